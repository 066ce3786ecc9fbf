"""Arrival order, one at a time: a bounded queue of jobs and the one worker thread that runs them on the model.

A job runs on the worker thread and sends its events to the asyncio loop that serves its HTTP request. The queue
holds at most `max_queue` jobs behind the running one; a full queue refuses the job at once (HTTP 429). A job
cancelled while it waits leaves the queue then and there (its place is free); one cancelled while it runs sees
`cancelled` set and stops at its next token.
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


class Closed(Exception):
    """The server is shutting down and takes no new job."""


class Job:
    """One request's work, run on the worker thread; its events reach `loop` in order, ending with `None`."""

    def __init__(self, work: Callable[["Job"], None], loop: asyncio.AbstractEventLoop) -> None:
        self.work, self.loop = work, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.queued_at = time.perf_counter()
        self.started_at: float | None = None

    def emit(self, event: object) -> None:
        """From the worker thread: hand one event to the request's loop (dropped once that loop has closed)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass


class Scheduler:
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._running: Job | None = None
        self._mean_s = 1.0  # running mean of a job's time on the worker: what Retry-After estimates from
        self._thread = threading.Thread(target=self._loop, name="npumoe-serve", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting (the running one not counted)."""
        return len(self._waiting)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise Closed
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(max(1, math.ceil(self._mean_s * (len(self._waiting) + 1))))
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        with self._cond:
            job.cancelled.set()
            if job in self._waiting:
                self._waiting.remove(job)
                job.emit(None)

    def close(self, timeout_s: float | None = None) -> None:
        """Take no new job, cancel the waiting ones and the running one, and stop the worker (called after the
        drain: what still runs then has outlived it)."""
        with self._cond:
            self._closed = True
            if self._running is not None:
                self._running.cancelled.set()
            while self._waiting:
                job = self._waiting.popleft()
                job.cancelled.set()
                job.emit(None)
            self._cond.notify()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return
                job = self._running = self._waiting.popleft()
            job.started_at = time.perf_counter()
            try:
                job.work(job)
            except Exception:  # the job reports its own errors; this keeps the worker alive whatever happens
                log.exception("a request failed on the worker")
            finally:
                job.emit(None)
                self._running = None
            self._mean_s = 0.8 * self._mean_s + 0.2 * (time.perf_counter() - job.started_at)
