"""The dtype `--dtype auto` computes in on this host: the checkpoint's own, except for a half-precision checkpoint
(bf16, fp16) on a host whose torch computes that dtype's matmuls far slower than float32 while the model's float32
weights fit in memory; there float32 is faster and exact. A CPU without bf16 instructions emulates them in its
kernels: on an AVX2-only AMD EPYC a 512-token bench layer took 3,457 ms in bf16 against 692 in float32, and a
tiny-moe decode step of 8 rows 24-25 ms against 19; torch's macOS wheel is built without BFDOT (a bf16 `bmm` took
971 ms against 217 in float32, pytorch #151934). A host with bf16 matmul instructions (AMX, AVX512-BF16) keeps the
checkpoint's dtype, and so does any checkpoint whose float32 copy would not fit."""
from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import torch

from runtime.errors import NpumoeError
from runtime.loading.model_config import DTYPE_CHOICES, DTYPES, mlx_quantization, stored_dtype

SLOWER = 1.5  # a half-precision matmul this many times float32's time or more: emulated here
PROBE_MNK = (64, 256, 256)  # compute-bound; 40 ms in all where emulated (35-106x float32 on the AVX2 host)
PROBE_RUNS = 5
FIT_SHARE = 0.5  # float32 weights at most this share of physical memory (the rest: activations, KV cache, the OS)
HALF = (torch.bfloat16, torch.float16)


@functools.cache
def half_over_float(dtype: torch.dtype) -> float:
    """This host's `dtype` matmul time over float32's at PROBE_MNK, on one thread (the fastest of PROBE_RUNS each,
    after one untimed: what the kernel costs, not what a busy moment does). One thread whatever the run's: what the
    kernel's instructions decide, while on two threads beside another busy process float32's threads waited on each
    other (0.4x bf16's time in 4 of 6 processes, against 41-47x alone)."""
    m, n, k = PROBE_MNK
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)

    def fastest(x: torch.Tensor, y: torch.Tensor) -> float:
        torch.mm(x, y)
        times = []
        for _ in range(PROBE_RUNS):
            t0 = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - t0)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            return fastest(a.to(dtype), b.to(dtype)) / fastest(a, b)
    finally:
        torch.set_num_threads(threads)


def physical_memory_bytes() -> int | None:
    """This machine's physical memory; None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def auto_dtype(stored: torch.dtype, parameters: int) -> tuple[torch.dtype, str]:
    """What `--dtype auto` computes a checkpoint stored in `stored` (one of HALF) with `parameters` weights in, and
    why."""
    own = dtype_name(stored)
    ratio = half_over_float(stored)
    if ratio < SLOWER:
        return stored, f"the checkpoint's own {own}: this host computes its matmuls in {ratio:.1f}x float32's time"
    memory, need = physical_memory_bytes(), 4 * parameters
    if memory is None or need > FIT_SHARE * memory:
        held = "unknown" if memory is None else f"{memory / 1e9:.1f} GB"
        return stored, (f"the checkpoint's own {own}, though this host computes its matmuls {ratio:.1f}x slower "
                        f"than float32: the float32 weights ({need / 1e9:.2f} GB) would take over {FIT_SHARE:.0%} "
                        f"of the memory ({held})")
    return torch.float32, (f"float32, not the checkpoint's {own}: this host computes {own} matmuls {ratio:.1f}x "
                           f"slower than float32 (emulated), and the float32 weights ({need / 1e9:.2f} GB) fit; "
                           f"--dtype {own} keeps the checkpoint's")


def auto_dtype_for(config: dict, parameters: Callable[[], int]) -> tuple[torch.dtype, str]:
    """What `--dtype auto` computes the model of `config` (config.json) in on this host, and why: a half-precision
    checkpoint as `auto_dtype` decides (`parameters`: its weight count, asked only then); any other, and an MLX
    checkpoint (held packed for its memory), in its own."""
    stored = stored_dtype(config)
    if stored in HALF and mlx_quantization(config) is None:
        return auto_dtype(stored, parameters())
    return stored, f"the checkpoint's own {dtype_name(stored)}"


def resolved_dtype(dtype: str | torch.dtype, auto: Callable[[], torch.dtype]) -> torch.dtype:
    """A `--dtype` value (auto | bfloat16 | float16 | float32, or a torch dtype) as the torch dtype to compute in
    (auto: what `auto` says)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto()
    if dtype not in DTYPES:
        raise NpumoeError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPE_CHOICES)}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` as `--dtype` spells it: bfloat16."""
    return str(dtype).removeprefix("torch.")
