"""How much a plan loses when the profile is wrong: regret under perturbed cost models, and the most robust plan.

A published profile is second-hand figures; a measured one has its held-out error. So for the chosen plan we ask:
if the ANE's fixed cost per call were half or twice the profile's, or one backend's compute per GFLOP 0.7x or 1.3x,
how much worse would the plan be than the best plan for that profile?

    regret(plan, case) = cost(plan | perturbed) / cost(best plan for the perturbed profile) - 1

where cost is the search's objective: predicted latency (summed over calibration chunks) for `--objective latency`,
predicted energy for `energy`, and for `both` the weighted sum that chose the plan. The best plan for a case is
re-optimised with the search's own machinery: every candidate decision the search evaluated per layer is re-scored
under the perturbed cost model and the exact per-layer DP (`search._best_over_overflow`) picks one per layer under
the same held-out drop budget. Where the search enumerated a layer's whole space, that optimum is exact over the
space; elsewhere it is over the search's candidates. The plan's own decisions are among the candidates, so
regret >= 0, and 0 when nothing changes.

Re-scoring every candidate under every case would cost as much as the search; it is not needed. In a case every
part of a layer's latency and energy is scaled by a factor in [lo, hi] (the perturbed part by the case's factor,
the rest by 1), so a candidate beaten by another with no more drops by more than hi/lo is beaten under the case too
and cannot be on that case's Pareto front: such candidates are pruned, exactly.

`--robust` picks, among the nominal plan, each case's optimum and the searched Pareto front, the plan with the
least worst-case regret (ties: the nominal plan).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from autotune.costing.costmodel import CostModel
from autotune.searching.optimizer import SearchOutcome, Solution, _best_over_overflow, _solution, weighted_cost
from autotune.searching.space import Evaluated, LayerConfig, LayerData, Scorer
from runtime.plan import OVERFLOW_POLICIES

CALL_FACTORS = (0.5, 2.0)  # the fixed cost per call of a backend off the CPU (the ANE)
GFLOP_FACTORS = (0.7, 1.3)  # each backend's compute time per GFLOP


@dataclass(frozen=True)
class Case:
    backend: str
    param: str  # a BackendModel coefficient: call_ms or ms_per_gflop
    factor: float

    @property
    def name(self) -> str:
        return f"{self.backend} {self.param} x{self.factor:g}"

    def apply(self, cost: CostModel) -> CostModel:
        """A copy of `cost` with this coefficient scaled (lookup tables are rebuilt for the copy)."""
        models = dict(cost.models)
        m = models[self.backend]
        models[self.backend] = dataclasses.replace(m, **{self.param: getattr(m, self.param) * self.factor})
        return CostModel(models, cost.host, cost.default_hidden)


def default_cases(cost: CostModel) -> list[Case]:
    """Fixed cost per call x0.5 and x2 for each backend that runs off the CPU (the ANE: its call cost is the least
    certain figure), compute per GFLOP x0.7 and x1.3 per backend."""
    cases = [Case(b, "call_ms", f) for b in cost.backends if cost.models[b].overlaps_cpu for f in CALL_FACTORS]
    return cases + [Case(b, "ms_per_gflop", f) for b in cost.backends for f in GFLOP_FACTORS]


def _prune(evs: list[Evaluated], ratio: float, weights: tuple[float, float]) -> list[Evaluated]:
    """Feasible candidates not beaten by more than `ratio` in cost by one with no more drops, per overflow policy
    (a plan has one policy; all-CPU decisions count for both)."""
    keep: dict = {}
    for ov in OVERFLOW_POLICIES:
        group = [e for e in evs if e.score.violation == 0 and (e.config.overflow == ov or e.config.resident == 0)]
        group.sort(key=lambda e: (e.score.heldout_drops, _cost(e.score, weights)))
        best = np.inf
        for e in group:
            best = min(best, _cost(e.score, weights))
            if _cost(e.score, weights) <= ratio * best:
                keep[e.config] = e
    return list(keep.values())


def _cost(x, weights: tuple[float, float]) -> float:
    """The search's scalar cost of a Score or a Solution (both carry latency_ms and energy_mj)."""
    return weighted_cost(x.latency_ms, x.energy_mj, weights)


@dataclass
class CaseResult:
    case: Case
    scorer: Scorer
    best: Solution  # the optimum under this case


def _plan_cost(configs: list[LayerConfig], layers: list[LayerData], scorer: Scorer,
               weights: tuple[float, float]) -> float:
    """From the scorer's cached scores (energy is in them where the objective weighs it)."""
    scores = [scorer.score(d, c) for d, c in zip(layers, configs)]
    energy = sum(s.energy_mj for s in scores) if weights[1] else None
    return weighted_cost(sum(s.latency_ms for s in scores), energy, weights)


def solve_cases(pool: list[list[Evaluated]], layers: list[LayerData], scorer: Scorer, budget: int,
                cases: list[Case], weights: tuple[float, float] = (1.0, 0.0)) -> list[CaseResult]:
    """Each case's best plan for the objective `weights`, re-optimised over the search's candidates (pruned
    exactly, see above)."""
    out = []
    for case in cases:
        lo, hi = min(1.0, case.factor), max(1.0, case.factor)
        sc = dataclasses.replace(scorer, cost=case.apply(scorer.cost), with_energy=weights[1] > 0)
        cands = [[Evaluated(e.config, sc.score(d, e.config)) for e in _prune(evs, hi / lo, weights)]
                 for d, evs in zip(layers, pool)]
        best = _best_over_overflow(cands, layers, sc, budget, weights)
        out.append(CaseResult(case, sc, best))
    return out


def regrets(configs: list[LayerConfig], layers: list[LayerData], results: list[CaseResult],
            weights: tuple[float, float] = (1.0, 0.0)) -> list[float]:
    return [_plan_cost(configs, layers, r.scorer, weights) / _cost(r.best, weights) - 1.0 for r in results]


@dataclass
class Robustness:
    max_regret: float
    cases: list[dict]
    robust: bool  # the plan was picked for least worst-case regret (--robust)
    candidates: int  # plans compared when picking
    seconds: float  # wall time of the analysis
    objective: str  # what the regret measures: the objective that chose the plan

    def to_json(self) -> dict:
        return {"max_regret": self.max_regret, "cases": self.cases, "robust_pick": self.robust,
                "candidates_compared": self.candidates,
                "seconds": self.seconds, "objective": self.objective,
                "definition": f"regret = predicted {self.objective} of the plan under the perturbed profile / that "
                              "of the best plan for it - 1 (re-optimised over the search's candidates, same drop "
                              "budget)"}


def assess(outcome: SearchOutcome, layers: list[LayerData], scorer: Scorer, chunks: int, pick: bool = False,
           cases: list[Case] | None = None) -> tuple[Solution, Robustness]:
    """(plan, Robustness): the outcome's best plan, or with `pick` the least worst-case-regret candidate (as a
    nominal Solution: predicted under the unperturbed profile). Regret is in the objective that chose the plan."""
    t0 = time.perf_counter()
    w = outcome.weights
    results = solve_cases(outcome.pool, layers, scorer, outcome.drop_budget, cases or default_cases(scorer.cost), w)
    plan, candidates = outcome.best, [outcome.best.configs]
    if pick:
        candidates += [r.best.configs for r in results] + [s.configs for s in outcome.front]
        worst = [max(regrets(c, layers, results, w), default=0.0) for c in candidates]
        i = int(np.argmin(worst))  # argmin keeps the first (nominal) plan on ties
        plan = outcome.best if i == 0 else _solution(candidates[i], layers, scorer)
    reg = regrets(plan.configs, layers, results, w)
    rows = []
    for r, g in zip(results, reg):
        mine = _solution(plan.configs, layers, r.scorer)
        rows.append({"case": r.case.name, "backend": r.case.backend, "param": r.case.param, "factor": r.case.factor,
                     "plan_latency_ms": mine.latency_ms / chunks, "best_latency_ms": r.best.latency_ms / chunks,
                     "plan_energy_mj": None if mine.energy_mj is None else mine.energy_mj / chunks,
                     "best_energy_mj": None if r.best.energy_mj is None else r.best.energy_mj / chunks,
                     "regret": g})
    objective = "latency" if w[1] == 0 else "energy" if w[0] == 0 else "weighted latency + energy"
    return plan, Robustness(max(reg, default=0.0), rows, pick, len(candidates), time.perf_counter() - t0, objective)
