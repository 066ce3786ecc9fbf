"""Energy windows on Apple silicon through zeus-apple-silicon (optional, macOS only): the one reader of its
counters, shared by the `ane` backend (energy per group function) and the profiler's meter."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

ENERGY_FIELDS = ("ane_mj", "cpu_total_mj", "gpu_mj", "dram_mj")  # mJ per unit, as zeus-apple-silicon names them


def zeus_monitor() -> object | None:
    """A zeus-apple-silicon `AppleEnergyMonitor`, or None where the package is not installed."""
    try:
        from zeus_apple_silicon import AppleEnergyMonitor  # type: ignore
    except ImportError:
        return None
    return AppleEnergyMonitor()


@contextmanager
def energy_window(monitor: object, key: str) -> Iterator[dict[str, float]]:
    """The mJ spent per unit (those of ENERGY_FIELDS the counters give) while the block ran, in the yielded dict
    once the block has exited. `key` names the window; windows with different keys may overlap (one per thread)."""
    out: dict[str, float] = {}
    monitor.begin_window(key, restart=True)
    try:
        yield out
    finally:
        reading = monitor.end_window(key)
        for unit in ENERGY_FIELDS:
            value = getattr(reading, unit, None)
            if value is not None:
                out[unit] = float(value)
