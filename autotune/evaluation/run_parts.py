"""A run's prefill by part, measured (`runtime.dense.measured_parts`: forward hooks) next to the whole-prefill
prediction for the plan's profile (`autotune.costing.whole_prefill`): what `run --json` reports as
`measured_parts_ms` and `predicted_parts_ms`; and what the plan's search predicted, to set beside a run
(`plan_predicted`). The experts are predicted from the run's own routing (its assignments per expert in each chunk
of each MoE layer, recorded while the parts are timed), priced as the plan runs them."""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from autotune.costing.costmodel import CostModel
from autotune.costing.whole_prefill import DecoderShape, ExpertFigures, placement_of, predict_prefill
from autotune.profiling.profile import Profile, host_profile_path, load_profile
from runtime.dense import measured_parts
from runtime.errors import NpumoeError
from runtime.loading.model_loader import moe_layers
from runtime.plan import LayerPlan, Plan

log = logging.getLogger("npumoe")

Routing = dict[int, list[np.ndarray]]  # per MoE layer, each chunk's assignments per expert, in run order


@contextmanager
def recorded_routing(model: torch.nn.Module, chunk_tokens: int) -> Iterator[Routing]:
    """Each MoE layer's assignments per expert in every chunk of the forwards inside the block (a forward longer
    than a chunk is cut as the executor cuts it), from a hook on the experts module's inputs."""
    routing: Routing = {}
    handles = []

    def hook(layer: int, experts: int):
        def pre(module, args, kwargs):
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            for start in range(0, idx.shape[0], chunk_tokens):
                counts = torch.bincount(idx[start:start + chunk_tokens].reshape(-1), minlength=experts)
                routing.setdefault(layer, []).append(counts.numpy().astype(np.int64))
        return pre

    for moe in moe_layers(model):
        handles.append(moe.experts.register_forward_pre_hook(hook(moe.index, int(moe.experts.num_experts)),
                                                             with_kwargs=True))
    try:
        yield routing
    finally:
        for h in handles:
            h.remove()


def measure_parts(model: torch.nn.Module, prefill: Callable[[], object], off_cpu: bool, chunk_tokens: int,
                  repeat: int = 1, calls: dict | None = None) -> tuple[dict, Routing]:
    """Ms per part of `repeat` more runs of `prefill` (its forwards' hooks), each part's median over them (one run
    on a shared host moved a part by 20%): on this process's CPU clock where the run is one-thread CPU work (what a
    shared host's other load does not inflate, as profile-device times it), else on the wall clock (`off_cpu`: a
    backend that ran off the CPU); `clock` says which. With it, the first run's routing (`recorded_routing`).
    `calls`: filled with the first run's calls per part."""
    cpu = torch.get_num_threads() == 1 and not off_cpu
    clock = time.process_time if cpu else time.perf_counter
    with recorded_routing(model, chunk_tokens) as routing, measured_parts(model, clock) as times:
        prefill()
    runs = [times.parts_ms()]
    if calls is not None:
        calls.update(times.parts_calls())
    for _ in range(repeat - 1):
        with measured_parts(model, clock) as times:
            prefill()
        runs.append(times.parts_ms())
    return {**{part: statistics.median(r[part] for r in runs) for part in runs[0]}, "clock": "cpu" if cpu else "wall"
            }, routing


def routed_experts(cost: CostModel, plan: Plan, shape: DecoderShape, routing: Routing) -> list[ExpertFigures]:
    """The experts' predicted latency and CPU-busy time per chunk (all MoE layers) for the routing a run saw, as
    the executor runs each chunk: the layer's plan, or wholly exact (a chunk below the plan's
    `exact_below_tokens`, through transformers' grouped kernel, priced as the exact path; a layer without groups
    runs its other chunks on the exact path, expert by expert, as priced)."""
    plans = {lp.layer: lp for lp in plan.layers}
    chunks = max((len(c) for c in routing.values()), default=0)
    latency, cpu = np.zeros(chunks), np.zeros(chunks)
    for layer, per_chunk in routing.items():
        counts = np.stack(per_chunk)
        every = LayerPlan.model_construct(layer=layer, groups=[], cpu_exact=list(range(counts.shape[1])))
        planned = counts.sum(axis=1) >= plan.exact_below * shape.top_k  # a chunk's tokens pick top-k experts each
        for lp, rows in ((plans.get(layer, every), planned), (every, ~planned)):
            if rows.any():
                t, c = cost.layer_times(lp, counts[rows], shape.hidden, shape.expert_ffn, plan.overflow,
                                        plan.exact_path)
                latency[rows] += t
                cpu[rows] += c
    return [ExpertFigures(float(t), float(c), None) for t, c in zip(latency, cpu)]


def plan_profile(plan: Plan) -> Profile | None:
    """The profile the plan was searched for; None where the plan names none or its profile is not here (said
    once, as a warning)."""
    name = (plan.meta or {}).get("profile")
    if not name:
        return None
    try:
        return load_profile(host_profile_path() if name == "host" else name, check_host=False)
    except (NpumoeError, OSError) as e:
        log.warning("run: no prediction by part (profile %s: %s)", name, e)
        return None


def predict_parts(plan: Plan, profile: Profile | None, config: dict, layer_bytes: int, tokens: int,
                  prompt_tokens: int, routing: Routing | None = None, every_position: bool = False,
                  dtype: str = "float32") -> dict | None:
    """The whole-prefill prediction of a run of `tokens` tokens in prompts of `prompt_tokens` (logits for each
    chunk's last position, as a prefill computes them, or with `every_position` for every one), on the profile the
    plan was searched for (`plan_profile`), in the cache state of a model of `layer_bytes` per layer (`Profile.
    cost_model_for`) computing in `dtype`; the experts priced from the run's `routing` (`recorded_routing`), or
    without it at the plan's own predicted figure per chunk. None without that profile or where the plan carries no
    prediction."""
    per_chunk = (plan.predicted or {}).get("predicted_latency_ms")
    if profile is None or per_chunk is None:
        return None
    name = plan.meta["profile"]
    cost, cache_state = profile.cost_model_for(layer_bytes, dtype)
    shape = DecoderShape.from_config(config)
    routed = routed_experts(cost, plan, shape, routing) if routing else None
    parts: dict[str, float] = {}
    start, chunk = 0, 0
    while start < tokens:
        p = min(prompt_tokens, tokens - start)
        n = -(-p // plan.chunk_tokens)  # the prompt's chunks
        if routed is not None:
            mine = routed[chunk:chunk + n]
            experts = ExpertFigures(sum(f.latency_ms for f in mine), sum(f.cpu_ms for f in mine), None)
        else:
            experts = ExpertFigures(per_chunk * p / plan.chunk_tokens, 0.0, None)
        pred = predict_prefill(cost, shape, p, plan.chunk_tokens, experts, placement_of(plan.dense),
                               logits_rows=p if every_position else n)
        for k, v in pred.parts_ms.items():
            parts[k] = parts.get(k, 0.0) + v
        start, chunk = start + p, chunk + n
    how = "the run's routing, priced as the plan runs it" if routed is not None else "the plan's figure per chunk"
    return {**{k: round(v, 3) for k, v in parts.items()},
            "label": f"predicted by the cost model of profile {name} (experts: {how}; {cache_state})"}


def plan_predictions(plan: Plan) -> dict | None:
    """What the plan's search predicted for its profile's device (CPU-busy time of the MoE layers per token,
    memory at its prompt length), to set beside a run's measurements; None for a plan without predictions."""
    p = plan.predicted or {}
    if "predicted_cpu_ms_per_token" not in p and "memory" not in p:
        return None
    return {"cpu_ms_per_token": p.get("predicted_cpu_ms_per_token"),
            "memory_gb": (p.get("memory") or {}).get("total_gb"), "label": p.get("label")}
