"""The prefix cache: a later prompt that starts with the tokens of an earlier one reuses that prefix's KV cache.

Only whole prefill chunks are kept and reused. A plan prefills in chunks and may drop overflow per chunk, so a
prefix that ends on a chunk boundary leaves the rest of the prompt meeting the same boundaries it would meet
without the cache, and the output is the same. Entries are what prefill wrote at a boundary: transformers' dynamic
cache grows by concatenation (new tensors each chunk), so keeping the boundary's tensors copies nothing. Bounded
in bytes; the least recently used entry goes first; the longest match wins.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import count

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


@dataclass
class Entry:
    tokens: torch.Tensor  # 1-D token ids the KV covers (a whole number of chunks)
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, heads, tokens, head_dim]
    nbytes: int


def supports_prefix_reuse(model: torch.nn.Module) -> bool:
    """Whether the model's cache is plain full attention (a sliding window would drop what a prefix holds)."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


class PrefixCache:
    def __init__(self, model: torch.nn.Module, chunk_tokens: int, max_bytes: int) -> None:
        self.model, self.chunk, self.max_bytes = model, chunk_tokens, max_bytes
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # by arrival number, least recently used first
        self.nbytes = 0
        self._keys = count()

    def reusable(self, ids: torch.Tensor, tokens: torch.Tensor) -> int:
        """How many leading tokens of prompt `ids` an entry of `tokens` can serve: whole chunks, and at least
        one prompt token left to prefill (its logits give the first new token)."""
        return min(common_prefix(tokens, ids), ids.numel() - 1) // self.chunk * self.chunk

    def lookup(self, ids: torch.Tensor) -> DynamicCache | None:
        """A fresh cache holding the longest reusable prefix of `ids`, or None."""
        best, best_n = None, 0
        for key, entry in reversed(self.entries.items()):  # most recent first: it wins ties
            n = self.reusable(ids, entry.tokens)
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
        """Keep what prefill wrote for `tokens` (a whole number of chunks): per layer, keys and values; an entry
        it extends goes."""
        assert tokens.numel() % self.chunk == 0 and all(k.shape[2] == tokens.numel() for k, _ in layers)
        for key, entry in list(self.entries.items()):
            n = common_prefix(entry.tokens, tokens)
            if n == tokens.numel():  # already held (as this prefix or a longer one)
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
