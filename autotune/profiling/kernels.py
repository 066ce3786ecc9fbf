"""The CPU's expert kernels per storage kind, timed at decode and prefill row counts (`profile-device`); the pick of
the fastest one per (storage, rows) from those records is `autotune.costing.kernel_choice`'s.

Storage kinds and their kernels (`runtime.cpu.cpu_weights`): `bf16` (`dense`: one matmul on the weights as stored),
`int8` and `int4` with its group size (`packed`: torch's int kernels; `dequant`: dequantize the expert, one matmul;
`int_mm`, int8 only: the rows quantized to int8 on the fly, one int8 matmul; `int_mm_gate_up`, int8 only: int_mm for
the gate/up projection, dequant for the down projection).
The records are kept in the profile's optional top-level `kernel_records` list (docs/formats.md): the cost model's
`records` stay as they were, so older profiles load and older readers skip them.
"""
from __future__ import annotations

import torch

from autotune.costing.kernel_choice import DECODE_ROWS, PREFILL_ROWS, storage_kind
from autotune.profiling.cache_state import Call, ForwardCaches
from autotune.profiling.settings import Settings
from autotune.profiling.timing import time_in_forward

STORAGES = ("bf16", "int8", "int4:64")  # kind[:group size]


def _expert_module(hidden: int, ffn: int, storage: str) -> torch.nn.Module:
    from autotune.profiling.callers import make_experts
    from runtime.cpu.cpu_weights import quantize_experts

    module = make_experts(hidden, ffn, 2).to(torch.bfloat16)
    kind, group = storage_kind(storage)
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
        kind, group = storage_kind(storage)
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
