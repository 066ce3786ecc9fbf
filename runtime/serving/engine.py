"""The engine behind the server: one loaded model (under its plan), its prefix cache, its queue and its metrics.

Everything that touches the model or the tokenizer runs on the scheduler's one worker thread, in arrival order:
encoding the prompt (a chat through the tokenizer's template, or the fallback format below), reusing a cached
prefix, then `runtime.generation.Generation`: the same prefill chunks, decode steps and sampling as
`runtime.generate`. Prefill and decode of different requests are never batched together. The calls go one way:
the engine looks the prompt up in the prefix cache, runs the generation (which keeps the KV tensors of the
prompt's last whole chunk, `Generation.kept`), then stores those in the cache; nothing calls back into the engine.

Chat fallback format, for a tokenizer without a chat template: one line per message, `System: ...`, `User: ...`,
`Assistant: ...` (a developer message reads as System), then `Assistant:` for the reply to follow.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field
from functools import partial

import torch

from runtime.errors import NpumoeError
from runtime.generation import ContextLimitError, Generation, Loaded, chat_prompt, max_new_tokens, prompt_ids
from runtime.serving.metrics import Metrics
from runtime.serving.prefix_cache import PrefixCache, supports_prefix_reuse
from runtime.serving.scheduler import Job, Scheduler
from runtime.serving.stop_sequences import StopText

log = logging.getLogger("npumoe.serve")

FALLBACK_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}


class RequestError(Exception):
    """A request the server refuses: its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


@dataclass(frozen=True)
class GenerationRequest:
    """One generation request, checked against the schema: exactly one of `text`, `ids`, `messages`."""
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    text: str | None = None
    ids: list[int] | None = None
    messages: list[dict] | None = None
    logprobs: int | None = None  # each token's log-probability and this many alternatives (None: none)
    echo: bool = False  # the prompt (and its log-probabilities) before the completion


def fallback_chat_text(messages: list[dict]) -> str:
    return "".join(f"{FALLBACK_ROLES[m['role']]}: {m['content']}\n" for m in messages) + "Assistant:"


class Engine:
    def __init__(self, loaded: Loaded, model_id: str, max_queue: int, prefix_cache_mb: float) -> None:
        self.loaded, self.model_id = loaded, model_id
        self.chunk = loaded.plan.chunk_tokens if loaded.plan else None
        self.prefix_cache, self.prefix_cache_off = None, None
        if self.chunk is None:
            self.prefix_cache_off = "no plan: prefill runs the whole prompt at once, so there is no chunk to reuse"
        elif not supports_prefix_reuse(loaded.model):
            self.prefix_cache_off = "the model's cache is not plain full attention"
        elif prefix_cache_mb <= 0:
            self.prefix_cache_off = "--prefix-cache-mb 0"
        else:
            self.prefix_cache = PrefixCache(loaded.model, self.chunk, int(prefix_cache_mb * 2**20))
        self.scheduler = Scheduler(max_queue)
        self.metrics = Metrics(lambda: self.scheduler.depth,
                               lambda: self.prefix_cache.nbytes if self.prefix_cache else 0)

    def warm_up(self) -> None:
        """One short untimed generation, so the first client does not pay first-call costs; then count afresh."""
        for _ in Generation(self.loaded, prompt_ids(self.loaded, "Hello"), 2, 0.0, 0, self.chunk).token_ids():
            pass
        self.loaded.reset()

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue `request` (QueueFull, Closed: refused). Its job's events: ("start", prompt tokens) or ("error",
        RequestError); then ("text", piece)... and ("done", figures); `None` ends them."""
        job = Job(partial(self._serve, request), loop)
        self.scheduler.submit(job)
        return job

    def close(self, timeout_s: float | None = None) -> None:
        self.scheduler.close(timeout_s)

    def health(self) -> dict:
        cache = {"entries": len(self.prefix_cache.entries), "bytes": self.prefix_cache.nbytes,
                 "max_bytes": self.prefix_cache.max_bytes} if self.prefix_cache else {"off": self.prefix_cache_off}
        return {"status": "ok", "model": self.model_id, "plan": self.loaded.plan is not None,
                "queue_depth": self.scheduler.depth, "max_queue": self.scheduler.max_queue, "prefix_cache": cache}

    def check_max_tokens(self, max_tokens: int, echo: bool = False) -> None:
        """Refuse, before the request queues, a `max_tokens` no prompt could meet (`max_new_tokens`, the one
        rule)."""
        try:
            max_new_tokens(self.loaded.model, 0, max_tokens, 0 if echo else 1)
        except ContextLimitError as e:
            raise RequestError(400, str(e), e.param) from None

    def _encode(self, request: GenerationRequest) -> torch.Tensor:
        """The request's prompt as token ids (a chat through the template or the fallback format), checked
        against the context by `max_new_tokens`."""
        prompt = request.text if request.text is not None else request.ids
        if request.messages is not None:
            try:
                text = chat_prompt(self.loaded.tokenizer, request.messages)
            except Exception as e:  # the template's own refusal (roles out of order, ...)
                raise RequestError(400, f"the chat template refused the messages: {e}", "messages") from e
            prompt = fallback_chat_text(request.messages) if text is None else text
        try:
            ids = prompt_ids(self.loaded, prompt)
            max_new_tokens(self.loaded.model, ids.numel(), request.max_tokens, 0 if request.echo else 1)
        except ContextLimitError as e:
            raise RequestError(400, str(e), e.param, "context_length_exceeded") from e
        except NpumoeError as e:
            raise RequestError(400, str(e), "messages" if request.messages is not None else "prompt") from e
        return ids

    def _serve(self, request: GenerationRequest, job: Job) -> None:
        if job.cancelled.is_set():
            return
        try:
            ids = self._encode(request)
        except RequestError as e:
            job.emit(("error", e))
            return
        job.emit(("start", ids.numel()))
        try:
            self._generate(request, ids, job)
        except Exception as e:
            log.exception("generation failed")
            job.emit(("error", RequestError(500, f"generation failed: {e}", type_="server_error")))

    def _generate(self, request: GenerationRequest, ids: torch.Tensor, job: Job) -> None:
        self.loaded.stats.reset()  # this request's figures; the drift monitor keeps watching across requests
        # an echo scores every prompt token: the logits of a reused prefix are not kept, so none is reused then
        prefix = self.prefix_cache.lookup(ids) if self.prefix_cache and not request.echo else None
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        gen = Generation(self.loaded, ids, request.max_tokens, request.temperature, seed, self.chunk,
                         request.top_p, prefix, self._keep_at(ids, prefix), request.logprobs, request.echo)
        stop, texts, finish, sent = StopText(request.stop), [], None, 0

        def emit(text: str) -> None:  # the text and the log-probabilities of the tokens not sent yet
            nonlocal sent
            job.emit(("text", text, gen.token_logprobs[sent:]))
            sent = len(gen.token_logprobs)
        pieces = gen.pieces(every_token=True)
        try:
            for piece in pieces:
                if job.cancelled.is_set():
                    break
                if not texts and request.echo:  # prefill is done: the prompt and its log-probabilities first
                    texts.append(self._prompt_text(request, ids))
                    job.emit(("text", texts[0], gen.prompt_logprobs))
                text, hit = stop.feed(piece)
                texts.append(text)
                if not hit or text:  # a chunk per token, text or not: the client sees each token arrive
                    emit(text)
                if hit:
                    finish = "stop"
                    break
            else:
                if not texts and request.echo:  # nothing generated (max_tokens 0, or an end of text at once)
                    texts.append(self._prompt_text(request, ids))
                    job.emit(("text", texts[0], gen.prompt_logprobs))
                texts.append(stop.flush())
                if texts[-1]:
                    emit(texts[-1])
                finish = "stop" if gen.finish_reason == "eos" else "length"
        finally:
            pieces.close()
            if gen.kept is not None:
                self.prefix_cache.store(ids[:gen.keep_at], gen.kept)
        if finish is None:  # the client left: nothing more to say to it
            self.metrics.cancelled.inc()
            return
        figures = self._figures(gen, job, finish, "".join(texts))
        figures["stop_sequence"] = stop.matched
        if request.logprobs is not None:
            figures.update(logprobs=gen.prompt_logprobs + gen.token_logprobs, unsent_logprobs=gen.token_logprobs[sent:])
        job.emit(("done", figures))

    def _prompt_text(self, request: GenerationRequest, ids: torch.Tensor) -> str:
        return request.text if request.text is not None else self.loaded.tokenizer.decode(
            ids.tolist(), skip_special_tokens=True)

    def _keep_at(self, ids: torch.Tensor, prefix: object | None) -> int | None:
        """The prompt's last whole-chunk boundary, where its KV cache is worth keeping (past what was reused)."""
        if self.prefix_cache is None:
            return None
        target = ids.numel() // self.chunk * self.chunk
        return target if target > (prefix.get_seq_length() if prefix is not None else 0) else None

    def _figures(self, gen: Generation, job: Job, finish: str, text: str) -> dict:
        """What the response reports (usage and the `npumoe` object), and the metrics it adds to."""
        r = gen.result(text)
        m = self.metrics
        m.prompt_tokens.inc(r.prompt_tokens)
        m.cached_tokens.inc(gen.cached)
        m.generated_tokens.inc(r.generated_tokens)
        m.ttft.observe(r.ttft_ms / 1e3)
        m.queue_wait.observe(job.started_at - job.queued_at)
        m.dropped.inc(r.dropped)
        m.spilled.inc(r.spilled)
        m.static_calls.labels("prefill").inc(r.prefill_static_calls)
        m.static_calls.labels("decode").inc(r.decode_static_calls)
        drift = None
        if self.loaded.executor is not None:
            report = self.loaded.executor.drift.report()
            drift = {k: report[k] for k in ("alert", "reason", "rate", "chunks_seen")}
            m.drift_alert.set(int(report["alert"]))
        npumoe = {"ttft_ms": r.ttft_ms, "queue_ms": (job.started_at - job.queued_at) * 1e3,
                  "prefill_tok_s": r.prefill_tok_s, "generation_tok_s": r.generation_tok_s,
                  "cached_tokens": gen.cached, "dropped": r.dropped, "spilled": r.spilled,
                  "prefill_static_calls": r.prefill_static_calls, "decode_static_calls": r.decode_static_calls,
                  "drift": drift, "token_ids": r.token_ids}
        return {"finish_reason": finish, "text": text, "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.generated_tokens, "cached_tokens": gen.cached, "npumoe": npumoe}
