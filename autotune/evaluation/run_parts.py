"""A run's prefill by part, measured (`runtime.dense.measured_parts`: forward hooks) next to the whole-prefill
prediction for the plan's profile (`autotune.costing.whole_prefill`): what `run --json` reports as
`measured_parts_ms` and `predicted_parts_ms`; and what the plan's search predicted, to set beside a run
(`plan_predicted`)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from autotune.costing.whole_prefill import DecoderShape, ExpertFigures, placement_of, predict_prefill
from autotune.profiling.profile import host_profile_path, load_profile
from runtime.dense import measured_parts
from runtime.errors import NpumoeError
from runtime.plan import Plan

log = logging.getLogger("npumoe")


def measure_parts(model: torch.nn.Module, prefill: Callable[[], object], off_cpu: bool) -> dict:
    """Ms per part of one more run of `prefill` (its forwards' hooks): on this process's CPU clock where the run is
    one-thread CPU work (what a shared host's other load does not inflate, as profile-device times it), else on
    the wall clock (`off_cpu`: a backend that ran off the CPU); `clock` says which."""
    cpu = torch.get_num_threads() == 1 and not off_cpu
    with measured_parts(model, time.process_time if cpu else time.perf_counter) as times:
        prefill()
    return {**times.parts_ms(), "clock": "cpu" if cpu else "wall"}


def predict_parts(plan: Plan, config: dict, tokens: int, prompt_tokens: int) -> dict | None:
    """The whole-prefill prediction of a run of `tokens` tokens in prompts of `prompt_tokens` (every position's
    logits, as a run computes them), on the profile the plan was searched for, the experts at the plan's own
    predicted figure per chunk; None where the plan carries no prediction or its profile is not here."""
    predicted, meta = plan.predicted or {}, plan.meta or {}
    per_chunk, name = predicted.get("predicted_latency_ms"), meta.get("profile")
    if per_chunk is None or not name:
        return None
    try:
        cost = load_profile(host_profile_path() if name == "host" else name, check_host=False).cost_model
    except (NpumoeError, OSError) as e:
        log.warning("run: no prediction by part (profile %s: %s)", name, e)
        return None
    shape = DecoderShape.from_config(config)
    parts: dict[str, float] = {}
    start = 0
    while start < tokens:
        p = min(prompt_tokens, tokens - start)
        experts = ExpertFigures(per_chunk * p / plan.chunk_tokens, 0.0, None)
        pred = predict_prefill(cost, shape, p, plan.chunk_tokens, experts, placement_of(plan.dense), logits_rows=p)
        for k, v in pred.parts_ms.items():
            parts[k] = parts.get(k, 0.0) + v
        start += p
    return {**{k: round(v, 3) for k, v in parts.items()},
            "label": f"predicted by the cost model of profile {name} (experts: the plan's figure per chunk)"}


def plan_predictions(plan: Plan) -> dict | None:
    """What the plan's search predicted for its profile's device (CPU-busy time of the MoE layers per token,
    memory at its prompt length), to set beside a run's measurements; None for a plan without predictions."""
    p = plan.predicted or {}
    if "predicted_cpu_ms_per_token" not in p and "memory" not in p:
        return None
    return {"cpu_ms_per_token": p.get("predicted_cpu_ms_per_token"),
            "memory_gb": (p.get("memory") or {}).get("total_gb"), "label": p.get("label")}
