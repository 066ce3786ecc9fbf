"""The least makespan of a prompt's FLOPs split over units within an energy cap (`autotune.costing.unit_bound`): a
hand-worked two-unit case, and the published M2 Ultra profile's roofline as `whole_prefill.roofline_ms` counts it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autotune.costing.unit_bound import prefill_bound, unit_bound
from autotune.costing.whole_prefill import DecoderShape, roofline_ms
from autotune.profiling.profile import load_profile


def test_two_units_by_hand():
    rates = {"a": (1.0, 10.0), "b": (2.0, 100.0)}  # ms per GFLOP, W
    free = unit_bound(rates, 30.0)  # both busy: 30 / (1 + 1/2) = 20 ms, a 20 GFLOP, b 10
    assert free.bound_ms == pytest.approx(20.0)
    assert free.gflop == pytest.approx({"a": 20.0, "b": 10.0})
    assert free.energy_mj == pytest.approx(20 * 10 + 20 * 100)
    # 1,200 mJ: b takes x GFLOP while 300 + 190 x <= 1200, x = 900 / 190; the makespan a's 30 - x
    capped = unit_bound(rates, 30.0, 1200.0)
    x = 900 / 190
    assert capped.bound_ms == pytest.approx(30 - x, rel=1e-6)
    assert capped.busy_ms["b"] == pytest.approx(2 * x, rel=1e-6) and capped.energy_mj == pytest.approx(1200.0)
    with pytest.raises(ValueError):
        unit_bound(rates, 30.0, 100.0)  # a alone takes 300 mJ


def test_published_profile_roofline_and_the_cap():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from make_shape_twin import TWINS

    cost = load_profile("apple-m2-ultra-published").cost_model
    shape = DecoderShape.from_config(TWINS["qwen3-30b-a3b"])
    gpu_ms = 1500.0
    out = prefill_bound(cost, shape, 4096, "ane", gpu_ms, gpu_ms * cost.power_w("mlx-exact"))
    assert out["roofline_ms"] == pytest.approx(roofline_ms(cost, shape, 4096, "ane"), rel=1e-6)
    every, two = out["all_units"], out["without_cpu"]
    assert set(every["units"]) == {"ane", "cpu", "mlx-exact"} and set(two["units"]) == {"ane", "mlx-exact"}
    # the ANE and the GPU each busy the whole makespan; the CPU only the share the GPU alone's energy leaves
    assert two["units"]["ane"]["busy_ms"] == pytest.approx(two["bound_ms"], rel=1e-6)
    assert 0 < every["units"]["cpu"]["busy_ms"] < every["bound_ms"]
    assert every["energy_mj"] == pytest.approx(out["energy_cap_mj"], rel=1e-6)
    assert out["roofline_ms"] < every["bound_ms"] < two["bound_ms"] < gpu_ms
