"""The per-layer decision space: tier capacities from load quantiles, the plan a decision means, hard limits, the
enumerated space, the paper heuristic, and scoring against held-out traces."""
import itertools

import numpy as np
import optuna
import pytest
from helpers import apple_like

from autotune.searching.space import (
    MAX_TIERS,
    LayerConfig,
    LayerData,
    Scorer,
    config_from_params,
    distributions,
    enumerate_configs,
    heuristic_config,
    layer_plan,
    neighbours,
    params_of,
    space_size,
    suggest,
    tiers,
    values,
    violation,
)
from runtime.coreml.ane_limits import FUNCTION_WEIGHT_BYTES, MAX_AXIS
from runtime.plan import Group, LayerPlan

# 3 calibration chunks x 4 experts: popularity 0 (12) > 2 (6) > 3 (3) > 1 (1)
CALIB = np.array([[4, 0, 2, 1], [6, 1, 0, 1], [2, 0, 4, 1]])
HELDOUT = np.array([[9, 0, 1, 2], [3, 2, 7, 0]])


@pytest.fixture
def data():
    return LayerData(5, CALIB, HELDOUT)


def test_rank_and_band_capacity_are_popularity_and_load_quantiles(data):
    assert data.rank.tolist() == [0, 2, 3, 1]
    assert data.band_capacity(0, 1, 1.0) == 6  # expert 0's busiest chunk
    assert data.band_capacity(0, 2, 0.5) == 3  # median of experts 0 and 2 over all chunks: [4,6,2,2,0,4] -> 3
    assert data.band_capacity(3, 4, 0.5) == 1  # never below 1


def test_tiers_split_residents_into_popularity_bands(data):
    assert tiers(data, LayerConfig(4, tiers=2, quantiles=(1.0, 1.0))) == ([6, 6, 1, 1], [0, 0, 1, 1])
    assert tiers(data, LayerConfig(3, capacity=5)) == ([5, 5, 5], [0, 0, 0])
    # more tiers than residents: one tier per resident
    assert tiers(data, LayerConfig(1, tiers=3, quantiles=(1.0, 1.0, 1.0))) == ([6], [0])


def test_layer_plan_groups_residents_in_rank_order_and_leaves_the_rest_exact(data):
    lp = layer_plan(data, LayerConfig(3, group_size=2, tiers=1, quantiles=(1.0,)), "cpu-static")
    assert lp.layer == 5 and lp.cpu_exact == [1]
    assert [(g.backend, g.experts, g.capacities, g.tier) for g in lp.groups] == [
        ("cpu-static", [0, 2], [6, 6], [0, 0]), ("cpu-static", [3], [6], [0])]
    empty = layer_plan(data, LayerConfig(0), "ane")
    assert empty.groups == [] and empty.cpu_exact == [0, 1, 2, 3]


def test_violation_measures_how_far_past_the_ane_axis_and_the_resident_budget():
    within = LayerPlan(layer=0, groups=[Group(backend="ane", experts=[0, 1], capacities=[8, 8])], cpu_exact=[])
    assert violation(within, "ane", expert_bytes=10, resident_bytes_budget=100) == 0.0
    over_axis = LayerPlan(layer=0, groups=[Group(backend="ane", experts=[0, 1], capacities=[MAX_AXIS, 100])],
                          cpu_exact=[])
    assert violation(over_axis, "ane", 10, 100) == pytest.approx(100 / MAX_AXIS)
    assert violation(over_axis, "cpu-static", 10, 100) == 0.0  # the axis limit is the ANE's only
    assert violation(within, "ane", expert_bytes=75, resident_bytes_budget=100) == pytest.approx(0.5)


def test_a_group_past_the_function_weight_limit_is_a_hard_violation():
    """The search scores a group against the builder's limits (ane_limits, the ane backend's `limits` in the
    registry): weight bytes per function too."""
    def group(n: int) -> LayerPlan:
        return LayerPlan(layer=0, groups=[Group(backend="ane", experts=list(range(n)), capacities=[8] * n)],
                         cpu_exact=[])

    hidden, ffn = 4096, 8192  # 201 MB of fp16 weights per expert: 8 of them pass the 1.5 GB per function
    weight = 8 * 3 * hidden * ffn * 2
    assert weight > FUNCTION_WEIGHT_BYTES > weight / 2
    assert violation(group(4), "ane", 10, 1e9, hidden=hidden, ffn=ffn) == 0.0
    assert violation(group(8), "ane", 10, 1e9, hidden=hidden, ffn=ffn) == pytest.approx(
        (weight - FUNCTION_WEIGHT_BYTES) / FUNCTION_WEIGHT_BYTES)
    assert violation(group(8), "cpu-static", 10, 1e9, hidden=hidden, ffn=ffn) == 0.0


def test_enumerated_space_is_complete_without_duplicates():
    configs = enumerate_configs(2)
    # r=0: 1; r=1: group 1 only, 6 quantiles x 2 overflows; r=2: groups 1 and 2, (6 + 36) quantile tuples x 2
    assert len(configs) == 1 + 12 + 2 * (6 + 36) * 2 == space_size(2)
    assert len(set(configs)) == len(configs)
    assert max(c.tiers for c in enumerate_configs(8)) == MAX_TIERS
    assert space_size(64) > 10 ** 8  # past enumeration


def test_paper_heuristic_keeps_hot_experts_in_groups_of_four(data):
    # cumulative shares 12/22, 18/22, ...: two experts cover 80 %, rounded up to a group of four
    assert heuristic_config(data) == LayerConfig(4, 4, 3, (0.9, 0.9, 0.9), "drop")


def test_scorer_counts_heldout_drops_and_caches(data):
    scorer = Scorer(apple_like(), hidden=64, ffn=32, backend="cpu-static", resident_bytes_per_layer=1e12)
    drop = LayerConfig(4, group_size=4, tiers=1, quantiles=(0.5,), overflow="drop")
    cap = data.band_capacity(0, 4, 0.5)
    s = scorer.score(data, drop)
    assert s.heldout_drops == int(np.maximum(HELDOUT - cap, 0).sum()) > 0
    assert s.latency_ms > 0 and s.violation == 0.0 and s.energy_mj is None
    assert scorer.score(data, drop) is s
    assert scorer.score(data, LayerConfig(4, 4, 1, (0.5,), "spill")).heldout_drops == 0
    assert scorer.energy(data, drop) > 0  # apple_like has power figures for every backend


def test_enumeration_is_the_distinct_decisions_of_the_declared_space():
    space = {name: values(d) for name, d in distributions(4).items()}
    every = {config_from_params(dict(zip(space, point)), 4) for point in itertools.product(*space.values())}
    every.discard(LayerConfig(0, overflow="spill"))  # no residents: one decision whatever the overflow
    assert set(enumerate_configs(4)) == every


def test_params_round_trip_and_neighbours_step_along_each_parameter():
    for cfg in enumerate_configs(4)[::37]:
        assert config_from_params(params_of(cfg), 4) == cfg
    p = params_of(LayerConfig(2, 2, 1, (0.9,), "drop"))
    steps = {(k, q[k]) for q in neighbours(p, 4) for k in q if q[k] != p[k]}
    assert steps == {("resident", 1), ("resident", 3), ("group_size", 1), ("group_size", 4), ("tiers", 2),
                     ("q0", 0.75), ("q0", 0.95), ("q1", 0.99), ("q2", 0.99), ("overflow", "spill")}
    assert len(p) == len(distributions(4)) == 3 + MAX_TIERS + 1


def test_trials_suggest_from_the_declared_space():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(lambda t: float(len(suggest(t, 8))), n_trials=5)
    assert all(t.distributions == distributions(8) for t in study.trials)
