"""The server on the MLX spine (`runtime.serving.serving_spine.ServingSpine`): the prefix cache's entries as
mlx-lm's `KVCache`s, and continuous batching's decode step on mlx-lm's `BatchKVCache`, as its own `BatchGenerator`
batches (`merge` left-pads each row's cache, `extend` adds a row, `filter` drops rows and the columns every row
pads). Each row's attention masks its padding and ropes at its own offset; on MLX's CPU device in float32 each
row's logits of a padded batched step equal its own step's bitwise (measured: tiny-moe, 4 bits, rows of 9, 17 and 30
tokens). A row alone steps on its own `KVCache`, as `Generation.step` runs it. Imports mlx."""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from runtime.generation import Generation, Loaded, batched_step
from runtime.mlx.cache_rows import add_row, prefix_of, remove_row
from runtime.mlx.spine_generation import last_logits


class MlxDecodeBatch:
    """`runtime.serving.decode_batch.DecodeBatch` on the MLX spine: every decoding generation's next token in one
    forward of `SpineModel` on one batched cache."""

    def __init__(self, loaded: Loaded) -> None:
        self.loaded = loaded
        self.rows: list[Generation] = []
        self.cache: list | None = None  # a row alone: its own KVCaches; several: BatchKVCaches, a row each
        self.widest = 0

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, gen: Generation) -> None:
        self.cache = add_row(self.cache if self.rows else None, gen.cache)
        gen.cache = None  # the batch holds it now
        self.rows.append(gen)

    def remove(self, gen: Generation) -> None:
        i = self.rows.index(gen)
        self.cache = remove_row(self.cache, i, len(self.rows))
        self.rows.pop(i)

    def step(self) -> None:
        self.widest = max(self.widest, len(self.rows))
        with batched_step(self.loaded, self.rows):
            out = self.loaded.model.forward([[gen.tokens[-1]] for gen in self.rows], self.cache)
            for i, gen in enumerate(self.rows):
                gen.sample(last_logits(out, i))


class MlxServing:
    """The server's view of the MLX spine."""

    def __init__(self, loaded: Loaded) -> None:
        self.loaded = loaded

    def reuse_off(self) -> str | None:
        plain = all(type(c) is KVCache for c in make_prompt_cache(self.loaded.model.mlx))
        return None if plain else "the model's cache is not plain full attention"

    def prefix(self, layers: list[tuple[mx.array, mx.array]], tokens: int) -> list[KVCache]:
        return prefix_of(layers, tokens)

    def keep(self, layers: list[tuple[mx.array, mx.array]], cache: list, tokens: int) -> list:
        return layers

    def decode_batch(self) -> MlxDecodeBatch:
        return MlxDecodeBatch(self.loaded)
