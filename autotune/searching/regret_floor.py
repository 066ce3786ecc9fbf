"""A lower bound on the worst-case regret of any plan built from the search's candidates, two cases at a time:
over every combination of the candidates' layer decisions for those two cases, by a Pareto dynamic programme over
layers in the two cases' costs. The drop budget enters as a Lagrange term: for any price mu >= 0 per dropped
assignment, min over plans within the budget of max(a, b) >= min over all combinations of max(a + mu*drops,
b + mu*drops) - mu*budget; the best of a few prices is kept (the plan's one overflow policy is relaxed, which only
lowers the bound).

The weighted bound of `robustness.minimax_plans` is a Lagrangian one. Where plans are few and far apart (a model of
four layers whose decisions are all-CPU or an ANE call that the cases price half or double), every plan that mixes
the two cases' optima loses in both, and the least weighted mean lies well below any plan's worst case. Two cases
that pull apart hold that gap, and for them this bound is exact.
"""
from __future__ import annotations

import numpy as np


def pareto(points: np.ndarray) -> np.ndarray:
    """The points of `points` ([n, 2]) that no other is at most in both coordinates (one of equal ones)."""
    order = np.lexsort((points[:, 1], points[:, 0]))
    p = points[order]
    before = np.minimum.accumulate(np.concatenate([[np.inf], p[:-1, 1]]))
    return p[p[:, 1] < before]


PRICES = (0.0, *np.geomspace(1e-3, 1.0, 6))  # mu x budget, in units of the cases' optima


def least_worst(steps: list[np.ndarray], drops: list[np.ndarray], budget: float, cap: float = np.inf) -> float:
    """A lower bound on min over one decision of each step, with total drops within `budget`, of the larger of the
    two coordinates' sums (`steps[k]`: [n, 2], a decision's cost in the two cases, each relative to its optimum,
    >= 0; `drops[k]`: [n] its held-out drops): the best over `PRICES` of the Lagrangian bound, each exact (the sums'
    Pareto front, step by step). Bounds above `cap` are not needed: partial sums past it are cut (costs only add),
    and a front cut empty bounds the minimum by `cap` itself."""
    best = -np.inf
    for price in PRICES:
        mu = price / max(budget, 1.0)
        limit = cap + mu * budget
        front = np.zeros((1, 2))
        for points, dropped in zip(steps, drops):
            p = points + mu * dropped[:, None]
            p = p[np.isfinite(p).all(1)]
            if not len(p):
                return float("inf")
            front = pareto((front[:, None, :] + pareto(p)[None, :, :]).reshape(-1, 2))
            front = front[front.max(1) <= limit]
            if not len(front):
                break
        best = max(best, (float(np.min(front.max(1))) if len(front) else limit) - mu * budget)
    return best
