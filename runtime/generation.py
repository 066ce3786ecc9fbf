"""Text generation under a plan: the runtime's application API, after mlx-lm's `load` / `generate` /
`stream_generate`.

Prefill feeds the prompt in the plan's chunks (as `autotune run` does), so static groups see the chunk sizes they
were tuned for; decode feeds one token a step, which the executor's decode policy runs exactly. Everything
reported is measured here: time to first token (prefill + first sample), prefill and generation tokens per second,
the process's peak RSS, and the executor's statistics (prefill and decode apart).
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from runtime.errors import NpumoeError
from runtime.executor import PlanExecutor
from runtime.loading.checkpoints import check_token_ids
from runtime.loading.model_loader import load_model
from runtime.plan import Plan, load_plan
from runtime.prefill import prefill_chunks
from runtime.resources import peak_rss_mb
from runtime.stats import RunStats

log = logging.getLogger("npumoe")

DEFAULT_MAX_TOKENS = 100


@dataclass
class Loaded:
    """A model ready to generate. `.model` has the plan installed, so `.model.generate()` runs under it too."""
    model: torch.nn.Module
    tokenizer: object
    plan: Plan | None = None
    executor: PlanExecutor | None = None
    _no_stats: RunStats = field(default_factory=RunStats, repr=False)

    @property
    def stats(self) -> RunStats:
        """What the executor did (prefill and decode apart); empty without a plan."""
        return self.executor.stats if self.executor else self._no_stats

    def reset(self) -> None:
        """Count afresh: run statistics and the drift monitor."""
        if self.executor:
            self.executor.reset()

    @contextmanager
    def unmodified(self) -> Iterator[None]:
        """The model without the plan for the duration (a reference run)."""
        with self.executor.applied(False) if self.executor else nullcontext():
            yield


def load(model: str, plan: str | os.PathLike | Plan | None = None, package: str | None = None,
         dtype: str = "auto", cpu_weights: str | None = None, group_size: int = 64) -> Loaded:
    """Load `model` (a built-in name, a local transformers directory or an MLX folder) and install `plan` on it, if
    given. `package`: the Core ML package `autotune build` made for the plan's `ane` groups. `cpu_weights`: int8 or
    int4 (groups of `group_size`) quantizes the experts the CPU holds at load (`runtime.cpu_weights`); None: as the
    plan's optional `cpu_weights` says, else as loaded."""
    p = None if plan is None else plan if isinstance(plan, Plan) else load_plan(plan)
    if cpu_weights is None and p is not None and p.cpu_weights is not None:
        cpu_weights, group_size = p.cpu_weights.kind, p.cpu_weights.group_size or group_size
    m, tokenizer = load_model(model, dtype, cpu_weights or "bf16", group_size)
    if p is None:
        if package:
            raise NpumoeError("a package runs a plan's ane groups: give the plan too")
        return Loaded(m, tokenizer)
    path = "" if isinstance(plan, Plan) else str(plan)
    backends = None
    if package:  # checked on any host, whether or not it can run here (then its groups run where ane falls back)
        from runtime.coreml.ane import open_package

        ane = open_package(package, p, m, path)
        backends = {ane.name: ane}
    executor = PlanExecutor(m, p, backends, plan_path=path, options={"package": package}).install()
    return Loaded(m, tokenizer, p, executor)


def chat_prompt(tokenizer: object, prompt: str | list[dict]) -> str | None:
    """The prompt (one user turn, or a list of {"role", "content"} messages) in the tokenizer's chat template, ready
    for the assistant's turn; None when it has no template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def prompt_ids(loaded: Loaded, prompt: str | Sequence[int], chat: bool = False) -> torch.Tensor:
    """The prompt's token ids as generation feeds them (chat template applied when asked)."""
    if not isinstance(prompt, str):  # token ids already
        ids = list(prompt)
        if chat:
            raise NpumoeError("chat needs the prompt as text, not token ids")
    else:
        text = chat_prompt(loaded.tokenizer, prompt) if chat else None
        if chat and text is None:
            log.warning("the tokenizer has no chat template; the prompt is used as it is")
        ids = loaded.tokenizer.encode(prompt if text is None else text, add_special_tokens=False)
    if len(ids) == 0:
        raise NpumoeError("the prompt holds no tokens")
    tensor = torch.tensor(ids, dtype=torch.long)
    check_token_ids(loaded.model, tensor)
    return tensor


def _eos_ids(loaded: Loaded) -> set[int]:
    eos = getattr(loaded.model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = loaded.model.config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _sample(logits: torch.Tensor, temp: float, gen: torch.Generator, top_p: float = 1.0) -> int:
    if temp <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temp, dim=-1)
    if top_p < 1.0:  # nucleus: the most likely tokens whose mass reaches top_p (always at least the first)
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs >= top_p
        sorted_probs[outside] = 0.0
        return int(order[torch.multinomial(sorted_probs, 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))


def _decode(tokenizer: object, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def context_positions(model: torch.nn.Module) -> int | None:
    """How many positions the model's context holds (config `max_position_embeddings`); None where unstated."""
    n = getattr(model.config, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def max_new_tokens(model: torch.nn.Module, prompt_tokens: int, max_tokens: int) -> int:
    """The one rule for new tokens against the model's context (`generate`, `stream_generate`, the server):
    refused up front when `max_tokens` alone is past the context (a request no prompt could fit, such as 10**12)
    or the prompt leaves no room for one new token; otherwise `max_tokens` bounded so that prompt + new <=
    positions, generation past the bound stopping with finish_reason "length"."""
    if max_tokens < 1:
        raise NpumoeError(f"max_tokens must be at least 1, got {max_tokens}")
    positions = context_positions(model)
    if positions is None:
        return max_tokens
    if max_tokens > positions:
        raise NpumoeError(f"max_tokens {max_tokens} is past the model's context of {positions} positions: ask "
                          f"for at most {max(0, positions - prompt_tokens)} new tokens after this prompt")
    if prompt_tokens >= positions:
        raise NpumoeError(f"the prompt holds {prompt_tokens} tokens; the model's context holds {positions} "
                          "positions, so no token fits after it")
    return min(max_tokens, positions - prompt_tokens)


class Generation:
    """One generation: produces tokens, then text pieces, and keeps the measured timings.

    `prefix`: a KV cache already holding the prompt's first tokens (a multiple of `chunk_tokens`, fewer than the
    prompt), so prefill starts after them and meets the same chunk boundaries as without it. `on_prefill_chunk`
    sees (tokens prefilled so far, the cache) after each prefill chunk. Stopping the iteration early is
    cancelling: nothing more runs."""

    def __init__(self, loaded: Loaded, ids: torch.Tensor, max_tokens: int, temp: float, seed: int,
                 chunk_tokens: int | None, top_p: float = 1.0, prefix: object | None = None,
                 on_prefill_chunk: Callable[[int, object], None] | None = None) -> None:
        self.loaded, self.ids, self.temp, self.top_p = loaded, ids, temp, top_p
        self.max_tokens = max_new_tokens(loaded.model, ids.numel(), max_tokens)
        self.gen = torch.Generator().manual_seed(seed)
        self.chunk = chunk_tokens or ids.numel()
        self.prefix, self.on_prefill_chunk = prefix, on_prefill_chunk
        self.cached = prefix.get_seq_length() if prefix is not None else 0
        if self.cached % self.chunk or self.cached >= ids.numel():
            raise NpumoeError(f"a reused prefix must be a whole number of {self.chunk}-token chunks shorter than "
                              f"the prompt, got {self.cached} of {ids.numel()} tokens")
        self.tokens: list[int] = []
        self.ttft_s = self.decode_s = 0.0
        self.step_s: list[float] = []  # each decode step's forward + sample, without the caller's time between
        self.finish_reason = "length"

    def _phase(self, phase: str) -> None:
        if self.loaded.executor:
            self.loaded.executor.set_phase(phase, pin=True)

    def token_ids(self) -> Iterator[int]:
        model, eos, ex = self.loaded.model, _eos_ids(self.loaded), self.loaded.executor
        try:
            self._phase("prefill")
            t0 = time.perf_counter()
            done = self.cached
            with torch.inference_mode():
                for out in prefill_chunks(model, self.ids[self.cached:], self.chunk, last_logits_only=True,
                                          cache=self.prefix):
                    done = min(done + self.chunk, self.ids.numel())
                    if self.on_prefill_chunk is not None:
                        self.on_prefill_chunk(done, out.cache)
                tok = _sample(out.logits[0, -1], self.temp, self.gen, self.top_p)
            t1 = time.perf_counter()
            self.ttft_s = t1 - t0
            self._phase("decode")
            cache = out.cache
            while True:
                if tok in eos:
                    self.finish_reason = "eos"
                    return
                self.tokens.append(tok)
                self.decode_s = time.perf_counter() - t1
                yield tok
                if len(self.tokens) >= self.max_tokens:
                    return
                t = time.perf_counter()
                with torch.inference_mode():
                    out = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True, logits_to_keep=1)
                    tok = _sample(out.logits[0, -1], self.temp, self.gen, self.top_p)
                self.step_s.append(time.perf_counter() - t)
                cache = out.cache
        finally:
            if ex:
                ex.pinned = False

    def pieces(self, every_token: bool = False) -> Iterator[str]:
        """Incremental detokenisation: yield the new text after each token, holding back a trailing incomplete
        character (U+FFFD) until the bytes that finish it arrive. `every_token`: yield "" for a token that adds no
        text yet (a server's client then sees every token arrive)."""
        shown = ""
        for _ in self.token_ids():
            text = _decode(self.loaded.tokenizer, self.tokens)
            if text.endswith("\ufffd") or len(text) <= len(shown):
                if every_token:
                    yield ""
                continue
            yield text[len(shown):]
            shown = text
        text = _decode(self.loaded.tokenizer, self.tokens)
        if len(text) > len(shown):
            yield text[len(shown):]

    def result(self, text: str) -> dict:
        stats = self.loaded.stats
        total = stats.total()
        n = len(self.tokens)
        return {"prompt_tokens": int(self.ids.numel()), "generated_tokens": n,
                "ttft_ms": self.ttft_s * 1e3, "prefill_tok_s": (self.ids.numel() - self.cached) / self.ttft_s,
                "generation_tok_s": (n - 1) / self.decode_s if n > 1 and self.decode_s > 0 else None,
                "decode_step_ms": statistics.median(self.step_s) * 1e3 if self.step_s else None,
                "peak_rss_mb": peak_rss_mb(), "dropped": total.dropped, "spilled": total.spilled,
                "prefill_static_calls": stats.static_calls("prefill"),
                "decode_static_calls": stats.static_calls("decode"), "finish_reason": self.finish_reason,
                "chunk_tokens": self.chunk, "token_ids": list(self.tokens), "text": text}


def _start(loaded: Loaded, prompt: str | Sequence[int], max_tokens: int, temp: float, seed: int,
           chat: bool) -> Generation:
    ids = prompt_ids(loaded, prompt, chat)
    return Generation(loaded, ids, max_tokens, temp, seed, loaded.plan.chunk_tokens if loaded.plan else None)


def stream_generate(loaded: Loaded, prompt: str | Sequence[int], max_tokens: int = DEFAULT_MAX_TOKENS,
                    temp: float = 0.0, seed: int = 0, chat: bool = False) -> Iterator[str]:
    """Yield the generated text piece by piece as it comes (greedy when `temp` is 0). `prompt`: text or token
    ids."""
    run = _start(loaded, prompt, max_tokens, temp, seed, chat)
    loaded.reset()
    yield from run.pieces()


def generate(loaded: Loaded, prompt: str | Sequence[int], max_tokens: int = DEFAULT_MAX_TOKENS, temp: float = 0.0,
             seed: int = 0, chat: bool = False, compare: bool = False,
             on_text: Callable[[str], None] | None = None) -> dict:
    """Generate from `prompt`; returns the measured figures and the text (see `autotune generate --json`).

    `on_text` receives each text piece as it comes. `compare` also runs the unmodified model on the same prompt
    (same prefill chunks) after an untimed warm-up of both, and reports its timings, the speed ratios and whether
    the tokens match."""
    run = _start(loaded, prompt, max_tokens, temp, seed, chat)
    if compare:
        _warm_up(loaded, run.ids, run.chunk)
    loaded.reset()
    pieces = []
    for piece in run.pieces():
        pieces.append(piece)
        if on_text is not None:
            on_text(piece)
    result = run.result("".join(pieces))
    if compare:
        with loaded.unmodified():
            ref = Generation(loaded, run.ids, max_tokens, temp, seed, run.chunk)
            for _ in ref.token_ids():
                pass
        result.update(reference_ttft_ms=ref.ttft_s * 1e3, reference_prefill_tok_s=run.ids.numel() / ref.ttft_s,
                      reference_generation_tok_s=(len(ref.tokens) - 1) / ref.decode_s
                      if len(ref.tokens) > 1 and ref.decode_s > 0 else None,
                      prefill_speedup=ref.ttft_s / run.ttft_s,
                      generation_speedup=_ratio(result["generation_tok_s"], ref.decode_s, len(ref.tokens)),
                      same_tokens=ref.tokens == run.tokens)
    return result


def _ratio(ours_tok_s: float | None, ref_decode_s: float, ref_tokens: int) -> float | None:
    """Our generation speed over the reference's (>1: ours is faster)."""
    if ours_tok_s is None or ref_tokens < 2 or ref_decode_s <= 0:
        return None
    return ours_tok_s / ((ref_tokens - 1) / ref_decode_s)


def _warm_up(loaded: Loaded, ids: torch.Tensor, chunk: int) -> None:
    """One short untimed generation each way, so neither measured run pays first-call costs."""
    for ctx in (loaded.unmodified, nullcontext):
        with ctx():
            for _ in Generation(loaded, ids, 2, 0.0, 0, chunk).token_ids():
                pass
