"""Compiled Core ML packages, cached by digest: each package is compiled once per machine and macOS version, and every
later process (`run`, `generate`, `serve`) loads the same `.mlmodelc` instead of compiling it again.

The digest covers what the compiled model depends on: the package's model description and program (`model.mlmodel`,
small, its build metadata with every function's weight digest included), the names and sizes of its weight files, and
the coremltools and macOS versions (Core ML's compiler comes with the OS). Compiling writes into a folder beside the
cache entry that is renamed into place whole, so a process cut short leaves no half entry and nothing in the system's
temporary folder (Core ML's own output there is moved out by coremltools' `compile_model`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from runtime.fileio import cache_root
from runtime.macos import macos_version

log = logging.getLogger("npumoe")


def default_compiled_dir() -> Path:
    return cache_root() / "coreml-compiled"


def package_digest(package: str | os.PathLike) -> str:
    """sha256 of what a compiled package depends on (see the module's note); reads the weights' sizes, not bytes."""
    import coremltools as ct

    root = Path(package)
    h = hashlib.sha256(f"coremltools {ct.__version__} macos {macos_version()}\0".encode())
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        rel = str(p.relative_to(root))
        h.update(rel.encode() + b"\0")
        if p.suffix == ".bin":  # weights: their size (their content is tied by the metadata's weight digests)
            h.update(str(p.stat().st_size).encode())
        else:
            h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:40]


def compiled_package(package: str | os.PathLike, cache: str | os.PathLike | None = None) -> tuple[str, bool]:
    """(path of `package` compiled, whether it was found in the cache): compiled with coremltools on a miss."""
    import coremltools as ct

    cache = Path(cache) if cache is not None else default_compiled_dir()
    entry = cache / f"{package_digest(package)}.mlmodelc"
    if entry.is_dir():
        log.info("Core ML package %s: compiled model reused from %s (not compiled again)", package, entry)
        return str(entry), True
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=cache))
    try:
        ct.models.utils.compile_model(str(package), str(staging / entry.name))
        try:
            os.replace(staging / entry.name, entry)
        except OSError:
            if not entry.is_dir():  # else another process compiled the same package first: keep that one
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("Core ML package %s: compiled into %s", package, entry)
    return str(entry), False
