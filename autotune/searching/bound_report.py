"""The priced bound in the search's report: per chunk size the search tried, the least makespan any split of the
prompt's ops reaches at the cost model's prices (`autotune.costing.priced_bound`), whole chunks or halves, and the
least over the sizes; each beside the GPU alone's latency and the roofline (predicted)."""
from __future__ import annotations

import dataclasses

from autotune.costing.priced_bound import BoundSetup, priced_bound
from autotune.costing.split_program import Solved
from autotune.costing.whole_prefill import DENSE_FUNCTIONS, DecoderShape, DensePlacement
from autotune.searching.dense_choice import ROW_GRAIN, attention_blocks, block_keys, dense_weight_bytes, executable
from autotune.searching.objective import host_of, prompts_in
from autotune.searching.optimizer import SearchOutcome
from autotune.searching.overlap_choice import cpu_backends
from autotune.searching.scoring import Scorer
from autotune.searching.space import compressions
from runtime.backends import EXACT

LABEL = ("predicted: the least makespan of any split of the prompt's ops over the units at the cost model's own "
         "prices at each chunk size (whole chunks or halves), each unit busy at most it, the energy at most the cap, "
         "the ANE's window holding its experts and dense weights (dependencies, packing and padding left out: "
         "autotune/costing/priced_bound.py); `chain`: one whole chunk's, its steps in order")


def bound_setup(outcome: SearchOutcome, scorer: Scorer, shape: DecoderShape, prompt_tokens: int,
                chunk: int) -> BoundSetup:
    """What the search's plans at `chunk` may use: its static backend and the CPU's for dense rows beside the host
    the search pinned, the attention core's bucket and block templates, the experts' exact paths, the compressions
    of its space and its drop budget's share."""
    choice = outcome.dense.get(chunk)
    host = choice.placement.host if choice is not None else host_of(scorer)
    backend, context = scorer.backend, shape.context or prompt_tokens
    templates = tuple(DensePlacement(buckets=keys, attention_block=block) for block in attention_blocks(chunk)
                      if (keys := block_keys(prompt_tokens, chunk, block, context)))
    compress = compressions(outcome.space)
    return BoundSetup(static=(backend, *cpu_backends(scorer.cost, backend)), host=host,
                      functions=tuple(f for f in DENSE_FUNCTIONS if f in executable(host)), attention=templates,
                      paths=(scorer.exact, *((EXACT,) if scorer.splits_exact else ())), compressions=compress,
                      drop_share=outcome.drop_rate, grain=ROW_GRAIN,
                      window_bytes={f: min(dense_weight_bytes(shape, DensePlacement(**{f: backend}, compress=c),
                                                              backend) for c in compress)
                                    for f in ("qkv", "o_proj", "mlp")})


def solved_bound(outcome: SearchOutcome, scorer: Scorer, shape: DecoderShape, prompt_tokens: int, chunk: int,
                 energy_cap_mj: float | None, halves: bool = False, drops: bool = True,
                 cache: dict | None = None, chain: bool = False) -> Solved:
    """The priced bound at `chunk` (whole chunks or `halves`; `drops`: within the search's drop budget, else every
    row computed; `chain`: the prompt one whole chunk, run as its chain), solved once per such key and cap where a
    `cache` (a dict the callers share) is given; raises ValueError where no split fits."""
    key = (chunk, halves, drops, energy_cap_mj) + (("chain",) if chain else ())
    if cache is not None and key in cache:
        return cache[key]
    found, setup = outcome.chunks[chunk], bound_setup(outcome, scorer, shape, prompt_tokens, chunk)
    setup = setup if drops else dataclasses.replace(setup, drop_share=0.0)
    got = priced_bound(scorer.cost, shape, prompt_tokens, chunk, [d.calib for d in found.layers],
                       prompts_in(found.layers, prompt_tokens), setup, energy_cap_mj, halves, chain)
    if cache is not None:
        cache[key] = got
    return got


def priced_bounds(outcome: SearchOutcome, scorer: Scorer, shape: DecoderShape, prompt_tokens: int,
                  baseline_ms: float, energy_cap_mj: float | None, roofline_ms: float | None,
                  cache: dict | None = None) -> dict:
    """`{"label", "energy_cap_mj", "drop_share", "by_chunk": {chunk: figures}, "best": figures,
    "best_without_drops": figures}`, each chunk size's figures the lesser of its whole-chunk and half-chunk bounds
    (`shape`, and both as `shapes_ms`): `bound_ms`, `vs_latency_at_most` (`baseline_ms` over it),
    `over_roofline_at_least`, the energy, each unit's busy ms and the binding rows' duals (predicted); where the chunk
    is the whole prompt, `chain`: the same figures for the one chunk run as its chain of steps (what the runtime runs
    at that size: no one-chunk schedule, whole chunks, ends before it; halves are not bound by it). The search's
    drop budget lets a plan leave out that share of the experts' rows, which the roofline counts (so its ratio may be
    below 1); `best_without_drops`: the best chunk size's bound with every row computed. `cache`: as
    `solved_bound`'s (the report's starts solve the same whole-chunk bounds, `bound_seed.LpSeeds`)."""
    def at(chunk: int, drops: bool) -> dict:  # the lesser of the chunk size's whole-chunk and half-chunk bounds
        got = {name: solved_bound(outcome, scorer, shape, prompt_tokens, chunk, energy_cap_mj, halves, drops, cache)
               for name, halves in (("chunks", False), ("half-chunks", True))}
        shape_of = min(got, key=lambda n: got[n].bound_ms)
        row = {"chunk_tokens": chunk, "shape": shape_of, "shapes_ms": {n: round(s.bound_ms, 3) for n, s in got.items()},
               **solved_json(got[shape_of], baseline_ms, roofline_ms)}
        if chunk >= prompt_tokens:
            chain = solved_bound(outcome, scorer, shape, prompt_tokens, chunk, energy_cap_mj, False, drops, cache, True)
            row["chain"] = solved_json(chain, baseline_ms, roofline_ms)
        return row

    by_chunk = {str(chunk): at(chunk, True) for chunk, found in sorted(outcome.chunks.items()) if found.best}
    best = min(by_chunk.values(), key=lambda r: r["bound_ms"]) if by_chunk else None
    exact = at(best["chunk_tokens"], False) if best and outcome.drop_rate > 0 else best
    return {"label": LABEL, "energy_cap_mj": energy_cap_mj, "drop_share": outcome.drop_rate, "by_chunk": by_chunk,
            "best": best, "best_without_drops": exact}


def solved_json(s: Solved, baseline_ms: float, roofline_ms: float | None) -> dict:
    """A bound's figures: the makespan, the ratios, energy, each unit's busy ms (and by op: each dense function, the
    norms and router `rest`, `experts` and their `expert_calls`, `lm_head`, a lazy last layer's `kv_only`) and the
    rows that bind (a nonzero dual: a unit's busy row's is its share of the makespan's sensitivity)."""
    units = {u: {"busy_ms": round(b, 3), "by_op": {t: round(ms, 3) for t, ms in sorted(s.by_op[u].items())}}
             for u, b in s.busy_ms.items()}
    return {"bound_ms": round(s.bound_ms, 3), "vs_latency_at_most": round(baseline_ms / s.bound_ms, 4),
            "over_roofline_at_least": round(s.bound_ms / roofline_ms, 4) if roofline_ms else None,
            "energy_mj": round(s.energy_mj, 3), "units": units,
            "binding": {name: float(f"{d:.4g}") for name, d in s.duals.items() if abs(d) > 1e-9}}
