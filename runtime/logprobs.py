"""Log-probabilities of tokens from the logits a run computed (under the plan, when one is installed): float32
log-softmax, the chosen token's and the `k` most likely at each position."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One position: its token, that token's log-probability and the `k` most likely tokens there (id,
    log-probability; most likely first). `logprob` and `top` are None for a sequence's first token (nothing
    predicts it)."""
    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[TokenLogprob]:
    """Per row of `logits` [n, vocab], the row's log-probability of `tokens[i]` and its `k` most likely tokens."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.reshape(-1, 1)).squeeze(1).tolist()
    if k > 0:
        values, ids = lp.topk(k, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprob(t, c, top) for t, c, top in zip(tokens.tolist(), chosen, tops)]
