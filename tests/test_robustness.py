"""Regret of the chosen plan under perturbed profiles: 0 when nothing is perturbed, equal to a brute-force
re-optimisation when something is, and `--robust` never worse in the worst case than the nominal plan."""
import dataclasses
import json

import pytest
from helpers import SMALL, apple_like

from autotune.calibration.traces import synthetic_traces
from autotune.cli import main
from autotune.searching.optimizer import _best_over_overflow, run_search
from autotune.searching.robustness import Case, assess, default_cases, solve_cases
from autotune.searching.space import LayerData, Scorer


@pytest.fixture(scope="module")
def searched():
    layers = LayerData.from_traces(synthetic_traces(SMALL, 30, 256, skew=1.2))
    scorer = Scorer(apple_like(), SMALL["hidden_size"], SMALL["expert_ffn_size"], "ane", 1e12)
    out = run_search(layers, scorer, trials=40, chunk_tokens=256, exact_limit=0, progress=False)
    return layers, scorer, out


def test_unperturbed_profile_has_zero_regret(searched):
    layers, scorer, out = searched
    cases = [Case("ane", "call_ms", 1.0), Case("cpu-exact", "ms_per_gflop", 1.0)]
    plan, rob = assess(out, layers, scorer, layers[0].calib.shape[0], cases=cases)
    assert plan is out.best and rob.max_regret == pytest.approx(0.0, abs=1e-12)
    for row in rob.cases:
        assert row["plan_latency_ms"] == pytest.approx(out.best.latency_ms / layers[0].calib.shape[0])


def test_regret_matches_a_brute_force_reoptimisation(searched):
    layers, scorer, out = searched
    chunks = layers[0].calib.shape[0]
    cases = default_cases(scorer.cost)
    assert {c.name for c in cases} == {"ane call_ms x0.5", "ane call_ms x2", *(
        f"{b} ms_per_gflop x{f:g}" for b in ("ane", "cpu-exact", "cpu-static") for f in (0.7, 1.3))}
    _, rob = assess(out, layers, scorer, chunks, cases=cases)
    for case, row in zip(cases, rob.cases):
        # the perturbed device by hand, every candidate re-scored (no pruning), the search's exact DP
        m = scorer.cost.models[case.backend]
        cost = dataclasses.replace(scorer.cost, models={**scorer.cost.models, case.backend: dataclasses.replace(
            m, **{case.param: getattr(m, case.param) * case.factor})}, _lut={})
        sc = dataclasses.replace(scorer, cost=cost)
        pool = [[dataclasses.replace(e, score=sc.score(d, e.config)) for e in evs] for d, evs in zip(layers, out.pool)]
        best = _best_over_overflow(pool, layers, sc, out.drop_budget, (1.0, 0.0))
        plan = sum(sc.score(d, c).latency_ms for d, c in zip(layers, out.best.configs))
        assert row["best_latency_ms"] == pytest.approx(best.latency_ms / chunks)
        assert row["regret"] == pytest.approx(plan / best.latency_ms - 1.0)
        assert row["regret"] >= -1e-12
    assert rob.max_regret == pytest.approx(max(r["regret"] for r in rob.cases))
    # the ANE's call cost matters to this plan: doubling it leaves the nominal plan behind
    assert rob.cases[1]["regret"] > 0


def test_robust_pick_has_no_larger_worst_case_regret(searched):
    layers, scorer, out = searched
    chunks = layers[0].calib.shape[0]
    _, nominal = assess(out, layers, scorer, chunks)
    plan, robust = assess(out, layers, scorer, chunks, pick=True)
    assert robust.robust and robust.candidates >= 1 + len(default_cases(scorer.cost))
    assert robust.max_regret <= nominal.max_regret + 1e-12
    assert plan.heldout_drops <= out.drop_budget
    # the pick is reported with its nominal (unperturbed) prediction
    assert plan.latency_ms == pytest.approx(sum(scorer.score(d, c).latency_ms for d, c in zip(layers, plan.configs)))
    each_case_optimum = solve_cases(out.pool, layers, scorer, out.drop_budget, default_cases(scorer.cost))
    assert all(r.best.heldout_drops <= out.drop_budget for r in each_case_optimum)


@pytest.mark.slow
def test_search_json_reports_robustness(workdir, capsys):
    assert main(["search", "--model", "random:qwen3_moe", "--profile", str(workdir / "profile.json"), "--traces",
                 str(workdir / "traces.npz"), "--trials", "20", "--robust", "--out", str(workdir / "r.json"),
                 "--json"]) == 0
    rob = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["robustness"]
    assert rob["robust_pick"] and len(rob["cases"]) == 8
    assert rob["max_regret"] == pytest.approx(max(c["regret"] for c in rob["cases"]))
