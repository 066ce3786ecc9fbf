"""Quality and routing figures of an MoE language model on a text: perplexity, expert load shares, skew.

Routing is read at the experts module's forward (`experts(hidden, top_k_index, top_k_weights)`), the one
interface every transformers 5.x MoE family shares, so these figures see exactly what the executor sees.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

from runtime.loading.model_loader import moe_layers

DEFAULT_CHUNK = 512


def _chunks(ids: Sequence[int], chunk: int) -> list[torch.Tensor]:
    return [torch.tensor(ids[i:i + chunk], dtype=torch.long) for i in range(0, len(ids), chunk)
            if len(ids[i:i + chunk]) > 1]


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids: Sequence[int], chunk: int = DEFAULT_CHUNK) -> float:
    """exp(mean next-token NLL) over non-overlapping chunks of `chunk` tokens (each chunk starts cold)."""
    nll, count = 0.0, 0
    for x in _chunks(ids, chunk):
        logits = model(input_ids=x[None]).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, x[1:], reduction="sum").item()
        count += len(x) - 1
    return math.exp(nll / count)


def unigram_perplexity(fit_ids: Sequence[int], eval_ids: Sequence[int], vocab_size: int) -> float:
    """Perplexity of an add-one-smoothed unigram model fitted on `fit_ids`, evaluated on `eval_ids`."""
    counts = np.ones(vocab_size)
    for token, n in Counter(fit_ids).items():
        counts[token] += n
    logp = np.log(counts / counts.sum())
    return float(math.exp(-logp[np.asarray(eval_ids)].mean()))


@torch.no_grad()
def expert_counts(model: torch.nn.Module, ids: Sequence[int], chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """Assignments per (MoE layer, expert) over the text: shape [layers, experts], each row sums to tokens×top-k."""
    layers = moe_layers(model)
    num_experts = int(layers[0].experts.num_experts)
    counts = np.zeros((len(layers), num_experts), dtype=np.int64)

    def hook(row: int):
        def record(_module, args, kwargs):
            top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            counts[row] += np.bincount(top_k_index.reshape(-1).numpy(), minlength=num_experts)[:num_experts]
        return record

    handles = [l.experts.register_forward_pre_hook(hook(i), with_kwargs=True) for i, l in enumerate(layers)]
    try:
        for x in _chunks(ids, chunk):
            model(input_ids=x[None])
    finally:
        for h in handles:
            h.remove()
    return counts


def shares(counts: np.ndarray) -> np.ndarray:
    """Per-layer expert load shares (rows sum to 1)."""
    return counts / counts.sum(axis=1, keepdims=True)


def skew(share: np.ndarray) -> np.ndarray:
    """Per layer: the most-used expert's share as a multiple of the uniform share."""
    return share.max(axis=1) * share.shape[1]


def tv_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-layer total-variation distance between two share matrices."""
    return 0.5 * np.abs(a - b).sum(axis=1)
