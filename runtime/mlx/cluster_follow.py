"""The forwards of a model across ranks (`runtime.mlx.cluster`): each evaluated where it is called, under the ring's
watchdog; and a server's followers, told what rank 0 does to its caches. Imports mlx.

Under `autotune run` and `generate` every rank runs the same program, so the same forwards. Under `serve` only rank 0
takes requests, and it decides alone (which requests run, which batch their decode steps share, which prefix they
reuse): before each forward of its decoder, and each change it makes to a KV cache, it announces it (`Link.tell`: a
header, then the token ids, each an `all_sum` to which the followers add zeros), and the followers (`follow`) do the
same to their own stage's caches. Rank 0's caches and prefix cache entries are known by handles (on a cache, its
first layer's object carries it): a forward on a cache not seen before starts a new one, and one rank 0 no longer
holds is freed on the followers by the next announcement. While rank 0 is idle it announces nothing every quarter of
the timeout, so a follower tells an idle leader from a lost one; at its end it announces the end, and the followers
return."""
from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from itertools import count

import mlx.core as mx
import numpy as np

from runtime.mlx.cache_rows import add_row, prefix_of, remove_row
from runtime.mlx.ring import Ring

# What rank 0 announces, and its operands (a, b, c, d):
END, NOTHING = 0, 1
FORWARD = 2  # a forward of the decoder on cache a (new where unknown); the token ids follow
PREFIX = 3  # cache a: the first c tokens of entry b (`cache_rows.prefix_of`)
KEEP = 4  # entry a: a copy of the first c tokens of cache b (`spine_generation.kept_layers`)
ADD = 5  # cache c: batch a (0: none) with cache b as its last row (`cache_rows.add_row`)
REMOVE = 6  # cache c (0: none): batch a of d rows without row b (`cache_rows.remove_row`)
FREE = 7  # the handles that follow are gone on rank 0
PHASES = ("prefill", "decode")
HEADER = 8  # op, a, b, c, d, rows, columns (of the ids that follow), phase


class Kept(list):
    """A prefix cache entry's layers on rank 0 (keys, values per layer), with the handle of the followers' copy."""
    npumoe_handle = 0


class Link:
    """This rank's forwards through the ring. `lead`: rank 0 of a server, which announces each one."""

    def __init__(self, ring: Ring, lead: bool) -> None:
        self.ring, self.lead = ring, lead
        self.lock = threading.Lock()  # one forward (or announcement) on the ring at a time
        self.phase: Callable[[], str] = lambda: "prefill"  # the leader's spine's phase, set once it is installed
        self.last = time.monotonic()
        self.ended = False
        self._handles = count(1)
        self._gone: list[int] = []  # the handles of rank 0's caches and entries collected since the last announcement

    def forward(self, run: Callable[[], mx.array], inputs: mx.array, cache: list | None) -> mx.array:
        """`run()` (a forward of the decoder: a send, a receive, a gather) evaluated under the watchdog, announced
        first where this rank leads."""
        with self.lock:
            if self.lead:
                self._announce(FORWARD, self.handle(cache) if cache is not None else 0, ids=inputs)
            h = run()
            return self.ring.step(f"a forward of {inputs.shape[-1]} tokens", lambda: _evaluated(h))

    def handle(self, held: list) -> int:
        """Rank 0's handle of a cache (mlx-lm's per-layer caches: carried by the first) or a `Kept` entry, a new one
        at first sight; once rank 0 no longer holds it, the followers are told to free theirs."""
        owner = held if isinstance(held, Kept) else held[0]
        if not getattr(owner, "npumoe_handle", 0):
            owner.npumoe_handle = next(self._handles)
            weakref.finalize(owner, self._gone.append, owner.npumoe_handle)
        return owner.npumoe_handle

    def tell(self, op: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> None:
        """Announce a change rank 0 made to its caches, the caller holding what it names until this returns (one
        collected before would be freed on the followers first)."""
        with self.lock:
            self._announce(op, a, b, c, d)

    def gather(self, value: int) -> list[int]:
        """Each rank's `value`, rank 0 first."""
        x = mx.distributed.all_gather(mx.array([value], dtype=mx.int32))
        return [int(v) for v in np.array(self.ring.step("agreeing on the plans", lambda: _evaluated(x)))]

    def _announce(self, op: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0, ids: mx.array | None = None) -> None:
        """Tell the followers what rank 0 no longer holds, then what comes (the lock held; a follower runs a forward
        as soon as it is told: nothing may follow it)."""
        if self._gone and op != FREE:
            gone = self._gone[:]
            del self._gone[:len(gone)]
            self._announce(FREE, ids=mx.array([gone], dtype=mx.int32))
        rows, cols = ids.shape if ids is not None else (0, 0)
        header = mx.array([op, a, b, c, d, rows, cols, PHASES.index(self.phase())], dtype=mx.int32)
        self._share(header, "announcing a forward")
        if ids is not None:
            self._share(ids.astype(mx.int32), "sending a forward's tokens")
        self.last = time.monotonic()

    def _share(self, x: mx.array, what: str) -> np.ndarray:
        """rank 0's `x` on every rank (the others give zeros of its shape), on the CPU's stream: the leader's beat
        shares from a thread of its own."""
        with mx.stream(mx.cpu):
            y = mx.distributed.all_sum(x)
        return np.array(self.ring.step(what, lambda: _evaluated(y)))

    def receive(self) -> tuple[int, tuple[int, int, int, int], np.ndarray | None, str]:
        """A follower's next announcement: (op, its operands, the ids that follow it, phase)."""
        op, a, b, c, d, rows, cols, phase = (int(v) for v in self._share(mx.zeros((HEADER,), mx.int32),
                                                                          "waiting for rank 0's next forward"))
        ids = self._share(mx.zeros((rows, cols), mx.int32), "receiving a forward's tokens") if rows else None
        return op, (a, b, c, d), ids, PHASES[phase]

    def keep_alive(self) -> None:
        """On the leader, a thread that announces nothing while it is idle (until `end`)."""
        beat = self.ring.timeout_s / 4

        def run() -> None:
            while not self.ended:
                time.sleep(beat)
                with self.lock:
                    if not self.ended and time.monotonic() - self.last >= beat:
                        self._announce(NOTHING)
        threading.Thread(target=run, name="npumoe-ring-beat", daemon=True).start()

    def end(self) -> None:
        """The leader's last announcement: the followers return."""
        with self.lock:
            if self.lead and not self.ended:
                self.ended = True
                self._announce(END)


def _evaluated(x: mx.array) -> mx.array:
    mx.eval(x)
    return x


def follow(loaded) -> dict[int, object]:
    """A follower of a server (`loaded`: its stage, `runtime.generation.Loaded`): each forward and each change to a
    cache rank 0 announces, made on this rank's layers and caches, until rank 0 announces the end. Returns what it
    holds then, by rank 0's handles (what a test compares with rank 0's)."""
    from runtime.mlx.spine_generation import kept_layers

    link, model = loaded.cluster.link, loaded.model
    held: dict[int, object] = {}  # by rank 0's handles: caches, and prefix cache entries' layers
    while True:
        op, (a, b, c, d), ids, phase = link.receive()
        if op == END:
            return held
        if op == FORWARD:
            if a and a not in held:
                held[a] = model.make_cache()
            _forward(loaded, ids, held.get(a), phase)
        elif op == PREFIX:
            held[a] = prefix_of(held[b], c)
        elif op == KEEP:
            held[a] = kept_layers(held[b], c)
        elif op == ADD:
            row, batch = held.pop(b), held.pop(a) if a else None
            held[c] = add_row(batch, row)
        elif op == REMOVE:
            rest = remove_row(held.pop(a), b, d)
            if c:
                held[c] = rest
        elif op == FREE:
            for h in ids[0].tolist():
                held.pop(h, None)


def _forward(loaded, ids: np.ndarray, cache: list | None, phase: str) -> None:
    """A forward rank 0 announced, on this rank's layers: in its phase, with as many sequences as it has rows (a
    batched decode step's: each row's token stays on the exact path, as on rank 0)."""
    loaded.pin_phase(phase)
    if loaded.executor is not None:
        loaded.executor.set_sequences(ids.shape[0])
    try:
        loaded.model.forward(ids.tolist(), cache, "none")
    finally:
        if loaded.executor is not None:
            loaded.executor.set_sequences(1)
