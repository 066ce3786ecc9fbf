"""The cost model's fitting ranges (autotune/costing/fit_range.py): the bookkeeping, the parts a prefill prices past
them and the one line that says so, records at a model's own shapes merged into a profile
(autotune/profiling/model_records.py), and the held-out error past the fitting range on records whose true law is
known."""
from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
from helpers import SHAPES, TRUE, synthetic_records

from autotune import pipeline, profile_stage
from autotune.costing.costmodel import BackendModel
from autotune.costing.dense_prices import attention_work
from autotune.costing.fit_range import describe_parts, fit_ranges, reach
from autotune.costing.fitting import (
    dtype_records,
    fit_cost_model,
    heldout_errors,
    out_of_range_errors,
    record_features,
    record_groups,
)
from autotune.costing.whole_prefill import DecoderShape, ExpertFigures, predict_prefill, priced_outside
from autotune.profiling import model_records
from autotune.profiling.profile import build_profile, host_facts, load_profile, save_profile
from runtime.errors import NpumoeError

PHI = DecoderShape(hidden=4096, heads=32, kv_heads=8, head_dim=128, vocab=32064, num_layers=1, moe_layers=(0,),
                   num_experts=16, top_k=2, expert_ffn=6400)
SMALL = DecoderShape(hidden=1024, heads=8, kv_heads=2, head_dim=128, vocab=4096, num_layers=1, moe_layers=(0,),
                     num_experts=16, top_k=2, expert_ffn=768)


def dense_records(hidden: int, model: str | None = None) -> list[dict]:
    """cpu-exact dense records at one width: projections and the router at a few rows, lm_head at one, the attention
    core, elementwise work."""
    shapes = [(m, n) for m in (1, 64, 256, 1024) for n in (hidden, hidden // 4, 16)] + [(1, 32768)]
    recs = [{"kind": "dense_matmul", "backend": "cpu-exact", "m": m, "n": n, "k": hidden, "median_ms": 1e-7 * m * n
             * hidden + 0.01} for m, n in shapes]
    recs += [{"kind": "attention", "backend": "cpu-exact", "rows": r, "context": c, "heads": hidden // 128,
              "kv_heads": 2, "head_dim": 128, "median_ms": 1e-7 * r * c * hidden + 0.01}
             for r, c in ((256, 256), (1024, 1024), (256, 2048), (1024, 4096))]
    recs += [{"kind": "elementwise", "backend": "cpu-exact", "rows": r, "hidden": hidden,
              "median_ms": 1e-6 * r * hidden + 0.01} for r in (64, 256, 1024, 4096)]
    return [{**r, "model": model} if model else r for r in recs]


def host_profile(records: list[dict]):
    facts = host_facts(1)
    return build_profile(records, facts, "autotune profile-device --quick", {"threads": 1, "clock": "cpu",
                                                                            "backends": ["cpu-exact"]}, {}, None)


def test_ranges_hold_each_kind_s_smallest_and_largest_shape_and_reach_says_how_far_past():
    records = synthetic_records("cpu-exact") + dense_records(2048)
    ranges = fit_ranges(records)
    experts = ranges["cpu-exact"]["experts"]
    assert experts["hidden"] == [256, 2048] and experts["ffn"] == [256, 2048] and experts["rows"] == [1, 2048]
    assert ranges["cpu-exact"]["matmul"] == {"rows": [1, 1024], "out": [16, 32768], "in": [2048, 2048]}
    assert ranges["cpu-exact"]["attention"]["context"] == [256, 4096]
    far = reach(ranges, "cpu-exact", "experts", rows=64, hidden=4096, ffn=6400)
    assert [(r.axis, r.value, r.end) for r in far] == [("hidden", 4096, 2048), ("ffn", 6400, 2048)]
    assert far[0].describe() == "hidden 4096 > 2048 profiled" and far[1].factor == pytest.approx(3.125)
    assert reach(ranges, "cpu-exact", "experts", rows=64, hidden=1024, ffn=768) == []  # inside: interpolated
    below = reach(ranges, "cpu-exact", "experts", rows=64, hidden=64, ffn=768)
    assert below[0].describe() == "hidden 64 < 256 profiled" and below[0].factor == 4
    assert reach(ranges, "ane", "experts", hidden=1e9) == []  # no such fit: no range to reach past


def test_a_prefill_names_the_parts_priced_past_the_profile_and_how_far():
    cost = fit_cost_model(synthetic_records("cpu-exact") + synthetic_records("cpu-static") + dense_records(2048))
    outside = priced_outside(cost, PHI, 4096, 1024, "cpu-static")
    assert [r.describe() for r in outside["experts"]] == ["hidden 4096 > 2048 profiled", "ffn 6400 > 2048 profiled"]
    assert [r.describe() for r in outside["attention_projections"]] == ["in 4096 > 2048 profiled"]
    assert outside["attention_core"][0].describe() == "width 4096 > 2048 profiled"
    assert "dense_mlp" not in outside  # no MLP in this model
    assert describe_parts({"experts": outside["experts"]}) == ("experts: hidden 4096 > 2048 profiled, ffn 6400 > "
                                                               "2048 profiled")
    assert priced_outside(cost, DecoderShape(**{**SMALL.__dict__, "hidden": 2048, "heads": 16}), 1024, 1024) == {}
    assert [r.describe() for r in priced_outside(cost, SMALL, 4096, 4096)["attention_core"]] == [
        "rows 4096 > 1024 profiled", "width 1024 < 2048 profiled"]
    # the ranges travel with the model's JSON
    assert type(cost).from_json(cost.to_json()).ranges == cost.ranges


def test_the_search_s_one_line_names_the_parts_and_no_measure_keeps_the_profile(tmp_path, caplog, monkeypatch):
    prof = host_profile(synthetic_records("cpu-exact") + dense_records(2048))
    prof.path = str(tmp_path / "p.json")
    save_profile(prof, prof.path)
    monkeypatch.setattr(model_records, "add_model_records", lambda *a, **k: pytest.fail("measured"))
    with caplog.at_level(logging.WARNING, logger="npumoe"):
        kept = model_records.cover_model(prof, "p.json", PHI, "phi", False, False, 10**9)
    assert kept is prof and caplog.records == []  # --no-measure: the profile as it is, nothing timed
    outside = priced_outside(prof.cost_model, PHI, 4096, 1024)
    assert model_records.outside_line(prof, "p.json", "phi", outside, False) == (
        "profile p.json (--no-measure) prices phi past its records: attention_projections: in 4096 > 2048 "
        "profiled; attention_core: width 4096 > 2048 profiled; experts: hidden 4096 > 2048 profiled, ffn 6400 > "
        "2048 profiled; lm_head: in 4096 > 2048 profiled; rest: hidden 4096 > 2048 profiled, in 4096 > 2048 profiled")
    assert model_records.outside_line(prof, "p.json", "phi", {}, False) is None
    prof.measured_by = "published figures"  # a published profile is never measured into: said the same way
    assert model_records.cover_model(prof, "pub", PHI, "phi", True, False, 10**9) is prof
    assert model_records.outside_line(prof, "pub", "phi", outside, True).startswith(
        "profile pub (published figures) prices phi past its records: attention_projections")


def test_model_records_merge_into_the_profile_replacing_the_model_s_earlier_ones(tmp_path, caplog, monkeypatch):
    base = synthetic_records("cpu-exact") + dense_records(2048)
    prof = host_profile(copy.deepcopy(base))
    prof.path = str(tmp_path / "p.json")
    save_profile(prof, prof.path)
    timed = []

    def fake_measure(shape, label, backends, quick, clock, progress, dtype):
        timed.append((shape.hidden, label, backends, quick))
        recs = [{"kind": "group", "backend": "cpu-exact", "capacities": [m], "hidden": shape.hidden,
                 "ffn": shape.expert_ffn, "tokens": m, "model": label} for m in (1, 16, 256)]
        for r in recs:
            r["median_ms"] = float(BackendModel("t", **TRUE).analytic(*record_features(r, 4)))
        return recs + dense_records(shape.hidden, label)

    monkeypatch.setattr(model_records, "measure_model", fake_measure)
    with caplog.at_level(logging.WARNING, logger="npumoe"):
        merged = model_records.cover_model(prof, "p.json", PHI, "phi", True, False, 10**9)
    assert timed == [(4096, "phi", ["cpu-exact"], True)]
    assert "measured 24 records at phi's shapes" in caplog.records[0].getMessage()
    assert len(merged.records) == len(base) + 24 and merged.settings["models"]["phi"]["records"] == 24
    assert merged.cost_model.ranges["cpu-exact"]["experts"]["hidden"] == [256, 4096]
    assert model_records.shape_outside(merged.cost_model, PHI) == {}  # covered: a search measures nothing more
    again = load_profile(prof.path)  # saved into the profile's own file, schema and all
    assert len(again.records) == len(merged.records) and again.cost_model.ranges == merged.cost_model.ranges
    twice, n, _ = model_records.add_model_records(again, PHI, "phi")
    assert n == 24 and len(twice.records) == len(merged.records)  # the model's earlier records replaced
    again.host = {**again.host, "id": "another-host"}
    with pytest.raises(NpumoeError, match="was measured on 'another-host', not this host"):
        model_records.require_measurable(again, "p.json")
    with pytest.raises(NpumoeError, match="published figures"):
        again.measured_by = "published figures"
        model_records.require_measurable(again, "p.json")
    # profile-device --model adds to the profile at --out
    monkeypatch.setattr(profile_stage, "resolve_model", lambda m, d: type("R", (), {"name": m,
                                                                            "compute_dtype": torch.float32})())
    monkeypatch.setattr(profile_stage, "decoder_shape", lambda record: SMALL)
    out = pipeline.profile_device(model="small", out=prof.path, progress=False)
    assert out.settings["models"].keys() == {"phi", "small"} and timed[-1][:2] == (1024, "small")


def law(records: list[dict], extra) -> list[dict]:
    """Times of a device whose cost is TRUE's analytic form times `extra(record)` (exact, no noise)."""
    truth = BackendModel("t", **TRUE)
    for r in records:
        r["median_ms"] = float(truth.analytic(*record_features(r, 4))) * extra(r)
    return records


def test_the_error_past_the_fitting_range_is_small_where_the_form_holds_and_large_where_it_only_interpolates():
    wide = [(4096, 2048)]  # a width past the others: the out-of-range test set
    def shaped(shapes):
        return [{"kind": "group", "backend": "cpu-exact", "capacities": [m], "hidden": h, "ffn": f}
                for h, f in shapes for m in (1, 4, 16, 64, 256, 1024)]

    same_law = law(shaped(SHAPES + wide), lambda r: 1.0)
    held = heldout_errors(same_law)
    assert held["out_of_range"]["split"]["cpu-exact"] == "hidden 4096 (fitted to hidden <= 2048)"
    assert held["out_of_range"]["mape"]["cpu-exact"] < 0.02
    # past 2048 the device slows by half (its weights leave a cache): the records below cannot know it
    slower = law(shaped(SHAPES + wide), lambda r: 1.5 if r["hidden"] > 2048 else 1.0)
    past = out_of_range_errors(record_groups(slower))["mape"]["cpu-exact"]
    assert past == pytest.approx(1 / 3, rel=0.05)  # predicted 1.0 where 1.5 was measured
    assert heldout_errors(slower)["mape"]["cpu-exact"] < past  # the k-fold figure sees the wide shape in training
    one_width = law(shaped([(1024, 2048)]), lambda r: 1.0)
    assert out_of_range_errors(record_groups(one_width))["mape"]["cpu-exact"] is None


def test_a_profile_written_before_the_ranges_gets_them_from_its_records(tmp_path):
    prof = host_profile(synthetic_records("cpu-exact"))
    obj = prof.to_json()
    del obj["cost_model"]["ranges"]
    path = tmp_path / "old.json"
    from runtime.fileio import atomic_write_json
    atomic_write_json(path, obj)
    assert load_profile(path).cost_model.ranges["cpu-exact"]["experts"]["hidden"] == [256, 2048]
    assert np.isfinite(prof.heldout["out_of_range"]["mape"]["cpu-exact"])


def test_a_model_s_records_in_its_own_dtype_get_a_fit_of_their_own(tmp_path, caplog, monkeypatch):
    base = synthetic_records("cpu-exact") + dense_records(2048)
    bf16 = [{**r, "dtype": "bfloat16", "model": "phi", "median_ms": r["median_ms"] / 5}
            for r in law([{"kind": "group", "backend": "cpu-exact", "capacities": [m], "hidden": 4096, "ffn": 6400}
                          for m in (1, 16, 64, 256, 1024)], lambda r: 1.0)] + \
        [{**r, "dtype": "bfloat16", "dtype_bytes": 2, "median_ms": r["median_ms"] / 5} for r in dense_records(4096)]
    prof = host_profile(base + bf16)
    assert set(prof.by_dtype) == {"bfloat16"} and prof.heldout["n"]["cpu-exact@bfloat16"] == 5
    # float32's fit prices them at 5x: what the profile says pricing them without their own records would miss by
    assert prof.heldout["float32_fit"]["cpu-exact@bfloat16"] == pytest.approx(4.0, rel=0.05)
    cost, why = prof.cost_model_for(10**9, "bfloat16")
    assert why.endswith("bfloat16 records") and cost.ranges["cpu-exact"]["experts"]["hidden"] == [4096, 4096]
    fp32 = prof.cost_model.backend_model("cpu-exact")
    assert float(cost.ffn_ms("cpu-exact", 256, 4096, 6400)) == pytest.approx(
        float(fp32.ffn_ms(256, 4096, 6400)) / 5, rel=0.1)  # a fifth of float32's law, as timed
    learnt = dtype_records(prof.records, "bfloat16")  # its own, and float32's dispatch costs (no dense op lacks)
    assert len(learnt) == len(bf16) + 1 and learnt[-1]["kind"] == "call"
    assert prof.cost_model_for(10**9, "float16")[1].endswith("float32 records: the profile timed nothing in float16")
    assert prof.cost_model.ranges["cpu-exact"]["experts"]["hidden"] == [256, 2048]  # float32's fit kept apart
    path = tmp_path / "p.json"
    save_profile(prof, path)
    again = load_profile(path)
    assert again.by_dtype["bfloat16"][0].to_json() == cost.to_json()
    # a search on a profile without the model's dtype measures it (here: says so, with --no-measure)
    plain = host_profile(copy.deepcopy(base))
    assert model_records.outside_line(plain, "p", "small", {}, False, torch.bfloat16) == (
        "profile p (--no-measure) prices small past its records: no bfloat16 records (the model computes in it; "
        "priced from float32's)")
    monkeypatch.setattr(model_records, "add_model_records", lambda *a, **k: (plain, 0, 0.0))
    plain.path = str(tmp_path / "plain.json")
    with caplog.at_level(logging.WARNING, logger="npumoe"):
        model_records.cover_model(plain, "p", SMALL, "small", True, False, 10**9, torch.bfloat16)
    assert caplog.records[-1].getMessage().startswith("measured 0 records at small's shapes")


def test_a_window_shorter_than_the_context_prices_even_a_first_chunk_as_masked():
    cost = fit_cost_model(synthetic_records("cpu-exact") + dense_records(2048))
    tiny = DecoderShape.from_config({"model_type": "phimoe", "hidden_size": 2048, "num_attention_heads": 16,
                                     "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 4096,
                                     "num_hidden_layers": 1, "num_local_experts": 16, "intermediate_size": 448,
                                     "sliding_window": 2047})
    assert tiny.sliding_window == 2047 and tiny.norm == "layer"  # PhiMoE's layer norms: timed as such
    assert model_records.dense_shape(tiny).norm == "layer"
    full = DecoderShape(**{**tiny.__dict__, "sliding_window": 0})
    experts = ExpertFigures(0.0, 0.0, None)
    core = {s.sliding_window: predict_prefill(cost, s, 4096, 4096, experts).parts_ms["attention_core"]
            for s in (tiny, full)}
    assert core[2047] > 1.3 * core[0]  # the whole block under a mask, not the causal half
    masked, causal = (attention_work(4096, 4096, 16, 4, 128, 2, sdpa=True, masked=m) for m in (True, False))
    assert masked[0] == 2 * causal[0] and masked[1] > causal[1]  # twice the FLOPs, k/v repeated and the mask
    short = {s.sliding_window: predict_prefill(cost, s, 1024, 1024, experts).parts_ms["attention_core"]
             for s in (tiny, full)}
    assert short[2047] == short[0]  # a context inside the window: causal
    off = DecoderShape.from_config({**{"model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 16,
                                       "vocab_size": 4096, "num_hidden_layers": 1, "intermediate_size": 448},
                                    "sliding_window": 4096, "use_sliding_window": False})
    assert off.sliding_window == 0


def test_profile_device_model_adds_the_model_s_records_to_the_profile_at_out(tmp_path, monkeypatch, capsys):
    from autotune.cli import main

    prof = host_profile(synthetic_records("cpu-exact") + dense_records(2048))
    path = tmp_path / "p.json"
    save_profile(prof, path)
    seen = []

    def fake_measure(shape, label, backends, quick, clock, progress, dtype):
        seen.append((shape.hidden, shape.expert_ffn, label, dtype, quick))
        return [{**r, "model": label, "dtype": "bfloat16"} for r in dense_records(shape.hidden)]

    monkeypatch.setattr(model_records, "measure_model", fake_measure)
    assert main(["profile-device", "--quick", "--model", "tiny-moe", "--dtype", "bfloat16", "--out", str(path),
                 "--no-progress"]) == 0
    assert seen == [(256, 256, "tiny-moe", torch.bfloat16, True)]
    assert "21 records at tiny-moe's shapes in bfloat16" in capsys.readouterr().out
    again = load_profile(path)
    assert set(again.by_dtype) == {"bfloat16"} and again.settings["models"]["tiny-moe@bfloat16"]["records"] == 21


def test_the_host_s_large_buffer_term_starts_at_32_mib_whatever_the_dtype():
    from autotune.costing.costmodel import host_features

    # 2,048 rows of 4,096: 32 MiB in float32 (mapped anew each chunk), 16 MiB in bf16 (served from the heap)
    assert host_features(2048, 4096, 0, 4)[4] > 0 and host_features(2048, 4096, 0, 2)[4] == 0
    assert host_features(4096, 4096, 0, 2)[4] == 4096 * 4096 / 1e3
    bf16 = [{"kind": "exact_host", "backend": "host", "assignments": a, "hidden": 4096, "dtype": "bfloat16",
             "median_ms": 0.5 + 1e-6 * a * 4096 * (4.0 if a * 4096 * 2 >= 32 * 2**20 else 1.0)}
            for a in (256, 512, 1024, 2048, 4096, 8192)]
    cost = fit_cost_model(bf16 + synthetic_records("cpu-exact"))
    assert cost.host.dtype_bytes == 2 and type(cost.host).from_json(cost.host.to_json()) == cost.host
    for r in bf16:  # the law, learnt on bytes: exact on both sides of the threshold
        lanes = cost.exact_lanes([("cpu-exact", 0.0, r["assignments"], 0.0)], 4096)  # no FFN: the host's cost alone
        assert float(lanes.latency) == pytest.approx(
            r["median_ms"] + cost.call_ms("cpu-exact"), rel=0.02)
