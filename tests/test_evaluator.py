"""The one evaluator (autotune/costing/evaluator.py): its summed form equals its per-chunk form, its sum of max()
equals the brute force, and a plan priced by the cost model is the evaluator's one row."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import apple_like
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.costing import evaluator
from runtime.plan import Group, LayerPlan


def _work(rng: np.random.Generator, rows: int, tables: int, chunks: int, overlaps: bool) -> evaluator.LayerWork:
    static = rng.uniform(0, 3, rows)
    zero = np.zeros(rows)
    return evaluator.LayerWork(zero if overlaps else static, static if overlaps else zero,
                               rng.uniform(0, 4, (tables, chunks)), rng.uniform(0, 1, (tables, chunks)),
                               rng.integers(0, tables, rows), rng.integers(0, tables, rows), 2.0 * static, 20.0)


@pytest.mark.parametrize("overlaps", [True, False])
def test_totals_are_the_per_chunk_figures_summed(overlaps):
    rng = np.random.default_rng(0)
    work = _work(rng, 50, 7, 30, overlaps)
    mask = rng.random(30) < 0.6
    per, tot = evaluator.per_chunk(work), evaluator.totals(work, mask)
    for name in ("latency_ms", "cpu_ms", "energy_mj"):
        np.testing.assert_allclose(getattr(tot, name), getattr(per, name)[:, mask].sum(1), rtol=1e-12)
    if overlaps:  # the exact path hides under off-CPU calls, the CPU waits for them
        assert (tot.latency_ms <= tot.cpu_ms + mask.sum() * work.off_cpu + 1e-9).all()
        assert (tot.cpu_ms < tot.latency_ms + 1e-9).any()
    else:  # everything on the CPU: latency is CPU-busy time
        np.testing.assert_allclose(tot.latency_ms, tot.cpu_ms)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 10), min_size=1, max_size=12), st.lists(st.floats(0, 10), min_size=1, max_size=6))
def test_sum_max_is_the_brute_force(row, levels):
    table = np.array([row])
    got = evaluator.sum_max(np.array(levels), table, np.zeros(len(levels), dtype=np.int64))
    want = [sum(max(level, x) for x in row) for level in levels]
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def test_a_plan_is_one_row_of_the_evaluator():
    cost = apple_like()
    lp = LayerPlan(layer=0, groups=[Group(backend="ane", experts=[0, 1], capacities=[8, 4])], cpu_exact=[2, 3])
    counts = np.array([[9, 2, 5, 0], [3, 6, 0, 1]])
    work = cost.layer_work(lp, counts, 64, 32, "spill")
    group = cost.group_call_ms("ane", [8, 4], 64, 32)
    exact = cost.exact_ms(np.array([[1, 0, 5, 0], [0, 2, 0, 1]]), 64, 32)  # the overflow spills, cold run exactly
    np.testing.assert_allclose(cost.layer_ms(lp, counts, 64, 32, "spill"), np.maximum(group, exact))
    assert work.off_cpu[0] == pytest.approx(group) and work.on_cpu[0] == 0.0
    np.testing.assert_allclose(cost.layer_energy_mj(lp, counts, 64, 32, "spill"), 2.0 * group + 20.0 * exact)


def test_chain_adds_and_keeps_the_cpu_idle_off_it():
    steps = [evaluator.Link(2.0, on_cpu=False, power_w=1.5), evaluator.Link(3.0, power_w=10.0),
             evaluator.Link(1.0, cpu_ms=0.25, energy_mj=4.0)]
    t = evaluator.chain(steps)
    assert (t.latency_ms, t.cpu_ms, t.energy_mj) == (6.0, 3.25, 3.0 + 30.0 + 4.0)
    assert evaluator.chain([evaluator.Link(1.0)]).energy_mj is None  # a power unknown: no energy, never a guess
