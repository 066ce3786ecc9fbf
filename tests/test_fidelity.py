"""evaluate_plan's figures, computed chunk by chunk and in row blocks, equal the whole-prompt computation."""
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import random_model

from autotune.evaluation.fidelity import evaluate_plan
from autotune.searching.templates import template_plan
from runtime.executor import PlanExecutor
from runtime.loading.model_loader import model_spec
from runtime.prefill import max_rel_diff, prefill_logits


def test_chunked_figures_equal_the_whole_prompt_ones():
    model, tok = random_model("random:mixtral")
    ids = torch.tensor(tok.encode("Experts that overflow are dropped by saliency. " * 12)[:300])
    plan = template_plan(model_spec(model), "tight", "drop", chunk_tokens=96)  # 96 > ROWS: blocks inside chunks
    got = evaluate_plan(PlanExecutor(model, plan), ids, 160, progress=False)
    nll_ref = nll_plan = 0.0
    agree = worst = 0
    for s in range(0, ids.numel(), 160):
        prompt = ids[s:s + 160]
        ref = prefill_logits(model, prompt, 96)
        with PlanExecutor(model, plan):
            out = prefill_logits(model, prompt, 96)
        nll_ref += float(F.cross_entropy(ref[:-1], prompt[1:], reduction="sum"))
        nll_plan += float(F.cross_entropy(out[:-1], prompt[1:], reduction="sum"))
        agree += int((ref.argmax(-1) == out.argmax(-1)).sum())
        worst = max(worst, max_rel_diff(out, ref))
    n = ids.numel() - 2
    assert got["ppl_reference"] == pytest.approx(math.exp(nll_ref / n), rel=1e-6)
    assert got["ppl_plan"] == pytest.approx(math.exp(nll_plan / n), rel=1e-6)
    assert got["top1_agreement"] == agree / ids.numel() and got["max_rel_diff_vs_reference"] == pytest.approx(worst)
    assert got["drop_rate"] > 0
