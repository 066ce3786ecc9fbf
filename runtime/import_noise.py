"""Known, harmless lines that third-party imports print, kept out of our stderr by their message, so a command's own
one-line error (or a warning a user can act on) is what stderr carries. Nothing else is silenced: a new or unknown
message still shows.

- coremltools, at import (its "coremltools" logger): scikit-learn and torch versions it has not tested (npumoe
  converts no scikit-learn model, and `autotune doctor` checks torch against what npumoe declares), and, off macOS
  only, one "Failed to load _ML...Proxy" line per Core ML runtime class (there is no Core ML runtime off macOS; on a
  Mac the same line means a broken install, and shows).
- coreai-torch, at import: its torch validation stamp (the `coreai` extra pins the versions measured together).
"""
from __future__ import annotations

import logging
import re
import sys
import warnings

HARMLESS_LOGS = {"coremltools": (
    r"^scikit-learn version \S+ is not supported\. .*Disabling scikit-learn conversion API\.",
    r"^Torch version \S+ has not been tested with coremltools\.",
)}
HARMLESS_OFF_MACOS = {"coremltools": (r"^Failed to load _ML\w+Proxy: No module named 'coremltools\.libcoremlpython'",)}
HARMLESS_WARNINGS = (r"coreai-torch has only been validated with torch",)


class KnownHarmless(logging.Filter):
    """Drops a logger's records whose message matches one of `patterns`."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


def filter_import_noise() -> None:
    """Install the filters (once): on the named loggers, and as `warnings` filters by message."""
    patterns = dict(HARMLESS_LOGS)
    if sys.platform != "darwin":
        for name, extra in HARMLESS_OFF_MACOS.items():
            patterns[name] = patterns.get(name, ()) + extra
    for name, found in patterns.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, KnownHarmless) for f in logger.filters):
            logger.addFilter(KnownHarmless(found))
    for message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
