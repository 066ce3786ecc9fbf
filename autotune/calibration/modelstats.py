"""Quality and routing figures of an MoE language model on a text: perplexity, expert load shares, skew.

Routing is read by `traces.RoutingRecorder` at the experts module's forward (`experts(hidden, top_k_index,
top_k_weights)`), the one interface every transformers 5.x MoE family shares, so these figures see exactly what
the executor sees.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

from autotune.calibration.traces import RoutingRecorder

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
    with RoutingRecorder(model) as recorder:
        for x in _chunks(ids, chunk):
            model(input_ids=x[None])
    return recorder.expert_counts()


def shares(counts: np.ndarray) -> np.ndarray:
    """Per-layer expert load shares (rows sum to 1)."""
    return counts / counts.sum(axis=1, keepdims=True)


def skew(share: np.ndarray) -> np.ndarray:
    """Per layer: the most-used expert's share as a multiple of the uniform share."""
    return share.max(axis=1) * share.shape[1]

