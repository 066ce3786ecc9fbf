"""`autotune search --measure K`: the search proves its pick on the machine it runs on.

After the fidelity gate, the K best distinct candidates by predicted whole prefill (`optimizer.ranked_solutions`,
the search's pick first) and the report's baselines that are plans (`objective.PLAN_ROWS`) are timed on this host
(`side_by_side.time_plans`: the calibration's held-out prompts, every plan interleaved, repeated, on the search's
threads). Each candidate's fidelity is the gate's verdict where the gate measured it, else measured now in one more
round of the gate (without the gate: not measured, `passed` null). A candidate running a lane this host only
simulates (ane-sim) is timed for nothing: its time is the simulator's, so it is measured for fidelity, not speed
(`measured_ms` null, `simulated` says which lane). The written plan is the fastest measured within the fidelity
limits. The report (`measure`): `candidates` (each with `predicted_ms`, `measured_ms`, `passed`), `kendall_tau`
(scipy's, predicted against measured), `measured_regret` (the written plan's measured time over the fastest
measured within the limits, minus 1) and `predicted_pick_regret` (the same of the search's predicted pick)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.stats import kendalltau

from autotune.calibration.traces import Traces
from autotune.calibration.workload import encode_text
from autotune.evaluation.gate import Candidate, GateSettings, run_gate
from autotune.measuring.side_by_side import clock_for, time_plans
from autotune.searching.optimizer import SearchOutcome, Solution, ranked_solutions
from autotune.searching.scoring import Scorer
from runtime.backends import registry
from runtime.errors import NpumoeError
from runtime.loading.compute_dtype import dtype_name
from runtime.loading.model_record import ModelRecord
from runtime.plan import Plan

DEFAULT_K = 8  # candidates timed by default on a profile measured on this host
PROMPTS = 2  # held-out prompts each candidate prefills
REPEATS = 3  # rounds over every candidate and prompt (the median is kept)


@dataclass
class Trial:
    """One candidate measured: its solution and plan, what the objective predicted (`predicted_ms` corrected by
    the profile's records, `parts_ms` as priced before it), and what this host measured."""
    name: str
    sol: Solution
    plan: Plan
    predicted_ms: float
    parts_ms: dict
    baseline: str | None = None
    passed: bool | None = None
    measured_ms: float | None = None
    simulated: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"name": self.name, "baseline": self.baseline, "chunk_tokens": self.plan.chunk_tokens,
                "predicted_ms": self.predicted_ms, "measured_ms": self.measured_ms, "passed": self.passed,
                "simulated": list(self.simulated), "predicted_parts_ms": self.parts_ms,
                **({"note": "measured for fidelity, not speed: a lane this host only simulates"}
                   if self.simulated else {})}


def heldout_prompts(record: ModelRecord, traces: Traces, prompt_tokens: int, n: int = PROMPTS) -> list[list[int]]:
    """Up to `n` prompts of `prompt_tokens` tokens of the calibration's held-out text (its held-out prompts' tokens,
    in order, cut to the length)."""
    if traces.chunk is None:
        raise NpumoeError("--measure times the plans on the calibration's held-out prompts, and these traces hold "
                          "counts only (synthetic): calibrate the model on a text, or give --measure 0")
    _, tokenizer = record.loaded()
    ids = encode_text(tokenizer, traces.header["text"], len(traces.chunk)).numpy()
    held = ids[np.nonzero(traces.heldout_chunks[traces.chunk])[0]]
    prompts = [held[s:s + prompt_tokens].tolist() for s in range(0, held.size - prompt_tokens + 1, prompt_tokens)]
    if not prompts:
        raise NpumoeError(f"--measure: the calibration holds {held.size} held-out tokens, less than one "
                          f"{prompt_tokens}-token prompt; calibrate on a longer text, or give --measure 0")
    return prompts[:n]


def fidelity(record: ModelRecord, trials: list[Trial], gated: dict | None, gated_plans: list[Plan],
             settings: GateSettings | None, progress: bool, **gate_options) -> None:
    """Each trial's `passed`: the gate's verdict on the same plan where it measured it, else measured now in one
    round of the gate (None without the gate)."""
    if settings is None:
        return
    verdict = {_key(p): r["passed"] for p, r in zip(gated_plans, _first_rows(gated))}
    todo = [t for t in trials if _key(t.plan) not in verdict]
    if todo:
        rows = run_gate(record, [Candidate(t.plan, t.predicted_ms) for t in todo],
                        dataclasses.replace(settings, candidates=len(todo)), progress=progress, **gate_options)
        verdict |= {_key(t.plan): r["passed"] for t, r in zip(todo, _first_rows(rows))}
    for t in trials:
        t.passed = verdict[_key(t.plan)]


def _first_rows(gated: dict | None) -> list[dict]:
    """The gate's rows in candidate order, each candidate's last measurement (a kernel fallback remeasures)."""
    rows: dict[int, dict] = {}
    for r in (gated or {}).get("candidates", []):
        rows[r["candidate"]] = r
    return [rows[i] for i in sorted(rows)]


def _key(plan: Plan) -> str:
    return plan.model_dump_json(exclude={"predicted", "meta", "cpu_weights"})


def time_trials(record: ModelRecord, trials: list[Trial], prompts: list[list[int]], threads: int, engine: str,
                repeats: int = REPEATS) -> None:
    """Each trial's measured whole prefill per prompt on this host (every plan interleaved), on `threads`."""
    timed = time_plans(record.name, {t.name: t.plan for t in trials}, prompts, repeats=repeats, threads=threads,
                       dtype=dtype_name(record.compute_dtype), engine=engine)
    clock = clock_for(threads)
    for t in trials:
        t.simulated = timed[t.name].simulated + dense_stand_ins(t.plan)
        t.measured_ms = None if t.simulated else timed[t.name].whole_ms(clock)


def dense_stand_ins(plan: Plan) -> tuple[str, ...]:
    """The backends the plan's dense functions name that this host runs through a stand-in
    (`side_by_side.simulated_lanes` names the groups' only), each as "name -> what runs it"."""
    names = sorted(plan.dense.backends) if plan.dense is not None else []
    return tuple(f"{n} -> {used}" for n in names if (used := registry.resolve(n).name) != n)


def summary(trials: list[Trial], pick: Trial, predicted_pick: Trial, prompts: int, threads: int) -> dict:
    """The report's `measure`: every trial, the rank correlation of predicted and measured, the regrets."""
    timed = [t for t in trials if t.measured_ms is not None]
    within = [t.measured_ms for t in timed if t.passed is not False]
    tau = kendalltau([t.predicted_ms for t in timed], [t.measured_ms for t in timed]).statistic \
        if len(timed) > 1 else None
    regret = lambda t: None if t.measured_ms is None or not within else t.measured_ms / min(within) - 1.0  # noqa: E731
    return {"label": f"measured on this host: {prompts} held-out prompt(s), {REPEATS} interleaved rounds, "
                     f"{threads} thread(s); predicted_ms by the cost model with the profile's plan records",
            "candidates": [t.to_json() for t in trials], "chosen": pick.name,
            "kendall_tau": None if tau is None or np.isnan(tau) else float(tau),
            "measured_regret": regret(pick), "predicted_pick": predicted_pick.name,
            "predicted_pick_regret": regret(predicted_pick)}


def measured_best(trials: list[Trial]) -> Trial:
    """The fastest trial measured within the fidelity limits; where none was timed, the first (the search's pick)."""
    timed = [t for t in trials if t.measured_ms is not None and t.passed is not False]
    return min(timed, key=lambda t: t.measured_ms) if timed else trials[0]


def candidates(outcome: SearchOutcome, scorer: Scorer, k: int) -> list[Solution]:
    """The search's pick, then the next best distinct candidates by predicted whole prefill up to `k` in all, then
    the baselines that are plans at the pick's chunk size not among them."""
    whole = outcome.whole
    at = outcome.chunks[outcome.best.chunk_tokens]
    rows = [s for s in whole.candidates(at, outcome.dense.get(at.chunk_tokens), scorer, outcome.space,
                                        outcome.drop_budget, outcome.drop_rate, outcome.weights) if s.baseline]
    out, seen = [], set()
    for sol in [outcome.best, *ranked_solutions(outcome, scorer), *rows]:
        key = (sol.chunk_tokens, sol.exact_partial, tuple(sol.configs), sol.dense)
        if key not in seen and (len(out) < k or sol.baseline):
            seen.add(key)
            out.append(sol)
    return out


def measure_search(record: ModelRecord, traces: Traces, outcome: SearchOutcome, scorer: Scorer, k: int,
                   plan_of: Callable[[Solution], Plan], gated: dict | None, gated_sols: list[Solution],
                   settings: GateSettings | None, threads: int, engine: str, progress: bool = True,
                   **gate_options) -> tuple[Solution, dict, list[Trial]]:
    """The candidates (`candidates`) measured on this host for fidelity and speed; (the written plan's solution,
    the report's `measure`, the trials)."""
    whole, raw = outcome.whole, dataclasses.replace(outcome.whole, factors=())
    trials = []
    for i, sol in enumerate(candidates(outcome, scorer, k)):
        layers, choice = outcome.chunks[sol.chunk_tokens].layers, outcome.dense.get(sol.chunk_tokens)
        trials.append(Trial(f"candidate {i}" + (f" ({sol.baseline})" if sol.baseline else ""), sol, plan_of(sol),
                            whole.price(sol, layers, scorer, choice).latency_ms,
                            raw.price(sol, layers, scorer, choice).parts_ms, sol.baseline))
    fidelity(record, trials, gated, [plan_of(s) for s in gated_sols[:len(_first_rows(gated))]], settings, progress,
             **gate_options)
    prompts = heldout_prompts(record, traces, whole.prompt_tokens)
    time_trials(record, trials, prompts, threads, engine)
    pick = measured_best(trials)
    return pick.sol, summary(trials, pick, trials[0], len(prompts), threads), trials
