"""`python -m autotune`: the same command as the `autotune` console script."""
import sys

from .cli import main

sys.exit(main())
