"""The profile file: round trip, one clear error for bad files, other-host warning, the shipped Apple profile."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from helpers import synthetic_records

from autotune.costing.costmodel import CostModel
from autotune.profiling.profile import (
    ProfileHostWarning,
    build_profile,
    host_id,
    host_profile_path,
    load_profile,
    save_profile,
    shipped_profiles,
)
from runtime.errors import FileFormatError
from runtime.plan import Group, LayerPlan


@pytest.fixture
def profile_path(tmp_path):
    from autotune.profiling.profile import host_facts

    recs = synthetic_records("cpu-exact") + synthetic_records("cpu-static", seed=1)
    prof = build_profile(recs, host_facts(1), "autotune profile-device --quick", {"threads": 1}, {"method": "none"})
    path = tmp_path / "p.json"
    save_profile(prof, path)
    return path


def test_round_trip_keeps_model_and_heldout_error(profile_path):
    prof = load_profile(profile_path)
    assert set(prof.heldout_mape) == {"cpu-exact", "cpu-static"}
    assert all(0 <= v < 0.1 for v in prof.heldout_mape.values())
    assert prof.cost_model.backends == ["cpu-exact", "cpu-static"]
    obj = json.loads(profile_path.read_text())
    assert obj["schema"] == "npumoe.profile/1" and len(obj["records"]) == len(prof.records)
    again = CostModel.from_json(obj["cost_model"])
    assert again.ffn_ms("cpu-exact", 37, 1024, 2048) == pytest.approx(prof.cost_model.ffn_ms("cpu-exact", 37, 1024,
                                                                                                  2048))


def _expect_one_error(path, field: str):
    with pytest.raises(FileFormatError) as e:
        load_profile(path)
    assert e.value.field == field and str(e.value).count("profile") >= 1
    return e.value


def test_truncated_and_malformed_files_give_one_clear_error(profile_path, tmp_path):
    raw = profile_path.read_text()
    bad = tmp_path / "bad.json"
    bad.write_text(raw[: len(raw) // 2])  # truncated mid-write
    assert "not valid JSON" in str(_expect_one_error(bad, "file"))
    bad.write_text("")
    _expect_one_error(bad, "file")
    obj = json.loads(raw)
    for mutate, field in [
        (lambda o: o.update(schema="npumoe.plan/1"), "schema"),
        (lambda o: o.update(schema="npumoe.profile/9"), "schema"),
        (lambda o: o.pop("cost_model"), "cost_model"),
        (lambda o: o["records"][3].pop("median_ms"), "records[3].median_ms"),
        (lambda o: o["records"][0].update(median_ms=-1.0), "records[0].median_ms"),
        (lambda o: o["cost_model"]["backends"]["cpu-exact"].update(ms_per_gflop="fast"),
         "cost_model.backends.cpu-exact.ms_per_gflop"),
        (lambda o: o["cost_model"].update(backends={}), "cost_model.backends"),
        (lambda o: o["host"].pop("id"), "host.id"),
        (lambda o: o["records"][5].pop("hidden"), "records[5].hidden"),
        (lambda o: o["records"][0].update(kind="bogus"), "records[0].kind"),
    ]:
        o = json.loads(raw)
        mutate(o)
        bad.write_text(json.dumps(o))
        _expect_one_error(bad, field)
    bad.write_text(json.dumps(obj))
    load_profile(bad)  # the unmutated copy is fine


def test_profile_from_another_host_loads_with_a_warning_naming_both(profile_path):
    obj = json.loads(profile_path.read_text())
    obj["host"]["id"], obj["host"]["description"] = "darwin-arm64-apple-m3-max-16c", "Apple M3 Max, 16 cores"
    profile_path.write_text(json.dumps(obj))
    with pytest.warns(ProfileHostWarning) as w:
        prof = load_profile(profile_path)
    msg = str(w[0].message)
    assert "darwin-arm64-apple-m3-max-16c" in msg and host_id() in msg
    assert prof.cost_model.call_ms("cpu-exact") >= 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_profile(profile_path, check_host=False)


def test_host_profile_path_follows_npumoe_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path))
    assert host_profile_path() == tmp_path / "profiles" / f"{host_id()}.json"


def test_shipped_apple_profile_plans_for_the_ane_from_linux():
    assert "apple-m2-ultra-published" in shipped_profiles()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileHostWarning)  # published figures are no host mismatch
        prof = load_profile("apple-m2-ultra-published")
    assert prof.published
    cm = prof.cost_model
    assert {"ane", "cpu-exact", "cpu-static"} <= set(cm.backends)
    # revision 2: the Core ML predict() path's fixed cost, and cited CPU and ANE power; 3: the GPU (mlx-exact);
    # 4: the link between Macs (Thunderbolt 5, published)
    assert prof.settings["revision"] == 4
    assert cm.call_ms("ane") == pytest.approx(0.27)
    assert cm.models["ane"].overlaps_cpu and cm.power_w("ane") == pytest.approx(1.58)
    assert cm.power_w("cpu-exact") == cm.power_w("cpu-static") == pytest.approx(61.0) and cm.has_energy
    gpu = cm.models["mlx-exact"]
    assert gpu.overlaps_cpu and gpu.power_w == pytest.approx(62.05) and gpu.call_ms == pytest.approx(0.18)
    assert 1 / gpu.ms_per_gflop == pytest.approx(20.5) and 1 / gpu.ms_per_mb == pytest.approx(800.0)
    assert cm.bus_ms_per_mb == pytest.approx(1 / 800.0) and cm.plan_exact() == "mlx-exact"
    for key in ("ane_call_ms", "ane_power_w", "cpu_power_w", "gpu_gemm_tflops", "gpu_call_ms", "gpu_power_w",
                "memory_gb_s", "gpu_peak_tflops", "link_gb_s"):
        cites = prof.extra["sources"][key]["cites"]
        assert cites and all(c["seen"] in ("primary", "second-hand") and c["source"] for c in cites)
    assert prof.extra["sources"]["cpu_power_w"]["cites"][0]["seen"] == "second-hand"  # Ars, as quoted
    assert prof.published and "not measured" in prof.measured_by
    for r in prof.records:
        assert r["source"] and r["measured_by_npumoe"] is False
    # the paper's rows are reproduced by the fit within its reported held-out error
    for r in prof.records:
        if not r.get("excluded"):
            pred = cm.models[r["backend"]].analytic(*__import__("autotune.costing.fitting", fromlist=["x"])
                                                    .record_features(r, cm.models[r["backend"]].dtype_bytes))
            assert abs(pred / r["median_ms"] - 1) < 0.1
    assert cm.group_call_ms("ane", [64] * 8, 2048, 768) > cm.call_ms("ane")
    assert max(prof.heldout_mape.values()) < 0.1
    # energy = power x busy time: the ANE's calls at 1.58 W, the CPU's exact path (spilled + cold) at 61 W
    lp = LayerPlan(layer=0, groups=[Group(backend="ane", experts=[0, 1], capacities=[8, 8])], cpu_exact=[2])
    ane_ms = cm.group_call_ms("ane", [8, 8], 2048, 768)
    exact_ms = cm.exact_ms(np.array([0, 1, 3]), 2048, 768)  # expert 1 spills 1 of its 9, expert 2 is cold
    assert cm.layer_energy_mj(lp, np.array([5, 9, 3]), 2048, 768, "spill") == pytest.approx(1.58 * ane_ms
                                                                                          + 61.0 * exact_ms)


def test_a_revision_1_profile_still_loads(tmp_path):
    """Revision 2 added optional fields only (settings.revision, structured sources, CPU power): a profile
    without them, like revision 1, loads and has no energy."""
    obj = json.loads(shipped_profiles()["apple-m2-ultra-published"].read_text())
    obj["settings"].pop("revision")
    obj["sources"] = {"ane_fixed_cost": "a string, as revision 1 wrote it"}
    obj.pop("superseded")
    obj["cost_model"]["backends"].pop("mlx-exact")
    obj["cost_model"].pop("bus_ms_per_mb")
    for b in ("cpu-exact", "cpu-static"):
        obj["cost_model"]["backends"][b]["power_w"] = None
    obj["cost_model"]["backends"]["ane"]["call_ms"] = 0.095
    (tmp_path / "v1.json").write_text(json.dumps(obj))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileHostWarning)  # published figures are no host mismatch
        prof = load_profile(tmp_path / "v1.json")
    assert prof.cost_model.call_ms("ane") == pytest.approx(0.095) and not prof.cost_model.has_energy



def test_a_model_that_fits_the_last_level_cache_is_priced_by_the_in_cache_model(tmp_path):
    from autotune.profiling.profile import host_facts

    recs = [{**r, "warm_median_ms": r["median_ms"] / 2} for r in synthetic_records("cpu-exact")]
    host = {**host_facts(1), "last_level_cache_bytes": 256 * 2**20}
    prof = build_profile(recs, host, "autotune profile-device --quick", {"threads": 1}, {"method": "none"})
    save_profile(prof, tmp_path / "p.json")
    prof = load_profile(tmp_path / "p.json")
    small, state = prof.cost_model_for(100 * 2**20)  # half the cache or less
    assert small is prof.cost_model_in_cache and state.startswith("in cache")
    assert small.ffn_ms("cpu-exact", 256, 1024, 2048) == pytest.approx(
        prof.cost_model.ffn_ms("cpu-exact", 256, 1024, 2048) / 2, rel=0.05)
    big, state = prof.cost_model_for(200 * 2**20)
    assert big is prof.cost_model and state.startswith("evicted")
    cold_only = build_profile(synthetic_records("cpu-exact"), host, "autotune profile-device", {}, {"method": "none"})
    assert cold_only.cost_model_in_cache is None and cold_only.cost_model_for(1)[0] is cold_only.cost_model
    unknown = build_profile(recs, {**host, "last_level_cache_bytes": None}, "autotune profile-device", {}, {})
    assert unknown.cost_model_for(1)[0] is unknown.cost_model  # no cache size known: the evicted state
    # by a layer's weights: tiny-moe in fp32 holds 58 MB, 13 MiB per layer, and a host with 32 MiB of L3 ran its
    # prefill within 1.5% of the in-cache prediction (30% under the evicted one)
    from autotune.costing.memory import model_size
    from runtime.loading.model_record import resolve_model

    tiny = model_size(resolve_model("tiny-moe", "float32"))
    assert tiny.weight_bytes > 50 * 2**20 and 12 * 2**20 < tiny.layer_bytes < 14 * 2**20
    epyc = build_profile(recs, {**host, "last_level_cache_bytes": 32 * 2**20}, "autotune profile-device", {}, {})
    assert epyc.cost_model_for(tiny.layer_bytes)[0] is epyc.cost_model_in_cache
    assert epyc.cost_model_for(tiny.weight_bytes)[0] is epyc.cost_model


def test_a_dense_op_with_two_records_has_no_held_out_error_and_its_profile_loads(tmp_path):
    """Leave-one-out over a dense op's two records fits each fold to one record: no fit (a dense fit takes two), so
    no held-out figure, not nan (the file was written and then refused by its own loader)."""
    from autotune.profiling.profile import host_facts

    attention = [{"kind": "attention", "backend": "cpu-exact", "rows": r, "context": c, "heads": 4, "kv_heads": 2,
                  "head_dim": 64, "median_ms": 0.01 * c} for r, c in ((256, 256), (256, 512))]
    recs = synthetic_records("cpu-exact") + attention
    prof = build_profile(recs, host_facts(1), "autotune profile-device --quick", {"threads": 1}, {"method": "none"})
    assert prof.heldout_mape["cpu-exact-attention"] is None and 0 <= prof.heldout_mape["cpu-exact"] < 0.1
    save_profile(prof, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").heldout_mape["cpu-exact-attention"] is None
