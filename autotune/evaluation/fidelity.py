"""What a plan costs in fidelity, measured: the planned model against the unmodified one on the same prompts."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm import tqdm

from runtime.executor import PlanExecutor
from runtime.prefill import prefill_chunks

ROWS = 64  # positions whose full-vocabulary logits are compared at once


def evaluate_plan(executor: PlanExecutor, ids: torch.Tensor, prompt_tokens: int, progress: bool = True) -> dict:
    """Perplexity of the model under `executor`'s plan and without it, top-1 next-token agreement, logits' max
    relative difference, and the executor's measured drop and spill rates, over prompts of `prompt_tokens`
    prefilled in the plan's chunks. The plan is installed or not afterwards as it was before."""
    model, plan = executor.model, executor.plan
    nll_ref = nll_plan = 0.0
    agree = predicted = 0
    worst = 0.0
    starts = list(range(0, ids.numel() - 1, prompt_tokens))
    for start in tqdm(starts, desc="evaluate", unit="prompt", disable=not progress):
        prompt = ids[start:start + prompt_tokens]
        if prompt.numel() < 2:
            continue
        # Chunk by chunk, the unmodified model and the planned one side by side (each with its own cache): only
        # one chunk's logits of each are held, never the prompt's [tokens, vocab].
        ref_chunks, plan_chunks = (prefill_chunks(model, prompt, plan.chunk_tokens) for _ in range(2))
        diff = scale = 0.0
        with torch.inference_mode():
            for s in range(0, prompt.numel(), plan.chunk_tokens):
                with executor.applied(False):
                    ref_out = next(ref_chunks)
                with executor.applied(True):
                    got_out = next(plan_chunks)
                n = ref_out.logits.shape[1]
                for r in range(0, n, ROWS):  # fp32 temporaries for ROWS positions at a time, not the chunk's
                    ref = ref_out.logits[0, r:r + ROWS].float()
                    got = got_out.logits[0, r:r + ROWS].float()
                    target = prompt[s + r + 1:s + min(n, r + ROWS) + 1]
                    nll_ref += float(F.cross_entropy(ref[:target.numel()], target, reduction="sum"))
                    nll_plan += float(F.cross_entropy(got[:target.numel()], target, reduction="sum"))
                    agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
                    diff, scale = max(diff, float((got - ref).abs().max())), max(scale, float(ref.abs().max()))
                del ref_out, got_out
        predicted += prompt.numel()
        worst = max(worst, diff / max(scale, 1e-30))
    n = predicted - len(starts)  # next-token targets
    total = executor.stats.total()
    ppl_ref, ppl_plan = math.exp(nll_ref / n), math.exp(nll_plan / n)
    return {"tokens": int(predicted), "prompts": len(starts), "ppl_reference": ppl_ref, "ppl_plan": ppl_plan,
            "ppl_delta_rel": ppl_plan / ppl_ref - 1.0, "top1_agreement": agree / predicted,
            "max_rel_diff_vs_reference": worst,
            "drop_rate": total.dropped / max(1, total.assignments),
            "spill_rate": total.spilled / max(1, total.assignments),
            "padding_fraction": total.padding_fraction, "assignments": total.assignments,
            "tokens_per_backend": dict(total.tokens_per_backend), "calls_per_backend": dict(total.calls_per_backend),
            "backend_fallbacks": executor.fallbacks}
