"""The search: per chunk size, every layer's decisions scored in bulk, combined exactly under the global drop budget;
then Optuna per layer at the chosen chunk.

Strategy, for each candidate chunk size (the traces re-chunked: `LayerData.from_traces`):
1. each layer's candidates: where its space is small enough (`exact_limit`), every decision (the exact optimum);
   else the one-tier part of the space (every residency, group size, quantile, overflow and compression), all
   scored at once with numpy (`Scorer.score_rows`);
2. a dynamic program over each layer's Pareto front picks one decision per layer minimising the total cost with
   held-out drops within the budget (exact over the candidates), per overflow policy (a plan has one) and per way
   of running the prompts' last, partial chunk (padded static calls, or the exact path: `exact_below_tokens`).
The cheapest chunk wins; there each layer gets its own Optuna study (multi-objective: predicted latency [and
energy], held-out drops; hard limits as constraints), seeded with the paper's heuristic, two extremes and the layer's
decision from step 2, resumable from storage; its decisions join the candidates and the plan is combined again.
Where a layer's space was enumerated, Optuna alone is measured against that exact optimum (`gap_vs_exact`).
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import optuna
from tqdm import tqdm

from autotune.costing.whole_prefill import DensePlacement
from autotune.searching.decisions import calibration, heuristic_config
from autotune.searching.dense_choice import DenseChoice
from autotune.searching.layer_data import LayerData
from autotune.searching.scores import Scores, Weights, total_score, weighted_cost
from autotune.searching.scoring import Scorer
from autotune.searching.space import LayerConfig, Space
from runtime.backends import EXACT
from runtime.coreml import ane_limits
from runtime.errors import NpumoeError
from runtime.plan import DEFAULT_EXACT_BELOW_TOKENS, OVERFLOW_POLICIES, ModelSpec, Plan, plan_from_json


class WholeObjective(Protocol):  # `objective.WholePrefill`, the whole prefill the search minimises (it imports this)
    def candidates(self, search: ChunkSearch, *rest) -> list[Solution]: ...
    def cost(self, sol: Solution, *rest) -> float: ...
    def best(self, search: ChunkSearch, *rest) -> tuple[float, Solution] | None: ...


OBJECTIVES = ("latency", "energy", "both", "cpu")  # both: the Pareto front of latency and energy; cpu: CPU-busy time
CPU_TIE_BREAK = 1e-3  # --objective cpu: latency's weight, relative to CPU-busy time's
EXACT_LIMIT = 400_000  # enumerate a layer's space when it has at most this many decisions
DP_MAX_BUDGET = 200_000  # drop units of the dynamic program; larger budgets are coarsened conservatively
CHUNK_CHOICES = tuple(2 ** i for i in range(8, 13))  # 256 .. 4096 tokens


def chunk_candidates(prompt_tokens: int, context: int | None = None) -> list[int]:
    """The chunk sizes searched: CHUNK_CHOICES up to the prompt length and the model's context; a prompt shorter
    than the smallest is one chunk."""
    top = min(prompt_tokens, context or prompt_tokens)
    return [c for c in CHUNK_CHOICES if c <= top] or [top]


@dataclass
class Candidates:
    """One layer's evaluated decisions at one chunk size: canonical rows of the space and their scores."""
    rows: np.ndarray
    scores: Scores

    def merged(self, other: "Candidates") -> "Candidates":
        rows = np.concatenate([self.rows, other.rows])
        _, first = np.unique(rows, axis=0, return_index=True)
        first = np.sort(first)
        return Candidates(rows[first], Scores.concat([self.scores, other.scores]).take(first))


@dataclass
class Solution:
    """One decision per layer and its predicted totals (latency/energy summed over calibration chunks)."""
    configs: list[LayerConfig]
    latency_ms: float
    energy_mj: float | None
    heldout_drops: int
    chunk_tokens: int = 0
    exact_partial: bool = False  # prompts' last, partial chunks run on the exact path (else padded static calls)
    cpu_ms: float = 0.0  # predicted CPU-busy time, summed over calibration chunks
    dense: DensePlacement | None = None  # its own dense placement (a baseline's); None: its chunk size's choice
    baseline: str | None = None  # the report's baseline row it is, where it is one (`objective.PLAN_ROWS`)

    @property
    def overflow(self) -> str | None:
        """The plan's overflow policy: its layers' with residents (None: nothing resident, no policy applies)."""
        return next((c.overflow for c in self.configs if c.resident), None)


@dataclass
class ChunkSearch:
    """What the search saw and kept at one chunk size."""
    chunk_tokens: int
    layers: list[LayerData]
    pool: list[Candidates]  # per layer
    best: Solution | None = None


@dataclass
class SearchOutcome:
    best: Solution
    baselines: dict[str, Solution]
    front: list[Solution] = field(default_factory=list)  # latency/energy Pareto front when both are searched
    gap_vs_exact: float | None = None  # (search-only cost / exact optimum) - 1, where the exact optimum exists
    trials: int = 0
    exact_layers: int = 0
    chunks: dict[int, ChunkSearch] = field(default_factory=dict)  # every chunk size searched
    drop_budget: int = 0  # held-out drops allowed, in assignments
    weights: Weights = (1.0, 0.0, 0.0)  # the (latency, energy, CPU-busy time) weights that chose `best`
    space: Space | None = None
    dense: dict[int, DenseChoice] = field(default_factory=dict)  # the dense functions' choice per chunk size searched
    whole: WholeObjective | None = None  # the objective that picked `best` (None: the experts' alone)
    drop_rate: float = 0.0  # the drop budget as a share of held-out assignments (the baselines' uniform capacity)

    @property
    def dense_choice(self) -> DenseChoice | None:
        """The dense functions' choice at the chosen chunk size (None: the search left them out)."""
        return self.dense.get(self.best.chunk_tokens)

    @property
    def layers(self) -> list[LayerData]:
        """The layers' traces at the chosen chunk size."""
        return self.chunks[self.best.chunk_tokens].layers


def _objectives(score, objective: str) -> tuple:
    costs = {"latency": (score.latency_ms,), "energy": (score.energy_mj,),
             "both": (score.latency_ms, score.energy_mj), "cpu": (score.cpu_ms,)}[objective]
    return (*costs, float(score.heldout_drops))


def optuna_layer(data: LayerData, scorer: Scorer, space: Space, objective: str, n_trials: int,
                 storage: object | None, study_name: str, seed: int, seeds: list[LayerConfig] = (),
                 explore: float = 0.6) -> Candidates:
    """Run (or resume) one layer's study to `n_trials` finished trials; return every evaluated decision.

    The first `explore` share of trials is TPE's (multi-objective, constrained); the rest polish the Pareto front
    found so far: its one-step neighbours are enqueued as trials, so storage keeps them like any other."""
    n_experts = data.calib.shape[1]
    n_obj = 2 if objective != "both" else 3
    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=10)
    study = optuna.create_study(storage=storage, study_name=study_name, directions=["minimize"] * n_obj,
                                sampler=sampler, load_if_exists=True)
    if not study.trials:  # fresh study: seed it (a resumed one already holds its seeds, run or waiting)
        for cfg in (heuristic_config(data), LayerConfig(0),
                    LayerConfig(n_experts, space.dim("group_size").values[-1], 1, (1.0,), "drop"), *seeds):
            study.enqueue_trial(space.params_of(cfg), skip_if_exists=True)

    def run_trial(trial: optuna.Trial) -> tuple:
        score = scorer.score(data, space.config_from_params(space.suggest(trial)))
        trial.set_constraint("hard_limits", score.violation)
        return _objectives(score, objective)

    def complete() -> list[optuna.trial.FrozenTrial]:
        return [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]

    explore_n = max(1, int(n_trials * explore))  # at least one trial before the polish, which ranks the done ones
    if len(complete()) < explore_n:
        study.optimize(run_trial, n_trials=explore_n - len(complete()))
    expanded: set[LayerConfig] = set()
    while len(done := complete()) < n_trials:
        # best-first: expand the cheapest unexpanded decision among the front and the cheapest few
        seen = {space.config_from_params(t.params) for t in done}
        # cost objectives (all but the last, drops) normalised and summed: one order for one or two objectives
        scale = np.maximum(np.max([t.values[:-1] for t in done], axis=0), 1e-12)
        cost = lambda t: float(np.sum(np.asarray(t.values[:-1]) / scale))  # noqa: E731
        cheapest = sorted(done, key=cost)[:8]  # the front alone can hide a cheap basin
        parents = sorted({t.number: t for t in cheapest + study.best_trials}.values(), key=cost)
        proposals: dict[LayerConfig, dict] = {}
        for t in parents:
            cfg = space.config_from_params(t.params)
            if cfg in expanded:
                continue
            expanded.add(cfg)
            for q in space.neighbours(space.params_of(cfg)):
                if (c := space.config_from_params(q)) not in seen:
                    proposals.setdefault(c, q)
            if proposals:
                break
        if not proposals:  # a local optimum everywhere: spend what is left on TPE
            study.optimize(run_trial, n_trials=n_trials - len(done))
            break
        todo = list(proposals.values())[:n_trials - len(done)]
        for q in todo:
            study.enqueue_trial(q)
        study.optimize(run_trial, n_trials=len(todo))
    rows = np.unique(space.canonical(np.stack([space.row_of(t.params) for t in complete()])), axis=0)
    return Candidates(rows, scorer.score_rows(data, space, rows))


def screen_rows(space: Space, exact_limit: int, scorer: Scorer) -> tuple[np.ndarray, bool]:
    """(rows, exact): every decision where the space has at most `exact_limit`, else its one-tier part, with no GPU
    head and no CPU tail, or either of E/8 (Optuna refines them at the chosen chunk size); without the decisions
    another dominates whatever the traces: where the profile knows no decompression cost, weights stored in fewer bytes
    only shorten a call and ease the limits, so only the smallest allowed kind is scored."""
    if space.size() <= exact_limit:
        rows, exact = space.enumerate(), True
    else:
        one_tier = dataclasses.replace(space, dims=tuple(
            dataclasses.replace(d, values=(1,)) if d.field == "tiers" else d for d in space.dims
            if d.field not in ("gpu_head", "cpu_tail")))
        rows, exact = one_tier.enumerate(), False
        names = [p for p, _ in space.params]
        rows[:, names.index("tiers")] = 0  # tiers value 1 is index 0 in both
        if "cpu_tail" in names:  # each decision with each screened (head, tail), as the full space's rows
            k = space.dim("cpu_tail").values[np.searchsorted(space.dim("cpu_tail").values,
                                                             max(1, (len(space.dim("resident").values) - 1) // 8))]
            pairs = [(0, 0), (k, 0), (0, k)]
            index = lambda dim, v: space.dim(dim).values.index(v)  # noqa: E731
            at = names.index("gpu_head")  # the last two parameters: gpu_head, cpu_tail
            rows = np.concatenate([np.insert(rows, [at, at], [index("gpu_head", h), index("cpu_tail", t)], axis=1)
                                   for h, t in pairs])
            rows = np.unique(space.canonical(rows), axis=0)
    kinds = space.dim("compress").values
    if len(kinds) > 1 and not scorer.cost.decompresses(scorer.backend):
        smallest = min(kinds, key=lambda k: ane_limits.BYTES_PER_WEIGHT[k])
        rows = rows[(space.column(rows, "compress") == smallest) | (space.column(rows, "resident") == 0)]
    return rows, exact


def largest_groups(space: Space, cands: Candidates) -> Candidates:
    """The decisions that can be best: a larger group is one static call fewer and changes nothing else but the
    hard limits, so of decisions differing only in group size the largest within the limits dominates the rest
    (and decisions past a limit are never chosen)."""
    col = [p for p, _ in space.params].index("group_size")
    radices = [len(d.values) for _, d in space.params]
    key = np.ravel_multi_index(np.delete(cands.rows, col, axis=1).T, radices[:col] + radices[col + 1:])
    ok = np.nonzero(cands.scores.violation == 0)[0]
    order = ok[np.lexsort((-cands.rows[ok, col], key[ok]))]  # by key, largest group first
    first = order[np.concatenate([[True], key[order][1:] != key[order][:-1]])] if order.size else order
    first = np.sort(first)
    return Candidates(cands.rows[first], cands.scores.take(first))


def _pareto(cost: np.ndarray, drops: np.ndarray) -> np.ndarray:
    """Indices not dominated in (cost, drops), by increasing drops."""
    order = np.lexsort((cost, drops))
    c = cost[order]
    keep = c < np.minimum.accumulate(np.concatenate([[np.inf], c[:-1]]))
    return order[keep]


def usable(space: Space, cands: Candidates, policy: str) -> np.ndarray:
    """Which candidate decisions a plan with this overflow policy may take: within the limits, and either of the
    policy or with nothing resident (the policy does not apply)."""
    return (cands.scores.violation == 0) & ((space.column(cands.rows, "overflow") == policy) |
                                            (space.column(cands.rows, "resident") == 0))


def combine(costs: list[np.ndarray], drops: list[np.ndarray], drop_budget: int,
            relax: bool = False) -> list[int] | None:
    """Pick one candidate per layer minimising total cost with total held-out drops <= budget (exact DP over each
    layer's Pareto front; infinite cost = not allowed). Returns chosen indices, or None when nothing fits.

    A budget past DP_MAX_BUDGET is solved in coarse units of drops: rounded up, every choice fits the budget (a
    plan); with `relax`, rounded down, every choice that fits the budget stays allowed (the sum of the rounded-down
    drops is at most the rounded-down sum), so the least cost found is at most the true least cost: a bound, not
    always a plan. Within DP_MAX_BUDGET both are exact.

    dp[b] is the least cost of the layers so far within b drop units. Each layer keeps the dp it started from, not
    its choices: walking back, a layer's choice is the first of its front whose cost on top of that dp gives the
    value reached (the same additions as the forward pass, so equal exactly)."""
    scale = max(1, math.ceil(drop_budget / DP_MAX_BUDGET))
    budget = drop_budget // scale
    dp = np.zeros(budget + 1)
    cand = np.empty(budget + 1)
    layers = []
    for cost, drop in zip(costs, drops):
        cost, drop = np.asarray(cost, dtype=np.float64), np.asarray(drop, dtype=np.int64)
        # rounding drops up to units keeps the coarse solution feasible; down, it relaxes the problem
        front = [(i, drop[i] // scale if relax else math.ceil(drop[i] / scale)) for i in _pareto(cost, drop)
                 if np.isfinite(cost[i])]
        front = [(i, units) for i, units in front if units <= budget]
        new = np.full(budget + 1, np.inf)
        for i, units in front:
            n = budget + 1 - units
            np.add(dp[:n], cost[i], out=cand[:n])
            np.minimum(new[units:], cand[:n], out=new[units:])
        layers.append((dp, cost, front))
        dp = new
    if not np.isfinite(dp[budget]):
        return None
    chosen, b, reached = [], budget, dp[budget]
    for before, cost, front in reversed(layers):
        i, units = next((i, u) for i, u in front if u <= b and before[b - u] + cost[i] == reached)
        chosen.append(i)
        b -= units
        reached = before[b]
    return chosen[::-1]


def solution(configs: list[LayerConfig], layers: list[LayerData], scorer: Scorer,
             exact_partial: bool = False) -> Solution:
    """A plan's predicted totals, each layer scored through its plan entry (energy where the profile has power)."""
    scores = [scorer.score(d, c) for d, c in zip(layers, configs)]
    energies = [scorer.energy(d, c) for d, c in zip(layers, configs)]
    energy = None if any(e is None for e in energies) else sum(energies)
    total = total_score(scores)
    latency, cpu = total.latency_ms, total.cpu_ms
    if exact_partial:  # the partial chunks' padded static share swapped for their exact cost
        exact = total_score([scorer.partial_exact(d) for d in layers])
        latency += exact.latency_ms - total.partial_ms
        cpu += exact.cpu_ms - total.partial_cpu_ms
        if energy is not None:
            energy = None if exact.energy_mj is None or total.partial_mj is None else (
                energy + exact.energy_mj - total.partial_mj)
    drops = total.heldout_drops
    return Solution(configs, latency, energy, drops, layers[0].chunk_tokens if layers else 0, exact_partial, cpu)


def partial_modes(layers: list[LayerData]) -> list[bool]:
    """How the prompts' partial chunks may run: exactly, or as padded static calls (only when each has at least
    DEFAULT_EXACT_BELOW_TOKENS tokens: shorter ones always run exactly); without partial chunks, one way."""
    if not layers or not layers[0].partial.any():
        return [False]
    if layers[0].tokens[layers[0].partial].min() < DEFAULT_EXACT_BELOW_TOKENS:
        return [True]
    return [False, True]


def best_plan(search: ChunkSearch, space: Space, scorer: Scorer, budget: int, weights: Weights,
              pool: list[Candidates] | None = None) -> Solution | None:
    """The cheapest plan over `pool` (default: the chunk's): one overflow policy, one way of running the partial
    chunks, held-out drops within `budget`."""
    found = cheapest_plan(search, space, budget, weights, [(1.0, search.pool if pool is None else pool, scorer)])
    return None if found is None else solution(found[1], search.layers, scorer, found[2])


Term = tuple[float, list[Candidates], Scorer]  # a weight, each layer's candidates as one case scored them, its scorer


def cheapest_plan(search: ChunkSearch, space: Space, budget: int, weights: Weights, terms: list[Term],
                  relax: bool = False) -> tuple[float, list[LayerConfig], bool] | None:
    """(least cost, decisions, exact_partial) over every overflow policy and way of running the partial chunks: the
    exact DP over the candidates (the first term's rows; every term holds the same rows), each costed as the sum of
    weight x its weighted cost in each term, plus each term's partial chunks run exactly where they are. `relax`:
    a budget past DP_MAX_BUDGET relaxed (`combine`), so the cost is a lower bound rather than a plan's."""
    best = None
    for ov in OVERFLOW_POLICIES:
        for exact_partial in partial_modes(search.layers):
            costs, drops = [], []
            for layer, first in enumerate(terms[0][1]):
                total = np.zeros(len(first.rows))
                for weight, pools, _ in terms:
                    total += weight * weighted_cost(pools[layer].scores, weights, exact_partial)
                costs.append(np.where(usable(space, first, ov), total, np.inf))
                drops.append(first.scores.heldout_drops)
            chosen = combine(costs, drops, budget, relax)
            if chosen is None:
                continue
            cost = sum(c[i] for c, i in zip(costs, chosen)) + sum(
                weight * partial_cost(search.layers, sc, weights, exact_partial) for weight, _, sc in terms)
            if best is None or cost < best[0]:
                best = (cost, [space.config(p.rows[i]) for p, i in zip(terms[0][1], chosen)], exact_partial)
    return best


def partial_cost(layers: list[LayerData], scorer: Scorer, weights: Weights, exact_partial: bool) -> float:
    """What the prompts' partial chunks cost run on the exact path, whatever the decisions (0 when they run as
    the plan's static calls: then each decision's score holds them)."""
    return weighted_cost(total_score([scorer.partial_exact(d) for d in layers]), weights) if exact_partial else 0.0


def ranked_solutions(outcome: SearchOutcome, scorer: Scorer,
                     budget_fractions: tuple[float, ...] = (1.0, 0.5, 0.25, 0.0)) -> list[Solution]:
    """Whole-plan solutions by predicted cost (`solution_cost`), best first: the optimum of each chunk size at each
    share of the drop budget (fewer drops: closer to the unmodified model) and, where the search's objective is the
    whole prefill, its other candidates at each chunk size (`WholePrefill.candidates`). What a fidelity gate runs,
    in order, to keep the first that passes."""
    out, seen = [], set()
    for search in outcome.chunks.values():
        found = [best_plan(search, outcome.space, scorer, int(outcome.drop_budget * f), outcome.weights)
                 for f in budget_fractions]
        if outcome.whole is not None and search.best is not None:
            found += outcome.whole.candidates(search, outcome.dense.get(search.chunk_tokens), scorer, outcome.space,
                                              outcome.drop_budget, outcome.drop_rate, outcome.weights)
        for sol in found:
            key = sol and (sol.chunk_tokens, sol.exact_partial, tuple(sol.configs), sol.dense)
            if sol and key not in seen:
                seen.add(key)
                out.append(sol)
    return sorted(out, key=lambda s: solution_cost(outcome, s, scorer))


def solution_cost(outcome: SearchOutcome, sol: Solution, scorer: Scorer) -> float:
    """What the search minimised, of one whole plan: its whole prefill weighted (where the objective is the whole
    prefill), else its experts' weighted cost."""
    if outcome.whole is None:
        return weighted_cost(sol, outcome.weights)
    return outcome.whole.cost(sol, outcome.chunks[sol.chunk_tokens].layers, scorer,
                              outcome.dense.get(sol.chunk_tokens), outcome.weights)


def uniform_capacity(layers: list[LayerData], budget_rate: float, chunk_tokens: int) -> int:
    """Smallest uniform capacity whose calibration drop rate is within budget (what a uniform design would pick)."""
    total = sum(int(d.calib.sum()) for d in layers)
    lo, hi = 1, max(chunk_tokens, max(int(d.calib.max()) for d in layers))
    while lo < hi:
        mid = (lo + hi) // 2
        drops = sum(int(np.maximum(d.calib - mid, 0).sum()) for d in layers)
        lo, hi = (lo, mid) if drops <= budget_rate * total else (mid + 1, hi)
    return lo


def baselines(layers: list[LayerData], scorer: Scorer, budget_rate: float, chunk_tokens: int) -> dict[str, Solution]:
    n = layers[0].calib.shape[1]
    u = uniform_capacity(layers, budget_rate, chunk_tokens)
    designs = {
        "cpu_only": [LayerConfig(0, cpu_tail=n) for _ in layers],
        "naive_coreml": [LayerConfig(n, 1, capacity=u) for _ in layers],
        "uniform_grouped": [LayerConfig(n, min(4, n), capacity=u) for _ in layers],
        "paper_heuristic": [dataclasses.replace(heuristic_config(d), cpu_tail=n) for d in layers],  # cold: CPU
    }
    if scorer.splits_exact:  # every expert on the GPU's exact path, as mlx-lm runs them
        designs["mlx_gpu"] = [LayerConfig(0) for _ in layers]
    return {name: solution(cfgs, layers, scorer) for name, cfgs in designs.items()}


def run_search(workloads: list[LayerData] | dict[int, list[LayerData]], scorer: Scorer, space: Space, *,
               objective: str = "latency", drop_budget: float = 0.10, trials: int = 60,
               storage: object | None = None, study_prefix: str = "npumoe", seed: int = 0,
               exact_limit: int = EXACT_LIMIT, progress: bool = True,
               dense: Callable[[int, Weights, float], DenseChoice] | None = None,
               whole: WholeObjective | None = None) -> SearchOutcome:
    """Search every chunk size (`workloads`: the layers' traces per chunk size, or one chunk size's list), combine
    under the held-out drop budget, compare with baselines and, where the space is enumerated, the exact optimum.
    `dense(chunk, weights, resident_bytes)`: the dense functions' choice at a chunk size (`dense_choice.choose_dense`)
    beside the solution's resident experts. `whole`: the objective, the whole prefill of one prompt
    (`objective.WholePrefill`): the chunk size and the plan are the cheapest of its candidates at every chunk size;
    without it, the experts' cost (with the dense choice's beside it) picks them."""
    if objective in ("energy", "both") and not scorer.cost.has_energy:
        raise NpumoeError(f"--objective {objective} needs power figures, and this profile has none "
                          "(it measured no energy); use --objective latency or a profile with energy")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if isinstance(workloads, list):
        workloads = {workloads[0].chunk_tokens: workloads}
    scorer = dataclasses.replace(scorer, with_energy=objective in ("energy", "both"))  # the caller's is left as is
    first = next(iter(workloads.values()))
    budget = int(math.floor(drop_budget * sum(int(d.heldout.sum()) for d in first)))
    screen, exact = screen_rows(space, exact_limit, scorer)
    ref = baselines(first, scorer, drop_budget, first[0].chunk_tokens)["cpu_only"]
    norm = (1.0 / max(ref.latency_ms, 1e-9), 1.0 / max(ref.energy_mj or 1.0, 1e-9), 1.0 / max(ref.cpu_ms, 1e-9))
    weight_sets = {"latency": [(norm[0], 0.0, 0.0)], "energy": [(0.0, norm[1], 0.0)],
                   "both": [(a * norm[0], (1 - a) * norm[1], 0.0) for a in np.linspace(0, 1, 11)],
                   # CPU-busy time can reach 0 (every expert off the CPU): latency breaks the ties among such plans
                   "cpu": [(CPU_TIE_BREAK * norm[0], 0.0, norm[2])]}[objective]
    mid = weight_sets[len(weight_sets) // 2]
    chunks = {}
    bar = tqdm(total=len(workloads) * len(first) + len(first) * (trials > 0), desc="search", unit="layer",
               disable=not progress)
    for c, layers in workloads.items():
        pool = []
        for d in layers:
            pool.append(largest_groups(space, Candidates(screen, scorer.score_rows(d, space, screen))))
            bar.update()
        chunks[c] = search = ChunkSearch(c, layers, pool)
        search.best = best_plan(search, space, scorer, budget, mid)
    solved = [s for s in chunks.values() if s.best]
    if not solved:
        bar.close()
        raise NpumoeError(f"no plan meets the drop budget {drop_budget:.2%} on held-out traces")
    beside = lambda sol: resident_bytes(sol, scorer.hidden, scorer.ffn)  # noqa: E731  (the window's other part)
    dense_at = {s.chunk_tokens: dense(s.chunk_tokens, mid, beside(s.best)) for s in solved} if dense else {}

    def whole_best(s: ChunkSearch) -> tuple[float, Solution]:
        return whole.best(s, dense_at.get(s.chunk_tokens), scorer, space, budget, drop_budget, mid)

    at = min(solved, key=lambda s: whole_best(s)[0] if whole else weighted_cost(s.best, mid) + (
        weighted_cost(dense_at[s.chunk_tokens].score, mid) if dense else 0.0))
    gap = None
    if trials > 0:  # Optuna at the chosen chunk size, seeded with the screen's decisions
        searched = []
        for d, cfg in zip(at.layers, at.best.configs):
            searched.append(optuna_layer(d, scorer, space, objective, trials, storage,
                                         f"{study_prefix}:{space.digest()}:C{at.chunk_tokens}:L{d.layer}",
                                         seed + d.layer, seeds=[] if exact else [cfg]))
            bar.update()
        if exact:
            only = best_plan(at, space, scorer, budget, mid, pool=searched)
            gap = weighted_cost(only, mid) / weighted_cost(at.best, mid) - 1.0 if only else None
        at.pool = [p.merged(s) for p, s in zip(at.pool, searched)]
        at.best = best_plan(at, space, scorer, budget, mid)
        if dense:  # beside the experts the trials kept resident
            dense_at[at.chunk_tokens] = dense(at.chunk_tokens, mid, beside(at.best))
    bar.close()
    front = [s for w in weight_sets if (s := best_plan(at, space, scorer, budget, w))]
    best = min((whole_best(s) for s in solved), key=lambda p: p[0])[1] if whole else at.best
    picked = chunks[best.chunk_tokens]
    return SearchOutcome(best=best, baselines=baselines(picked.layers, scorer, drop_budget, best.chunk_tokens),
                         front=_pareto_solutions(front) if objective == "both" else [], gap_vs_exact=gap,
                         trials=trials * len(first) if trials > 0 else 0, exact_layers=len(first) if exact else 0,
                         chunks=chunks, drop_budget=budget, weights=mid, space=space, dense=dense_at, whole=whole,
                         drop_rate=drop_budget)


def resident_bytes(sol: Solution | list[LayerConfig], hidden: int, ffn: int) -> float:
    """The stored bytes of every expert a solution (or its layers' configs) keeps resident on its static backend."""
    configs = sol if isinstance(sol, list) else sol.configs
    return float(sum(c.resident * ane_limits.expert_weight_bytes(hidden, ffn, c.compress) for c in configs))


def _pareto_solutions(sols: list[Solution]) -> list[Solution]:
    sols = sorted(sols, key=lambda s: (s.latency_ms, s.energy_mj))
    out = []
    for s in sols:
        if not out or s.energy_mj < out[-1].energy_mj:
            out.append(s)
    return out


def exact_below(sol: Solution, entries: list, layers: list[LayerData], scorer: Scorer) -> int:
    """The plan's exact_below_tokens: the cost model's break-even, moved past the prompts' partial chunks when the
    search ran them exactly, or down to them when it charged their padded static calls."""
    c = sol.chunk_tokens
    be = scorer.cost.static_break_even(entries, [d.full_calib.mean(0) for d in layers], c, scorer.hidden,
                                       scorer.ffn, sol.overflow or "drop", scorer.exact)
    sizes = sorted({int(n) for n in layers[0].tokens[layers[0].partial]})
    if not sizes:
        return be
    if sol.exact_partial:
        return min(c, max(be, max(sizes) + 1))
    return max(DEFAULT_EXACT_BELOW_TOKENS, min(be, min(sizes)))


def solution_plan(sol: Solution, layers: list[LayerData], scorer: Scorer, model: dict, chunk_tokens: int | None = None,
                  saliency: str = "router_weight", predicted: dict | None = None, meta: dict | None = None,
                  dense: dict | None = None) -> Plan:
    """The validated plan file a solution means, with each layer's calibration statistics (and `dense`, the dense
    functions' placement: `dense_choice.dense_plan`)."""
    chunk_tokens = chunk_tokens or sol.chunk_tokens
    entries = [scorer.layer_plan(d, c) for d, c in zip(layers, sol.configs)]
    entries = [e.model_copy(update={"calibration": calibration(d, e)}) for d, e in zip(layers, entries)]
    obj = {"schema": "npumoe.plan/1", "model": ModelSpec(**model).model_dump(), "chunk_tokens": chunk_tokens,
           "overflow": sol.overflow or "drop", "saliency": saliency,
           "exact_below_tokens": exact_below(dataclasses.replace(sol, chunk_tokens=chunk_tokens), entries, layers,
                                             scorer),
           "layers": [e.model_dump(exclude_none=True) for e in entries], "dense": dense, "predicted": predicted,
           "meta": meta, "exact": scorer.exact if scorer.exact != EXACT else None}
    return plan_from_json({k: v for k, v in obj.items() if v is not None})


def timed_search(*args, **kwargs) -> tuple[SearchOutcome, float]:
    t0 = time.perf_counter()
    out = run_search(*args, **kwargs)
    return out, time.perf_counter() - t0
