"""The schedule's starts beside the search's plans (autotune/searching/bound_seed.py), on a small shape and the
published M2 Ultra profile (predicted)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import BOUND_PROMPT as PROMPT
from helpers import BOUND_SHAPE as SHAPE
from helpers import bound_search as search

from autotune.costing.schedule import predict_scheduled
from autotune.costing.split_program import Role, Solved, SplitProgram
from autotune.profiling.profile import load_profile
from autotune.searching.bound_seed import LpSeeds, energy_fit, lp_placements, lp_rows, tail_free, window_fit
from autotune.searching.objective import prompts_in
from autotune.searching.optimizer import solution
from autotune.searching.overlap_choice import best_by_chunk, choose_overlapped, cpu_backends, overlap_candidate
from autotune.searching.prefill_report import (
    mlx_gpu_prefill,
    overlap_candidates,
    pick_candidates,
)
from runtime.coreml import ane_limits

CHUNK = 1024


@pytest.fixture(scope="module")
def searched():
    cost = load_profile("apple-m2-ultra-published").cost_model
    out, scorer = search(cost, "ane", chunks=(CHUNK,))
    return cost, out, scorer


def tailed_plan(out, scorer):
    """Each layer's fastest decision in the search's pool with experts on the ANE and a CPU tail."""
    found, space = out.chunks[CHUNK], out.space
    configs = []
    for pool in found.pool:
        ok = (space.column(pool.rows, "resident") > 0) & (space.column(pool.rows, "cpu_tail") > 0)
        configs.append(space.config(pool.rows[ok][np.argmin(pool.scores.latency_ms[ok])]))
    return solution(configs, found.layers, scorer, found.best.exact_partial)


def test_a_cpu_tail_past_the_cap_is_offered_without_it(searched):
    """phi-3.5-moe at one chunk of 4,096 put nothing on the ANE: every plan there within the window carried CPU tails
    whose energy took it past the cap (the GPU alone's), and no dense placement brought it back under. Here: a cap
    between the plan's energy with and without its tail; its tail-free copy fits as it stands, its experts still on
    the ANE and its drops the same, and the report's candidates offer it (they did not: the cause)."""
    cost, out, scorer = searched
    found = out.chunks[CHUNK]
    tailed = tailed_plan(out, scorer)
    free = tail_free([tailed], found.layers, scorer)
    assert len(free) == 1 and tail_free(free, found.layers, scorer) == []
    free = free[0]
    assert [c.cpu_tail for c in free.configs] == [0] * len(free.configs)
    assert [dataclasses.replace(c, cpu_tail=0) for c in tailed.configs] == free.configs
    assert free.heldout_drops == tailed.heldout_drops  # a tail's experts are computed either way
    cands = [overlap_candidate(s, found.layers, scorer, SHAPE, PROMPT, out.dense.get(CHUNK)) for s in (tailed, free)]
    energy = [predict_scheduled(cost, SHAPE, PROMPT, CHUNK, c.experts, c.placement, 2, c.lazy_last)[0].energy_mj
              for c in cands]
    assert energy[1] < energy[0]  # the tail's CPU work costs energy the exact path does not
    cap = energy[1] * (1 + 1e-9)
    backends = (scorer.backend, *cpu_backends(cost, scorer.backend))
    got = choose_overlapped(cost, backends, SHAPE, PROMPT, cands[1], 2, cap)
    assert got.within_cap and got.prediction.energy_mj <= cap
    assert got.schedule.to_json()["units"]["ane"]["busy_ms"] > 0
    found.best = tailed  # the search's own plan the tailed one: the report's candidates hold it without its tail
    offered = overlap_candidates(out, scorer, SHAPE, PROMPT, within=10.0)
    assert any(c.experts == cands[1].experts for c in offered)


def test_a_plan_past_the_cap_keeps_the_tails_that_fit(searched, monkeypatch):
    """A plan whose CPU tails take it past the cap (here half way between its energy with and without them): offered
    with its tails halved until it fits, within the cap and above the tail-free plan's energy (tails kept where they
    fit), only tails changed, none longer, each a value of the space, its drops the same; one within the cap is not
    offered again, and without a cap none is; the report's candidates and the pick's offer it."""
    _, out, scorer = searched
    found = out.chunks[CHUNK]
    tailed = tailed_plan(out, scorer)
    free = tail_free([tailed], found.layers, scorer)[0]

    def energy(sol):
        return out.whole.price(sol, found.layers, scorer, out.dense.get(CHUNK)).energy_mj

    prompts = prompts_in(found.layers, PROMPT)
    cap = (energy(tailed) + energy(free)) / 2
    fit = energy_fit([tailed], found.layers, scorer, energy, prompts, cap)
    assert len(fit) == 1
    assert energy(free) < energy(fit[0]) <= cap < energy(tailed)
    tails = out.space.dim("cpu_tail").values
    assert all(a.cpu_tail <= b.cpu_tail and a.cpu_tail in tails for a, b in zip(fit[0].configs, tailed.configs))
    assert [dataclasses.replace(c, cpu_tail=0) for c in fit[0].configs] == free.configs
    assert 0 < sum(c.cpu_tail for c in fit[0].configs) < sum(c.cpu_tail for c in tailed.configs)
    assert fit[0].heldout_drops == tailed.heldout_drops
    assert energy_fit(fit, found.layers, scorer, energy, prompts, cap) == []
    assert energy_fit([tailed], found.layers, scorer, energy, prompts, None) == []
    monkeypatch.setattr(found, "best", tailed)
    monkeypatch.setattr(out, "best", tailed)
    want = overlap_candidate(fit[0], found.layers, scorer, SHAPE, PROMPT, out.dense.get(CHUNK)).experts
    assert any(c.experts == want for c in overlap_candidates(out, scorer, SHAPE, PROMPT, 10.0, cap))
    assert [c.experts for c in pick_candidates(out, scorer, SHAPE, PROMPT, cap)][-1] == want


def test_the_lp_split_read_back_and_rounded_to_the_grid():
    """Two q/k/v ops of 1,024 rows in bands of 64 (the second counted twice): the ANE takes the first 5.5 bands of
    one (352 rows), 3 of the other (192); by count, (352 + 2 x 192) / 3 = 245.33 rows, rounded to the grid of 64:
    256 nearest, 192 down, 256 up. The CPU's static prefix of o_proj: 1,024 rows, all of it."""
    cost = load_profile("apple-m2-ultra-published").cost_model
    prog = SplitProgram()
    bands = 16
    for count in (1, 2):
        prog.op([Role("ane", tuple(range(bands + 1))), Role("mlx-exact", tuple(range(bands, -1, -1)), suffix=True)],
                count, tag="qkv")
    prog.op([Role("cpu", (0.0, 1.0)), Role("mlx-exact", (1.0, 0.0), suffix=True)], tag="o_proj")
    x = np.zeros(len(prog.cols))
    (_, _, first), (_, _, second), (_, _, third) = prog.ops
    x[first[0][1][:5]], x[first[0][1][5]], x[first[1][1][5:]] = 1.0, 0.5, 1.0
    x[second[0][1][:3]], x[second[1][1][3:]] = 1.0, 1.0
    x[third[0][1]] = 1.0
    solved = Solved(1.0, {}, 0.0, x, {}, {}, prog.ops)
    rows = lp_rows(solved, cost, ("ane", "cpu-static"), 1024, 64)
    assert rows == {"qkv": {"ane": pytest.approx((352 + 2 * 192) / 3)}, "o_proj": {"cpu-static": 1024.0}}
    starts = lp_placements(rows, "mlx-exact", 1024, 4096)
    assert [p.static_rows("qkv", 1024) for p in starts] == [256, 192]  # nearest and up agree: one start
    assert all(p.qkv == "ane" and p.o_proj == "cpu-static" and p.static_rows("o_proj", 1024) == 1024 for p in starts)


def test_seeded_starts_never_end_later(searched):
    """The schedule's choice per chunk size with the LP's starts (`LpSeeds`) against without, at the GPU alone's
    energy: each seeded choice within the cap, none ending later than the unseeded one, and the seeds priced at
    every chunk size."""
    cost, out, scorer = searched
    found = out.chunks[CHUNK]
    cap = mlx_gpu_prefill(scorer, SHAPE, found.layers, PROMPT).energy_mj * 1.5
    cands = overlap_candidates(out, scorer, SHAPE, PROMPT, within=10.0)
    seeds = LpSeeds(out, scorer, SHAPE, PROMPT, cap)
    plain = best_by_chunk(scorer, SHAPE, PROMPT, cands, 2, cap)
    seeded = best_by_chunk(scorer, SHAPE, PROMPT, cands, 2, cap, seeds=seeds)
    extra = seeds(CHUNK, [c for c in cands if c.chunk == CHUNK])
    assert extra and all(o.prediction.chunk_tokens == CHUNK for o in extra)
    for chunk, o in plain.items():
        assert seeded[chunk].within_cap or not o.within_cap
        assert seeded[chunk].prediction.latency_ms <= o.prediction.latency_ms + 1e-9


def test_a_plan_past_the_window_is_offered_trimmed_to_fit(searched, monkeypatch):
    """A plan whose residents overflow the ANE's window (here a window one and a half experts short of them): offered
    with two residents fewer, within the window, no layer with more than before, dropping no more; one that fits
    is not offered again. Asked to leave room beside them (a window three and a half experts short), four fewer."""
    cost, out, scorer = searched
    found, space = out.chunks[CHUNK], out.space
    configs = []
    for pool in found.pool:
        ok = space.column(pool.rows, "resident") >= 2
        best = space.config(pool.rows[ok][np.argmin(pool.scores.latency_ms[ok])])
        configs.append(dataclasses.replace(best, compress="none"))  # one size of expert: the count taken off exact
    plan = solution(configs, found.layers, scorer, found.best.exact_partial)
    one = ane_limits.expert_weight_bytes(scorer.hidden, scorer.ffn, configs[0].compress)
    stored = sum(c.resident for c in configs) * one
    monkeypatch.setattr(ane_limits, "WINDOW_BYTES", stored - 1.5 * one)
    fit = window_fit([plan], found.layers, scorer, out.drop_budget)
    assert len(fit) == 1 and window_fit(fit, found.layers, scorer, out.drop_budget) == []
    assert sum(c.resident for c in fit[0].configs) == sum(c.resident for c in configs) - 2
    assert all(a.resident <= b.resident for a, b in zip(fit[0].configs, configs))
    assert fit[0].heldout_drops <= plan.heldout_drops
    beside = window_fit([plan], found.layers, scorer, out.drop_budget, stored - 3.5 * one)  # room left for more
    assert sum(c.resident for c in beside[0].configs) == sum(c.resident for c in configs) - 4
