"""Two chunks in flight on a host without an accelerator: which dense functions the static lane (torch, one thread)
takes beside the host lane (MLX's CPU device), chosen by the schedule from a host profile.

There the two lanes are two threads on two cores (`--threads 1`), so the profile's CPU is two units: the static
backend's calls on one (`lanes_apart`), the host's exact path (the plan's dense half and packing) on the other. The
plan's experts are its static groups (priced at their capacities: every chunk routed evenly); its dense functions
are chosen by `overlap_choice.choose_overlapped` under the schedule, each function wholly on one lane (a split's
other rows would run MLX work off the host lane)."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np

from autotune.costing.costmodel import CostModel
from autotune.costing.schedule import Schedule, predict_scheduled
from autotune.costing.whole_prefill import DecoderShape, DensePlacement, ExpertFigures, prompt_chunks
from autotune.searching.overlap_choice import Candidate, Overlapped, choose_overlapped, with_steps, work_units
from runtime.plan import Group, LayerPlan, Plan

WHOLE_FUNCTIONS = ("qkv", "o_proj", "attention")  # the dense functions a lane takes whole here


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
    per_layer = []
    for lp in plan.layers:
        t, c = cost.layer_times(lp, counts, shape.hidden, shape.expert_ffn, plan.overflow, plan.exact_path)
        latency, cpu = latency + float(np.sum(t)), cpu + float(np.sum(c))
        work = cost.layer_work(lp, counts, shape.hidden, shape.expert_ffn, plan.overflow, plan.exact_path)
        per_layer.append(work_units(cost, work, plan.exact_path, backend))
    return with_steps(ExpertFigures(latency, cpu, None), per_layer)


def host_lanes_choice(cost: CostModel, shape: DecoderShape, plan: Plan, prompt_tokens: int, backend: str,
                      in_flight: int = 2) -> Overlapped:
    """The dense placement (each of q/k/v, o_proj and the attention core wholly on `backend` or on the plan's exact
    path) whose schedule with `in_flight` chunks ends first on this host's two lanes, from everything on the exact
    path; its prediction and schedule (predicted)."""
    apart = lanes_apart(cost, backend)
    experts = plan_experts(apart, shape, plan, prompt_tokens, backend)
    cand = Candidate(plan.chunk_tokens, experts, DensePlacement(host=plan.exact_path))
    return choose_overlapped(apart, backend, shape, prompt_tokens, cand, in_flight, grid=lambda chunk: [0, chunk],
                             grain=0)


@dataclass
class Balanced:
    """The placement two chunks in flight speed up most (`host_lanes_balanced`): each layer's first `grouped`
    experts in static groups, the dense functions as `placement` puts them, and its schedules with one and with two
    chunks in flight (predicted)."""
    grouped: int
    placement: DensePlacement
    one: Schedule
    two: Schedule

    @property
    def speedup(self) -> float:
        return self.one.makespan_ms / self.two.makespan_ms


def grouped_first(plan: Plan, grouped: int) -> Plan:
    """`plan` with each layer's experts below `grouped` kept in its static groups (their capacities), the others on
    its exact path."""
    def layer(lp: LayerPlan) -> LayerPlan:
        groups = [Group(backend=g.backend, experts=[e for e in g.experts if e < grouped],
                        capacities=[c for e, c in zip(g.experts, g.capacities) if e < grouped])
                  for g in lp.groups if min(g.experts) < grouped]
        kept = {e for g in groups for e in g.experts}
        experts = sorted({*kept, *lp.cpu_exact, *(e for g in lp.groups for e in g.experts)})
        return lp.model_copy(update={"groups": groups, "cpu_exact": [e for e in experts if e not in kept]})
    return plan.model_copy(update={"layers": [layer(lp) for lp in plan.layers]})


def whole_placement(functions: tuple[str, ...], prompt_tokens: int, chunk: int, backend: str,
                    host: str) -> DensePlacement:
    """`functions` (of q/k/v, o_proj and the attention core: a bucket per full chunk's context) wholly on
    `backend`, the rest on `host`."""
    buckets = tuple(c for r, c in prompt_chunks(prompt_tokens, chunk) if r == chunk) if "attention" in functions \
        else ()
    return DensePlacement(**{f: backend for f in functions}, buckets=buckets, host=host)


def host_lanes_balanced(cost: CostModel, shape: DecoderShape, plan: Plan, prompt_tokens: int, backend: str,
                        slack: float = 1.25) -> Balanced:
    """The plan whose two chunks in flight gain most over one at a time on this host's two lanes, among those whose
    two-in-flight makespan is within `slack` of the fastest's (predicted): each layer's first k experts (k >= 1) in
    the plan's static groups on `backend`, the others on its exact path, and each dense function wholly on one lane.
    Gain, not equal busy lanes, is the measure: a chunk's chain alternates lanes, so lanes equally busy may still wait
    on each other; the slack keeps a plan that gains by being slow (work on the slower lane) out."""
    apart = lanes_apart(cost, backend)
    found: list[Balanced] = []
    for grouped in range(1, shape.num_experts + 1):
        experts = plan_experts(apart, shape, grouped_first(plan, grouped), prompt_tokens, backend)
        for n in range(len(WHOLE_FUNCTIONS) + 1):
            for functions in itertools.combinations(WHOLE_FUNCTIONS, n):
                place = whole_placement(functions, prompt_tokens, plan.chunk_tokens, backend, plan.exact_path)
                one, two = (predict_scheduled(apart, shape, prompt_tokens, plan.chunk_tokens, experts, place, k)[1]
                            for k in (1, 2))
                found.append(Balanced(grouped, place, one, two))
    fastest = min(b.two.makespan_ms for b in found)
    return max((b for b in found if b.two.makespan_ms <= slack * fastest),
               key=lambda b: (b.speedup, -b.two.makespan_ms))
