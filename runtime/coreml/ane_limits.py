"""The Neural Engine's limits on one program (a package function) and one package, each with its source.

The search (autotune/searching/scoring.py) scores a group past any of them as a hard-limit violation; the builder
(runtime/coreml/converter.py) refuses such a group before converting anything and splits a plan whose weights exceed
one package into several. Sources are listed in docs/ane-facts.md; the figures marked unverified there are
community measurements, not Apple documentation.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from runtime.errors import NpumoeError

# Per tensor axis: channels <= 65,536 (width/height <= 16,384). A group's packed slots are one axis of its input.
MAX_AXIS = 65_536
# MIL ops per program: the ANE compiler gives up around 18-21K ops; a margin below that.
MAX_OPS = 18_000
# What the builder emits per expert (consts not counted): slice rows, linear, 2 channel slices, silu, mul,
# linear; plus one concat per function.
OPS_PER_EXPERT = 7
OPS_PER_FUNCTION = 1
# Baked weights per program: the ANE compiler took ~1.5 GB and failed at 3.4 GB (ANEForge PR #45); past ~2 GB
# per file on macOS export succeeds and the output is broken (Anemll issue 28). 1.5 GB is what was seen to work.
FUNCTION_WEIGHT_BYTES = 1_500_000_000
# Weights per package (one weights file): ANEMLL keeps ~2 GB per file on macOS (Anemll issue 28), and compile
# time grows with program size (coremltools issue 1900: ~40 min for one 32-block program, ~7.7 min split).
PACKAGE_WEIGHT_BYTES = 2_000_000_000
# Weights the ANE holds mapped at once: about a 4 GiB address window per ANE (oMLX's measurements, as cited in
# docs/ane-facts.md). A run loads every function of its packages once and keeps it for its whole length, so the
# window bounds everything resident together: experts and dense functions (`resident_over_window`).
WINDOW_BYTES = 4 * 2**30
# Bytes per stored weight by the builder's --compress (fp16, int8 per channel, 4-bit palettes).
BYTES_PER_WEIGHT = {"none": 2.0, "int8": 1.0, "palettize4": 0.5}


@dataclass(frozen=True)
class Limit:
    """One limit on a program: the `Usage` field it bounds, its value, and what to change when past it."""
    what: str
    field: str
    limit: float
    change: str


# Every limit on one group's program, once: `Usage.over` (the builder's refusal) and `violation` (the search's
# measure, over arrays) both read this table. The weight limit is a parameter of the build (`--function-weight-mb`).
LIMITS = (
    Limit("packed slots (sum of capacities)", "slots", MAX_AXIS, "split the group or lower its capacities"),
    Limit("hidden size", "hidden", MAX_AXIS, "split the group or lower its capacities"),
    Limit("gate_up width (2 x expert FFN size)", "gate_up", MAX_AXIS, "split the group or lower its capacities"),
    Limit("MIL ops", "ops", MAX_OPS, "split the group into smaller groups"),
    Limit("weight bytes", "weight_bytes", FUNCTION_WEIGHT_BYTES,
          "split the group into smaller groups (fewer experts each) or compress its weights"),
)


def _bound(lim: Limit, function_weight_bytes: float) -> float:
    return function_weight_bytes if lim.field == "weight_bytes" else lim.limit


def violation(usage: dict[str, Any], function_weight_bytes: float = FUNCTION_WEIGHT_BYTES) -> Any:
    """How far past the limits, summed as fractions of each limit (0 when within all), of one program or many:
    `usage` maps `Usage` fields to numbers or arrays (a field left out is not checked: the search sums the groups'
    slots apart from the rest, since a plan's full groups differ only in them)."""
    out = 0.0
    for lim in LIMITS:
        if lim.field in usage:
            bound = _bound(lim, function_weight_bytes)
            out = out + np.maximum(0.0, np.asarray(usage[lim.field], dtype=np.float64) - bound) / bound
    return out


def program_usage(experts: Any, hidden: int, ffn: int, compress: str = "none",
                  expert_bytes: Any = None) -> dict[str, Any]:
    """What a group of `experts` experts (a number or an array) uses, slots aside: the fields of `Usage` but
    `slots`, as `violation` takes them. `expert_bytes`: each expert's stored bytes (an array: one per group, where
    groups store their weights differently; default `expert_weight_bytes` of `compress`)."""
    n = np.asarray(experts)
    per = expert_weight_bytes(hidden, ffn, compress) if expert_bytes is None else np.asarray(expert_bytes)
    return {"hidden": hidden, "gate_up": 2 * ffn, "ops": OPS_PER_EXPERT * n + OPS_PER_FUNCTION,
            "weight_bytes": n * per}


@dataclass(frozen=True)
class Usage:
    """What one group's program uses, against each limit."""
    slots: int  # packed rows: the sum of the group's capacities
    hidden: int
    gate_up: int  # 2 x expert FFN size
    ops: int
    weight_bytes: int

    def over(self, function_weight_bytes: float = FUNCTION_WEIGHT_BYTES) -> list[tuple[str, float, float, str]]:
        """(what, value, limit, what to change) for every limit this group is past; empty when within all."""
        out = []
        for lim in LIMITS:
            value, bound = getattr(self, lim.field), _bound(lim, function_weight_bytes)
            if value > bound:
                out.append((lim.what, value, bound, lim.change))
        return out

    def violation(self, function_weight_bytes: float = FUNCTION_WEIGHT_BYTES) -> float:
        """`violation` of this one program."""
        return float(violation(dataclasses.asdict(self), function_weight_bytes))


def expert_weight_bytes(hidden: int, ffn: int, compress: str = "none") -> int:
    """Stored bytes of one expert's gate, up and down matrices."""
    return int(3 * hidden * ffn * BYTES_PER_WEIGHT[compress])


def group_usage(capacities: Sequence[int], hidden: int, ffn: int, compress: str = "none") -> Usage:
    """The program one static group of experts (one capacity each) becomes."""
    return Usage(slots=int(sum(capacities)), **{k: int(v) for k, v in
                                                program_usage(len(capacities), hidden, ffn, compress).items()})


def group_violation(capacities: Sequence[int], hidden: int, ffn: int, compress: str = "none") -> float:
    """The ANE backends' `limits` (the registry's hook): how far one group's program is past the limits."""
    return group_usage(capacities, hidden, ffn, compress).violation()


def resident_over_window(resident: Mapping[str, float]) -> float:
    """Bytes by which everything resident on the Neural Engine at once passes its window (0 when within):
    `resident` maps each part (e.g. "experts", "dense functions") to its stored weight bytes. The one measure of the
    window for every user: the search's choices, `autotune build`'s refusal, any backend that keeps functions
    resident on the ANE."""
    return max(0.0, float(sum(resident.values())) - WINDOW_BYTES)


def check_window(resident: Mapping[str, float]) -> None:
    """Refuse, in one line naming each part, functions that cannot be resident on the Neural Engine at once."""
    if resident_over_window(resident) > 0:
        parts = " + ".join(f"{part} {size / 1e6:,.1f} MB" for part, size in resident.items())
        raise NpumoeError(f"the functions resident on the Neural Engine at once hold {parts} = "
                          f"{sum(resident.values()) / 1e6:,.1f} MB of weights, past its window of "
                          f"{WINDOW_BYTES / 1e6:,.1f} MB; put fewer experts or dense functions on it, or compress them")
