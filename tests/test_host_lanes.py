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
from autotune.costing.whole_prefill import DensePlacement, decoder_shape, prompt_chunks
from autotune.profiling.profile import load_profile
from autotune.searching.host_lanes import host_lanes_choice, lanes_apart, plan_experts
from autotune.searching.templates import template_plan
from runtime.loading.model_record import resolve_model

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
    buckets = tuple(c for r, c in prompt_chunks(TOKENS, CHUNK) if r == CHUNK) if "attention" in functions else ()
    return DensePlacement(**{f: "cpu-static" for f in functions}, buckets=buckets, host="mlx-exact")


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
