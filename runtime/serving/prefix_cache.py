"""The prefix cache: a later prompt that starts with the tokens of an earlier one reuses that prefix's KV cache.

Whole prefill chunks are kept and reused. A plan prefills in chunks and may drop overflow per chunk, so a
prefix that ends on a chunk boundary leaves the rest of the prompt meeting the same boundaries it would meet
without the cache, and the output is the same. The tail rule: a prompt whose last, partial chunk ran on the exact
path (fewer than the plan's `exact_below` tokens) is kept whole, and a later prompt reuses positions of that tail
exactly when its own chunk holding them is partial and exact too (`prefill.exact_tail`): each position's keys and
values then depend only on the tokens up to it, as they would without the cache. Entries are what prefill wrote at a
boundary: transformers' dynamic cache grows by concatenation (new tensors each chunk), so keeping the boundary's
tensors copies nothing. Bounded in bytes; the least recently used entry goes first; the longest match wins.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import count

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from runtime.plan import DEFAULT_EXACT_BELOW_TOKENS
from runtime.prefill import exact_tail


@dataclass
class Entry:
    tokens: torch.Tensor  # 1-D token ids the KV covers (whole chunks, then maybe an exact tail)
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, heads, tokens, head_dim]
    nbytes: int


def supports_prefix_reuse(model: torch.nn.Module) -> bool:
    """Whether the model's cache is plain full attention (a sliding window would drop what a prefix holds)."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


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
    def __init__(self, model: torch.nn.Module, chunk_tokens: int, max_bytes: int,
                 exact_below: int = DEFAULT_EXACT_BELOW_TOKENS) -> None:
        self.model, self.chunk, self.max_bytes, self.exact_below = model, chunk_tokens, max_bytes, exact_below
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # by arrival number, least recently used first
        self.nbytes = 0
        self._keys = count()

    def lookup(self, ids: torch.Tensor) -> DynamicCache | None:
        """A fresh cache holding the longest reusable prefix of `ids`, or None."""
        best, best_n = None, 0
        for key, entry in reversed(self.entries.items()):  # most recent first: it wins ties
            n = reusable(ids, entry.tokens, self.chunk, self.exact_below)
            if n > best_n:
                best, best_n = key, n
        if best is None:
            return None
        self.entries.move_to_end(best)
        cache = DynamicCache(config=self.model.config)
        for i, (k, v) in enumerate(self.entries[best].layers):
            cache.update(k[:, :, :best_n], v[:, :, :best_n], i)  # copies: the entry stays as it is
        return cache

    def store(self, tokens: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
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
        nbytes = sum(t.numel() * t.element_size() for kv in layers for t in kv)
        if nbytes > self.max_bytes:
            return
        self.entries[next(self._keys)] = Entry(tokens.clone(), layers, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self._remove(next(iter(self.entries)))

    def _remove(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes
