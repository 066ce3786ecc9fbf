"""autotune/searching/regret_floor.py: the two-case bound on a plan's worst-case regret is never above the true
least worst case (brute force over every combination within the drop budget), and is exact without drops."""
import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.searching.regret_floor import least_worst, pareto


def _brute(steps, drops, budget):
    best = np.inf
    for pick in itertools.product(*(range(len(s)) for s in steps)):
        if sum(d[i] for d, i in zip(drops, pick)) <= budget:
            best = min(best, max(sum(s[i, 0] for s, i in zip(steps, pick)), sum(s[i, 1] for s, i in zip(steps, pick))))
    return best


def test_pareto_keeps_the_undominated():
    pts = np.array([[1, 5], [2, 2], [3, 3], [2, 4], [5, 1], [1, 6]], dtype=float)
    assert sorted(map(tuple, pareto(pts))) == [(1, 5), (2, 2), (5, 1)]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4), st.integers(1, 5))
def test_the_bound_never_passes_the_least_worst_case(seed, layers, options):
    rng = np.random.default_rng(seed)
    steps = [rng.uniform(0.0, 1.0, (options, 2)) for _ in range(layers)]
    drops = [rng.integers(0, 4, options).astype(float) for _ in range(layers)]
    budget = float(rng.integers(0, 3 * layers))
    brute = _brute(steps, drops, budget)
    assert least_worst(steps, drops, budget) <= brute + 1e-12
    assert least_worst(steps, drops, budget, cap=0.5 * layers) <= brute + 1e-12  # cut past the cap: still a bound
    free = [np.zeros(options) for _ in range(layers)]  # no drops: the Pareto DP is exact
    assert abs(least_worst(steps, free, 0.0) - _brute(steps, free, 0.0)) < 1e-12
