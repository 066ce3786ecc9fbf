"""Joining MLX's ring (`mx.distributed`, as `mlx.launch --backend ring` starts each rank) so that a rank that dies or
cannot be reached ends the others with one line naming it, within a timeout.

MLX's ring blocks for ever in `init` while a neighbour is not listening, and a recv from a neighbour that is alive
but stuck never returns; a neighbour whose process ended makes the pending op raise ("connection to a peer was
lost") after MLX's own lines on stderr, one per failed retry. So every distributed step runs under a watchdog
(`Ring.step`): past the timeout, or on the ring's error, this rank prints one line naming its neighbours
(`rank 1 (127.0.0.1:47412)`) and exits with `PEER_LOST`; `mlx.launch` then ends the ranks still running. The
ring's `init` holds the interpreter while it waits, so its watchdog is a forked process that prints the line and
kills the rank (`Ring.outside_watch`). The
ring's own retry lines are filtered out of stderr (`quiet_ring_lines`). A receive from a neighbour whose process
ended fails on MLX's own thread and leaves the evaluation waiting (measured, MLX 0.32.4: a pipelined forward's
`recv` waited out the timeout), so the ring's line that it gave up on a socket ends the rank at once too.
Imports mlx.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, TypeVar

import mlx.core as mx

from runtime.errors import NpumoeError
from runtime.mlx.launcher import launched

PEER_LOST = 3  # the exit status of a rank whose neighbour died or could not be reached
_WATCHDOGS: set[int] = set()  # the forked watchdogs running (`Ring.outside_watch`)
T = TypeVar("T")


@dataclass(frozen=True)
class Ring:
    """This rank's place in the ring: its rank, the ring's size, each rank's address and the timeout (seconds)."""
    rank: int
    size: int
    addresses: tuple[str, ...]
    timeout_s: float

    @classmethod
    def from_env(cls, timeout_s: float) -> "Ring":
        """The ring `mlx.launch --backend ring` describes in the environment (MLX_RANK, MLX_HOSTFILE)."""
        if not launched():
            raise NpumoeError("no MLX ring in the environment (MLX_RANK, MLX_HOSTFILE): start every rank with "
                              "`mlx.launch --backend ring -n N ...` or `mlx.launch --hostfile hosts.json ...`")
        try:
            hosts = json.loads(open(os.environ["MLX_HOSTFILE"], encoding="utf-8").read())
        except (OSError, ValueError) as e:
            raise NpumoeError(f"cannot read the ring's hosts in MLX_HOSTFILE: {e}") from None
        return cls(int(os.environ["MLX_RANK"]), len(hosts), tuple(",".join(h) for h in hosts), timeout_s)

    def neighbours(self) -> list[int]:
        """The ranks this one exchanges with: the one before it and the one after it in the ring."""
        return sorted({(self.rank - 1) % self.size, (self.rank + 1) % self.size} - {self.rank})

    def named(self) -> str:
        """The neighbours as a line names them: `rank 1 (127.0.0.1:47412)`."""
        return " or ".join(f"rank {k} ({self.addresses[k]})" for k in self.neighbours())

    def fail(self, why: str) -> None:
        """One line on stderr and the end of this process (no cleanup can wait on a ring that is gone), its
        watchdog process with it; a second thread that fails meanwhile waits for the end (one line)."""
        if not _ENDING.acquire(blocking=False):
            threading.Event().wait()
        os.write(_STDERR, f"npumoe: rank {self.rank}: {why}\n".encode())
        for pid in _WATCHDOGS:
            os.kill(pid, signal.SIGKILL)
        os._exit(PEER_LOST)

    @contextmanager
    def watched(self, what: str) -> Iterator[None]:
        """Within the timeout, or this rank ends naming its neighbours."""
        timer = threading.Timer(self.timeout_s, self.fail, (self._late(what),))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def step(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()` (a step that sends or receives) under the watchdog; the ring's error ends this rank too."""
        with self.watched(what):
            try:
                return fn()
            except RuntimeError as e:
                if "[ring]" not in str(e):
                    raise
                self.fail(f"lost {self.named()} ({what}): it died or cannot be reached")
                raise  # not reached: fail exits

    @contextmanager
    def outside_watch(self, what: str) -> Iterator[None]:
        """The watchdog as a forked process, for a call that holds the interpreter while it blocks (the ring's
        `init` waits on its neighbours' sockets without letting another thread run): past the timeout it prints the
        line and kills this rank (SIGKILL: no handler of this process could run)."""
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the watchdog: sleeps, and touches nothing of the parent's but its stderr
            time.sleep(self.timeout_s)
            os.write(_STDERR, f"npumoe: rank {self.rank}: {self._late(what)}\n".encode())
            os.kill(parent, signal.SIGKILL)
            os._exit(0)
        _WATCHDOGS.add(pid)
        try:
            yield
        finally:
            _WATCHDOGS.discard(pid)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)

    def _late(self, what: str) -> str:
        return f"{self.named()} did not answer within {self.timeout_s:g} s ({what}): it died or cannot be reached"

    def join(self) -> mx.distributed.Group:
        """The ring's group, once every neighbour answered (within the timeout). The connecting side gives up on its
        own after about 30 s (MLX), and may try again (measured here): it does until the watchdog's timeout, so a
        neighbour that starts later (a server's engine process) is still met."""
        with self.outside_watch("joining the ring"):
            while True:
                try:
                    return mx.distributed.init(backend="ring", strict=True)
                except RuntimeError as e:
                    if "[ring]" not in str(e):
                        raise


_STDERR = 2  # replaced by `quiet_ring_lines` with a copy of the original stderr
_ENDING = threading.Lock()  # held by the thread that ends this rank (`Ring.fail`)
GAVE_UP = b"Too many send/recv errors"  # MLX's line once a socket's peer is gone: its pending ops fail


def quiet_ring_lines(ring: Ring) -> None:
    """Keep the ring's own retry lines (`[ring] ...`, written by MLX to fd 2) off stderr: fd 2 goes through a pipe
    that drops them and passes every other line on; the line that the ring gave up on a socket ends `ring`'s rank,
    naming its neighbours. Python's own stderr writes to the original stderr directly, so a last line (an error,
    then the exit) is never left in the pipe behind a thread that dies with the process."""
    global _STDERR
    if _STDERR != 2:
        return
    old = sys.stderr
    old.flush()
    _STDERR = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)
    sys.stderr = os.fdopen(_STDERR, "w", buffering=1, closefd=False)
    for handler in logging.getLogger().handlers:  # a log line too
        if isinstance(handler, logging.StreamHandler) and handler.stream is old:
            handler.setStream(sys.stderr)

    def forward() -> None:
        with os.fdopen(read, "rb") as pipe:
            for line in pipe:
                if GAVE_UP in line:
                    ring.fail(f"lost {ring.named()} (its connection closed): it died or cannot be reached")
                if not line.startswith(b"[ring]"):
                    os.write(_STDERR, line)

    threading.Thread(target=forward, daemon=True).start()
