"""The pipeline as library functions: describe a model, measure a device, calibrate routing traces, search a plan,
build its Core ML package, run and evaluate a plan. Each `autotune` command is a thin argparse front over one of
them; they show progress on stderr (tqdm) and notes through the `npumoe` logger, never on stdout, and raise
`NpumoeError` on bad input. A planned model is loaded by `runtime.load`, the one way to load one.

Outputs are written whole (atomically; a search's plan and its sidecars as one set). Checking that an output can be
written before the work starts is the caller's (the commands do it, naming their option).
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import statistics
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from autotune.calibration import modelstats
from autotune.calibration.texts import DEFAULT_CALIB_TEXT, DEFAULT_EVAL_TEXT
from autotune.calibration.traces import (
    HELDOUT_EVERY,
    Traces,
    default_traces_path,
    load_traces,
    record_run_traces,
    record_traces,
    require_heldout,
    require_recordable,
    save_traces,
)
from autotune.calibration.workload import encode_text
from autotune.costing.memory import against_measured, ane_budget_bytes, model_size, predict_memory, simulated_functions
from autotune.evaluation.gate import Candidate, GateSettings, refusal, run_gate
from autotune.profiling.profile import (
    Profile,
    ProfileHostWarning,
    host_profile_path,
    load_profile,
    published_note,
    save_profile,
)
from autotune.searching.backend_choice import choose_static_backend
from autotune.searching.explain import explain
from autotune.searching.optimizer import chunk_candidates, ranked_solutions, solution, solution_plan, timed_search
from autotune.searching.report import add_cpu_figures, plot_pareto, plot_plan_map, search_report, sidecar
from autotune.searching.robustness import assess
from autotune.searching.space import LayerData, Scorer, layer_space
from runtime.backends import registry
from runtime.errors import NpumoeError
from runtime.fileio import atomic_write_json, output_set
from runtime.generation import Loaded, load, prompt_ids
from runtime.loading.checkpoints import check_token_ids
from runtime.loading.model_loader import (
    TINY_MOE_DIR,
    context_length,
    load_model,
    model_spec,
    moe_layers,
    read_model_spec,
)
from runtime.plan import Plan, check_plan_matches, load_plan, save_plan
from runtime.prefill import max_rel_diff, prefill_prompts_logits
from runtime.resources import Clock, peak_rss_bytes

log = logging.getLogger("npumoe")

# calibration defaults, shared by `calibrate` and the calibration `search` runs when traces are missing
CHUNK_TOKENS, PROMPT_TOKENS, MAX_TOKENS = 256, 1024, 32768
SHIFT_TOLERANCE = 1.5  # a plan "holds" on shifted text when its measured drop rate is within 1.5x its budget
_ABOUT = {"tiny-moe": f"embedded trained Qwen3-MoE ({TINY_MOE_DIR}, see MODEL_CARD.md)"}


# --- models ---------------------------------------------------------------------------------------------------------
def describe_model(name: str, text: str = DEFAULT_CALIB_TEXT, *, max_tokens: int = 16384,
                   dtype: str = "auto") -> dict:
    """Shape, size and per-layer expert load shares of one model on the first `max_tokens` tokens of `text`
    (one entry of `autotune models --json`)."""
    model, tokenizer = load_model(name, dtype)
    spec = model_spec(model)
    ids = encode_text(tokenizer, text, max_tokens).tolist()
    if len(ids) < 2:
        raise NpumoeError(f"--text {text!r} holds too few tokens")
    shares = modelstats.shares(modelstats.expert_counts(model, ids))
    return {
        "name": name,
        "about": _ABOUT.get(name, "seeded random model of this transformers MoE family (for tests)"),
        "architecture": spec.architecture,
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "layers": spec.num_layers,
        "moe_layers": spec.moe_layers,
        "experts": spec.num_experts,
        "top_k": spec.top_k,
        "hidden_size": spec.hidden_size,
        "expert_ffn_size": spec.expert_ffn_size,
        "text": text,
        "tokens": len(ids),
        "max_share_x_uniform": [round(float(x), 3) for x in modelstats.skew(shares)],
        "expert_shares": {str(l): np.round(row, 4).tolist() for l, row in zip(spec.moe_layers, shares)},
    }


# --- profile --------------------------------------------------------------------------------------------------------
def profile_device(backends: list[str] | None = None, *, quick: bool = False, threads: int = 1,
                   shapes: dict[str, tuple[int, int]] | None = None, clock: str = "auto",
                   out: str | os.PathLike | None = None, progress: bool = True) -> Profile:
    """Measure this host's backends, fit the cost model and save the profile to `out` (default: this host's cache,
    `host_profile_path()`); returns it with `path` set."""
    from autotune.profiling.device import profile_device as measure
    from autotune.profiling.settings import settings_for

    s = settings_for(quick)
    if shapes:
        s = dataclasses.replace(s, shapes=shapes)
    profile = measure(backends, quick, threads, progress=progress, s=s, clock=clock)
    out = out or host_profile_path()
    save_profile(profile, out)
    profile.path = str(out)
    return profile


# --- calibrate ------------------------------------------------------------------------------------------------------
@dataclass
class Calibration:
    path: str  # the traces file written
    traces: Traces
    summary: dict  # what `calibrate --json` prints


def calibrate(model: str, text: str = DEFAULT_CALIB_TEXT, *, chunk: int = CHUNK_TOKENS,
              prompt_tokens: int = PROMPT_TOKENS, max_tokens: int = MAX_TOKENS, out: str | os.PathLike | None = None,
              dtype: str = "auto", progress: bool = True) -> Calibration:
    """Record `model`'s routing on `text` (a file or a built-in text name) and save the traces to `out` (default
    `traces/<model>.npz`)."""
    if chunk > prompt_tokens:
        raise NpumoeError(f"--chunk {chunk} is longer than --prompt-tokens {prompt_tokens}: a prompt is prefilled in "
                          "chunks of at most its length; give --chunk <= --prompt-tokens")
    path = str(out or default_traces_path(model))
    loaded, tokenizer = load_model(model, dtype)
    ids = encode_text(tokenizer, text, max_tokens)
    check_token_ids(loaded, ids)
    prompts = -(-len(ids) // prompt_tokens)
    if prompts < HELDOUT_EVERY:
        raise NpumoeError(f"{len(ids)} tokens of {text} make {prompts} prompt(s) of {prompt_tokens} tokens; held-out "
                          f"chunks come from every {HELDOUT_EVERY}th prompt, so give at least "
                          f"{HELDOUT_EVERY * prompt_tokens} tokens (a longer --text, a larger --max-tokens or a "
                          "smaller --prompt-tokens)")
    traces = record_traces(loaded, ids, chunk, prompt_tokens, text, progress=progress)
    save_traces(traces, path)
    return Calibration(path, traces, _calibration_summary(traces, path))


def _calibration_summary(traces: Traces, path: str) -> dict:
    layers = traces.header["model"]["moe_layers"]
    shares = {str(l): (traces.counts(l, "calib").sum(0) / max(1, traces.counts(l, "calib").sum())).round(4).tolist()
              for l in layers}
    return {"traces": path, "tokens": traces.header["tokens"], "chunks": traces.n_chunks,
            "heldout_chunks": int(traces.heldout_chunks.sum()),
            "max_expert_share_x_uniform": {l: float(np.max(s) * len(s)) for l, s in shares.items()},
            "layer0_shares": shares[str(layers[0])]}


# --- search ---------------------------------------------------------------------------------------------------------
@dataclass
class SearchResult:
    plan: Plan
    report: dict  # what `search --json` prints (figures predicted by the cost model)
    path: Path  # the plan file
    sidecars: list[Path]  # report, plan map (and Pareto plot)
    seconds: float


def default_plan_path(model: str, profile: str | None) -> Path:
    """plans/<model>@<profile>.json (`host` when no profile is named)."""
    return Path("plans") / f"{Path(model).name.replace(':', '_')}@{profile or 'host'}.json"


def search_sidecars(out: str | os.PathLike, objective: str) -> list[Path]:
    """The files a search writes next to its plan."""
    extras = [".report.json", ".map.png"] + ([".pareto.png"] if objective == "both" else [])
    return [sidecar(out, e) for e in extras]


def search_plan(model: str, *, profile: str | None = None, traces: str | os.PathLike | None = None,
           drop_budget: float = 0.10, objective: str = "latency", trials: int = 120, storage: str | None = None,
           resident_mb: float = 16384, saliency: str = "router_weight", seed: int = 0, robust: bool = False,
           prompt_tokens: int | None = None, compress: tuple[str, ...] = ("none",), memory_gb: float | None = None,
           out: str | os.PathLike | None = None, dtype: str = "auto", progress: bool = True,
           gate: GateSettings | None = GateSettings()) -> SearchResult:
    """Tune a plan for `model` on a device profile (a file, a shipped name, or None: this host's, measured quickly
    if missing) against routing traces (None: `traces/<model>.npz`, calibrated if missing); write the plan with
    its report and plots to `out` (default `default_plan_path`). The plan is for prompts of `prompt_tokens`
    (default: the traces'); its chunk size is searched (`chunk_candidates`), and each layer's weight storage among
    `compress` (on a static backend that stores weights compressed: the ANE). `robust`: keep the plan of least
    worst-case regret under perturbed profiles instead of the nominal best (the report carries the robustness
    either way). `memory_gb`: a plan predicted to need more (autotune/costing/memory.py) is a violation. `gate`
    (None: off): measure the cheapest candidates' fidelity and write the cheapest within its limits
    (autotune.evaluation.gate); none within them raises NpumoeError and writes nothing."""
    with _one_search_per_sqlite(storage):
        spec = read_model_spec(model)
        out = Path(out) if out else default_plan_path(model, profile)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ProfileHostWarning)
            prof, profile_name = _profile(profile, progress)
        trs, traces_path = _traces(model, traces, spec, dtype, progress)
        prompt = _prompt_tokens(model, trs, prompt_tokens)
        cost = prof.cost_model
        n_layers = len(spec.moe_layers)
        chunks = chunk_candidates(prompt, context_length(model)) if trs.chunk is not None else \
            [trs.header["chunk_tokens"]]  # counts-only traces stay as recorded
        size = model_size(model, dtype)
        resident_bytes = resident_mb * 1e6
        ane_bytes = resident_bytes
        if memory_gb is not None:  # what the budget leaves (at the largest chunk) bounds the ANE-resident experts
            ane_bytes = min(resident_bytes, ane_budget_bytes(memory_gb, size, max(chunks), prompt))
        for note in [f"warning: {w.message}" for w in caught] + [published_note(prof, profile_name)]:
            if note:  # held until the inputs are known good, so that an error is always the only line
                log.warning(note)

        def scorer_for(backend: str) -> Scorer:
            budget = ane_bytes if registry.get(backend).limits is not None else resident_bytes
            return Scorer(cost, spec.hidden_size, spec.expert_ffn_size, backend, budget / n_layers)

        backend = choose_static_backend(cost, LayerData.from_traces(trs), scorer_for)
        scorer = scorer_for(backend)
        # weights stored compressed are a Core ML function's: the backends with the ANE's limits
        kinds = tuple(compress) if registry.get(backend).limits is not None else ("none",)
        workloads = {c: LayerData.from_traces(trs, c, prompt) for c in chunks}
        outcome, seconds = timed_search(workloads, scorer, layer_space(spec.num_experts, kinds), objective=objective,
                                        drop_budget=drop_budget, trials=trials, storage=_storage(storage),
                                        study_prefix=_study_prefix(spec, cost, trs, ane_bytes / 1e6, objective, prompt),
                                        seed=seed, progress=progress)
        outcome.best, robustness = assess(outcome, scorer, pick=robust)
        gated = None
        if gate is not None:
            sols, gated = _gate(model, outcome, scorer, spec, saliency, gate, dtype, progress)
            if gated["chosen"] is None:
                raise refusal(gated)
            if gated["chosen"]["index"]:  # the gate passed over the search's pick: report and plan are its choice
                outcome.best = sols[gated["chosen"]["index"]]
                robustness = assess(outcome, scorer, pick=False)[1]
        chunk_tokens = outcome.best.chunk_tokens
        layers = outcome.chunks[chunk_tokens].layers
        calib_chunks = sum(int(t) for t in layers[0].tokens) / chunk_tokens  # figures per chunk of chunk_tokens
        heldout_assignments = sum(int(d.heldout.sum()) for d in layers)
        context = {"plan": str(out), "profile": profile_name, "static_backend": backend, "traces": traces_path,
                   "objective": objective, "drop_budget": drop_budget, "chunk_tokens": chunk_tokens,
                   "prompt_tokens": prompt, "chunks_searched": chunks, "compress_allowed": list(kinds),
                   "compress": compress_counts(outcome.best.configs),
                   "partial_chunks": "exact" if outcome.best.exact_partial else "static", "memory_gb": memory_gb}
        report = search_report(outcome, calib_chunks, heldout_assignments, seconds, context)
        add_cpu_figures(report, outcome, layers, cost.host.pack is not None)
        report["robustness"] = robustness.to_json()
        report["gate"] = gated
        predicted = {k: report[k] for k in ("predicted_latency_ms", "predicted_energy_mj", "heldout_drop_rate",
                                            "predicted_cpu_ms_per_token")}
        predicted["label"] = "predicted by the cost model of profile " + profile_name
        plan = solution_plan(outcome.best, layers, scorer, spec.to_json(), chunk_tokens, saliency, predicted,
                             {"made_by": "autotune search", "profile": profile_name, "traces": traces_path,
                              "drop_budget": drop_budget, "objective": objective, "robust": robust,
                              "prompt_tokens": prompt, "compress_allowed": list(kinds), "memory_gb": memory_gb,
                              "decisions": [c.to_json() for c in outcome.best.configs],
                              **({"gate": _gate_meta(gated)} if gated else {})})
        memory = predict_memory(plan, size, prompt)
        if memory_gb is not None and memory.total > memory_gb * 1e9:
            raise NpumoeError(f"--memory-gb {memory_gb:g}: the best plan within the drop budget needs "
                              f"{memory.describe()}; give a larger budget")
        plan = plan.model_copy(update={"predicted": {**predicted, "memory": memory.to_json()}})
        report["predicted_memory"] = memory.to_json()
        report["explanation"] = explain(plan, layers, cost, backend)
        sidecars = search_sidecars(out, objective)
        with output_set(out, *sidecars) as (plan_tmp, report_tmp, map_tmp, *pareto_tmp):
            save_plan(plan, plan_tmp)
            atomic_write_json(report_tmp, report)
            plot_plan_map(plan, map_tmp)
            for path in pareto_tmp:
                plot_pareto(report, path)
    return SearchResult(plan, report, out, sidecars, seconds)


def compress_counts(configs) -> dict[str, int]:
    """How many layers' static groups store their weights each way (layers without residents not counted)."""
    out: dict[str, int] = {}
    for c in configs:
        if c.resident:
            out[c.compress] = out.get(c.compress, 0) + 1
    return out


def _prompt_tokens(model: str, traces: Traces, given: int | None) -> int:
    """The prompt length the plan is for: `given` or the traces'; at most the model's context."""
    prompt = given or traces.prompt_tokens
    context = context_length(model)
    if context and prompt > context:
        raise NpumoeError(f"--prompt-tokens {prompt} is longer than {model}'s context of {context} tokens "
                          "(config.json max_position_embeddings); give at most that")
    if traces.chunk is None and given and given != traces.prompt_tokens:
        raise NpumoeError(f"--prompt-tokens {given}: these traces hold counts per {traces.prompt_tokens}-token "
                          "prompt only (synthetic); they cannot be cut into other prompts")
    return prompt


def _gate(model: str, outcome, scorer: Scorer, spec, saliency: str, settings: GateSettings, dtype: str,
          progress: bool) -> tuple[list, dict]:
    """The fidelity gate over the search's cheapest whole-plan candidates (its pick first, then
    `ranked_solutions`), each compressed one followed by the same plan uncompressed: a group stays compressed only
    where the gate holds."""
    sols = []
    for sol in [outcome.best, *ranked_solutions(outcome, scorer)]:
        layers = outcome.chunks[sol.chunk_tokens].layers
        plain = [dataclasses.replace(c, compress="none") for c in sol.configs]
        for s in (sol, solution(plain, layers, scorer, sol.exact_partial) if plain != sol.configs else None):
            if s is not None and not any((t.chunk_tokens, t.exact_partial, t.configs) ==
                                         (s.chunk_tokens, s.exact_partial, s.configs) for t in sols):
                sols.append(s)
    sols = sols[:settings.candidates]
    candidates = []
    for sol in sols:
        layers = outcome.chunks[sol.chunk_tokens].layers
        per_chunk = sum(int(t) for t in layers[0].tokens) / sol.chunk_tokens
        candidates.append(Candidate(solution_plan(sol, layers, scorer, spec.to_json(), sol.chunk_tokens, saliency),
                                    sol.latency_ms / per_chunk))
    return sols, run_gate(model, candidates, settings, dtype=dtype, progress=progress)


def _gate_meta(gated: dict) -> dict:
    """The chosen candidate's measured fidelity, as the plan keeps it."""
    chosen = gated["chosen"]
    return {"label": gated["label"], "tokens": gated["tokens"], "text": gated["text"],
            **{k: chosen[k] for k in ("ppl_delta", "top1", "kl")}}


def _storage(url: str | None):
    if url is None:
        return None
    import optuna

    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url[len("journal:"):]))
    return url


def _profile(name: str | None, progress: bool) -> tuple[Profile, str]:
    if name:
        return load_profile(name), name
    path = host_profile_path()
    if not path.exists():
        log.warning("no saved profile for this host; measuring a quick one into %s (autotune profile-device "
                    "--quick)", path)
        profile_device(quick=True, out=path, progress=progress)
    return load_profile(path), "host"


def _traces(model: str, given: str | os.PathLike | None, spec, dtype: str, progress: bool) -> tuple[Traces, str]:
    path = Path(given) if given else default_traces_path(model)
    if path.exists():
        traces = load_traces(path)
        if traces.spec["fingerprint"] == spec.fingerprint:
            require_heldout(traces, str(path))
            return traces, str(path)
        if given:
            raise NpumoeError(f"traces {path} are for another model (fingerprint {traces.spec['fingerprint']}, "
                              f"model {spec.fingerprint})")
    log.warning("no traces for %s; calibrating on %s into %s", model, DEFAULT_CALIB_TEXT, path)
    traces = calibrate(model, DEFAULT_CALIB_TEXT, out=path, dtype=dtype, progress=progress).traces
    require_heldout(traces, str(path))
    return traces, str(path)


def _study_prefix(spec, cost, traces: Traces, resident_mb: float, objective: str, prompt_tokens: int) -> str:
    """Studies resume only for the same model, cost model, traces, prompts, backend limits and objective: trials
    scored under another profile or other traces would mislead the sampler. (The space's digest and the chunk size
    are added per study by the search.)"""
    key = json.dumps([cost.to_json(), traces.header, resident_mb, prompt_tokens], sort_keys=True, default=str)
    return f"npumoe:{spec.fingerprint[7:19]}:{hashlib.sha256(key.encode()).hexdigest()[:12]}:{objective}"


@contextmanager
def _one_search_per_sqlite(url: str | None) -> Iterator[None]:
    """SQLite storage serves one search at a time: two at once race on creating its tables and on the trials
    they enqueue. A second search on it is refused (pointing to journal:, which is made for several processes)
    by an exclusive lock on <file>.lock, held for the whole search and removed after it (still locked, so a
    search that opened the old file sees it gone and is refused rather than running beside a newer one)."""
    if not url or not url.startswith("sqlite:///"):
        yield
        return
    lock = Path(url[len("sqlite:///"):] + ".lock")
    busy = NpumoeError(f"--storage {url} is in use by another search; SQLite storage takes one search at a "
                       "time: run concurrent searches on --storage journal:FILE")
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy from None
        try:
            if os.stat(lock).st_ino != os.fstat(f.fileno()).st_ino:  # removed by the search that held it
                raise busy
        except FileNotFoundError:
            raise busy from None
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)


# --- run and evaluate -----------------------------------------------------------------------------------------------
def _planned(model: str, plan: str | os.PathLike, package: str | None, dtype: str, text: str,
             max_tokens: int) -> tuple[Loaded, torch.Tensor]:
    """The planned model (the plan checked against it before any text is read) and the text's token ids."""
    loaded = load(model, plan, package, dtype)
    ids = encode_text(loaded.tokenizer, text, max_tokens)
    check_token_ids(loaded.model, ids)
    return loaded, ids


def _timed(fn: Callable[[], torch.Tensor], repeat: int) -> tuple[torch.Tensor, float, float]:
    """The last result of `repeat` calls, their median wall time and median process CPU time (every thread), in
    ms."""
    wall, cpu, out = [], [], None
    for _ in range(repeat):
        with Clock() as clock:
            out = fn()
        wall.append(clock.wall_s * 1e3)
        cpu.append(clock.cpu_s * 1e3)
    return out, statistics.median(wall), statistics.median(cpu)


def run_plan(model: str, plan: str | os.PathLike, *, text: str = DEFAULT_EVAL_TEXT, max_tokens: int = 1024,
             prompt_tokens: int | None = None, package: str | None = None, dtype: str = "auto",
             reference: bool = False, repeat: int = 1, record_traces: str | os.PathLike | None = None) -> dict:
    """Prefill the first `max_tokens` tokens of `text` under the plan (as prompts of `prompt_tokens`, default one
    prompt), timed as the median of `repeat` runs; returns what `autotune run --json` prints: run statistics,
    backend fallbacks, the drift monitor's verdict, the measured energy of backends that measure their calls
    (`energy_per_backend`, of the last run), and with `reference` the unmodified model's latency and the logits'
    max relative difference. `record_traces`: also write the routing the plan saw there as traces."""
    loaded, ids = _planned(model, plan, package, dtype, text, max_tokens)
    executor, chunk = loaded.executor, loaded.plan.chunk_tokens
    if record_traces:  # before the run, as calibrate refuses too short a text
        require_recordable(int(ids.numel()), chunk, prompt_tokens or int(ids.numel()),
                           "give a longer --text or a larger --max-tokens")
    result = {"model": model, "plan": str(plan), "text": text, "tokens": int(ids.numel()), "chunk_tokens": chunk,
              "overflow": loaded.plan.overflow}
    prefill = lambda: prefill_prompts_logits(loaded.model, ids, chunk, prompt_tokens)  # noqa: E731
    if reference:
        with loaded.unmodified():
            ref, result["reference_latency_ms"], _ = _timed(prefill, repeat)

    def planned() -> torch.Tensor:
        loaded.reset()
        return prefill()

    logits, result["latency_ms"], cpu_ms = _timed(planned, repeat)
    n = int(ids.numel())
    result["wall_ms_per_token"], result["cpu_ms_per_token"] = result["latency_ms"] / n, cpu_ms / n
    result.update(executor.stats.to_json())
    result["backend_fallbacks"] = executor.fallbacks
    result["drift"] = executor.drift.report()
    energy = executor.energy()
    if energy:  # backends that measure their calls (ane with zeus-apple-silicon on macOS)
        result["energy_per_backend"] = energy
    if record_traces:
        result["traces"] = record_run_traces(loaded.model, ids, chunk, prompt_tokens or int(ids.numel()), text,
                                             record_traces, f"autotune run --plan {plan}")
    if reference:
        result["max_rel_diff_vs_reference"] = max_rel_diff(logits, ref)
    # run keeps [tokens, vocab] fp32 logits (twice with the reference)
    result["memory"] = against_measured(loaded.plan, loaded.model, prompt_tokens or n, peak_rss_bytes(),
                                        logits_rows=n * (2 if reference else 1),
                                        ane_simulated=simulated_functions(executor.fallbacks))
    result["plan_predicted"] = plan_predictions(loaded.plan)
    return result


def plan_predictions(plan: Plan) -> dict | None:
    """What the plan's search predicted for its profile's device (CPU-busy time of the MoE layers per token,
    memory at its prompt length), to set beside a run's measurements; None for a plan without predictions."""
    p = plan.predicted or {}
    if "predicted_cpu_ms_per_token" not in p and "memory" not in p:
        return None
    return {"cpu_ms_per_token": p.get("predicted_cpu_ms_per_token"),
            "memory_gb": (p.get("memory") or {}).get("total_gb"), "label": p.get("label")}


def evaluate(model: str, plan: str | os.PathLike, *, text: str = DEFAULT_EVAL_TEXT, max_tokens: int = 8192,
             prompt_tokens: int = 1024, package: str | None = None, dtype: str = "auto",
             progress: bool = True) -> dict:
    """A plan's fidelity on the first `max_tokens` tokens of `text` (prompts of `prompt_tokens`): perplexity of
    the plan and the unmodified model, top-1 agreement, drop and spill rates, and whether the drop rate stays
    within 1.5x the plan's budget; what `autotune evaluate --json` prints."""
    from autotune.evaluation.fidelity import evaluate_plan

    loaded, ids = _planned(model, plan, package, dtype, text, max_tokens)
    result = {"model": model, "plan": str(plan), "text": text,
              **evaluate_plan(loaded.executor, ids, prompt_tokens, progress=progress)}
    budget = (loaded.plan.meta or {}).get("drop_budget")
    if budget is not None:
        result["drop_budget"] = budget
        result["drop_rate_within_1_5x_budget"] = result["drop_rate"] <= SHIFT_TOLERANCE * budget
    return result


def evaluate_tasks(model: str, plan: str | os.PathLike, tasks: list[str], *, limit: int | None = None,
                   num_fewshot: int | None = None, include_path: str | None = None, package: str | None = None,
                   dtype: str = "auto") -> dict:
    """lm-evaluation-harness `tasks` (extra `eval`) on the plan and the unmodified model: paired accuracies per
    task; what `autotune evaluate --tasks --json` prints."""
    from autotune.evaluation.harness import prepared_tasks, run_tasks

    with prepared_tasks(tasks, include_path) as found:  # a bad task is refused before the load says anything
        loaded = load(model, plan, package, dtype)
        return {"model": model, "plan": str(plan), "limit": limit, "num_fewshot": num_fewshot,
                **run_tasks(loaded.executor, loaded.tokenizer, found, limit, num_fewshot)}


def check_prompt_recordable(loaded: Loaded, prompt: str, *, chat: bool = False) -> torch.Tensor:
    """The prompt's token ids, if its prefill under `loaded`'s plan makes traces a search can use (a held-out chunk
    among them): call it before generating, so that a prompt too short is refused up front."""
    if loaded.executor is None:
        raise NpumoeError("recording traces records the routing under a plan: load the model with a plan")
    ids = prompt_ids(loaded, prompt, chat)
    require_recordable(int(ids.numel()), loaded.plan.chunk_tokens, int(ids.numel()), "give a longer prompt")
    return ids


def record_prompt_traces(loaded: Loaded, prompt: str, out: str | os.PathLike, *, chat: bool = False,
                         text: str = "--prompt", recorded_by: str = "autotune generate") -> dict:
    """The prompt's prefill under `loaded`'s plan, untimed, with its routing saved to `out` as traces (every
    HELDOUT_EVERY-th chunk held out); returns the summary `generate --json` prints under `traces`."""
    ids = check_prompt_recordable(loaded, prompt, chat=chat)
    return record_run_traces(loaded.model, ids, loaded.plan.chunk_tokens, int(ids.numel()), text, out, recorded_by)


# --- build ----------------------------------------------------------------------------------------------------------
def build(model: str, plan: str | os.PathLike, *, out: str | os.PathLike | None = None, layout: str = "matmul",
          compress: str = "none", cache_dir: str | os.PathLike | None = None,
          function_weight_bytes: float | None = None, package_weight_bytes: float | None = None,
          dtype: str = "auto", progress: bool = True):
    """Build the Core ML package(s) of the plan's ANE groups (default `out`: the plan's path with .mlpackage),
    linted and checked numerically on the host; returns `runtime.coreml.converter.BuildResult`."""
    from runtime.coreml import ane_limits
    from runtime.coreml.converter import build_package, quiet_coremltools_import
    from runtime.loading.expert_weights import CheckpointExperts, ModuleExperts

    out = out or Path(plan).with_suffix(".mlpackage")
    quiet_coremltools_import()
    loaded_plan = load_plan(plan)
    # A safetensors checkpoint is never loaded whole: each function's experts are read when it is converted and
    # checked (build memory is one function, not the model). Other models (random:) are loaded.
    source = CheckpointExperts.open(model, dtype)
    dense_on_ane = loaded_plan.dense is not None and "ane" in loaded_plan.dense.backends  # needs the dense modules
    loaded = load_model(model, dtype)[0] if source is None or dense_on_ane else None
    if source is None:
        spec = model_spec(loaded)
        source = ModuleExperts({layer.index: layer.experts for layer in moe_layers(loaded)})
    else:
        spec = read_model_spec(model)
    check_plan_matches(loaded_plan, spec, str(plan))
    with _private_tempdir():  # coremltools' own tmp*.mlpackage folders go there and leave with it
        return build_package(source, loaded_plan, out, layout, compress, cache_dir, _progress_factory(progress),
                             function_weight_bytes=function_weight_bytes or ane_limits.FUNCTION_WEIGHT_BYTES,
                             package_weight_bytes=package_weight_bytes or ane_limits.PACKAGE_WEIGHT_BYTES,
                             dense_model=loaded if dense_on_ane else None)


def _progress_factory(enabled: bool):
    if not enabled:
        return None
    import sys

    from tqdm import tqdm

    return lambda stage, total: tqdm(total=total, desc=stage, unit="fn", file=sys.stderr, dynamic_ncols=True)


@contextmanager
def _private_tempdir() -> Iterator[None]:
    """Point `tempfile` at a folder of our own for the block and remove it after, interrupted or not."""
    previous = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="npumoe-build-") as d:
        tempfile.tempdir = d
        try:
            yield
        finally:
            tempfile.tempdir = previous
