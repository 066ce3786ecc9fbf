"""One admitted request on the worker: its `Generation` (prefilled a chunk per round, then decoded in the engine's
batch), its streaming detokenizer and stop sequences, and the events it sends its job.

Its figures are its own: the executor's counts (drops, spills, static calls) are taken as differences around its
own prefill chunks and the batched decode steps it was part of, so several requests at once do not mix them.
"""
from __future__ import annotations

import secrets
import threading
from collections import Counter

import torch

from runtime.detokenizer import StreamingDetokenizer
from runtime.generation import Generation, Loaded
from runtime.serving.scheduler import Job
from runtime.serving.stop_sequences import StopText

COUNTS = ("dropped", "spilled", "prefill_static_calls", "decode_static_calls")


def executor_counts(loaded: Loaded, decode_only: bool = False) -> Counter:
    """The executor's running counts (what a request adds is the difference of two of these). `decode_only`: the
    decode static calls alone, for a decode step (the exact path never drops or spills; summing every layer's
    prefill counts twice a step was 0.2 ms of a tiny model's 11 ms step)."""
    if loaded.executor is None:
        return Counter()
    stats = loaded.stats
    if decode_only:
        return Counter(decode_static_calls=stats.static_calls("decode"))
    total = stats.total("prefill")
    return Counter(dropped=total.dropped, spilled=total.spilled, prefill_static_calls=stats.static_calls("prefill"))


class RequestStream:
    def __init__(self, engine: object, request: object, ids: torch.Tensor, job: Job) -> None:
        self.engine, self.request, self.ids, self.job = engine, request, ids, job
        self.loaded: Loaded = engine.loaded
        # an echo scores every prompt token: the logits of a reused prefix are not kept, so none is reused then
        prefix = engine.lookup_prefix(ids) if not request.echo else None
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        self.gen = Generation(self.loaded, ids, request.max_tokens, request.temperature, seed, engine.chunk,
                              request.top_p, prefix, engine.keep_at(ids, prefix), request.logprobs, request.echo)
        self.steps = self.gen.prefill_steps()
        self.prefilling = True
        self.detokenizer = StreamingDetokenizer(self.loaded.tokenizer)
        self.stop = StopText(request.stop)
        self.texts: list[str] = []
        self.sent = 0  # token log-probabilities sent so far
        self.counts: Counter = Counter({k: 0 for k in COUNTS})

    def prefill(self, cancelled: threading.Event) -> bool:
        """Every prefill chunk, in the plan's chunks (on the engine's prefill thread, beside the decode steps);
        True once done (the first token pending), False where `cancelled` stopped it between chunks. Its counts
        are the prefill phase's, which only this thread adds to while it runs."""
        before = executor_counts(self.loaded)
        try:
            for _ in self.steps:
                if cancelled.is_set():
                    self.steps.close()
                    return False
            return True
        finally:
            self.counts.update(executor_counts(self.loaded) - before)
            self.loaded.unpin_phase()

    def prefilled(self) -> None:
        """Back on the engine's thread once `prefill` is done: decoding next, the prefix it kept stored."""
        self.prefilling = False
        if self.gen.kept is not None:
            kept = self.engine.spine.keep(self.gen.kept, self.gen.cache, self.gen.keep_at)
            self.engine.store_prefix(self.ids[:self.gen.keep_at], kept)

    def take(self) -> bool:
        """Take the pending token and send its text (a chunk per token, text or not: the client sees each token
        arrive); False once the request is done and its figures sent."""
        if not self.texts and self.request.echo:  # prefill is done: the prompt and its log-probabilities first
            self.texts.append(self.engine.prompt_text(self.request, self.ids))
            self.job.emit(("text", self.texts[0], self.gen.prompt_logprobs))
        tok = self.gen.accept()
        if tok is None:
            return self._end("stop" if self.gen.finish_reason == "eos" else "length")
        text, hit = self.stop.feed(self.detokenizer.add(tok))
        self.texts.append(text)
        if not hit or text:
            self._emit(text)
        if hit:
            return self._end("stop", flush=False)
        return self._end("length") if self.gen.full else True

    def cancel(self) -> None:
        """The client left: nothing more to say to it."""
        self.engine.metrics.cancelled.inc()

    def _emit(self, text: str) -> None:  # the text and the log-probabilities of the tokens not sent yet
        self.job.emit(("text", text, self.gen.token_logprobs[self.sent:]))
        self.sent = len(self.gen.token_logprobs)

    def _end(self, finish: str, flush: bool = True) -> bool:
        if flush:
            text, hit = self.stop.feed(self.detokenizer.finish())
            rest = "" if hit else self.stop.flush()
            finish = "stop" if hit else finish
            if text + rest:
                self.texts.append(text + rest)
                self._emit(text + rest)
        figures = self.engine.figures(self, finish, "".join(self.texts))
        figures["stop_sequence"] = self.stop.matched
        if self.request.logprobs is not None:
            figures.update(logprobs=self.gen.prompt_logprobs + self.gen.token_logprobs,
                           unsent_logprobs=self.gen.token_logprobs[self.sent:])
        self.job.emit(("done", figures))
        return False
