"""The per-layer decision space of the search, and how one decision is scored against traces.

A decision (`LayerConfig`) for one MoE layer, with experts ranked by calibration popularity:
- `resident`: the top-`resident` experts run as static groups; the rest fall back to cpu-exact (residency);
- `group_size`: resident experts, in popularity order, fused `group_size` at a time into one static graph;
- `tiers` + `quantiles`: the resident experts split into `tiers` contiguous popularity bands; each band's
  capacity is the `quantile` of its experts' per-chunk loads on calibration traces (static capacity tiers);
- `overflow`: drop (lowest saliency first) or spill to cpu-exact.
The same space is searched by Optuna and, where small, enumerated exactly (the yardstick).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from runtime import ane_limits
from runtime.plan import Group, LayerCalibration, LayerPlan

from .costmodel import CostModel
from .traces import Traces

QUANTILES = (0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
MAX_TIERS = 3


@dataclass(frozen=True)
class LayerConfig:
    resident: int
    group_size: int = 1
    tiers: int = 1
    quantiles: tuple[float, ...] = (1.0,)
    overflow: str = "drop"
    capacity: int | None = None  # a uniform capacity instead of tiers (the uniform-capacity baselines)

    def to_json(self) -> dict:
        return {"resident": self.resident, "group_size": self.group_size, "tiers": self.tiers,
                "quantiles": list(self.quantiles), "overflow": self.overflow, "capacity": self.capacity}


@dataclass
class LayerData:
    """One layer's traces as the search needs them."""
    layer: int
    calib: np.ndarray  # [chunks, E] assignments per expert per calibration chunk
    heldout: np.ndarray  # [chunks, E] on held-out chunks
    rank: np.ndarray = field(init=False)  # experts by calibration popularity, most used first
    _quantiles: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.rank = np.argsort(-self.calib.sum(0), kind="stable")

    def band_capacity(self, lo: int, hi: int, q: float) -> int:
        """Capacity of the tier made of ranks lo..hi-1: the q-quantile of their per-chunk loads (memoised: the
        search asks for the same bands over and over)."""
        key = (lo, hi, q)
        if key not in self._quantiles:
            loads = self.calib[:, self.rank[lo:hi]].reshape(-1)
            self._quantiles[key] = max(1, int(math.ceil(np.quantile(loads, q))))
        return self._quantiles[key]

    @classmethod
    def from_traces(cls, traces: Traces) -> list["LayerData"]:
        return [cls(l, traces.counts(l, "calib"), traces.counts(l, "heldout")) for l in traces.spec["moe_layers"]]


@dataclass(frozen=True)
class Score:
    latency_ms: float  # predicted, summed over calibration chunks
    energy_mj: float | None  # predicted; None where the profile has no power figures or it was not asked for
    heldout_drops: int  # assignments that would be dropped on held-out chunks
    violation: float  # > 0 when a hard limit (ANE axis/ops, resident bytes) is broken


@dataclass(frozen=True)
class Evaluated:
    config: LayerConfig
    score: Score


def tiers(data: LayerData, cfg: LayerConfig) -> tuple[list[int], list[int]]:
    """(capacity, tier index) of each resident expert, in rank order: tier t is the t-th contiguous popularity
    band, sized by its load quantile (a uniform `capacity` makes one tier)."""
    if cfg.capacity is not None:
        return [cfg.capacity] * cfg.resident, [0] * cfg.resident
    caps, tier_of = [], []
    bands = np.array_split(np.arange(cfg.resident), min(cfg.tiers, cfg.resident))
    for t, (band, q) in enumerate(zip(bands, cfg.quantiles)):
        caps += [data.band_capacity(int(band[0]), int(band[-1]) + 1, q)] * len(band)
        tier_of += [t] * len(band)
    return caps, tier_of


def layer_plan(data: LayerData, cfg: LayerConfig, backend: str) -> LayerPlan:
    """The plan entry a decision means (pydantic objects built without re-validation: inputs are ours)."""
    resident = [int(e) for e in data.rank[:cfg.resident]]
    caps, tier_of = tiers(data, cfg) if resident else ([], [])
    groups = [Group.model_construct(backend=backend, experts=resident[i:i + cfg.group_size],
                                    capacities=caps[i:i + cfg.group_size],
                                    tier=tier_of[i:i + cfg.group_size])
              for i in range(0, len(resident), cfg.group_size)]
    cold = sorted(int(e) for e in data.rank[cfg.resident:])
    return LayerPlan.model_construct(layer=data.layer, groups=groups, cpu_exact=cold)


def overflow(lp: LayerPlan, loads: np.ndarray) -> int:
    """Assignments past their expert's capacity, summed over chunks of `loads` ([chunks, E])."""
    if not lp.groups:
        return 0
    experts = [e for g in lp.groups for e in g.experts]
    caps = np.array([c for g in lp.groups for c in g.capacities])
    return int(np.maximum(loads[:, experts] - caps, 0).sum())


SHARE_DIGITS = 6


def calibration(data: LayerData, lp: LayerPlan) -> LayerCalibration:
    """The layer's calibration load shares and its overflow rate on held-out chunks, for the plan file."""
    shares = data.calib.sum(0) / max(1, data.calib.sum())
    return LayerCalibration(load_shares=np.round(shares, SHARE_DIGITS).tolist(),
                            heldout_overflow_rate=overflow(lp, data.heldout) / max(1, int(data.heldout.sum())))


def violation(lp: LayerPlan, backend: str, expert_bytes: int, resident_bytes_budget: float, hidden: int = 0,
              ffn: int = 0, function_weight_bytes: float = ane_limits.FUNCTION_WEIGHT_BYTES) -> float:
    """How far a layer plan is past the hard limits (0 when within them): on the ANE, each group's program against
    runtime.ane_limits (axes, ops, weight bytes per function, as the builder checks them); the resident budget."""
    v = 0.0
    if backend == "ane":
        v += sum(ane_limits.group_usage(g.capacities, hidden, ffn).violation(function_weight_bytes) for g in lp.groups)
    resident = sum(len(g.experts) for g in lp.groups) * expert_bytes
    return v + max(0.0, resident - resident_bytes_budget) / max(1.0, resident_bytes_budget)


@dataclass
class Scorer:
    """Scores decisions for every layer with one cost model; caches by (layer, decision)."""
    cost: CostModel
    hidden: int
    ffn: int
    backend: str  # the static backend: "ane" where the device has one, else "cpu-static"
    resident_bytes_per_layer: float
    with_energy: bool = False  # score energy too (the energy objectives); else only `energy()` computes it
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def expert_bytes(self) -> int:
        return ane_limits.expert_weight_bytes(self.hidden, self.ffn)  # gate, up, down in fp16

    def score(self, data: LayerData, cfg: LayerConfig) -> Score:
        key = (data.layer, cfg)
        if key not in self._cache:
            lp = layer_plan(data, cfg, self.backend)
            lat = float(np.sum(self.cost.layer_ms(lp, data.calib, self.hidden, self.ffn, cfg.overflow)))
            energy = self.energy(data, cfg) if self.with_energy else None
            drops = overflow(lp, data.heldout) if cfg.overflow == "drop" else 0
            v = violation(lp, self.backend, self.expert_bytes, self.resident_bytes_per_layer, self.hidden, self.ffn)
            self._cache[key] = Score(lat, energy, drops, v)
        return self._cache[key]

    def energy(self, data: LayerData, cfg: LayerConfig) -> float | None:
        lp = layer_plan(data, cfg, self.backend)
        e = self.cost.layer_energy_mj(lp, data.calib, self.hidden, self.ffn, cfg.overflow)
        return None if e is None else float(np.sum(e))


def group_sizes(n_experts: int) -> list[int]:
    return [2 ** i for i in range(int(math.log2(n_experts)) + 1)]


def enumerate_configs(n_experts: int) -> list[LayerConfig]:
    """Every decision of the space (without duplicates that differ only in ignored fields)."""
    out = [LayerConfig(0, overflow="drop")]
    for r in range(1, n_experts + 1):
        for g in group_sizes(n_experts):
            if g > r and g // 2 >= r:
                continue  # only one size above r: every larger one yields the same single group
            for t in range(1, min(MAX_TIERS, r) + 1):
                for qs in itertools.product(QUANTILES, repeat=t):
                    for ov in ("drop", "spill"):
                        out.append(LayerConfig(r, g, t, qs, ov))
    return out


def space_size(n_experts: int) -> int:
    """Decisions in one layer's space; past 32 experts it is far beyond enumeration, so it is not counted."""
    return len(enumerate_configs(n_experts)) if n_experts <= 32 else 10 ** 9


def heuristic_config(data: LayerData, coverage: float = 0.8, group_size: int = 4, quantile: float = 0.9
                     ) -> LayerConfig:
    """The paper's heuristic: rank by popularity, hot experts (covering `coverage` of assignments) resident in
    fixed groups of four, three tiers at the 0.9 load quantile, overflow dropped."""
    share = np.cumsum(data.calib.sum(0)[data.rank]) / max(1, data.calib.sum())
    hot = int(np.searchsorted(share, coverage) + 1)
    hot = min(len(share), int(math.ceil(hot / group_size) * group_size))
    return LayerConfig(hot, min(group_size, hot), min(3, hot), (quantile,) * min(3, hot), "drop")
