"""`autotune search --measure K` (autotune/measuring/measure.py): the candidates timed on this host, the measured best
within the fidelity limits written; and what was measured fed back into the profile (measuring/feedback.py)."""
import json

import pytest
from helpers import apple_like

from autotune.cli import main
from autotune.costing.whole_prefill import PrefillPrediction
from autotune.measuring.feedback import KEY, add_records, part_factors
from autotune.profiling.profile import Profile, load_profile, save_profile
from autotune.searching.objective import corrected
from runtime.plan import load_plan


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A search with `--measure 2` on a random model: a hand-made ANE-like profile, a short calibration (two
    held-out 256-token prompts), the gate on 256 tokens."""
    d = tmp_path_factory.mktemp("measure")
    save_profile(Profile(host={"id": "test-device", "description": "hand-made ANE-like device"},
                         cost_model=apple_like(), records=[], heldout={"method": "none", "mape": {}},
                         measured_by="hand-made for tests"), d / "profile.json")
    (d / "text.txt").write_text("Routing skews toward a few experts; the rest idle. " * 60)
    assert main(["calibrate", "--model", "random:qwen3_moe", "--text", str(d / "text.txt"), "--chunk", "64",
                 "--prompt-tokens", "256", "--out", str(d / "traces.npz"), "--json"]) == 0
    assert main(["search", "--model", "random:qwen3_moe", "--profile", str(d / "profile.json"), "--traces",
                 str(d / "traces.npz"), "--measure", "2", "--trials", "4", "--gate-tokens", "256", "--out",
                 str(d / "plan.json"), "--json"]) == 0
    return d


def test_measure_times_the_candidates_and_writes_the_measured_best(measured):
    m = json.loads((measured / "plan.report.json").read_text())["measure"]
    rows = m["candidates"]
    assert len(rows) >= 2 and all({"predicted_ms", "measured_ms", "passed"} <= set(r) for r in rows)
    assert rows[0]["name"] == m["predicted_pick"]  # the search's pick first
    for r in rows:
        assert r["predicted_ms"] > 0 and r["passed"] in (True, False)
        if r["simulated"]:  # a lane this host only simulates: measured for fidelity, not speed
            assert r["measured_ms"] is None and "not speed" in r["note"]
        else:
            assert r["measured_ms"] > 0
    timed = [r for r in rows if r["measured_ms"] is not None and r["passed"]]
    chosen = next(r for r in rows if r["name"] == m["chosen"])
    assert chosen["measured_ms"] == min(r["measured_ms"] for r in timed) and m["measured_regret"] == 0.0
    assert m["predicted_pick_regret"] == pytest.approx(rows[0]["measured_ms"] / chosen["measured_ms"] - 1.0)
    assert m["kendall_tau"] is None or -1.0 <= m["kendall_tau"] <= 1.0
    plan = load_plan(measured / "plan.json")
    assert plan.chunk_tokens == chosen["chunk_tokens"]
    # the hand-made profile is no measurement of this host: its runs are not kept in it
    assert KEY not in load_profile(measured / "profile.json", check_host=False).extra


def prediction(parts: dict) -> PrefillPrediction:
    total = sum(parts.values())
    return PrefillPrediction(4096, 1024, total, total, None, dict(parts))


def test_fed_back_records_correct_the_prediction(tmp_path):
    """Whole plans measured at twice their predicted experts and as priced otherwise: the part factors fitted to
    the records give the next prediction of each within 2% of what was measured (the issue asks 10%), and a plan
    not among them is corrected the same way."""
    prof = Profile(host={"id": "here", "description": "test"}, cost_model=apple_like(), records=[],
                   heldout={"method": "none", "mape": {}}, measured_by="test", path=str(tmp_path / "p.json"))
    plans = [{"experts": e, "attention_core": a, "rest": 1.0} for e, a in ((10.0, 5.0), (30.0, 5.0), (20.0, 15.0))]
    truth = lambda p: 2.0 * p["experts"] + p["attention_core"] + p["rest"]  # noqa: E731
    assert part_factors(prof, "m", "float32") == {}
    add_records(prof, "m", "float32", 4096, [{"chunk_tokens": 1024, "predicted_parts_ms": p,
                                              "measured_ms": truth(p)} for p in plans])
    assert len(load_profile(tmp_path / "p.json", check_host=False).extra[KEY]) == 3  # kept in the profile file
    factors = part_factors(prof, "m", "float32")
    assert factors["experts"] == pytest.approx(2.0, rel=0.02)
    assert part_factors(prof, "another model", "float32") == {}
    assert part_factors(prof, "m", "bfloat16") == {}  # no run in bf16: priced as before
    for p in [*plans, {"experts": 50.0, "attention_core": 2.0, "rest": 1.0}]:
        before, after = prediction(p), corrected(prediction(p), factors)
        assert after.latency_ms == pytest.approx(truth(p), rel=0.02)
        assert abs(before.latency_ms / truth(p) - 1.0) > 0.25  # the records changed the prediction


def test_each_dtype_is_corrected_by_its_own_runs_only(tmp_path):
    """Runs of one model in two dtypes, experts measured at 2x their price in bf16 and 0.5x in float32 (emulated
    bf16 against native float32): each dtype's next prediction within 2% of what its own runs measured, none pulled
    towards the other's; a record kept before runs carried a dtype counts as float32, the profile's own default."""
    prof = Profile(host={"id": "here", "description": "test"}, cost_model=apple_like(), records=[],
                   heldout={"method": "none", "mape": {}}, measured_by="test")
    plans = [{"experts": e, "attention_core": a, "rest": 1.0} for e, a in ((10.0, 5.0), (30.0, 5.0), (20.0, 15.0))]
    truth = {"bfloat16": lambda p: 2.0 * p["experts"] + p["attention_core"] + p["rest"],
             "float32": lambda p: 0.5 * p["experts"] + p["attention_core"] + p["rest"]}
    for dtype, measured in truth.items():
        add_records(prof, "m", dtype, 4096, [{"chunk_tokens": 1024, "predicted_parts_ms": p,
                                              "measured_ms": measured(p)} for p in plans])
    for dtype, measured in truth.items():
        factors = part_factors(prof, "m", dtype)
        for p in [*plans, {"experts": 50.0, "attention_core": 2.0, "rest": 1.0}]:
            assert corrected(prediction(p), factors).latency_ms == pytest.approx(measured(p), rel=0.02)
    legacy = [{k: v for k, v in r.items() if k != "dtype"} for r in prof.extra[KEY] if r["dtype"] == "float32"]
    prof.extra[KEY] = legacy
    assert part_factors(prof, "m", "float32")["experts"] == pytest.approx(0.5, rel=0.02)
    assert part_factors(prof, "m", "bfloat16") == {}


def test_a_search_without_traces_calibrates_prompts_of_its_length(tmp_path, monkeypatch, capsys):
    """`search --prompt-tokens 4096` with no traces records 4,096-token prompts (not the calibration's default
    1,024), ten of them, so that --measure times two held-out prompts of the plan's length; the built-in
    calibration text holds that many tokens."""
    import autotune.pipeline as pipeline
    from autotune.calibration.workload import encode_text
    from runtime.errors import NpumoeError
    from runtime.loading.model_loader import load_model

    asked = {}

    def calibrate(record, text, **options):
        asked.update(options, text=text)
        raise NpumoeError("calibrated")

    monkeypatch.setattr(pipeline, "calibrate", calibrate)
    monkeypatch.chdir(tmp_path)
    assert main(["search", "--model", "tiny-moe", "--profile", "apple-m2-ultra-published", "--prompt-tokens",
                 "4096", "--trials", "2"]) == 2
    assert "calibrated" in capsys.readouterr().err
    assert (asked["prompt_tokens"], asked["max_tokens"], asked["chunk"]) == (4096, 40960, 256)
    _, tokenizer = load_model("tiny-moe")
    assert encode_text(tokenizer, asked["text"], 40960).numel() == 40960
