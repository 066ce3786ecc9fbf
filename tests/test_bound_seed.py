"""The schedule's starts beside the search's plans (autotune/searching/bound_seed.py), on a small shape and the
published M2 Ultra profile (predicted)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_priced_bound import PROMPT, SHAPE, search

from autotune.costing.schedule import predict_scheduled
from autotune.profiling.profile import load_profile
from autotune.searching.bound_seed import tail_free
from autotune.searching.optimizer import solution
from autotune.searching.overlap_choice import choose_overlapped, cpu_backends
from autotune.searching.prefill_report import overlap_candidate, overlap_candidates

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
