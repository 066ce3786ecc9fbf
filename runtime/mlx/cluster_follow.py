"""The forwards of a model across ranks (`runtime.mlx.cluster`): each evaluated where it is called, under the ring's
watchdog; and a server's followers, told each forward rank 0 makes. Imports mlx.

Under `autotune run` and `generate` every rank runs the same program, so the same forwards. Under `serve` only rank 0
takes requests: before each forward of its decoder it announces it (`Link.announce`: a header, then the token ids,
each an `all_sum` to which the followers add zeros) and the followers (`follow`) run the same forward on their own
layers and KV cache. The server runs one request at a time across Macs, so one cache is live: a forward on an empty
cache starts a new one. While rank 0 is idle it announces nothing every quarter of the timeout, so a follower tells
an idle leader from a lost one; at its end it announces the end, and the followers return."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from runtime.mlx.ring import Ring

END, NOTHING, FORWARD = 0, 1, 2
PHASES = ("prefill", "decode")
HEADER = 5  # op, rows, columns, a new cache, phase


class Link:
    """This rank's forwards through the ring. `lead`: rank 0 of a server, which announces each one."""

    def __init__(self, ring: Ring, lead: bool) -> None:
        self.ring, self.lead = ring, lead
        self.lock = threading.Lock()  # one forward (or announcement) on the ring at a time
        self.phase: Callable[[], str] = lambda: "prefill"  # the leader's spine's phase, set once it is installed
        self.last = time.monotonic()
        self.ended = False

    def forward(self, run: Callable[[], mx.array], inputs: mx.array, cache: list | None) -> mx.array:
        """`run()` (a forward of the decoder: a send, a receive, a gather) evaluated under the watchdog, announced
        first where this rank leads."""
        with self.lock:
            if self.lead:
                fresh = cache is None or cache[0].offset == 0
                self._announce(FORWARD, inputs, fresh)
            h = run()
            return self.ring.step(f"a forward of {inputs.shape[-1]} tokens", lambda: _evaluated(h))

    def gather(self, value: int) -> list[int]:
        """Each rank's `value`, rank 0 first."""
        x = mx.distributed.all_gather(mx.array([value], dtype=mx.int32))
        return [int(v) for v in np.array(self.ring.step("agreeing on the plans", lambda: _evaluated(x)))]

    def _announce(self, op: int, inputs: mx.array | None = None, fresh: bool = False) -> None:
        """Tell the followers what comes (the lock held)."""
        rows, cols = inputs.shape if inputs is not None else (0, 0)
        header = mx.array([op, rows, cols, int(fresh), PHASES.index(self.phase())], dtype=mx.int32)
        self._share(header, "announcing a forward")
        if inputs is not None:
            self._share(inputs.astype(mx.int32), "sending a forward's tokens")
        self.last = time.monotonic()

    def _share(self, x: mx.array, what: str) -> np.ndarray:
        """rank 0's `x` on every rank (the others give zeros of its shape), on the CPU's stream: the leader's beat
        shares from a thread of its own."""
        with mx.stream(mx.cpu):
            y = mx.distributed.all_sum(x)
        return np.array(self.ring.step(what, lambda: _evaluated(y)))

    def receive(self) -> tuple[int, np.ndarray | None, bool, str]:
        """A follower's next announcement: (op, token ids [rows, columns], a new cache, phase)."""
        op, rows, cols, fresh, phase = (int(v) for v in self._share(mx.zeros((HEADER,), mx.int32),
                                                                      "waiting for rank 0's next forward"))
        ids = self._share(mx.zeros((rows, cols), mx.int32), "receiving a forward's tokens") if op == FORWARD else None
        return op, ids, bool(fresh), PHASES[phase]

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


def follow(loaded) -> None:
    """A follower of a server (`loaded`: its stage, `runtime.generation.Loaded`): each forward rank 0 announces, run
    on this rank's layers and cache, until rank 0 announces the end."""
    link, model, cache = loaded.cluster.link, loaded.model, None
    while True:
        op, ids, fresh, phase = link.receive()
        if op == END:
            return
        if op == NOTHING:
            continue
        if fresh or cache is None:
            cache = model.make_cache()
        loaded.pin_phase(phase)
        model.forward(ids.tolist(), cache, "none")
