"""Cost model: recovery of a known analytic cost, layer composition, energy only where power was measured."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import SHAPES, TRUE, synthetic_records

from autotune.costing.costmodel import BackendModel, CostModel, HostCosts
from autotune.costing.fitting import fit_backend, fit_cost_model, heldout_errors
from runtime.plan import Group, LayerPlan


def test_fit_recovers_known_analytic_cost_within_5_percent():
    recs = synthetic_records("cpu-exact")
    model = fit_backend("cpu-exact", recs, residual=False)
    for name, want in TRUE.items():
        assert getattr(model, name) == pytest.approx(want, rel=0.05), name
    # and with the residual learner on, predictions of the true cost stay within 5% across shapes
    model = fit_backend("cpu-exact", recs)
    truth = BackendModel("t", **TRUE)
    for h, f in SHAPES:
        m = np.array([3, 48, 300, 1500])
        np.testing.assert_allclose(model.ffn_ms(m, h, f), truth.ffn_ms(m, h, f), rtol=0.05)


def test_heldout_error_is_small_on_clean_analytic_records():
    recs = synthetic_records("cpu-static", noise=0.01)
    err = heldout_errors(recs)
    assert err["mape"]["cpu-static"] < 0.05
    assert all("heldout_pred_ms" in r for r in recs)


def _cpu_model() -> CostModel:
    recs = synthetic_records("cpu-exact") + synthetic_records("cpu-static", seed=1)
    cm = fit_cost_model(recs)
    cm.host = HostCosts(pack=(0.05, 0.001, 0.0, 0.002, 0.0, 0.0), exact=(0.03, 0.0005, 0.0, 0.0, 0.0, 0.0))
    return cm


def test_layer_composes_calls_exact_path_and_packing():
    cm = _cpu_model()
    h, f = 1024, 2048
    lp = LayerPlan(layer=0, groups=[Group(backend="cpu-static", experts=[0, 1], capacities=[32, 16])],
                   cpu_exact=[2, 3])
    counts = np.array([40, 10, 7, 0])
    static = cm.group_call_ms("cpu-static", [32, 16], h, f)
    pack = cm.pack_ms(57, h, slots=48)
    # drop: expert 0's 8 overflowing assignments vanish; the exact path runs expert 2 only (3 has no tokens)
    exact_drop = cm.exact_ms(np.array([0, 0, 7, 0]), h, f)
    assert exact_drop == pytest.approx(cm.call_ms("cpu-exact") + cm.ffn_ms("cpu-exact", 7, h, f)
                                       + 0.03 + 0.0005 * 7)
    assert cm.layer_ms(lp, counts, h, f, "drop") == pytest.approx(pack + static + exact_drop)  # all on the CPU
    # spill: they run exactly instead
    exact_spill = cm.exact_ms(np.array([8, 0, 7, 0]), h, f)
    assert cm.layer_ms(lp, counts, h, f, "spill") == pytest.approx(pack + static + exact_spill)
    assert exact_spill > exact_drop
    # vectorised over chunks: one row per chunk gives the per-chunk values
    many = np.array([[40, 10, 7, 0], [0, 0, 0, 0], [3, 30, 0, 9]])
    got = cm.layer_ms(lp, many, h, f, "spill")
    assert got.shape == (3,)
    np.testing.assert_allclose(got, [cm.layer_ms(lp, row, h, f, "spill") for row in many])
    # a plan naming `ane` on a device without one is priced as cpu-static, as the runtime runs it
    lp_ane = LayerPlan(layer=0, groups=[Group(backend="ane", experts=[0, 1], capacities=[32, 16])], cpu_exact=[2, 3])
    assert cm.layer_ms(lp_ane, counts, h, f, "drop") == pytest.approx(cm.layer_ms(lp, counts, h, f, "drop"))
    # no measured power: no energy
    assert cm.layer_energy_mj(lp, counts, h, f, "drop") is None and not cm.has_energy


def test_ffn_ms_is_vectorised_and_zero_tokens_cost_nothing():
    cm = _cpu_model()
    m = np.array([0, 1, 5, 100, 9000])
    out = cm.ffn_ms("cpu-exact", m, 256, 256)
    assert out.shape == (5,) and out[0] == 0.0 and np.all(np.diff(out[1:]) > 0)
    assert cm.ffn_ms("cpu-exact", 5, 256, 256) == pytest.approx(out[2])
    assert cm.exact_ms(np.zeros(8, dtype=int), 256, 256) == 0.0


def test_energy_is_power_times_busy_time_only_where_power_was_measured():
    kw = dict(call_ms=0.1, expert_ms=0.0, ms_per_gflop=1.0, ms_per_mb=0.0)
    models = {"ane": BackendModel("ane", overlaps_cpu=True, power_w=2.0, **kw),
              "cpu-exact": BackendModel("cpu-exact", power_w=10.0, **kw),
              "cpu-static": BackendModel("cpu-static", power_w=10.0, **kw)}
    cm = CostModel(models)
    lp = LayerPlan(layer=0, groups=[Group(backend="ane", experts=[0], capacities=[100])], cpu_exact=[1])
    counts = np.array([50, 40])
    ane = cm.group_call_ms("ane", [100], 64, 64)
    exact = cm.exact_ms(np.array([0, 40]), 64, 64)
    assert cm.layer_ms(lp, counts, 64, 64, "drop") == pytest.approx(max(ane, exact))  # overlap, no host costs
    assert cm.layer_energy_mj(lp, counts, 64, 64, "drop") == pytest.approx(2.0 * ane + 10.0 * exact)
    models["cpu-exact"].power_w = None
    assert cm.layer_energy_mj(lp, counts, 64, 64, "drop") is None and not cm.has_energy
