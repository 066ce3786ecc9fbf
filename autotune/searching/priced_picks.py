"""The experts' decisions picked again with the energy cap and the ANE's window priced in (Lagrange multipliers).

The search picks each layer's decision for latency alone within the drop budget (`optimizer.combine`). Two chunks in
flight are also held to an energy cap (the GPU alone's) and to the window every layer's residents share; the
candidates meet both afterwards, one layer at a time: CPU tails halved (`bound_seed.energy_fit`), residents taken
off (`bound_seed.window_fit`). Here both are priced in the pick itself: over each layer's options (`layer_options`:
the search's best by latency, more and fewer residents, each with every CPU tail of the space), the decisions of
least latency + `energy_price` x energy + a price per resident byte, all layers at once within the drop budget (the
same DP), the byte price the least that fits the residents within a window (`window_priced`). The energy price is a
multiple of the priced bound's dual on the cap (ms of makespan per mJ, `bound_seed.LpSeeds`). Each pick is a
candidate for the schedule's choice of the dense half, which prices it whole (`overlap_choice.choose_overlapped`).

Phi-3.5-MoE at one chunk of 4,096 tokens (published M2 Ultra profile, predicted): the tails the cap allows moved to
the layers where they pay most, and residents trimmed where a byte costs least beside q/k/v and o_proj on the ANE:
2,228.1 -> 2,171.0 ms."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from autotune.searching.optimizer import ChunkSearch, Solution, combine, resident_bytes, solution
from autotune.searching.scoring import Scorer
from autotune.searching.space import LayerConfig, Space


@dataclass(frozen=True)
class Option:
    """One layer's decision with what the pick weighs: its chain latency, energy and held-out drops over the
    calibration chunks, and the bytes its residents keep in the ANE's window."""
    config: LayerConfig
    latency_ms: float
    energy_mj: float
    drops: int
    resident_bytes: float


def layer_options(found: ChunkSearch, space: Space, scorer: Scorer, own: Solution, per_layer: int = 24
                  ) -> list[list[Option]] | None:
    """Per layer: its decision in `own`, the `per_layer` of least latency in the search's pool and half as many each
    with more and with fewer residents, each also with every CPU tail of the space, of `own`'s overflow policy and
    within the limits. None where the profile prices no energy."""
    tails = space.dim("cpu_tail").values if "cpu_tail" in dict(space.params) else (0,)
    policy = own.overflow
    out = []
    for data, pool, mine in zip(found.layers, found.pool, own.configs):
        order = np.argsort(pool.scores.latency_ms, kind="stable")
        order = order[pool.scores.violation[order] == 0]
        resident = space.column(pool.rows[order], "resident")
        half = per_layer // 2
        picked = np.concatenate([order[:per_layer], order[resident > mine.resident][:half],
                                 order[resident < mine.resident][:half]])
        configs = [mine, *(space.config(r) for r in pool.rows[picked])]
        configs += [dataclasses.replace(c, cpu_tail=t) for c in list(configs) for t in tails if t != c.cpu_tail]
        options = []
        for c in dict.fromkeys(configs):
            if c.resident and policy is not None and c.overflow != policy:
                continue
            score, energy = scorer.score(data, c), scorer.energy(data, c)
            if energy is None:
                return None
            if score.violation == 0:
                options.append(Option(c, score.latency_ms, energy, score.heldout_drops,
                                      resident_bytes([c], scorer.hidden, scorer.ffn)))
        out.append(options)
    return out


def priced_pick(options: list[list[Option]], drop_budget: int, energy_price: float, byte_price: float
                ) -> list[Option] | None:
    """Per layer, the option of least latency + `energy_price` x energy + `byte_price` x resident bytes, all layers
    at once within `drop_budget` held-out drops (`optimizer.combine`); None where none fits."""
    costs = [np.array([o.latency_ms + energy_price * o.energy_mj + byte_price * o.resident_bytes for o in opts])
             for opts in options]
    chosen = combine(costs, [np.array([o.drops for o in opts]) for opts in options], drop_budget)
    return None if chosen is None else [opts[i] for opts, i in zip(options, chosen)]


def window_priced(options: list[list[Option]], drop_budget: int, energy_price: float, window: float,
                  steps: int = 14) -> list[Option] | None:
    """`priced_pick` at the least byte price (to `steps` halvings) whose residents fit `window` bytes; None where
    none does."""
    def fits(pick: list[Option] | None) -> bool:
        return pick is not None and sum(o.resident_bytes for o in pick) <= window

    pick = priced_pick(options, drop_budget, energy_price, 0.0)
    if pick is None or fits(pick):
        return pick
    # a byte price at which the least difference in one layer's bytes outweighs every layer's latency and energy:
    # the fewest bytes first (doubled while the layers' differences add up to less)
    span = sum(max(o.latency_ms + energy_price * o.energy_mj for o in opts) for opts in options)
    gaps = [np.diff(np.unique([o.resident_bytes for o in opts])) for opts in options]
    gap = min((float(g.min()) for g in gaps if g.size), default=0.0)
    if gap <= 0:
        return None
    lo, hi = 0.0, span / gap
    best = priced_pick(options, drop_budget, energy_price, hi)
    for _ in range(30):
        if fits(best):
            break
        lo, hi = hi, 2 * hi
        best = priced_pick(options, drop_budget, energy_price, hi)
    if not fits(best):
        return None
    for _ in range(steps):
        mid = (lo + hi) / 2
        got = priced_pick(options, drop_budget, energy_price, mid)
        if fits(got):
            hi, best = mid, got
        else:
            lo = mid
    return best


def priced_picks(found: ChunkSearch, space: Space, scorer: Scorer, drop_budget: int, own: Solution,
                 energy_prices: tuple[float, ...], windows: tuple[float, ...]) -> list[Solution]:
    """The distinct picks at each of `energy_prices` (ms per mJ) fitting each of `windows` (bytes of residents),
    as solutions like `own` (its partial chunks' way)."""
    options = layer_options(found, space, scorer, own)
    if options is None:
        energy_prices = ()
    picks = {tuple(o.config for o in pick): None for price in energy_prices for window in windows
             if (pick := window_priced(options, drop_budget, price, window)) is not None}
    return [solution(list(configs), found.layers, scorer, own.exact_partial) for configs in picks
            if list(configs) != own.configs]
