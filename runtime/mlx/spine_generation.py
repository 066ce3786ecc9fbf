"""Generation on the MLX spine: prefill in the plan's chunks and decode steps through mlx-lm's model and its KV cache
(`mlx_lm.models.cache.make_prompt_cache`), sampled as the torch spine samples (`generation._sample`, on a view of
MLX's logits: greedy is mlx-lm's argmax). Imports mlx."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import torch
from mlx_lm.models.cache import make_prompt_cache

from runtime.errors import NpumoeError
from runtime.generation import Generation
from runtime.loading.checkpoint_reader import transformers_config
from runtime.mlx.mlx_exact import to_torch
from runtime.mlx.spine import MlxSpine, forward_rows


class SpineModel:
    """mlx-lm's model as generation reads a model (its config, generation config and vocabulary); `forward` runs it,
    under the plan where one is installed (`spine`)."""

    def __init__(self, model: nn.Module, path: Path, spine: MlxSpine | None) -> None:
        import transformers

        self.mlx, self.path, self.spine = model, path, spine
        self.config = transformers_config(path)
        try:
            self.generation_config = transformers.GenerationConfig.from_pretrained(path, local_files_only=True)
        except OSError:  # no generation_config.json: the model config's tokens
            self.generation_config = transformers.GenerationConfig.from_model_config(self.config)
        self.vocab = int(self.config.get_text_config().vocab_size)

    def get_input_embeddings(self) -> SimpleNamespace:
        return SimpleNamespace(num_embeddings=self.vocab)

    def make_cache(self) -> list:
        return make_prompt_cache(self.mlx)

    def forward(self, ids: list[int], cache: list, rows: str = "last") -> mx.array | None:
        x = mx.array(ids, dtype=mx.uint32)[None]
        if self.spine is not None and self.spine.installed:
            return self.spine.forward(x, cache, rows)
        return forward_rows(self.mlx, x, cache, rows)


def last_logits(out: mx.array) -> torch.Tensor:
    """The last position's logits as a float32 torch view (no copy where they are float32)."""
    row = out[0, -1]
    return to_torch(row if row.dtype == mx.float32 else row.astype(mx.float32), torch.float32)


class SpineGeneration(Generation):
    """`Generation` on the MLX spine: the same sampling, stopping and timings; prefill and decode steps in MLX."""

    def prefill_steps(self) -> Iterator[int]:
        if self.echo or self.prefix is not None or self.keep_at is not None:
            raise NpumoeError("echo, a reused prefix and kept KV tensors run on the torch spine only: use "
                              "--engine torch")
        model: SpineModel = self.loaded.model
        ids, n = self.ids.tolist(), self.ids.numel()
        cache = model.make_cache()
        t0 = time.perf_counter()
        for start in range(0, n, self.chunk):
            self.loaded.pin_phase("prefill")
            done = min(start + self.chunk, n)
            out = model.forward(ids[start:done], cache, "last" if done == n else "none")
            if done < n:
                yield done
        if self.max_tokens:
            self.sample(last_logits(out))
        self.cache = cache
        self.t1 = time.perf_counter()
        self.ttft_s = self.t1 - t0

    def step(self) -> None:
        t = time.perf_counter()
        self.loaded.pin_phase("decode")
        out = self.loaded.model.forward([self.tokens[-1]], self.cache)
        self.sample(last_logits(out))
        self.step_s.append(time.perf_counter() - t)


def prefill_logits(model: SpineModel, ids: torch.Tensor, chunk_tokens: int, prompt_tokens: int | None = None,
                   every_position: bool = False) -> torch.Tensor:
    """`runtime.prefill`'s prompt logits on the MLX spine, float32: every position's `[T, vocab]`
    (`every_position`), else each prompt's last `[prompts, vocab]` (each chunk but a prompt's last then fills the
    cache only, as mlx-lm's prefill does). Prompts of `prompt_tokens` (default one), each from an empty cache."""
    n, step = ids.numel(), prompt_tokens or ids.numel()
    flat, rows = ids.tolist(), []
    for s in range(0, n, step):
        cache = model.make_cache()
        end = min(s + step, n)
        for start in range(s, end, chunk_tokens):
            done = min(start + chunk_tokens, end)
            out = model.forward(flat[start:done], cache, "all" if every_position else "last" if done == end
                                else "none")
            if out is not None:
                rows.append(to_torch(out[0].astype(mx.float32), torch.float32))
    return torch.cat(rows)
