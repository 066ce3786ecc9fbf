"""The engine in a process of its own, as `autotune serve` runs it: the HTTP loop and the model never take turns on
one GIL.

In one process, the uvicorn loop's Python work for each token (its SSE chunk, the socket write) and the model's
Python-heavy decode step hold one GIL by turns, and each waits for the other's hand-over: tiny-moe's tokens came
8-9% slower served than from `runtime.generate` (`scripts/bench_serve.py`), though a one-row batched decode step
alone was within 2% of `Generation.step`. As vLLM's engine core does, the engine runs in a child process (spawned:
forking a process whose torch has started threads is unsafe) that loads the model, warms up and then serves two
pipes:

- requests, from this process: submit and cancel, not answered (the event loop that submits does not wait on the
  child: a refusal is the job's first event), and health, metrics, close, each answered in order;
- events, from the child: lists of (job key, event) as the engine's jobs emit them (one event, or a batched decode
  step's tokens together), read here on the asyncio loop that submits (its selector watches the pipe: a token's
  trip from the child wakes that loop alone, not a reader thread that then wakes the loop; a job of another loop
  gets its events through `Job.emit`).

The child ignores SIGINT (Ctrl-C reaches the whole process group: this process drains, then closes it) and ends
when its request pipe closes (this process gone). Its tokenizer comes back pickled once it is ready, for what is
written here (log-probabilities' token texts).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from multiprocessing.connection import Connection

import torch

from runtime.errors import NpumoeError
from runtime.generation import load as load_model
from runtime.serving.engine import Engine, GenerationRequest, RequestError
from runtime.serving.scheduler import Closed, Job, QueueFull

log = logging.getLogger("npumoe.serve")


class EngineEnded(NpumoeError):
    """The engine process ended before it answered; `exitcode` says how (its own message is above)."""

    def __init__(self, exitcode: int | None, message: str) -> None:
        super().__init__(message)
        self.exitcode = exitcode


class EngineProcess:
    """An `Engine` (`engine_args` but the model) over `runtime.load(**load_args)` in a spawned child process, with
    the engine's methods the app calls. Returns once the child is ready (model loaded, warmed up); a failure to load
    raises its one-line NpumoeError here."""

    def __init__(self, load_args: dict, engine_args: dict, model_id: str, threads: int | None = None,
                 log_format: str | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._requests, child_requests = ctx.Pipe()
        self._events, child_events = ctx.Pipe(duplex=False)
        self.model_id = model_id
        self.process = ctx.Process(target=_child, name="npumoe-engine", daemon=True,
                                   args=(child_requests, child_events, load_args, {**engine_args, "model_id": model_id},
                                         threads, log_format))
        self.process.start()
        child_requests.close()
        child_events.close()
        self._lock = threading.Lock()  # one request and its answer at a time
        first = self._receive("loading the model")
        if first[0] == "failed":
            self.process.join()
            raise NpumoeError(first[1])
        self.tokenizer = first[1]
        self._jobs: dict[int, Job] = {}
        self._keys: dict[Job, int] = {}
        self._next_key = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that reads the events pipe
        self._listening = threading.Lock()
        self._ended = threading.Event()  # the events pipe's end was read and its jobs ended

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> Job:
        """As `Engine.submit`, except that a refusal (RequestError, QueueFull) comes as the job's first event
        ("error", refusal): the job here, its events from the child's."""
        self._listen(loop)
        job, key = Job(None, loop), next(self._next_key)
        self._jobs[key], self._keys[job] = job, key  # before the child can answer with an event
        if not self._post(("submit", key, request)):
            self._forget(key)
            raise Closed
        return job

    def cancel(self, job: Job) -> None:
        key = self._keys.get(job)
        if key is not None:
            self._post(("cancel", key))  # a child that has ended ended its jobs with it

    def health(self) -> dict:
        return self._call(("health",))

    def metrics_text(self) -> bytes:
        return self._call(("metrics",))

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the child's engine (what still runs is cancelled, as `Engine.close`) and wait for it to exit."""
        if self.process.is_alive():
            try:
                self._call(("close", timeout_s))
            except (NpumoeError, OSError):
                pass
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        with self._listening:
            reading = self._loop is not None and self._loop.is_running()
        if not reading or not self._ended.wait(timeout_s):  # no loop will read the pipe's end: read it here
            self._drain()

    def _post(self, message: tuple) -> bool:
        """Send a request the child does not answer; False where the child has ended."""
        try:
            with self._lock:
                self._requests.send(message)
            return True
        except OSError:
            return False

    def _call(self, message: tuple) -> object:
        with self._lock:
            try:
                self._requests.send(message)
            except OSError as e:
                raise NpumoeError(f"the engine process has ended (exit code {self.process.exitcode})") from e
            return self._receive(message[0])

    def _receive(self, doing: str) -> object:
        try:
            return self._requests.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise EngineEnded(self.process.exitcode, f"the engine process ended (exit code {self.process.exitcode}) "
                              f"while {doing}; its "
                              "message is above") from None

    def _forget(self, key: int) -> Job | None:
        job = self._jobs.pop(key, None)
        self._keys.pop(job, None)
        return job

    def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the events pipe on `loop` (called on it): the first loop to submit, or the next once that one has
        closed (a test's loop; the server has one)."""
        with self._listening:
            if self._ended.is_set() or (self._loop is not None and not self._loop.is_closed()):
                return
            self._loop = loop
            loop.add_reader(self._events.fileno(), self._on_events)

    def _on_events(self) -> None:
        """On the reading loop, its selector saw the pipe readable: each event to its job (this loop's directly)."""
        try:
            items = self._events.recv()  # one event, or a batched step's, in order
        except (EOFError, OSError):
            self._loop.remove_reader(self._events.fileno())
            self._end()
            return
        self._deliver(items, self._loop)

    def _deliver(self, items: list[tuple], here: asyncio.AbstractEventLoop | None) -> None:
        for key, event in items:
            job = self._forget(key) if event is None else self._jobs.get(key)
            if job is None:
                continue
            if job.loop is here:
                job.events.put_nowait(event)
            else:
                job.emit(event)

    def _drain(self) -> None:
        """Off any loop, once the child has ended: what is left in the pipe to its jobs, then the pipe's end."""
        try:
            while True:
                self._deliver(self._events.recv(), None)
        except (EOFError, OSError):
            pass
        self._end()

    def _end(self) -> None:
        """The child ended (a clean close leaves no job): each job still open ends with a server error."""
        for key in list(self._jobs):
            job = self._forget(key)
            job.emit(("error", RequestError(500, "the engine process ended", type_="server_error")))
            job.emit(None)
        self._ended.set()


class _Outbox:
    """The child's end of the events pipe, shared by its threads (the engine's worker, the request loop). Under
    `held` (a batched decode step's tokens, on the worker) what the worker sends waits, then goes as one message: a
    write that wakes the reader costs about 0.1 ms on the development VM, per message, not per event."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.lock, self.local = conn, threading.Lock(), threading.local()

    def send(self, item: tuple) -> None:
        waiting = getattr(self.local, "waiting", None)
        if waiting is not None:
            waiting.append(item)
        else:
            self._write([item])

    @contextmanager
    def held(self) -> Iterator[None]:
        self.local.waiting = []
        try:
            yield
        finally:
            items, self.local.waiting = self.local.waiting, None
            if items:
                self._write(items)

    def _write(self, items: list[tuple]) -> None:
        with self.lock:
            try:
                self.conn.send(items)
            except OSError:  # the server's process is gone; the request loop ends at its pipe's end
                pass


class _ChildJob(Job):
    """A job in the child: its events go down the events pipe under its key; listed in `jobs` until its end."""

    def __init__(self, work: Callable, loop: None, outbox: _Outbox, key: int, jobs: dict[int, Job]) -> None:
        super().__init__(work, loop)
        self.outbox, self.key, self.jobs = outbox, key, jobs
        jobs[key] = self

    def emit(self, event: object) -> None:
        if event is None:
            self.jobs.pop(self.key, None)
        self.outbox.send((self.key, event))


def _child(requests: Connection, events: Connection, load_args: dict, engine_args: dict, threads: int | None,
           log_format: str | None) -> None:
    """The engine process: load, warm up, say ready (or why not), then answer requests until closed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log_format:
        logging.basicConfig(level=logging.WARNING, format=log_format)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        engine = Engine(load_model(**load_args), **engine_args)
        engine.warm_up()
    except NpumoeError as e:
        requests.send(("failed", str(e)))
        return
    except Exception as e:
        log.exception("the engine failed to start")
        requests.send(("failed", f"the engine failed to start: {type(e).__name__}: {e}"))
        return
    requests.send(("ready", engine.tokenizer))
    outbox, jobs = _Outbox(events), {}
    engine.step_events = outbox.held
    while True:
        try:
            message = requests.recv()
        except EOFError:  # the server's process is gone
            engine.close(0)
            return
        kind = message[0]
        if kind == "submit":
            key, request = message[1:]
            try:
                engine.submit(request, None, partial(_ChildJob, outbox=outbox, key=key, jobs=jobs))
            except (RequestError, QueueFull, Closed) as e:
                jobs.pop(key, None)
                with outbox.held():  # the refusal and the job's end, as one message
                    outbox.send((key, ("error", e)))
                    outbox.send((key, None))
        elif kind == "cancel":
            if (job := jobs.get(message[1])) is not None:
                engine.cancel(job)
        elif kind == "health":
            requests.send(engine.health())
        elif kind == "metrics":
            requests.send(engine.metrics_text())
        elif kind == "close":
            engine.close(message[1])
            requests.send(None)
            return
