"""The per-layer decision space of the search, declared once as data.

A decision (`LayerConfig`) for one MoE layer, with experts ranked by calibration popularity:
- `resident`: the top-`resident` experts run as static groups; the rest fall back to cpu-exact (residency);
- `group_size`: resident experts, in popularity order, fused `group_size` at a time into one static graph;
- `tiers` + `quantiles`: the resident experts split into `tiers` contiguous popularity bands; each band's
  capacity is the `quantile` of its experts' per-chunk loads on calibration traces (static capacity tiers),
  from 0.1 (well below the median: most chunks overflow, the ANE takes part of each hot expert's rows and the
  overflow policy the rest) to 1.0 (the busiest chunk);
- `sizing`: `band`, one capacity per tier as above, or `expert`, each resident expert the tier's quantile of its
  own per-chunk loads (less padding where a tier's experts are loaded unequally);
- `overflow`: drop (lowest saliency first) or spill to cpu-exact;
- `compress`: how the layer's static groups store their weights (the plan's per-group `compress`);
- `gpu_head`, `cpu_tail` (where the plan's exact path runs off the CPU, the GPU's): the most popular `gpu_head`
  experts run on the plan's exact path and the residents are the next ones (a GPU faster than the ANE takes the
  hottest experts); the least popular `cpu_tail` cold experts run on cpu-exact, the other cold experts (and spills)
  on the plan's exact path: three lanes, the ANE's groups, the GPU's exact path and the CPU's (the plan's `exact`
  and `exact_split`).
The space is one `Space`: a tuple of `Dimension`s (a field of the decision and its values, in order). Optuna's
distributions, a trial's suggestion, parameters <-> decision, the local polish's neighbours, the exact yardstick's
enumeration and the study name's digest are all derived from it; the one rule of meaning (`Space.canonical`: a
group larger than the residents is one group, tiers beyond the residents and their quantiles are unused, a layer
without residents is one decision) is written once, over arrays.

What a decision means as a plan entry is `decisions`; what it costs, `scoring` (through autotune.costing).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from runtime.plan import COMPRESSIONS, OVERFLOW_POLICIES

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
MAX_TIERS = 3
SIZINGS = ("band", "expert")  # a tier's capacity: one for its experts' loads together, or one per expert
BLOCK = 1 << 18  # product points canonicalised at a time by `Space.enumerate`
ENUMERABLE = 6_000_000  # product points past which the distinct decisions are not counted: a bound on the work
# (memory is one block and the decisions); an 8-expert layer with the GPU's head and tail: 5.5M, 326,421 decisions


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
    cpu_tail: int = 0  # the least popular cold experts on cpu-exact (where the plan's exact path is another)
    gpu_head: int = 0  # the most popular experts on the plan's exact path, the residents ranked after them

    def to_json(self) -> dict:
        return {"resident": self.resident, "group_size": self.group_size, "tiers": self.tiers,
                "quantiles": list(self.quantiles), "sizing": self.sizing, "overflow": self.overflow,
                "compress": self.compress, "capacity": self.capacity, "cpu_tail": self.cpu_tail,
                "gpu_head": self.gpu_head}


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
    _keys: dict = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)  # key_of's memo
    _rows: list = field(default_factory=list, init=False, compare=False, hash=False, repr=False)  # enumerate's

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
        head = np.zeros_like(r)
        if "gpu_head" in names:  # a head ahead of residents only (none without), and within the experts left
            heads = np.asarray(self.dim("gpu_head").values)
            room = np.where(r > 0, len(self.dim("resident").values) - 1 - r, 0)
            at = np.searchsorted(heads, np.minimum(self.column(rows, "gpu_head"), room), side="right") - 1
            rows[:, col("gpu_head")], head = at, heads[at]
        if "cpu_tail" in names:  # a tail of all the cold experts or more is all of them; none without cold experts
            cold = len(self.dim("resident").values) - 1 - r - head
            tails = np.asarray(self.dim("cpu_tail").values)
            all_cold = 2 ** np.ceil(np.log2(np.maximum(cold, 1))).astype(np.int64)
            rows[:, col("cpu_tail")] = np.searchsorted(tails, np.where(cold > 0, np.minimum(
                self.column(rows, "cpu_tail"), all_cold), 0))
        none = r == 0
        for p, d in self.params:
            if p not in ("resident", "cpu_tail", "gpu_head"):
                rows[none, col(p)] = unused if d is qdim else 0
        return rows

    def config(self, row: np.ndarray) -> LayerConfig:
        """The decision a canonical row means."""
        p = self.params_of_row(row)
        tail = int(p.get("cpu_tail", 0))
        if p["resident"] == 0:
            return LayerConfig(0, cpu_tail=tail)
        t = int(p["tiers"])
        qs = tuple(float(p[q]) for q in self.dim("quantiles").params[:t])
        return LayerConfig(int(p["resident"]), int(p["group_size"]), t, qs, p["overflow"], p.get("compress", "none"),
                           sizing=p.get("sizing", "band"), cpu_tail=tail, gpu_head=int(p.get("gpu_head", 0)))

    def config_from_params(self, params: dict) -> LayerConfig:
        return self.config(self.canonical(self.row_of(params))[0])

    def params_of(self, cfg: LayerConfig) -> dict:
        """A point of the space that means `cfg` (unused quantiles at 1.0)."""
        qs = list(cfg.quantiles) + [1.0] * MAX_TIERS
        fields = {"resident": cfg.resident, "group_size": cfg.group_size, "tiers": max(1, cfg.tiers),
                  "sizing": cfg.sizing, "overflow": cfg.overflow, "compress": cfg.compress, "cpu_tail": cfg.cpu_tail,
                  "gpu_head": cfg.gpu_head}
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
        """Every decision once: the distinct canonical rows of the product of all parameters' values, in the order
        they first appear in it, found a block of the product at a time (memory: one block and the decisions, not
        the product); computed once per space, a copy returned."""
        if not self._rows:
            radices = [len(d.values) for _, d in self.params]
            seen, found = np.empty(0, dtype=np.int64), []  # the keys found so far (sorted) and their rows
            for start in range(0, self.product_size, BLOCK):
                points = np.arange(start, min(start + BLOCK, self.product_size))
                rows = self.canonical(np.stack(np.unravel_index(points, radices), axis=1))
                keys, first = np.unique(self.keys(rows), return_index=True)
                new = ~np.isin(keys, seen, assume_unique=True)
                found.append(rows[np.sort(first[new])])
                seen = np.union1d(seen, keys[new])
            self._rows.append(np.concatenate(found))
        return self._rows[0].copy()

    def size(self) -> int:
        """Decisions in the space; past ENUMERABLE product points, the product's size (an upper bound)."""
        return len(self.enumerate()) if self.product_size <= ENUMERABLE else self.product_size


def compressions(space: "Space | None") -> tuple[str, ...]:
    """The weight storages `space` allows on the static backend, least compressed first (none without a space)."""
    return tuple(space.dim("compress").values) if space is not None else ("none",)


def layer_space(n_experts: int, compress: tuple[str, ...] = ("none",), split_exact: bool = False) -> Space:
    """The decision space of one layer with `n_experts` experts; `compress`: the weight storage kinds allowed;
    `split_exact`: the plan's exact path runs off the CPU (the GPU), so the hottest experts may run there ahead of
    the residents and cold experts split between it and the CPU (heads and tails of 0 and powers of two up to every
    expert)."""
    unknown = [c for c in compress if c not in COMPRESSIONS]
    if unknown or not compress:
        raise ValueError(f"compression kinds must be among {COMPRESSIONS}, got {list(compress)}")
    tail = (Dimension("gpu_head", (0, *group_sizes(n_experts))),
            Dimension("cpu_tail", (0, *group_sizes(n_experts)))) if split_exact else ()
    return Space((Dimension("resident", tuple(range(n_experts + 1))),
                  Dimension("group_size", tuple(group_sizes(n_experts))),
                  Dimension("tiers", tuple(range(1, MAX_TIERS + 1))),
                  Dimension("quantiles", QUANTILES, MAX_TIERS, "q"),
                  Dimension("sizing", SIZINGS),
                  Dimension("overflow", OVERFLOW_POLICIES),
                  Dimension("compress", tuple(c for c in COMPRESSIONS if c in compress)), *tail))
