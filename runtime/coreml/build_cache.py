"""Checksums for the converted-function cache of `autotune build`: an entry (a single-function .mlpackage folder)
is renamed into place whole, then sealed with `<entry>.sha256`; an entry whose files no longer match (a disk
error, a hand edit, a build cut short before sealing) is removed, reported in one line, and rebuilt."""
from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

from runtime.fileio import atomic_write_bytes

log = logging.getLogger("npumoe.build_cache")


def tree_digest(folder: Path) -> str:
    """sha256 over every file of `folder`: its path relative to the folder and its bytes, in sorted order."""
    h = hashlib.sha256()
    for p in sorted(q for q in folder.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(folder)).encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def _checksum_file(entry: Path) -> Path:
    return entry.with_name(entry.name + ".sha256")


def seal(entry: Path) -> None:
    """Record the checksum of a freshly stored entry."""
    atomic_write_bytes(_checksum_file(entry), (tree_digest(entry) + "\n").encode())


def usable(entry: Path) -> bool:
    """True if `entry` is in the cache and whole. A corrupt or unsealed entry is removed (and said so once on
    stderr through logging), so the caller converts the function again."""
    checksum = _checksum_file(entry)
    if not entry.is_dir() or entry.is_symlink():
        if not (entry.exists() or entry.is_symlink()):
            return False
        why = "is not a package folder"  # a file (or a link) where the converted function belongs
    else:
        try:
            want = checksum.read_text().strip()
        except (OSError, UnicodeDecodeError):
            want = None
        if want == tree_digest(entry):
            return True
        why = "has no checksum" if want is None else "is corrupt (checksum mismatch)"
    log.warning(f"build cache entry {entry} {why}; rebuilding it")
    for path in (entry, checksum):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return False
