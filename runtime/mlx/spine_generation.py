"""Generation on the MLX spine: `runtime.generation.Generation`'s prefill and decode steps, run by `SpineModel`
through mlx-lm's model and its KV cache (`mlx_lm.models.cache.make_prompt_cache`), sampled as the torch spine
samples (on a view of MLX's logits: greedy is mlx-lm's argmax). A prefill may start from a reused prefix (the
server's prefix cache: `runtime.serving.mlx_serving`) and keep a copy of its KV at a boundary (`kept_layers`), and
with `echo` scores the prompt from every position's logits, as the torch spine's does. Imports mlx; never imports
`runtime.generation`."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import torch
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from runtime.loading.checkpoint_reader import transformers_config
from runtime.loading.model_config import read_config
from runtime.mlx.mlx_exact import to_torch
from runtime.mlx.overlap import Lanes, run_in_flight
from runtime.mlx.spine import MlxSpine, forward_rows
from runtime.prefill import chunk_spans


class SpineModel:
    """mlx-lm's model as generation reads a model (its config, generation config and vocabulary); `forward` runs it,
    under the plan where one is installed (`spine`)."""

    def __init__(self, model: nn.Module, path: Path, spine: MlxSpine | None, in_flight: int = 1) -> None:
        import transformers

        self.mlx, self.path, self.spine = model, path, spine
        self.config = transformers_config(path, read_config(path))
        try:
            self.generation_config = transformers.GenerationConfig.from_pretrained(path, local_files_only=True)
        except OSError:  # no generation_config.json: the model config's tokens
            self.generation_config = transformers.GenerationConfig.from_model_config(self.config)
        self.vocab = int(self.config.get_text_config().vocab_size)
        self.in_flight = in_flight  # prefill chunks in flight (`runtime.mlx.overlap`); 1: one at a time
        # every MoE layer mlx-lm's own (`MlxSpine.all_fast`): a prompt's last token then goes alone; across Macs,
        # every rank's stage (`runtime.mlx.cluster.load_rank`), so that the ranks make the same forwards
        self.all_fast = spine is None or spine.all_fast

    def get_input_embeddings(self) -> SimpleNamespace:
        return SimpleNamespace(num_embeddings=self.vocab)

    def make_cache(self) -> list:
        return make_prompt_cache(self.mlx)

    @staticmethod
    def cache_length(cache: list) -> int:
        """The tokens mlx-lm's per-layer cache of one sequence holds."""
        return cache[0].offset

    def prefill_steps(self, gen) -> Iterator[int]:
        """`Generation.prefill_steps` on this spine (`gen`: the generation): the same chunks, sampling and
        timings, each forward in MLX on mlx-lm's cache (the reused prefix's, continued)."""
        ids, n = gen.ids.tolist(), gen.ids.numel()
        cache = gen.prefix if gen.prefix is not None else self.make_cache()
        t0 = time.perf_counter()
        forwards = list(prefill_forwards(self, n, gen.chunk, gen.cached, gen.echo, gen.chunk_rows))
        if self.overlaps(gen, forwards):
            gen.loaded.pin_phase("prefill")
            out = self.forward_in_flight([(ids[start:done], rows) for start, done, rows in forwards], cache)
            forwards = []
        for start, done, rows in forwards:
            gen.loaded.pin_phase("prefill")
            out = self.forward(ids[start:done], cache, rows)
            if done == gen.keep_at:
                gen.kept = kept_layers(cache, done)
            if gen.echo:
                gen.score(start, done, to_torch(out[0].astype(mx.float32), torch.float32))
            if done < n and rows != "last":
                yield done
        if gen.max_tokens:
            gen.sample(last_logits(out))
        gen.cache = cache
        gen.t1 = time.perf_counter()
        gen.ttft_s = gen.t1 - t0

    def overlaps(self, gen, forwards: list) -> bool:
        """Whether this prefill runs its chunks in flight: several chunks under an installed plan, none scored
        (`echo`) or kept (`keep_at`) on the way."""
        return self.runs_in_flight(len(forwards)) and not gen.echo and gen.keep_at is None

    def runs_in_flight(self, forwards: int) -> bool:
        """Whether a prefill of `forwards` forwards runs them in flight: several, under an installed plan, with
        `in_flight` above 1."""
        return self.in_flight > 1 and forwards > 1 and self.spine is not None and self.spine.installed

    def forward_in_flight(self, pieces: list[tuple[list[int], str]], cache: list, in_flight: int | None = None,
                          lanes: Lanes | None = None) -> mx.array | None:
        """Each (ids, rows) forward under the plan with `in_flight` (default: this model's) chunks in flight
        (`runtime.mlx.overlap`), in order on `cache`, on `lanes` (default: new ones); the last one's output. Each
        lane's busy and wait time go to the spine's `executed`."""
        lanes = lanes or Lanes()

        def forward(ids: list[int], rows: str) -> Callable[[], mx.array | None]:
            return lambda: self.spine.forward(mx.array(ids, dtype=mx.uint32)[None], cache, rows)

        with self.spine.in_flight(lanes):
            out = run_in_flight([forward(ids, rows) for ids, rows in pieces], lanes, in_flight or self.in_flight)[-1]
        self.spine.add_lanes(lanes.figures())
        return out

    def step(self, gen) -> None:
        """`Generation.step` on this spine: one decode step on the generation's own cache. Greedy steps pipeline
        as mlx-lm's `generate_step` does: the next step is scheduled on this one's lazy argmax (`mx.async_eval`)
        before this one's token is read, so building one overlaps computing the other, and the caller's work on a
        token (detokenising, streaming) overlaps the next step. A generation ending on an end-of-text token leaves
        that step in its cache, as mlx-lm's does."""
        t = time.perf_counter()
        gen.loaded.pin_phase("decode")
        if not gen.greedy:
            out = self.forward([gen.tokens[-1]], gen.cache)
            gen.sample(last_logits(out))
        else:
            now = gen.ahead or self._greedy_step(mx.array([gen.tokens[-1]], dtype=mx.uint32), gen.cache)
            more = len(gen.tokens) + 1 < gen.max_tokens  # the token after this one will be asked for
            gen.ahead = self._greedy_step(now.token, gen.cache) if more else None
            now.done()
            gen.sample(last_logits(now.logits) if gen.top is not None else None, token=int(now.token.item()))
        gen.step_s.append(time.perf_counter() - t)

    def _greedy_step(self, token: mx.array, cache: list) -> SimpleNamespace:
        """A decode step feeding `token` (an MLX scalar, maybe lazy), scheduled: its logits, its argmax and, once
        they are evaluated, `done` (the plan's count of its expert calls)."""
        with mx.stream(generation_stream):
            x = token.reshape(1, 1)
            if self.spine is not None and self.spine.installed:
                logits, done = self.spine.schedule(x, cache)
            else:
                logits, done = forward_rows(self.mlx, x, cache, "last", lazy=True), lambda: None
            top = mx.argmax(logits[0, -1])
            mx.async_eval(top, logits)
        return SimpleNamespace(logits=logits, token=top, done=done)

    def forward(self, ids: list[int] | list[list[int]], cache: list, rows: str = "last") -> mx.array | None:
        """On mlx-lm's generation stream, as its own generation runs (one per thread). `ids`: one sequence's
        tokens, or a token per row of a batched cache (a batched decode step)."""
        x = mx.array(ids, dtype=mx.uint32)
        x = x[None] if x.ndim == 1 else x
        with mx.stream(generation_stream):
            if self.spine is not None and self.spine.installed:
                return self.spine.forward(x, cache, rows)
            return forward_rows(self.mlx, x, cache, rows)


def prefill_forwards(model: SpineModel, end: int, chunk: int, start: int = 0, every_position: bool = False,
                     rows: Sequence[int] = ()) -> Iterator[tuple[int, int, str]]:
    """(first, end, rows) of each forward prefilling tokens start..end in `chunk`s (`runtime.prefill.chunk_spans`:
    `rows` an uneven chunking, its chunks counted from `start`): the last row's logits at the end (`forward_rows`),
    or every row's. Under a plan whose every layer runs mlx-lm's own experts (no chunk size matters to it) the
    prompt's last token goes alone, as mlx-lm's prefill takes it: no row before it needs the last layer's attention
    output or experts, so they are never computed."""
    split = not every_position and model.all_fast
    for first, stop in chunk_spans(end - start, chunk, rows):
        first, stop = start + first, start + stop
        if every_position:
            yield first, stop, "all"
        elif stop < end:
            yield first, stop, "none"
        elif split and stop - first > 1:
            yield first, stop - 1, "none"
            yield stop - 1, stop, "last"
        else:
            yield first, stop, "last"


def kept_layers(cache: list, tokens: int) -> list[tuple[mx.array, mx.array]]:
    """Per layer, a copy of the keys and values of the cache's first `tokens` (what the prefix cache keeps): mlx-lm
    writes its cache in place and a view would pin its whole buffer; evaluated here, on the thread that made
    them."""
    kept = [(mx.contiguous(c.keys[..., :tokens, :]), mx.contiguous(c.values[..., :tokens, :])) for c in cache]
    mx.eval(kept)
    return kept


def last_logits(out: mx.array, row: int = 0) -> torch.Tensor:
    """Row `row`'s last position's logits as a float32 torch view (no copy where they are float32)."""
    row = out[row, -1]
    return to_torch(row if row.dtype == mx.float32 else row.astype(mx.float32), torch.float32)


def prompt_logits(model: SpineModel, ids: list[int], chunk_tokens: int, start: int, end: int,
                  every_position: bool = False, rows: Sequence[int] = ()) -> Iterator[torch.Tensor]:
    """Each forward's logits (float32 torch views of MLX's) prefilling `ids[start:end]` in chunks (`rows`: an
    uneven chunking) from an empty cache: every position's (`every_position`), else the prompt's last row (each
    chunk but the last then fills the cache only, as mlx-lm's prefill does). Each forward runs under the plan where
    it is installed at that moment, with the model's chunks in flight where it runs them so (only the last row's
    logits then: each chunk but the last fills the cache)."""
    cache = model.make_cache()
    forwards = list(prefill_forwards(model, end, chunk_tokens, start, every_position, rows))
    if not every_position and model.runs_in_flight(len(forwards)):
        out = model.forward_in_flight([(ids[first:done], kept) for first, done, kept in forwards], cache)
        yield to_torch(out[0].astype(mx.float32), torch.float32)
        return
    for first, done, kept in forwards:
        out = model.forward(ids[first:done], cache, kept)
        if out is not None:
            yield to_torch(out[0].astype(mx.float32), torch.float32)


def chunk_logits(model: SpineModel, prompt: torch.Tensor, chunk_tokens: int) -> Iterator[torch.Tensor]:
    """Every position's logits of a prompt, chunk by chunk (`[n, vocab]` each): the fidelity measures' prefill
    (`autotune.evaluation.fidelity.ChunkLogits`) on this spine."""
    return prompt_logits(model, prompt.tolist(), chunk_tokens, 0, prompt.numel(), every_position=True)


def prefill_logits(model: SpineModel, ids: torch.Tensor, chunk_tokens: int, prompt_tokens: int | None = None,
                   every_position: bool = False, rows: Sequence[int] = ()) -> torch.Tensor:
    """`runtime.prefill`'s prompt logits on the MLX spine, float32: every position's `[T, vocab]`
    (`every_position`), else each prompt's last `[prompts, vocab]` (`prompt_logits`). Prompts of `prompt_tokens`
    (default one), each from an empty cache, in chunks of `chunk_tokens` (`rows`: an uneven chunking first)."""
    n, step = ids.numel(), prompt_tokens or ids.numel()
    flat = ids.tolist()
    return torch.cat([out for s in range(0, n, step)
                      for out in prompt_logits(model, flat, chunk_tokens, s, min(s + step, n), every_position, rows)])
