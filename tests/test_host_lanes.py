"""Two chunks in flight on a host without an accelerator (`autotune.searching.host_lanes`): the static lane's calls
are a unit of their own, and the schedule chooses which dense functions it takes. On the checked-in host profile,
with an MLX exact path priced as its CPU times `slow` (MLX's CPU device here computes a matmul tens of times slower
than torch)."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from autotune.costing.schedule import predict_scheduled
from autotune.costing.whole_prefill import DensePlacement, decoder_shape
from autotune.profiling.profile import load_profile
from autotune.searching.host_lanes import (
    WHOLE_FUNCTIONS,
    grouped_first,
    host_lanes_balanced,
    host_lanes_choice,
    lanes_apart,
    plan_experts,
    whole_placement,
)
from autotune.searching.templates import template_plan
from runtime.loading.model_record import resolve_model
from runtime.plan import Plan

CHUNK, TOKENS = 256, 1024


def _setup(slow: float):
    """(cost model with an mlx-exact `slow` times cpu-exact's rates, tiny-moe's shape, the experts-on-cpu-static
    plan with mlx-exact as its exact path)."""
    cost = load_profile("linux-xeon-2c-quick", check_host=False).cost_model
    cpu = cost.backend_model("cpu-exact")
    mlx = dataclasses.replace(cpu, name="mlx-exact", ms_per_gflop=cpu.ms_per_gflop * slow,
                              ms_per_mb=cpu.ms_per_mb * slow)
    cost = dataclasses.replace(cost, models={**cost.models, "mlx-exact": mlx}, _lut={}).with_exact("mlx-exact")
    record = resolve_model("tiny-moe", torch.float32)
    plan = template_plan(record.spec, chunk_tokens=CHUNK, exact="mlx-exact", backend="cpu-static")
    return cost, decoder_shape(record), plan


def _whole(functions: tuple[str, ...]) -> DensePlacement:
    return whole_placement(functions, TOKENS, CHUNK, "cpu-static", "mlx-exact")


def test_the_static_lane_is_a_unit_of_its_own_and_two_in_flight_is_bound_by_the_busier():
    cost, shape, plan = _setup(20.0)
    apart = lanes_apart(cost, "cpu-static")
    experts = plan_experts(apart, shape, plan, TOKENS, "cpu-static")
    assert experts.steps and experts.steps[-1]["cpu-static"] > 0  # the groups' calls, off the host lane
    place = _whole(("attention",))
    one, two = (predict_scheduled(apart, shape, TOKENS, CHUNK, experts, place, n)[1] for n in (1, 2))
    assert set(two.busy_ms) == {"cpu", "cpu-static"}
    for unit, busy in one.busy_ms.items():  # the same work, scheduled
        assert two.busy_ms[unit] == pytest.approx(busy, rel=1e-9)
    assert max(two.busy_ms.values()) <= two.makespan_ms < one.makespan_ms
    assert one.makespan_ms == pytest.approx(sum(one.busy_ms.values()), rel=1e-9)  # no split: the lanes in turn


@pytest.mark.parametrize("slow", [1.0, 20.0])
def test_the_choice_is_the_best_whole_placement(slow):
    cost, shape, plan = _setup(slow)
    got = host_lanes_choice(cost, shape, plan, TOKENS, "cpu-static")
    apart = lanes_apart(cost, "cpu-static")
    priced = {fs: predict_scheduled(apart, shape, TOKENS, CHUNK, got.candidate.experts, _whole(fs), 2)[1].makespan_ms
              for n in range(4) for fs in itertools.combinations(("qkv", "o_proj", "attention"), n)}
    assert got.schedule.makespan_ms == pytest.approx(min(priced.values()), rel=1e-9)
    assert not got.placement.rows  # each function wholly on one lane
    if slow > 1:  # a slow host lane: its costliest dense work, the attention core, goes to the static lane
        assert got.placement.attention == "cpu-static"


def test_grouped_first_keeps_the_first_experts_in_their_groups_and_the_rest_exact():
    _, shape, plan = _setup(1.0)
    for k in (1, 6, shape.num_experts):
        got = Plan.model_validate(grouped_first(plan, k).model_dump())  # a valid plan
        for lp, was in zip(got.layers, plan.layers):
            assert sorted(e for g in lp.groups for e in g.experts) == list(range(k))
            assert lp.cpu_exact == list(range(k, shape.num_experts))
            caps = {e: c for g in was.groups for e, c in zip(g.experts, g.capacities)}
            assert all(c == caps[e] and g.backend == "cpu-static" for g in lp.groups
                       for e, c in zip(g.experts, g.capacities))


def test_the_balanced_plan_gains_most_from_two_in_flight_within_the_slack():
    """MLX 20x slower than torch: the plan two in flight speed up most (each layer's first k experts grouped, the
    dense functions each wholly on a lane) gains more than the schedule's choice (every expert grouped), within 1.25
    of the fastest two in flight, its lanes near even; no plan of a coarse grid that ends as soon gains more."""
    cost, shape, plan = _setup(20.0)
    got = host_lanes_balanced(cost, shape, plan, TOKENS, "cpu-static")
    choice = host_lanes_choice(cost, shape, plan, TOKENS, "cpu-static")
    apart = lanes_apart(cost, "cpu-static")
    one = predict_scheduled(apart, shape, TOKENS, CHUNK, choice.candidate.experts, choice.placement, 1)[1]
    assert got.speedup > 1.3 > one.makespan_ms / choice.schedule.makespan_ms
    assert got.two.makespan_ms <= 1.25 * choice.schedule.makespan_ms  # the choice: one of its candidates
    busy = sorted(got.two.busy_ms.values())
    assert busy[0] / busy[1] > 0.9 and busy[1] <= got.two.makespan_ms < got.one.makespan_ms
    for k in (1, shape.num_experts // 2, shape.num_experts):
        experts = plan_experts(apart, shape, grouped_first(plan, k), TOKENS, "cpu-static")
        for n in range(len(WHOLE_FUNCTIONS) + 1):
            for fs in itertools.combinations(WHOLE_FUNCTIONS, n):
                one, two = (predict_scheduled(apart, shape, TOKENS, CHUNK, experts, _whole(fs), i)[1].makespan_ms
                            for i in (1, 2))
                assert two > got.two.makespan_ms or one / two <= got.speedup + 1e-9, (k, fs)
