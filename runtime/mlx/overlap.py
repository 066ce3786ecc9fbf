"""Two chunks in flight on the MLX spine: one chunk's static calls run while the other chunk's MLX work is built and
evaluated, so neither unit waits for the other (the schedule `autotune.costing.schedule` prices).

Each chunk's forward runs on its own thread, at most `in_flight` at a time, in order. Two lanes:
- the host lane: MLX. One thread at a time builds and evaluates MLX work (MLX's streams are per thread since 0.31.2:
  an array built lazily on one thread and first evaluated on another fails, so nothing lazy crosses threads); a
  chunk thread holds it but while it waits, the older chunk first when both ask; a layer's exact path, run on the
  layer's worker (`LayerExecutor`), takes it around its MLX call ahead of any chunk.
- the static lane: the plan's static calls (its groups; its dense functions spliced into mlx-lm's forward, their
  rows crossed first), one at a time (the ANE is one unit), off the host lane. torch's kernels release the GIL, so
  they compute while the other thread runs MLX. A backend on a unit of its own beside the static one (the CPU's
  torch, cpu-static, in a plan whose other static calls are the ANE's: `Lanes.apart`) has a lane of its own, named
  for it: its calls run beside the static lane's.
The KV cache receives each chunk's keys and values in order: a chunk's layer l attention starts once the chunk
before has written layer l's (`KvOrder`), and its cache write is evaluated at once, on its own thread (a static
attention core reads them first: its call says they are written, so the next chunk's attention runs beside it). Within a
chunk the ops and their order are the one-at-a-time run's, so the logits are the same. Each lane's busy time (held)
and wait time (the prefill's wall less it) are measured (`Lanes.figures`). Imports mlx."""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext

import mlx.core as mx

EXACT_PRIORITY = -1  # a layer's exact path takes the host lane before any chunk (a chunk waits on it)


class Lanes:
    """The host lane (a lock served by priority: lower first) and the static lane (a lock), each timed."""

    def __init__(self, record: bool = False) -> None:
        self.cond = threading.Condition()
        self.holder: int | None = None
        self.priority = 0  # the holder's
        # `record`: each lane's intervals as (kind, chunk, start s, end s, layer): "host" (a chunk thread holds the
        # host lane), "exact" (a layer's exact path holds it, for the chunk off it), "off" (a chunk off the host
        # lane), "static" (a static call), "kv" (a chunk's keys and values of `layer` written, at `end`)
        self.events: list[tuple[str, int, float, float, int]] | None = [] if record else None
        self.current = 0  # the chunk last off the host lane (one in flight: whose exact path holds it)
        self.waiting: set[tuple[int, int]] = set()
        self.seq = itertools.count()
        self.static_locks = {"static": threading.Lock()}  # a lane -> its lock: one call at a time on each unit
        self.local = threading.local()
        self.busy = {"host": 0.0, "static": 0.0}
        self.aborts: list[Callable[[], None]] = []  # called when a chunk's forward fails (`abort`)
        self.since = 0.0
        self.start = self.end = time.perf_counter()

    def acquire(self, priority: int) -> None:
        me = (priority, next(self.seq))
        with self.cond:
            self.waiting.add(me)
            while self.holder is not None or min(self.waiting) != me:
                self.cond.wait()
            self.waiting.discard(me)
            self.holder, self.since, self.priority = threading.get_ident(), time.perf_counter(), priority

    def note(self, kind: str, chunk: int, start: float, end: float, layer: int = -1) -> None:
        if self.events is not None:
            self.events.append((kind, chunk, start, end, layer))

    def release(self) -> None:
        with self.cond:
            now = time.perf_counter()
            self.busy["host"] += now - self.since
            exact = self.priority == EXACT_PRIORITY
            self.note("exact" if exact else "host", self.current if exact else self.priority, self.since, now)
            self.holder = None
            self.cond.notify_all()

    @contextmanager
    def host(self, priority: int = EXACT_PRIORITY) -> Iterator[None]:
        """The host lane for the block (a layer's exact path on its worker)."""
        self.acquire(priority)
        try:
            yield
        finally:
            self.release()

    @contextmanager
    def off_host(self) -> Iterator[None]:
        """The calling chunk thread's host lane let go for the block (it waits, or runs static calls), then taken
        back at its chunk's priority. A thread that does not hold it (the one-at-a-time run) passes through."""
        if self.holder != threading.get_ident():
            yield
            return
        self.release()
        self.current, start = self.local.chunk, time.perf_counter()
        try:
            yield
        finally:
            self.note("off", self.local.chunk, start, time.perf_counter())
            self.acquire(self.local.chunk)

    def apart(self, backends: set[str]) -> None:
        """`backends`' static calls each on a lane of their own (named for the backend), beside the static lane."""
        for backend in backends:
            self.static_locks.setdefault(backend, threading.Lock())
            self.busy.setdefault(backend, 0.0)

    @contextmanager
    def on_static(self, backend: str | None = None) -> Iterator[None]:
        """The static lane for the block (one static call of `backend`), or the backend's own lane where it runs
        apart; timed."""
        lane = backend if backend in self.static_locks else "static"
        with self.static_locks[lane]:
            start = time.perf_counter()
            try:
                yield
            finally:
                end = time.perf_counter()
                self.busy[lane] += end - start
                self.note(lane, self.local.chunk, start, end)

    def kv_written(self) -> None:
        """The calling chunk's keys and values of its current layer are written and evaluated (a static attention
        core read them): the next chunk's attention of that layer may start (`OrderedAttention`)."""
        written = getattr(self.local, "kv_written", None)
        if written is not None:
            written()

    def static(self, fn: Callable) -> Callable:
        """`fn` (a static group's call) run on the static lane."""
        def call(rows):
            with self.on_static():
                return fn(rows)
        return call

    def abort(self) -> None:
        """A chunk's forward failed: whatever waits on it gives up (`KvOrder`), so its error ends the prefill."""
        for fn in self.aborts:
            fn()

    def figures(self) -> dict[str, dict[str, float]]:
        """Each lane's busy ms and wait ms (the prefill's wall less its busy time), measured."""
        wall = (self.end - self.start) * 1e3
        return {lane: {"busy_ms": round(s * 1e3, 3), "wait_ms": round(max(0.0, wall - s * 1e3), 3)}
                for lane, s in self.busy.items()}


class KvOrder:
    """Each layer's keys and values written chunk after chunk: `wait(layer, c)` returns once chunks 0..c-1 wrote
    that layer's (`done`)."""

    def __init__(self, lanes: Lanes) -> None:
        self.lanes, self.cond, self.written, self.failed = lanes, threading.Condition(), {}, False
        lanes.aborts.append(self.abort)

    def wait(self, layer: int, chunk: int) -> None:
        with self.cond:
            if self.written.get(layer, 0) >= chunk:
                return
        with self.lanes.off_host(), self.cond:
            self.cond.wait_for(lambda: self.written.get(layer, 0) >= chunk or self.failed)
        if self.failed:
            raise RuntimeError("an earlier chunk's forward failed")

    def abort(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()

    def done(self, layer: int, chunk: int) -> None:
        """Chunk `chunk`'s keys and values of `layer` written (once: a static core may say so first)."""
        if self.written.get(layer, 0) > chunk:
            return
        now = time.perf_counter()
        self.lanes.note("kv", chunk, now, now, layer)
        with self.cond:
            self.written[layer] = chunk + 1
            self.cond.notify_all()


class OrderedAttention:
    """A layer's attention module, called in chunk order (`KvOrder`), its cache write evaluated on the calling
    thread before another chunk reads it."""

    def __init__(self, inner, layer: int, order: KvOrder) -> None:
        self.inner, self.layer, self.order = inner, layer, order

    def __call__(self, *args, **kwargs):
        local = self.order.lanes.local
        chunk = local.chunk
        self.order.wait(self.layer, chunk)
        local.kv_written = lambda: self.order.done(self.layer, chunk)
        try:
            out = self.inner(*args, **kwargs)
        finally:
            local.kv_written = None
        cache = kwargs.get("cache") or next(a for a in args if hasattr(a, "state"))
        mx.eval(cache.keys, cache.values)
        self.order.done(self.layer, chunk)
        return out

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def run_in_flight(forwards: list[Callable[[], object]], lanes: Lanes, in_flight: int = 2) -> list[object]:
    """Each chunk's forward (`forwards[c]()`, in chunk order) on a thread of its own holding the host lane, at most
    `in_flight` at a time; their results in order."""
    def run(c: int, fn: Callable[[], object]) -> object:
        lanes.local.chunk = c
        lanes.acquire(c)
        try:
            return fn()
        except BaseException:
            lanes.abort()
            raise
        finally:
            lanes.release()

    lanes.start = time.perf_counter()
    with ThreadPoolExecutor(in_flight, thread_name_prefix="npumoe-chunk") as pool:
        futures = [pool.submit(run, c, fn) for c, fn in enumerate(forwards)]
        out = [f.result() for f in futures]
    lanes.end = time.perf_counter()
    return out


def lane_lock(lanes: Lanes | None):
    """The lock a layer's MLX exact path takes around its call: the host lane in flight, else none."""
    return nullcontext() if lanes is None else lanes.host()
