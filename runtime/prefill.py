"""Chunked prefill: the text goes through the model `chunk_tokens` at a time with a KV cache, as on device."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

NO_ROWS = torch.empty(0, dtype=torch.long)  # transformers' `logits_to_keep` of no position: the head computes none


def chunk_spans(tokens: int, chunk_tokens: int, rows: Sequence[int] = ()) -> list[tuple[int, int]]:
    """(start, stop) of each prefill chunk of `tokens` tokens: an uneven chunking's `rows` first, in order (the
    plan's `chunk_rows`, cut at the end), then chunks of `chunk_tokens`, the last one partial."""
    out, start = [], 0
    for r in rows:
        if start < tokens:
            out.append((start, min(start + r, tokens)))
            start = out[-1][1]
    return out + [(s, min(s + chunk_tokens, tokens)) for s in range(start, tokens, chunk_tokens)]


def prefill_chunks(model: torch.nn.Module, input_ids: torch.Tensor, chunk_tokens: int,
                   last_logits_only: bool = False, cache: object | None = None,
                   rows: Sequence[int] = ()) -> Iterator:
    """The model's outputs, chunk by chunk (`chunk_spans`: `rows` an uneven chunking), for a 1-D sequence of token
    ids; each output holds the cache so far. `last_logits_only`: the last chunk computes logits for its last
    position only (what generation needs) and the chunks before it none (their `logits` [1, 0, vocab]): the head,
    a packed one dequantized whole per call, runs once per prompt, not once per chunk. `cache`: a KV cache holding
    the tokens before `input_ids` (continued in place). Callers run it under `torch.inference_mode()`."""
    ids = input_ids.reshape(1, -1)
    for start, stop in chunk_spans(ids.shape[1], chunk_tokens, rows):
        last = stop >= ids.shape[1]
        keep = {} if not last_logits_only else {"logits_to_keep": 1 if last else NO_ROWS}
        held = [model(input_ids=ids[:, start:stop], cache=cache, use_cache=True, **keep)]
        cache = held[0].cache
        # suspended here, nothing of the output is held (popped as it goes): the caller's drop lets its logits go
        # before the next chunk's forward, and before other generators' forwards between
        yield held.pop()


def exact_tail(prompt_tokens: int, boundary: int, chunk_tokens: int, exact_below: int) -> bool:
    """Whether a prompt's positions past chunk `boundary` lie in a partial chunk that runs on the exact path
    (fewer than the plan's `exact_below` tokens: no static call, no drop). Each position's keys and values then
    depend only on the tokens up to it, so those of another prompt's exact tail with the same tokens there may be
    reused (the prefix caches' tail rule)."""
    return boundary % chunk_tokens == 0 and boundary < prompt_tokens < boundary + chunk_tokens \
        and prompt_tokens - boundary < exact_below


def prefill_logits(model: torch.nn.Module, input_ids: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Logits `[T, vocab]` for a 1-D sequence of token ids, computed chunk by chunk."""
    logits = None
    with torch.inference_mode():
        for start, out in zip(range(0, input_ids.numel(), chunk_tokens),
                              prefill_chunks(model, input_ids, chunk_tokens)):
            if logits is None:  # filled in place: no second [T, vocab] copy from concatenating chunks
                logits = torch.empty(input_ids.numel(), out.logits.shape[-1], dtype=torch.float32)
            logits[start:start + out.logits.shape[1]] = out.logits[0]
    return logits


def prefill_prompts_last_logits(model: torch.nn.Module, input_ids: torch.Tensor, chunk_tokens: int,
                                prompt_tokens: int | None = None) -> torch.Tensor:
    """Each prompt's logits at its last position, `[prompts, vocab]` in fp32: what a prefill gives generation. The
    sequence is cut into prompts as `prefill_prompts_logits` cuts it; each prompt's last chunk computes one row of
    logits."""
    n = input_ids.numel()
    step = prompt_tokens or n
    rows = []
    with torch.inference_mode():
        for s in range(0, n, step):
            for out in prefill_chunks(model, input_ids[s:s + step], chunk_tokens, last_logits_only=True):
                pass
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def prefill_prompts_logits(model: torch.nn.Module, input_ids: torch.Tensor, chunk_tokens: int,
                           prompt_tokens: int | None = None) -> torch.Tensor:
    """Logits `[T, vocab]` with the sequence cut into prompts of `prompt_tokens` (default: one prompt), each
    prefilled from an empty cache: a long text stays within the model's context."""
    n = input_ids.numel()
    step = prompt_tokens or n
    if step >= n:
        return prefill_logits(model, input_ids, chunk_tokens)
    logits = None
    for s in range(0, n, step):  # each prompt's logits go into one preallocated tensor: no concatenated copy
        part = prefill_logits(model, input_ids[s:s + step], chunk_tokens)
        if logits is None:
            logits = torch.empty(n, part.shape[-1], dtype=part.dtype)
        logits[s:s + part.shape[0]] = part
        del part
    return logits


def max_rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|: relative to the reference's scale, so near-zero entries don't blow it up."""
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
