"""The design card's own flow, on this host's backends: `profile-device --quick` (its shape set reduced to one small
size, as TINY_PROFILE does), then `search --model tiny-moe` on that profile, which measures tiny-moe's own records
into it, fits them and writes a plan. At tiny shapes a fit may put its compute rate at 0 (issue #54: the roofline
divided by it)."""
import json

from helpers import small_profiling

from autotune.cli import main
from autotune.profiling.profile import load_profile


def test_profile_this_host_then_search_writes_a_plan(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the search reads tiny-moe's traces from ./traces, as a new user's does
    small_profiling(monkeypatch)
    host, plan = tmp_path / "host.json", tmp_path / "plan.json"
    assert main(["profile-device", "--quick", "--threads", "1", "--backends", "cpu-exact,cpu-static",
                 "--out", str(host), "--no-progress"]) == 0
    assert main(["calibrate", "--model", "tiny-moe", "--prompt-tokens", "256", "--max-tokens", "2048"]) == 0
    before = len(load_profile(host).records)
    assert main(["search", "--model", "tiny-moe", "--profile", str(host), "--trials", "5", "--no-gate",
                 "--measure", "0", "--threads", "1", "--out", str(plan)]) == 0  # tests/test_measure.py measures
    after = load_profile(host)
    assert len(after.records) > before and any(key.startswith("tiny-moe") for key in after.settings["models"])
    report = json.loads(plan.with_suffix(".report.json").read_text())
    assert json.loads(plan.read_text())["model"]["num_experts"] == 16
    assert report["predicted_prefill_ms"] > 0 and report["profile"] == str(host)
