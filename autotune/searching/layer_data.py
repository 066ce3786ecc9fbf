"""One MoE layer's routing traces as the search reads them, at one chunk size: per-chunk loads and capacities."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autotune.calibration.traces import Traces
from autotune.searching.space import QUANTILES


@dataclass
class LayerData:
    """One layer's traces as the search needs them, at one chunk size."""
    layer: int
    calib: np.ndarray  # [chunks, E] assignments per expert per calibration chunk
    heldout: np.ndarray  # [chunks, E] on held-out chunks
    chunk_tokens: int = 0  # the chunk size the counts are for (0: not said)
    tokens: np.ndarray | None = None  # [calib chunks] tokens in each (None: every chunk full)
    rank: np.ndarray = field(init=False)  # experts by calibration popularity, most used first
    partial: np.ndarray = field(init=False)  # [calib chunks] bool: a prompt's last chunk, shorter than chunk_tokens
    _quantiles: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.rank = np.argsort(-self.calib.sum(0), kind="stable")
        if self.tokens is None:
            self.tokens = np.full(self.calib.shape[0], self.chunk_tokens)
        self.partial = self.tokens < self.chunk_tokens

    @property
    def full_calib(self) -> np.ndarray:
        """The full calibration chunks' counts (all of them where every chunk is partial): what capacities are
        sized on."""
        return self.calib[~self.partial] if (~self.partial).any() else self.calib

    @property
    def calib_chunks(self) -> float:
        """The calibration tokens in chunks of `chunk_tokens`: what a figure summed over chunks is divided by to be
        per chunk."""
        return float(self.tokens.sum()) / self.chunk_tokens

    def band_capacities(self, lo: int, hi: int) -> np.ndarray:
        """Capacities of the tier made of ranks lo..hi-1 at each of QUANTILES: the quantile of their per-chunk loads
        on full calibration chunks (memoised: the search asks for the same bands over and over)."""
        key = (lo, hi)
        if key not in self._quantiles:
            loads = self.full_calib[:, self.rank[lo:hi]].reshape(-1)
            self._quantiles[key] = np.maximum(1, np.ceil(np.quantile(loads, QUANTILES))).astype(np.int64)
        return self._quantiles[key]

    def band_capacity(self, lo: int, hi: int, q: float) -> int:
        return int(self.band_capacities(lo, hi)[QUANTILES.index(q)])

    def expert_capacities(self, lo: int, hi: int) -> np.ndarray:
        """[QUANTILES, hi-lo]: each of ranks lo..hi-1 at each quantile of its own per-chunk loads (full chunks)."""
        key = ("expert", lo, hi)
        if key not in self._quantiles:
            loads = self.full_calib[:, self.rank[lo:hi]]
            self._quantiles[key] = np.maximum(1, np.ceil(np.quantile(loads, QUANTILES, axis=0))).astype(np.int64)
        return self._quantiles[key]

    def capacities(self, lo: int, hi: int, sizing: str) -> np.ndarray:
        """[QUANTILES, hi-lo]: the capacity of each of ranks lo..hi-1 as a tier sized by `sizing`."""
        if sizing == "expert":
            return self.expert_capacities(lo, hi)
        return np.repeat(self.band_capacities(lo, hi)[:, None], hi - lo, axis=1)

    @classmethod
    def from_traces(cls, traces: Traces, chunk_tokens: int | None = None,
                    prompt_tokens: int | None = None) -> list["LayerData"]:
        """Every MoE layer's counts, re-chunked to `chunk_tokens` within prompts of `prompt_tokens` (default: as
        recorded)."""
        w = traces.workload(chunk_tokens or traces.header["chunk_tokens"], prompt_tokens)
        return [cls(l, w.counts(traces, l, "calib"), w.counts(traces, l, "heldout"), w.chunk_tokens,
                    w.sizes[~w.heldout]) for l in traces.spec["moe_layers"]]
