"""What a decision means: its tiers, the plan entry (`layer_plan`), its overflow on traces, the calibration the plan
keeps, how far it is past the hard limits (`violation`), and the paper's heuristic decision."""
from __future__ import annotations

import math

import numpy as np

from autotune.costing.evaluator import over_budget
from autotune.searching.layer_data import LayerData
from autotune.searching.space import MAX_TIERS, QUANTILES, LayerConfig
from runtime.backends import EXACT, registry
from runtime.coreml import ane_limits
from runtime.drift import WINDOW_CHUNKS
from runtime.plan import Group, LayerCalibration, LayerPlan, WindowSpread


def tiers(data: LayerData, cfg: LayerConfig) -> tuple[list[int], list[int]]:
    """(capacity, tier index) of each resident expert, in rank order: tier t is the t-th contiguous popularity
    band, sized by its load quantile (a uniform `capacity` makes one tier)."""
    if cfg.capacity is not None:
        return [cfg.capacity] * cfg.resident, [0] * cfg.resident
    caps, tier_of = [], []
    bands = np.array_split(np.arange(cfg.resident) + cfg.gpu_head, min(cfg.tiers, cfg.resident))
    for t, (band, q) in enumerate(zip(bands, cfg.quantiles)):
        caps += data.capacities(int(band[0]), int(band[-1]) + 1, cfg.sizing)[QUANTILES.index(q)].tolist()
        tier_of += [t] * len(band)
    return caps, tier_of


def layer_plan(data: LayerData, cfg: LayerConfig, backend: str, exact: str = EXACT) -> LayerPlan:
    """The plan entry a decision means (pydantic objects built without re-validation: inputs are ours): the residents
    ranked after the `gpu_head` hottest experts; with a plan exact path `exact` off the CPU, the least popular
    `cpu_tail` cold experts run on cpu-exact (`exact_split`)."""
    h = cfg.gpu_head
    resident = [int(e) for e in data.rank[h:h + cfg.resident]]
    caps, tier_of = tiers(data, cfg) if resident else ([], [])
    compress = None if cfg.compress == "none" else cfg.compress
    groups = [Group.model_construct(backend=backend, experts=resident[i:i + cfg.group_size],
                                    capacities=caps[i:i + cfg.group_size],
                                    tier=tier_of[i:i + cfg.group_size], compress=compress)
              for i in range(0, len(resident), cfg.group_size)]
    after = [int(e) for e in data.rank[h + cfg.resident:]]
    tail = sorted(after[len(after) - min(cfg.cpu_tail, len(after)):]) if exact != EXACT else []
    cold = [int(e) for e in data.rank[:h]] + after
    return LayerPlan.model_construct(layer=data.layer, groups=groups, cpu_exact=sorted(cold),
                                     exact_split={EXACT: tail} if tail else None)


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
    return v + float(over_budget(resident, resident_bytes_budget))


def heuristic_config(data: LayerData, coverage: float = 0.8, group_size: int = 4, quantile: float = 0.9,
                     tiers: int = MAX_TIERS) -> LayerConfig:
    """The paper's heuristic: rank by popularity, hot experts (covering `coverage` of assignments) resident in
    fixed groups of four, three tiers at the 0.9 load quantile, overflow dropped."""
    share = np.cumsum(data.calib.sum(0)[data.rank]) / max(1, data.calib.sum())
    hot = int(np.searchsorted(share, coverage) + 1)
    hot = min(len(share), int(math.ceil(hot / group_size) * group_size))
    return LayerConfig(hot, min(group_size, hot), min(tiers, hot), (quantile,) * min(tiers, hot), "drop")
