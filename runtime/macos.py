"""Is this macOS, which version, and is a macOS-only facility (Core ML prediction, energy counters) importable: the
one place that asks, for the runtime's backends, the profiler and the doctor."""
from __future__ import annotations

import importlib
import platform
import sys


def on_macos() -> bool:
    return sys.platform == "darwin"


def macos_version() -> tuple[int, ...]:
    """(major, minor, patch) of macOS; () elsewhere."""
    try:
        return tuple(int(p) for p in platform.mac_ver()[0].split("."))
    except ValueError:
        return ()


def macos_module(module: str, not_macos: str, missing: str, ok: str) -> tuple[bool, str]:
    """(available, reason) for a macOS-only facility that needs `module` importable."""
    if not on_macos():
        return False, not_macos
    try:
        importlib.import_module(module)
    except ImportError:
        return False, missing
    return True, ok
