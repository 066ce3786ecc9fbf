"""`autotune run --engine mlx`: a plan's chunked prefill on the MLX spine (`runtime.mlx.spine`), with its run
statistics, `executed` (each part's lanes, from a timed pass after the measured runs) and, with `reference`,
every position's logits against mlx-lm's own forward of the same folder (the plan uninstalled: mlx-lm's model
as it loads). The torch-only figures (the memory prediction, the parts' prediction) are not made here."""
from __future__ import annotations

import os

import torch

from autotune.calibration.workload import encode_text
from autotune.evaluation.run_parts import plan_predictions
from autotune.results import RunResult
from runtime.engines import set_in_flight
from runtime.generation import Loaded, context_positions, load
from runtime.loading.checkpoints import check_token_ids
from runtime.loading.model_record import check_context
from runtime.prefill import max_rel_diff
from runtime.priced_lanes import executed_as_priced
from runtime.resources import peak_rss_bytes, timed_runs

GB = 1 << 30


def run_on_mlx(model: str, plan: str | os.PathLike, *, text: str, max_tokens: int, prompt_tokens: int | None,
               dtype: str, reference: bool, repeat: int, package: str | None = None,
               cluster: object | None = None, in_flight: int | None = None) -> RunResult:
    """`pipeline.run_plan` on the MLX spine (the same keys, `engine` "mlx"); `package`: what `autotune build` wrote
    for the plan's groups. `cluster`: under `mlx.launch`, this rank's stage of the model (its `rank` and `layers`
    in the result). The timed runs prefill in the plan's chunking (`chunk_rows`) with its chunks in flight
    (`in_flight`, None: the plan's), each lane's busy and wait ms of the last in `executed`; `reference` computes
    every position's logits, one chunk at a time, as the pass that times the parts does."""
    from runtime.mlx.spine_generation import prefill_logits

    loaded = load(model, plan, package, dtype=dtype, engine="mlx", cluster=cluster)
    set_in_flight(loaded, in_flight)
    ids = encode_text(loaded.tokenizer, text, max_tokens)
    check_token_ids(loaded.model, ids)
    n, chunk, spine, rows = int(ids.numel()), loaded.plan.chunk_tokens, loaded.executor, loaded.plan.chunk_rows or ()
    check_context(model, context_positions(loaded.model), prompt_tokens or n,
                  "--prompt-tokens" if prompt_tokens else "--max-tokens")

    def prefill() -> torch.Tensor:
        return prefill_logits(loaded.model, ids, chunk, prompt_tokens, every_position=reference, rows=rows)

    ref = reference_ms = None
    if reference:
        with loaded.unmodified():
            ref, reference_ms, _ = timed_runs(prefill, repeat)
    logits, latency_ms, cpu_ms = timed_runs(lambda: _counted(loaded, prefill), repeat)
    stats, drift, lanes = spine.stats.to_json(), spine.drift.report(), dict(spine.in_flight_lanes)
    diff = max_rel_diff(logits, ref) if reference else None
    del logits, ref
    spine.reset()
    loaded.model.in_flight, in_flight = 1, loaded.model.in_flight  # each part timed around itself: one at a time
    with spine.timed():
        prefill()
    loaded.model.in_flight = in_flight
    spine.add_lanes(lanes)
    return RunResult(model=model, plan=str(plan), text=text, tokens=n, chunk_tokens=chunk,
                     overflow=loaded.plan.overflow, latency_ms=latency_ms, wall_ms_per_token=latency_ms / n,
                     cpu_ms_per_token=cpu_ms / n, stats=stats, backend_fallbacks=spine.fallbacks, drift=drift,
                     memory={"measured_peak_rss_gb": round(peak_rss_bytes() / GB, 4),
                             "measured": "peak resident set size of this process (ru_maxrss)"},
                     plan_predicted=plan_predictions(loaded.plan), reference_latency_ms=reference_ms,
                     max_rel_diff_vs_reference=diff, energy_per_backend=spine.energy() or None, engine="mlx",
                     cluster=loaded.cluster.to_json() if loaded.cluster else None,
                     **executed_as_priced(loaded.plan, spine, spine.executed().to_json()))


def _counted(loaded: Loaded, prefill):
    loaded.reset()
    return prefill()

