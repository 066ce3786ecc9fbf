"""The issue-5 acceptance figures on the embedded model: the tuned plan vs baselines (predicted, published
M2 Ultra profile), and what evaluate measures."""
import json

import pytest
import torch
from helpers import random_model

from autotune.cli import main
from autotune.evaluation.fidelity import evaluate_plan
from autotune.searching.templates import template_plan
from runtime.executor import PlanExecutor
from runtime.loading.model_loader import TINY_MOE_DIR, model_spec

needs_tiny = pytest.mark.skipif(not (TINY_MOE_DIR / "config.json").exists(), reason="tiny-moe asset missing")


@pytest.mark.slow
@needs_tiny
def test_tuned_plan_beats_heuristic_and_naive_coreml(tmp_path, capsys):
    traces, plan = tmp_path / "traces.npz", tmp_path / "plan.json"
    assert main(["calibrate", "--model", "tiny-moe", "--max-tokens", "8192", "--out", str(traces), "--json"]) == 0
    capsys.readouterr()
    assert main(["search", "--model", "tiny-moe", "--profile", "apple-m2-ultra-published", "--traces", str(traces),
                 "--trials", "40", "--out", str(plan), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["heldout_drop_rate"] <= 0.10
    assert r["predicted_latency_ms"] <= r["baselines"]["paper_heuristic"]
    assert r["baselines"]["naive_coreml"] / r["predicted_latency_ms"] >= 1.3


def test_evaluate_spill_plan_is_exact_and_drop_plan_is_measured():
    model, tok = random_model("random:olmoe")
    ids = torch.tensor(tok.encode("Experts that overflow spill to the exact path. " * 12))
    spec = model_spec(model)
    spill = evaluate_plan(PlanExecutor(model, template_plan(spec, "tight", "spill", chunk_tokens=64)), ids, 256,
                          progress=False)
    assert spill["spill_rate"] > 0 and spill["drop_rate"] == 0
    assert spill["max_rel_diff_vs_reference"] <= 1e-5
    assert spill["ppl_delta_rel"] == pytest.approx(0.0, abs=1e-5) and spill["top1_agreement"] == 1.0
    drop = evaluate_plan(PlanExecutor(model, template_plan(spec, "tight", "drop", chunk_tokens=64)), ids, 256,
                         progress=False)
    assert drop["drop_rate"] > 0.3 and drop["top1_agreement"] < 1.0 and drop["ppl_delta_rel"] != 0.0
