"""The per-layer decision space of the search, declared once as data, and how decisions are scored against traces.

A decision (`LayerConfig`) for one MoE layer, with experts ranked by calibration popularity:
- `resident`: the top-`resident` experts run as static groups; the rest fall back to cpu-exact (residency);
- `group_size`: resident experts, in popularity order, fused `group_size` at a time into one static graph;
- `tiers` + `quantiles`: the resident experts split into `tiers` contiguous popularity bands; each band's
  capacity is the `quantile` of its experts' per-chunk loads on calibration traces (static capacity tiers);
- `sizing`: `band`, one capacity per tier as above, or `expert`, each resident expert the tier's quantile of its
  own per-chunk loads (less padding where a tier's experts are loaded unequally);
- `overflow`: drop (lowest saliency first) or spill to cpu-exact;
- `compress`: how the layer's static groups store their weights (the plan's per-group `compress`).
The space is one `Space`: a tuple of `Dimension`s (a field of the decision and its values, in order). Optuna's
distributions, a trial's suggestion, parameters <-> decision, the local polish's neighbours, the exact yardstick's
enumeration and the study name's digest are all derived from it; the one rule of meaning (`Space.canonical`: a
group larger than the residents is one group, tiers beyond the residents and their quantiles are unused, a layer
without residents is one decision) is written once, over arrays.

Scoring: `Scorer.score` scores one decision through the plan entry it means and the cost model's `layer_ms` (the
reference); `Scorer.score_rows` scores many at once with numpy, from per-band and per-residency parts that the
decisions share (what makes exact enumeration affordable); a test holds the two equal.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from autotune.calibration.traces import Traces
from autotune.costing.costmodel import CostModel, HostCosts
from runtime.backends import EXACT, registry
from runtime.coreml import ane_limits
from runtime.drift import WINDOW_CHUNKS
from runtime.plan import COMPRESSIONS, OVERFLOW_POLICIES, Group, LayerCalibration, LayerPlan, WindowSpread

QUANTILES = (0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
MAX_TIERS = 3
SIZINGS = ("band", "expert")  # a tier's capacity: one for its experts' loads together, or one per expert
ENUMERABLE = 1_000_000  # points of the product space past which the distinct decisions are not counted
BATCH = 65_536  # decisions scored per numpy pass (bounds the [decisions, chunks] temporaries)


@dataclass(frozen=True)
class LayerConfig:
    """One layer's decision (see the module docstring); `tiers` quantiles, one per tier."""
    resident: int
    group_size: int = 1
    tiers: int = 1
    quantiles: tuple[float, ...] = (1.0,)
    overflow: str = "drop"
    compress: str = "none"
    capacity: int | None = None  # a uniform capacity instead of tiers (the uniform-capacity baselines)
    sizing: str = "band"

    def to_json(self) -> dict:
        return {"resident": self.resident, "group_size": self.group_size, "tiers": self.tiers,
                "quantiles": list(self.quantiles), "sizing": self.sizing, "overflow": self.overflow,
                "compress": self.compress, "capacity": self.capacity}


@dataclass(frozen=True)
class Dimension:
    """One field of the decision and its values, in order (the polish steps to adjacent values). A field with
    `width` > 1 holds a tuple: one parameter per element, `param0`, `param1`, ..."""
    field: str
    values: tuple
    width: int = 1
    param: str = ""  # the parameter name (prefix when width > 1); default: the field's name

    @property
    def params(self) -> list[str]:
        name = self.param or self.field
        return [name] if self.width == 1 else [f"{name}{i}" for i in range(self.width)]

    def distribution(self) -> BaseDistribution:
        """Ordered integer ranges are ordinal to the sampler; everything else is a category."""
        v = self.values
        if all(isinstance(x, int) for x in v) and list(v) == list(range(v[0], v[0] + len(v))):
            return IntDistribution(v[0], v[-1])
        return CategoricalDistribution(v)


def group_sizes(n_experts: int) -> list[int]:
    return [2 ** i for i in range(int(math.log2(n_experts)) + 1)]


@dataclass(frozen=True)
class Space:
    """One layer's decision space: its dimensions, in parameter order."""
    dims: tuple[Dimension, ...]
    _keys: dict = field(default_factory=dict, compare=False, hash=False, repr=False)  # key_of's memo

    # --- the declaration's parameters ---------------------------------------------------------------------------
    @property
    def params(self) -> list[tuple[str, Dimension]]:
        return [(p, d) for d in self.dims for p in d.params]

    def dim(self, name: str) -> Dimension:
        return next(d for d in self.dims if d.field == name)

    def distributions(self) -> dict[str, BaseDistribution]:
        """Optuna distributions by parameter name."""
        return {p: d.distribution() for p, d in self.params}

    def digest(self) -> str:
        """A short hash of the declaration: part of a study's name, so a resumed study never mixes two spaces."""
        key = json.dumps([(d.field, d.width, list(d.values)) for d in self.dims], default=str)
        return hashlib.sha256(key.encode()).hexdigest()[:10]

    def suggest(self, trial: optuna.Trial) -> dict:
        """A trial's parameters, suggested from the space."""
        out = {}
        for name, dist in self.distributions().items():
            if isinstance(dist, IntDistribution):
                out[name] = trial.suggest_int(name, dist.low, dist.high)
            else:
                out[name] = trial.suggest_categorical(name, dist.choices)
        return out

    # --- points as rows of value indices --------------------------------------------------------------------------
    def row_of(self, params: dict) -> np.ndarray:
        return np.array([d.values.index(params[p]) for p, d in self.params], dtype=np.int64)

    def params_of_row(self, row: np.ndarray) -> dict:
        return {p: d.values[int(i)] for (p, d), i in zip(self.params, row)}

    def column(self, rows: np.ndarray, param: str) -> np.ndarray:
        """The values of one parameter over rows (numbers as an array)."""
        j = [p for p, _ in self.params].index(param)
        return np.asarray(dict(self.params)[param].values)[rows[:, j]]

    def keys(self, rows: np.ndarray) -> np.ndarray:
        """One integer per row (its index in the product space)."""
        return np.ravel_multi_index(np.asarray(rows).reshape(-1, len(self.params)).T,
                                    [len(d.values) for _, d in self.params])

    def key_of(self, cfg: LayerConfig) -> int:
        """The key of a decision's canonical row (memoised: robustness costs the same plans' decisions often)."""
        if cfg not in self._keys:
            self._keys[cfg] = int(self.keys(self.canonical(self.row_of(self.params_of(cfg))))[0])
        return self._keys[cfg]

    def canonical(self, rows: np.ndarray) -> np.ndarray:
        """The point that stands for each point's decision: a group size is at most the next power of two above
        the residents, tiers at most the residents, unused quantiles at 1.0, a tier per resident sized as a band,
        and without residents every other parameter at its first value."""
        rows = np.array(rows, dtype=np.int64, copy=True).reshape(-1, len(self.params))
        names = [p for p, _ in self.params]
        col = names.index
        r = self.column(rows, "resident")
        need = 2 ** np.ceil(np.log2(np.maximum(r, 1))).astype(np.int64)
        sizes = np.asarray(self.dim("group_size").values)
        g = np.minimum(self.column(rows, "group_size"), need)
        rows[:, col("group_size")] = np.searchsorted(sizes, g)
        tiers = np.asarray(self.dim("tiers").values)
        t = np.minimum(self.column(rows, "tiers"), np.maximum(r, 1))
        rows[:, col("tiers")] = np.searchsorted(tiers, t)
        unused = self.dim("quantiles").values.index(1.0)
        qdim = self.dim("quantiles")
        for i, p in enumerate(qdim.params):
            rows[t <= i, col(p)] = unused
        rows[t >= r, col("sizing")] = 0  # a tier per expert: sized by its own loads either way
        none = r == 0
        for p, d in self.params:
            if p != "resident":
                rows[none, col(p)] = unused if d is qdim else 0
        return rows

    def config(self, row: np.ndarray) -> LayerConfig:
        """The decision a canonical row means."""
        p = self.params_of_row(row)
        if p["resident"] == 0:
            return LayerConfig(0)
        t = int(p["tiers"])
        qs = tuple(float(p[q]) for q in self.dim("quantiles").params[:t])
        return LayerConfig(int(p["resident"]), int(p["group_size"]), t, qs, p["overflow"], p.get("compress", "none"),
                           sizing=p.get("sizing", "band"))

    def config_from_params(self, params: dict) -> LayerConfig:
        return self.config(self.canonical(self.row_of(params))[0])

    def params_of(self, cfg: LayerConfig) -> dict:
        """A point of the space that means `cfg` (unused quantiles at 1.0)."""
        qs = list(cfg.quantiles) + [1.0] * MAX_TIERS
        fields = {"resident": cfg.resident, "group_size": cfg.group_size, "tiers": max(1, cfg.tiers),
                  "sizing": cfg.sizing, "overflow": cfg.overflow, "compress": cfg.compress}
        out = {}
        for p, d in self.params:
            v = qs[d.params.index(p)] if d.width > 1 else fields[d.field]
            out[p] = v if v in d.values else d.values[0]  # a decision without residents names no compression
        return out

    def neighbours(self, params: dict) -> list[dict]:
        """Points one step away from `params` along each parameter (the local-polish phase's proposals)."""
        out = []
        for name, d in self.params:
            i = d.values.index(params[name])
            out += [{**params, name: d.values[j]} for j in (i - 1, i + 1) if 0 <= j < len(d.values)]
        return out

    # --- the whole space ------------------------------------------------------------------------------------------
    @property
    def product_size(self) -> int:
        return math.prod(len(d.values) for _, d in self.params)

    def enumerate(self) -> np.ndarray:
        """Every decision once: the distinct canonical rows of the product of all parameters' values."""
        radices = [len(d.values) for _, d in self.params]
        rows = self.canonical(np.indices(radices, dtype=np.int64).reshape(len(radices), -1).T)
        _, first = np.unique(self.keys(rows), return_index=True)
        return rows[np.sort(first)]

    def size(self) -> int:
        """Decisions in the space; past ENUMERABLE product points, the product's size (an upper bound)."""
        return len(self.enumerate()) if self.product_size <= ENUMERABLE else self.product_size


def layer_space(n_experts: int, compress: tuple[str, ...] = ("none",)) -> Space:
    """The decision space of one layer with `n_experts` experts; `compress`: the weight storage kinds allowed."""
    unknown = [c for c in compress if c not in COMPRESSIONS]
    if unknown or not compress:
        raise ValueError(f"compression kinds must be among {COMPRESSIONS}, got {list(compress)}")
    return Space((Dimension("resident", tuple(range(n_experts + 1))),
                  Dimension("group_size", tuple(group_sizes(n_experts))),
                  Dimension("tiers", tuple(range(1, MAX_TIERS + 1))),
                  Dimension("quantiles", QUANTILES, MAX_TIERS, "q"),
                  Dimension("sizing", SIZINGS),
                  Dimension("overflow", OVERFLOW_POLICIES),
                  Dimension("compress", tuple(c for c in COMPRESSIONS if c in compress))))


# --- one layer's traces ---------------------------------------------------------------------------------------------
@dataclass
class LayerData:
    """One layer's traces as the search needs them, at one chunk size."""
    layer: int
    calib: np.ndarray  # [chunks, E] assignments per expert per calibration chunk
    heldout: np.ndarray  # [chunks, E] on held-out chunks
    chunk_tokens: int = 0  # the chunk size the counts are for (0: not said)
    tokens: np.ndarray | None = None  # [calib chunks] tokens in each (None: every chunk full)
    rank: np.ndarray = field(init=False)  # experts by calibration popularity, most used first
    partial: np.ndarray = field(init=False)  # [calib chunks] bool: a prompt's last chunk, shorter than chunk_tokens
    _quantiles: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.rank = np.argsort(-self.calib.sum(0), kind="stable")
        if self.tokens is None:
            self.tokens = np.full(self.calib.shape[0], self.chunk_tokens)
        self.partial = self.tokens < self.chunk_tokens

    def band_capacities(self, lo: int, hi: int) -> np.ndarray:
        """Capacities of the tier made of ranks lo..hi-1 at each of QUANTILES: the quantile of their per-chunk loads
        on full calibration chunks (memoised: the search asks for the same bands over and over)."""
        key = (lo, hi)
        if key not in self._quantiles:
            full = self.calib[~self.partial] if (~self.partial).any() else self.calib
            loads = full[:, self.rank[lo:hi]].reshape(-1)
            self._quantiles[key] = np.maximum(1, np.ceil(np.quantile(loads, QUANTILES))).astype(np.int64)
        return self._quantiles[key]

    def band_capacity(self, lo: int, hi: int, q: float) -> int:
        return int(self.band_capacities(lo, hi)[QUANTILES.index(q)])

    def expert_capacities(self, lo: int, hi: int) -> np.ndarray:
        """[QUANTILES, hi-lo]: each of ranks lo..hi-1 at each quantile of its own per-chunk loads (full chunks)."""
        key = ("expert", lo, hi)
        if key not in self._quantiles:
            full = self.calib[~self.partial] if (~self.partial).any() else self.calib
            loads = full[:, self.rank[lo:hi]]
            self._quantiles[key] = np.maximum(1, np.ceil(np.quantile(loads, QUANTILES, axis=0))).astype(np.int64)
        return self._quantiles[key]

    def capacities(self, lo: int, hi: int, sizing: str) -> np.ndarray:
        """[QUANTILES, hi-lo]: the capacity of each of ranks lo..hi-1 as a tier sized by `sizing`."""
        if sizing == "expert":
            return self.expert_capacities(lo, hi)
        return np.repeat(self.band_capacities(lo, hi)[:, None], hi - lo, axis=1)

    @classmethod
    def from_traces(cls, traces: Traces, chunk_tokens: int | None = None,
                    prompt_tokens: int | None = None) -> list["LayerData"]:
        """Every MoE layer's counts, re-chunked to `chunk_tokens` within prompts of `prompt_tokens` (default: as
        recorded)."""
        w = traces.workload(chunk_tokens or traces.header["chunk_tokens"], prompt_tokens)
        return [cls(l, w.counts(traces, l, "calib"), w.counts(traces, l, "heldout"), w.chunk_tokens,
                    w.sizes[~w.heldout]) for l in traces.spec["moe_layers"]]


@dataclass(frozen=True)
class Score:
    latency_ms: float  # predicted, summed over calibration chunks
    energy_mj: float | None  # predicted; None where the profile has no power figures or it was not asked for
    heldout_drops: int  # assignments that would be dropped on held-out chunks
    violation: float  # > 0 when a hard limit (ANE axis/ops/weights, resident bytes) is broken
    partial_ms: float = 0.0  # the part of latency_ms spent on prompts' last, partial chunks (padded static calls)
    partial_mj: float | None = None
    cpu_ms: float = 0.0  # predicted CPU-busy time (packing, cpu-static calls, the exact path), summed like latency
    partial_cpu_ms: float = 0.0  # its part on the partial chunks


@dataclass
class Scores:
    """Scores of many decisions of one layer, one entry per decision (the arrays of `Score`'s fields)."""
    latency_ms: np.ndarray
    energy_mj: np.ndarray | None
    heldout_drops: np.ndarray
    violation: np.ndarray
    partial_ms: np.ndarray
    partial_mj: np.ndarray | None
    cpu_ms: np.ndarray
    partial_cpu_ms: np.ndarray

    FIELDS = ("latency_ms", "energy_mj", "heldout_drops", "violation", "partial_ms", "partial_mj", "cpu_ms",
              "partial_cpu_ms")

    def __len__(self) -> int:
        return len(self.latency_ms)

    def at(self, i: int) -> Score:
        e = lambda a: None if a is None else a[i].item()  # noqa: E731
        return Score(*(e(getattr(self, n)) for n in self.FIELDS))

    def take(self, idx: np.ndarray) -> "Scores":
        return Scores(*(None if (a := getattr(self, n)) is None else a[idx] for n in self.FIELDS))

    @classmethod
    def concat(cls, parts: list["Scores"]) -> "Scores":
        c = lambda name: (None if any(getattr(p, name) is None for p in parts)  # noqa: E731
                          else np.concatenate([getattr(p, name) for p in parts]))
        return cls(*(c(n) for n in cls.FIELDS))


Weights = tuple[float, float, float]  # the search's weights on (latency, energy, CPU-busy time)


def objective_name(weights: Weights) -> str:
    """What `weights` minimise, in words: "latency", "energy", "CPU-busy time" (latency only breaks its ties) or
    "weighted latency + energy"."""
    if weights[2]:
        return "CPU-busy time"
    names = [n for n, w in zip(("latency", "energy"), weights) if w]
    return names[0] if len(names) == 1 else "weighted " + " + ".join(names)


def weighted_cost(s: Score | Scores | Any, weights: Weights, exact_partial: bool = False):
    """The scalar cost the search minimises, of a decision, many (`Scores`: an array) or a plan (a `Solution`):
    `weights` on (latency, energy, CPU-busy time), each normalised by the caller; a part whose weight is 0 is not
    read (energy may be None then). With `exact_partial` the prompts' partial chunks are left out (they run on the
    exact path, whatever the decision: the caller adds that)."""
    out = 0.0
    for w, total, partial in zip(weights, ("latency_ms", "energy_mj", "cpu_ms"),
                                 ("partial_ms", "partial_mj", "partial_cpu_ms")):
        if w:
            out = out + w * (getattr(s, total) - (getattr(s, partial) if exact_partial else 0.0))
    return out


def total_score(scores: list[Score]) -> Score:
    """The sum of scores, field by field (energy None if any is None)."""
    def total(name: str):
        values = [getattr(s, name) for s in scores]
        return None if any(v is None for v in values) else sum(values)

    return Score(*(total(name) for name in Scores.FIELDS))


def tiers(data: LayerData, cfg: LayerConfig) -> tuple[list[int], list[int]]:
    """(capacity, tier index) of each resident expert, in rank order: tier t is the t-th contiguous popularity
    band, sized by its load quantile (a uniform `capacity` makes one tier)."""
    if cfg.capacity is not None:
        return [cfg.capacity] * cfg.resident, [0] * cfg.resident
    caps, tier_of = [], []
    bands = np.array_split(np.arange(cfg.resident), min(cfg.tiers, cfg.resident))
    for t, (band, q) in enumerate(zip(bands, cfg.quantiles)):
        caps += data.capacities(int(band[0]), int(band[-1]) + 1, cfg.sizing)[QUANTILES.index(q)].tolist()
        tier_of += [t] * len(band)
    return caps, tier_of


def layer_plan(data: LayerData, cfg: LayerConfig, backend: str) -> LayerPlan:
    """The plan entry a decision means (pydantic objects built without re-validation: inputs are ours)."""
    resident = [int(e) for e in data.rank[:cfg.resident]]
    caps, tier_of = tiers(data, cfg) if resident else ([], [])
    compress = None if cfg.compress == "none" else cfg.compress
    groups = [Group.model_construct(backend=backend, experts=resident[i:i + cfg.group_size],
                                    capacities=caps[i:i + cfg.group_size],
                                    tier=tier_of[i:i + cfg.group_size], compress=compress)
              for i in range(0, len(resident), cfg.group_size)]
    cold = sorted(int(e) for e in data.rank[cfg.resident:])
    return LayerPlan.model_construct(layer=data.layer, groups=groups, cpu_exact=cold)


def chunk_overflow(lp: LayerPlan, loads: np.ndarray) -> np.ndarray:
    """Assignments past their expert's capacity in each chunk of `loads` ([chunks, E])."""
    if not lp.groups:
        return np.zeros(loads.shape[0], dtype=np.int64)
    experts = [e for g in lp.groups for e in g.experts]
    caps = np.array([c for g in lp.groups for c in g.capacities])
    return np.maximum(loads[:, experts] - caps, 0).sum(1)


def overflow(lp: LayerPlan, loads: np.ndarray) -> int:
    """Assignments past their expert's capacity, summed over chunks of `loads` ([chunks, E])."""
    return int(chunk_overflow(lp, loads).sum())


def window_spread(lp: LayerPlan, loads: np.ndarray, window: int = WINDOW_CHUNKS) -> WindowSpread | None:
    """Mean and sd of the overflow rate over every full window of `window` consecutive chunks of `loads` (the
    drift monitor's window, slid one chunk at a time); None when there are fewer chunks than a window."""
    if loads.shape[0] < window:
        return None
    over = np.concatenate([[0], np.cumsum(chunk_overflow(lp, loads))])
    total = np.concatenate([[0], np.cumsum(loads.sum(1))])
    rates = (over[window:] - over[:-window]) / np.maximum(1, total[window:] - total[:-window])
    return WindowSpread(window_chunks=window, windows=len(rates), mean=float(rates.mean()), sd=float(rates.std()))


SHARE_DIGITS = 6


def calibration(data: LayerData, lp: LayerPlan) -> LayerCalibration:
    """The layer's calibration load shares and its overflow rate on held-out chunks, for the plan file."""
    shares = data.calib.sum(0) / max(1, data.calib.sum())
    return LayerCalibration(load_shares=np.round(shares, SHARE_DIGITS).tolist(),
                            heldout_overflow_rate=overflow(lp, data.heldout) / max(1, int(data.heldout.sum())),
                            heldout_window_spread=window_spread(lp, data.heldout))


def violation(lp: LayerPlan, backend: str, hidden: int, ffn: int, resident_bytes_budget: float) -> float:
    """How far a layer plan is past the hard limits (0 when within them): each group's program against its backend's
    limits (from the backend registry; the ANE's are ane_limits: axes, ops, stored weight bytes per function, as the
    builder checks them); the resident budget, in stored (compressed) bytes."""
    v = 0.0
    info = registry.get(backend)
    if info is not None and info.limits is not None:
        v += sum(info.limits(g.capacities, hidden, ffn, g.compression) for g in lp.groups)
    resident = sum(len(g.experts) * ane_limits.expert_weight_bytes(hidden, ffn, g.compression) for g in lp.groups)
    return v + max(0.0, resident - resident_bytes_budget) / max(1.0, resident_bytes_budget)


@dataclass
class _LayerParts:
    """What every decision of one layer shares: per residency, the cold experts' exact path; per band (lo, hi) and
    quantile, its capacity, static cost per compression, held-out overflow and calibration overflow."""
    ffn_exact: np.ndarray  # [chunks, E] cpu-exact ms of each ranked expert's calibration load
    cold_ms: np.ndarray  # [E+1, chunks] exact ms of experts ranked r.. (no call/host cost)
    cold_n: np.ndarray  # [E+1, chunks] their assignments
    total_n: np.ndarray  # [chunks] all assignments
    bands: dict = field(default_factory=dict)  # (lo, hi) -> dict of arrays over QUANTILES


@dataclass
class Scorer:
    """Scores decisions for every layer with one cost model; caches by (layer, chunk, decision)."""
    cost: CostModel
    hidden: int
    ffn: int
    backend: str  # the static backend every group runs on (search_plan picks it among the profile's)
    resident_bytes_per_layer: float
    with_energy: bool = False  # score energy too (the energy objectives); else only `energy()` computes it
    _cache: dict = field(default_factory=dict, init=False, repr=False)  # a copy (dataclasses.replace) starts empty
    _parts: dict = field(default_factory=dict, init=False, repr=False)

    def score(self, data: LayerData, cfg: LayerConfig) -> Score:
        """One decision through its plan entry and the cost model (the reference for `score_rows`)."""
        key = (data.layer, data.chunk_tokens, cfg)
        if key not in self._cache:
            lp = layer_plan(data, cfg, self.backend)
            per_chunk, cpu = map(np.asarray, self.cost.layer_times(lp, data.calib, self.hidden, self.ffn,
                                                                   cfg.overflow))
            energy = self._energy_chunks(data, lp, cfg) if self.with_energy else None
            drops = overflow(lp, data.heldout) if cfg.overflow == "drop" else 0
            v = violation(lp, self.backend, self.hidden, self.ffn, self.resident_bytes_per_layer)
            self._cache[key] = Score(float(per_chunk.sum()), None if energy is None else float(energy.sum()), drops,
                                     v, float(per_chunk[data.partial].sum()),
                                     None if energy is None else float(energy[data.partial].sum()),
                                     float(cpu.sum()), float(cpu[data.partial].sum()))
        return self._cache[key]

    def _energy_chunks(self, data: LayerData, lp: LayerPlan, cfg: LayerConfig) -> np.ndarray | None:
        e = self.cost.layer_energy_mj(lp, data.calib, self.hidden, self.ffn, cfg.overflow)
        return None if e is None else np.asarray(e, dtype=np.float64)

    def energy(self, data: LayerData, cfg: LayerConfig) -> float | None:
        e = self._energy_chunks(data, layer_plan(data, cfg, self.backend), cfg)
        return None if e is None else float(np.sum(e))

    def partial_exact(self, data: LayerData) -> Score:
        """The layer's partial chunks run wholly on the exact path (the plan's exact_below_tokens above their
        length): the same whatever the decision, all CPU work."""
        counts = data.calib[data.partial]
        ms = float(np.sum(self.cost.exact_ms(counts, self.hidden, self.ffn)))
        power = self.cost.power_w("cpu-exact")
        mj = None if power is None else power * ms
        return Score(ms, mj, heldout_drops=0, violation=0.0, partial_ms=ms, partial_mj=mj, cpu_ms=ms,
                     partial_cpu_ms=ms)

    # --- many decisions at once ------------------------------------------------------------------------------------
    def with_cost(self, cost: CostModel, with_energy: bool) -> "Scorer":
        """A scorer for `cost` sharing this one's bulk figures where they do not depend on what differs: a cost
        model that changes a call cost or a power, not the experts' compute, reuses every band."""
        out = dataclasses.replace(self, cost=cost, with_energy=with_energy)
        out._parts = self._parts
        return out

    def _layer_parts(self, data: LayerData) -> _LayerParts:
        key = (data.layer, data.chunk_tokens, id(data), self.hidden, self.ffn,
               self.cost.backend_model(self.backend).ffn_key(), self.cost.backend_model(EXACT).ffn_key())
        if key not in self._parts:
            ranked = data.calib[:, data.rank]
            f = np.asarray(self.cost.ffn_ms("cpu-exact", ranked, self.hidden, self.ffn), dtype=np.float64)
            f = f.reshape(ranked.shape)
            zeros = np.zeros((1, ranked.shape[0]))
            cold_ms = np.concatenate([np.cumsum(f[:, ::-1], axis=1)[:, ::-1].T, zeros])
            cold_n = np.concatenate([np.cumsum(ranked[:, ::-1], axis=1)[:, ::-1].T, zeros])
            self._parts[key] = _LayerParts(f, cold_ms, cold_n, ranked.sum(1).astype(np.float64))
        return self._parts[key]

    def _band(self, data: LayerData, parts: _LayerParts, lo: int, hi: int, sizing: str) -> dict:
        """A band's figures at every quantile: its capacities (the largest, the sum, running sums over its ranks
        padded to E+1), static ms per compression, held-out overflow, and per calibration chunk the overflow's count
        and exact ms."""
        if (lo, hi, sizing) not in parts.bands:
            self._fill_bands(data, parts, lo, [hi], sizing)
        return parts.bands[(lo, hi, sizing)]

    def _fill_bands(self, data: LayerData, parts: _LayerParts, lo: int, his: list[int], sizing: str) -> None:
        """`_band` of the bands lo..hi-1 for every hi in `his` at once, as running sums over ranks taken at each
        band's end: sized per expert, a rank's capacity and overflow are the same whatever band it is in; sized per
        band, they depend only on the band's capacity, so the sums run once per distinct capacity."""
        his = sorted({h for h in his if (lo, h, sizing) not in parts.bands})
        if not his:
            return
        n = np.asarray(his) - lo  # each band's length
        width, e1 = int(n[-1]), len(data.rank) + 1
        ranks = data.rank[lo:lo + width]
        calib, held = data.calib[:, ranks], data.heldout[:, ranks]

        def running(a: np.ndarray) -> np.ndarray:  # [..., W] -> [..., W+1]: sums over the first k ranks
            return np.concatenate([np.zeros(a.shape[:-1] + (1,)), np.cumsum(a, axis=-1, dtype=np.float64)], -1)

        def ffn(backend: str, rows: np.ndarray, kind: str = "none") -> np.ndarray:
            return np.asarray(self.cost.ffn_ms(backend, rows, self.hidden, self.ffn, kind), dtype=np.float64)

        if sizing == "expert":  # [Q, W] per rank: every band's figure is the running sum at its end
            caps = data.expert_capacities(lo, lo + width)
            over = np.maximum(calib[None] - caps[:, None, :], 0)  # [Q, C, W]
            at = lambda a: np.moveaxis(running(a)[..., n], -1, 0)  # noqa: E731  [..., W] -> [B, ...]
            static = {k: at(ffn(self.backend, caps, k)) for k in COMPRESSIONS}
            spill_ms, spill_n = at(ffn(EXACT, over)), at(over)
            drops = at(np.maximum(held[None] - caps[:, None, :], 0).sum(1))
            caps_b = np.where(np.arange(width)[None, None, :] < n[:, None, None], caps[None], 0)  # [B, Q, W]
            cum = np.zeros((len(n), len(QUANTILES), e1))
            cum[:, :, 1:width + 1] = np.cumsum(caps_b, axis=2)
            cum[:, :, width + 1:] = cum[:, :, width:width + 1]
            cap_max, slots = caps_b.max(2), caps_b.sum(2)
        else:  # one capacity per band and quantile: running sums per distinct capacity, taken at each band's end
            cap_bq = np.stack([data.band_capacities(lo, int(h)) for h in his])  # [B, Q]
            values, which = np.unique(cap_bq, return_inverse=True)
            which = which.reshape(cap_bq.shape)
            over = np.maximum(calib[None] - values[:, None, None], 0)  # [V, C, W]
            pick = lambda a: a[which, ..., n[:, None]]  # noqa: E731  [V, ..., W+1] -> [B, Q, ...]
            spill_ms, spill_n = pick(running(ffn(EXACT, over))), pick(running(over))
            drops = pick(running(np.maximum(held[None] - values[:, None, None], 0).sum(1)))
            static = {k: n[:, None] * ffn(self.backend, cap_bq, k) for k in COMPRESSIONS}
            cum = np.minimum(np.arange(e1)[None, None, :], n[:, None, None]) * cap_bq[:, :, None].astype(np.float64)
            cap_max, slots = cap_bq, n[:, None] * cap_bq
        for b, h in enumerate(his):
            parts.bands[(lo, h, sizing)] = {
                "cap_max": cap_max[b], "slots": slots[b], "cum": cum[b],
                "static": {k: v[b] for k, v in static.items()}, "drops": drops[b],
                "spill_n": spill_n[b], "spill_ms": spill_ms[b]}

    def score_rows(self, data: LayerData, space: Space, rows: np.ndarray) -> Scores:
        """Scores of canonical rows of `space` (equal to `score` of each row's decision), in batches."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, len(space.params))
        parts = [self._score_batch(data, space, rows[i:i + BATCH]) for i in range(0, max(1, len(rows)), BATCH)]
        return Scores.concat(parts)

    def _score_batch(self, data: LayerData, space: Space, rows: np.ndarray) -> Scores:
        """Decisions sharing residency, tiers and quantiles (a `core`) share their bands, exact path and packing;
        group size and compression only change the static calls' cost, so per decision only the overlap of that
        one number with each chunk's exact path is left (sum of max(static, exact) from sorted exact times)."""
        parts = self._layer_parts(data)
        r = space.column(rows, "resident").astype(np.int64)
        g = space.column(rows, "group_size").astype(np.int64)
        spill = (space.column(rows, "overflow") == "spill").astype(np.int64)
        kinds = space.column(rows, "compress") if "compress" in dict(space.params) else np.full(len(rows), "none")
        kind_names = [str(k) for k in np.unique(kinds)]
        kind = np.searchsorted(kind_names, kinds)
        qcols = [[p for p, _ in space.params].index(q) for q in space.dim("quantiles").params]
        tcol = [p for p, _ in space.params].index("tiers")
        scol = [p for p, _ in space.params].index("sizing")
        core_key = np.concatenate([r[:, None], rows[:, [tcol] + qcols + [scol]]], 1)
        radices = (int(r.max()) + 1, len(space.dim("tiers").values), *[len(QUANTILES)] * len(qcols),
                   len(space.dim("sizing").values))
        keys, first, ci = np.unique(np.ravel_multi_index(core_key.T, radices), return_index=True,
                                    return_inverse=True)
        cores, ci = core_key[first], ci.reshape(-1)
        cr = cores[:, 0]
        ct = np.minimum(np.asarray(space.dim("tiers").values)[cores[:, 1]], np.maximum(cr, 1))
        cq = np.searchsorted(QUANTILES, np.asarray(QUANTILES)[cores[:, 2:2 + len(qcols)]])
        csizing = np.asarray(space.dim("sizing").values)[cores[:, -1]]
        n_cores, n_chunks = len(cores), data.calib.shape[0]
        static = np.zeros((n_cores, len(kind_names)))
        drops = np.zeros(n_cores)
        slots = np.zeros(n_cores)
        spill_n = np.zeros((n_cores, n_chunks))
        spill_ms = np.zeros((n_cores, n_chunks))
        cap_max = np.zeros(n_cores)
        cums = np.zeros((n_cores, MAX_TIERS, len(data.rank) + 1))  # running capacity sums per band, padded
        lo_of = np.zeros((n_cores, MAX_TIERS), dtype=np.int64)
        base, extra = cr // np.maximum(ct, 1), cr % np.maximum(ct, 1)
        e1 = len(data.rank) + 1
        for j in range(MAX_TIERS):  # band j of each core: ranks lo..hi-1, as np.array_split cuts them
            size = np.where(j < ct, base + (j < extra), 0)
            lo = lo_of[:, j] = j * base + np.minimum(j, extra)
            used = np.nonzero(size > 0)[0]
            by_sizing = np.searchsorted(SIZINGS, csizing[used])
            bands, which = np.unique((by_sizing * e1 + lo[used]) * e1 + size[used], return_inverse=True)
            starts = np.asarray(bands) // e1  # (sizing, lo) of each band: the bands sharing one are filled at once
            for key in np.unique(starts).tolist():
                sz, l = divmod(key, e1)
                self._fill_bands(data, parts, l, (l + np.asarray(bands)[starts == key] % e1).tolist(), SIZINGS[sz])
            for key, sel in zip(bands.tolist(), np.split(used[np.argsort(which, kind="stable")],
                                                         np.cumsum(np.bincount(which.reshape(-1)))[:-1])):
                rest, n = divmod(key, e1)
                sz, l = divmod(rest, e1)
                band = self._band(data, parts, l, l + n, SIZINGS[sz])
                q = cq[sel, j]
                cap_max[sel] = np.maximum(cap_max[sel], band["cap_max"][q])
                cums[sel, j] = band["cum"][q]
                static[sel] += np.stack([band["static"][k][q] for k in kind_names], 1)
                drops[sel] += band["drops"][q]
                slots[sel] += band["slots"][q]
                spill_n[sel] += band["spill_n"][q]
                spill_ms[sel] += band["spill_ms"][q]
        # per core and overflow policy (0 drop, 1 spill): each chunk's exact path, packing
        exact_n = parts.cold_n[cr][:, None] + np.stack([np.zeros_like(spill_n), spill_n], 1)  # [C, 2, n]
        exact = parts.cold_ms[cr][:, None] + np.stack([np.zeros_like(spill_ms), spill_ms], 1)
        exact = np.where(exact_n > 0, exact + self.cost.call_ms("cpu-exact"), 0.0)
        exact = exact + HostCosts.evaluate(self.cost.host.exact, exact_n, self.hidden)
        total = np.broadcast_to(parts.total_n, (n_cores, n_chunks))
        pack = np.where((cr > 0)[:, None], self.cost.pack_ms(total, self.hidden, slots[:, None]), 0.0)  # [C, n]
        calls = np.where(r > 0, -(-r // g), 0)
        s_row = static[ci, kind] + calls * self.cost.call_ms(self.backend)  # each decision's static calls
        latency, partial = np.zeros(len(rows)), np.zeros(len(rows))
        cpu, partial_cpu = np.zeros(len(rows)), np.zeros(len(rows))
        off_cpu = self.cost.overlaps(self.backend)  # static calls run off the CPU: the calling thread waits
        for mask, out, busy in ((~data.partial, latency, cpu), (data.partial, partial, partial_cpu)):
            x = exact[:, :, mask]
            host = pack[:, mask].sum(1)[ci] + x.sum(2)[ci, spill]  # CPU work whatever the calls
            busy += host if off_cpu else host + mask.sum() * s_row
            out += pack[:, mask].sum(1)[ci]
            if not off_cpu:
                out += mask.sum() * s_row + x.sum(2)[ci, spill]
                continue
            xs = np.sort(x, axis=2)
            tail = np.concatenate([np.cumsum(xs[:, :, ::-1], axis=2)[:, :, ::-1], np.zeros(xs.shape[:2] + (1,))], 2)
            below = (xs[ci, spill] < s_row[:, None]).sum(1)  # chunks whose exact path ends before the calls
            out += below * s_row + tail[ci, spill, below]
        latency += partial
        cpu += partial_cpu
        energy = partial_mj = None
        if self.with_energy:
            e_static, e_cpu = self.cost.power_w(self.backend), self.cost.power_w("cpu-exact")
            if e_static is not None and e_cpu is not None:
                busy = np.where((cr > 0)[:, None, None] | (exact > 0), exact + pack[:, None], 0.0)  # [C, 2, n]
                n_part = int(data.partial.sum())
                partial_mj = e_static * n_part * s_row + e_cpu * busy[:, :, data.partial].sum(2)[ci, spill]
                energy = e_static * n_chunks * s_row + e_cpu * busy.sum(2)[ci, spill]
        v = self._violation_rows(r, g, kinds, cap_max[ci], lambda rows_at, bounds: _slots_at(
            cums[ci[rows_at]], lo_of[ci[rows_at]], bounds))
        return Scores(latency, energy, np.where(spill == 1, 0, drops[ci]).astype(np.int64), v, partial, partial_mj,
                      cpu, partial_cpu)

    def _violation_rows(self, r: np.ndarray, g: np.ndarray, kinds: np.ndarray, cap_max: np.ndarray,
                        slots_at) -> np.ndarray:
        """`violation` of each decision, from its residents, group size, compression, largest capacity and
        `slots_at(rows, bounds)` (summed capacities of ranks below each bound): on the ANE every group's program
        against ane_limits (`Usage.violation`, summed over the groups: r // g full groups and one of r % g), and
        the resident budget."""
        eb = np.zeros(len(r))
        for k in np.unique(kinds):
            eb[kinds == k] = ane_limits.expert_weight_bytes(self.hidden, self.ffn, str(k))
        budget = self.resident_bytes_per_layer
        v = np.maximum(0.0, r * eb - budget) / max(1.0, budget)
        limits = getattr(registry.get(self.backend), "limits", None)
        if limits is None:
            return v
        if not _ane_form(limits, self.hidden, self.ffn):  # another backend's limits: group by group
            for i in np.nonzero(r > 0)[0]:
                ri, gi = int(r[i]), int(g[i])
                caps = np.diff(slots_at(np.array([i]), np.arange(ri + 1)[None, :])[0]).astype(np.int64)
                v[i] += sum(limits(caps[j:j + gi].tolist(), self.hidden, self.ffn, str(kinds[i]))
                            for j in range(0, ri, gi))
            return v
        full, rest = np.where(r > 0, r // g, 0), np.where(r > 0, r % g, 0)
        groups = full + (rest > 0)

        def over(value, limit: float) -> np.ndarray:
            return np.maximum(0.0, value - limit) / limit

        for n, count in ((g, full), (rest, (rest > 0).astype(np.int64))):  # per group, as Usage.over counts
            v += count * (over(n * eb, ane_limits.FUNCTION_WEIGHT_BYTES) +
                          over(ane_limits.OPS_PER_EXPERT * n + ane_limits.OPS_PER_FUNCTION, ane_limits.MAX_OPS))
        v += groups * (over(self.hidden, ane_limits.MAX_AXIS) + over(2 * self.ffn, ane_limits.MAX_AXIS))
        maybe = np.nonzero((r > 0) & (np.minimum(g, r) * cap_max > ane_limits.MAX_AXIS))[0]
        if maybe.size:  # packed slots per group, from the running sums of capacities at the group bounds
            ri, gi = r[maybe], g[maybe]
            bounds = np.minimum(np.arange(int((ri // gi).max()) + 2)[None, :] * gi[:, None], ri[:, None])
            v[maybe] += over(np.diff(slots_at(maybe, bounds), axis=1), ane_limits.MAX_AXIS).sum(1)
        return v


def _slots_at(cums: np.ndarray, lo: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """[rows, bounds]: capacities of the ranks below each bound, from each band's running sums ([rows, tiers,
    E+1], padded past the band) and first rank ([rows, tiers])."""
    out = np.zeros(bounds.shape)
    for j in range(cums.shape[1]):
        at = np.clip(bounds - lo[:, j:j + 1], 0, cums.shape[2] - 1)
        out += np.take_along_axis(cums[:, j], at, axis=1)
    return out


def _ane_form(limits, hidden: int, ffn: int) -> bool:
    """Whether a backend's limits are ane_limits' (what the closed form in `_violation_rows` computes): the same
    answer on groups past each of its limits."""
    over_weights = int(ane_limits.FUNCTION_WEIGHT_BYTES // ane_limits.expert_weight_bytes(hidden, ffn)) + 1
    probes = [([ane_limits.MAX_AXIS + 7], "none"), ([1] * over_weights, "none"), ([1] * over_weights, "int8"),
              ([1] * (ane_limits.MAX_OPS // ane_limits.OPS_PER_EXPERT + 1), "palettize4"), ([3, 5], "none")]
    return all(math.isclose(limits(caps, hidden, ffn, k), ane_limits.group_usage(caps, hidden, ffn, k).violation())
               for caps, k in probes)


def heuristic_config(data: LayerData, coverage: float = 0.8, group_size: int = 4, quantile: float = 0.9,
                     tiers: int = MAX_TIERS) -> LayerConfig:
    """The paper's heuristic: rank by popularity, hot experts (covering `coverage` of assignments) resident in
    fixed groups of four, three tiers at the 0.9 load quantile, overflow dropped."""
    share = np.cumsum(data.calib.sum(0)[data.rank]) / max(1, data.calib.sum())
    hot = int(np.searchsorted(share, coverage) + 1)
    hot = min(len(share), int(math.ceil(hot / group_size) * group_size))
    return LayerConfig(hot, min(group_size, hot), min(tiers, hot), (quantile,) * min(tiers, hot), "drop")

