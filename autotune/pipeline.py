"""The pipeline as library functions: describe a model, measure a device, calibrate routing traces, search a plan,
build its device functions (`build`, from `autotune.build_stage`), run and evaluate a plan. Each `autotune` command
is a thin argparse front over one of them; they show progress on stderr (tqdm) and notes through the `npumoe`
logger, never on stdout, and raise `NpumoeError` on bad input. A planned model is loaded by `runtime.load`, the one
way to load one.

Outputs are written whole (atomically; a search's plan and its sidecars as one set). Checking that an output can be
written before the work starts is the caller's (the commands do it, naming their option).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from autotune.build_stage import build  # noqa: F401 - the build stage, re-exported with the others
from autotune.calibration import modelstats
from autotune.calibration.stage import PROMPT_TOKENS, calibrate
from autotune.calibration.texts import DEFAULT_CALIB_TEXT, DEFAULT_EVAL_TEXT
from autotune.calibration.traces import (
    Traces,
    default_traces_path,
    load_traces,
    record_run_traces,
    require_heldout,
    require_recordable,
)
from autotune.calibration.workload import encode_text
from autotune.costing.cpu_storage import load_options
from autotune.costing.memory import (
    ModelSize,
    against_measured,
    predict_memory,
    simulated_functions,
)
from autotune.costing.whole_prefill import priced_outside
from autotune.evaluation.gate import refusal, run_gate
from autotune.evaluation.host_speed import host_speed
from autotune.evaluation.run_parts import measure_parts, plan_predictions, plan_profile, predict_parts
from autotune.profiling.model_records import (
    add_model_records,
    cover_model,
    model_label,
    outside_line,
    require_measurable,
)
from autotune.profiling.profile import (
    Profile,
    ProfileHostWarning,
    host_profile_path,
    load_profile,
    published_note,
    save_profile,
)
from autotune.results import EvaluateResult, RunResult, SearchReport, TasksResult
from autotune.searching.backend_choice import choose_static_backend
from autotune.searching.config import SearchConfig
from autotune.searching.cpu_choice import choose_cpu_storage
from autotune.searching.dense_choice import DenseChoice, choose_dense
from autotune.searching.explain import explain
from autotune.searching.gate_candidates import gate_candidates, gate_order
from autotune.searching.layer_data import LayerData
from autotune.searching.model_record import ModelRecord, check_context, resolve_model
from autotune.searching.optimizer import chunk_candidates, solution_plan, timed_search
from autotune.searching.plan_fields import compress_counts, dense_of, gate_meta
from autotune.searching.prefill_report import whole_prefill
from autotune.searching.report import (
    add_cpu_figures,
    plot_pareto,
    plot_plan_map,
    plot_tradeoff,
    search_report,
    sidecar,
)
from autotune.searching.robustness import assess, reassess
from autotune.searching.scoring import Scorer
from autotune.searching.space import layer_space
from autotune.searching.storage import one_search_per_sqlite, optuna_storage, study_prefix
from runtime.backends import registry
from runtime.coreml import ane_limits
from runtime.errors import NpumoeError
from runtime.fileio import atomic_write_json, output_set
from runtime.generation import Loaded, context_positions, load, prompt_ids
from runtime.loading.checkpoints import check_token_ids
from runtime.loading.compute_dtype import dtype_name
from runtime.loading.model_loader import (
    TINY_MOE_DIR,
    context_length,
    load_model,
    model_spec,
)
from runtime.plan import Plan, save_plan
from runtime.prefill import max_rel_diff, prefill_prompts_last_logits, prefill_prompts_logits
from runtime.resources import Clock, peak_rss_bytes

log = logging.getLogger("npumoe")

# calibration defaults, shared by `calibrate` and the calibration `search` runs when traces are missing
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
                   out: str | os.PathLike | None = None, progress: bool = True, model: str | None = None,
                   dtype: str = "auto") -> Profile:
    """Measure this host's backends, fit the cost model and save the profile to `out` (default: this host's cache,
    `host_profile_path()`); returns it with `path` set. With `model`: records at that model's own shapes
    (`profiling.model_records`), timed in the dtype it computes in (`dtype`, auto resolved here), added to the
    profile at `out` where one is there (measured on this host), else to a new one measured first."""
    from autotune.profiling.device import profile_device as measure
    from autotune.profiling.settings import settings_for

    out = out or host_profile_path()
    record = model_to_measure(model, dtype) if model is not None else None  # a bad model: refused before measuring
    if model is not None and Path(out).exists():
        profile = load_profile(out, check_host=False)
        require_measurable(profile, str(out))
    else:
        s = settings_for(quick)
        if shapes:
            s = dataclasses.replace(s, shapes=shapes)
        profile = measure(backends, quick, threads, progress=progress, s=s, clock=clock)
    profile.path = str(out)
    if record is not None:
        profile = measure_model_shapes(profile, model, record, quick, progress)[0]
    save_profile(profile, out)
    return profile


def model_to_measure(model: str, dtype: str = "auto") -> ModelRecord:
    """`model` resolved, with a decoder shape to measure (else one clear error)."""
    record = resolve_model(model, dtype)
    if record.shape is None:
        raise NpumoeError(f"{model}: its config gives no decoder shape to measure")
    return record


def measure_model_shapes(profile: Profile, model: str, record: ModelRecord, quick: bool = True,
                         progress: bool = True) -> tuple[Profile, int, float]:
    """`profile` with records at `model`'s own shapes (`record`: it resolved) added and refitted
    (`model_records.add_model_records`); with the records' count and the seconds they took."""
    return add_model_records(profile, record.shape, model_label(model), quick, progress, record.compute_dtype)


# --- search ---------------------------------------------------------------------------------------------------------
@dataclass
class SearchResult:
    plan: Plan
    report: SearchReport  # figures predicted by the cost model; the gate's measured
    path: Path  # the plan file
    sidecars: list[Path]  # report, plan map (and Pareto plot)
    seconds: float

    def to_json(self) -> dict:
        """What `autotune search --json` prints."""
        return self.report.to_json()


def default_plan_path(model: str, profile: str | None) -> Path:
    """plans/<model>@<profile>.json (`host` when no profile is named)."""
    return Path("plans") / f"{Path(model).name.replace(':', '_')}@{profile or 'host'}.json"


def search_sidecars(out: str | os.PathLike, objective: str, tradeoff: bool = False) -> list[Path]:
    """The files a search writes next to its plan (`tradeoff`: with the whole prefill's latency/energy chart)."""
    extras = ([".report.json", ".map.png"] + ([".tradeoff.png"] if tradeoff else [])
              + ([".pareto.png"] if objective == "both" else []))
    return [sidecar(out, e) for e in extras]


def search_plan(model: str, config: SearchConfig = SearchConfig(), *, progress: bool = True) -> SearchResult:
    """Tune a plan for `model` as `autotune search --model M` with `config`'s options does: on a device profile (a
    file, a shipped name, or None: this host's, measured quickly if missing) against routing traces (None:
    `traces/<model>.npz`, calibrated if missing); write the plan with its report and plots to `config.out` (default
    `default_plan_path`). The plan is for prompts of `prompt_tokens` (default: the traces'); its chunk size is
    searched (`chunk_candidates`), and each layer's weight storage among `config.compress_kinds` (on a static
    backend that stores weights compressed: the ANE). `robust`: keep the plan of least worst-case regret under
    perturbed profiles instead of the nominal best (the report carries the robustness either way). `memory_gb`: a
    plan predicted to need more (autotune/costing/memory.py) is a violation. Unless `no_gate`, the fidelity gate
    measures the candidates (autotune/searching/gate_candidates.py) and writes the first within its limits; none
    within them raises NpumoeError and writes nothing."""
    c = config
    if c.threads is not None:
        torch.set_num_threads(c.threads)
    with one_search_per_sqlite(c.storage):
        record = resolve_model(model, c.dtype)
        if c.prompt_tokens:  # before the traces are read or made
            check_context(model, record.context, c.prompt_tokens)
        if c.prompt_tokens or not Path(c.traces or default_traces_path(model)).exists():  # the prompt is known
            c.check_gate_tokens(min(chunk_candidates(c.prompt_tokens or PROMPT_TOKENS, record.context)))
        spec = record.spec
        out = Path(c.out) if c.out else default_plan_path(model, c.profile)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ProfileHostWarning)
            prof, profile_name = _profile(c.profile, progress)
        if record.shape is not None:  # the model's own shapes measured first where the profile lacks them
            prof = cover_model(prof, profile_name, record.shape, model_label(model), not c.no_measure, progress,
                               record.size.layer_bytes, record.compute_dtype)
        trs, traces_path = _traces(record, c.traces, progress)
        prompt = _prompt_tokens(record, trs, c.prompt_tokens)
        cost, cache_state = prof.cost_model_for(record.size.layer_bytes, dtype_name(record.compute_dtype))
        n_layers = len(spec.moe_layers)
        chunks = chunk_candidates(prompt, record.context) if trs.chunk is not None else \
            [trs.header["chunk_tokens"]]  # counts-only traces stay as recorded
        c.check_gate_tokens(min(chunks))
        workloads = {ch: LayerData.from_traces(trs, ch, prompt) for ch in chunks}
        cpu = choose_cpu_storage(c.cpu_weights, c.memory_gb, record.size, cost, prof.extra.get("kernel_records") or [],
                                 workloads[max(chunks)], spec.hidden_size, spec.expert_ffn_size, max(chunks), prompt)
        for note in [f"warning: {w.message}" for w in caught] + [published_note(prof, profile_name)]:
            if note:  # held until the inputs are known good, so that an error is always the only line
                log.warning(note)
        while True:  # the CPU storage chosen, then each wider one that fits while the gate refuses every candidate
            cost, resident_bytes = cpu.cost, c.resident_mb * 1e6  # what the budget leaves bounds the ANE's experts
            ane_bytes = resident_bytes if cpu.ane_bytes is None else min(resident_bytes, cpu.ane_bytes)
            ane_bytes = min(ane_bytes, ane_limits.WINDOW_BYTES)  # the ANE's window holds them with the dense ones

            def scorer_for(backend: str) -> Scorer:
                budget = ane_bytes if registry.get(backend).limits is not None else resident_bytes
                return Scorer(cost, spec.hidden_size, spec.expert_ffn_size, backend, budget / n_layers)

            backend = choose_static_backend(cost, LayerData.from_traces(trs), scorer_for, c.backend)
            scorer = scorer_for(backend)
            # weights stored compressed are a Core ML function's: the backends with the ANE's limits
            kinds = c.compress_kinds if registry.get(backend).limits is not None else ("none",)
            dense = None
            if not c.no_dense and record.shape is not None and registry.get(backend).limits is not None:
                calib_prompts = float(next(iter(workloads.values()))[0].tokens.sum()) / prompt

                def dense(chunk: int, weights, resident: float) -> DenseChoice:  # Core ML functions, as the groups
                    return choose_dense(cost, record.shape, prompt, chunk, backend, weights, calib_prompts, resident)

            space = layer_space(spec.num_experts, kinds, scorer.splits_exact)
            outcome, seconds = timed_search(workloads, scorer, space, dense=dense,
                                            objective=c.objective, drop_budget=c.drop_budget, trials=c.trials,
                                            storage=optuna_storage(c.storage),
                                            study_prefix=study_prefix(spec, cost, trs, ane_bytes / 1e6, c.objective,
                                                                      prompt),
                                            seed=c.seed, progress=progress)
            outcome.best, robustness = assess(outcome, scorer, pick=c.robust)
            if robustness.dense_choice is not None:  # the robust pick's dense placement
                outcome.dense[outcome.best.chunk_tokens] = robustness.dense_choice
            gated, settings = None, c.gate_settings()
            if settings is not None:
                sols = gate_order(outcome, scorer, settings.tokens, settings.candidates)
                gated = run_gate(record.loaded(), gate_candidates(sols, outcome, scorer, spec, c.saliency,
                                                                  lambda sol: dense_of(outcome, record, sol)),
                                 settings, progress=progress, cpu_weights=cpu.kind_and_group,
                                 kernel_rows=cpu.kernel_rows)
            if gated is None or gated["chosen"] is not None:
                break
            if cpu.wider is None:
                raise refusal(gated)
            log.warning(f"the fidelity gate refused every candidate with {cpu.storage} CPU experts: searching "
                        f"{cpu.wider.storage}, the next wider storage within --memory-gb")
            cpu = cpu.after_refusal(gated)
        if gated is not None:
            cpu = cpu.after_gate(gated)
            if sols[gated["chosen"]["candidate"]] is not outcome.best:  # the gate passed over the search's pick
                outcome.best = sols[gated["chosen"]["candidate"]]
                # --robust: the gate's plan on the pick's analysis (its candidates compared, its floor)
                robustness = reassess(outcome, robustness, outcome.best) if c.robust else \
                    assess(outcome, scorer, pick=False)[1]
        chunk_tokens = outcome.best.chunk_tokens
        layers = outcome.chunks[chunk_tokens].layers
        heldout_assignments = sum(int(d.heldout.sum()) for d in layers)
        context = {"plan": str(out), "profile": profile_name, "static_backend": backend, "traces": traces_path,
                   "objective": c.objective, "drop_budget": c.drop_budget, "chunk_tokens": chunk_tokens,
                   "prompt_tokens": prompt, "chunks_searched": chunks, "compress_allowed": list(kinds),
                   "compress": compress_counts(outcome.best.configs),
                   "partial_chunks": "exact" if outcome.best.exact_partial else "static",
                   "memory_gb": c.memory_gb}
        report = search_report(outcome, layers[0].calib_chunks, heldout_assignments, seconds,
                               context)
        add_cpu_figures(report, outcome, layers, cost.host.pack is not None)
        if record.shape is not None:
            report["whole_prefill"] = whole = whole_prefill(outcome, scorer, record.shape, prompt)
            report["predicted_prefill_ms"], report["predicted_parts_ms"] = (whole["predicted_prefill_ms"],
                                                                            whole["predicted_parts_ms"])
            outside = priced_outside(cost, record.shape, prompt, chunk_tokens, backend)
            report["priced_outside"] = {part: [r.to_json() for r in rs] for part, rs in outside.items()}
            line = outside_line(prof, profile_name, model_label(model), outside, not c.no_measure,
                                record.compute_dtype)
            if line:
                log.warning(line)
        report["robustness"] = robustness.to_json()
        report["gate"] = gated
        predicted = {k: report[k] for k in ("predicted_latency_ms", "predicted_energy_mj", "heldout_drop_rate",
                                            "predicted_cpu_ms_per_token", "predicted_prefill_ms",
                                            "predicted_parts_ms") if k in report}
        predicted["label"] = f"predicted by the cost model of profile {profile_name} ({cache_state})"
        plan = solution_plan(outcome.best, layers, scorer, spec.to_json(), chunk_tokens, c.saliency, predicted,
                             {"made_by": "autotune search", "profile": profile_name, "traces": traces_path,
                              "drop_budget": c.drop_budget, "objective": c.objective, "robust": c.robust,
                              "prompt_tokens": prompt, "compress_allowed": list(kinds), "memory_gb": c.memory_gb,
                              "decisions": [cfg.to_json() for cfg in outcome.best.configs],
                              **({"gate": gate_meta(gated)} if gated else {})},
                             dense=dense_of(outcome, record, outcome.best)).model_copy(
            update={"cpu_weights": cpu.plan_field()})
        memory = predict_memory(plan, record.size, prompt)
        if c.memory_gb is not None and memory.total > c.memory_gb * 1e9:
            raise NpumoeError(f"--memory-gb {c.memory_gb:g}: the best plan within the drop budget needs "
                              f"{memory.describe()}; give a larger budget")
        plan = plan.model_copy(update={"predicted": {**predicted, "memory": memory.to_json()}})
        report["predicted_memory"], report["cpu_weights"] = memory.to_json(), cpu.to_json()
        report["explanation"] = explain(plan, layers, cost, backend)
        report = SearchReport(**report)
        whole = report.to_json().get("whole_prefill")
        sidecars = search_sidecars(out, c.objective, tradeoff=whole is not None)
        with output_set(out, *sidecars) as (plan_tmp, report_tmp, map_tmp, *plots):
            save_plan(plan, plan_tmp)
            atomic_write_json(report_tmp, report.to_json())
            plot_plan_map(plan, map_tmp)
            if whole is not None:
                plot_tradeoff(whole, plots.pop(0))
            for path in plots:
                plot_pareto(report.to_json(), path)
    return SearchResult(plan=plan, report=report, path=out, sidecars=sidecars, seconds=seconds)


def _prompt_tokens(record: ModelRecord, traces: Traces, given: int | None) -> int:
    """The prompt length the plan is for: `given` or the traces'; at most the model's context."""
    prompt = given or traces.prompt_tokens
    check_context(record.name, record.context, prompt)
    if traces.chunk is None and given and given != traces.prompt_tokens:
        raise NpumoeError(f"--prompt-tokens {given}: these traces hold counts per {traces.prompt_tokens}-token "
                          "prompt only (synthetic); they cannot be cut into other prompts")
    return prompt


def _profile(name: str | None, progress: bool) -> tuple[Profile, str]:
    if name:
        return load_profile(name), name
    path = host_profile_path()
    if not path.exists():
        log.warning("no saved profile for this host; measuring a quick one into %s (autotune profile-device "
                    "--quick)", path)
        profile_device(quick=True, out=path, progress=progress)
    return load_profile(path), "host"


def _traces(record: ModelRecord, given: str | os.PathLike | None, progress: bool) -> tuple[Traces, str]:
    path = Path(given) if given else default_traces_path(record.name)
    fingerprint = record.spec.fingerprint
    if path.exists():
        traces = load_traces(path)
        if traces.spec["fingerprint"] == fingerprint:
            require_heldout(traces, str(path))
            return traces, str(path)
        if given:
            raise NpumoeError(f"traces {path} are for another model (fingerprint {traces.spec['fingerprint']}, "
                              f"model {fingerprint})")
    log.warning("no traces for %s; calibrating on %s into %s", record.name, DEFAULT_CALIB_TEXT, path)
    traces = calibrate(record, DEFAULT_CALIB_TEXT, out=path, progress=progress).traces
    require_heldout(traces, str(path))
    return traces, str(path)


# --- run and evaluate -----------------------------------------------------------------------------------------------
def _planned(model: str, plan: str | os.PathLike, package: str | None, dtype: str, text: str,
             max_tokens: int, prompt_tokens: int | None, cpu_weights: str | None) -> tuple[Loaded, torch.Tensor]:
    """The planned model (the plan checked against it before any text is read) and the text's token ids, its
    prompts (of `prompt_tokens`; None: the whole text, one prompt) within the model's context; `cpu_weights`: the
    CPU's expert storage (`--cpu-weights`), quantized at load."""
    if prompt_tokens:  # before the load says anything
        check_context(model, context_length(model), prompt_tokens)
    loaded = load(model, plan, package, dtype, **load_options(cpu_weights))
    ids = encode_text(loaded.tokenizer, text, max_tokens)
    check_token_ids(loaded.model, ids)
    if not prompt_tokens:  # one prompt: the whole text
        check_context(model, context_positions(loaded.model), int(ids.numel()), "--max-tokens")
    return loaded, ids


def _timed(fn: Callable[[], torch.Tensor], repeat: int) -> tuple[torch.Tensor, float, float]:
    """The last result of `repeat` calls, their median wall time and median process CPU time (every thread), in
    ms."""
    wall, cpu, out = [], [], None
    for _ in range(repeat):
        out = None  # dropped before the next call makes its own: one result held at a time
        with Clock() as clock:
            out = fn()
        wall.append(clock.wall_s * 1e3)
        cpu.append(clock.cpu_s * 1e3)
    return out, statistics.median(wall), statistics.median(cpu)


def run_plan(model: str, plan: str | os.PathLike, *, text: str = DEFAULT_EVAL_TEXT, max_tokens: int = 1024,
             prompt_tokens: int | None = None, package: str | None = None, dtype: str = "auto",
             reference: bool = False, repeat: int = 1, record_traces: str | os.PathLike | None = None,
             cpu_weights: str | None = None) -> RunResult:
    """Prefill the first `max_tokens` tokens of `text` under the plan (as prompts of `prompt_tokens`, default one
    prompt), timed as the median of `repeat` runs: run statistics, backend fallbacks, the drift monitor's verdict,
    the measured energy of backends that measure their calls (`energy_per_backend`, of the last run), and with
    `reference` the unmodified model's latency and the logits' max relative difference (`.to_json()`: what
    `autotune run --json` prints). `record_traces`: also write the routing the plan saw there as traces."""
    loaded, ids = _planned(model, plan, package, dtype, text, max_tokens, prompt_tokens, cpu_weights)
    executor, chunk = loaded.executor, loaded.plan.chunk_tokens
    n = int(ids.numel())
    if record_traces:  # before the run, as calibrate refuses too short a text
        require_recordable(n, chunk, prompt_tokens or n, "give a longer --text or a larger --max-tokens")
    # A prefill computes one row of logits per chunk (what generation needs); comparing with the reference takes
    # every position's.
    logits_of = prefill_prompts_logits if reference else prefill_prompts_last_logits
    prefill = lambda: logits_of(loaded.model, ids, chunk, prompt_tokens)  # noqa: E731
    ref = reference_ms = None
    if reference:
        with loaded.unmodified():
            ref, reference_ms, _ = _timed(prefill, repeat)

    def planned() -> torch.Tensor:
        loaded.reset()
        return prefill()

    logits, latency_ms, cpu_ms = _timed(planned, repeat)
    # the run's own figures, before recording traces (or timing the parts) runs the model again
    stats, drift, energy = executor.stats.to_json(), executor.drift.report(), executor.energy() or None
    dense_calls = executor.dense.to_json() if executor.dense is not None else None
    ran = [registry.get(b) for b in stats.get("calls_per_backend", {})]
    # the logits are compared now and dropped: timing the parts prefills again, and would hold a second copy
    diff = max_rel_diff(logits, ref) if reference else None
    del logits, ref
    measured, routing = measure_parts(loaded.model, planned, any(info.overlaps_cpu for info in ran if info is not None),
                                      chunk, repeat)
    profile = plan_profile(loaded.plan)
    predicted = predict_parts(loaded.plan, profile, loaded.model.config.to_dict(),
                              ModelSize.of(loaded.model).layer_bytes, n, prompt_tokens or n, routing,
                              every_position=reference, dtype=dtype_name(loaded.model.dtype))
    traces = None
    if record_traces:
        traces = record_run_traces(loaded.model, ids, chunk, prompt_tokens or n, text, record_traces,
                                   f"autotune run --plan {plan}")
    # with the reference, run keeps [tokens, vocab] fp32 logits twice and each chunk's in the model's dtype; else a
    # row per prompt
    prompts = -(-n // (prompt_tokens or n))
    memory = against_measured(loaded.plan, loaded.model, prompt_tokens or n, peak_rss_bytes(),
                              logits_rows=2 * n if reference else prompts, chunk_logits=int(reference),
                              ane_simulated=simulated_functions(executor.fallbacks))
    return RunResult(model=model, plan=str(plan), text=text, tokens=n, chunk_tokens=chunk,
                     overflow=loaded.plan.overflow, latency_ms=latency_ms, wall_ms_per_token=latency_ms / n,
                     cpu_ms_per_token=cpu_ms / n, stats=stats,
                     backend_fallbacks=executor.fallbacks, drift=drift, memory=memory,
                     plan_predicted=plan_predictions(loaded.plan), reference_latency_ms=reference_ms,
                     max_rel_diff_vs_reference=diff,
                     energy_per_backend=energy, traces=traces, measured_parts_ms=measured,
                     predicted_parts_ms=predicted, host_speed=host_speed(profile), dense_calls=dense_calls)


def evaluate(model: str, plan: str | os.PathLike, *, text: str = DEFAULT_EVAL_TEXT, max_tokens: int = 8192,
             prompt_tokens: int = 1024, package: str | None = None, dtype: str = "auto",
             progress: bool = True, cpu_weights: str | None = None) -> EvaluateResult:
    """A plan's fidelity on the first `max_tokens` tokens of `text` (prompts of `prompt_tokens`): perplexity of
    the plan and the unmodified model, top-1 agreement, drop and spill rates, and whether the drop rate stays
    within 1.5x the plan's budget (`.to_json()`: what `autotune evaluate --json` prints)."""
    from autotune.evaluation.fidelity import evaluate_plan

    loaded, ids = _planned(model, plan, package, dtype, text, max_tokens, prompt_tokens, cpu_weights)
    figures = evaluate_plan(loaded.executor, ids, prompt_tokens, progress=progress)
    budget = (loaded.plan.meta or {}).get("drop_budget")
    return EvaluateResult(model=model, plan=str(plan), text=text, **figures, drop_budget=budget,
                          drop_rate_within_1_5x_budget=None if budget is None else
                          figures["drop_rate"] <= SHIFT_TOLERANCE * budget)


def evaluate_tasks(model: str, plan: str | os.PathLike, tasks: list[str], *, limit: int | None = None,
                   num_fewshot: int | None = None, include_path: str | None = None, package: str | None = None,
                   dtype: str = "auto", cpu_weights: str | None = None) -> TasksResult:
    """lm-evaluation-harness `tasks` (extra `eval`) on the plan and the unmodified model: paired accuracies per
    task (`.to_json()`: what `autotune evaluate --tasks --json` prints)."""
    from autotune.evaluation.harness import prepared_tasks, run_tasks

    with prepared_tasks(tasks, include_path) as found:  # a bad task is refused before the load says anything
        loaded = load(model, plan, package, dtype, **load_options(cpu_weights))
        return TasksResult(model=model, plan=str(plan), limit=limit, num_fewshot=num_fewshot,
                           **run_tasks(loaded.executor, loaded.tokenizer, found, limit, num_fewshot))


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
