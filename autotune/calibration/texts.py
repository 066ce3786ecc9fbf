"""Text sources for every `--text` option: a file path, or a built-in name (`builtin:...`).

The built-in texts are derived at run time from the running Python installation (no download, nothing
committed), and are deterministic for a given Python version:
- `builtin:pydoc-calib` / `builtin:pydoc-heldout`: a fixed disjoint split of `pydoc_data.topics` by topic.
  A topic goes to held-out when sha256(key) % 4 == 0, so a key's side never changes across Python versions.
  Topics quote each other (the "compound" topic holds the "if" statement's), so the calibration side also
  drops every paragraph that occurs in a held-out topic: no held-out paragraph is in calibration/training.
- `builtin:stdlib-code`: a fixed selection of standard-library `.py` files (a shifted domain: code, not
  prose), chosen by sha256(relative path) % 16 == 0, so the selection is also stable across versions.
The embedded model `tiny-moe` was trained without `pydoc-heldout` and without the files that
`stdlib-code` selects (scripts/train_tiny_moe.py uses the helpers below to leave them out).
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Iterator

from runtime.errors import NpumoeError

BUILTIN_PREFIX = "builtin:"
DEFAULT_CALIB_TEXT = "builtin:pydoc-calib"
DEFAULT_EVAL_TEXT = "builtin:pydoc-heldout"
SHIFTED_TEXT = "builtin:stdlib-code"
BUILTIN_TEXTS: dict[str, str] = {
    DEFAULT_CALIB_TEXT: "Python's pydoc topics (calibration split, ~75% of topics)",
    DEFAULT_EVAL_TEXT: "Python's pydoc topics (held-out split, ~25% of topics, not in tiny-moe's training)",
    SHIFTED_TEXT: "a fixed selection of standard-library source files (shifted domain, not in training)",
}

_HELDOUT_MODULUS = 4
_CODE_MODULUS = 16
# stdlib-code is capped so that a pass over it stays quick on a CPU; the selection itself is not capped.
STDLIB_CODE_MAX_CHARS = 300_000
# Parts of the stdlib tree that are not ordinary library code (tests, tables, installers, third-party).
_EXCLUDED_PARTS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
                   "ensurepip", "encodings", "__pycache__", "idle_test"}
_SEPARATOR = "\n\n"
PIECE_CHARS = 1 << 20  # texts are tokenised a piece at a time: a large file costs what one piece costs


def _bucket(name: str, modulus: int) -> int:
    return int(hashlib.sha256(name.encode("utf-8")).hexdigest(), 16) % modulus


def pydoc_topics() -> dict[str, str]:
    """All pydoc topics of the running Python, keyed by topic name."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise NpumoeError("this Python installation has no pydoc_data.topics; pass --text FILE instead") from None
    return dict(topics)


def is_heldout_topic(key: str) -> bool:
    return _bucket(key, _HELDOUT_MODULUS) == 0


def pydoc_split() -> tuple[list[str], list[str]]:
    """(calibration topic keys, held-out topic keys), each sorted; disjoint and together all topics."""
    keys = sorted(pydoc_topics())
    return [k for k in keys if not is_heldout_topic(k)], [k for k in keys if is_heldout_topic(k)]


def _paragraphs(text: str) -> list[str]:
    return [p for p in text.strip().split(_SEPARATOR) if p.strip()]


def pydoc_documents(heldout: bool) -> list[str]:
    """One document per topic of a side of the split; calibration topics without held-out paragraphs."""
    topics = pydoc_topics()
    calib, held = pydoc_split()
    if heldout:
        return [topics[k].strip() for k in held]
    seen = {p for k in held for p in _paragraphs(topics[k])}
    docs = (_SEPARATOR.join(p for p in _paragraphs(topics[k]) if p not in seen) for k in calib)
    return [d for d in docs if d]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[str]:
    """Ordinary standard-library source files, as sorted POSIX paths relative to the stdlib root."""
    root = stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if any(p in _EXCLUDED_PARTS or p.startswith(("test_", "config-")) for p in parts):
            continue
        files.append(path.relative_to(root).as_posix())
    return sorted(files)


def is_stdlib_code_file(relpath: str) -> bool:
    """Whether a stdlib file (relative POSIX path) belongs to `builtin:stdlib-code` (kept out of training)."""
    return _bucket(relpath, _CODE_MODULUS) == 0


def stdlib_code_files() -> list[str]:
    return [f for f in stdlib_files() if is_stdlib_code_file(f)]


def _read_source(relpath: str) -> str:
    return (stdlib_root() / relpath).read_text(encoding="utf-8", errors="replace")


def builtin_text(name: str) -> str:
    """The text of a built-in name (with or without the `builtin:` prefix)."""
    spec = name if name.startswith(BUILTIN_PREFIX) else BUILTIN_PREFIX + name
    if spec in (DEFAULT_CALIB_TEXT, DEFAULT_EVAL_TEXT):
        return _SEPARATOR.join(pydoc_documents(heldout=spec == DEFAULT_EVAL_TEXT))
    if spec == SHIFTED_TEXT:
        files = stdlib_code_files()
        if not files:
            raise NpumoeError(f"no standard-library sources found under {stdlib_root()} for {spec}")
        return _SEPARATOR.join(_read_source(f).strip() for f in files)[:STDLIB_CODE_MAX_CHARS]
    raise NpumoeError(f"unknown built-in text {spec!r}; choose from {', '.join(BUILTIN_TEXTS)} or a file path")


def read_text(spec: str) -> str:
    """Return the text named by `spec`: a built-in name or a UTF-8 file path."""
    return "".join(iter_text(spec, piece_chars=None))


def _whole_lines(pieces: Iterator[str]) -> Iterator[str]:
    """Re-cut pieces so each ends at a line end (a token never spans two pieces when lines don't share one)."""
    rest = ""
    for piece in pieces:
        piece = rest + piece
        cut = piece.rfind("\n") + 1
        if cut == 0:
            rest = piece
            continue
        rest = piece[cut:]
        yield piece[:cut]
    if rest:
        yield rest


def iter_text(spec: str, piece_chars: int | None = PIECE_CHARS) -> Iterator[str]:
    """The text named by `spec` in pieces of about `piece_chars` characters cut at line ends (None: one piece),
    read from the file as they are asked for: a consumer that stops early never reads the rest."""
    if spec.startswith(BUILTIN_PREFIX):
        text = builtin_text(spec)
        step = piece_chars or max(1, len(text))
        yield from _whole_lines(text[i:i + step] for i in range(0, len(text), step))
        return
    try:
        with open(spec, encoding="utf-8") as f:
            if piece_chars is None:
                yield f.read()
                return
            yield from _whole_lines(iter(lambda: f.read(piece_chars), ""))
    except OSError as e:
        raise NpumoeError(f"cannot read text file {spec!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise NpumoeError(f"text file {spec!r} is not UTF-8") from None
