"""What a scripts/ proof run needs beyond the project's own dependencies: checked before any long step, so a fresh
set-up learns the extra to install in one line (exit 2) instead of a traceback minutes in."""
from __future__ import annotations

import importlib.util
import sys

EXTRA = "pip install -e '.[bench]'"


def require(script: str, *modules: str) -> None:
    """Exit 2 with one line naming the missing `modules` (import names) and the extra that brings them."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        print(f"{script}: needs {', '.join(missing)}: {EXTRA}", file=sys.stderr)
        sys.exit(2)
