"""`python -m autotune`: the same command as the `autotune` console script."""
import sys

from autotune.cli import main

sys.exit(main())
