"""The search: per-layer Optuna studies over the decision space, combined exactly under the global drop budget.

Strategy: each MoE layer gets its own Optuna study (multi-objective: predicted latency [and energy] on calibration
traces, held-out drops; hard limits as constraints), seeded with the paper's heuristic and two extremes. Layers
are independent but for the drop budget, which is global: a dynamic program over each layer's Pareto front picks
one decision per layer minimising the total cost with held-out drops within budget (exact over the candidates).
Where a layer's space is small it is also enumerated exactly; that yardstick is reported (`gap_vs_exact`).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np
import optuna
from tqdm import tqdm

from autotune.searching.space import (
    Evaluated,
    LayerConfig,
    LayerData,
    Scorer,
    calibration,
    config_from_params,
    enumerate_configs,
    group_sizes,
    heuristic_config,
    layer_plan,
    neighbours,
    params_of,
    space_size,
    suggest,
)
from runtime.errors import NpumoeError
from runtime.plan import OVERFLOW_POLICIES, ModelSpec, Plan, plan_from_json

OBJECTIVES = ("latency", "energy", "both")  # both: the Pareto front of latency and energy
EXACT_LIMIT = 40_000  # enumerate a layer's space when it has at most this many decisions
DP_MAX_BUDGET = 200_000  # drop units of the dynamic program; larger budgets are coarsened conservatively


@dataclass
class Solution:
    """One decision per layer and its predicted totals (latency/energy summed over calibration chunks)."""
    configs: list[LayerConfig]
    latency_ms: float
    energy_mj: float | None
    heldout_drops: int


@dataclass
class SearchOutcome:
    best: Solution
    baselines: dict[str, Solution]
    front: list[Solution] = field(default_factory=list)  # latency/energy Pareto front when both are searched
    gap_vs_exact: float | None = None  # (search-only cost / exact optimum) - 1, where the exact optimum exists
    trials: int = 0
    exact_layers: int = 0
    pool: list[list[Evaluated]] = field(default_factory=list)  # every candidate evaluated, per layer (robustness)
    drop_budget: int = 0  # held-out drops allowed, in assignments
    weights: tuple[float, float] = (1.0, 0.0)  # the (latency, energy) weights that chose `best`


def _objectives(score, objective: str) -> tuple:
    costs = {"latency": (score.latency_ms,), "energy": (score.energy_mj,),
             "both": (score.latency_ms, score.energy_mj)}[objective]
    return (*costs, float(score.heldout_drops))


def optuna_layer(data: LayerData, scorer: Scorer, objective: str, n_trials: int, storage: object | None,
                 study_name: str, seed: int, explore: float = 0.6) -> list[Evaluated]:
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
                    LayerConfig(n_experts, group_sizes(n_experts)[-1], 1, (1.0,), "drop")):
            study.enqueue_trial(params_of(cfg), skip_if_exists=True)

    def run_trial(trial: optuna.Trial) -> tuple:
        score = scorer.score(data, config_from_params(suggest(trial, n_experts), n_experts))
        trial.set_constraint("hard_limits", score.violation)
        return _objectives(score, objective)

    def complete() -> list[optuna.trial.FrozenTrial]:
        return [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]

    explore_n = int(n_trials * explore)
    if len(complete()) < explore_n:
        study.optimize(run_trial, n_trials=explore_n - len(complete()))
    expanded: set[LayerConfig] = set()
    while len(done := complete()) < n_trials:
        # best-first: expand the cheapest unexpanded decision among the front and the cheapest few
        seen = {config_from_params(t.params, n_experts) for t in done}
        # cost objectives (all but the last, drops) normalised and summed: one order for one or two objectives
        scale = np.maximum(np.max([t.values[:-1] for t in done], axis=0), 1e-12)
        cost = lambda t: float(np.sum(np.asarray(t.values[:-1]) / scale))  # noqa: E731
        cheapest = sorted(done, key=cost)[:8]  # the front alone can hide a cheap basin
        parents = sorted({t.number: t for t in cheapest + study.best_trials}.values(), key=cost)
        proposals: dict[LayerConfig, dict] = {}
        for t in parents:
            cfg = config_from_params(t.params, n_experts)
            if cfg in expanded:
                continue
            expanded.add(cfg)
            for q in neighbours(params_of(cfg), n_experts):
                if (c := config_from_params(q, n_experts)) not in seen:
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
    return [Evaluated(cfg, scorer.score(data, cfg)) for cfg in
            {config_from_params(t.params, n_experts) for t in complete()}]


def exact_layer(data: LayerData, scorer: Scorer) -> list[Evaluated]:
    return [Evaluated(cfg, scorer.score(data, cfg)) for cfg in enumerate_configs(data.calib.shape[1])]


def weighted_cost(latency_ms: float, energy_mj: float | None, weights: tuple[float, float]) -> float:
    """The scalar cost of a decision or a plan: weights on (latency, energy), each normalised by the caller
    (energy counts only where it is weighted: it may be None otherwise)."""
    wl, we = weights
    return wl * latency_ms + (we * energy_mj if we else 0.0)


def _pareto(points: list[tuple[float, int, int]]) -> list[tuple[float, int, int]]:
    """Points (cost, drops, index) not dominated in (cost, drops)."""
    out, best = [], math.inf
    for c, d, i in sorted(points, key=lambda p: (p[1], p[0])):
        if c < best:
            out.append((c, d, i))
            best = c
    return out


def combine(candidates: list[list[Evaluated]], drop_budget: int, weights: tuple[float, float]) -> list[int] | None:
    """Pick one candidate per layer minimising total cost with total held-out drops <= budget (exact DP over
    each layer's Pareto front). Returns chosen indices, or None when nothing fits."""
    scale = max(1, math.ceil(drop_budget / DP_MAX_BUDGET))
    budget = drop_budget // scale
    dp = np.zeros(budget + 1)
    choices = []
    for cands in candidates:
        front = _pareto([(weighted_cost(ev.score.latency_ms, ev.score.energy_mj, weights), ev.score.heldout_drops, i)
                         for i, ev in enumerate(cands)
                         if ev.score.violation == 0])
        new = np.full(budget + 1, np.inf)
        pick = np.full(budget + 1, -1, dtype=np.int64)
        for c, d, i in front:
            du = math.ceil(d / scale)  # rounding drops up keeps the coarse solution feasible
            if du > budget:
                continue
            cand = dp[:budget + 1 - du] + c
            better = cand < new[du:]
            new[du:][better] = cand[better]
            pick[du:][better] = i
        dp = new
        choices.append((pick, {i: math.ceil(d / scale) for _, d, i in front}))
    if not np.isfinite(dp[budget]):
        return None
    chosen, b = [], budget
    for pick, drops in reversed(choices):
        i = int(pick[b])
        chosen.append(i)
        b -= drops[i]
    return chosen[::-1]


def _solution(configs: list[LayerConfig], layers: list[LayerData], scorer: Scorer) -> Solution:
    scores = [scorer.score(d, c) for d, c in zip(layers, configs)]
    energies = [scorer.energy(d, c) for d, c in zip(layers, configs)]
    energy = None if any(e is None for e in energies) else sum(energies)
    return Solution(configs, sum(s.latency_ms for s in scores), energy, sum(s.heldout_drops for s in scores))


def _best_over_overflow(candidates: list[list[Evaluated]], layers, scorer, budget: int,
                        weights: tuple[float, float]) -> Solution | None:
    """The plan has one overflow policy: solve for each and keep the cheaper."""
    best = None
    for ov in OVERFLOW_POLICIES:
        per_layer = [[ev for ev in c if ev.config.overflow == ov or ev.config.resident == 0] for c in candidates]
        chosen = combine(per_layer, budget, weights)
        if chosen is None:
            continue
        sol = _solution([per_layer[l][i].config for l, i in enumerate(chosen)], layers, scorer)
        cost = weighted_cost(sol.latency_ms, sol.energy_mj, weights)
        if best is None or cost < best[0]:
            best = (cost, sol)
    return best[1] if best else None


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
        "cpu_only": [LayerConfig(0) for _ in layers],
        "naive_coreml": [LayerConfig(n, 1, capacity=u) for _ in layers],
        "uniform_grouped": [LayerConfig(n, min(4, n), capacity=u) for _ in layers],
        "paper_heuristic": [heuristic_config(d) for d in layers],
    }
    return {name: _solution(cfgs, layers, scorer) for name, cfgs in designs.items()}


def run_search(layers: list[LayerData], scorer: Scorer, *, objective: str = "latency", drop_budget: float = 0.10,
               trials: int = 60, storage: object | None = None, study_prefix: str = "npumoe", seed: int = 0,
               chunk_tokens: int = 256, exact_limit: int = EXACT_LIMIT, progress: bool = True) -> SearchOutcome:
    """Search every layer, combine under the held-out drop budget, compare with baselines and the exact yardstick."""
    if objective in ("energy", "both") and not scorer.cost.has_energy:
        raise NpumoeError(f"--objective {objective} needs power figures, and this profile has none "
                          "(it measured no energy); use --objective latency or a profile with energy")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    scorer = dataclasses.replace(scorer, with_energy=objective in ("energy", "both"))  # the caller's is left as is
    heldout_total = sum(int(d.heldout.sum()) for d in layers)
    budget = int(math.floor(drop_budget * heldout_total))
    searched, exact = [], []
    small = space_size(layers[0].calib.shape[1]) <= exact_limit
    for d in tqdm(layers, desc="search", unit="layer", disable=not progress):
        searched.append(optuna_layer(d, scorer, objective, trials, storage, f"{study_prefix}:L{d.layer}",
                                     seed + d.layer))
        if small:
            exact.append(exact_layer(d, scorer))
    base = baselines(layers, scorer, drop_budget, chunk_tokens)
    ref = base["cpu_only"]
    norm = (1.0 / max(ref.latency_ms, 1e-9), 1.0 / max(ref.energy_mj or 1.0, 1e-9))
    pool = [s + e for s, e in zip(searched, exact)] if small else searched
    # the heuristic is every study's first trial; adding it here too keeps "never worse than the heuristic" true
    # for studies resumed from a storage that another search version filled
    heuristic = [Evaluated(c, scorer.score(d, c)) for d, c in zip(layers, (heuristic_config(d) for d in layers))]
    pool = [p + [h] for p, h in zip(pool, heuristic)]
    weight_sets = {"latency": [(norm[0], 0.0)], "energy": [(0.0, norm[1])],
                   "both": [(a * norm[0], (1 - a) * norm[1]) for a in np.linspace(0, 1, 11)]}[objective]
    front = [s for w in weight_sets if (s := _best_over_overflow(pool, layers, scorer, budget, w))]
    if not front:
        raise NpumoeError(f"no plan meets the drop budget {drop_budget:.2%} on held-out traces")
    mid = weight_sets[len(weight_sets) // 2]
    best = _best_over_overflow(pool, layers, scorer, budget, mid)
    gap = None
    if small:
        only = _best_over_overflow(searched, layers, scorer, budget, mid)
        yard = _best_over_overflow(exact, layers, scorer, budget, mid)
        gap = (weighted_cost(only.latency_ms, only.energy_mj, mid) / weighted_cost(yard.latency_ms, yard.energy_mj, mid)
               - 1.0 if only and yard else None)
    return SearchOutcome(best, base, _pareto_solutions(front) if objective == "both" else [], gap,
                         trials * len(layers), len(exact), pool, budget, mid)


def _pareto_solutions(sols: list[Solution]) -> list[Solution]:
    sols = sorted(sols, key=lambda s: (s.latency_ms, s.energy_mj))
    out = []
    for s in sols:
        if not out or s.energy_mj < out[-1].energy_mj:
            out.append(s)
    return out


def solution_plan(sol: Solution, layers: list[LayerData], scorer: Scorer, model: dict, chunk_tokens: int,
                  saliency: str = "router_weight", predicted: dict | None = None, meta: dict | None = None) -> Plan:
    """The validated plan file a solution means, with each layer's calibration statistics."""
    overflow = next((c.overflow for c in sol.configs if c.resident), "drop")
    entries = [layer_plan(d, c, scorer.backend) for d, c in zip(layers, sol.configs)]
    entries = [e.model_copy(update={"calibration": calibration(d, e)}) for d, e in zip(layers, entries)]
    exact_below = scorer.cost.static_break_even(entries, [d.calib.mean(0) for d in layers], chunk_tokens,
                                                scorer.hidden, scorer.ffn, overflow)
    obj = {"schema": "npumoe.plan/1", "model": ModelSpec(**model).model_dump(), "chunk_tokens": chunk_tokens,
           "overflow": overflow, "saliency": saliency, "exact_below_tokens": exact_below,
           "layers": [e.model_dump(exclude_none=True) for e in entries], "predicted": predicted, "meta": meta}
    return plan_from_json({k: v for k, v in obj.items() if v is not None})


def timed_search(*args, **kwargs) -> tuple[SearchOutcome, float]:
    t0 = time.perf_counter()
    out = run_search(*args, **kwargs)
    return out, time.perf_counter() - t0
