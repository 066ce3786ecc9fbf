"""The engine behind the server: one loaded model (under its plan), its prefix cache, its queue and its metrics.

The engine's thread runs every tokenizer call and the decode steps. A request starts in arrival order (its prompt
encoded: a chat through the tokenizer's template, or the fallback format below; a cached prefix looked up) and up
to `max_batch` requests are active at once (continuous batching). Each round runs prefills (`_prefills`: one
request at a time, in the plan's chunks, each request alone, as `runtime.generate` runs them) and then one decode
step of every decoding request together (the spine's batch, `serving_spine`: one forward, each row at its own
position, each with its own sampling and stop sequences). Either spine runs it, torch's or MLX's, under this one
scheduler (`ServingSpine`: its KV caches, its prefix cache entries, its batched decode step). A long prompt that
arrives while others decode prefills on the prefill thread, with its own KV cache, while the rounds keep decoding
(on a Mac its static groups run on the ANE; on Linux it takes another core, at a lower priority), so its prefill
does not stall the streams; the executor keeps its phase per thread, so its counts stay its own. The calls go one
way: engine -> prefix cache -> generation -> prefix cache (the caches are only touched from the engine's thread).

Chat fallback format, for a tokenizer without a chat template: one line per message, `System: ...`, `User: ...`,
`Assistant: ...` (a developer message reads as System), then `Assistant:` for the reply to follow.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial

import torch

from runtime.errors import NpumoeError
from runtime.generation import (
    ContextLimitError,
    Generation,
    Loaded,
    cache_length,
    chat_prompt,
    max_new_tokens,
    prompt_ids,
)
from runtime.serving.disk_prefix_cache import DiskPrefixCache
from runtime.serving.metrics import Metrics
from runtime.serving.prefix_cache import PrefixCache, keeps_tail
from runtime.serving.request_stream import COUNTS, RequestStream, executor_counts
from runtime.serving.scheduler import Job, Scheduler
from runtime.serving.serving_spine import serving_spine

log = logging.getLogger("npumoe.serve")

DEFAULT_DISK_GB = 4.0  # the prefix cache on disk, when --prefix-cache-dir is given
DEFAULT_MAX_BATCH = 8  # requests decoding together (a laptop's worth); more wait in the queue
PREFILL_NICE = 10  # the prefill thread's nice value beside decoding streams (Linux)
INLINE_PREFILL_TOKENS = 64  # a prefill this short runs in the engine's round even beside decoding streams
FALLBACK_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}


def background() -> None:
    """Run the calling thread (the prefill thread) at a lower priority than decode where the OS allows it per
    thread (Linux: its nice value), so decode steps keep their pace on a busy CPU (llama.cpp's `--prio-batch`)."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREFILL_NICE)
        except OSError as e:
            log.warning("the prefill thread keeps its priority: %s", e)


class RequestError(Exception):
    """A request the server refuses: its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def __reduce__(self) -> tuple:  # across the engine process's pipe
        return RequestError, (self.status, self.message, self.param, self.code, self.type)


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


def disk_cache_off(engine: str) -> str | None:
    """Why `--prefix-cache-dir` cannot run on the spine `engine` (None: it can)."""
    if engine == "torch":
        return None
    return ("--prefix-cache-dir keeps the torch spine's KV tensors, tied to a digest of its torch weights; on "
            "--engine mlx the prefix cache is in memory only (--prefix-cache-mb): leave --prefix-cache-dir out, or use "
            "--engine torch")


def fallback_chat_text(messages: list[dict]) -> str:
    return "".join(f"{FALLBACK_ROLES[m['role']]}: {m['content']}\n" for m in messages) + "Assistant:"


class Engine:
    def __init__(self, loaded: Loaded, model_id: str, max_queue: int, prefix_cache_mb: float,
                 max_batch: int = DEFAULT_MAX_BATCH, prefix_cache_dir: str | None = None,
                 prefix_cache_disk_gb: float = DEFAULT_DISK_GB) -> None:
        self.loaded, self.model_id = loaded, model_id
        self.spine = serving_spine(loaded)  # the KV caches and the batched decode step of the model's spine
        self.chunk = loaded.plan.chunk_tokens if loaded.plan else None
        self.prefix_cache, self.prefix_cache_off = None, None
        reuse_off = self.spine.reuse_off()
        # across Macs, a tail is kept where every rank's plan runs it exactly (`runtime.mlx.cluster.load_rank`)
        self.exact_below = loaded.cluster.exact_below if loaded.cluster is not None else \
            loaded.plan.exact_below if loaded.plan else None
        if self.chunk is None:
            self.prefix_cache_off = "no plan: prefill runs the whole prompt at once, so there is no chunk to reuse"
        elif reuse_off is not None:
            self.prefix_cache_off = reuse_off
        elif prefix_cache_mb <= 0:
            self.prefix_cache_off = "--prefix-cache-mb 0"
        else:
            self.prefix_cache = PrefixCache(self.spine, self.chunk, int(prefix_cache_mb * 2**20), self.exact_below)
        self.disk_cache = None
        if prefix_cache_dir is not None:
            if (off := disk_cache_off(loaded.engine)) is not None:
                raise NpumoeError(off)
            if self.chunk is None or reuse_off is not None:
                raise NpumoeError("--prefix-cache-dir keeps whole prefill chunks: it needs --plan and a model with "
                                  "plain full attention")
            try:
                self.disk_cache = DiskPrefixCache(prefix_cache_dir, int(prefix_cache_disk_gb * 2**30), loaded.model,
                                                  loaded.plan)
            except OSError as e:
                raise NpumoeError(f"--prefix-cache-dir {prefix_cache_dir}: {e.strerror or e}") from e
        self.batch = self.spine.decode_batch()
        # prefill runs on its own thread (one request at a time) while this engine's thread keeps decoding
        self.prefill_thread = ThreadPoolExecutor(1, thread_name_prefix="npumoe-prefill", initializer=background)
        self.prefill: tuple[RequestStream, Future] | None = None
        self.beside_prefill = 0  # decode steps run while a prefill ran on its thread (what a test reads)
        # What the tokens of one batched step are sent under (the engine process holds them and sends them as one)
        self.step_events: Callable[[], AbstractContextManager] = contextlib.nullcontext
        self.scheduler = Scheduler(max_queue, max_batch, self._round)
        self.metrics = Metrics(lambda: self.scheduler.depth,
                               lambda: self.prefix_cache.nbytes if self.prefix_cache else 0)
        if loaded.cluster is not None:
            loaded.cluster.link.keep_alive()

    def warm_up(self) -> None:
        """One short untimed generation, so the first client does not pay first-call costs; then count afresh."""
        for _ in Generation(self.loaded, prompt_ids(self.loaded, "Hello"), 2, 0.0, 0, self.chunk).token_ids():
            pass
        self.loaded.reset()

    @property
    def tokenizer(self) -> object:
        return self.loaded.tokenizer

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None,
               make_job: Callable[[Callable, asyncio.AbstractEventLoop | None], Job] = Job) -> Job:
        """Queue `request` (RequestError: a `max_tokens` no prompt could meet; QueueFull, Closed: refused). Its
        job (`make_job(work, loop)`) sends ("start", prompt tokens) or ("error", RequestError); then ("text",
        piece)... and ("done", figures); `None` ends them."""
        self.check_max_tokens(request.max_tokens, request.echo)  # before it queues; the prompt's part later
        job = make_job(partial(self._serve, request), loop)
        self.scheduler.submit(job)
        return job

    def cancel(self, job: Job) -> None:
        """The client left (a no-op once the job is done)."""
        self.scheduler.cancel(job)

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def close(self, timeout_s: float | None = None) -> None:
        self.scheduler.close(timeout_s)
        self.prefill_thread.shutdown(wait=False, cancel_futures=True)
        if self.loaded.cluster is not None:  # the followers end with it
            self.loaded.cluster.link.end()

    def health(self) -> dict:
        cache = {"entries": len(self.prefix_cache.entries), "bytes": self.prefix_cache.nbytes,
                 "max_bytes": self.prefix_cache.max_bytes} if self.prefix_cache else {"off": self.prefix_cache_off}
        if self.disk_cache is not None:
            cache["disk"] = {"dir": str(self.disk_cache.folder), "bytes": self.disk_cache.nbytes,
                             "max_bytes": self.disk_cache.max_bytes}
        return {"status": "ok", "model": self.model_id, "engine": self.loaded.engine,
                "plan": self.loaded.plan is not None,
                "active": self.scheduler.active, "max_batch": self.scheduler.max_active,
                "queue_depth": self.scheduler.depth, "max_queue": self.scheduler.max_queue, "prefix_cache": cache,
                **({"cluster": self.loaded.cluster.health()} if self.loaded.cluster is not None else {})}

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

    def _serve(self, request: GenerationRequest, job: Job) -> RequestStream | None:
        """Start `request` on the worker: its prompt encoded and checked, its generation set up (None: refused
        or failed, its job told so)."""
        if job.cancelled.is_set():
            return None
        try:
            ids = self._encode(request)
        except RequestError as e:
            job.emit(("error", e))
            return None
        job.emit(("start", ids.numel()))
        try:
            return RequestStream(self, request, ids, job)
        except Exception as e:
            self._fail(job, e)
            return None

    def _round(self, active: dict[Job, RequestStream]) -> list[Job]:
        """One round of the active requests: prefills (`_prefills`), then one batched decode step of every
        decoding one. Returns the jobs that are done."""
        done = [job for job, stream in active.items() if job.cancelled.is_set()]
        for job in done:
            active[job].cancel()
            if active[job].gen in self.batch.rows:
                self.batch.remove(active[job].gen)
        live = [stream for job, stream in active.items() if job not in done]
        done += self._prefills(live)
        decoding = [s for s in live if s.gen in self.batch.rows]
        if decoding:
            self.beside_prefill += self.prefill is not None
            before = executor_counts(self.loaded, decode_only=True)
            try:
                self.batch.step()
            except Exception as e:
                for s in decoding:
                    self.batch.remove(s.gen)
                    self._fail(s.job, e)
                return done + [s.job for s in decoding]
            added = executor_counts(self.loaded, decode_only=True) - before
            with self.step_events():
                for s in decoding:
                    s.counts.update(added)
                    if not s.take():
                        self.batch.remove(s.gen)
                        done.append(s.job)
        return done

    def _prefills(self, live: list[RequestStream]) -> list[Job]:
        """One prefill at a time, in arrival order. With no stream decoding at the round's start every waiting
        one runs here, one after another (no stream waits on this thread meanwhile). Beside decoding streams,
        short ones (INLINE_PREFILL_TOKENS, about a decode step: the streams' next token waits that much) run
        here up to that many tokens a round, and a long one runs on the prefill thread, at a lower priority,
        while the rounds keep decoding; it joins the batch at the first round after it ends (or the round waits
        for it once nothing decodes). Returns the jobs that are done."""
        done = []
        if self.prefill is not None:
            if not self.prefill[1].done() and self.batch.rows:
                return done
            stream, future = self.prefill
            self.prefill = None
            done += [stream.job] if self._join(stream, future.result) else []
        idle, budget = not self.batch.rows, INLINE_PREFILL_TOKENS
        for stream in [s for s in live if s.prefilling]:
            tokens = stream.ids.numel() - stream.gen.cached
            if not idle and tokens > INLINE_PREFILL_TOKENS:
                self.prefill = stream, self.prefill_thread.submit(stream.prefill, stream.job.cancelled)
                break
            if not idle and tokens > budget:
                break
            budget -= tokens
            done += [stream.job] if self._join(stream, partial(stream.prefill, stream.job.cancelled)) else []
        return done

    def _join(self, stream: RequestStream, prefill: Callable[[], bool]) -> bool:
        """`stream` once `prefill()` (its prefill, or its result) is done: in the batch, or done (True: its
        job is; a cancelled one was already ended by its round)."""
        try:
            if not prefill() or stream.job.cancelled.is_set():
                return False
            more = stream.take()  # the first token out before the prefix is stored: its client waits on it
            stream.prefilled()
            if more:
                self.batch.add(stream.gen)
                return False
            return True
        except Exception as e:
            self._fail(stream.job, e)
            return True

    def _fail(self, job: Job, e: Exception) -> None:
        log.exception("generation failed", exc_info=e)
        job.emit(("error", RequestError(500, f"generation failed: {e}", type_="server_error")))

    def prompt_text(self, request: GenerationRequest, ids: torch.Tensor) -> str:
        """The prompt as an echo shows it: its text, or its token ids decoded."""
        return request.text if request.text is not None else self.loaded.tokenizer.decode(
            ids.tolist(), skip_special_tokens=True)

    def lookup_prefix(self, ids: torch.Tensor) -> object | None:
        """The longest reusable prefix of `ids`: from memory, or a longer one from disk (then kept in memory)."""
        prefix = self.prefix_cache.lookup(ids) if self.prefix_cache else None
        if self.disk_cache is not None:
            longer = self.disk_cache.lookup(ids, longer_than=cache_length(self.loaded, prefix))
            if longer is not None:
                prefix = longer
                if self.prefix_cache is not None:
                    self.prefix_cache.store(ids[:longer.get_seq_length()],
                                            [(layer.keys, layer.values) for layer in longer.layers])
        return prefix

    def store_prefix(self, tokens: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.store(tokens, layers)
        if self.disk_cache is not None:
            self.disk_cache.store(tokens, layers)

    def keep_at(self, ids: torch.Tensor, prefix: object | None) -> int | None:
        """Where the prompt's KV cache is worth keeping (past what was reused): its end where its last chunk is
        partial and exact (the tail rule), else its last whole-chunk boundary."""
        if self.prefix_cache is None and self.disk_cache is None:
            return None
        n = ids.numel()
        target = n if keeps_tail(n, self.chunk, self.exact_below) else n // self.chunk * self.chunk
        return target if target > cache_length(self.loaded, prefix) else None

    def figures(self, stream: RequestStream, finish: str, text: str) -> dict:
        """What the response reports (usage and the `npumoe` object), and the metrics it adds to."""
        gen, job, c = stream.gen, stream.job, stream.counts
        n, prompt = len(gen.tokens), int(stream.ids.numel())
        ttft_ms = gen.ttft_s * 1e3
        m = self.metrics
        m.prompt_tokens.inc(prompt)
        m.cached_tokens.inc(gen.cached)
        m.generated_tokens.inc(n)
        m.ttft.observe(gen.ttft_s)
        m.queue_wait.observe(job.started_at - job.queued_at)
        m.dropped.inc(c["dropped"])
        m.spilled.inc(c["spilled"])
        m.static_calls.labels("prefill").inc(c["prefill_static_calls"])
        m.static_calls.labels("decode").inc(c["decode_static_calls"])
        drift = None
        if self.loaded.executor is not None:
            report = self.loaded.executor.drift.report()
            drift = {k: report[k] for k in ("alert", "reason", "rate", "chunks_seen")}
            m.drift_alert.set(int(report["alert"]))
        npumoe = {"ttft_ms": ttft_ms, "queue_ms": (job.started_at - job.queued_at) * 1e3,
                  "prefill_tok_s": (prompt - gen.cached) / gen.ttft_s if gen.ttft_s > 0 else None,
                  "generation_tok_s": (n - 1) / gen.decode_s if n > 1 and gen.decode_s > 0 else None,
                  "cached_tokens": gen.cached, **{k: c[k] for k in COUNTS}, "drift": drift,
                  "token_ids": list(gen.tokens), "engine": self.loaded.engine}
        return {"finish_reason": finish, "text": text, "prompt_tokens": prompt, "completion_tokens": n,
                "cached_tokens": gen.cached, "npumoe": npumoe}
