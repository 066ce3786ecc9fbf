"""The fastest CPU expert kernel per (storage, rows), picked from a profile's `kernel_records` (timed by
`autotune.profiling.kernels`): what the CPU storage's price (`cpu_storage`) and a plan's `kernel_rows` read."""
from __future__ import annotations

import math

# Rows of one expert's call: a decode step (1 token) and short spills, then prefill chunks' per-expert rows.
DECODE_ROWS = (1, 2, 4)
PREFILL_ROWS = (16, 64, 256)


def storage_kind(storage: str) -> tuple[str, int]:
    """`int4:32` as (kind, group size): the group 64 where none is given."""
    kind, _, group = storage.partition(":")
    return kind, int(group or 64)


def fastest_kernel(records: list[dict], storage: str, rows: int, hidden: int | None = None) -> tuple[str, float]:
    """(kernel, its measured ms) fastest for `storage` (`bf16`, `int8`, `int4[:group]`) at `rows` rows per expert,
    from a profile's `kernel_records`: at the measured row count nearest to `rows` on a log scale (of the shape
    `hidden`, else of any). Raises KeyError where the profile measured no kernel of that storage."""
    kind, group = storage_kind(storage)
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
    kind, _ = storage_kind(storage)
    counts = sorted({r["rows"] for r in records if r.get("kind") == "expert_kernel" and r["storage"] == kind})
    out: dict[str, int] = {}
    previous = None
    for rows in counts:
        kernel = fastest_kernel(records, storage, rows, hidden)[0]
        if kernel != previous:
            out[kernel] = rows if out else 0
            previous = kernel
    return out
