"""Which layers each Mac holds: consecutive runs of decoder layers, one stage per Mac in order, balanced by each
stage's predicted time on its own Mac under that Mac's memory budget.

`balanced_split` is exact: over every way to cut the layers into consecutive runs (each Mac at least one layer), the
one whose slowest stage is fastest among those where every stage's memory fits its Mac (dynamic programming over
(stage, last layer)). `even_split` is mlx-lm's own (`PipelineMixin.pipeline` without a split: equal counts, the extra
layers to the low ranks, and rank 0 holds the last layers), which its pipeline runs by default.
"""
from __future__ import annotations

from collections.abc import Sequence

from runtime.errors import NpumoeError

GB = 1e9


def balanced_split(layer_ms: Sequence[Sequence[float]], layer_bytes: Sequence[float], fixed_bytes: Sequence[float],
                   budgets: Sequence[float]) -> list[tuple[int, int]]:
    """(first, last) layers of each stage: `layer_ms[s][l]`, layer l's predicted time on stage s's Mac;
    `layer_bytes[l]`, what it holds; `fixed_bytes[s]`, what stage s holds besides its layers; `budgets[s]`, its
    Mac's memory. Raises NpumoeError where no split fits."""
    stages, n = len(budgets), len(layer_bytes)
    if stages > n:
        raise NpumoeError(f"{stages} Macs for {n} layers: a stage needs at least one layer")
    run_ms = [[0.0, *_running(row)] for row in layer_ms]
    run_bytes = [0.0, *_running(layer_bytes)]
    inf = float("inf")
    # best[s][j]: the least slowest-stage time of stages 0..s holding layers 0..j-1; cut[s][j]: stage s's first layer
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for s in range(stages):
        for j in range(s + 1, n - (stages - 1 - s) + 1):
            for i in range(s, j):
                before = 0.0 if s == 0 else best[s - 1][i]
                if (s == 0 and i) or before == inf:
                    continue
                if run_bytes[j] - run_bytes[i] + fixed_bytes[s] > budgets[s]:
                    continue
                t = max(before, run_ms[s][j] - run_ms[s][i])
                if t < best[s][j]:
                    best[s][j], cut[s][j] = t, i
    if best[-1][n] == inf:
        need = (run_bytes[n] + sum(fixed_bytes)) / GB
        raise NpumoeError(f"no split of {n} layers over {stages} Macs fits their memory ({need:.1f} GB in all, "
                          f"budgets {', '.join(f'{b / GB:g}' for b in budgets)} GB); add a Mac or quantize further")
    return _walk_back(cut, n)


def _running(values: Sequence[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out


def _walk_back(cut: list[list[int]], n: int) -> list[tuple[int, int]]:
    bounds, last = [], n
    for s in range(len(cut) - 1, -1, -1):
        first = cut[s][last]
        bounds.append((first, last))
        last = first
    return bounds[::-1]


def even_split(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """mlx-lm's default split, in layer order: rank r holds base (+1 for the first n % stages ranks) layers, and
    rank 0 the last ones, so the extra layers go to the last stages."""
    base, extra = divmod(n_layers, stages)
    counts = [base + (1 if r < extra else 0) for r in range(stages)][::-1]  # stage s is rank stages-1-s
    bounds, first = [], 0
    for c in counts:
        bounds.append((first, first + c))
        first += c
    return bounds
