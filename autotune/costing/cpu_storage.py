"""What each CPU storage of the experts costs the exact path, relative to the bf16 the cost model was fitted on.

Storages (`runtime.cpu.cpu_weights`): `bf16` (as loaded), `int8` (per output channel), `int4:<group>` (per group of
inputs). A storage's price is a factor on the CPU's expert compute per row count (the rows one expert's call gets):

- measured, where the profile has `kernel_records` (`profile-device`): the storage's fastest kernel over bf16's at
  the nearest measured row count (`kernel_choice.fastest_kernel`), on the measured shape nearest the model's;
- derived otherwise (e.g. the published profile, which times no int kernel): the cpu-exact fit's own rates, with
  the weights streamed at the storage's bytes (packed kernels at the fit's GFLOP rate) or dequantized to full width
  first (reading the codes and writing full-width weights at its MB rate, then the bf16 matmul), whichever is less.

Between measured row counts the factor is interpolated on log rows; past them it is the end's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autotune.costing.kernel_choice import DECODE_ROWS, PREFILL_ROWS, fastest_kernel, kernel_rows
from autotune.costing.memory import storage_bytes_per_weight
from runtime.backends import EXACT
from runtime.cpu.cpu_weights import KERNEL_ROWS
from runtime.errors import NpumoeError

SEARCHED = ("bf16", "int8", "int4:64")  # what a search under --memory-gb chooses among, widest first
INT4_GROUPS = (32, 64, 128, 256)
ROWS = (*DECODE_ROWS, *PREFILL_ROWS)


def parse_storage(text: str) -> tuple[str, int | None]:
    """`bf16`, `int8` or `int4[:group]` as (kind, group size: int4 only, default 64); anything else refused."""
    kind, _, group = str(text).partition(":")
    if kind in ("bf16", "int8") and not group:
        return kind, None
    if kind == "int4" and (not group or (group.isdigit() and int(group) in INT4_GROUPS)):
        return kind, int(group or 64)
    raise NpumoeError(f"--cpu-weights {text}: not a CPU storage (bf16, int8, or int4[:group] with a group of "
                      f"{', '.join(map(str, INT4_GROUPS))})")


def load_options(storage: str | None) -> dict:
    """`runtime.load`'s / `load_model`'s keyword arguments for `--cpu-weights` (none when not given)."""
    if storage is None:
        return {}
    kind, group = parse_storage(storage)
    return {"cpu_weights": kind, "group_size": group or 64}


def storage_name(kind: str, group: int | None) -> str:
    return f"int4:{group or 64}" if kind == "int4" else kind


@dataclass(frozen=True)
class StoragePrice:
    """A storage's factor on the CPU's expert compute (its ms over bf16's) at `rows` rows per expert call."""
    storage: str
    rows: tuple[int, ...]
    factors: tuple[float, ...]
    kernels: tuple[str, ...]  # the kernel the factor is of, per row count
    source: str  # "measured" or "derived", with what from

    @property
    def key(self) -> tuple:
        return self.storage, self.factors

    def factor(self, rows) -> np.ndarray:
        m = np.maximum(np.asarray(rows, dtype=np.float64), 1.0)
        return np.interp(np.log(m), np.log(np.asarray(self.rows, dtype=np.float64)), self.factors)

    def to_json(self) -> dict:
        return {"storage": self.storage, "source": self.source,
                "factor_vs_bf16": {str(r): round(f, 4) for r, f in zip(self.rows, self.factors)},
                "kernel": dict(zip(map(str, self.rows), self.kernels))}


def _nearest_shape(records: list[dict], hidden: int) -> int | None:
    """The measured expert shape (hidden size) nearest the model's on a log scale; None where none is measured."""
    shapes = {r["hidden"] for r in records if r.get("kind") == "expert_kernel"}
    return min(shapes, key=lambda h: abs(math.log(h) - math.log(hidden))) if shapes else None


def _measured(records: list[dict], storage: str, hidden: int) -> StoragePrice | None:
    near = _nearest_shape(records, hidden)
    if near is None:
        return None
    try:
        picks = [(fastest_kernel(records, storage, m, near), fastest_kernel(records, "bf16", m, near)[1])
                 for m in ROWS]
    except KeyError:
        return None
    return StoragePrice(storage, ROWS, tuple(ms / bf16 for (_, ms), bf16 in picks), tuple(k for (k, _), _ in picks),
                        f"measured: the profile's kernel_records (hidden {near}), fastest kernel over bf16's")


def _derived(cost, storage: str, hidden: int, ffn: int) -> StoragePrice:
    kind, group = parse_storage(storage)
    fit = cost.backend_model(EXACT)
    rate = storage_bytes_per_weight(kind, group or 64, fit.dtype_bytes, hidden)
    weights_mb = 3.0 * hidden * ffn / 1e6
    full = np.asarray(cost.ffn_ms(EXACT, np.asarray(ROWS), hidden, ffn), dtype=np.float64)
    packed = full - fit.ms_per_mb * weights_mb * (fit.dtype_bytes - rate)
    dequant = full + fit.ms_per_mb * weights_mb * (rate + fit.dtype_bytes)
    best = np.minimum(packed, dequant)
    return StoragePrice(storage, ROWS, tuple(float(f) for f in best / np.maximum(full, 1e-12)),
                        tuple("packed" if p <= d else "dequant" for p, d in zip(packed, dequant)),
                        f"derived: {EXACT}'s fitted GFLOP and MB rates, weights at {rate:.3f} bytes each "
                        "(no kernel_records in the profile)")


def packed_checkpoint_price(cost, storage: str, hidden: int, ffn: int) -> StoragePrice:
    """The experts of a checkpoint kept packed as stored (`mlx-<bits>bit-g<group>`, `ModelSize.storage`): the exact
    path dequantizes each expert it runs to full width on every call (`runtime.cpu.quantized.QuantizedExperts`:
    again each chunk, since holding them all widened would exceed the predicted memory). Its price is bf16's plus
    one elementwise pass over the expert's full-width weights (`dequant_ms`)."""
    full = np.asarray(cost.ffn_ms(EXACT, np.asarray(ROWS), hidden, ffn), dtype=np.float64)
    dequant = full + dequant_ms(cost, EXACT, 3 * hidden * ffn, hidden)
    return StoragePrice(storage, ROWS, tuple(float(f) for f in dequant / np.maximum(full, 1e-12)),
                        ("dequant",) * len(ROWS), f"derived: {EXACT}'s elementwise fit, each expert dequantized "
                        "per call")


def dequant_ms(cost, backend: str, weights: int, width: int) -> float:
    """Dequantizing `weights` packed weights (rows of `width`) to full width: priced as one elementwise pass over
    them (the fit's RMS norm of that many elements; measured on the Qwen3 twin's 4-bit experts, 2048 x 2304 weights
    a call: 6-8 ms against this pass's 4.8 ms)."""
    return float(cost.norm_ms(backend, weights / width, width, width))


def storage_price(cost, records: list[dict], storage: str, hidden: int, ffn: int) -> StoragePrice | None:
    """`storage`'s price on this profile (None for bf16: the cost model's own)."""
    kind, group = parse_storage(storage)
    if kind == "bf16":
        return None
    name = storage_name(kind, group)
    return _measured(records, name, hidden) or _derived(cost, name, hidden, ffn)


def planned_kernels(records: list[dict], storage: str, hidden: int) -> tuple[dict[str, int] | None, str]:
    """The row count from which each kernel of `storage` runs (the plan's `cpu_weights.kernel_rows`; None for
    bf16), and where it comes from: the fastest kernel per measured row range in the profile's `kernel_records`
    (the shape nearest the model's), else the runtime's defaults."""
    kind, group = parse_storage(storage)
    if kind == "bf16":
        return None, "bf16: one matmul on the weights as loaded"
    near = _nearest_shape(records, hidden)
    try:
        rows = kernel_rows(records, storage_name(kind, group), near) if near is not None else {}
    except KeyError:  # the profile measured this kind at another int4 group
        rows = {}
    if rows:
        return rows, f"measured: the fastest kernel per row range in the profile's kernel_records (hidden {near})"
    return dict(KERNEL_ROWS[kind]), f"the runtime's defaults: the profile measured no {storage_name(kind, group)} " \
        "kernel"
