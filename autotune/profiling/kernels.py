"""The CPU's expert kernels per storage kind, timed at decode and prefill row counts (`profile-device`), and the pick
of the fastest one per (storage, rows) from those records.

Storage kinds and their kernels (`runtime.cpu.cpu_weights`): `bf16` (`dense`: one matmul on the weights as stored),
`int8` and `int4` with its group size (`packed`: torch's int kernels; `dequant`: dequantize the expert, one matmul;
`int_mm`, int8 only: the rows quantized to int8 on the fly, one int8 matmul; `int_mm_gate_up`, int8 only: int_mm for
the gate/up projection, dequant for the down projection).
The records are kept in the profile's optional top-level `kernel_records` list (docs/formats.md): the cost model's
`records` stay as they were, so older profiles load and older readers skip them.
"""
from __future__ import annotations

import math

import torch

from autotune.profiling.cache_state import Call, ForwardCaches
from autotune.profiling.settings import Settings
from autotune.profiling.timing import time_in_forward

# Rows of one expert's call: a decode step (1 token) and short spills, then prefill chunks' per-expert rows.
DECODE_ROWS = (1, 2, 4)
PREFILL_ROWS = (16, 64, 256)
STORAGES = ("bf16", "int8", "int4:64")  # kind[:group size]


def _storage(storage: str) -> tuple[str, int]:
    kind, _, group = storage.partition(":")
    return kind, int(group or 64)


def _expert_module(hidden: int, ffn: int, storage: str) -> torch.nn.Module:
    from autotune.profiling.callers import make_experts
    from runtime.cpu.cpu_weights import quantize_experts

    module = make_experts(hidden, ffn, 2).to(torch.bfloat16)
    kind, group = _storage(storage)
    if kind != "bf16":
        quantize_experts(module, kind, group)
    return module


def kernel_records(s: Settings, hidden: int, ffn: int, shape: str) -> list[dict]:
    """One record per (storage, kernel, rows): the median ms of one expert's gated FFN on `rows` bf16 rows, its
    weights out of cache as a forward's layer leaves them."""
    from runtime.backends.protocol import expert_ffn
    from runtime.cpu.cpu_weights import KERNELS
    from runtime.errors import NpumoeError

    out, caches = [], ForwardCaches()
    for storage in STORAGES:
        try:
            module = _expert_module(hidden, ffn, storage)
        except NpumoeError:  # a shape the storage cannot hold (int4: sizes divisible by its group and by 64)
            continue
        kind, group = _storage(storage)
        store = getattr(module, "npumoe_weights", None)
        for kernel in ("dense",) if kind == "bf16" else KERNELS[kind]:
            if store is not None:
                store.kernel_rows = {kernel: 0}  # this kernel at every row count
            for rows in (*DECODE_ROWS, *PREFILL_ROWS):
                x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
                timed = time_in_forward(Call(lambda: expert_ffn(module, 0, x), (x,)), s, caches=caches)
                out.append({"kind": "expert_kernel", "backend": "cpu-exact", "shape": shape, "hidden": hidden,
                            "ffn": ffn, "storage": kind, "group_size": group if kind == "int4" else None,
                            "kernel": kernel, "rows": rows, **timed})
    return out


def fastest_kernel(records: list[dict], storage: str, rows: int, hidden: int | None = None) -> tuple[str, float]:
    """(kernel, its measured ms) fastest for `storage` (`bf16`, `int8`, `int4[:group]`) at `rows` rows per expert,
    from a profile's `kernel_records`: at the measured row count nearest to `rows` on a log scale (of the shape
    `hidden`, else of any). Raises KeyError where the profile measured no kernel of that storage."""
    kind, group = _storage(storage)
    mine = [r for r in records if r.get("kind") == "expert_kernel" and r["storage"] == kind
            and (kind != "int4" or r.get("group_size") == group) and (hidden is None or r["hidden"] == hidden)]
    if not mine:
        raise KeyError(f"no kernel records for {storage}")
    nearest = min({r["rows"] for r in mine}, key=lambda m: abs(math.log(m) - math.log(max(1, rows))))
    best = min((r for r in mine if r["rows"] == nearest), key=lambda r: r["median_ms"])
    return best["kernel"], float(best["median_ms"])


def kernel_rows(records: list[dict], storage: str, hidden: int | None = None) -> dict[str, int]:
    """`runtime.cpu.cpu_weights.QuantizedCpuExperts.kernel_rows` from the records: each kernel from the measured row
    count at which it becomes the fastest (the first from 0); a kernel that wins two separate ranges runs from the
    last one's start."""
    kind, _ = _storage(storage)
    counts = sorted({r["rows"] for r in records if r.get("kind") == "expert_kernel" and r["storage"] == kind})
    out: dict[str, int] = {}
    previous = None
    for rows in counts:
        kernel = fastest_kernel(records, storage, rows, hidden)[0]
        if kernel != previous:
            out[kernel] = rows if out else 0
            previous = kernel
    return out
