"""The search's totals are sums over the calibration traces; its figures are per prefill chunk."""
from __future__ import annotations

from autotune.searching.space import LayerData


def calibration_chunks(layers: list[LayerData], chunk_tokens: int) -> float:
    """How many chunks of `chunk_tokens` the calibration tokens make: the divisor from a search's totals to figures
    per chunk (a partial chunk counts as its share)."""
    return sum(int(t) for t in layers[0].tokens) / chunk_tokens
