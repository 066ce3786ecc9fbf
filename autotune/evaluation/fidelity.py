"""What a plan costs in fidelity, measured: the planned model against the unmodified one on the same prompts."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from runtime.cpu.allocator import release_freed_heap
from runtime.executor import PlanExecutor
from runtime.prefill import prefill_chunks

ROWS = 64  # positions whose full-vocabulary logits are compared at once


@dataclass
class _Tally:
    """One plan's sums over the positions compared so far."""
    nll: float = 0.0
    agree: int = 0
    kl: float = 0.0
    diff: float = 0.0  # this prompt's max |plan - reference| logit
    worst: float = 0.0  # max over prompts of diff / the prompt's max |reference| logit


# A spine's chunked prefill of one prompt from an empty cache: (prompt ids, chunk) -> each chunk's logits [n, vocab],
# under the plan or not as the executor has it installed when the chunk runs
ChunkLogits = Callable[[torch.Tensor, int], Iterator[torch.Tensor]]


def torch_chunk_logits(model: torch.nn.Module) -> ChunkLogits:
    """The torch spine's `ChunkLogits` (`prefill_chunks` of the transformers model). Suspended between chunks, it
    holds none of the chunk it gave (`yield from` a map: no local of its own keeps the logits): the caller's drop
    lets them go, so candidates prefilled side by side hold one chunk's logits at a time, not one each."""
    def chunks(prompt: torch.Tensor, chunk: int) -> Iterator[torch.Tensor]:
        yield from map(lambda out: out.logits[0], prefill_chunks(model, prompt, chunk))

    return chunks


def evaluate_plan(executor: PlanExecutor, ids: torch.Tensor, prompt_tokens: int, progress: bool = True,
                  chunk_logits: ChunkLogits | None = None) -> dict:
    """Perplexity of the model under `executor`'s plan and without it, top-1 next-token agreement, mean KL
    divergence, logits' max relative difference, and the executor's measured drop and spill rates, over prompts of
    `prompt_tokens` (at least the plan's chunk) prefilled in the plan's chunks (`chunk_logits`: the spine's; default
    the torch spine's, of `executor.model`). The plan is installed or not afterwards as it was before."""
    result = compare_plans([executor], ids, prompt_tokens, progress, chunk_logits)[0]
    total = executor.stats.total()
    return {**result, "drop_rate": total.dropped / max(1, total.assignments),
            "spill_rate": total.spilled / max(1, total.assignments),
            "padding_fraction": total.padding_fraction, "assignments": total.assignments,
            "tokens_per_backend": dict(total.tokens_per_backend), "calls_per_backend": dict(total.calls_per_backend),
            "backend_fallbacks": executor.fallbacks}


def compare_plans(executors: list[PlanExecutor], ids: torch.Tensor, prompt_tokens: int,
                  progress: bool = True, chunk_logits: ChunkLogits | None = None) -> list[dict]:
    """Each executor's plan (all on one model) against the unmodified model, on the same prompts: the reference
    runs once per chunk size and prompt, side by side with every plan of that chunk size, whose chunks are compared
    one plan at a time (the logits held do not grow with the plans)."""
    chunk_logits = chunk_logits or torch_chunk_logits(executors[0].model)
    out: list[dict] = [{} for _ in executors]
    by_chunk: dict[int, list[int]] = {}
    for i, ex in enumerate(executors):
        by_chunk.setdefault(ex.plan.chunk_tokens, []).append(i)
    for chunk, which in by_chunk.items():
        for i, figures in zip(which, _compare(
                [executors[i] for i in which], ids, prompt_tokens, chunk, progress, chunk_logits)):
            out[i] = figures
    return out


def _compare(executors: list[PlanExecutor], ids: torch.Tensor, prompt_tokens: int, chunk: int,
             progress: bool, chunk_logits: ChunkLogits) -> list[dict]:
    tallies = [_Tally() for _ in executors]
    nll_ref, predicted = 0.0, 0
    # prompts of at least one chunk: a shorter one is a partial chunk, run exactly below the plan's exact_below
    # (the plan's static groups never run: its figures would be the unmodified model's)
    prompt_tokens = max(prompt_tokens, chunk)
    starts = list(range(0, ids.numel() - 1, prompt_tokens))
    for start in tqdm(starts, desc="evaluate", unit="prompt", disable=not progress):
        prompt = ids[start:start + prompt_tokens]
        if prompt.numel() < 2:
            continue
        # Chunk by chunk, the unmodified model and each planned one side by side (each with its own cache): the
        # reference's chunk of logits is held while each candidate's is computed, compared and let go before the
        # next candidate's forward, so the logits held are two chunks' however many candidates there are (never
        # the prompt's [tokens, vocab])
        ref_chunks = chunk_logits(prompt, chunk)
        plan_chunks = [chunk_logits(prompt, chunk) for _ in executors]
        scale = 0.0
        with torch.inference_mode():
            for s in range(0, prompt.numel(), chunk):
                with executors[0].applied(False):
                    ref_out = next(ref_chunks)
                target = prompt[s + 1:s + ref_out.shape[0] + 1]
                nll, top = _reference_figures(ref_out, target)
                nll_ref, scale = nll_ref + nll, max(scale, top)
                for t, ex, gen in zip(tallies, executors, plan_chunks):
                    with ex.applied(True):
                        out = next(gen)
                    _tally(t, ref_out, out, target)
                    del out
                    release_freed_heap()  # as calibrate does per chunk: the heap's high-water mark stays one chunk's
                del ref_out
                release_freed_heap()
        # each side's generator still holds its KV cache: closed, they let it go before the next prompt's forwards
        for gen in (ref_chunks, *plan_chunks):
            gen.close()
        release_freed_heap()
        predicted += prompt.numel()
        for t in tallies:
            t.worst, t.diff = max(t.worst, t.diff / max(scale, 1e-30)), 0.0
    n = predicted - len(starts)  # next-token targets
    ppl_ref = math.exp(nll_ref / n)
    return [{"tokens": int(predicted), "prompts": len(starts), "ppl_reference": ppl_ref,
             "ppl_plan": math.exp(t.nll / n), "ppl_delta_rel": math.exp(t.nll / n) / ppl_ref - 1.0,
             "top1_agreement": t.agree / predicted, "kl_mean": t.kl / predicted,
             "max_rel_diff_vs_reference": t.worst} for t in tallies]


def _reference_figures(ref_out: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """The reference chunk's summed next-token NLL over `target` and its largest |logit|, ROWS positions at a time."""
    nll, scale = 0.0, 0.0
    for r in range(0, ref_out.shape[0], ROWS):
        ref = ref_out[r:r + ROWS].float()
        rows = target[r:r + ROWS]
        nll += float(F.nll_loss(F.log_softmax(ref, -1)[:rows.numel()], rows, reduction="sum"))
        scale = max(scale, float(ref.abs().max()))
    return nll, scale


def _tally(t: _Tally, ref_out: torch.Tensor, out: torch.Tensor, target: torch.Tensor) -> None:
    """A candidate's chunk `out` against the reference's, added to `t`: fp32 temporaries (7 x ROWS rows of the
    vocabulary: both logits and log-probabilities, the KL's three) for ROWS positions at a time, not the chunk's."""
    for r in range(0, ref_out.shape[0], ROWS):
        ref, got = ref_out[r:r + ROWS].float(), out[r:r + ROWS].float()
        ref_logp, logp = F.log_softmax(ref, -1), F.log_softmax(got, -1)
        rows = target[r:r + ROWS]
        t.nll += float(F.nll_loss(logp[:rows.numel()], rows, reduction="sum"))
        t.agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        t.kl += float((ref_logp.exp() * (ref_logp - logp)).sum())  # KL(reference || plan)
        t.diff = max(t.diff, float((got - ref).abs().max()))
