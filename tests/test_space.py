"""The per-layer decision space: tier capacities from load quantiles, the plan a decision means, hard limits, the
enumerated space, the paper heuristic, and scoring against held-out traces."""
import itertools

import numpy as np
import optuna
import pytest
from helpers import SMALL, apple_like

from autotune.calibration.traces import synthetic_traces
from autotune.costing.costmodel import BackendModel
from autotune.searching import space as space_module
from autotune.searching.decisions import heuristic_config, layer_plan, tiers, violation
from autotune.searching.layer_data import LayerData
from autotune.searching.scoring import Scorer
from autotune.searching.space import MAX_TIERS, LayerConfig, layer_space
from runtime.coreml import ane_limits
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
    one = ane_limits.expert_weight_bytes(4, 4)  # 96 bytes of fp16 weights per expert
    within = LayerPlan(layer=0, groups=[Group(backend="ane", experts=[0, 1], capacities=[8, 8])], cpu_exact=[])
    assert violation(within, "ane", 4, 4, resident_bytes_budget=1000) == 0.0
    over_axis = LayerPlan(layer=0, groups=[Group(backend="ane", experts=[0, 1], capacities=[MAX_AXIS, 100])],
                          cpu_exact=[])
    assert violation(over_axis, "ane", 4, 4, 1000) == pytest.approx(100 / MAX_AXIS)
    assert violation(over_axis, "cpu-static", 4, 4, 1000) == 0.0  # the axis limit is the ANE's only
    assert violation(within, "ane", 4, 4, resident_bytes_budget=one * 4 / 3) == pytest.approx(0.5)
    # the resident budget counts stored bytes: palettized to 4 bits, a quarter of fp16
    small = LayerPlan(layer=0, groups=[Group(backend="ane", experts=[0, 1], capacities=[8, 8],
                                             compress="palettize4")], cpu_exact=[])
    assert violation(small, "ane", 4, 4, resident_bytes_budget=one / 2) == 0.0


def test_a_group_past_the_function_weight_limit_is_a_hard_violation_counting_compressed_bytes():
    """The search scores a group against the builder's limits (ane_limits, the ane backend's `limits` in the
    registry): stored weight bytes per function too, so int8 weights fit where fp16 ones do not."""
    def group(n: int, compress: str | None = None) -> LayerPlan:
        return LayerPlan(layer=0, groups=[Group(backend="ane", experts=list(range(n)), capacities=[8] * n,
                                                compress=compress)], cpu_exact=[])

    hidden, ffn = 4096, 8192  # 201 MB of fp16 weights per expert: 8 of them pass the 1.5 GB per function
    weight = 8 * 3 * hidden * ffn * 2
    assert weight > FUNCTION_WEIGHT_BYTES > weight / 2
    assert violation(group(4), "ane", hidden, ffn, 1e12) == 0.0
    assert violation(group(8), "ane", hidden, ffn, 1e12) == pytest.approx(
        (weight - FUNCTION_WEIGHT_BYTES) / FUNCTION_WEIGHT_BYTES)
    assert violation(group(8, "int8"), "ane", hidden, ffn, 1e12) == 0.0
    assert violation(group(8), "cpu-static", hidden, ffn, 1e12) == 0.0


def test_enumerated_space_is_complete_without_duplicates():
    space = layer_space(2)
    # r=0: 1; r=1: group 1 only, 8 quantiles x 2 overflows; r=2: groups 1 and 2 x 2 overflows x (one tier: 8
    # quantiles x 2 sizings; two tiers of one expert each: 64 quantile pairs)
    assert len(space.enumerate()) == 1 + 16 + 2 * 2 * (8 * 2 + 64) == space.size()
    assert len(layer_space(2, ("none", "int8")).enumerate()) == 1 + 2 * (16 + 2 * 2 * (8 * 2 + 64))
    configs = [space.config(r) for r in space.enumerate()]
    assert len(set(configs)) == len(configs)
    assert max(layer_space(8).config(r).tiers for r in layer_space(8).enumerate()) == MAX_TIERS
    assert layer_space(16).size() == 142_097  # Phi-3.5-MoE: enumerated (x3 with every compression)
    split = layer_space(8, split_exact=True)  # the largest layer the exact yardstick enumerates: 5.5M points
    assert split.size() == 326_421 < split.product_size
    assert layer_space(128).size() == layer_space(128).product_size > 10 ** 6  # past enumeration: not counted


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


def test_compressed_weights_stream_fewer_bytes_on_the_ane():
    """The weight term of a static call (ms_per_mb) shrinks with the stored bytes: int8 half of fp16's, 4-bit
    palettes a quarter; the profile has no decompression cost, so nothing is added for it."""
    cost = apple_like()
    cost.models["ane"].ms_per_mb = 0.02
    fp16, int8, pal = (cost.group_call_ms("ane", [16, 16], 1024, 512, k) for k in ("none", "int8", "palettize4"))
    weights_mb = 2 * 3 * 1024 * 512 * 2 / 1e6
    assert fp16 - int8 == pytest.approx(0.02 * weights_mb / 2)
    assert fp16 - pal == pytest.approx(0.02 * weights_mb * 3 / 4)


@pytest.mark.parametrize("backend,prompt,ffn,axis,gpu", [("ane", 512, 512, None, False),
                                                         ("cpu-static", 384, 512, None, False),
                                                         ("ane", 384, 65536, 300, False),
                                                         ("ane", 384, 512, None, True)])
def test_bulk_scores_equal_the_plan_entry_through_the_cost_model(backend, prompt, ffn, axis, gpu, monkeypatch):
    """score_rows (numpy over many decisions) against score (the plan entry through the cost model's layer_ms),
    on sampled decisions of the whole space, compression and partial chunks included; the third case puts groups
    past the ANE's weight bytes per function and (with a lowered axis limit) its packed slots; the last has a GPU
    (the plan's exact path mlx-exact: GPU heads and CPU tails, the memory bus)."""
    if axis:
        monkeypatch.setattr(ane_limits, "MAX_AXIS", axis)
    cost = apple_like()
    cost.models["ane"].ms_per_mb = 0.01
    if gpu:
        cost.models["mlx-exact"] = BackendModel("mlx-exact", 0.05, 0.0, 0.1, 0.002, 2, True, 30.0)
        cost.bus_ms_per_mb = 0.003  # a slow bus: its floor takes part in the lanes
    layers = LayerData.from_traces(synthetic_traces(SMALL, 12, 512, skew=1.2, tokens=True), 256, prompt)
    d = layers[1]
    assert d.partial.any() == (prompt % 256 != 0)
    space = layer_space(SMALL["num_experts"], ("none", "int8", "palettize4"), split_exact=gpu)
    if gpu:  # a random sample of the product space (17M points), as canonical decisions
        radices = [len(dim.values) for _, dim in space.params]
        rows = np.unique(space.canonical(np.random.default_rng(0).integers(0, radices, (400, len(radices)))), axis=0)
    else:
        rows = space.enumerate()[::97]
    scorer = Scorer(cost, 1024, ffn, backend, 3e6 * ffn / 512, with_energy=True)
    assert scorer.splits_exact == gpu
    bulk = scorer.score_rows(d, space, rows)
    for i, row in enumerate(rows):
        ref, got = scorer.score(d, space.config(row)), bulk.at(i)
        assert got.latency_ms == pytest.approx(ref.latency_ms, rel=1e-9)
        assert got.partial_ms == pytest.approx(ref.partial_ms, rel=1e-9, abs=1e-12)
        assert got.energy_mj == pytest.approx(ref.energy_mj, rel=1e-9)
        assert got.cpu_ms == pytest.approx(ref.cpu_ms, rel=1e-9)
        assert got.partial_cpu_ms == pytest.approx(ref.partial_cpu_ms, rel=1e-9, abs=1e-12)
        assert (got.heldout_drops, got.violation) == (ref.heldout_drops, pytest.approx(ref.violation))
    assert (bulk.violation > 0).any() and (bulk.violation == 0).any()  # the resident budget binds some


def test_enumeration_is_the_distinct_decisions_of_the_declared_space():
    space = layer_space(4, ("none", "int8"))
    values = [d.values for _, d in space.params]
    every = {space.config_from_params(dict(zip([p for p, _ in space.params], point)))
             for point in itertools.product(*values)}
    assert {space.config(r) for r in space.enumerate()} == every


def test_enumeration_by_blocks_finds_each_decision_once_in_first_appearance_order(monkeypatch):
    space = layer_space(4, ("none", "int8"))
    assert space.product_size <= space_module.BLOCK
    product = space.canonical(np.indices([len(d.values) for _, d in space.params]).reshape(len(space.params), -1).T)
    _, first = np.unique(space.keys(product), return_index=True)
    assert np.array_equal(space.enumerate(), product[np.sort(first)])  # one block: the whole product at once
    monkeypatch.setattr(space_module, "BLOCK", 1000)  # 185 blocks, decisions recurring across them
    assert np.array_equal(layer_space(4, ("none", "int8")).enumerate(), product[np.sort(first)])


def test_params_round_trip_and_neighbours_step_along_each_parameter():
    space = layer_space(4, ("none", "int8"))
    for row in space.enumerate()[::37]:
        cfg = space.config(row)
        assert space.config_from_params(space.params_of(cfg)) == cfg
    p = space.params_of(LayerConfig(2, 2, 1, (0.9,), "drop"))
    steps = {(k, q[k]) for q in space.neighbours(p) for k in q if q[k] != p[k]}
    assert steps == {("resident", 1), ("resident", 3), ("group_size", 1), ("group_size", 4), ("tiers", 2),
                     ("q0", 0.75), ("q0", 0.95), ("q1", 0.99), ("q2", 0.99), ("sizing", "expert"),
                     ("overflow", "spill"), ("compress", "int8")}
    assert len(p) == len(space.distributions()) == 3 + MAX_TIERS + 3


def test_the_space_digest_changes_with_the_space():
    assert layer_space(8).digest() == layer_space(8).digest()
    assert len({layer_space(8).digest(), layer_space(16).digest(), layer_space(8, ("none", "int8")).digest()}) == 3


def test_trials_suggest_from_the_declared_space():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = layer_space(8, ("none", "palettize4"))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(lambda t: float(len(space.suggest(t))), n_trials=5)
    assert all(t.distributions == space.distributions() for t in study.trials)
