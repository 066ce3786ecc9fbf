"""The least makespan of any split of a prompt's ops at the cost model's own prices (`autotune.costing.priced_bound`,
`split_program`): hand-made programs solved by hand (the energy cap binding in one, the window in another, a
prefix paying its first band), and the bound never above a schedule the search prices, on small decoder shapes."""
from __future__ import annotations

import dataclasses

import pytest
from helpers import BOUND_PROMPT as PROMPT
from helpers import BOUND_SHAPE as SHAPE
from helpers import bound_search as search

from autotune.costing.costmodel import BackendModel, CostModel
from autotune.costing.schedule import predict_scheduled
from autotune.costing.split_program import Role, SplitProgram
from autotune.profiling.profile import load_profile
from autotune.searching.bound_report import bound_setup, priced_bounds, solved_bound
from autotune.searching.objective import WholePrefill
from autotune.searching.prefill_report import overlap_candidates


def two_ops(steps: tuple[str, str] = ("", "")) -> SplitProgram:
    """Two ops over units a (1 W) and b (10 W): op 1 costs a 10 ms, b 20; op 2 a 30, b 15; op 1's share on a keeps
    100 bytes resident; each op in its chain step of `steps`."""
    prog = SplitProgram()
    first = prog.op([Role("a", (0.0, 10.0), 1.0), Role("b", (0.0, 20.0), 10.0)], step=steps[0])
    prog.op([Role("a", (0.0, 30.0), 1.0), Role("b", (0.0, 15.0), 10.0)], step=steps[1])
    prog.window[first["a"]] = 100.0
    return prog


def test_two_units_two_ops_by_hand():
    # a takes op 1 (its better ratio) and x of op 2: 10 + 30 x = 15 (1 - x), x = 1/9, T = 40/3
    free = two_ops().solve()
    assert free.bound_ms == pytest.approx(40 / 3, rel=1e-6)
    assert free.busy_ms == pytest.approx({"a": 40 / 3, "b": 40 / 3}, rel=1e-6)
    assert free.energy_mj == pytest.approx(40 / 3 * 11, rel=1e-6)
    # energy 350 - 190 x1 - 120 x2 <= 140: x1 = 1 (a's cheaper ms per mJ saved), x2 = 1/6; a busy 15, b 12.5
    capped = two_ops().solve(energy_cap_mj=140.0)
    assert capped.bound_ms == pytest.approx(15.0, rel=1e-6)
    assert capped.busy_ms["b"] == pytest.approx(12.5, rel=1e-6) and capped.energy_mj == pytest.approx(140.0)
    assert capped.duals["energy_cap"] > 0 and capped.duals["busy:a"] == pytest.approx(1.0)
    # a window of 50 bytes: op 1 half on a; 5 + 30 x = 25 - 15 x, x = 4/9, T = 55/3
    held = two_ops().solve(window_bytes=50.0)
    assert held.bound_ms == pytest.approx(55 / 3, rel=1e-6)
    assert held.duals["window"] > 0 and "energy_cap" not in held.duals
    # every op on a is the least energy (40 mJ): a cap of 40 leaves that split only, 39 none
    assert two_ops().solve(energy_cap_mj=40.0).bound_ms == pytest.approx(40.0, rel=1e-6)
    with pytest.raises(ValueError):
        two_ops().solve(energy_cap_mj=39.0)


def test_a_chain_of_two_steps_by_hand():
    """Op 1 then op 2, each step as long as its slower unit: op 1 at 10 x = 20 (1 - x), 20/3; op 2 at 30 x =
    15 (1 - x), 10: 50/3, above the busy bound's 40/3 (where a takes all of op 1 while b works on op 2). One step
    holding both ops is the busy bound; the energy cap binds a chain as it does the busy bound."""
    chain = two_ops(("1", "2")).solve(chain=True)
    assert chain.bound_ms == pytest.approx(50 / 3, rel=1e-6)
    assert chain.busy_ms == pytest.approx({"a": 20 / 3 + 10, "b": 20 / 3 + 10}, rel=1e-6)
    assert chain.duals["chain"] == pytest.approx(1.0)
    assert two_ops(("1", "1")).solve(chain=True).bound_ms == pytest.approx(40 / 3, rel=1e-6)
    # the least energy, every op on a (40 mJ): one split left, a busy 40, b idle
    assert two_ops(("1", "2")).solve(energy_cap_mj=40.0, chain=True).bound_ms == pytest.approx(40.0, rel=1e-6)


def test_a_prefix_pays_its_first_band():
    """A static prefix on a: 10 ms for the first band (its call), 2 for the second; the host's suffix on b 10 per
    band. Splitting once (a 10, b 10) or a mixture of none and all (a 12 t, b 20 (1 - t), t = 5/8): 7.5; a's
    second band alone (2 ms, without the first's call) is not a split any plan makes."""
    prog = SplitProgram()
    prog.op([Role("a", (0.0, 10.0, 12.0)), Role("b", (20.0, 10.0, 0.0), suffix=True)])
    got = prog.solve()
    assert got.bound_ms == pytest.approx(7.5, rel=1e-6)
    assert got.x[:2] == pytest.approx([0.625, 0.625], rel=1e-6)




def test_never_above_a_priced_schedule_on_the_published_profile():
    """Every candidate the report prices at each chunk size (as the search left it: whole chunks and halves, one and
    two in flight) ends no earlier than the bound without a cap; the bound's busiest unit is busy the whole bound
    (the capped bound against the report's plans: tests/test_objective.py)."""
    cost = load_profile("apple-m2-ultra-published").cost_model
    out, scorer = search(cost, "ane")
    free = priced_bounds(out, scorer, SHAPE, PROMPT, 1.0, None, 1.0)
    assert set(free["by_chunk"]) == {"512", "1024"}
    assert free["best"]["bound_ms"] == min(r["bound_ms"] for r in free["by_chunk"].values())
    cache: dict = {}  # shared with the report's starts (`bound_seed.LpSeeds`): each bound solved once
    assert priced_bounds(out, scorer, SHAPE, PROMPT, 1.0, None, 1.0, cache) == free
    assert len(cache) == 2 * 2 + 2  # each chunk size whole and halved, the best one's again without drops
    assert solved_bound(out, scorer, SHAPE, PROMPT, 512, None, cache=cache) is cache[(512, False, True, None)]
    exact = free["best_without_drops"]  # every row computed: no less
    assert exact["chunk_tokens"] == free["best"]["chunk_tokens"] and exact["bound_ms"] >= free["best"]["bound_ms"]
    cands = overlap_candidates(out, scorer, SHAPE, PROMPT, within=10.0)
    assert {c.chunk for c in cands} == {512, 1024}
    for cand in cands:
        bound = free["by_chunk"][str(cand.chunk)]["bound_ms"]
        for in_flight, halves in ((1, False), (2, False), (2, True)):
            pred, _ = predict_scheduled(cost, SHAPE, PROMPT, cand.chunk, cand.experts, cand.placement, in_flight,
                                        cand.lazy_last, halves)
            assert bound <= pred.latency_ms * (1 + 1e-6)
    for row in free["by_chunk"].values():
        assert set(row["units"]) == {"ane", "cpu", "mlx-exact"} and row["shapes_ms"][row["shape"]] == row["bound_ms"]
        busiest = max(u["busy_ms"] for u in row["units"].values())
        assert busiest == pytest.approx(row["bound_ms"], rel=1e-6)
        for unit in row["units"].values():
            assert sum(unit["by_op"].values()) == pytest.approx(unit["busy_ms"], abs=1e-2)
        assert set(row["units"]["ane"]["by_op"]) <= {"qkv", "o_proj", "attention", "experts", "expert_calls"}


def test_one_chunks_chain_bound_is_below_its_schedules_and_above_the_busy_bound():
    """The prompt as one chunk (2,048 tokens), published profile: every candidate the report prices there, one or
    two in flight (whole chunks: its chain), ends no earlier than the chain bound, which is at least the busy bound
    (the same ops, each step as long as its busiest unit); no chain bound for a chunk smaller than the prompt."""
    cost = load_profile("apple-m2-ultra-published").cost_model
    out, scorer = search(cost, "ane", (1024, PROMPT))
    bounds = priced_bounds(out, scorer, SHAPE, PROMPT, 1.0, None, 1.0)
    one, half = bounds["by_chunk"][str(PROMPT)], bounds["by_chunk"]["1024"]
    assert "chain" not in half and one["chain"]["bound_ms"] >= one["shapes_ms"]["chunks"] * (1 - 1e-6)
    assert one["chain"]["bound_ms"] > 1.01 * one["shapes_ms"]["chunks"]  # the chain costs here
    with pytest.raises(ValueError):
        solved_bound(out, scorer, SHAPE, PROMPT, 1024, None, chain=True)
    cands = [c for c in overlap_candidates(out, scorer, SHAPE, PROMPT, within=10.0) if c.chunk == PROMPT]
    assert cands
    for cand in cands:
        for in_flight in (1, 2):
            pred, _ = predict_scheduled(cost, SHAPE, PROMPT, PROMPT, cand.experts, cand.placement, in_flight,
                                        cand.lazy_last)
            assert one["chain"]["bound_ms"] <= pred.latency_ms * (1 + 1e-6)


def test_never_above_the_chain_on_a_cpu_host_with_a_dense_mlp():
    """The CPU the host (cpu-exact, not lazy; cpu-static on the same unit), two dense layers with an MLP: the
    search's plan as a chain, and each candidate one and two in flight, end no earlier than the bound."""
    cost = CostModel({"cpu-exact": BackendModel("cpu-exact", 0.0, 0.01, 0.4, 0.002, 2, False, 60.0),
                      "cpu-static": BackendModel("cpu-static", 0.0, 0.0, 0.4, 0.002, 2, False, 60.0),
                      "ane": BackendModel("ane", 0.2, 0.0, 0.17, 0.018, 2, True, 1.6)})
    shape = dataclasses.replace(SHAPE, moe_layers=(1, 3), dense_ffn=512)
    out, scorer = search(cost, "ane", (512,), shape)
    setup = bound_setup(out, scorer, shape, PROMPT, 512)
    assert setup.host == "cpu-exact" and "mlp" in setup.functions and setup.paths == ("cpu-exact",)
    chain = WholePrefill(shape, PROMPT).price(out.best, out.layers, scorer, out.dense_choice).latency_ms
    bound = priced_bounds(out, scorer, shape, PROMPT, chain, None, None)["best"]
    assert set(bound["units"]) == {"ane", "cpu"} and 1.0 <= bound["vs_latency_at_most"]
    for cand in overlap_candidates(out, scorer, shape, PROMPT):
        for in_flight in (1, 2):
            pred, _ = predict_scheduled(cost, shape, PROMPT, 512, cand.experts, cand.placement, in_flight)
            assert bound["bound_ms"] <= pred.latency_ms * (1 + 1e-6)
