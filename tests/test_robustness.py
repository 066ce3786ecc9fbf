"""Regret of the chosen plan under perturbed profiles: 0 when nothing is perturbed, equal to a brute-force
re-optimisation when something is, and `--robust` never worse in the worst case than the nominal plan."""
import dataclasses
import json

import numpy as np
import pytest
from helpers import SMALL, apple_like

from autotune.calibration.traces import synthetic_traces
from autotune.cli import main
from autotune.profiling.profile import Profile, save_profile
from autotune.searching import optimizer, robustness
from autotune.searching.layer_data import LayerData
from autotune.searching.optimizer import Candidates, best_plan, run_search, usable
from autotune.searching.robustness import Case, assess, default_cases, reassess, regrets, solve_cases
from autotune.searching.scoring import Scorer
from autotune.searching.space import layer_space


@pytest.fixture(scope="module")
def searched():
    traces = synthetic_traces(SMALL, 30, 512, skew=1.2, tokens=True)
    workloads = {c: LayerData.from_traces(traces, c, 512) for c in (256, 512)}
    scorer = Scorer(apple_like(), SMALL["hidden_size"], SMALL["expert_ffn_size"], "ane", 1e12)
    out = run_search(workloads, scorer, layer_space(8), trials=40, exact_limit=0, progress=False)
    return out.layers, scorer, out


def test_unperturbed_profile_has_zero_regret(searched):
    layers, scorer, out = searched
    cases = [Case("ane", "call_ms", 1.0), Case("cpu-exact", "ms_per_gflop", 1.0)]
    plan, rob = assess(out, scorer, cases=cases)
    assert plan is out.best and rob.max_regret == pytest.approx(0.0, abs=1e-12)
    for row in rob.cases:
        assert row["plan_latency_ms"] == pytest.approx(out.best.latency_ms / layers[0].calib.shape[0])


def test_regret_matches_a_brute_force_reoptimisation(searched):
    layers, scorer, out = searched
    cases = default_cases(scorer.cost)
    assert {c.name for c in cases} == {"ane call_ms x0.5", "ane call_ms x2", *(
        f"{b} ms_per_gflop x{f:g}" for b in ("ane", "cpu-exact", "cpu-static") for f in (0.7, 1.3))}
    _, rob = assess(out, scorer, cases=cases)
    tokens = sum(int(t) for t in layers[0].tokens)
    for case, row in zip(cases, rob.cases):
        # the perturbed device by hand, every candidate at every chunk size re-scored (no pruning), the exact DP
        m = scorer.cost.models[case.backend]
        cost = dataclasses.replace(scorer.cost, models={**scorer.cost.models, case.backend: dataclasses.replace(
            m, **{case.param: getattr(m, case.param) * case.factor})}, _lut={})
        sc = dataclasses.replace(scorer, cost=cost)
        sols = [best_plan(s, out.space, sc, out.drop_budget, out.weights, pool=[
            Candidates(p.rows, sc.score_rows(d, out.space, p.rows)) for d, p in zip(s.layers, s.pool)])
            for s in out.chunks.values()]
        best = min(sols, key=lambda s: s.latency_ms)
        plan = sum(sc.score(d, c).latency_ms for d, c in zip(layers, out.best.configs))
        per = out.best.chunk_tokens / tokens
        assert row["best_latency_ms"] == pytest.approx(best.latency_ms * per)
        assert row["regret"] == pytest.approx(plan / best.latency_ms - 1.0)
        assert row["regret"] >= -1e-12
    assert rob.max_regret == pytest.approx(max(r["regret"] for r in rob.cases))
    # the profile's figures matter to this plan: in some case another plan is better
    assert rob.max_regret > 0


def test_robust_pick_has_no_larger_worst_case_regret(searched):
    layers, scorer, out = searched
    _, nominal = assess(out, scorer)
    plan, robust = assess(out, scorer, pick=True)
    assert robust.robust and robust.candidates >= 1 + len(default_cases(scorer.cost))
    assert robust.max_regret <= nominal.max_regret + 1e-12
    assert plan.heldout_drops <= out.drop_budget
    # the pick is reported with its nominal (unperturbed) prediction, at its own chunk size
    at = out.chunks[plan.chunk_tokens].layers
    assert plan.latency_ms == pytest.approx(sum(scorer.score(d, c).latency_ms for d, c in zip(at, plan.configs)))
    each_case_optimum = solve_cases(out, scorer, default_cases(scorer.cost))
    assert all(r.best.heldout_drops <= out.drop_budget for r in each_case_optimum)


def least_worst_case_regret(out, results) -> float:
    """The least worst-case latency regret of any plan of the search's candidates, by brute force: every pair of the
    two layers' candidates (each chunk size, each overflow policy, within the drop budget), each case's cost
    re-scored without pruning, against each case's optimum in `results`."""
    best = np.array([r.best.latency_ms for r in results])
    least = np.inf
    for s in out.chunks.values():
        assert len(s.layers) == 2 and not s.layers[0].partial.any()
        scored = [[r.scorer.score_rows(d, out.space, p.rows) for d, p in zip(s.layers, s.pool)] for r in results]
        for policy in ("drop", "spill"):
            ok = [usable(out.space, p, policy) for p in s.pool]
            drops = s.pool[0].scores.heldout_drops[:, None] + s.pool[1].scores.heldout_drops[None, :]
            feasible = ok[0][:, None] & ok[1][None, :] & (drops <= out.drop_budget)
            worst = np.max([(sc[0].latency_ms[:, None] + sc[1].latency_ms[None, :]) / b - 1.0
                            for sc, b in zip(scored, best)], axis=0)
            least = min(least, float(np.min(np.where(feasible, worst, np.inf))))
    return least


def test_regret_floor_is_below_every_plans_worst_case_regret(searched):
    """The floor --robust reports against the brute force."""
    layers, scorer, out = searched
    cases = default_cases(scorer.cost)
    _, robust = assess(out, scorer, pick=True, cases=cases)
    least = least_worst_case_regret(out, solve_cases(out, scorer, cases))
    assert robust.regret_floor is not None and 0.0 < robust.regret_floor <= least + 1e-9
    assert least <= robust.max_regret + 1e-9


def test_regret_floor_where_the_drop_budget_is_coarsened(searched, monkeypatch):
    """A drop budget past what the DP solves exactly (its limit made small here, as a large model's held-out
    assignments pass it): the floor is still reported (was None), from the DP relaxed, and no plan beats it."""
    layers, scorer, out = searched
    limit = out.drop_budget // 7
    assert limit >= 1
    monkeypatch.setattr(optimizer, "DP_MAX_BUDGET", limit)
    monkeypatch.setattr(robustness, "DP_MAX_BUDGET", limit)
    cases = default_cases(scorer.cost)
    plan, robust = assess(out, scorer, pick=True, cases=cases)
    least = least_worst_case_regret(out, solve_cases(out, scorer, cases))
    assert robust.candidates > 1 and plan.heldout_drops <= out.drop_budget
    assert robust.regret_floor is not None and 0.0 < robust.regret_floor <= least + 1e-9
    assert robust.max_regret - robust.regret_floor <= 0.05


def test_the_gates_plan_keeps_the_robust_comparison(searched):
    """Where the fidelity gate passes over the robust pick, its plan is reported on the pick's analysis: the same
    candidates compared and floor (was: 1 candidate, no floor), its own regrets."""
    layers, scorer, out = searched
    pick, robust = assess(out, scorer, pick=True)
    other = next(r.best for r in robust.results if r.best.configs != pick.configs)
    again = reassess(out, robust, other)
    assert again.robust and again.candidates == robust.candidates > 1
    assert again.regret_floor == robust.regret_floor is not None
    regs = regrets(other, out, robust.results)
    assert [c["regret"] for c in again.cases] == pytest.approx(regs)
    assert again.max_regret == pytest.approx(max(regs)) and again.max_regret >= robust.regret_floor - 1e-9
    assert again.nominal_max_regret == robust.nominal_max_regret


@pytest.mark.slow
def test_search_json_reports_robustness(workdir, capsys):
    assert main(["search", "--model", "random:qwen3_moe", "--profile", str(workdir / "profile.json"), "--traces",
                 str(workdir / "traces.npz"), "--trials", "20", "--robust", "--out", str(workdir / "r.json"),
                 "--no-gate", "--json"]) == 0
    rob = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["robustness"]
    assert rob["robust_pick"] and len(rob["cases"]) == 8
    assert rob["max_regret"] == pytest.approx(max(c["regret"] for c in rob["cases"]))


def test_gate_passing_over_the_robust_pick_keeps_its_comparison(tmp_path, monkeypatch):
    """`search --robust` where the fidelity gate refuses the pick and keeps the next candidate (the gate faked here:
    it passes the second candidate): the report still says how many plans the pick compared and its floor (was 1
    and null: the gate's plan was assessed afresh, without the comparison), and the gate's plan's regret."""
    from autotune import pipeline
    from autotune.calibration.traces import save_traces
    from autotune.searching.config import SearchConfig
    from runtime.loading.model_record import resolve_model

    spec = resolve_model("random:qwen3_moe").spec.to_json()
    save_traces(synthetic_traces(spec, 30, 256, skew=1.2, tokens=True), tmp_path / "t.npz")
    save_profile(Profile(host={"id": "test-device", "description": "hand-made ANE-like device"},
                         cost_model=apple_like(), records=[], heldout={"method": "none", "mape": {}},
                         measured_by="hand-made for tests"), tmp_path / "profile.json")

    def second_passes(model, candidates, settings, **kw) -> dict:
        rows = [{"index": i, "candidate": i, "passed": i == 1, "kernel_rows": None, "predicted_ms": c.predicted_ms,
                 "ppl_delta": 0.0, "top1": 1.0, "kl": 0.0} for i, c in zip(range(2), candidates)]
        return {"label": "faked", "tokens": 256, "text": "none", "candidates": rows, "chosen": rows[1], "rounds": 1}

    monkeypatch.setattr(pipeline, "run_gate", second_passes)
    config = SearchConfig(profile=str(tmp_path / "profile.json"), traces=tmp_path / "t.npz", out=tmp_path / "p.json",
                          trials=20, robust=True, prompt_tokens=256)
    rob = pipeline.search_plan("random:qwen3_moe", config, progress=False).to_json()["robustness"]
    assert rob["robust_pick"] and rob["candidates_compared"] > 1
    assert rob["regret_floor"] is not None and rob["max_regret"] >= rob["regret_floor"] - 1e-9
    assert rob["max_regret"] == pytest.approx(max(c["regret"] for c in rob["cases"]))
