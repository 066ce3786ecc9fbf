"""What `autotune build` wraps around the converter: its progress bars, and a temporary folder of its own for
coremltools' scratch packages."""
from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


def progress_factory(enabled: bool):
    if not enabled:
        return None
    import sys

    from tqdm import tqdm

    return lambda stage, total: tqdm(total=total, desc=stage, unit="fn", file=sys.stderr, dynamic_ncols=True)


@contextmanager
def private_tempdir() -> Iterator[None]:
    """Point `tempfile` at a folder of our own for the block and remove it after, interrupted or not."""
    previous = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="npumoe-build-") as d:
        tempfile.tempdir = d
        try:
            yield
        finally:
            tempfile.tempdir = previous
