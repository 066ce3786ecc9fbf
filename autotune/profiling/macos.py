"""Probing macOS-only facilities (Core ML prediction, energy counters) without importing them elsewhere."""
from __future__ import annotations

import importlib
import platform


def macos_module(module: str, not_macos: str, missing: str, ok: str) -> tuple[bool, str]:
    """(available, reason) for a macOS-only facility that needs `module` importable."""
    if platform.system() != "Darwin":
        return False, not_macos
    try:
        importlib.import_module(module)
    except ImportError:
        return False, missing
    return True, ok
