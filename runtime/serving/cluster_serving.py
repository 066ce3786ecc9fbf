"""The server across Macs (`mlx.launch`), on rank 0: the MLX spine's server (`runtime.serving.mlx_serving`), each
change it makes to a KV cache told to the other ranks (`runtime.mlx.cluster_follow`), which make it to their own
stage's caches. So continuous batching and the prefix cache run as on one Mac: rank 0 decides which requests run,
which batch their decode steps share and which cached prefix each reuses, and every rank holds its own layers' keys
and values of the same batch and the same prefix cache entries. Imports mlx."""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from runtime.generation import Generation, Loaded
from runtime.mlx.cluster_follow import ADD, KEEP, PREFIX, REMOVE, Kept, Link
from runtime.serving.mlx_serving import MlxDecodeBatch, MlxServing


class ClusterDecodeBatch(MlxDecodeBatch):
    """Rank 0's decode batch: a row that joins or leaves is told to the other ranks (its step's forward is told by
    the link itself)."""

    def __init__(self, loaded: Loaded) -> None:
        super().__init__(loaded)
        self.link: Link = loaded.cluster.link

    def add(self, gen: Generation) -> None:
        held = self.cache, gen.cache  # until told: what the batch replaces is not freed before
        batch = self.link.handle(self.cache) if self.rows else 0
        row = self.link.handle(gen.cache)
        super().add(gen)
        self.link.tell(ADD, batch, row, self.link.handle(self.cache))
        del held

    def remove(self, gen: Generation) -> None:
        held = self.cache
        batch, i, rows = self.link.handle(self.cache), self.rows.index(gen), len(self.rows)
        super().remove(gen)
        self.link.tell(REMOVE, batch, i, self.link.handle(self.cache) if self.cache is not None else 0, rows)
        del held


class ClusterServing(MlxServing):
    """Rank 0's view of the MLX spine: the prefix cache's entries, and the caches made from them, told by handle."""

    def __init__(self, loaded: Loaded) -> None:
        super().__init__(loaded)
        self.link: Link = loaded.cluster.link

    def prefix(self, layers: Kept, tokens: int) -> list[KVCache]:
        cache = super().prefix(layers, tokens)
        self.link.tell(PREFIX, self.link.handle(cache), self.link.handle(layers), tokens)
        return cache

    def keep(self, layers: list[tuple[mx.array, mx.array]], cache: list, tokens: int) -> Kept:
        kept = Kept(layers)
        self.link.tell(KEEP, self.link.handle(kept), self.link.handle(cache), tokens)
        return kept

    def decode_batch(self) -> ClusterDecodeBatch:
        return ClusterDecodeBatch(self.loaded)
