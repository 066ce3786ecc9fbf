"""The best any schedule could do: the prompt's FLOPs split over the units at their fitted throughput, each unit busy
at most the makespan, the energy at most a cap (the GPU alone's, say), as a linear program.

Every op a plan runs costs at least its FLOPs at its unit's rate (a call, its bytes and a static function's padding
only add; a fitted residual below 1 would break this, and the published M2 Ultra profile has none), so no plan under
the same prices ends before `bound_ms`: `vs_latency_at_most` (a baseline's latency over
it) caps the plan's speedup, `over_roofline_at_least` (it over the roofline, every unit at full rate and no cap) caps
`over_roofline_whole` from below. With a cap, a unit whose energy per FLOP is high (the CPU) gets only the share the
cap leaves. Predicted from the profile's prices; what it leaves out (calls, bytes, padding, dependencies) makes any
real plan slower."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog

from autotune.costing.costmodel import EXACT, CostModel
from autotune.costing.whole_prefill import DecoderShape, unit_of


@dataclass
class UnitBound:
    """The LP's optimum: the makespan, and per unit the GFLOP it takes and its busy ms."""
    bound_ms: float
    gflop: dict[str, float]
    busy_ms: dict[str, float]
    energy_mj: float

    def to_json(self) -> dict:
        return {"bound_ms": round(self.bound_ms, 3), "energy_mj": round(self.energy_mj, 3),
                "units": {u: {"gflop": round(self.gflop[u], 3), "busy_ms": round(self.busy_ms[u], 3)}
                          for u in sorted(self.gflop)}}


def unit_rates(cost: CostModel, backends: list[str]) -> dict[str, tuple[float, float]]:
    """Per unit (`unit_of`) of `backends`: (ms per GFLOP of its matmul fit, power W; 0 where the profile has none);
    a unit several backends share (the CPU's) at its fastest backend's rate. A fit pricing no FLOPs adds no unit."""
    out: dict[str, tuple[float, float]] = {}
    for b in backends:
        rate = cost.dense_fit(b, "matmul").ms_per_gflop
        if rate <= 0:
            continue
        unit = unit_of(cost, b)
        got = (rate, cost.power_w(b) or 0.0)
        out[unit] = min(out.get(unit, got), got)
    return out


def unit_bound(rates: dict[str, tuple[float, float]], gflop: float, energy_cap_mj: float | None = None) -> UnitBound:
    """The least makespan over splits of `gflop` across the units of `rates` (unit -> (ms/GFLOP, W)), each unit's
    busy time its share at its rate, the energy (busy ms x W, mJ) at most `energy_cap_mj` (None: no cap)."""
    units = sorted(rates)
    r = np.array([rates[u][0] for u in units])
    p = np.array([rates[u][1] for u in units])
    n = len(units)
    c = np.r_[np.zeros(n), 1.0]  # variables: each unit's GFLOP, then the makespan
    a_ub = np.c_[np.diag(r), -np.ones(n)]  # busy ms <= makespan
    b_ub = np.zeros(n)
    if energy_cap_mj is not None:
        a_ub = np.r_[a_ub, [np.r_[r * p, 0.0]]]
        b_ub = np.r_[b_ub, energy_cap_mj]
    got = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=[np.r_[np.ones(n), 0.0]], b_eq=[gflop], bounds=[(0, None)] * (n + 1))
    if not got.success:
        raise ValueError(f"no split of {gflop:.1f} GFLOP fits the energy cap of {energy_cap_mj} mJ")
    g = got.x[:n]
    return UnitBound(float(got.x[-1]), dict(zip(units, map(float, g))), dict(zip(units, map(float, g * r))),
                     float(np.sum(g * r * p)))


def prefill_bound(cost: CostModel, shape: DecoderShape, prompt_tokens: int, static_backend: str,
                  baseline_ms: float, energy_cap_mj: float | None) -> dict:
    """The prompt's bound over the static backend's unit, the CPU and the GPU (where the profile prices one), with
    and without the CPU, at most `energy_cap_mj`: each with `vs_latency_at_most` (`baseline_ms` over its bound) and
    `over_roofline_at_least`; the prompt's GFLOP and each unit's rate (predicted)."""
    gflop = shape.flops_per_token((prompt_tokens + 1) / 2) * prompt_tokens / 1e9  # as `roofline_ms` counts them
    rates = unit_rates(cost, [static_backend, EXACT, cost.plan_exact()])
    roof = unit_bound(rates, gflop).bound_ms
    out = {"label": "predicted: the least makespan any split of the prompt's FLOPs over the units reaches at their "
                    "fitted rates, energy at most the cap (calls, bytes, padding and dependencies left out)",
           "gflop": round(gflop, 3), "energy_cap_mj": energy_cap_mj, "roofline_ms": round(roof, 3),
           "rates": {u: {"tflop_s": round(1.0 / r, 3), "power_w": w} for u, (r, w) in sorted(rates.items())}}
    for name, keep in (("all_units", rates), ("without_cpu", {u: v for u, v in rates.items() if u != "cpu"})):
        try:
            b = unit_bound(keep, gflop, energy_cap_mj)
        except ValueError:
            out[name] = None
            continue
        out[name] = {**b.to_json(), "vs_latency_at_most": round(baseline_ms / b.bound_ms, 4),
                     "over_roofline_at_least": round(b.bound_ms / roof, 4)}
    return out
