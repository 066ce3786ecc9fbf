"""The plans the fidelity gate measures, in the order it measures them, so that it never leaves a user without
a plan: the search's pick and `optimizer.ranked_solutions` by what the search minimised (the whole prefill of one
prompt, `objective.WholePrefill`, where it is the objective), each compressed one followed by itself uncompressed,
a round of them at a time followed by the same plans tightened (drops turned to spills, then compression off), and
last, within at most ROUNDS rounds, the all-exact plans (`all_exact`): every expert on the plan's exact path where it
runs off the CPU, then the all-CPU plan, which runs what the model runs and so passes by construction."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from autotune.evaluation.gate import Candidate
from autotune.searching.optimizer import SearchOutcome, Solution, ranked_solutions, solution, solution_plan
from autotune.searching.scoring import Scorer
from autotune.searching.space import LayerConfig
from runtime.plan import ModelSpec

ROUNDS = 4  # rounds of --gate-candidates the gate measures at most; the last ends on the all-CPU plan


def _key(sol: Solution) -> tuple:
    return sol.chunk_tokens, sol.exact_partial, tuple(sol.configs), sol.dense


def _variant(sol: Solution, outcome: SearchOutcome, scorer: Scorer, residents_only: bool = False,
             **change) -> Solution | None:
    """`sol` with `change` in every layer's decision (or only where experts are resident; None when that changes
    nothing)."""
    configs = [dataclasses.replace(c, **change) if c.resident or not residents_only else c for c in sol.configs]
    if configs == sol.configs:
        return None
    return dataclasses.replace(solution(configs, outcome.chunks[sol.chunk_tokens].layers, scorer, sol.exact_partial),
                               dense=sol.dense)


def all_exact(outcome: SearchOutcome, scorer: Scorer, chunk_tokens: int) -> list[Solution]:
    """The gate's last candidates: where the plan's exact path runs off the CPU, every expert on it (what mlx-lm
    runs: no slower than the user's own runtime), then every expert on cpu-exact, the unmodified model's own
    computation, which passes by construction (MLX's CPU device computes bf16 rows in float32: not the bf16
    reference's rounding)."""
    layers = outcome.chunks[chunk_tokens].layers
    experts = layers[0].calib.shape[1]
    on_exact_path = [LayerConfig(0)] if scorer.splits_exact else []
    return [solution([cfg for _ in layers], layers, scorer, exact_partial=True)
            for cfg in (*on_exact_path, LayerConfig(0, cpu_tail=experts))]


def gate_order(outcome: SearchOutcome, scorer: Scorer, gate_tokens: int, per_round: int,
               rounds: int = ROUNDS) -> list[Solution]:
    """The candidates in the gate's order, each once, at most `rounds` rounds of `per_round`: the search's
    candidates `per_round` at a time, each batch followed by itself tightened (drops turned to spills, then
    uncompressed), and last the all-exact plans (`all_exact`). Only plans with a chunk the gate's `gate_tokens` hold
    (a longer chunk would run exactly there, unmeasured). Each is scored as the search scored its own (energy where it
    weighs it)."""
    scorer = dataclasses.replace(scorer, with_energy=outcome.weights[1] > 0)
    primary: list[Solution] = []
    for sol in [outcome.best, *ranked_solutions(outcome, scorer)]:
        primary += [s for s in (sol, _variant(sol, outcome, scorer, compress="none")) if s is not None]
    primary = _distinct(s for s in primary if s.chunk_tokens <= gate_tokens)
    ordered: list[Solution] = []
    for i in range(0, len(primary), per_round):
        batch = primary[i:i + per_round]
        ordered += batch
        for sol in batch:
            spill = _variant(sol, outcome, scorer, True, overflow="spill")
            ordered += [s for s in (spill, _variant(spill or sol, outcome, scorer, compress="none")) if s is not None]
    fits = [c for c in outcome.chunks if c <= gate_tokens]
    if not fits:
        return []
    exact = all_exact(outcome, scorer, outcome.best.chunk_tokens if outcome.best.chunk_tokens in fits else min(fits))
    return _ending_on(_distinct(ordered), exact, per_round * rounds)


def _ending_on(ordered: list[Solution], last: list[Solution], cap: int) -> list[Solution]:
    """At most `cap` of `ordered`, in order, with every plan of `last` that they do not hold after them."""
    head = ordered[:cap]
    while True:
        held = {_key(s) for s in head}
        missing = [s for s in last if _key(s) not in held]
        if len(head) + len(missing) <= cap:
            return head + missing
        head = head[:cap - len(missing)]


def _distinct(sols) -> list[Solution]:
    out, seen = [], set()
    for s in sols:
        if _key(s) not in seen:
            seen.add(_key(s))
            out.append(s)
    return out


def gate_candidates(sols: list[Solution], outcome: SearchOutcome, scorer: Scorer, spec: ModelSpec,
                    saliency: str, dense: Callable[[Solution], dict | None] = lambda sol: None
                    ) -> Iterator[Candidate]:
    """Each solution as the plan the gate runs (with `dense(sol)`, its dense functions), with its predicted latency
    (made as the gate reaches it): the whole prefill of one prompt where that is the search's objective, else the
    experts' per chunk."""
    for sol in sols:
        layers = outcome.chunks[sol.chunk_tokens].layers
        ms = sol.latency_ms / layers[0].calib_chunks if outcome.whole is None else outcome.whole.price(
            sol, layers, scorer, outcome.dense.get(sol.chunk_tokens)).latency_ms
        yield Candidate(solution_plan(sol, layers, scorer, spec.to_json(), sol.chunk_tokens, saliency,
                                      dense=dense(sol)), ms)
