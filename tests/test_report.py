"""The search report: per-chunk figures, speedups against each baseline, the printed table, the plots."""
from pathlib import Path

import pytest
from helpers import random_model

from autotune.searching.optimizer import SearchOutcome, Solution, solution
from autotune.searching.report import (
    format_report,
    plot_pareto,
    plot_plan_map,
    search_report,
    sidecar,
    solution_summary,
)
from autotune.searching.space import LayerConfig
from runtime.plan import Group, LayerPlan, Plan


def _outcome() -> SearchOutcome:
    best = Solution([LayerConfig(2)], latency_ms=40.0, energy_mj=8.0, heldout_drops=5)
    cpu = Solution([LayerConfig(0)], latency_ms=100.0, energy_mj=None, heldout_drops=0)
    heur = Solution([LayerConfig(4)], latency_ms=60.0, energy_mj=20.0, heldout_drops=50)
    return SearchOutcome(best, {"cpu_only": cpu, "paper_heuristic": heur}, front=[best, heur], gap_vs_exact=0.004,
                         trials=30, exact_layers=1)


def test_solution_summary_is_per_chunk_with_the_heldout_drop_rate():
    s = solution_summary(Solution([], 40.0, None, 5), calib_chunks=4, heldout_assignments=100)
    assert s == {"predicted_latency_ms": 10.0, "predicted_energy_mj": None, "heldout_drop_rate": 0.05}
    assert solution_summary(Solution([], 0.0, 2.0, 0), 4, 0)["heldout_drop_rate"] == 0.0


def test_cpu_ms_per_token_for_the_plan_and_each_baseline():
    from helpers import SMALL, apple_like

    from autotune.calibration.traces import synthetic_traces
    from autotune.searching.layer_data import LayerData
    from autotune.searching.report import add_cpu_figures
    from autotune.searching.scoring import Scorer

    layers = LayerData.from_traces(synthetic_traces(SMALL, 10, 64, skew=1.2))
    scorer = Scorer(apple_like(), SMALL["hidden_size"], SMALL["expert_ffn_size"], "ane", 1e12)
    out = _outcome()
    out.best = solution([LayerConfig(2, 2) for _ in layers], layers, scorer)  # 2 experts per layer on the ANE
    out.baselines["cpu_only"] = solution([LayerConfig(0) for _ in layers], layers, scorer)
    out.baselines["paper_heuristic"] = solution([LayerConfig(4, 4) for _ in layers], layers, scorer)
    r = search_report(out, calib_chunks=4, heldout_assignments=100, seconds=1.5, context={})
    add_cpu_figures(r, out, layers, packing_measured=False)
    all_cpu = sum(float(scorer.cost.exact_ms(d.calib, SMALL["hidden_size"], SMALL["expert_ffn_size"]).sum())
                  for d in layers) / int(layers[0].tokens.sum())  # the 8 calibration chunks of 64
    assert r["baseline_details"]["cpu_only"]["predicted_cpu_ms_per_token"] == pytest.approx(all_cpu)
    assert r["predicted_cpu_ms_per_token"] < all_cpu  # resident experts take work off the CPU
    assert r["cpu_ratio_vs"]["cpu_only"] == pytest.approx(all_cpu / r["predicted_cpu_ms_per_token"])
    table = format_report(r)
    assert "CPU ms/token" in table and f"{all_cpu:.4f}" in table
    assert r["packing_measured"] is False and "measured no host packing" in table


def test_report_has_speedups_against_each_baseline_and_the_context():
    r = search_report(_outcome(), calib_chunks=4, heldout_assignments=100, seconds=1.5, context={"profile": "p"})
    assert r["predicted_latency_ms"] == 10.0 and r["predicted_energy_mj"] == 2.0
    assert r["baselines"] == {"cpu_only": 25.0, "paper_heuristic": 15.0}
    assert r["speedup_vs"] == {"cpu_only": pytest.approx(2.5), "paper_heuristic": pytest.approx(1.5)}
    assert r["baseline_details"]["paper_heuristic"]["heldout_drop_rate"] == 0.5
    assert [p["predicted_latency_ms"] for p in r["pareto_front"]] == [10.0, 15.0]
    assert (r["trials"], r["exact_layers"], r["gap_vs_exact"], r["profile"]) == (30, 1, 0.004, "p")
    assert "predicted" in r["figures"]


def test_format_report_labels_baselines_and_says_predicted():
    r = search_report(_outcome(), 4, 100, 1.0, {"profile": "apple", "chunk_tokens": 256})
    lines = format_report(r).splitlines()
    assert lines[1].split()[:2] == ["tuned", "plan"] and "10.0000" in lines[1] and "5.00%" in lines[1]
    cpu = next(line for line in lines if line.startswith("CPU only"))
    assert "25.0000" in cpu and " - " in cpu  # no energy figure: a dash, never a number
    assert any("predicted by the cost model of profile apple, per chunk of 256 tokens" in line for line in lines)
    assert lines[-1] == "Optuna alone vs the exact optimum of the same space: +0.40%"


def test_plots_are_written(tmp_path):
    model, _ = random_model("random:qwen3_moe")
    from autotune.searching.templates import template_plan
    from runtime.loading.model_loader import model_spec

    plan: Plan = template_plan(model_spec(model), "tight")
    lp = plan.layers[0]
    plan.layers[0] = LayerPlan(layer=lp.layer, groups=[Group(backend="cpu-static", experts=[0, 1], capacities=[4, 2],
                                                             tier=[0, 1])], cpu_exact=list(range(2, 8)))
    plot_plan_map(plan, tmp_path / "map.png")
    r = search_report(_outcome(), 4, 100, 1.0, {})
    plot_pareto(r, tmp_path / "pareto.png")
    for name in ("map.png", "pareto.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / name).stat().st_size > 1000


def test_sidecar_sits_next_to_the_plan():
    assert sidecar("plans/m@p.json", ".report.json") == Path("plans/m@p.report.json")
