"""The experts picked again with the energy cap and the ANE's window priced in (autotune/searching/priced_picks.py):
the pick against every combination by hand on small cases, and on a small searched shape with the published M2
Ultra profile (predicted)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import BOUND_PROMPT as PROMPT
from helpers import BOUND_SHAPE as SHAPE
from helpers import bound_search as search

from autotune.profiling.profile import load_profile
from autotune.searching.bound_seed import LpSeeds
from autotune.searching.optimizer import solution
from autotune.searching.overlap_choice import best_by_chunk
from autotune.searching.prefill_report import overlap_candidates
from autotune.searching.priced_picks import Option, layer_options, priced_pick, priced_picks, window_priced
from autotune.searching.space import LayerConfig

CHUNK = 1024


def random_options(rng: np.random.Generator, layers: int = 3, per_layer: int = 4) -> list[list[Option]]:
    """Layers of options with random latency, energy, drops and resident bytes (distinct configs)."""
    return [[Option(LayerConfig(resident=r), float(rng.uniform(1, 10)), float(rng.uniform(100, 1000)),
                    int(rng.integers(0, 6)), float(rng.integers(0, 5)) * 1e6)
             for r in range(per_layer)] for _ in range(layers)]


def by_hand(options, budget, energy_price, byte_price, window=np.inf):
    """Of every combination within the drop budget and the window, the least latency + prices x energy and bytes."""
    best = None
    for combo in itertools.product(*options):
        if sum(o.drops for o in combo) > budget or sum(o.resident_bytes for o in combo) > window:
            continue
        cost = sum(o.latency_ms + energy_price * o.energy_mj + byte_price * o.resident_bytes for o in combo)
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_pick_is_the_least_priced_combination_within_the_drop_budget(seed):
    """Three layers of four options: the pick's latency plus its energy and bytes at their prices is the least over
    all 64 combinations within the drop budget (to rounding), at no price, an energy price and a byte price; with a
    budget no combination meets, none."""
    rng = np.random.default_rng(seed)
    options = random_options(rng)
    budget = int(rng.integers(2, 10))
    for energy_price, byte_price in ((0.0, 0.0), (0.01, 0.0), (0.005, 2e-6)):
        pick = priced_pick(options, budget, energy_price, byte_price)
        assert sum(o.drops for o in pick) <= budget
        got = sum(o.latency_ms + energy_price * o.energy_mj + byte_price * o.resident_bytes for o in pick)
        assert got == pytest.approx(by_hand(options, budget, energy_price, byte_price), rel=1e-12)
    least = sum(min(o.drops for o in opts) for opts in options)
    assert priced_pick(options, least, 0.0, 0.0) is not None
    if least > 0:
        assert priced_pick(options, least - 1, 0.0, 0.0) is None


@pytest.mark.parametrize("seed", range(12))
def test_the_window_pick_fits_and_is_no_larger_for_a_smaller_window(seed):
    """The pick fitted to a window fits it; a window its unpriced pick fits returns that pick; a smaller window never
    a pick with more bytes; a window below the fewest bytes any combination within the budget holds, none. Its cost
    at the energy price is at least the least by hand within the window (a Lagrange pick is one of them)."""
    rng = np.random.default_rng(100 + seed)
    options = random_options(rng)
    budget, price = int(rng.integers(4, 12)), 0.004
    free = priced_pick(options, budget, price, 0.0)
    free_bytes = sum(o.resident_bytes for o in free)
    assert window_priced(options, budget, price, free_bytes) == free
    fewest = min(sum(o.resident_bytes for o in c) for c in itertools.product(*options)
                 if sum(o.drops for o in c) <= budget)
    last = np.inf
    for window in sorted({fewest, (fewest + free_bytes) / 2, free_bytes}, reverse=True):
        pick = window_priced(options, budget, price, window)
        held = sum(o.resident_bytes for o in pick)
        assert held <= window and held <= last and sum(o.drops for o in pick) <= budget
        cost = sum(o.latency_ms + price * o.energy_mj for o in pick)
        assert cost >= by_hand(options, budget, price, 0.0, window) - 1e-9
        last = held
    if fewest > 0:
        assert window_priced(options, budget, price, fewest - 1) is None


@pytest.fixture(scope="module")
def searched():
    cost = load_profile("apple-m2-ultra-published").cost_model
    out, scorer = search(cost, "ane", chunks=(CHUNK,))
    return cost, out, scorer


def test_options_priced_as_the_plan_and_energy_falls_with_its_price(searched):
    """On a searched shape: each layer's options hold the search's own decision; a pick's latency, energy and drops
    summed over its layers are the plan's (`solution`, to rounding); as the energy price rises the pick's energy
    does not (a Lagrange pick's), and at a high price it is below the unpriced pick's, whose latency is the least."""
    _, out, scorer = searched
    found = out.chunks[CHUNK]
    own = found.best
    options = layer_options(found, out.space, scorer, own)
    assert [own.configs[i] in [o.config for o in opts] for i, opts in enumerate(options)] == [True] * len(options)
    energies, latencies = [], []
    for price in (0.0, 0.001, 0.01, 0.1, 1.0):
        pick = priced_pick(options, out.drop_budget, price, 0.0)
        sol = solution([o.config for o in pick], found.layers, scorer)
        assert sol.latency_ms == pytest.approx(sum(o.latency_ms for o in pick), rel=1e-9)
        assert sol.energy_mj == pytest.approx(sum(o.energy_mj for o in pick), rel=1e-9)
        assert sol.heldout_drops == sum(o.drops for o in pick) <= out.drop_budget
        energies.append(sol.energy_mj)
        latencies.append(sol.latency_ms)
    assert all(b <= a * (1 + 1e-12) for a, b in zip(energies, energies[1:]))
    assert energies[-1] < energies[0] and latencies[0] == min(latencies)


def test_picks_reach_the_schedule(searched):
    """On a searched shape whose plan runs CPU tails (every expert exact here, no drops allowed): the unpriced pick no
    slower than the search's own plan (whose decisions it weighs), at a high energy price the plan without tails, each
    within the drop budget; the seeds of the schedule's choice offer the latter (`LpSeeds.picked`: a candidate of
    those experts, at an energy price from the LP's dual on the cap)."""
    _, out, scorer = searched
    found = out.chunks[CHUNK]
    own = found.best
    assert any(c.cpu_tail for c in own.configs)
    fast, frugal = priced_picks(found, out.space, scorer, out.drop_budget, own, (0.0, 1.0), (0.0,))
    assert fast.latency_ms <= own.latency_ms * (1 + 1e-12)
    assert [c.cpu_tail for c in frugal.configs] == [0] * len(own.configs)
    assert frugal.energy_mj < min(own.energy_mj, fast.energy_mj)
    assert max(fast.heldout_drops, frugal.heldout_drops) <= out.drop_budget
    uncapped = LpSeeds(out, scorer, SHAPE, PROMPT).solved(CHUNK)[0].energy_mj
    seeds = LpSeeds(out, scorer, SHAPE, PROMPT, energy_cap_mj=0.97 * uncapped)  # the cap binds the LP
    mine = [c for c in overlap_candidates(out, scorer, SHAPE, PROMPT, within=10.0) if c.chunk == CHUNK]
    solved, _ = seeds.solved(CHUNK)
    assert solved.duals["energy_cap"] > 0
    assert any(c.solution.configs == frugal.configs for c in seeds.picked(CHUNK, mine, solved))


class Recorder:
    """Seeds that add no choice and record which chunk sizes the picks were asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def __call__(self, chunk, mine):
        return []

    def picks(self, chunk, mine, best):
        self.asked.append(chunk)
        return []


def test_picks_only_where_the_choice_is_near_the_best():
    """Two chunk sizes: the picks are asked for the one whose choice ends first, and for the other only where the
    margin `near` takes its latency in (the picks are the costly seeds: each a search of the experts and two
    descents of the dense half)."""
    cost = load_profile("apple-m2-ultra-published").cost_model
    out, scorer = search(cost, "ane")
    cands = overlap_candidates(out, scorer, SHAPE, PROMPT, within=10.0)
    plain = best_by_chunk(scorer, SHAPE, PROMPT, cands, 2)
    equal = {k: o.prediction.latency_ms for k, o in plain.items() if not k[1]}
    assert set(equal) == {(512, ()), (1024, ())}
    fast, slow = sorted(equal, key=equal.get)
    gap = equal[slow] / equal[fast] - 1
    assert gap > 0
    for near, want in ((gap / 2, [fast[0]]), (gap * 2, sorted([fast[0], slow[0]]))):
        seeds = Recorder()
        got = best_by_chunk(scorer, SHAPE, PROMPT, cands, 2, seeds=seeds, near=near)
        assert sorted(seeds.asked) == want
        assert {k: o.prediction.latency_ms for k, o in got.items()} == {k: o.prediction.latency_ms
                                                                       for k, o in plain.items()}
