"""Cost model: recovery of a known analytic cost, layer composition, energy only where power was measured."""
from __future__ import annotations

import numpy as np
import pytest

from autotune.costmodel import (BackendModel, CostModel, HostCosts, fit_backend, fit_cost_model, heldout_errors,
                                record_features)
from runtime.plan import Group, LayerPlan

TRUE = {"call_ms": 0.05, "expert_ms": 0.012, "ms_per_gflop": 6.0, "ms_per_mb": 0.02}
SHAPES = [(256, 256), (1024, 2048), (2048, 768)]


def synthetic_records(backend: str, noise: float = 0.02, seed: int = 0) -> list[dict]:
    """Records timed on a fake device whose cost is exactly TRUE, with multiplicative noise."""
    rng = np.random.default_rng(seed)
    truth = BackendModel(backend, **TRUE)
    recs = []
    for h, f in SHAPES:
        for m in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]:
            recs.append({"kind": "ffn", "backend": backend, "tokens": m, "hidden": h, "ffn": f})
        for g, c in [(1, 1), (4, 16), (8, 64), (4, 256)]:
            recs.append({"kind": "group", "backend": backend, "capacities": [c] * g, "hidden": h, "ffn": f})
    recs.append({"kind": "call", "backend": backend, "capacities": [1], "hidden": 8, "ffn": 8})
    for r in recs:
        r["median_ms"] = float(truth.analytic(*record_features(r, 4))) * float(np.exp(rng.normal(0, noise)))
    return recs


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
