"""The range of each fit: per kind of work (the experts' FFN per backend, a dense op per backend), the smallest and
largest value of each shape axis among the records the fit learnt from; and how far past it a prediction reaches.

A fit prices shapes inside its range by interpolation; past it, by its form alone (`Reach`): the search and the
report name those parts (e.g. "experts: hidden 4096 > 2048 profiled"), so that a figure priced outside what the
profile measured is never shown with the confidence of one inside it.
"""
from __future__ import annotations

from dataclasses import dataclass

from autotune.costing.dense_prices import RECORD_OP

# Each kind's axes, as a record names them: the experts' rows per expert call, hidden and FFN; a matmul's rows, its
# output width and its input width (a projection's input is the hidden size); the attention core's rows, context and
# width (heads x head_dim); elementwise work's rows and hidden.
AXES = {"experts": ("rows", "hidden", "ffn"), "matmul": ("rows", "out", "in"),
        "attention": ("rows", "context", "width"), "elementwise": ("rows", "hidden")}
Ranges = dict[str, dict[str, dict[str, list[float]]]]  # backend -> kind -> axis -> [lo, hi]


def record_kind(rec: dict) -> str | None:
    """The kind of work a record's fit prices (None: host-side work or a record no fit learns from)."""
    if rec.get("excluded"):
        return None
    if rec["kind"] in RECORD_OP:
        return RECORD_OP[rec["kind"]]
    if rec["kind"] == "matmul":  # a backend's (M, N, K) record (published figures): its matmul throughput
        return "matmul"
    return "experts" if rec["kind"] in ("ffn", "group", "call") else None


def record_shape(rec: dict) -> dict[str, list[float]]:
    """A record's values on its kind's axes (lists: a group call holds several experts' rows)."""
    kind = record_kind(rec)
    if kind == "experts":
        rows = rec["capacities"] if "capacities" in rec else [rec["tokens"]]
        return {"rows": [float(r) for r in rows], "hidden": [float(rec["hidden"])], "ffn": [float(rec["ffn"])]}
    if kind == "matmul":
        return {"rows": [float(rec["m"])], "out": [float(rec["n"])], "in": [float(rec["k"])]}
    if kind == "attention":
        return {"rows": [float(rec["rows"])], "context": [float(rec["context"])],
                "width": [float(rec["heads"] * rec["head_dim"])]}
    return {"rows": [float(rec["rows"])], "hidden": [float(rec["hidden"])]}


def fit_ranges(records: list[dict]) -> Ranges:
    """Per backend and kind, [lo, hi] of every axis over the records its fit learns from. Tiny dispatch-cost calls
    (`call` records) price the fixed cost, not a shape: they are left out. A backend's (M, N, K) `matmul` records
    (the published profile's) are what its experts' fit learns from too: their widths bound the experts' hidden and
    FFN sizes."""
    out: Ranges = {}

    def add(backend: str, kind: str, shape: dict[str, list[float]]) -> None:
        axes = out.setdefault(backend, {}).setdefault(kind, {})
        for axis, values in shape.items():
            lo, hi = axes.get(axis, [min(values), max(values)])
            axes[axis] = [min(lo, *values), max(hi, *values)]

    for rec in records:
        kind = record_kind(rec)
        if kind is None or rec["kind"] == "call":
            continue
        shape = record_shape(rec)
        add(rec["backend"], kind, shape)
        if rec["kind"] == "matmul":
            widths = shape["out"] + shape["in"]
            add(rec["backend"], "experts", {"rows": shape["rows"], "hidden": widths, "ffn": widths})
    return out


@dataclass(frozen=True)
class Reach:
    """One axis of a prediction past its fit's range: the value asked and the profiled end it lies past."""
    axis: str
    value: float
    end: float  # the profiled largest (value above it) or smallest (below it)

    @property
    def factor(self) -> float:
        """How far past, as a ratio (>= 1): value / largest, or smallest / value."""
        return self.value / self.end if self.value > self.end else self.end / max(self.value, 1e-12)

    def describe(self) -> str:
        sign = ">" if self.value > self.end else "<"
        return f"{self.axis} {self.value:g} {sign} {self.end:g} profiled"

    def to_json(self) -> dict:
        return {"axis": self.axis, "value": self.value, "profiled": self.end, "factor": round(self.factor, 3),
                "text": self.describe()}


def reach(ranges: Ranges, backend: str, kind: str, **shape: float) -> list[Reach]:
    """The axes of `shape` past the backend's `kind` fit (all of them where the profile has no such records: the
    price is then derived, which `DenseFit.source` says, and no range applies)."""
    axes = ranges.get(backend, {}).get(kind)
    if not axes:
        return []
    out = []
    for axis, value in shape.items():
        lo, hi = axes.get(axis, (value, value))
        if value > hi or value < lo:
            out.append(Reach(axis, float(value), float(hi if value > hi else lo)))
    return out


def merge_reaches(reaches: list[Reach]) -> list[Reach]:
    """One per axis, the farthest past (several ops of a part may reach past the same axis)."""
    best: dict[str, Reach] = {}
    for r in reaches:
        if r.axis not in best or r.factor > best[r.axis].factor:
            best[r.axis] = r
    return list(best.values())


def describe_parts(parts: dict[str, list[Reach]]) -> str:
    """`experts: hidden 4096 > 2048 profiled; attention_projections: in 4096 > 2048 profiled`."""
    return "; ".join(f"{part}: {', '.join(r.describe() for r in rs)}" for part, rs in parts.items() if rs)
