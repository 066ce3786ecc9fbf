"""Energy meters: one protocol, every meter implements it. A meter measures windows: the energy spent while a
`with` block ran, in mJ per unit (`cpu_total_mj`, and on Apple silicon `ane_mj`, `gpu_mj`, `dram_mj`)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import ContextManager, Iterator, Protocol

from runtime.apple_energy import energy_window, zeus_monitor
from runtime.macos import macos_module


class EnergyMeter(Protocol):
    name: str
    source: str  # what the figures are (and what they include), stored next to them in the profile

    def window(self) -> ContextManager[dict[str, float]]:
        """A context manager whose dict holds, once the block has exited, the mJ spent per unit during it."""
        ...


class RaplMeter:
    """Linux RAPL package counters (/sys/class/powercap/intel-rapl:N). Package energy includes every process on
    the socket, which the profile says next to the figure."""
    name = "rapl"

    def __init__(self, root: str | Path = "/sys/class/powercap") -> None:
        self.domains = sorted(Path(root).glob("intel-rapl:[0-9]"))
        self.source = f"RAPL package counters under {root} (whole socket: other processes included)"
        self.wrap = {d.name: float((d / "max_energy_range_uj").read_text()) / 1e3
                     if (d / "max_energy_range_uj").exists() else None for d in self.domains}

    @classmethod
    def available(cls, root: str | Path = "/sys/class/powercap") -> tuple[bool, str]:
        domains = sorted(Path(root).glob("intel-rapl:[0-9]"))
        if not domains:
            return False, f"no RAPL domains under {root}"
        try:
            for d in domains:
                float((d / "energy_uj").read_text())
        except (OSError, ValueError) as e:
            return False, f"RAPL counters not readable ({e.__class__.__name__})"
        return True, "RAPL"

    @contextlib.contextmanager
    def window(self) -> Iterator[dict[str, float]]:
        start, out = self.read_mj(), {}
        try:
            yield out
        finally:
            out["cpu_total_mj"] = self.delta_mj(start, self.read_mj())  # the package: CPU cores and uncore

    def read_mj(self) -> dict[str, float]:
        return {d.name: float((d / "energy_uj").read_text()) / 1e3 for d in self.domains}

    def delta_mj(self, a: dict[str, float], b: dict[str, float]) -> float:
        """Energy between two readings; a counter that passed its maximum wrapped around to 0."""
        return sum((b[k] - a[k]) % self.wrap[k] if self.wrap.get(k) else b[k] - a[k] for k in a)


class ZeusMeter:
    """zeus-apple-silicon energy windows (mJ per unit, incl. the ANE) on macOS."""
    name = "zeus-apple-silicon"
    source = "zeus-apple-silicon AppleEnergyMonitor windows"

    def __init__(self) -> None:
        self.monitor = zeus_monitor()
        self._n = 0

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return macos_module("zeus_apple_silicon", "zeus-apple-silicon is macOS only",
                             "zeus-apple-silicon is not installed (pip install 'npumoe[energy]')", "zeus-apple-silicon")

    def window(self) -> ContextManager[dict[str, float]]:
        self._n += 1
        return energy_window(self.monitor, f"npumoe-{self._n}")


def energy_meter() -> tuple[EnergyMeter | None, str]:
    """The energy meter this host offers, or None (then no energy is recorded), with the reason."""
    ok, why = ZeusMeter.available()
    if ok:
        return ZeusMeter(), why
    ok, why_rapl = RaplMeter.available()
    if ok:
        return RaplMeter(), why_rapl
    return None, f"no energy counters readable: {why_rapl}; {why}"
