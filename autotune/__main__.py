"""`python -m autotune`: the same command as the `autotune` console script."""
import sys

from autotune.cli import main

if __name__ == "__main__":  # not in a process that multiprocessing spawns (it imports this as __mp_main__)
    sys.exit(main())
