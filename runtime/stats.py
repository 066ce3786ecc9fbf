"""Run statistics: what the executor did per layer, summed for the run."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch


@dataclass
class LayerStats:
    assignments: int = 0  # (token, expert) pairs routed
    dropped: int = 0  # overflowed a static slice and were dropped (overflow: drop)
    spilled: int = 0  # overflowed a static slice and ran on cpu-exact instead (overflow: spill)
    tokens: int = 0
    slots: int = 0  # static slice rows executed (filled + padding)
    filled: int = 0  # static slice rows that held a real assignment
    tokens_per_backend: Counter = field(default_factory=Counter)  # assignments computed per backend
    calls_per_backend: Counter = field(default_factory=Counter)
    # per exact path computing off torch (mlx-exact): microseconds spent moving its calls' inputs and outputs
    # between torch and that runtime (copies, views, dtype views; not its compute), and how many calls crossed
    crossing_us: Counter = field(default_factory=Counter)
    crossings: Counter = field(default_factory=Counter)
    seconds_per_backend: Counter = field(default_factory=Counter)  # wall time of each backend's calls (measured)
    watcher: Callable[[np.ndarray, int], None] | None = None  # sees each chunk's expert loads (drift monitor)

    def record_chunk(self, tokens: int, loads: torch.Tensor, overflow: int, spill: bool) -> None:
        """Count one chunk's routing: `loads[e]` assignments chose expert e, `overflow` of them did not fit."""
        self.tokens += tokens
        self.assignments += int(loads.sum())
        if spill:
            self.spilled += overflow
        else:
            self.dropped += overflow
        if self.watcher is not None:
            self.watcher(loads.numpy(), overflow)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.filled / self.slots if self.slots else 0.0

    def merge(self, other: "LayerStats") -> None:
        for name in ("assignments", "dropped", "spilled", "tokens", "slots", "filled"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.tokens_per_backend.update(other.tokens_per_backend)
        self.calls_per_backend.update(other.calls_per_backend)
        self.crossing_us.update(other.crossing_us)
        self.crossings.update(other.crossings)
        self.seconds_per_backend.update(other.seconds_per_backend)

    def to_json(self) -> dict:
        """Counts and rates; `crossing_us_per_call` (mean per exact path that crossed) only where one crossed."""
        crossing = {name: self.crossing_us[name] / n for name, n in self.crossings.items() if n}
        return {"assignments": self.assignments, "dropped": self.dropped, "spilled": self.spilled,
                "tokens": self.tokens, "drop_rate": self.dropped / self.assignments if self.assignments else 0.0,
                "spill_rate": self.spilled / self.assignments if self.assignments else 0.0,
                "padding_fraction": self.padding_fraction, "static_slots": self.slots,
                "tokens_per_backend": dict(self.tokens_per_backend),
                "calls_per_backend": dict(self.calls_per_backend),
                **({"crossing_us_per_call": crossing} if crossing else {})}


PHASES = ("prefill", "decode")


@dataclass
class RunStats:
    """Per-layer statistics, kept apart for prefill and decode (one new token per sequence on a filled cache)."""
    layers: dict[int, LayerStats] = field(default_factory=dict)  # prefill
    decode: dict[int, LayerStats] = field(default_factory=dict)
    exact_paths: frozenset[str] = frozenset()  # the registry's exact paths: their calls are not static calls

    def layer(self, index: int, phase: str = "prefill") -> LayerStats:
        return (self.decode if phase == "decode" else self.layers).setdefault(index, LayerStats())

    def _of(self, phase: str | None) -> list[LayerStats]:
        """Every layer's stats of one phase, or of both when `phase` is None."""
        parts = {"prefill": [self.layers], "decode": [self.decode], None: [self.layers, self.decode]}[phase]
        return [s for layers in parts for s in layers.values()]

    def total(self, phase: str | None = None) -> LayerStats:
        """Summed over layers: of one phase, or of both when `phase` is None."""
        total = LayerStats()
        for s in self._of(phase):
            total.merge(s)
        return total

    def static_calls(self, phase: str | None = None) -> int:
        """Calls to static groups (every backend but the exact paths); summed without merging the layers' stats (a
        server reads it around every decode step)."""
        return sum(n for s in self._of(phase) for name, n in s.calls_per_backend.items()
                   if name not in self.exact_paths)

    def reset(self) -> None:
        for layers in (self.layers, self.decode):  # in place: executors hold references to their LayerStats
            for s in layers.values():
                s.__init__(watcher=s.watcher)

    def to_json(self) -> dict:
        out = self.total().to_json()
        out.pop("tokens")  # per-layer token counts add up to layers x tokens; the run reports tokens itself
        per_layer: dict[int, LayerStats] = {}
        for layers in (self.layers, self.decode):
            for i, s in layers.items():
                per_layer.setdefault(i, LayerStats()).merge(s)
        out["per_layer"] = {str(i): s.to_json() for i, s in sorted(per_layer.items())}
        for phase in PHASES:
            part = self.total(phase).to_json()
            part.pop("tokens")
            out[phase] = part
        return out


PARTS = ("attention_projections", "attention_core", "experts", "dense_mlp", "lm_head", "rest")
# the part each kind of dense function (`DenseSpec.kind`) computes
DENSE_PARTS = {"qkv": "attention_projections", "o_proj": "attention_projections", "attention": "attention_core",
               "mlp": "dense_mlp"}
TORCH_CPU = "torch-cpu"
# exact paths computed by torch, and a split dense function's rows torch computes (`cpu-share`): the lane says so
_TORCH_LANES = {"cpu-exact": TORCH_CPU, "cpu-share": TORCH_CPU}


def lane_of(backend: str) -> str:
    """The lane that ran a backend's (or exact path's) calls: cpu-exact is torch on the CPU; every other name says
    itself (`mlx-exact`, and a static backend's name: `ane`, `ane-sim`, `coreai`, `cpu-static`)."""
    return _TORCH_LANES.get(backend, backend)


@dataclass
class Executed:
    """What ran each part of the model (`PARTS`), per lane: calls and measured seconds. A lane's name says what ran
    it: `mlx` in every MLX lane's (`mlx-exact`, `mlx-cpu` / `mlx-gpu`), `torch` in every torch lane's, a static
    backend's own name for its calls. Time is only ever measured, never apportioned: a lane whose calls ran
    untimed (MLX's lazy graph outside a timed pass) has calls and no `ms`."""
    calls: Counter = field(default_factory=Counter)  # (part, lane) -> calls
    seconds: Counter = field(default_factory=Counter)  # (part, lane) -> measured seconds
    timed: set = field(default_factory=set)  # the (part, lane) pairs whose seconds were measured
    # chunks in flight (`runtime.mlx.overlap`): each lane's measured busy and wait ms over the prefills so run
    lanes: dict = field(default_factory=dict)

    def add(self, part: str, lane: str, calls: int = 1, seconds: float | None = None) -> None:
        assert part in PARTS, part
        self.calls[part, lane] += calls
        if seconds is not None:
            self.seconds[part, lane] += seconds
            self.timed.add((part, lane))

    def add_experts(self, stats: LayerStats) -> None:
        """The experts' calls per backend of `stats` (a run's total), on their lanes, with the time measured around
        their calls where it was."""
        for backend, n in stats.calls_per_backend.items():
            self.add("experts", lane_of(backend), n, stats.seconds_per_backend.get(backend))

    def clear(self) -> None:
        self.calls.clear()
        self.seconds.clear()
        self.timed.clear()
        self.lanes.clear()

    def to_json(self) -> dict:
        out: dict[str, dict] = {}
        for (part, lane), n in sorted(self.calls.items(), key=lambda kv: (PARTS.index(kv[0][0]), kv[0][1])):
            entry = {"calls": n}
            if (part, lane) in self.timed:
                entry["ms"] = round(self.seconds[part, lane] * 1e3, 3)
            out.setdefault(part, {})[lane] = entry
        return {**out, "lanes": self.lanes} if self.lanes else out
