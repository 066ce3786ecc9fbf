"""Arrival order, several at a time: a bounded queue of jobs and the one worker thread that runs them on the model.

A job starts on the worker thread (its `work`) and sends its events to the asyncio loop that serves its HTTP
request. Work that needs more than its start returns a task; up to `max_active` tasks are active at once and the
worker advances them together, a round at a time (`step`: the engine's prefill chunk and batched decode step),
until `step` says each is done. The queue holds at most `max_queue` jobs behind the active ones; a full queue
refuses the job at once (HTTP 429). A job cancelled while it waits leaves the queue then and there (its place is
free); one cancelled while active sees `cancelled` set and `step` ends it at its next round.
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("npumoe.serve")


class QueueFull(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple:  # across the engine process's pipe
        return QueueFull, (self.retry_after_s,)


class Closed(Exception):
    """The server is shutting down and takes no new job."""


class Job:
    """One request's work, started on the worker thread (returning a task to step, or None when it is done); its
    events reach `loop` in order, ending with `None`."""

    def __init__(self, work: Callable[["Job"], object | None], loop: asyncio.AbstractEventLoop) -> None:
        self.work, self.loop = work, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.queued_at = time.perf_counter()
        self.started_at: float | None = None

    def emit(self, event: object) -> None:
        """From the worker thread: hand one event to the request's loop (dropped once that loop has closed)."""
        _mailbox(self.loop).put(self.events, event)


class Mailbox:
    """Events from the worker to one asyncio loop, with one wake-up of the loop for all that arrive before it
    runs (a batched decode step's tokens: one self-pipe write and one hand-over of the GIL, not one a row)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.items, self.lock, self.pending = loop, [], threading.Lock(), False

    def put(self, queue: asyncio.Queue, event: object) -> None:
        if self.loop.is_closed():  # nobody reads these events any more
            return
        with self.lock:
            self.items.append((queue, event))
            if self.pending:
                return
            self.pending = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop has closed: nobody reads these events
            pass

    def _deliver(self) -> None:
        with self.lock:
            items, self.items, self.pending = self.items, [], False
        for queue, event in items:
            queue.put_nowait(event)


_MAILBOXES: dict[asyncio.AbstractEventLoop, Mailbox] = {}
_MAILBOXES_LOCK = threading.Lock()


def _mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    with _MAILBOXES_LOCK:
        if loop not in _MAILBOXES:
            for closed in [other for other in _MAILBOXES if other.is_closed()]:
                del _MAILBOXES[closed]
            _MAILBOXES[loop] = Mailbox(loop)
        return _MAILBOXES[loop]


class Scheduler:
    def __init__(self, max_queue: int, max_active: int = 1,
                 step: Callable[[dict[Job, object]], list[Job]] | None = None) -> None:
        """`step(active tasks by job)`: advance them one round; returns the jobs that are done."""
        self.max_queue, self.max_active, self._step = max_queue, max_active, step
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._active: dict[Job, object] = {}
        self._mean_s = 1.0  # running mean of a job's time on the worker: what Retry-After estimates from
        self._thread = threading.Thread(target=self._loop, name="npumoe-serve", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting (the active ones not counted)."""
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self._active)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise Closed
            if len(self._waiting) >= self.max_queue:  # those waiting for the worker's next round included
                turns = math.ceil((len(self._waiting) + 1) / self.max_active)
                raise QueueFull(max(1, math.ceil(self._mean_s * turns)))
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        with self._cond:
            job.cancelled.set()
            if job in self._waiting:
                self._waiting.remove(job)
                job.emit(None)

    def close(self, timeout_s: float | None = None) -> None:
        """Take no new job, cancel the waiting ones and the active ones, and stop the worker (called after the
        drain: what still runs then has outlived it)."""
        with self._cond:
            self._closed = True
            for job in self._active:
                job.cancelled.set()
            while self._waiting:
                job = self._waiting.popleft()
                job.cancelled.set()
                job.emit(None)
            self._cond.notify()
        self._thread.join(timeout_s)

    def _admit(self) -> list[Job] | None:
        """The waiting jobs that fit beside the active ones (after a wait for work); None: closed and idle."""
        with self._cond:
            while not self._waiting and not self._active and not self._closed:
                self._cond.wait()
            if self._closed and not self._waiting and not self._active:
                return None
            admitted = []
            while self._waiting and len(self._active) + len(admitted) < self.max_active:
                admitted.append(self._waiting.popleft())
            for job in admitted:
                self._active[job] = None
            return admitted

    def _loop(self) -> None:
        while (admitted := self._admit()) is not None:
            for job in admitted:
                job.started_at = time.perf_counter()
                task = None
                try:
                    task = job.work(job)
                except Exception:  # the job reports its own errors; this keeps the worker alive whatever happens
                    log.exception("a request failed on the worker")
                if task is None or self._step is None:
                    self._finish(job)
                else:
                    self._active[job] = task
            if self._active:
                try:
                    done = self._step(dict(self._active))
                except Exception:
                    log.exception("a round of the active requests failed on the worker")
                    done = list(self._active)
                for job in done:
                    self._finish(job)

    def _finish(self, job: Job) -> None:
        with self._cond:
            self._active.pop(job, None)
        job.emit(None)
        self._mean_s = 0.8 * self._mean_s + 0.2 * (time.perf_counter() - job.started_at)
