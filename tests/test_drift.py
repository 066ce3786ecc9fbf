"""The drift monitor: its alert logic on controlled loads, and the loop on the real model: record the routing a run
saw on shifted text, re-tune on it, and the re-tuned plan holds (no alert) on fresh text of that kind."""
import json
import logging
import random
from functools import partial

import numpy as np
import pytest
from helpers import random_model

from autotune import pipeline
from autotune.calibration.traces import HELDOUT_EVERY, load_traces
from autotune.cli import main
from autotune.searching.decisions import window_spread
from autotune.searching.optimizer import timed_search
from autotune.searching.templates import template_plan
from runtime.drift import RATE_FACTOR, TV_THRESHOLD, WINDOW_CHUNKS, DriftMonitor
from runtime.loading.model_loader import TINY_MOE_DIR, model_spec
from runtime.plan import LayerPlan, load_plan, plan_from_json

N_EXPERTS, WINDOW, CHUNK_ASSIGNMENTS, EXPECTED = 8, 4, 800, 0.04


@pytest.fixture(scope="module")
def plan():
    model, _ = random_model("random:olmoe")
    obj = template_plan(model_spec(model), "tight", "drop", chunk_tokens=400).to_json()
    cal = {"load_shares": [1 / N_EXPERTS] * N_EXPERTS, "heldout_overflow_rate": EXPECTED}
    obj["layers"] = [{**lp, "calibration": cal} for lp in obj["layers"]]
    return plan_from_json(obj)


def _feed(monitor: DriftMonitor, chunks: int, loads: np.ndarray, overflow_rate: float) -> None:
    for _ in range(chunks):
        for layer in monitor.layers:
            monitor.observe(layer, loads, round(overflow_rate * loads.sum()))


UNIFORM = np.full(N_EXPERTS, CHUNK_ASSIGNMENTS // N_EXPERTS)


def test_in_domain_window_stays_quiet_and_short_runs_are_not_judged(plan):
    monitor = DriftMonitor(plan, window=WINDOW)
    _feed(monitor, WINDOW - 1, UNIFORM, EXPECTED)
    r = monitor.report()
    assert not r["alert"] and r["reason"].startswith("not judged: 3 of")
    _feed(monitor, 10, UNIFORM, RATE_FACTOR * EXPECTED * 0.95)  # within 1.5x: still in budget
    r = monitor.report()
    assert not r["alert"] and r["reason"] is None
    assert r["rate"] == pytest.approx(RATE_FACTOR * EXPECTED * 0.95, rel=0.01) and r["tv_max"] == 0.0
    assert r["rate_limit"] == pytest.approx(RATE_FACTOR * EXPECTED)


def test_drop_rate_past_1_5x_alerts_once(plan, caplog):
    monitor = DriftMonitor(plan, window=WINDOW)
    _feed(monitor, WINDOW, UNIFORM, EXPECTED)
    with caplog.at_level(logging.WARNING, logger="npumoe.drift"):
        _feed(monitor, 1, UNIFORM, 4 * EXPECTED)  # the window: (3 x 4% + 16%) / 4 = 7% > 6%
        _feed(monitor, 20, UNIFORM, 4 * EXPECTED)
    r = monitor.report()
    assert r["alert"] and "drop rate 7.00%" in r["reason"] and "1.5x" in r["reason"]
    assert len(caplog.records) == 1 and "\n" not in caplog.records[0].getMessage()
    assert r["layers"]["0"]["drop_rate"] == pytest.approx(4 * EXPECTED, rel=0.01)


def test_load_shift_alerts_on_distance(plan):
    monitor = DriftMonitor(plan, window=WINDOW)
    shifted = UNIFORM.copy()
    shifted[0] += 2 * CHUNK_ASSIGNMENTS // N_EXPERTS  # expert 0 takes 3/10 of the load instead of 1/8
    shifted[1] -= CHUNK_ASSIGNMENTS // N_EXPERTS
    shifted[2] -= CHUNK_ASSIGNMENTS // N_EXPERTS
    _feed(monitor, WINDOW, shifted, 0.0)
    r = monitor.report()
    tv = 0.5 * np.abs(shifted / shifted.sum() - 1 / N_EXPERTS).sum()
    assert tv > TV_THRESHOLD and r["tv_max"] == pytest.approx(tv)
    assert r["alert"] and "TV" in r["reason"] and r["rate"] == 0.0


def _plan_with_spread(expected: float, sd: float | None):
    model, _ = random_model("random:olmoe")
    obj = template_plan(model_spec(model), "tight", "drop", chunk_tokens=400).to_json()
    cal = {"load_shares": [1 / N_EXPERTS] * N_EXPERTS, "heldout_overflow_rate": expected}
    if sd is not None:
        cal["heldout_window_spread"] = {"window_chunks": WINDOW_CHUNKS, "windows": 17, "mean": expected, "sd": sd}
    obj["layers"] = [{**lp, "calibration": cal} for lp in obj["layers"]]
    return plan_from_json(obj)


def test_rate_alert_is_judged_against_the_plans_own_window_spread():
    """Last round's false alarm: in-domain windows at 2.94% against 1.5 x 1.87% = 2.80% while the run matched the
    expected 1.87%. Judged against the spread of the plan's own held-out windows (sd 0.45%: limit 3.22%) it is
    quiet; a shifted text's windows at 4% still alert."""
    expected, in_domain, shifted = 0.0187, 0.0294, 0.04
    assert in_domain > RATE_FACTOR * expected  # what the rate rule alone alarmed on
    old = DriftMonitor(_plan_with_spread(expected, None))
    _feed(old, WINDOW_CHUNKS, UNIFORM, in_domain)
    assert old.report()["alert"]
    spread = _plan_with_spread(expected, 0.0045)
    quiet = DriftMonitor(spread)
    _feed(quiet, 3 * WINDOW_CHUNKS, UNIFORM, in_domain)
    r = quiet.report()
    assert not r["alert"] and r["reason"] is None and r["rate"] == pytest.approx(in_domain, abs=1 / 800)
    assert r["rate_limit"] == pytest.approx(expected + 3 * 0.0045) and r["window_spread"]["sd"] == 0.0045
    loud = DriftMonitor(spread)
    _feed(loud, WINDOW_CHUNKS, UNIFORM, shifted)
    r = loud.report()
    assert r["alert"] and "4.00%" in r["reason"] and "3 sd" in r["reason"]
    tiny = DriftMonitor(_plan_with_spread(expected, 0.0))  # no spread measured: never tighter than 1.5x
    assert tiny.report()["rate_limit"] == pytest.approx(RATE_FACTOR * expected)


def test_window_spread_is_the_rate_over_every_full_window():
    lp = LayerPlan(layer=0, groups=[{"backend": "cpu-static", "experts": [0, 1], "capacities": [10, 10]}],
                   cpu_exact=[2])
    rng = np.random.default_rng(0)
    loads = rng.integers(0, 20, size=(20, 3))
    got = window_spread(lp, loads, window=16)
    over = np.maximum(loads[:, :2] - 10, 0).sum(1)
    rates = [over[s:s + 16].sum() / loads[s:s + 16].sum() for s in range(5)]
    assert got.windows == 5 and got.mean == pytest.approx(np.mean(rates)) and got.sd == pytest.approx(np.std(rates))
    assert window_spread(lp, loads[:15], window=16) is None


def test_plan_without_calibration_reports_rates_only():
    model, _ = random_model("random:olmoe")
    monitor = DriftMonitor(template_plan(model_spec(model), "tight", "spill"), window=WINDOW)
    _feed(monitor, WINDOW, UNIFORM, 0.5)
    r = monitor.report()
    assert not r["calibrated"] and not r["alert"] and "no calibration" in r["reason"]
    assert r["layers"]["0"]["spill_rate"] == 0.5 and "tv" not in r["layers"]["0"]


def _csv(seed: int, rows: int) -> str:
    rng = random.Random(seed)
    return "id,date,temperature,humidity,price\n" + "".join(
        f"{rng.randint(10000, 99999)},2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d},"
        f"{rng.uniform(-20, 40):.2f},{rng.uniform(0, 100):.1f},{rng.uniform(0, 1000):.2f}\n" for _ in range(rows))


def _run_json(capsys, *args) -> dict:
    assert main(["run", "--model", "tiny-moe", "--max-tokens", "1024", "--prompt-tokens", "512", "--json",
                 *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.skipif(not (TINY_MOE_DIR / "config.json").exists(), reason="tiny-moe asset missing")
def test_retune_on_recorded_traces_holds_on_fresh_text_of_that_kind(tmp_path, capsys, monkeypatch):
    """A CSV-tuned plan: recorded from one set of records, quiet on other records, alerting on prose."""
    # the search's exact yardstick (~30K decisions per layer) is not what this test checks, and costs ~20 s a layer
    monkeypatch.setattr(pipeline, "timed_search", partial(timed_search, exact_limit=0))
    seen, fresh = tmp_path / "csv-a.txt", tmp_path / "csv-b.txt"
    seen.write_text(_csv(1, 500))
    fresh.write_text(_csv(2, 500))
    base, traces, tuned = tmp_path / "base.json", tmp_path / "csv.npz", tmp_path / "tuned.json"
    # ample: nothing drops, so the recorded routing is the model's own (heavy drops would change later layers' routing)
    assert main(["plan-template", "--model", "tiny-moe", "--capacity", "ample", "--chunk", "64",
                 "--out", str(base)]) == 0
    r = _run_json(capsys, "--plan", str(base), "--text", str(seen), "--record-traces", str(traces))
    assert r["traces"]["chunks"] == 16 and r["drift"]["calibrated"] is False
    t = load_traces(traces)
    assert t.n_chunks == 16 and t.heldout_chunks.tolist() == [c % HELDOUT_EVERY == HELDOUT_EVERY - 1
                                                               for c in range(16)]
    assert int(t.counts(0, "all").sum()) == r["assignments"] // 4  # four MoE layers, each sees every token
    # a plan for 64-token prompts keeps the 64-token chunk, so the fresh text fills the monitor's 16-chunk window
    assert main(["search", "--model", "tiny-moe", "--profile", "apple-m2-ultra-published", "--traces", str(traces),
                 "--trials", "8", "--prompt-tokens", "64", "--out", str(tuned), "--no-gate", "--json"]) == 0
    capsys.readouterr()
    assert load_plan(tuned).calibrated
    held = _run_json(capsys, "--plan", str(tuned), "--text", str(fresh))["drift"]
    assert held["chunks_in_window"] == 16 and not held["alert"], held
    assert held["rate"] <= 0.10 and held["tv_max"] < TV_THRESHOLD
    prose = _run_json(capsys, "--plan", str(tuned), "--text", "builtin:pydoc-heldout")["drift"]
    assert prose["alert"] and prose["tv_max"] > TV_THRESHOLD


@pytest.mark.skipif(not (TINY_MOE_DIR / "config.json").exists(), reason="tiny-moe asset missing")
def test_generate_reports_drift_and_records_the_prompt(tmp_path, capsys):
    prompt, plan, traces = tmp_path / "csv.txt", tmp_path / "plan.json", tmp_path / "prompt.npz"
    prompt.write_text(_csv(3, 60))
    assert main(["plan-template", "--model", "tiny-moe", "--capacity", "tight", "--chunk", "64",
                 "--out", str(plan)]) == 0
    assert main(["generate", "--model", "tiny-moe", "--plan", str(plan), "--prompt-file", str(prompt),
                 "--max-tokens", "2", "--record-traces", str(traces), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    chunks = -(-r["prompt_tokens"] // 64)
    assert r["drift"]["chunks_seen"] == chunks and r["drift"]["rate"] > 0  # a tight plan drops on its prefill
    assert r["traces"]["chunks"] == chunks and load_traces(traces).header["tokens"] == r["prompt_tokens"]
