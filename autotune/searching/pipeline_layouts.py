"""Past one Mac, the layouts beside the pipeline, each with our plan on every Mac, predicted:

- `tensor`: every Mac holds every layer sliced as mlx-lm's `shard()` slices it (1/N of each attention head group,
  of each dense MLP's and each expert's FFN width; router, norms, embedding and `lm_head` whole) and runs its slice
  under a plan searched for it (`search_stage` on the sliced shape): its ANE takes its share of static groups, each
  resident expert a 1/N slice, so the ANE's window holds N times as many. Two `all_sum`s of `chunk x hidden` per
  layer per chunk over the link (`pipeline_link.all_sum_ms`), on the critical path as for mlx-lm's own `shard()`.
  No fill or drain: every Mac works on every chunk.
- `expert`: every Mac holds 1/N of each layer's experts whole (dealt by calibrated popularity, in a snake, so that
  each Mac's share of the assignments is even) and the attention sliced as in `tensor`; each Mac runs its experts
  for every token (the tokens are on every Mac after the attention's `all_sum`: MLX has no `all_to_all`) under a
  plan searched for its experts, and an `all_sum` adds the Macs' outputs: the same two sums per layer as `tensor`.
  The Macs wait for each other at each layer: a layer takes its busier Mac's time.

Either layout is priced on the Macs the pipeline was searched for, at each chunk size searched, and the fastest
chunk kept. `choose_layout` names the fastest of the pipeline and these.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from autotune.costing.pipeline_link import LinkFigure, all_sum_ms
from autotune.costing.whole_prefill import DecoderShape, prompt_chunks
from autotune.searching.layer_data import LayerData
from autotune.searching.pipeline_plan import Mac, Stage, StageSearch, layer_times, search_stage, stage_ms

LAYOUTS = ("pipeline", "tensor", "expert")


def sharded_shape(shape: DecoderShape, n: int) -> DecoderShape:
    """What one rank of mlx-lm's `shard()` computes per layer: 1/n of the heads, KV heads and every FFN width."""
    return dataclasses.replace(shape, heads=shape.heads // n, kv_heads=max(1, shape.kv_heads // n),
                               expert_ffn=shape.expert_ffn // n, shared_ffn=shape.shared_ffn // n,
                               dense_ffn=shape.dense_ffn // n)


def sliced(how: StageSearch) -> StageSearch:
    """A sliced layer's search: its dense half on the exact path (the MLX spine splices whole projections and
    attention cores, not a rank's slice of them)."""
    return dataclasses.replace(how, dense=False)


def sums_ms(link: LinkFigure, n: int, shape: DecoderShape, prompt: int, chunk: int) -> list[float]:
    """Each chunk's two `all_sum`s per layer over the link."""
    return [2 * shape.num_layers * all_sum_ms(link, n, rows, shape.hidden) for rows, _ in prompt_chunks(prompt, chunk)]


@dataclass
class LayoutOutcome:
    """A layout's ranks (one search per distinct Mac and share) and the chunk size whose prefill is fastest."""
    layout: str
    ranks: list[Stage]
    chunk_tokens: int
    compute_ms: float  # the ranks' work, their slowest at each step
    all_sum_ms: float

    @property
    def prefill_ms(self) -> float:
        return self.compute_ms + self.all_sum_ms


def _distinct(macs: list[Mac]) -> dict[tuple, Mac]:
    return {(id(m.cost), m.budget_bytes): m for m in macs}


def plan_tensor(macs: list[Mac], shape: DecoderShape, workloads: dict[int, list[LayerData]], prompt: int,
                link: LinkFigure, how: StageSearch = StageSearch()) -> LayoutOutcome:
    """The tensor layout: each distinct Mac's slice searched; a chunk takes the slowest rank's time, then its sums."""
    n, part = len(macs), sharded_shape(shape, len(macs))
    searched = {k: search_stage(m, part, workloads, prompt, 0, shape.num_layers, sliced(how))
                for k, m in _distinct(macs).items()}
    ranks = [dataclasses.replace(searched[(id(m.cost), m.budget_bytes)], mac=m) for m in macs]

    def priced(chunk: int) -> tuple[float, float]:
        per_rank = [stage_ms(r, prompt, chunk, True) for r in ranks]
        return sum(max(c) for c in zip(*per_rank)), sum(sums_ms(link, n, shape, prompt, chunk))
    chunk = min(_common(ranks), key=lambda c: sum(priced(c)))
    return LayoutOutcome("tensor", ranks, chunk, *priced(chunk))


def expert_owners(layers: list[LayerData], experts: int, n: int) -> list[np.ndarray]:
    """Each rank's experts, the same in every layer (a rank holds whole experts): by popularity over every layer's
    calibration, dealt in a snake (0, 1, .., n-1, n-1, .., 0, ...) so that each rank's share is even."""
    load = sum(d.calib.sum(0) for d in layers)
    order = np.argsort(-load, kind="stable")
    snake = [i % n if (i // n) % 2 == 0 else n - 1 - i % n for i in range(experts)]
    return [np.sort(order[[i for i, r in enumerate(snake) if r == k]]) for k in range(n)]


def _own(d: LayerData, experts: np.ndarray) -> LayerData:
    return LayerData(d.layer, d.calib[:, experts], d.heldout[:, experts], d.chunk_tokens, d.tokens)


def plan_expert(macs: list[Mac], shape: DecoderShape, workloads: dict[int, list[LayerData]], prompt: int,
                link: LinkFigure, how: StageSearch = StageSearch()) -> LayoutOutcome:
    """The expert layout: each rank's experts searched at the chunk sizes searched; a layer takes its busiest
    rank's time over the prompt (the ranks meet at each layer's sums), then the chunks' sums."""
    n = len(macs)
    part = dataclasses.replace(sharded_shape(shape, n), expert_ffn=shape.expert_ffn, num_experts=shape.num_experts // n)
    owners = expert_owners(next(iter(workloads.values())), shape.num_experts, n)
    ranks = [search_stage(m, part, {c: [_own(d, mine) for d in ls] for c, ls in workloads.items()}, prompt, 0,
                          shape.num_layers, sliced(how)) for m, mine in zip(macs, owners)]

    def priced(chunk: int) -> tuple[float, float]:
        times = []
        for r in ranks:
            sol, place = r.at(chunk)
            layers = r.outcome.chunks[chunk].layers
            configs = {d.layer: c for d, c in zip(layers, sol.configs)}
            times.append(layer_times(r.mac.cost, r.scorer, part, layers, prompt, configs, place))
        head = [stage_ms(r, prompt, chunk, True)[-1] - stage_ms(r, prompt, chunk, False)[-1] for r in ranks]
        return sum(map(max, zip(*times))) + max(head), sum(sums_ms(link, n, shape, prompt, chunk))
    chunk = min(_common(ranks), key=lambda c: sum(priced(c)))
    return LayoutOutcome("expert", ranks, chunk, *priced(chunk))


def _common(ranks: list[Stage]) -> list[int]:
    """The chunk sizes every rank's search found a plan at."""
    return [c for c in ranks[0].outcome.chunks if all(r.outcome.chunks.get(c) and r.outcome.chunks[c].best
                                                      for r in ranks)]


def choose_layout(prefill_ms: dict[str, float]) -> str:
    """The fastest layout (ties: the first, in `LAYOUTS` order)."""
    return min(prefill_ms, key=lambda k: (prefill_ms[k], LAYOUTS.index(k)))
