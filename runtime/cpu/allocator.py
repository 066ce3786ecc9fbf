"""glibc malloc's policy for the runtime's temporaries (Linux with glibc; a no-op elsewhere), process-wide.

A prefill allocates and frees many temporaries of a few MB to tens of MB (the experts' gathered rows and their
products, the attention scores). glibc maps a block above its mmap threshold anew, and faults its pages in, each
time; the threshold moves as blocks are freed (up to 32 MB), so how often that happens depends on the order of a
process's frees and differs from one process to the next. Measured on tiny-moe (2,048-token prefill, fp32, one
thread, `run --repeat 7`, four processes): 626k, 661k, 781k and 962k minor faults, and the experts' part took
83.6, 87.1, 98.5 and 108.9 ms accordingly, though the same work.

- `reuse_temporaries` (full-width models): the threshold fixed at its ceiling and the heap's top kept, so every
  block up to 32 MB is reused from the heap, as a timing loop (`profile-device`) reuses it once its threshold has
  risen: the experts then took 81.4-86.3 ms in four processes, at a peak RSS 3% higher (0.67-0.69 GB, against
  0.62-0.67).
- `return_temporaries_to_the_os` (packed weights, where peak memory is the point): every block over 1 MB back to
  the OS when freed.
- `temporaries_returned`: the latter for a block, the policy before it restored after.
- `release_freed_heap`: the heap's free pages back to the OS now.
- `bound_primitive_cache`: the compute library's own cache of compiled matmuls kept small.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_CEILING = 32 << 20  # glibc's largest mmap threshold on 64-bit hosts (DEFAULT_MMAP_THRESHOLD_MAX)
DEFAULT_TRIM = 128 << 10  # glibc's default trim threshold
DEFAULT_MMAP = 128 << 10  # glibc's default mmap threshold
ONEDNN_PRIMITIVES = 128  # compiled primitives oneDNN keeps (its default: 1,024)


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _mallopt(*settings: tuple[int, int]) -> None:
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return
    for param, value in settings:
        libc.mallopt(param, value)


_policy: list[Callable[[], None]] = []  # the policy set last, if any (`temporaries_returned` restores it)


def reuse_temporaries() -> None:
    """Blocks up to 32 MB reused from the heap, never trimmed from it (the module docstring)."""
    _policy[:] = [reuse_temporaries]
    _mallopt((M_MMAP_THRESHOLD, MMAP_CEILING), (M_TRIM_THRESHOLD, 1 << 30))


def return_temporaries_to_the_os() -> None:
    """Packed weights are dequantized per call: many temporaries of a few MB. glibc's malloc raises its mmap
    threshold as such blocks are freed and then keeps later ones in its heap, which only grows (a 2-layer
    Qwen3-30B-A3B twin at 4 bits: 2.9 GB peak RSS against 1.7 GB with the threshold fixed at 1 MB). Fixing it
    returns each one to the OS when freed (and the heap's top is trimmed as by default)."""
    _policy[:] = [return_temporaries_to_the_os]
    _mallopt((M_MMAP_THRESHOLD, 1 << 20), (M_TRIM_THRESHOLD, DEFAULT_TRIM))


@contextmanager
def temporaries_returned() -> Iterator[None]:
    """`return_temporaries_to_the_os` for the block, the policy before it restored after (glibc's defaults where none
    was set): for work whose peak matters and whose time is not measured (the fidelity gate). Under
    `reuse_temporaries` the heap kept the gate's freed blocks, which pinned pages prompt after prompt and left its
    peak to where each process's blocks happened to fall (tiny-moe, 2 candidates: 183-269 MiB over the loaded
    model across processes; 203-220 returned)."""
    previous = list(_policy)
    return_temporaries_to_the_os()
    try:
        yield
    finally:
        if previous:
            previous[0]()
        else:
            _policy.clear()
            _mallopt((M_MMAP_THRESHOLD, DEFAULT_MMAP), (M_TRIM_THRESHOLD, DEFAULT_TRIM))


def release_freed_heap() -> None:
    """Give the heap's free pages back to the OS now (glibc's malloc_trim). Between prefill chunks: allocations
    under the mmap threshold live in the heap, and the few kept per chunk (routing records, a cache's growth) pin
    the pages freed around them, so the heap's high-water mark grows chunk after chunk (a 2-layer Qwen3-30B-A3B
    twin at 4 bits, 20 chunks of calibrate: 1.89 GB peak RSS, 1.83 trimmed per chunk). MLX's buffer cache first,
    where MLX is loaded: on its CPU device its buffers are malloc's blocks, and it keeps those it freed for reuse
    (tiny-moe's gate: 32 MiB after the first candidate on mlx-exact, held through the next ones' forwards)."""
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        mx.clear_cache()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def bound_primitive_cache() -> None:
    """oneDNN (torch's bf16 matmuls on x86, AMX's included) keeps a compiled primitive per shape, 1,024 by default,
    and an expert's rows differ from call to call in a prefill, so its cache fills with them: anonymous memory grew
    by about 90 MiB per 1,024-token prompt of the fidelity gate on a 2-layer Qwen3-30B-A3B twin at 4 bits, no tensor
    alive more (3,511 MiB peak over 4 prompts; 3,325 with 128 kept, 3,185 with none; a 2,048-token prefill 0.14-0.16
    GB smaller, and tiny-moe's decode 240.4 against 244.1 tok/s in 3 interleaved pairs, within their spread).
    oneDNN reads it when it makes its first primitive; a user's own setting stands."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVES))
