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


def test_no_side_holds_a_prompts_outputs_into_the_next_prompt(monkeypatch):
    """Each compared side's outputs (logits, cache) are let go at its prompt's end: none is alive when the next
    prompt's sides start (they held a 1024-token chunk's logits of every side, 0.31 GB each on a 152k vocabulary,
    into the next prompt's forwards: the gate's peak on the Qwen3-30B-A3B twin 1.16x its prediction)."""
    import weakref

    import autotune.evaluation.fidelity as fidelity
    from autotune.evaluation.fidelity import compare_plans

    model, tok = random_model("random:mixtral")
    ids = torch.tensor(tok.encode("Experts that overflow are dropped by saliency. " * 12)[:300])
    plans = [template_plan(model_spec(model), "tight", "drop", chunk_tokens=96) for _ in range(2)]
    made, alive_at_start = [], []

    def watched(*args):
        alive_at_start.append(sum(r() is not None for r in made))  # a new side of a new prompt starts
        for out in fidelity_prefill(*args):
            made.append(weakref.ref(out.logits))
            yield out

    fidelity_prefill = fidelity.prefill_chunks
    monkeypatch.setattr(fidelity, "prefill_chunks", watched)
    compare_plans([PlanExecutor(model, p) for p in plans], ids, 160, progress=False)
    assert len(alive_at_start) == 2 * 3 and len(made) == 2 * 3 * 2  # 2 prompts x 3 sides, 2 chunks each
    starts = alive_at_start[3]  # prompt 2's reference: every output of prompt 1 already gone
    assert starts == 0 and all(r() is None for r in made)
