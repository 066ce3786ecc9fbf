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


def test_no_side_holds_a_prompts_outputs_into_the_next_prompt_nor_one_candidates_into_anothers(monkeypatch):
    """Each compared side's outputs (logits, cache) are let go at its prompt's end: none is alive when the next
    prompt's sides start (they held a 1024-token chunk's logits of every side, 0.31 GB each on a 152k vocabulary,
    into the next prompt's forwards: the gate's peak on the Qwen3-30B-A3B twin 1.16x its prediction). Within a
    chunk, each candidate's logits are compared and let go before the next candidate's forward: at every forward
    the only logits alive are the reference's chunk (they held every candidate's: the gate's memory grew with its
    candidates)."""
    from torch.multiprocessing.reductions import StorageWeakRef  # the logits' memory, whoever views it

    import autotune.evaluation.fidelity as fidelity
    from autotune.evaluation.fidelity import compare_plans

    model, tok = random_model("random:mixtral")
    ids = torch.tensor(tok.encode("Experts that overflow are dropped by saliency. " * 12)[:300])
    plans = [template_plan(model_spec(model), "tight", "drop", chunk_tokens=96) for _ in range(3)]
    made, alive_at_forward = [], []

    def watched(*args):  # holds nothing of what it gives while suspended, as prefill_chunks
        chunks = fidelity_prefill(*args)
        while True:
            alive_at_forward.append(sum(not r.expired() for r in made))  # before this side's next forward
            held = [next(chunks, None)]
            if held[0] is None:
                return
            made.append(StorageWeakRef(held[0].logits.untyped_storage()))
            yield held.pop()

    fidelity_prefill = fidelity.prefill_chunks
    monkeypatch.setattr(fidelity, "prefill_chunks", watched)
    compare_plans([PlanExecutor(model, p) for p in plans], ids, 160, progress=False)
    assert len(made) == len(alive_at_forward) == 2 * 4 * 2  # 2 prompts x 4 sides x 2 chunks, each side in turn
    assert alive_at_forward[1:4] == [1, 1, 1]  # the candidates' forwards beside the reference's chunk alone
    assert max(alive_at_forward) == 1 and alive_at_forward[8] == 0  # prompt 2's reference: prompt 1's all gone
    assert all(r.expired() for r in made)
