"""What the server's scheduling asks of the spine a model runs on (`ServingSpine`), so that one engine, one
scheduler and one prefix cache serve both spines: the torch spine (`TorchServing`: transformers' `DynamicCache`,
`decode_batch.DecodeBatch`) and the MLX spine (`runtime.serving.mlx_serving.MlxServing`: mlx-lm's `KVCache` and
`BatchKVCache`). A cache's tokens: `runtime.generation.cache_length`."""
from __future__ import annotations

from typing import Protocol

from transformers.cache_utils import DynamicCache, DynamicLayer

from runtime.generation import Generation, Loaded
from runtime.serving.decode_batch import DecodeBatch

# per layer, the keys and values a prefill wrote [1, heads, tokens, head_dim]: torch tensors or MLX arrays
Layers = list[tuple[object, object]]


class Batch(Protocol):
    """Continuous batching's decode side: the decoding generations, one forward a step."""
    rows: list[Generation]
    widest: int  # the most rows one step has run (what a test of batching reads)

    def add(self, gen: Generation) -> None:
        """A generation whose prefill is done (its first token taken) joins; the batch holds its cache."""

    def remove(self, gen: Generation) -> None: ...

    def step(self) -> None:
        """One decode step of every row: each row's next token pending (its own sampling), its step time kept."""


class ServingSpine(Protocol):
    def reuse_off(self) -> str | None:
        """Why a prompt's KV cache cannot be reused on this model (None: it can)."""

    def prefix(self, layers: Layers, tokens: int) -> object:
        """A fresh KV cache of this spine holding the first `tokens` of `layers` (which stay as they are)."""

    def keep(self, layers: Layers, cache: object, tokens: int) -> Layers:
        """What the prefix cache keeps of `layers`, a prefill's copy of the first `tokens` of `cache` (the KV cache
        of the prompt it prefilled): `layers` itself; across Macs, with the name the other ranks keep theirs by."""

    def decode_batch(self) -> Batch: ...


class TorchServing:
    def __init__(self, loaded: Loaded) -> None:
        self.loaded = loaded

    def reuse_off(self) -> str | None:
        plain = all(type(layer) is DynamicLayer for layer in DynamicCache(config=self.loaded.model.config).layers)
        return None if plain else "the model's cache is not plain full attention"

    def prefix(self, layers: Layers, tokens: int) -> DynamicCache:
        cache = DynamicCache(config=self.loaded.model.config)
        for i, (k, v) in enumerate(layers):
            cache.update(k[:, :, :tokens], v[:, :, :tokens], i)  # copies: the entry stays as it is
        return cache

    def keep(self, layers: Layers, cache: DynamicCache, tokens: int) -> Layers:
        return layers

    def decode_batch(self) -> DecodeBatch:
        return DecodeBatch(self.loaded)


def serving_spine(loaded: Loaded) -> ServingSpine:
    """The spine `loaded` runs on, as the server drives it (the MLX one imports mlx; across Macs, rank 0's, which
    tells the other ranks what it does to its caches: `runtime.serving.cluster_serving`)."""
    if loaded.cluster is not None:
        from runtime.serving.cluster_serving import ClusterServing

        return ClusterServing(loaded)
    if loaded.engine == "mlx":
        from runtime.serving.mlx_serving import MlxServing

        return MlxServing(loaded)
    return TorchServing(loaded)
