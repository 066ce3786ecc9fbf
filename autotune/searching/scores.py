"""What the search keeps of a decision's predicted cost (`Score`, `Scores` for many) and the one scalar it
minimises (`weighted_cost`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Score:
    latency_ms: float  # predicted, summed over calibration chunks
    energy_mj: float | None  # predicted; None where the profile has no power figures or it was not asked for
    heldout_drops: int  # assignments that would be dropped on held-out chunks
    violation: float  # > 0 when a hard limit (ANE axis/ops/weights, resident bytes) is broken
    partial_ms: float = 0.0  # the part of latency_ms spent on prompts' last, partial chunks (padded static calls)
    partial_mj: float | None = None
    cpu_ms: float = 0.0  # predicted CPU-busy time (packing, cpu-static calls, the exact path), summed like latency
    partial_cpu_ms: float = 0.0  # its part on the partial chunks


@dataclass
class Scores:
    """Scores of many decisions of one layer, one entry per decision (the arrays of `Score`'s fields)."""
    latency_ms: np.ndarray
    energy_mj: np.ndarray | None
    heldout_drops: np.ndarray
    violation: np.ndarray
    partial_ms: np.ndarray
    partial_mj: np.ndarray | None
    cpu_ms: np.ndarray
    partial_cpu_ms: np.ndarray

    FIELDS = ("latency_ms", "energy_mj", "heldout_drops", "violation", "partial_ms", "partial_mj", "cpu_ms",
              "partial_cpu_ms")

    def __len__(self) -> int:
        return len(self.latency_ms)

    def at(self, i: int) -> Score:
        e = lambda a: None if a is None else a[i].item()  # noqa: E731
        return Score(*(e(getattr(self, n)) for n in self.FIELDS))

    def take(self, idx: np.ndarray) -> "Scores":
        return Scores(*(None if (a := getattr(self, n)) is None else a[idx] for n in self.FIELDS))

    @classmethod
    def concat(cls, parts: list["Scores"]) -> "Scores":
        c = lambda name: (None if any(getattr(p, name) is None for p in parts)  # noqa: E731
                          else np.concatenate([getattr(p, name) for p in parts]))
        return cls(*(c(n) for n in cls.FIELDS))


Weights = tuple[float, float, float]  # the search's weights on (latency, energy, CPU-busy time)


def objective_name(weights: Weights) -> str:
    """What `weights` minimise, in words: "latency", "energy", "CPU-busy time" (latency only breaks its ties) or
    "weighted latency + energy"."""
    if weights[2]:
        return "CPU-busy time"
    names = [n for n, w in zip(("latency", "energy"), weights) if w]
    return names[0] if len(names) == 1 else "weighted " + " + ".join(names)


def weighted_cost(s: Score | Scores | Any, weights: Weights, exact_partial: bool = False):
    """The scalar cost the search minimises, of a decision, many (`Scores`: an array) or a plan (a `Solution`):
    `weights` on (latency, energy, CPU-busy time), each normalised by the caller; a part whose weight is 0 is not
    read (energy may be None then). With `exact_partial` the prompts' partial chunks are left out (they run on the
    exact path, whatever the decision: the caller adds that)."""
    out = 0.0
    for w, total, partial in zip(weights, ("latency_ms", "energy_mj", "cpu_ms"),
                                 ("partial_ms", "partial_mj", "partial_cpu_ms")):
        if w:
            out = out + w * (getattr(s, total) - (getattr(s, partial) if exact_partial else 0.0))
    return out


def total_score(scores: list[Score]) -> Score:
    """The sum of scores, field by field (energy None if any is None)."""
    def total(name: str):
        values = [getattr(s, name) for s in scores]
        return None if any(v is None for v in values) else sum(values)

    return Score(*(total(name) for name in Scores.FIELDS))
