"""A server's KV caches as rows of a batch on mlx-lm's caches (`KVCache`, `BatchKVCache`): a row added and removed,
a prefix cache entry's first tokens as caches; what rank 0's server does (`runtime.serving.mlx_serving`) and what
the other ranks repeat on their own stage's caches (`runtime.mlx.cluster_follow`). Imports mlx."""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache


def _batched(cache: list) -> list[BatchKVCache]:
    """A cache of one sequence (mlx-lm's per-layer `KVCache`s) as a batch of one row; a batch as it is."""
    return [c if isinstance(c, BatchKVCache) else BatchKVCache.merge([c]) for c in cache]


def add_row(batch: list | None, row: list) -> list:
    """The batch's cache (None: no row yet) with `row`'s cache (a prefilled sequence's) as its last row: a row alone
    keeps its own caches; a second one makes them a batch (new objects), which grows in place after."""
    if batch is None:
        return row
    batch = _batched(batch)
    for cache, one in zip(batch, _batched(row)):
        cache.extend(one)
    return batch


def remove_row(batch: list, i: int, rows: int) -> list | None:
    """The batch's cache of `rows` rows without row `i`: None once empty; the row left alone back on its own caches
    (its padding gone: it steps as it would alone); else filtered in place."""
    keep = [j for j in range(rows) if j != i]
    if not keep:
        return None
    if len(keep) == 1:
        alone = [c.extract(keep[0]) for c in batch]
        mx.eval([(c.keys, c.values) for c in alone])
        return alone
    for c in batch:
        c.filter(keep)
    return batch


def prefix_of(layers: list[tuple[mx.array, mx.array]], tokens: int) -> list[KVCache]:
    """mlx-lm's caches holding an entry's first `tokens`: views (no copy), which the first token written after them
    replaces with a grown buffer (`KVCache.update_and_fetch` concatenates past a full one), so the entry stays as it
    is. Evaluated here, on the thread that made them."""
    cache = []
    for k, v in layers:
        c = KVCache()
        c.state = (k[..., :tokens, :], v[..., :tokens, :], tokens)
        cache.append(c)
    mx.eval([(c.keys, c.values) for c in cache])
    return cache
