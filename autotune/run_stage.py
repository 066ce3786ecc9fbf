"""The run stage: a plan run over a text against the unmodified model (`run_plan`), its fidelity measured
(`evaluate`, `evaluate_tasks`), and the prompt traces `generate` records. Moved out of `autotune/pipeline.py`, which
re-exports these with the other stages."""
from __future__ import annotations

import logging
import os
from functools import partial

import torch

from autotune.calibration.texts import DEFAULT_EVAL_TEXT
from autotune.calibration.traces import (
    record_run_traces,
    require_recordable,
)
from autotune.calibration.workload import encode_text
from autotune.costing.cpu_storage import load_options
from autotune.costing.memory import (
    ModelSize,
    against_measured,
    simulated_functions,
)
from autotune.evaluation.host_speed import host_speed
from autotune.evaluation.run_parts import measure_parts, plan_predictions, plan_profile, predict_parts
from autotune.results import EvaluateResult, RunResult, TasksResult
from runtime.backends import registry
from runtime.engines import check_in_flight, resolve_engine, torch_only
from runtime.errors import NpumoeError
from runtime.generation import Loaded, context_positions, load, prompt_ids
from runtime.loading.checkpoints import check_token_ids
from runtime.loading.compute_dtype import dtype_name
from runtime.loading.model_loader import (
    context_length,
)
from runtime.loading.model_record import check_context
from runtime.plan import load_plan
from runtime.prefill import max_rel_diff, prefill_prompts_last_logits, prefill_prompts_logits
from runtime.priced_lanes import executed_as_priced
from runtime.resources import peak_rss_bytes, timed_runs
from runtime.stats import DENSE_PARTS, PARTS, TORCH_CPU, Executed, LayerStats, lane_of

log = logging.getLogger("npumoe")
SHIFT_TOLERANCE = 1.5  # a plan "holds" on shifted text when its measured drop rate is within 1.5x its budget


def _planned(model: str, plan: str | os.PathLike, package: str | None, dtype: str, text: str,
             max_tokens: int, prompt_tokens: int | None, cpu_weights: str | None,
             engine: str = "torch", cluster: object | None = None) -> tuple[Loaded, torch.Tensor]:
    """The planned model (the plan checked against it before any text is read) and the text's token ids, its
    prompts (of `prompt_tokens`; None: the whole text, one prompt) within the model's context; `cpu_weights`: the
    CPU's expert storage (`--cpu-weights`), quantized at load; `engine`: the spine (`runtime.load`); `cluster`:
    under mlx.launch, this rank's part (`runtime.mlx.cluster.ClusterSpec`)."""
    if prompt_tokens:  # before the load says anything
        check_context(model, context_length(model), prompt_tokens)
    loaded = load(model, plan, package, dtype, **load_options(cpu_weights), engine=engine, cluster=cluster)
    ids = encode_text(loaded.tokenizer, text, max_tokens)
    check_token_ids(loaded.model, ids)
    if not prompt_tokens:  # one prompt: the whole text
        check_context(model, context_positions(loaded.model), int(ids.numel()), "--max-tokens")
    return loaded, ids


def run_plan(model: str, plan: str | os.PathLike, *, text: str = DEFAULT_EVAL_TEXT, max_tokens: int = 1024,
             prompt_tokens: int | None = None, package: str | None = None, dtype: str = "auto",
             reference: bool = False, repeat: int = 1, record_traces: str | os.PathLike | None = None,
             cpu_weights: str | None = None, engine: str = "torch", cluster: object | None = None,
             in_flight: int | None = None) -> RunResult:
    """Prefill the first `max_tokens` tokens of `text` under the plan (as prompts of `prompt_tokens`, default one
    prompt), timed as the median of `repeat` runs: run statistics, backend fallbacks, the drift monitor's verdict,
    the measured energy of backends that measure their calls (`energy_per_backend`, of the last run), and with
    `reference` the unmodified model's latency and the logits' max relative difference (`.to_json()`: what
    `autotune run --json` prints). `record_traces`: also write the routing the plan saw there as traces. `engine`:
    the spine (`runtime.engines`; mlx: `autotune.spine_run`). `cluster`: under `mlx.launch`, this rank's part
    (`runtime.mlx.cluster.ClusterSpec`), run on the MLX spine. `in_flight`: the prefill's chunks in flight on the
    MLX spine (None: the plan's; `runtime.engines.set_in_flight`)."""
    p = load_plan(plan)
    needs_torch = "--record-traces" if record_traces else torch_only(p, cpu_weights)
    if resolve_engine("mlx" if cluster is not None else engine, p, needs_torch) == "mlx":
        from autotune.spine_run import run_on_mlx

        return run_on_mlx(model, plan, text=text, max_tokens=max_tokens, prompt_tokens=prompt_tokens, dtype=dtype,
                          reference=reference, repeat=repeat, package=package, cluster=cluster, in_flight=in_flight)
    check_in_flight(in_flight, "torch", True)
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
            ref, reference_ms, _ = timed_runs(prefill, repeat)

    def planned() -> torch.Tensor:
        loaded.reset()
        return prefill()

    logits, latency_ms, cpu_ms = timed_runs(planned, repeat)
    # the run's own figures, before recording traces (or timing the parts) runs the model again
    stats, drift, energy = executor.stats.to_json(), executor.drift.report(), executor.energy() or None
    dense_calls = executor.dense.to_json() if executor.dense is not None else None
    ran = [registry.get(b) for b in stats.get("calls_per_backend", {})]
    # the logits are compared now and dropped: timing the parts prefills again, and would hold a second copy
    diff = max_rel_diff(logits, ref) if reference else None
    del logits, ref
    part_calls: dict = {}
    measured, routing = measure_parts(loaded.model, planned, any(info.overlaps_cpu for info in ran if info is not None),
                                      chunk, repeat, calls=part_calls)
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
                     predicted_parts_ms=predicted, host_speed=host_speed(profile), dense_calls=dense_calls,
                     **executed_as_priced(loaded.plan, executor,
                                          torch_executed(executor.stats.total(), measured, part_calls, dense_calls)))


def torch_executed(experts: LayerStats, measured: dict, calls: dict, dense_calls: dict | None) -> dict:
    """`executed` of a run on the torch spine: the experts on the lanes their backends name (timed around each
    call), every other part on torch on the CPU (its calls and ms from the timed parts' pass), and the calls of
    dense functions a static backend ran (their time is inside their part's)."""
    out = Executed()
    out.add_experts(experts)
    for part in PARTS:
        if part != "experts" and calls.get(part):
            out.add(part, TORCH_CPU, calls[part], measured[part] / 1e3)
    for kind, backends in (dense_calls or {}).items():
        for backend, n in backends.items():
            if lane_of(backend) != TORCH_CPU:
                out.add(DENSE_PARTS[kind], lane_of(backend), n)
    return out.to_json()


def evaluate(model: str, plan: str | os.PathLike, *, text: str = DEFAULT_EVAL_TEXT, max_tokens: int = 8192,
             prompt_tokens: int = 1024, package: str | None = None, dtype: str = "auto",
             progress: bool = True, cpu_weights: str | None = None, engine: str = "torch",
             cluster: object | None = None) -> EvaluateResult:
    """A plan's fidelity on the first `max_tokens` tokens of `text` (prompts of `prompt_tokens`): perplexity of
    the plan and the unmodified model, top-1 agreement, drop and spill rates, and whether the drop rate stays
    within 1.5x the plan's budget (`.to_json()`: what `autotune evaluate --json` prints). `engine`: the spine
    (`runtime.engines`); on mlx the unmodified model is mlx-lm's own forward of the same folder. `cluster`: under
    `mlx.launch`, this rank's part (`runtime.mlx.cluster.ClusterSpec`), on the MLX spine: every rank gets the
    model's logits, so the same perplexities and agreement; its rates count its own layers' experts."""
    from autotune.evaluation.fidelity import evaluate_plan

    p = load_plan(plan)
    engine = resolve_engine("mlx" if cluster is not None else engine, p, torch_only(p, cpu_weights))
    loaded, ids = _planned(model, plan, package, dtype, text, max_tokens, prompt_tokens, cpu_weights, engine,
                           cluster)
    chunks = None
    if engine == "mlx":
        from runtime.mlx.spine_generation import chunk_logits

        chunks = partial(chunk_logits, loaded.model)
    figures = evaluate_plan(loaded.executor, ids, prompt_tokens, progress=progress, chunk_logits=chunks)
    budget = (loaded.plan.meta or {}).get("drop_budget")
    return EvaluateResult(model=model, plan=str(plan), text=text, **figures, drop_budget=budget,
                          drop_rate_within_1_5x_budget=None if budget is None else
                          figures["drop_rate"] <= SHIFT_TOLERANCE * budget, engine=engine,
                          cluster=loaded.cluster.to_json() if loaded.cluster else None)


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
