"""Timing one benchmark call: warm-up, repetitions until both a run count and a time are met, median and spread,
on the wall clock or this process's CPU clock, with energy from a meter's window where one is readable."""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

import numpy as np

from autotune.profiling.cache_state import Call, ForwardCaches
from autotune.profiling.energy import EnergyMeter
from autotune.profiling.settings import Settings
from runtime.backends import CPU_ENERGY


def time_call(fn: Callable[[], object], s: Settings, meter: EnergyMeter | None = None,
              energy_field: str = CPU_ENERGY, clock: str = "wall", before: Callable[[], object] | None = None) -> dict:
    """Warm up, then repeat until min_runs and min_time_s are both met (or max_runs): median and spread in ms.

    Each run is timed twice: wall clock, and this process's CPU time. `clock` says which one `median_ms` (what
    the fit uses) reports: `cpu` excludes the time other processes on a shared host preempt us (right for
    one-thread CPU work, where CPU time is the latency of an unloaded host); `wall` is needed whenever work
    runs off the CPU (Core ML, the ANE) or on several threads. `energy_field`: the meter's field that measures
    what `fn` runs on (the backend's, from its registry entry). `before`: run ahead of each call, untimed (the
    cache state a forward leaves: `cache_state.ForwardCaches`); a meter's window then also holds it, so its energy,
    measured alone over as many runs after, is taken off. With `before`, as many runs again without it give
    `warm_median_ms`: the state of a forward whose model stays in the host's last-level cache (`cache_state`)."""
    prepare = before if before is not None else (lambda: None)
    for _ in range(s.warmup):
        prepare()
        fn()
    wall: list[float] = []
    cpu: list[float] = []
    window = meter.window() if meter is not None else contextlib.nullcontext({})
    t_start = time.perf_counter()
    with window as spent:
        while len(wall) < s.max_runs and (len(wall) < s.min_runs or time.perf_counter() - t_start < s.min_time_s):
            prepare()
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
    wall_ms = (time.perf_counter() - t_start) * 1e3
    energy = spent.get(energy_field)
    if before is not None and energy is not None:
        with meter.window() as alone:
            for _ in wall:
                prepare()
        energy, wall_ms = max(0.0, energy - alone.get(energy_field, 0.0)), sum(wall)
    times = cpu if clock == "cpu" else wall
    q = np.percentile(times, [10, 25, 75, 90])

    def r(v) -> float:
        return round(float(v), 6)

    rec = {"median_ms": r(statistics.median(times)), "p10_ms": r(q[0]), "p25_ms": r(q[1]), "p75_ms": r(q[2]),
           "p90_ms": r(q[3]), "min_ms": r(min(times)), "clock": clock, "wall_median_ms": r(statistics.median(wall)),
           "cpu_median_ms": r(statistics.median(cpu)), "runs": len(times), "warmup": s.warmup}
    if before is not None:
        rec["warm_median_ms"] = r(_warm_median(fn, len(times), clock))
    if energy is not None and wall_ms > 0:
        rec["energy_mj_per_run"] = r(energy / len(times))
        rec["power_w"] = round(energy / wall_ms, 4)  # mJ / ms = W
    return rec


def _warm_median(fn: Callable[[], object], runs: int, clock: str) -> float:
    """Median ms of `runs` calls back to back (after one untimed), on `clock`."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    fn()
    times = []
    for _ in range(runs):
        t0 = now()
        fn()
        times.append((now() - t0) * 1e3)
    return statistics.median(times)


def time_in_forward(call: Call, s: Settings, meter: EnergyMeter | None = None, energy_field: str = CPU_ENERGY,
                    clock: str = "cpu", caches: ForwardCaches | None = None) -> dict:
    """`time_call` of a CPU call, each run in the cache state a forward leaves it (`cache_state`); `caches`: one
    eviction buffer shared by a profile's records (default: a new one)."""
    return time_call(call.run, s, meter, energy_field, clock, before=(caches or ForwardCaches()).before(call))


def clock_for(cpu_torch: bool, threads: int) -> str:
    """CPU time for one-thread torch work on this process's threads (immune to other processes on a shared host),
    wall clock otherwise."""
    return "cpu" if threads == 1 and cpu_torch else "wall"
