"""How much a plan loses when the profile is wrong: regret under perturbed cost models, and the most robust plan.

A published profile is second-hand figures; a measured one has its held-out error. So for the chosen plan we ask:
if the ANE's fixed cost per call were half or twice the profile's, or one backend's compute per GFLOP 0.7x or 1.3x,
how much slower would the plan be than the best plan for that profile?

    regret(plan, case) = latency(plan | perturbed) / latency(best plan for the perturbed profile) - 1

(predicted latencies, summed over calibration chunks). The best plan for a case is re-optimised with the search's
own machinery: every candidate decision the search evaluated per layer is re-scored under the perturbed cost model
and the exact per-layer DP (`search._best_over_overflow`) picks one per layer under the same held-out drop budget.
Where the search enumerated a layer's whole space, that optimum is exact over the space; elsewhere it is over the
search's candidates. The plan's own decisions are among the candidates, so regret >= 0, and 0 when nothing changes.

Re-scoring every candidate under every case would cost as much as the search; it is not needed. In a case every
part of a layer's latency is scaled by a factor in [lo, hi] (the perturbed part by the case's factor, the rest by
1), so a candidate beaten by another with no more drops by more than hi/lo is beaten under the case too and cannot
be on that case's Pareto front: such candidates are pruned, exactly.

`--robust` picks, among the nominal plan, each case's optimum and the searched Pareto front, the plan with the
least worst-case regret (ties: the nominal plan).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .costmodel import CostModel
from .space import Evaluated, LayerData, Scorer

CALL_FACTORS = (0.5, 2.0)  # the ANE's fixed cost per call
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
    """ANE call cost x0.5 and x2 (where the profile has an ANE), compute per GFLOP x0.7 and x1.3 per backend."""
    cases = [Case("ane", "call_ms", f) for f in CALL_FACTORS if "ane" in cost.models]
    return cases + [Case(b, "ms_per_gflop", f) for b in cost.backends for f in GFLOP_FACTORS]


def _prune(evs: list[Evaluated], ratio: float) -> list[Evaluated]:
    """Feasible candidates not beaten by more than `ratio` in latency by one with no more drops, per overflow
    policy (a plan has one policy; all-CPU decisions count for both)."""
    keep: dict = {}
    for ov in ("drop", "spill"):
        group = [e for e in evs if e.score.violation == 0 and (e.config.overflow == ov or e.config.resident == 0)]
        group.sort(key=lambda e: (e.score.heldout_drops, e.score.latency_ms))
        best = np.inf
        for e in group:
            best = min(best, e.score.latency_ms)
            if e.score.latency_ms <= ratio * best:
                keep[e.config] = e
    return list(keep.values())


@dataclass
class CaseResult:
    case: Case
    scorer: Scorer
    best: object  # search.Solution: the optimum under this case


def _latency(configs, layers: list[LayerData], scorer: Scorer) -> float:
    return sum(scorer.score(d, c).latency_ms for d, c in zip(layers, configs))


def solve_cases(pool: list[list[Evaluated]], layers: list[LayerData], scorer: Scorer, budget: int,
                cases: list[Case]) -> list[CaseResult]:
    """Each case's best plan by latency, re-optimised over the search's candidates (pruned exactly, see above)."""
    from .search import _best_over_overflow

    out = []
    for case in cases:
        lo, hi = min(1.0, case.factor), max(1.0, case.factor)
        sc = dataclasses.replace(scorer, cost=case.apply(scorer.cost), with_energy=False)
        cands = [[Evaluated(e.config, sc.score(d, e.config)) for e in _prune(evs, hi / lo)]
                 for d, evs in zip(layers, pool)]
        best = _best_over_overflow(cands, layers, sc, budget, (1.0, 0.0))
        out.append(CaseResult(case, sc, best))
    return out


def regrets(configs, layers: list[LayerData], results: list[CaseResult]) -> list[float]:
    return [_latency(configs, layers, r.scorer) / r.best.latency_ms - 1.0 for r in results]


@dataclass
class Robustness:
    max_regret: float
    cases: list[dict]
    robust: bool  # the plan was picked for least worst-case regret (--robust)
    candidates: int  # plans compared when picking

    def to_json(self) -> dict:
        return {"max_regret": self.max_regret, "cases": self.cases, "robust_pick": self.robust,
                "candidates_compared": self.candidates,
                "definition": "regret = predicted latency of the plan under the perturbed profile / that of the "
                              "best plan for it - 1 (re-optimised over the search's candidates, same drop budget)"}


def assess(outcome, layers: list[LayerData], scorer: Scorer, chunks: int, pick: bool = False,
           cases: list[Case] | None = None):
    """(plan, Robustness): the outcome's best plan, or with `pick` the least worst-case-regret candidate (as a
    nominal Solution: predicted under the unperturbed profile)."""
    from .search import _solution

    results = solve_cases(outcome.pool, layers, scorer, outcome.drop_budget, cases or default_cases(scorer.cost))
    plan, candidates = outcome.best, [outcome.best.configs]
    if pick:
        candidates += [r.best.configs for r in results] + [s.configs for s in outcome.front]
        worst = [max(regrets(c, layers, results), default=0.0) for c in candidates]
        i = int(np.argmin(worst))  # argmin keeps the first (nominal) plan on ties
        plan = outcome.best if i == 0 else _solution(candidates[i], layers, scorer)
    reg = regrets(plan.configs, layers, results)
    rows = [{"case": r.case.name, "backend": r.case.backend, "param": r.case.param, "factor": r.case.factor,
             "plan_latency_ms": _latency(plan.configs, layers, r.scorer) / chunks,
             "best_latency_ms": r.best.latency_ms / chunks, "regret": g} for r, g in zip(results, reg)]
    return plan, Robustness(max(reg, default=0.0), rows, pick, len(candidates))
