"""What running costs the process, measured: peak resident memory and CPU time.

The predicted side is the tuner's (`autotune/costing/memory.py`, and the cost model's CPU-busy time); a run reports
these next to it.
"""
from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far: on Linux its address space's high-water mark (`VmHWM`; Linux
    carries `ru_maxrss` across fork and exec, so a process started by a large one would report its parent's peak),
    else ru_maxrss (bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_rss_mb() -> float:
    """`peak_rss_bytes` in MiB."""
    return peak_rss_bytes() / (1 << 20)


@dataclass
class Clock:
    """Wall time and the process's CPU time (user + system, every thread) over a block:
    `with Clock() as c: ...; c.wall_s, c.cpu_s`."""
    wall_s: float = 0.0
    cpu_s: float = 0.0

    def __enter__(self) -> "Clock":
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._wall
        self.cpu_s = time.process_time() - self._cpu


def timed_runs(fn: Callable[[], T], repeat: int) -> tuple[T, float, float]:
    """The last result of `repeat` calls, their median wall time and median process CPU time (every thread), in
    ms."""
    wall, cpu, out = [], [], None
    for _ in range(repeat):
        out = None  # dropped before the next call makes its own: one result held at a time
        with Clock() as clock:
            out = fn()
        wall.append(clock.wall_s * 1e3)
        cpu.append(clock.cpu_s * 1e3)
    return out, statistics.median(wall), statistics.median(cpu)
