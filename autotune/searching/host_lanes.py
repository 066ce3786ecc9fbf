"""Two chunks in flight on a host without an accelerator: which dense functions the static lane (torch, one thread)
takes beside the host lane (MLX's CPU device), chosen by the schedule from a host profile.

There the two lanes are two threads on two cores (`--threads 1`), so the profile's CPU is two units: the static
backend's calls on one (`lanes_apart`), the host's exact path (the plan's dense half and packing) on the other. The
plan's experts are its static groups (priced at their capacities: every chunk routed evenly); its dense functions
are chosen by `overlap_choice.choose_overlapped` under the schedule, each function wholly on one lane (a split's
other rows would run MLX work off the host lane)."""
from __future__ import annotations

import dataclasses

import numpy as np

from autotune.costing.costmodel import CostModel
from autotune.costing.whole_prefill import DecoderShape, DensePlacement, ExpertFigures, prompt_chunks
from autotune.searching.overlap_choice import Candidate, Overlapped, choose_overlapped, work_units
from runtime.plan import Plan


def lanes_apart(cost: CostModel, backend: str) -> CostModel:
    """`cost` with `backend`'s calls on a unit of their own (off the host lane's), as this host's static lane runs
    them: its own thread on its own core."""
    model = dataclasses.replace(cost.backend_model(backend), overlaps_cpu=True)
    return dataclasses.replace(cost, models={**cost.models, backend: model}, _lut={})


def plan_experts(cost: CostModel, shape: DecoderShape, plan: Plan, prompt_tokens: int, backend: str) -> ExpertFigures:
    """The plan's experts over one prompt: latency and CPU-busy time of every MoE layer's chunks, and their
    schedule steps (`overlap_choice.work_units`), each chunk's tokens routed evenly over the experts."""
    rows = np.array([r for r, _ in prompt_chunks(prompt_tokens, plan.chunk_tokens)])
    counts = np.repeat((rows * shape.top_k / shape.num_experts)[:, None], shape.num_experts, axis=1).round()
    latency = cpu = 0.0
    steps: list[dict[str, float]] = [{}, {}]
    for lp in plan.layers:
        t, c = cost.layer_times(lp, counts, shape.hidden, shape.expert_ffn, plan.overflow, plan.exact_path)
        latency, cpu = latency + float(np.sum(t)), cpu + float(np.sum(c))
        work = cost.layer_work(lp, counts, shape.hidden, shape.expert_ffn, plan.overflow, plan.exact_path)
        for into, units in zip(steps, work_units(cost, work, plan.exact_path, backend)):
            for unit, ms in units.items():
                into[unit] = into.get(unit, 0.0) + ms
    return ExpertFigures(latency, cpu, None, tuple(s for s in steps if any(v > 0 for v in s.values())))


def host_lanes_choice(cost: CostModel, shape: DecoderShape, plan: Plan, prompt_tokens: int, backend: str,
                      in_flight: int = 2) -> Overlapped:
    """The dense placement (each of q/k/v, o_proj and the attention core wholly on `backend` or on the plan's exact
    path) whose schedule with `in_flight` chunks ends first on this host's two lanes, from everything on the exact
    path; its prediction and schedule (predicted)."""
    apart = lanes_apart(cost, backend)
    experts = plan_experts(apart, shape, plan, prompt_tokens, backend)
    cand = Candidate(plan.chunk_tokens, experts, DensePlacement(host=plan.exact_path))
    return choose_overlapped(apart, backend, shape, prompt_tokens, cand, in_flight, grid=lambda chunk: [0, chunk])
