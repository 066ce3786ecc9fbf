"""The pipeline as library functions: describe a model, measure a device (`profile_device`, from
`autotune.profile_stage`), calibrate routing traces, search a plan, build its device functions (`build`, from
`autotune.build_stage`), run and evaluate a plan. Each `autotune` command is a thin argparse front over one of them;
they show progress on stderr (tqdm) and notes through the `npumoe` logger, never on stdout, and raise `NpumoeError`
on bad input. A planned model is loaded by `runtime.load`, the one way to load one.

Outputs are written whole (atomically; a search's plan and its sidecars as one set). Checking that an output can be
written before the work starts is the caller's (the commands do it, naming their option)."""
from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from autotune.build_stage import build  # noqa: F401 - the build stage, re-exported with the others
from autotune.calibration import modelstats
from autotune.calibration.stage import CHUNK_TOKENS, MAX_TOKENS, PROMPT_TOKENS, calibrate
from autotune.calibration.texts import DEFAULT_CALIB_TEXT
from autotune.calibration.traces import (
    HELDOUT_EVERY,
    Traces,
    default_traces_path,
    load_traces,
    require_heldout,
)
from autotune.calibration.workload import encode_text
from autotune.costing.costmodel import CostModel
from autotune.costing.memory import (
    ModelSize,
    model_size,
    predict_memory,
)
from autotune.costing.pipeline_link import profile_link
from autotune.costing.whole_prefill import DecoderShape, decoder_shape, priced_outside
from autotune.evaluation.gate import refusal, run_gate
from autotune.measuring.feedback import add_records, part_factors
from autotune.measuring.measure import DEFAULT_K, PROMPTS, measure_search
from autotune.profile_stage import measure_model_shapes, profile_device  # noqa: F401 - re-exported with the others
from autotune.profiling.model_records import (
    cover_model,
    model_label,
    outside_line,
)
from autotune.profiling.profile import (
    Profile,
    ProfileHostWarning,
    host_profile_path,
    load_profile,
    published_note,
)
from autotune.results import SearchReport
from autotune.run_stage import (  # noqa: F401 - the run stage, re-exported with the others
    check_prompt_recordable,
    evaluate,
    evaluate_tasks,
    record_prompt_traces,
    run_plan,
    torch_executed,
)
from autotune.searching.backend_choice import choose_static_backend
from autotune.searching.config import SearchConfig
from autotune.searching.cpu_choice import CpuChoice, choose_cpu_storage
from autotune.searching.dense_choice import DenseChoice, choose_dense
from autotune.searching.explain import explain
from autotune.searching.flight_plan import Flight, choose_flight
from autotune.searching.gate_candidates import gate_candidates, gate_order
from autotune.searching.layer_data import LayerData
from autotune.searching.objective import WholePrefill
from autotune.searching.optimizer import SearchOutcome, Solution, chunk_candidates, solution_plan, timed_search
from autotune.searching.pipeline_search import HostSpec, pipeline_json, pricing, split_hosts, stage_paths, write_stages
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
from autotune.searching.robustness import Robustness, assess, reassess
from autotune.searching.scoring import Scorer
from autotune.searching.space import layer_space
from autotune.searching.storage import one_search_per_sqlite, optuna_storage, study_prefix
from runtime.backends import registry
from runtime.coreml import ane_limits
from runtime.errors import NpumoeError
from runtime.fileio import atomic_write_json, output_set
from runtime.loading.compute_dtype import dtype_name
from runtime.loading.model_loader import (
    TINY_MOE_DIR,
    load_model,
    model_spec,
)
from runtime.loading.model_record import ModelRecord, check_context, resolve_model
from runtime.mlx.formats import NAME as MLX_EXACT
from runtime.plan import ModelSpec, Plan, save_plan

log = logging.getLogger("npumoe")

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
    within them raises NpumoeError and writes nothing.

    The stages, in order: the inputs (the model resolved once, the profile, the traces), the CPU's expert storage,
    the expert search and the gate's rounds, the plan and its report, the files written."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    with one_search_per_sqlite(config.storage):
        inputs = search_inputs(model, config, progress)
        cpu = choose_cpu_storage(config.cpu_weights, config.memory_gb, inputs.size, inputs.cost,
                                 inputs.profile.extra.get("kernel_records") or [], inputs.workloads[max(inputs.chunks)],
                                 inputs.record.spec.hidden_size, inputs.record.spec.expert_ffn_size,
                                 max(inputs.chunks), inputs.prompt)
        for note in inputs.notes:  # held until the inputs are known good, so that an error is always the only line
            log.warning(note)
        found, cpu = gate_rounds(inputs, config, cpu, progress)
        measured = measure_stage(inputs, config, found, cpu, progress)
        plan, report = plan_and_report(inputs, config, found, cpu, measured)
        sidecars = write_search(plan, report, inputs.out, config.objective)
    return SearchResult(plan=plan, report=report, path=inputs.out, sidecars=sidecars, seconds=found.seconds)


def search_across_macs(model: str, config: SearchConfig, hosts: list[HostSpec], link_gb_s: float | None = None,
                       progress: bool = True) -> dict:
    """`autotune search --macs N` / `--hosts`: the plan searched (`search_plan`) once per distinct profile among
    `hosts`, each layer priced under it on each host's profile, the layers split by those times under each host's
    memory, and the stage plans and `<plan>.pipeline.json` written (autotune/searching/pipeline_search.py); returns
    the pipeline file's content."""
    if config.in_flight > 1:  # each rank's stage runs one chunk at a time
        raise NpumoeError(f"--in-flight {config.in_flight} plans one Mac's prefill: not with --macs or --hosts")
    out = Path(config.out) if config.out else default_plan_path(model, config.profile)
    link = profile_link(load_profile(hosts[0].profile or "host").extra, link_gb_s)  # refused before any search
    record = resolve_model(model, config.dtype)
    shape, size = decoder_shape(record), model_size(record)
    zeros = [[0.0] * shape.num_layers for _ in hosts]  # the weights alone, before any search
    split_hosts(zeros, hosts, shape, size, config.prompt_tokens or 0, 256)
    searched: dict[str | None, SearchResult] = {}
    for h in hosts:
        if h.profile not in searched:
            to = out if not searched else out.with_suffix(f".{Path(str(h.profile)).stem}.json")
            searched[h.profile] = search_plan(model, config.replace(profile=h.profile, out=str(to)),
                                                       progress=progress)
    traces = config.traces or default_traces_path(model)
    prices = [pricing(h, searched[h.profile].plan, record, traces, searched[h.profile].report.to_json()
                      ["static_backend"]) for h in hosts]
    split = split_hosts([p.layer_ms(shape) for p in prices], hosts, shape, size, prices[0].prompt,
                        prices[0].plan.chunk_tokens)
    pipe_path, files = stage_paths(out, len(hosts))
    report = pipeline_json(prices, shape, split, link, files)
    write_stages([p.plan for p in prices], hosts, split, files)
    atomic_write_json(pipe_path, report)
    return report


@dataclass
class SearchInputs:
    """What a search works from, each read once: the model's record (and the memory and whole-prefill models' views
    of it), the profile and its cost model at the model's size, the traces, the prompt and the chunk sizes to
    search with their workloads."""
    record: ModelRecord
    size: ModelSize
    shape: DecoderShape
    profile: Profile
    profile_name: str
    cost: CostModel
    cache_state: str
    traces: Traces
    traces_path: str
    prompt: int
    chunks: list[int]
    workloads: dict[int, list[LayerData]]
    out: Path  # the plan file
    notes: list[str]  # the profile's warnings, said once the inputs are known good
    measured_here: bool = False  # the profile was measured on this host (`--measure` on by default, records kept)


def search_inputs(model: str, c: SearchConfig, progress: bool) -> SearchInputs:
    """The search's inputs: each prompt length checked against the model's context before the traces are read or
    made; the profile covering the model's own shapes (measured first where it lacks them and may measure)."""
    record = resolve_model(model, c.dtype)
    name = record.name
    if c.prompt_tokens:  # before the traces are read or made
        check_context(name, record.context, c.prompt_tokens)
    if c.prompt_tokens or not Path(c.traces or default_traces_path(name)).exists():  # the prompt is known
        c.check_gate_tokens(min(chunk_candidates(c.prompt_tokens or PROMPT_TOKENS, record.context)))
    size, shape = model_size(record), decoder_shape(record)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProfileHostWarning)
        prof, profile_name = _profile(c.profile, progress)
    prof = cover_model(prof, profile_name, shape, model_label(name), not c.no_measure, progress, size.layer_bytes,
                       record.compute_dtype)
    trs, traces_path = _traces(record, c.traces, progress, c.prompt_tokens or PROMPT_TOKENS)
    prompt = _prompt_tokens(record, trs, c.prompt_tokens)
    cost, cache_state = prof.cost_model_for(size.layer_bytes, dtype_name(record.compute_dtype))
    if c.engine == "mlx":  # the MLX spine runs the exact path and the dense half on mlx-exact, where it is
        cost = cost.with_exact(MLX_EXACT)
    chunks = chunk_candidates(prompt, record.context) if trs.chunk is not None else \
        [trs.header["chunk_tokens"]]  # counts-only traces stay as recorded
    c.check_gate_tokens(min(chunks))
    notes = [f"warning: {w.message}" for w in caught] + [published_note(prof, profile_name)]
    return SearchInputs(record, size, shape, prof, profile_name, cost, cache_state, trs, traces_path, prompt, chunks,
                        {ch: LayerData.from_traces(trs, ch, prompt) for ch in chunks},
                        Path(c.out) if c.out else default_plan_path(name, c.profile), [n for n in notes if n],
                        not prof.published and not any(issubclass(w.category, ProfileHostWarning) for w in caught))


@dataclass
class ExpertSearch:
    """One search of the experts' placement, at one CPU storage: the cost model it priced with, the static backend
    and storages it chose among, its outcome (best, baselines, front) with the robustness of its pick, and the
    gate's measurement of its candidates (None: not gated)."""
    cost: CostModel
    scorer: Scorer
    backend: str
    kinds: tuple[str, ...]
    outcome: SearchOutcome
    robustness: Robustness
    seconds: float
    gated: dict | None = None
    gated_solutions: list[Solution] = dataclasses.field(default_factory=list)  # in the gate's order


def gate_rounds(inputs: SearchInputs, c: SearchConfig, cpu: CpuChoice,
                progress: bool) -> tuple[ExpertSearch, CpuChoice]:
    """The expert search at the CPU storage chosen, its candidates through the gate; while the gate refuses every
    one, again at each wider storage that fits. Returns the search whose candidate passed (or ungated), with the
    CPU storage as the gate left it."""
    while True:
        found = expert_search(inputs, c, cpu, progress)
        found.gated, solutions = _gate(inputs, c, cpu, found, progress)
        found.gated_solutions = solutions
        if found.gated is None or found.gated["chosen"] is not None:
            break
        if cpu.wider is None:
            raise refusal(found.gated)
        log.warning(f"the fidelity gate refused every candidate with {cpu.storage} CPU experts: searching "
                    f"{cpu.wider.storage}, the next wider storage within --memory-gb")
        cpu = cpu.after_refusal(found.gated)
    if found.gated is None:
        return found, cpu
    chosen = solutions[found.gated["chosen"]["candidate"]]
    adopt(found, c, chosen)  # the gate may pass over the search's pick
    return found, cpu.after_gate(found.gated)


def adopt(found: ExpertSearch, c: SearchConfig, chosen: Solution) -> None:
    """`chosen` made the search's pick where it is another, with its robustness (`--robust`: on the pick's
    analysis, its candidates compared, its floor)."""
    if chosen is not found.outcome.best:
        found.outcome.best = chosen
        found.robustness = reassess(found.outcome, found.robustness, chosen) if c.robust else \
            assess(found.outcome, found.scorer, pick=False)[1]


def expert_search(inputs: SearchInputs, c: SearchConfig, cpu: CpuChoice, progress: bool) -> ExpertSearch:
    """The experts' placement searched at `cpu`'s storage: the static backend chosen, each layer's groups and
    storage searched at every chunk size (the dense functions placed beside where the backend has the ANE's
    limits), the pick assessed under perturbed profiles."""
    spec, resident_bytes = inputs.record.spec, c.resident_mb * 1e6  # what the budget leaves bounds the ANE's experts
    ane_bytes = resident_bytes if cpu.ane_bytes is None else min(resident_bytes, cpu.ane_bytes)
    ane_bytes = min(ane_bytes, ane_limits.WINDOW_BYTES)  # the ANE's window holds them with the dense ones
    scorer_for = partial(_scorer, cpu.cost, spec, ane_bytes, resident_bytes)
    backend = choose_static_backend(cpu.cost, LayerData.from_traces(inputs.traces), scorer_for, c.backend)
    scorer, coreml = scorer_for(backend), registry.get(backend).limits is not None
    kinds = c.compress_kinds if coreml else ("none",)  # weights stored compressed are a Core ML function's
    dense = _dense_chooser(inputs, cpu.cost, backend) if coreml and not c.no_dense else None
    factors = part_factors(inputs.profile, model_label(inputs.record.name), dtype_name(inputs.record.compute_dtype))
    outcome, seconds = timed_search(inputs.workloads, scorer, layer_space(spec.num_experts, kinds, scorer.splits_exact),
                                    dense=dense, objective=c.objective, drop_budget=c.drop_budget, trials=c.trials,
                                    storage=optuna_storage(c.storage),
                                    study_prefix=study_prefix(spec, cpu.cost, inputs.traces, ane_bytes / 1e6,
                                                              c.objective, inputs.prompt),
                                    seed=c.seed, progress=progress,
                                    whole=WholePrefill(inputs.shape, inputs.prompt, tuple(factors.items())))
    outcome.best, robustness = assess(outcome, scorer, pick=c.robust)
    if robustness.dense_choice is not None:  # the robust pick's dense placement
        outcome.dense[outcome.best.chunk_tokens] = robustness.dense_choice
    return ExpertSearch(cpu.cost, scorer, backend, tuple(kinds), outcome, robustness, seconds)


def _scorer(cost: CostModel, spec: ModelSpec, ane_bytes: float, resident_bytes: float, backend: str) -> Scorer:
    """The search's scorer on `backend`: a backend with the ANE's limits holds its experts within `ane_bytes`."""
    budget = ane_bytes if registry.get(backend).limits is not None else resident_bytes
    return Scorer(cost, spec.hidden_size, spec.expert_ffn_size, backend, budget / len(spec.moe_layers))


def _dense_chooser(inputs: SearchInputs, cost: CostModel, backend: str) -> Callable[..., DenseChoice]:
    """The dense functions' placement beside a candidate (Core ML functions, as the groups), at its chunk size."""
    calib_prompts = float(next(iter(inputs.workloads.values()))[0].tokens.sum()) / inputs.prompt

    def dense(chunk: int, weights, resident: float) -> DenseChoice:
        return choose_dense(cost, inputs.shape, inputs.prompt, chunk, backend, weights, calib_prompts, resident)

    return dense


def _gate(inputs: SearchInputs, c: SearchConfig, cpu: CpuChoice, found: ExpertSearch,
          progress: bool) -> tuple[dict | None, list[Solution]]:
    """The gate's measurement of the search's candidates, in the order it takes them (None, []: no gate)."""
    settings = c.gate_settings()
    if settings is None:
        return None, []
    outcome, scorer = found.outcome, found.scorer
    solutions = gate_order(outcome, scorer, settings.tokens, settings.candidates)
    candidates = gate_candidates(solutions, outcome, scorer, inputs.record.spec, c.saliency,
                                 lambda sol: dense_of(outcome, inputs.shape, sol))
    return run_gate(inputs.record, candidates, settings, progress=progress, cpu_weights=cpu.kind_and_group,
                    kernel_rows=cpu.kernel_rows), solutions


def measure_stage(inputs: SearchInputs, c: SearchConfig, found: ExpertSearch, cpu: CpuChoice,
                  progress: bool) -> dict | None:
    """`--measure K` (autotune/measuring/measure.py): the candidates timed on this host, the measured best within
    the fidelity limits made the search's pick, and the runs kept in a profile measured here
    (`measuring.feedback`); the report's `measure` (None: not measured)."""
    k = c.measure if c.measure is not None else DEFAULT_K if inputs.measured_here else 0
    if not k:
        return None
    outcome, scorer, spec = found.outcome, found.scorer, inputs.record.spec

    def plan_of(sol: Solution) -> Plan:
        return solution_plan(sol, outcome.chunks[sol.chunk_tokens].layers, scorer, spec.to_json(), sol.chunk_tokens,
                             c.saliency, dense=dense_of(outcome, inputs.shape, sol)).model_copy(
            update={"cpu_weights": cpu.plan_field(), "in_flight": c.in_flight if c.in_flight > 1 else None})

    outcome.best, measured, trials = measure_search(
        inputs.record, inputs.traces, outcome, scorer, k, plan_of, found.gated, found.gated_solutions,
        c.gate_settings(), c.threads or torch.get_num_threads(), c.engine, progress,
        cpu_weights=cpu.kind_and_group, kernel_rows=cpu.kernel_rows)
    if inputs.measured_here:
        add_records(inputs.profile, model_label(inputs.record.name), dtype_name(inputs.record.compute_dtype),
                    inputs.prompt, [t.to_json() for t in trials])
    return measured


def plan_and_report(inputs: SearchInputs, c: SearchConfig, found: ExpertSearch,
                    cpu: CpuChoice, measured: dict | None = None) -> tuple[Plan, SearchReport]:
    """The plan of the search's pick with its predicted figures and memory, and the report that describes it; with
    `in_flight` 2, of the schedule's choice (`flight_plan`: the experts kept where the gate, `--measure` or
    `--robust` chose them)."""
    flight = None
    if c.in_flight > 1:
        flight = choose_flight(found.outcome, found.scorer, inputs.shape, inputs.prompt,
                               bool(found.gated or measured or c.robust))
        adopt(found, c, flight.solution)
    outcome = found.outcome
    layers = outcome.chunks[outcome.best.chunk_tokens].layers
    figures = _figures(inputs, c, found, flight)
    predicted = {k: figures[k] for k in ("predicted_latency_ms", "predicted_energy_mj", "heldout_drop_rate",
                                         "predicted_cpu_ms_per_token", "predicted_prefill_ms", "predicted_parts_ms")}
    predicted["label"] = f"predicted by the cost model of profile {inputs.profile_name} ({inputs.cache_state})"
    predicted |= flight.predicted() if flight else {}
    plan = solution_plan(outcome.best, layers, found.scorer, inputs.record.spec.to_json(), figures["chunk_tokens"],
                         c.saliency, predicted, _plan_meta(inputs, c, found),
                         dense=flight.dense(inputs.shape) if flight else dense_of(outcome, inputs.shape, outcome.best)
                         ).model_copy(update={"cpu_weights": cpu.plan_field(), **(flight.fields() if flight else {})})
    memory = predict_memory(plan, inputs.size, inputs.prompt)
    if c.memory_gb is not None and memory.total > c.memory_gb * 1e9:
        raise NpumoeError(f"--memory-gb {c.memory_gb:g}: the best plan within the drop budget needs "
                          f"{memory.describe()}; give a larger budget")
    plan = plan.model_copy(update={"predicted": {**predicted, "memory": memory.to_json()}})
    return plan, SearchReport(**figures, robustness=found.robustness.to_json(), gate=found.gated, measure=measured,
                              predicted_memory=memory.to_json(), cpu_weights=cpu.to_json(),
                              explanation=explain(plan, layers, found.cost, found.backend))


def _figures(inputs: SearchInputs, c: SearchConfig, found: ExpertSearch, flight: Flight | None = None) -> dict:
    """The report's predicted figures: the pick's and the baselines' per chunk over the MoE layers, the whole
    prefill of one prompt (`flight`'s: two chunks in flight), and the parts priced past the profile's records (said
    in one line)."""
    outcome = found.outcome
    layers = outcome.chunks[outcome.best.chunk_tokens].layers
    chunk = flight.chunk_tokens if flight else outcome.best.chunk_tokens
    context = {"plan": str(inputs.out), "profile": inputs.profile_name, "static_backend": found.backend,
               "traces": inputs.traces_path, "objective": c.objective, "drop_budget": c.drop_budget,
               "chunk_tokens": chunk, "prompt_tokens": inputs.prompt, "chunks_searched": inputs.chunks,
               "compress_allowed": list(found.kinds), "compress": compress_counts(outcome.best.configs),
               "partial_chunks": "exact" if outcome.best.exact_partial else "static", "memory_gb": c.memory_gb}
    figures = search_report(outcome, layers[0].calib_chunks, sum(int(d.heldout.sum()) for d in layers),
                            found.seconds, context)
    add_cpu_figures(figures, outcome, layers, found.cost.host.pack is not None)
    whole = flight.whole if flight else whole_prefill(outcome, found.scorer, inputs.shape, inputs.prompt)
    outside = priced_outside(found.cost, inputs.shape, inputs.prompt, chunk, found.backend)
    line = outside_line(inputs.profile, inputs.profile_name, model_label(inputs.record.name), outside,
                        not c.no_measure, inputs.record.compute_dtype)
    if line:
        log.warning(line)
    return {**figures, "whole_prefill": whole, "predicted_prefill_ms": whole["predicted_prefill_ms"],
            "predicted_parts_ms": whole["predicted_parts_ms"],
            "priced_outside": {part: [r.to_json() for r in rs] for part, rs in outside.items()}}


def _plan_meta(inputs: SearchInputs, c: SearchConfig, found: ExpertSearch) -> dict:
    """What the plan records of the search that made it."""
    return {"made_by": "autotune search", "profile": inputs.profile_name, "traces": inputs.traces_path,
            "drop_budget": c.drop_budget, "objective": c.objective, "robust": c.robust, "prompt_tokens": inputs.prompt,
            "compress_allowed": list(found.kinds), "memory_gb": c.memory_gb,
            "decisions": [cfg.to_json() for cfg in found.outcome.best.configs],
            **({"gate": gate_meta(found.gated)} if found.gated else {})}


def write_search(plan: Plan, report: SearchReport, out: Path, objective: str) -> list[Path]:
    """The plan, its report and its plots written as one set (nothing half-written); returns the sidecars."""
    sidecars = search_sidecars(out, objective, tradeoff=True)
    with output_set(out, *sidecars) as (plan_tmp, report_tmp, map_tmp, tradeoff_tmp, *pareto):
        save_plan(plan, plan_tmp)
        atomic_write_json(report_tmp, report.to_json())
        plot_plan_map(plan, map_tmp)
        plot_tradeoff(report.whole_prefill, tradeoff_tmp)
        for path in pareto:
            plot_pareto(report.to_json(), path)
    return sidecars


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


def _traces(record: ModelRecord, given: str | os.PathLike | None, progress: bool,
            prompt: int = PROMPT_TOKENS) -> tuple[Traces, str]:
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
    log.warning("no traces for %s; calibrating %d-token prompts of %s into %s", record.name, prompt,
                DEFAULT_CALIB_TEXT, path)  # the plan's prompts, enough of them for --measure's held-out ones
    traces = calibrate(record, DEFAULT_CALIB_TEXT, chunk=min(CHUNK_TOKENS, prompt), prompt_tokens=prompt,
                       max_tokens=max(MAX_TOKENS, HELDOUT_EVERY * PROMPTS * prompt), out=path, progress=progress).traces
    require_heldout(traces, str(path))
    return traces, str(path)
