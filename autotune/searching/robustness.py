"""How much a plan loses when the profile is wrong: regret under perturbed cost models, and the most robust plan.

A published profile is second-hand figures; a measured one has its held-out error. So for the chosen plan we ask:
if the ANE's fixed cost per call were half or twice the profile's, or one backend's compute per GFLOP 0.7x or 1.3x,
how much worse would the plan be than the best plan for that profile?

    regret(plan, case) = cost(plan | perturbed) / cost(best plan for the perturbed profile) - 1

where cost is the search's objective: predicted latency (summed over calibration chunks) for `--objective latency`,
predicted energy for `energy`, and for `both` the weighted sum that chose the plan. The best plan for a case is
re-optimised with the search's own machinery, over every chunk size: every candidate decision the search evaluated
per layer is re-scored under the perturbed cost model and the exact per-layer DP (`optimizer.best_plan`) picks one
per layer under the same held-out drop budget. Where the search enumerated a layer's whole space, that optimum is
exact over the space; elsewhere it is over the search's candidates. The plan's own decisions are among the
candidates, so regret >= 0, and 0 when nothing changes.

Re-scoring every candidate under every case would cost as much as the search; it is not needed. In a case every
part of a layer's latency and energy is scaled by a factor in [lo, hi] (the perturbed part by the case's factor,
the rest by 1), so a candidate beaten by another with no more drops by more than hi/lo is beaten under the case too
and cannot be on that case's Pareto front: such candidates are pruned, exactly.

`--robust` makes regret part of the choice: besides the nominal plan, each case's optimum and the searched Pareto
front, it solves, at every chunk size, the DP for a weighted sum of each case's cost relative to that case's
optimum, reweighting towards the worst case a few times (multiplicative weights: a minimax search over chunk,
residency and everything else the DP decides), and keeps the plan with the least worst-case regret (ties: the
nominal plan). The dense functions' placement is part of that choice: at each chunk size the search's placement or
any case's best placement (each a whole-prefill cost per case, added to the experts'), whichever leaves the least
worst-case regret.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from autotune.costing.costmodel import CostModel
from autotune.searching.optimizer import (
    DP_MAX_BUDGET,
    Candidates,
    SearchOutcome,
    Solution,
    best_plan,
    cheapest_plan,
    partial_cost,
    solution,
)
from autotune.searching.regret_floor import least_worst
from autotune.searching.scores import Weights, objective_name, weighted_cost
from autotune.searching.scoring import Scorer
from autotune.searching.space import Space
from runtime.backends import EXACT
from runtime.plan import OVERFLOW_POLICIES

CALL_FACTORS = (0.5, 2.0)  # the fixed cost per call of a backend off the CPU (the ANE)
GFLOP_FACTORS = (0.7, 1.3)  # each backend's compute time per GFLOP
REWEIGHTS = 6  # rounds of the --robust minimax reweighting
LINE_POINTS = 9  # then weightings tried between the two cases that pull apart
DESCENTS = 12  # candidates the --robust pick improves layer by layer
# The two-case floor where plans are few and far apart (few layers: the weighted bound's integrality gap is wide);
# with many layers, mixing the cases' optima layer by layer comes close to the weighted mean, and the Pareto fronts
# of 48 layers' sums cost minutes
PAIR_FLOOR_MAX_LAYERS = 8


@dataclass(frozen=True)
class Case:
    backend: str
    param: str  # a BackendModel coefficient: call_ms or ms_per_gflop
    factor: float

    @property
    def name(self) -> str:
        return f"{self.backend} {self.param} x{self.factor:g}"

    @property
    def spread(self) -> float:
        """hi / lo of the factors the case puts on any part of a cost."""
        return max(1.0, self.factor) / min(1.0, self.factor)

    def apply(self, cost: CostModel) -> CostModel:
        """A copy of `cost` with this coefficient scaled, the rest kept (its dense fits, bus, ranges); lookup tables
        are rebuilt for the copy."""
        models = dict(cost.models)
        m = models[self.backend]
        models[self.backend] = dataclasses.replace(m, **{self.param: getattr(m, self.param) * self.factor})
        return dataclasses.replace(cost, models=models, _lut={})


def default_cases(cost: CostModel) -> list[Case]:
    """Fixed cost per call x0.5 and x2 for each backend that runs off the CPU (the ANE: its call cost is the least
    certain figure), compute per GFLOP x0.7 and x1.3 per backend."""
    cases = [Case(b, "call_ms", f) for b in cost.backends if cost.models[b].overlaps_cpu for f in CALL_FACTORS]
    return cases + [Case(b, "ms_per_gflop", f) for b in cost.backends for f in GFLOP_FACTORS]


def prune(cands: Candidates, space: Space, ratio: float, weights: Weights) -> Candidates:
    """Feasible candidates not beaten by more than `ratio` in cost by one with no more drops, per overflow policy
    (a plan has one; all-CPU decisions count for both) and per way of running partial chunks."""
    s = cands.scores
    keep = np.zeros(len(s), dtype=bool)
    ov, none = space.column(cands.rows, "overflow"), space.column(cands.rows, "resident") == 0
    for policy in OVERFLOW_POLICIES:
        for exact_partial in (False, True):
            cost = weighted_cost(s, weights, exact_partial)
            idx = np.nonzero((s.violation == 0) & ((ov == policy) | none))[0]
            order = idx[np.lexsort((cost[idx], s.heldout_drops[idx]))]
            keep[order[cost[order] <= ratio * np.minimum.accumulate(cost[order])]] = True
    return Candidates(cands.rows[keep], s.take(np.nonzero(keep)[0]))


@dataclass
class CaseResult:
    case: Case
    scorer: Scorer
    best: Solution  # the optimum under this case, over every chunk size
    pools: dict[int, list[Candidates]]  # per chunk size, the pruned candidates re-scored under the case (the same
    # rows, in the same order, for every case)
    index: dict = dataclasses.field(default_factory=dict, repr=False)  # (chunk, layer) -> {row bytes: position}
    # the dense functions under the case, per chunk size: the search's placement, and the best one for the case
    # (empty: a search without dense decisions)
    plan_dense: dict[int, float] = dataclasses.field(default_factory=dict)
    best_dense: dict[int, float] = dataclasses.field(default_factory=dict)
    best_placement: dict[int, object] = dataclasses.field(default_factory=dict)  # the case's best DensePlacement
    dense_options: dict[int, dict] = dataclasses.field(default_factory=dict)  # chunk -> {placement: cost here}

    @property
    def best_cost(self) -> float:
        """The case's optimum: its experts and its best dense placement at that chunk size."""
        return _cost(self.best, self.weights) + self.best_dense.get(self.best.chunk_tokens, 0.0)

    weights: Weights = (1.0, 0.0, 0.0)

    def cost(self, sol: Solution, outcome: SearchOutcome, w: Weights) -> float:
        """A plan's cost under this case, from the re-scored candidates (decisions not among them: scored)."""
        search = outcome.chunks[sol.chunk_tokens]
        total = 0.0
        for layer, (d, cfg) in enumerate(zip(search.layers, sol.configs)):
            s = None
            if sol.chunk_tokens in self.pools:  # else a chunk size the case's optimum cannot be at: not re-scored
                pool, space = self.pools[sol.chunk_tokens][layer], outcome.space
                if (sol.chunk_tokens, layer) not in self.index:
                    self.index[sol.chunk_tokens, layer] = dict(zip(space.keys(pool.rows).tolist(),
                                                                   range(len(pool.rows))))
                i = self.index[sol.chunk_tokens, layer].get(space.key_of(cfg))
                s = None if i is None else pool.scores.at(i)
            total += weighted_cost(self.scorer.score(d, cfg) if s is None else s, w, sol.exact_partial)
        return (total + partial_cost(search.layers, self.scorer, w, sol.exact_partial)
                + self.plan_dense.get(sol.chunk_tokens, 0.0))


def _cost(x, weights: Weights) -> float:
    """The search's scalar cost of a Solution (its experts)."""
    return weighted_cost(x, weights)


def _nominal_dense(outcome: SearchOutcome, w: Weights, chunk: int) -> float:
    """The weighted cost of the search's dense placement at a chunk size (0 without dense decisions)."""
    choice = outcome.dense.get(chunk)
    return 0.0 if choice is None else weighted_cost(choice.score, w)


def _whole(sol: Solution, outcome: SearchOutcome, w: Weights) -> float:
    """A plan's nominal cost with its chunk size's dense functions: what the search compared chunk sizes on."""
    return _cost(sol, w) + _nominal_dense(outcome, w, sol.chunk_tokens)


def solve_cases(outcome: SearchOutcome, scorer: Scorer, cases: list[Case],
                weights: Weights | None = None) -> list[CaseResult]:
    """Each case's best plan for the objective `weights` (default: the outcome's), re-optimised over the search's
    candidates at every chunk size (pruned exactly, see above)."""
    w = outcome.weights if weights is None else weights
    spread = max((c.spread for c in cases), default=1.0)  # one pruned set for every case: their pools align
    kept = {c: [prune(p, outcome.space, spread, w) for p in search.pool] for c, search in outcome.chunks.items()}
    out, index = [], {}
    # chunk sizes by their nominal optimum: a chunk size whose optimum costs more than the best case plan found so
    # far divided by the case's least factor cannot hold the case's optimum (every part scales by >= that factor)
    order = sorted((s for s in outcome.chunks.values() if s.best), key=lambda s: _whole(s.best, outcome, w))
    for case in cases:
        sc = scorer.with_cost(case.apply(scorer.cost), with_energy=w[1] > 0)
        # a case on a backend the scores never read (cpu-static, when the groups run on the ANE; not the plan's
        # exact path, the GPU's where it has one) scores the same
        same = case.backend not in {scorer.cost.backend_model(b).name for b in (scorer.backend, EXACT, scorer.exact)}
        best_dense = {c: choice.best_under(sc.cost, w) for c, choice in outcome.dense.items()}
        dense = {c: (choice.cost_under(sc.cost, w), weighted_cost(best_dense[c].score, w))
                 for c, choice in outcome.dense.items()}
        pools, best, best_total = {}, None, np.inf
        for search in order:
            c = search.chunk_tokens
            if best is not None and min(1.0, case.factor) * _whole(search.best, outcome, w) >= best_total:
                continue
            pools[c] = kept[c] if same else [Candidates(p.rows, sc.score_rows(d, outcome.space, p.rows))
                                             for d, p in zip(search.layers, kept[c])]
            sol = best_plan(search, outcome.space, sc, outcome.drop_budget, w, pool=pools[c])
            if sol and _cost(sol, w) + dense.get(c, (0.0, 0.0))[1] < best_total:
                best, best_total = sol, _cost(sol, w) + dense.get(c, (0.0, 0.0))[1]
        out.append(CaseResult(case, sc, best, pools, index, {c: d[0] for c, d in dense.items()},
                              {c: d[1] for c, d in dense.items()}, {c: b.placement for c, b in best_dense.items()},
                              weights=w))  # one index: the pools' rows are the same
    for c, choice in outcome.dense.items():  # the placements a robust plan may take: the search's, each case's best
        options = dict.fromkeys([choice.placement, *(r.best_placement[c] for r in out)])
        for r in out:
            r.dense_options[c] = {p: choice.cost_under(r.scorer.cost, w, p) for p in options}
    return out


def dense_regrets(regs: list[float], chunk: int, results: list[CaseResult]) -> dict:
    """{placement: the case regrets of a plan whose experts have regrets `regs` (with the search's placement) with
    that dense placement instead}, for each placement the analysis offers at `chunk` (none: {None: regs})."""
    if not results or chunk not in results[0].dense_options:
        return {None: list(regs)}
    return {p: [g + excess(r.dense_options[chunk][p] - r.plan_dense[chunk], r.best_cost) for g, r in zip(regs, results)]
            for p in results[0].dense_options[chunk]}


def regrets(sol: Solution, outcome: SearchOutcome, results: list[CaseResult],
            weights: Weights | None = None) -> list[float]:
    w = outcome.weights if weights is None else weights
    return [over(r.cost(sol, outcome, w), r.best_cost) for r in results]


def over(cost: float, best: float) -> float:
    """A plan's regret in a case: its `cost` over the case's optimum `best`, less 1."""
    return cost / best - 1.0 if best > 0 else excess(cost, best)


def excess(extra: float, best: float) -> float:
    """`extra` cost relative to a case's optimum `best`. An optimum of 0 (a fit whose every term a plan uses is 0):
    nothing extra is no regret, anything extra is unbounded regret."""
    if best > 0:
        return extra / best
    return 0.0 if extra <= 0 else np.inf


def minimax_plans(outcome: SearchOutcome, scorer: Scorer,
                  results: list[CaseResult]) -> tuple[list[Solution], float | None]:
    """(plans, floor). Plans weigh every case's cost relative to its optimum, at every chunk size: regret as part
    of the choice. The weights move towards the worst case each round (multiplicative weights); then, where two
    cases pull apart (the ANE's call cost halved or doubled), along the line between those two.

    The floor is what no plan among the search's candidates can beat: a plan's worst-case regret is at least any
    weighted mean of its regrets, and the weighted DP finds the least weighted mean exactly (the pruning keeps
    every candidate that is best in some case, hence under any weighting); at a chunk size a case did not re-score,
    its regret is bounded by its least factor times the chunk's nominal optimum. The best such bound over every
    weighting tried. Where the drop budget is past what the DP solves exactly, the bound comes from the DP relaxed
    (drops rounded down to its units: `optimizer.combine`), still a bound, and the two-case floor counts drops
    exactly (`regret_floor`)."""
    if not results:
        return [], None
    lam = np.ones(len(results)) / len(results)
    plans, bounds = [], []
    for _ in range(REWEIGHTS):
        found = _at_weights(outcome, scorer, results, lam)
        if found is None:
            break
        plans.append(found[0])
        bounds.append(found[1])
        lam = lam * np.exp(4.0 * np.array(regrets(found[0], outcome, results)))
        lam /= lam.sum()
    pair = None
    if plans:
        worst = min(plans, key=lambda p: max(regrets(p, outcome, results)))
        i, j = np.argsort(regrets(worst, outcome, results))[-2:]
        cap = max(regrets(worst, outcome, results))  # a plan reaches it: a floor above it is not needed
        if len(outcome.layers) <= PAIR_FLOOR_MAX_LAYERS:
            pair = max(pair_floor(outcome, results, int(j), k, cap) for k in range(len(results)) if k != j)
        for a in np.linspace(0.0, 1.0, LINE_POINTS):
            lam = np.zeros(len(results))
            lam[i], lam[j] = a, 1.0 - a
            found = _at_weights(outcome, scorer, results, lam)
            if found is not None:
                plans.append(found[0])
                bounds.append(found[1])
    return plans, (max(bounds + ([pair] if pair is not None else [])) if bounds else None)


def pair_floor(outcome: SearchOutcome, results: list[CaseResult], i: int, j: int, cap: float = np.inf) -> float:
    """No plan of the search's candidates has a worst-case regret below this: the least larger regret of cases `i`
    and `j` over every combination of the candidates' layer decisions (`regret_floor.least_worst`) with each
    dense placement offered, over every chunk size and way of running partial chunks. At a chunk size a case did
    not re-score, the bound of `_at_weights`. Bounds past `cap` are cut to it: a chunk size whose layers' least
    costs (drops aside) already pass the best bound so far is skipped, and without partial chunks the two ways of
    running them are one."""
    w, a, b = outcome.weights, results[i], results[j]
    least = np.inf
    for c, search in outcome.chunks.items():
        if search.best is None:
            continue
        # a case that did not re-score this chunk size: its bound as `_at_weights` has it, its coordinate 0
        missing = max((min(1.0, r.case.factor) * _whole(search.best, outcome, w) / r.best_cost - 1.0
                       for r in (a, b) if c not in r.pools), default=-np.inf)
        here = [k for k, r in enumerate((a, b)) if c in r.pools]
        if not here:
            least = min(least, missing)
            continue
        scale = np.array([a.best_cost, b.best_cost])
        options = (a if c in a.pools else b).dense_options.get(c) or {None: 0.0}
        dense = np.array([[r.dense_options[c][p] if p is not None and c in r.pools else 0.0 for r in (a, b)]
                          for p in options])
        partial = any(d.partial.any() for d in search.layers)
        for exact_partial in (False, True) if partial else (False,):
            steps, drops = [], []
            for layer in range(len(search.layers)):
                scores = [r.pools[c][layer].scores if c in r.pools else None for r in (a, b)]
                ref = scores[here[0]]
                cost = np.stack([weighted_cost(sc, w, exact_partial) if sc is not None else np.zeros(len(ref.violation))
                                 for sc in scores], 1)
                steps.append(np.where((ref.violation == 0)[:, None], cost, np.inf) / scale)
                drops.append(np.asarray(ref.heldout_drops, dtype=np.float64))
            const = [partial_cost(search.layers, r.scorer, w, exact_partial) if c in r.pools else 0.0 for r in (a, b)]
            steps.append((dense + np.array(const)) / scale)
            drops.append(np.zeros(len(dense)))
            alone = sum(s.min(0) for s in steps)  # each case's least cost here, drops aside: a bound on both
            if max(missing, float(alone.max()) - 1.0) >= min(least, cap):
                least = min(least, max(missing, float(alone.max()) - 1.0))
                continue
            least = min(least, max(missing, least_worst(steps, drops, outcome.drop_budget, min(least, cap) + 1.0)
                                   - 1.0))
    return float(min(least, cap))


def _at_weights(outcome: SearchOutcome, scorer: Scorer, results: list[CaseResult],
                lam: np.ndarray) -> tuple[Solution, float] | None:
    """(the plan of least worst-case regret among each chunk size's plan for the weights `lam` on the cases'
    relative costs, the least weighted mean regret over every chunk size: a bound, see `minimax_plans`)."""
    w, space = outcome.weights, outcome.space
    best, least = None, np.inf
    for c, search in outcome.chunks.items():
        if search.best is None:
            continue
        here = [i for i, r in enumerate(results) if c in r.pools]
        bound = sum(lam[i] * (min(1.0, r.case.factor) * _whole(search.best, outcome, w) / r.best_cost - 1.0)
                    for i, r in enumerate(results) if i not in here)
        if here:
            terms = [(lam[i] / results[i].best_cost, results[i].pools[c], results[i].scorer) for i in here]
            found = cheapest_plan(search, space, outcome.drop_budget, w, terms)
            # the bound from the relaxed DP where the budget is coarsened (the plan's DP rounds drops up: its cost
            # may lie above the least one); within DP_MAX_BUDGET the two are one
            least_here = cheapest_plan(search, space, outcome.drop_budget, w, terms, relax=True) \
                if outcome.drop_budget > DP_MAX_BUDGET else found
            if least_here is None:
                continue
            options = results[here[0]].dense_options.get(c) or {None: 0.0}  # the weighted mean's least dense part
            dense = min(sum(lam[i] * (results[i].dense_options[c][p] if p is not None else 0.0) / results[i].best_cost
                            for i in here) for p in options)
            bound += least_here[0] + dense - sum(lam[i] for i in here)
            if found is not None and len(here) == len(results):  # a candidate plan only where it weighs every case
                found = (found[0], solution(found[1], search.layers, scorer, found[2]))
                worst = max(regrets(found[1], outcome, results))
                if best is None or worst < best[0]:
                    best = (worst, found[1])
        least = min(least, bound)
    return None if best is None else (best[1], least)


def descend(sol: Solution, outcome: SearchOutcome, scorer: Scorer, results: list[CaseResult],
            rounds: int = 64) -> Solution:
    """From `sol`, swap one layer's decision at a time for the one (among the candidates kept for the cases, same
    overflow policy, drops within budget) that lowers the worst-case regret most, while one does: reaches the
    minimax plans no weighting of the cases reaches (where the cases conflict, the best plan for any weighting is
    one extreme or the other)."""
    w, space, c = outcome.weights, outcome.space, sol.chunk_tokens
    search = outcome.chunks[c]
    if any(c not in r.pools for r in results):
        return sol
    best = np.array([r.best_cost for r in results])
    ov = sol.overflow
    layer_costs, drops, rows, current = [], [], [], []
    for layer, (d, cfg) in enumerate(zip(search.layers, sol.configs)):
        p = results[0].pools[c][layer]
        cost = np.stack([weighted_cost(r.pools[c][layer].scores, w, sol.exact_partial) for r in results],
                        1)  # [candidates, cases]
        ok = (p.scores.violation == 0) & ((space.column(p.rows, "resident") == 0) |
                                          (ov is None) | (space.column(p.rows, "overflow") == (ov or "drop")))
        cost[~ok] = np.inf
        mine = space.canonical(space.row_of(space.params_of(cfg)))[0]
        at = np.nonzero((p.rows == mine).all(1))[0]
        if at.size == 0 or not np.isfinite(cost[at[0]]).all():
            return sol  # the plan's decision was pruned away: nothing to step from
        layer_costs.append(cost)
        drops.append(p.scores.heldout_drops)
        rows.append(p.rows)
        current.append(int(at[0]))
    const = np.array([partial_cost(search.layers, r.scorer, w, sol.exact_partial) + r.plan_dense.get(c, 0.0)
                      for r in results])
    total = const + sum(lc[i] for lc, i in zip(layer_costs, current))
    used = sum(int(dr[i]) for dr, i in zip(drops, current))
    for _ in range(rounds):
        worst, move = float(np.max(total / best)), None
        for layer, (lc, dr) in enumerate(zip(layer_costs, drops)):
            trial = np.max((total - lc[current[layer]] + lc) / best, axis=1)
            trial[used - dr[current[layer]] + dr > outcome.drop_budget] = np.inf
            j = int(np.argmin(trial))
            if trial[j] < worst - 1e-12:
                worst, move = float(trial[j]), (layer, j)
        if move is None:
            break
        layer, j = move
        total += layer_costs[layer][j] - layer_costs[layer][current[layer]]
        used += int(drops[layer][j]) - int(drops[layer][current[layer]])
        current[layer] = j
    return solution([space.config(r[i]) for r, i in zip(rows, current)], search.layers, scorer, sol.exact_partial)


@dataclass
class Robustness:
    max_regret: float
    cases: list[dict]
    robust: bool  # the plan was picked for least worst-case regret (--robust)
    candidates: int  # plans compared when picking
    seconds: float  # wall time of the analysis
    objective: str  # what the regret measures: the objective that chose the plan
    nominal_max_regret: float = 0.0  # the nominal plan's worst-case regret
    cost_of_robustness: float = 0.0  # the plan's nominal cost / the nominal plan's - 1 (the trade --robust made)
    regret_floor: float | None = None  # --robust: no candidate plan's worst-case regret is below this (None: unknown)
    dense_choice: object | None = None  # --robust: the DenseChoice the pick takes where it is not the search's
    # the analysis, kept to report another plan on it (`reassess`): each case's optimum, the nominal plan's cost
    results: list[CaseResult] = dataclasses.field(default_factory=list, repr=False)
    nominal_cost: float = 0.0

    def to_json(self) -> dict:
        return {"max_regret": self.max_regret, "cases": self.cases, "robust_pick": self.robust,
                "candidates_compared": self.candidates,
                "nominal_max_regret": self.nominal_max_regret, "cost_of_robustness": self.cost_of_robustness,
                "regret_floor": self.regret_floor, "seconds": self.seconds, "objective": self.objective,
                "definition": f"regret = predicted {self.objective} of the plan under the perturbed profile / that "
                              "of the best plan for it - 1 (re-optimised over the search's candidates at every "
                              "chunk size, same drop budget)"}


def assess(outcome: SearchOutcome, scorer: Scorer, pick: bool = False,
           cases: list[Case] | None = None) -> tuple[Solution, Robustness]:
    """(plan, Robustness): the outcome's best plan, or with `pick` the least worst-case-regret candidate (as a
    nominal Solution: predicted under the unperturbed profile) and, where it is not the search's, the dense placement
    it takes (`Robustness.dense_choice`). Regret is in the objective that chose the plan."""
    t0 = time.perf_counter()
    w = outcome.weights
    results = solve_cases(outcome, scorer, cases or default_cases(scorer.cost), w)
    plan, candidates, floor, dense = outcome.best, [outcome.best], None, None
    nominal = _whole(outcome.best, outcome, w)
    if pick and nominal > 0:  # a plan costing 0 has no regret: every case's optimum is 0 too (factors are > 0)
        minimax, floor = minimax_plans(outcome, scorer, results)
        candidates += [r.best for r in results] + outcome.front + minimax
        worst = [max(regrets(c, outcome, results), default=0.0) for c in candidates]
        starts = {}  # the least worst-case regrets, each distinct plan once, improved layer by layer
        for i in np.argsort(worst, kind="stable"):
            starts.setdefault((candidates[i].chunk_tokens, candidates[i].exact_partial, *candidates[i].configs), i)
            if len(starts) == DESCENTS:
                break
        for i in starts.values():
            candidates.append(descend(candidates[i], outcome, scorer, results))
            worst.append(max(regrets(candidates[-1], outcome, results), default=0.0))
        # each candidate with the dense placement that leaves it the least worst-case regret (ties: the search's)
        picks = [min(dense_regrets(regrets(c, outcome, results), c.chunk_tokens, results).items(),
                     key=lambda kv: max(kv[1], default=0.0)) for c in candidates]
        worst = [max(regs, default=0.0) for _, regs in picks]
        i = int(np.argmin(worst))  # argmin keeps the first (nominal) plan on ties
        plan = outcome.best if i == 0 else solution(candidates[i].configs, outcome.chunks[
            candidates[i].chunk_tokens].layers, scorer, candidates[i].exact_partial)
        place = picks[i][0]
        if place is not None and place != outcome.dense[plan.chunk_tokens].placement:
            dense = outcome.dense[plan.chunk_tokens].priced(place, scorer.cost)
    analysis = Robustness(0.0, [], pick, len(candidates), 0.0, objective_name(w),
                          nominal_max_regret=max(regrets(outcome.best, outcome, results), default=0.0),
                          regret_floor=floor, results=results, nominal_cost=nominal)
    return plan, _report(outcome, analysis, plan, dense, t0)


def reassess(outcome: SearchOutcome, robustness: Robustness, plan: Solution) -> Robustness:
    """`robustness` reporting `plan` instead of its pick (the fidelity gate's choice, where the gate passed over the
    pick): the same cases and optima, the same candidates compared and the same floor (no candidate plan, this one
    included, has a worst-case regret below it); the pick's dense placement where `plan` is at its chunk size."""
    dense = robustness.dense_choice
    if dense is not None and dense.prediction.chunk_tokens != plan.chunk_tokens:
        dense = None
    return _report(outcome, robustness, plan, dense, time.perf_counter() - robustness.seconds)


def _report(outcome: SearchOutcome, analysis: Robustness, plan: Solution, dense, t0: float) -> Robustness:
    """`plan`'s regrets in each case (with the dense placement `dense`, None: the search's) on `analysis`."""
    w, results = outcome.weights, analysis.results
    reg = regrets(plan, outcome, results)
    if dense is not None:
        reg = dense_regrets(reg, plan.chunk_tokens, results)[dense.placement]
    layers = outcome.chunks[plan.chunk_tokens].layers
    per = 1.0 / max(layers[0].calib_chunks, 1e-12)  # figures per chunk of the plan's size
    rows = []
    for r, g in zip(results, reg):
        mine = solution(plan.configs, layers, r.scorer, plan.exact_partial)
        rows.append({"case": r.case.name, "backend": r.case.backend, "param": r.case.param, "factor": r.case.factor,
                     "plan_latency_ms": mine.latency_ms * per, "best_latency_ms": r.best.latency_ms * per,
                     "best_chunk_tokens": r.best.chunk_tokens,
                     "plan_energy_mj": None if mine.energy_mj is None else mine.energy_mj * per,
                     "best_energy_mj": None if r.best.energy_mj is None else r.best.energy_mj * per,
                     "regret": g})
    whole = _whole(plan, outcome, w) if dense is None else _cost(plan, w) + weighted_cost(dense.score, w)
    return dataclasses.replace(analysis, max_regret=max(reg, default=0.0), cases=rows,
                               seconds=time.perf_counter() - t0, cost_of_robustness=over(whole, analysis.nominal_cost),
                               dense_choice=dense)
