"""The per-layer decision space of the search, and how one decision is scored against traces.

A decision (`LayerConfig`) for one MoE layer, with experts ranked by calibration popularity:
- `resident`: the top-`resident` experts run as static groups; the rest fall back to cpu-exact (residency);
- `group_size`: resident experts, in popularity order, fused `group_size` at a time into one static graph;
- `tiers` + `quantiles`: the resident experts split into `tiers` contiguous popularity bands; each band's
  capacity is the `quantile` of its experts' per-chunk loads on calibration traces (static capacity tiers);
- `overflow`: drop (lowest saliency first) or spill to cpu-exact.
The space is declared once, as Optuna distributions over named parameters (`distributions`); Optuna's trials
suggest from it, the local polish steps along it (`neighbours`), the exact yardstick enumerates it
(`enumerate_configs`), and `config_from_params` / `params_of` map between parameters and decisions.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from autotune.calibration.traces import Traces
from autotune.costing.costmodel import CostModel
from runtime.backends import registry
from runtime.coreml import ane_limits
from runtime.plan import OVERFLOW_POLICIES, Group, LayerCalibration, LayerPlan

QUANTILES = (0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
MAX_TIERS = 3


@dataclass(frozen=True)
class LayerConfig:
    """One layer's decision (see the module docstring); `tiers` quantiles, one per tier."""
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
              ffn: int = 0) -> float:
    """How far a layer plan is past the hard limits (0 when within them): each group's program against its backend's
    limits (from the backend registry; the ANE's are ane_limits: axes, ops, weight bytes per function, as the
    builder checks them); the resident budget."""
    v = 0.0
    info = registry.get(backend)
    if info is not None and info.limits is not None:
        v += sum(info.limits(g.capacities, hidden, ffn, g.compression) for g in lp.groups)
    resident = sum(len(g.experts) for g in lp.groups) * expert_bytes
    return v + max(0.0, resident - resident_bytes_budget) / max(1.0, resident_bytes_budget)


@dataclass
class Scorer:
    """Scores decisions for every layer with one cost model; caches by (layer, decision)."""
    cost: CostModel
    hidden: int
    ffn: int
    backend: str  # the static backend every group runs on (search_plan picks it among the profile's)
    resident_bytes_per_layer: float
    with_energy: bool = False  # score energy too (the energy objectives); else only `energy()` computes it
    _cache: dict = field(default_factory=dict, init=False, repr=False)  # a copy (dataclasses.replace) starts empty

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


def distributions(n_experts: int) -> dict[str, BaseDistribution]:
    """The decision space of one layer with `n_experts` experts, as Optuna distributions by parameter name."""
    return {"resident": IntDistribution(0, n_experts),
            "group_size": CategoricalDistribution(group_sizes(n_experts)),
            "tiers": IntDistribution(1, MAX_TIERS),
            **{f"q{i}": CategoricalDistribution(QUANTILES) for i in range(MAX_TIERS)},
            "overflow": CategoricalDistribution(OVERFLOW_POLICIES)}


def values(dist: BaseDistribution) -> list:
    """A distribution's values in order (the space is finite: integer ranges and categories)."""
    if isinstance(dist, IntDistribution):
        return list(range(dist.low, dist.high + 1, dist.step))
    return list(dist.choices)


def suggest(trial: optuna.Trial, n_experts: int) -> dict:
    """A trial's parameters, suggested from the space."""
    out = {}
    for name, dist in distributions(n_experts).items():
        if isinstance(dist, IntDistribution):
            out[name] = trial.suggest_int(name, dist.low, dist.high, step=dist.step)
        else:
            out[name] = trial.suggest_categorical(name, dist.choices)
    return out


def config_from_params(p: dict, n_experts: int) -> LayerConfig:
    """The decision a point of the space means: parameters past what the decision uses are ignored (a group
    larger than the residents, tiers beyond the residents, quantiles of tiers not used)."""
    r = int(p["resident"])
    if r == 0:
        return LayerConfig(0, overflow=p["overflow"])
    g = min(int(p["group_size"]), 2 ** math.ceil(math.log2(r)))
    t = min(int(p["tiers"]), r)
    return LayerConfig(r, g, t, tuple(float(p[f"q{i}"]) for i in range(t)), p["overflow"])


def params_of(cfg: LayerConfig) -> dict:
    """A point of the space that means `cfg` (unused quantiles at 1.0)."""
    qs = list(cfg.quantiles) + [1.0] * MAX_TIERS
    return {"resident": cfg.resident, "group_size": cfg.group_size, "tiers": max(1, cfg.tiers),
            **{f"q{i}": qs[i] for i in range(MAX_TIERS)}, "overflow": cfg.overflow}


def neighbours(p: dict, n_experts: int) -> list[dict]:
    """Points one step away from `p` along each parameter (the local-polish phase's proposals)."""
    out = []
    for name, dist in distributions(n_experts).items():
        steps = values(dist)
        i = steps.index(p[name])
        for j in (i - 1, i + 1):
            if 0 <= j < len(steps):
                out.append({**p, name: steps[j]})
    return out


def enumerate_configs(n_experts: int) -> list[LayerConfig]:
    """Every decision of the space once: the distinct `config_from_params` over all its points (no residents:
    one decision, whatever the overflow)."""
    d = {name: values(dist) for name, dist in distributions(n_experts).items()}
    out = [LayerConfig(0, overflow=d["overflow"][0])]
    for r in d["resident"][1:]:
        for g in d["group_size"]:
            if g > r and g // 2 >= r:
                continue  # only one size above r: every larger one yields the same single group
            for t in (t for t in d["tiers"] if t <= r):
                for qs in itertools.product(*(d[f"q{i}"] for i in range(t))):
                    for ov in d["overflow"]:
                        out.append(LayerConfig(r, g, t, qs, ov))
    return out


def space_size(n_experts: int) -> int:
    """Decisions in one layer's space; past 32 experts it is far beyond enumeration, so it is not counted."""
    return len(enumerate_configs(n_experts)) if n_experts <= 32 else 10 ** 9


def heuristic_config(data: LayerData, coverage: float = 0.8, group_size: int = 4, quantile: float = 0.9,
                     tiers: int = MAX_TIERS) -> LayerConfig:
    """The paper's heuristic: rank by popularity, hot experts (covering `coverage` of assignments) resident in
    fixed groups of four, three tiers at the 0.9 load quantile, overflow dropped."""
    share = np.cumsum(data.calib.sum(0)[data.rank]) / max(1, data.calib.sum())
    hot = int(np.searchsorted(share, coverage) + 1)
    hot = min(len(share), int(math.ceil(hot / group_size) * group_size))
    return LayerConfig(hot, min(group_size, hot), min(tiers, hot), (quantile,) * min(tiers, hot), "drop")
