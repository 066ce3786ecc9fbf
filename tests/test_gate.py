"""The fidelity gate of `autotune search`: the cheapest whole plans, measured against the unmodified model; a plan
that meets the proxy but fails the gate is not written."""
import json

import pytest

from autotune.cli import main
from autotune.costing.costmodel import BackendModel, CostModel
from autotune.profiling.profile import Profile, save_profile
from runtime.plan import load_plan


def _search(d, out, *extra, profile="profile.json"):
    return ["search", "--model", "random:qwen3_moe", "--profile", str(d / profile), "--traces",
            str(d / "traces.npz"), "--trials", "16", "--out", str(out), "--gate-tokens", "512", "--json", *extra]


def _slow_cpu_profile(path):
    """A device whose CPU is 100x slower than its ANE: every search picks ane groups."""
    cost = CostModel({"ane": BackendModel("ane", 0.001, 0.0, 0.3, 0.0, 2, True, None),
                      "cpu-exact": BackendModel("cpu-exact", 0.5, 0.5, 60.0, 0.0, 2, False, None),
                      "cpu-static": BackendModel("cpu-static", 0.5, 0.5, 60.0, 0.0, 2, False, None)})
    save_profile(Profile(host={"id": "slow-cpu", "description": "hand-made: ANE far faster than the CPU"},
                         cost_model=cost, records=[], heldout={"method": "none", "mape": {}},
                         measured_by="hand-made for tests"), path)


@pytest.mark.slow
def test_gate_reports_measured_candidates_and_writes_the_cheapest_passing(workdir, capsys):
    _slow_cpu_profile(workdir / "slow-cpu.json")  # ane groups in every candidate, compressed ones among them
    out = workdir / "gated.json"
    assert main(_search(workdir, out, "--max-ppl-delta", "100", "--min-top1", "0", profile="slow-cpu.json")) == 0
    gate = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["gate"]
    assert gate["label"].startswith("measured") and gate["tokens"] == 512
    rows = gate["candidates"]
    assert 1 < len(rows) <= 4 and gate["chosen"]["index"] == 0 and gate["chosen"]["passed"]
    assert any(r["static_groups"].get("ane") for r in rows)
    for r in rows:
        assert 0.0 <= r["top1"] <= 1.0 and r["kl"] >= 0.0 and isinstance(r["passed"], bool)
        if r["static_groups"].get("ane"):  # its ane groups ran on ane-sim
            assert r["calls_per_backend"].get("ane-sim", 0) > 0 and r["kl"] > 0.0
        if not r["static_groups"]:  # an all-CPU candidate computes what the model computes
            assert r["ppl_delta"] == 0.0 and r["top1"] == 1.0 and r["kl"] == pytest.approx(0.0, abs=1e-9)
    plan = load_plan(out)
    assert plan.meta["gate"]["top1"] == gate["chosen"]["top1"]


@pytest.mark.slow
def test_a_plan_that_meets_the_proxy_but_fails_the_gate_is_not_written(workdir, capsys):
    _slow_cpu_profile(workdir / "slow-cpu.json")
    light = workdir / "light.json"
    assert main(_search(workdir, light, "--no-gate", profile="slow-cpu.json")) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["gate"] is None and report["heldout_drop_rate"] <= 0.10  # the proxy holds
    assert any(g.backend == "ane" for lp in load_plan(light).layers for g in lp.groups)
    gated = workdir / "strict.json"
    # One candidate, the search's pick (ane groups in fp16 on ane-sim), against limits no fp16 plan meets.
    assert main(_search(workdir, gated, "--gate-candidates", "1", "--max-ppl-delta", "0", "--min-top1", "1",
                        profile="slow-cpu.json")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no candidate passes the fidelity gate" in err[0] and "candidate 0" in err[0]
    assert "top-1" in err[0] and "no plan written" in err[0]
    assert not gated.exists() and not (workdir / "strict.report.json").exists()


@pytest.mark.slow
def test_a_gate_shorter_than_one_chunk_is_refused_not_passed(workdir, capsys):
    """Under one chunk of text every candidate runs exactly (a partial chunk), so it would pass as the unmodified
    model: the gate says so in one line instead."""
    _slow_cpu_profile(workdir / "slow-cpu.json")
    out = workdir / "short.json"
    args = _search(workdir, out, profile="slow-cpu.json")
    args[args.index("--gate-tokens") + 1] = "100"
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "less than one chunk" in err[0] and "--gate-tokens" in err[0]
    assert not out.exists()
