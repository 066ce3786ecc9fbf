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
- `bound_primitive_cache`: the compute library's own caches of compiled matmuls kept small; `primitive_cache_bytes`
  what they hold at most, and `matmuls_through_onednn` whether torch's matmuls of a dtype go through them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_CEILING = 32 << 20  # glibc's largest mmap threshold on 64-bit hosts (DEFAULT_MMAP_THRESHOLD_MAX)
DEFAULT_TRIM = 128 << 10  # glibc's default trim threshold
DEFAULT_MMAP = 128 << 10  # glibc's default mmap threshold
ONEDNN_PRIMITIVES = 128  # compiled primitives oneDNN keeps (its default: 1,024), and as many in ideep's cache
# What one cached primitive holds (its compiled code and descriptors), whatever the matmul's shape: measured on this
# Linux x86-64 host (torch 2.13, oneDNN 3.12, bf16) as 0.28 MiB per entry at saturation, for tiny-moe's 256 x 256
# experts and Qwen3-30B-A3B's 2048 x 768 alike (1,024 row counts through caches of 16, 128 and 1,024 entries).
PRIMITIVE_BYTES = int(0.28 * 2**20)


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
    """torch's bf16 matmuls on x86 (AMX's included) go through two caches of compiled primitives keyed by shape:
    oneDNN's own (1,024 by default) and, in front of it, ideep's (torch's binding to oneDNN; `LRU_CACHE_CAPACITY`,
    1,024 by default). An expert's rows differ from call to call in a prefill, so both fill with its row counts,
    PRIMITIVE_BYTES an entry, no tensor alive more: on a 2-layer Qwen3-30B-A3B twin at 4 bits, 3,511 MiB peak over 4
    prompts of the fidelity gate with oneDNN's at 1,024, 3,325 at 128, 3,185 with none; on tiny-moe in bf16, with
    oneDNN's at 128, the main job's gate peaked at 812 MiB for 596 predicted, its heap's bytes in use 181 -> 428 MiB
    over 8 prompts and still growing. Both at ONEDNN_PRIMITIVES, that gate's heap grows 68 MiB in its first
    prompt and not after (665 MiB peak); tiny-moe's timed prefill (`run --repeat 5`, cpu-exact, bf16) spent 90.6 and
    90.5 ms on its experts with ideep's at 1,024, 81.7 and 79.9 at 128 (interleaved, shared host), and its decode
    stayed within its spread with oneDNN's at 128 (240.4 against 244.1 tok/s, 3 interleaved pairs). Each library
    reads its setting once, at its first primitive; a user's own setting stands (ideep's crashes at 0: 1 or more)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVES))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(ONEDNN_PRIMITIVES))


def primitive_cache_bytes() -> int:
    """What the two caches of compiled primitives hold at most in this process (`bound_primitive_cache`): their
    entries, as set in the environment (the bound where unset), at PRIMITIVE_BYTES each."""
    entries = sum(int(os.environ.get(name) or ONEDNN_PRIMITIVES)
                  for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"))
    return entries * PRIMITIVE_BYTES


def matmuls_through_onednn(dtype: torch.dtype) -> bool:
    """torch computes `dtype`'s matmuls on this host through oneDNN (and its caches): bf16 or fp16 where oneDNN has
    kernels for it (x86 with AVX-512 or AMX); float32 goes to the BLAS, and a host without those kernels computes
    16-bit floats in torch's own loops."""
    import torch

    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False
