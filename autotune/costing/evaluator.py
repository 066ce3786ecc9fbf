"""The one evaluator: how a MoE layer's busy parts compose into latency, CPU-busy time and energy, over arrays.

A decision is a row; one plan is one row. A row's static calls take the same time in every chunk (their
capacities are fixed): `on_cpu` ms on backends that compute on the CPU, `off_cpu` ms on a backend that runs off it
(the ANE), `static_mj` their energy. Its exact paths and host packing vary by chunk: rows of the tables `exact`
[K, chunks] and `pack` [P, chunks], picked per decision by `exact_of` / `pack_of` (the decisions that share
residency and tiers share them: what makes scoring thousands of decisions affordable). Per chunk:

    latency = pack + on_cpu + max(off_cpu, exact)     # the exact paths overlap off-CPU calls, not CPU work
    cpu     = pack + on_cpu + exact_cpu               # while an off-CPU call runs, the calling thread waits
    energy  = static_mj + cpu_w * pack + exact_mj

Three lanes run side by side: the static calls off the CPU (the ANE), the exact path off the CPU (the GPU: MLX) and
the exact path on the CPU. `exact` is the two exact lanes already composed per chunk (`CostModel.exact_lanes`: the
longer lane, or the memory bus's floor when both stream more than it carries), `exact_cpu` the CPU lane's share of
it and `exact_mj` their energy. With one exact path on the CPU (no `exact_cpu` / `exact_mj` tables) both are
`exact` and `cpu_w * exact`.

`totals` sums them over a set of chunks for every row (the sum of max() from each table's sorted times);
`per_chunk` gives them chunk by chunk. Both are `_compose`. The prices that fill the tables are the cost model's
(`CostModel`); the limits are `ane_limits`' and `over_budget`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class LayerWork:
    """One MoE layer's busy parts (ms) for many decision rows (see the module docstring)."""
    on_cpu: np.ndarray  # [rows] static calls computed on the CPU, per chunk
    off_cpu: np.ndarray  # [rows] static calls off the CPU, per chunk
    exact: np.ndarray  # [K, chunks] exact-path time (its call and host costs included)
    pack: np.ndarray  # [P, chunks] host packing time
    exact_of: np.ndarray  # [rows] -> a row of `exact`
    pack_of: np.ndarray  # [rows] -> a row of `pack`
    static_mj: np.ndarray | None = None  # [rows] energy of the static calls per chunk; None: a power is unknown
    cpu_w: float | None = None  # the CPU's power (W); None: unknown
    exact_cpu: np.ndarray | None = None  # [K, chunks] the CPU lane's busy time within `exact` (None: all of it)
    exact_mj: np.ndarray | None = None  # [K, chunks] the exact lanes' energy (None: cpu_w x exact)

    def cpu_table(self) -> np.ndarray:
        return self.exact if self.exact_cpu is None else self.exact_cpu

    def mj_table(self) -> np.ndarray | None:
        if self.exact_mj is not None:
            return self.exact_mj
        return None if self.cpu_w is None else self.cpu_w * self.exact


@dataclass
class Totals:
    """Predicted latency, CPU-busy time (ms) and energy (mJ; None where a power is unknown) of each row."""
    latency_ms: np.ndarray
    cpu_ms: np.ndarray
    energy_mj: np.ndarray | None


def _compose(work: LayerWork, n: Any, pack: np.ndarray, exact_cpu: np.ndarray, exact_mj: np.ndarray | None,
             exact_over_calls: np.ndarray) -> Totals:
    """The formulas, once: `n` chunks whose packing sums to `pack`, the CPU's exact lane to `exact_cpu`, the exact
    lanes' energy to `exact_mj` and max(off_cpu, exact) to `exact_over_calls`."""
    on = work.on_cpu.reshape(work.on_cpu.shape + (1,) * (np.ndim(pack) - 1))
    latency = pack + (n * on + exact_over_calls)
    cpu = pack + exact_cpu + n * on
    energy = None
    if work.static_mj is not None and work.cpu_w is not None and exact_mj is not None:
        energy = n * work.static_mj.reshape(on.shape) + work.cpu_w * pack + exact_mj
    return Totals(latency, cpu, energy)


def per_chunk(work: LayerWork) -> Totals:
    """Each row's figures chunk by chunk ([rows, chunks])."""
    exact, mj = work.exact[work.exact_of], work.mj_table()
    return _compose(work, 1, work.pack[work.pack_of], work.cpu_table()[work.exact_of],
                    None if mj is None else mj[work.exact_of], np.maximum(work.off_cpu[:, None], exact))


def totals(work: LayerWork, chunks: np.ndarray) -> Totals:
    """Each row's figures summed over the chunks where `chunks` (a bool mask) is set ([rows])."""
    exact, mj = work.exact[:, chunks], work.mj_table()
    over_calls = (sum_max(work.off_cpu, exact, work.exact_of) if work.off_cpu.any()
                  else exact.sum(1)[work.exact_of])
    return _compose(work, int(chunks.sum()), work.pack[:, chunks].sum(1)[work.pack_of],
                    work.cpu_table()[:, chunks].sum(1)[work.exact_of],
                    None if mj is None else mj[:, chunks].sum(1)[work.exact_of], over_calls)


def sum_max(level: np.ndarray, table: np.ndarray, of: np.ndarray) -> np.ndarray:
    """[rows]: the sum over a table row's entries of max(level, entry), for row `of[i]` of `table` and `level[i]`:
    from each table row sorted once, the entries below the level count as the level, the rest as themselves."""
    ts = np.sort(table, axis=1)
    tail = np.concatenate([np.cumsum(ts[:, ::-1], axis=1)[:, ::-1], np.zeros((len(ts), 1))], 1)
    below = (ts[of] < level[:, None]).sum(1)
    return below * level + tail[of, below]


def over_budget(used: Any, budget: float) -> Any:
    """The resident-bytes limit: how far `used` bytes are past `budget`, as a fraction of it (0 within)."""
    return np.maximum(0.0, np.asarray(used, dtype=np.float64) - budget) / max(1.0, budget)


@dataclass
class Link:
    """One step of a chain that nothing overlaps (a decoder layer's dense ops run one after another): its latency,
    and where the step does not say them, its CPU-busy time (all of it on the CPU, none off it) and energy (power
    x latency; None where the power is unknown)."""
    latency_ms: float
    on_cpu: bool = True
    power_w: float | None = None
    cpu_ms: float | None = None
    energy_mj: float | None = None
    units: dict[str, float] | None = None  # each unit's busy ms within the step (a schedule's parts: `schedule`)

    def __post_init__(self) -> None:
        if self.cpu_ms is None:
            self.cpu_ms = self.latency_ms if self.on_cpu else 0.0
        if self.energy_mj is None and self.power_w is not None:
            self.energy_mj = self.power_w * self.latency_ms

    def times(self, n: int) -> "Link":
        """The same step `n` times (layers of one shape)."""
        return Link(n * self.latency_ms, self.on_cpu, self.power_w, n * self.cpu_ms,
                    None if self.energy_mj is None else n * self.energy_mj,
                    None if self.units is None else {u: n * ms for u, ms in self.units.items()})


@dataclass
class ChainTotals:
    latency_ms: float
    cpu_ms: float
    energy_mj: float | None


def chain(links: list[Link]) -> ChainTotals:
    """Steps in sequence: latencies, CPU-busy times and energies add (energy None if any step's is)."""
    energy = None if any(s.energy_mj is None for s in links) else float(sum(s.energy_mj for s in links))
    return ChainTotals(float(sum(s.latency_ms for s in links)), float(sum(s.cpu_ms for s in links)), energy)
