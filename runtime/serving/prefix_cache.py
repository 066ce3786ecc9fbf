"""The prefix cache: a later prompt that starts with the tokens of an earlier one reuses that prefix's KV cache.

Whole prefill chunks are kept and reused. A plan prefills in chunks and may drop overflow per chunk, so a
prefix that ends on a chunk boundary leaves the rest of the prompt meeting the same boundaries it would meet
without the cache, and the output is the same. The tail rule: a prompt whose last, partial chunk ran on the exact
path (fewer than the plan's `exact_below` tokens) is kept whole, and a later prompt reuses positions of that tail
exactly when its own chunk holding them is partial and exact too (`prefill.exact_tail`): each position's keys and
values then depend only on the tokens up to it, as they would without the cache. Entries are what prefill wrote at a
boundary: transformers' dynamic cache grows by concatenation (new tensors each chunk), so keeping the boundary's
tensors copies nothing (mlx-lm's cache is written in place: the MLX spine keeps a copy). Either spine's entries, its
caches made by its `ServingSpine`. Bounded in bytes; the least recently used entry goes first; the longest match wins.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING

import torch

from runtime.plan import DEFAULT_EXACT_BELOW_TOKENS
from runtime.prefill import exact_tail

if TYPE_CHECKING:
    from runtime.serving.serving_spine import Layers, ServingSpine


@dataclass
class Entry:
    tokens: torch.Tensor  # 1-D token ids the KV covers (whole chunks, then maybe an exact tail)
    layers: Layers  # per layer: keys, values [1, heads, tokens, head_dim], as the spine's prefill wrote them
    nbytes: int


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


def reusable(ids: torch.Tensor, tokens: torch.Tensor, chunk: int, exact_below: int) -> int:
    """How many leading tokens of prompt `ids` an entry of `tokens` (whole chunks, then maybe an exact tail) can
    serve: at least one prompt token left to prefill (its logits give the first new token); whole chunks, or past
    the entry's last chunk boundary where both the entry's tail and the prompt's chunk there are exact."""
    shared = min(common_prefix(tokens, ids), ids.numel() - 1)
    boundary = tokens.numel() // chunk * chunk
    if shared > boundary and exact_tail(ids.numel(), boundary, chunk, exact_below):
        return shared
    return shared // chunk * chunk


def keeps_tail(tokens: int, chunk: int, exact_below: int) -> bool:
    """Whether a prompt of `tokens` ends in an exact partial chunk, worth keeping whole (the tail rule)."""
    return exact_tail(tokens, tokens // chunk * chunk, chunk, exact_below)


class PrefixCache:
    """The entries of one model on one spine (`spine`: its caches made from an entry, `ServingSpine.prefix`)."""

    def __init__(self, spine: ServingSpine, chunk_tokens: int, max_bytes: int,
                 exact_below: int = DEFAULT_EXACT_BELOW_TOKENS) -> None:
        self.spine, self.chunk, self.max_bytes, self.exact_below = spine, chunk_tokens, max_bytes, exact_below
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # by arrival number, least recently used first
        self.nbytes = 0
        self._keys = count()

    def lookup(self, ids: torch.Tensor) -> object | None:
        """A fresh cache holding the longest reusable prefix of `ids`, or None."""
        best, best_n = None, 0
        for key, entry in reversed(self.entries.items()):  # most recent first: it wins ties
            n = reusable(ids, entry.tokens, self.chunk, self.exact_below)
            if n > best_n:
                best, best_n = key, n
        if best is None:
            return None
        self.entries.move_to_end(best)
        return self.spine.prefix(self.entries[best].layers, best_n)

    def store(self, tokens: torch.Tensor, layers: Layers) -> None:
        """Keep what prefill wrote for `tokens` (whole chunks, or a prompt ending in an exact tail): per layer,
        keys and values; an entry it extends goes."""
        length = tokens.numel()
        assert (length % self.chunk == 0 or keeps_tail(length, self.chunk, self.exact_below)) \
            and all(k.shape[2] == length for k, _ in layers)
        for key, entry in list(self.entries.items()):
            n = common_prefix(entry.tokens, tokens)
            if n == length:  # already held (as this prefix or a longer one)
                self.entries.move_to_end(key)
                return
            if n == entry.tokens.numel():  # the new entry holds this one
                self._remove(key)
        nbytes = sum(t.nbytes for kv in layers for t in kv)  # torch tensors and MLX arrays alike
        if nbytes > self.max_bytes:
            return
        self.entries[next(self._keys)] = Entry(tokens.clone(), layers, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self._remove(next(iter(self.entries)))

    def _remove(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes
