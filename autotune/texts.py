"""Text sources for every `--text` option: a file path, or a built-in name (`builtin:...`)."""
from __future__ import annotations

from pathlib import Path

from runtime.errors import NpumoeError

BUILTIN_PREFIX = "builtin:"


def read_text(spec: str) -> str:
    """Return the text named by `spec`: a built-in name or a UTF-8 file path."""
    if spec.startswith(BUILTIN_PREFIX):
        raise NpumoeError(f"unknown built-in text {spec!r}")
    try:
        return Path(spec).read_text(encoding="utf-8")
    except OSError as e:
        raise NpumoeError(f"cannot read text file {spec!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise NpumoeError(f"text file {spec!r} is not UTF-8") from None
