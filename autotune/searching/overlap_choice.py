"""Two chunks in flight, chosen: the experts' steps of a search's solution per unit (what `schedule` queues), and
the dense half's placement chosen again under the schedule (`autotune.costing.schedule`).

Priced as a chain, a dense function the ANE runs slower than the GPU never pays: the layer waits for it. With two
chunks in flight it runs while the GPU computes the other chunk, so the choice that pays differs: for each dense
function in turn, the backend (the static one, or the CPU's where the profile prices it: `cpu_backends`) and its
rows (none, or a multiple of `ROW_GRAIN` up to the chunk; the host, the GPU, the rest) whose schedule ends first,
the others as chosen, until no function changes; per chunk size, with that size's expert solution. So the CPU is a
third unit of the schedule: a function's rows on it run beside the GPU's and the ANE's, at its own energy. A
placement that would take more energy than `energy_cap_mj` (the GPU alone's, say) is not taken."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from autotune.costing.costmodel import CostModel
from autotune.costing.evaluator import LayerWork
from autotune.costing.schedule import Schedule, predict_scheduled
from autotune.costing.whole_prefill import (
    DENSE_FUNCTIONS,
    DecoderShape,
    DensePlacement,
    ExpertFigures,
    LazyLast,
    PrefillPrediction,
    prompt_chunks,
    unit_of,
)
from autotune.searching.dense_choice import ROW_GRAIN, DenseChoice, dense_weight_bytes
from autotune.searching.layer_data import LayerData
from autotune.searching.objective import expert_figures, host_of, lazy_last, placement, prompts_in
from autotune.searching.optimizer import ChunkSearch, Solution, resident_bytes, solution
from autotune.searching.scoring import Scorer
from autotune.searching.space import LayerConfig, Space
from runtime.backends.registry import REFERENCE
from runtime.coreml import ane_limits


@dataclass
class Candidate:
    """One chunk size's plan as the search left it: its experts (with their steps), dense placement, lazy last
    layer, the expert bytes resident on the static backend beside the dense functions, and the report's baseline
    row it is (`Solution.baseline`; None: the search's own)."""
    chunk: int
    experts: ExpertFigures
    placement: DensePlacement
    lazy_last: LazyLast | None = None
    resident_bytes: float = 0.0
    baseline: str | None = None
    rows: tuple[int, ...] = ()  # an uneven chunking (`whole_prefill.prompt_chunks`); (): chunks of `chunk`
    solution: Solution | None = None  # the search's solution whose experts these are (what a plan of it writes)
    # how its dense functions on the static backend may store their weights, least compressed first (the search's
    # space's compressions): the least that fits the window beside the residents is taken (`stored_within`)
    stores: tuple[str, ...] = ("none",)

    @property
    def key(self) -> tuple[int, tuple[int, ...]]:
        """Its chunking: the chunk size and an uneven chunking's rows."""
        return self.chunk, self.rows


class Seeds(Protocol):
    """More choices for one equal chunking (`bound_seed.LpSeeds`): from its candidates `mine` (ranked), and, for a
    chunking whose choice is near the best, from that choice `best`."""
    def __call__(self, chunk: int, mine: list[Candidate]) -> list[Overlapped]: ...

    def picks(self, chunk: int, mine: list[Candidate], best: Overlapped) -> list[Overlapped]: ...


@dataclass
class Overlapped:
    """A placement chosen under the schedule for `candidate`, and its prediction (latency: the schedule's
    makespan); `within_cap`: whether it fits the energy cap and the ANE's window (none of its placements may)."""
    placement: DensePlacement
    prediction: PrefillPrediction
    schedule: Schedule
    candidate: Candidate
    within_cap: bool = True


def layer_units(scorer: Scorer, data: LayerData, cfg: LayerConfig) -> tuple[dict, dict]:
    """One layer's decision as two steps of unit busy times over its calibration chunks: the host's packing and the
    static calls computed on the CPU, then the static calls off it beside the exact lanes (the evaluator's
    per-chunk formula, `pack + on_cpu + max(off_cpu, exact)`, as parts)."""
    cost = scorer.cost
    work = cost.layer_work(scorer.layer_plan(data, cfg), data.calib, scorer.hidden, scorer.ffn, cfg.overflow,
                           scorer.exact)
    return work_units(cost, work, scorer.exact, scorer.backend)


def work_units(cost: CostModel, work: LayerWork, exact: str, backend: str) -> tuple[dict, dict]:
    """A layer's work (`CostModel.layer_work`) as `layer_units`' two steps: the exact path `exact`, the static calls
    on `backend`."""
    n = work.exact.shape[1]
    second = {unit_of(cost, backend): n * float(work.off_cpu[0])}
    exact_unit = unit_of(cost, exact)
    if exact_unit == "cpu":
        second["cpu"] = second.get("cpu", 0.0) + float(work.exact.sum())
    else:
        second[exact_unit], second["cpu"] = float(work.exact.sum()), float(work.cpu_table().sum())
    return {"cpu": float(work.pack.sum()) + n * float(work.on_cpu[0])}, second


def expert_steps(sol: Solution, layers: list[LayerData], scorer: Scorer, prompts: float) -> ExpertFigures:
    """The solution's experts per prompt (`objective.expert_figures`) with their steps: each layer's two steps of
    unit busy times (`layer_units`), and their sums."""
    per_layer = [tuple({u: ms / prompts for u, ms in s.items()} for s in layer_units(scorer, data, cfg))
                 for data, cfg in zip(layers, sol.configs)]
    return with_steps(expert_figures(sol, prompts), per_layer)


def with_steps(experts: ExpertFigures, per_layer: list[tuple[dict[str, float], ...]]) -> ExpertFigures:
    """`experts` with each MoE layer's steps (`per_layer`, in layer order, each the same steps) and their sums, a step
    no layer keeps busy left out."""
    kept = [k for k in range(len(per_layer[0]) if per_layer else 0)
            if any(ms > 0 for layer in per_layer for ms in layer[k].values())]
    by_layer = tuple(tuple(layer[k] for k in kept) for layer in per_layer)
    steps: list[dict[str, float]] = [{} for _ in kept]
    for layer in by_layer:
        for into, units in zip(steps, layer):
            for unit, ms in units.items():
                into[unit] = into.get(unit, 0.0) + ms
    return dataclasses.replace(experts, steps=tuple(steps), by_layer=by_layer)


def overlap_candidate(sol: Solution, layers: list[LayerData], scorer: Scorer, shape: DecoderShape, prompt_tokens: int,
                      choice: DenseChoice | None, stores: tuple[str, ...] = ("none",)) -> Candidate:
    """A whole plan as two chunks in flight take it (`overlap_choice.Candidate`): its experts with their steps, the
    dense placement the objective gives it (`objective.placement`), its lazy last layer and resident bytes; `stores`:
    the weight storages its dense functions may take (the search space's, `space.compressions`)."""
    prompts = prompts_in(layers, prompt_tokens)
    experts = expert_steps(sol, layers, scorer, prompts)
    return Candidate(sol.chunk_tokens, experts, placement(sol, choice, host_of(scorer)),
                     lazy_last(sol, layers, scorer, shape, prompts), resident_bytes(sol, scorer.hidden, scorer.ffn),
                     sol.baseline, solution=sol, stores=stores)


def rebalanced(found: ChunkSearch, space: Space, scorer: Scorer, drop_budget: int, per_layer: int = 24,
               weights: tuple[float, ...] = tuple(np.linspace(0.1, 0.9, 9))) -> list[Solution]:
    """Solutions that move the experts' work between the static backend and the exact path, for a schedule to
    price: each layer's `per_layer` decisions of least chain latency in the search's pool, and as many with more
    experts resident than its own pick and as many with fewer (its own among them: fewer residents free the
    static backend's window for dense functions, `choose_overlapped`),
    and per weight w, each layer's decision of least `pack + w * static + (1 - w) * exact` (a schedule with two
    chunks in flight is bound by the busier unit's total, not each layer's longer side); those within the drop
    budget."""
    static = unit_of(scorer.cost, scorer.backend)
    options = []
    for data, pool, own in zip(found.layers, found.pool, found.best.configs):
        order = np.argsort(pool.scores.latency_ms, kind="stable")
        resident = space.column(pool.rows[order], "resident")
        more, fewer = order[resident > own.resident], order[resident < own.resident]  # more or less static work
        rows = pool.rows[np.concatenate([order[:per_layer], more[:per_layer], fewer[:per_layer]])]
        cfgs = list(dict.fromkeys([own, *(space.config(r) for r in rows)]))
        options.append([(c, layer_units(scorer, data, c), scorer.score(data, c).heldout_drops) for c in cfgs])
    out = []
    for w in weights:
        def cost(option) -> float:
            first, second = option[1]
            rest = max((ms for u, ms in second.items() if u != static), default=0.0)
            return sum(first.values()) + w * second.get(static, 0.0) + (1 - w) * rest
        picks = [min(opts, key=cost) for opts in options]
        if sum(p[2] for p in picks) <= drop_budget:
            out.append(solution([p[0] for p in picks], found.layers, scorer, found.best.exact_partial))
    return out


def static_rows_grid(chunk: int) -> list[int]:
    """The static rows tried per function: none, then multiples of `ROW_GRAIN` (at most 16 of them), the chunk."""
    step = max(ROW_GRAIN, (chunk // 16) // ROW_GRAIN * ROW_GRAIN)
    return [0, *range(step, chunk, step), chunk]


def placed(place: DensePlacement, function: str, rows: int, chunk: int, backend: str,
           prompt_tokens: int, chunk_rows: tuple[int, ...] = ()) -> DensePlacement:
    """`place` with `function` on `backend` for `rows` of a full chunk's rows (0: on the host); an attention core's
    buckets the full chunks' contexts (of the uneven chunking `chunk_rows`), each a multiple of the chunk as a
    plan's must be (`place` as it is where one is not)."""
    if not rows:
        return dataclasses.replace(place, **{function: None}).with_rows(function, None)
    out = dataclasses.replace(place, **{function: backend})
    if function == "attention" and not out.buckets:  # a static core per full chunk's context
        buckets = tuple(c for r, c in prompt_chunks(prompt_tokens, chunk, chunk_rows) if r == chunk)
        if any(c % chunk for c in buckets):
            return place
        out = dataclasses.replace(out, buckets=buckets)
    return out.with_rows(function, rows if rows < chunk else None)


def cpu_backends(cost: CostModel, backend: str) -> tuple[str, ...]:
    """The CPU's static backend (torch, `REFERENCE`) as a third unit for dense functions, where the profile prices its
    FLOPs and the static backend is not on the CPU itself."""
    on_cpu = unit_of(cost, backend) == "cpu"
    priced = REFERENCE in cost.models and cost.dense_fit(REFERENCE, "matmul").ms_per_gflop > 0
    return (REFERENCE,) if priced and not on_cpu else ()


def best_by_chunk(scorer: Scorer, shape: DecoderShape, prompt_tokens: int, candidates: list[Candidate],
                  in_flight: int = 2, energy_cap_mj: float | None = None, keep: int = 3,
                  halves: bool = False, seeds: Seeds | None = None, near: float = 0.05
                  ) -> dict[tuple[int, tuple[int, ...]], Overlapped]:
    """Per chunking (`Candidate.key`), of its candidate whose schedule ends first as it stands, those among the
    `keep` first of all sizes and its first that leaves the static backend's window room for q/k/v and o_proj
    (`window_trade`), each with its dense placement chosen again under the schedule (the static backend's and the
    CPU's, `cpu_backends`), and per equal chunking `seeds`' choices from its ranked candidates (`bound_seed.LpSeeds`),
    the one that then ends first; per equal chunking whose choice ends within `near` of the first within the cap,
    also `seeds.picks` from it; and, from the equal two chunks' choice, the uneven two chunks that end first
    (`uneven_pairs`), the equal two chosen again from each one's placement (the descent moves one function at a time:
    another start finds another optimum); `halves`: each chunk's dense ops per half (`schedule.prefill_steps`, not run
    by the runtime)."""
    def as_is(c: Candidate) -> float:
        pred, _ = predict_scheduled(scorer.cost, shape, prompt_tokens, c.chunk, c.experts, c.placement, in_flight,
                                    c.lazy_last, halves, c.rows)
        over = energy_cap_mj is not None and pred.energy_mj is not None and pred.energy_mj > energy_cap_mj
        return np.inf if over else pred.latency_ms

    def first(got: list[Overlapped]) -> Overlapped:
        return min(got, key=lambda o: (not o.within_cap, o.prediction.latency_ms))

    ranked = sorted(candidates, key=as_is)
    backends = (scorer.backend, *cpu_backends(scorer.cost, scorer.backend))
    out, mine = {}, {}
    for key in sorted({c.key for c in ranked}):
        mine[key] = [c for c in ranked if c.key == key]
        tried = [mine[key][0], *(c for c in ranked[:keep] if c.key == key and c is not mine[key][0])]
        tried += [c for c in window_trade(mine[key], shape, scorer.backend) if all(c is not t for t in tried)]
        got = [choose_overlapped(scorer.cost, backends, shape, prompt_tokens, c, in_flight, energy_cap_mj,
                                 halves=halves) for c in tried]
        out[key] = first(got + (seeds(key[0], mine[key]) if seeds is not None and not key[1] else []))
    least = min((o.prediction.latency_ms for o in out.values() if o.within_cap), default=np.inf)
    for key, o in list(out.items()) if seeds is not None else ():
        if not key[1] and o.within_cap and o.prediction.latency_ms <= (1 + near) * least:
            out[key] = first([o, *seeds.picks(key[0], mine[key], o)])
    half = out.get((prompt_tokens // 2, ())) if prompt_tokens % (2 * ROW_GRAIN) == 0 and not halves else None
    for o in uneven_pairs(scorer.cost, backends, shape, prompt_tokens, half, in_flight, energy_cap_mj) if half else []:
        out[o.candidate.key] = o
        again = choose_overlapped(scorer.cost, backends, shape, prompt_tokens,  # the equal two from its placement
                                  dataclasses.replace(half.candidate, placement=o.placement), in_flight, energy_cap_mj)
        if (not again.within_cap, again.prediction.latency_ms) < (not half.within_cap, half.prediction.latency_ms):
            out[half.candidate.key] = half = again
    return out


def uneven_pairs(cost: CostModel, backends: tuple[str, ...], shape: DecoderShape, prompt_tokens: int,
                 half: Overlapped, in_flight: int = 2, energy_cap_mj: float | None = None,
                 keep: int = 2) -> list[Overlapped]:
    """The prompt as two uneven chunks, the first 1/4..3/4 of it in `ROW_GRAIN` steps (the equal split left out),
    from the equal two chunks' choice `half`: each priced with its experts (as many calls per expert: their steps
    shared by rows) and placement (`chunk_tokens` the longer chunk; the shorter one's dense work on the host, as a
    partial chunk's), then the `keep` that end first with their dense placement chosen again
    (`choose_overlapped`)."""
    cand, quarter = half.candidate, prompt_tokens // 4

    def price(first: int) -> tuple[float, Candidate]:
        rows = (first, prompt_tokens - first)
        c = dataclasses.replace(cand, chunk=max(rows), rows=rows, placement=rechunked(half.placement, max(rows),
                                                                                      prompt_tokens, rows))
        pred, _ = predict_scheduled(cost, shape, prompt_tokens, c.chunk, c.experts, c.placement, in_flight,
                                    c.lazy_last, chunk_rows=rows)
        over = energy_cap_mj is not None and pred.energy_mj is not None and pred.energy_mj > energy_cap_mj
        return (np.inf if over else pred.latency_ms), c

    firsts = [f for f in range(quarter // ROW_GRAIN * ROW_GRAIN, 3 * quarter + 1, ROW_GRAIN) if 2 * f != prompt_tokens]
    best = sorted((price(f) for f in firsts), key=lambda p: p[0])[:keep]
    return [choose_overlapped(cost, backends, shape, prompt_tokens, c, in_flight, energy_cap_mj) for _, c in best]


def rechunked(place: DensePlacement, chunk: int, prompt_tokens: int, chunk_rows: tuple[int, ...]) -> DensePlacement:
    """`place` for chunks of `chunk` rows (uneven: `chunk_rows`): its split functions' static rows as they are, its
    attention core's buckets the new full chunks' (`placed`)."""
    if place.attention is None:
        return place
    rows = place.static_rows("attention", chunk)
    bare = dataclasses.replace(place, attention=None, buckets=(), attention_block=None).with_rows("attention", None)
    return placed(bare, "attention", rows, chunk, place.attention, prompt_tokens, chunk_rows)


def window_trade(ranked: list[Candidate], shape: DecoderShape, backend: str) -> list[Candidate]:
    """The first of `ranked` whose resident experts leave the static backend's window room for every layer's q/k/v
    and o_proj (none if none does): fewer experts on the ANE, the rest on the exact path, for dense rows there, a
    trade the dense choice prices jointly with the rows (`choose_overlapped`) rather than one expert at a time."""
    return next(([c] for c in ranked if c.resident_bytes <= projection_room(shape, backend, c.stores[-1])), [])


def projection_room(shape: DecoderShape, backend: str, compress: str) -> float:
    """The bytes the static backend's window leaves for experts beside every layer's q/k/v and o_proj stored as
    `compress`."""
    both = DensePlacement(qkv=backend, o_proj=backend, compress=compress)
    return ane_limits.WINDOW_BYTES - dense_weight_bytes(shape, both, backend)


def best_overlapped(by_chunk: dict) -> Overlapped:
    """Of each chunk size's choice (`best_by_chunk`) within the cap, the one whose schedule ends first (the smaller
    chunk on a tie)."""
    return min(by_chunk.values(), key=lambda o: (not o.within_cap, o.prediction.latency_ms, o.prediction.chunk_tokens))


def choose_overlapped(cost: CostModel, backends: str | tuple[str, ...], shape: DecoderShape, prompt_tokens: int,
                      cand: Candidate, in_flight: int = 2, energy_cap_mj: float | None = None, rounds: int = 2,
                      grid: Callable[[int], list[int]] = static_rows_grid, halves: bool = False,
                      grain: int = ROW_GRAIN) -> Overlapped:
    """The dense placement whose schedule ends first (see the module docstring), from the candidate's own, each
    function on one of `backends` (the first: the static backend whose window the experts share) for rows from
    `grid(chunk)`, then each function's static rows moved by `grain` while that ends sooner (`refined`; 0: not);
    one whose dense weights on the first and the resident experts overflow the ANE's window is not taken.
    `halves`: priced as a micro-pipeline inside each chunk (`schedule.prefill_steps`)."""
    backends = (backends,) if isinstance(backends, str) else backends
    chunk = cand.chunk

    def price(place: DensePlacement) -> tuple[float, PrefillPrediction, Schedule]:
        pred, sched = predict_scheduled(cost, shape, prompt_tokens, chunk, cand.experts, place, in_flight,
                                        cand.lazy_last, halves, cand.rows)
        over = energy_cap_mj is not None and pred.energy_mj is not None and pred.energy_mj > energy_cap_mj
        over = over or window_over(shape, place, cand.resident_bytes, backends[0]) > 0
        return (np.inf if over else pred.latency_ms), pred, sched

    best_place = start = stored_within(shape, cand.placement, cand, backends[0])
    best = price(start)
    functions = [f for f in DENSE_FUNCTIONS if f != "mlp" or any(shape.mlp_ffn(la) for la in range(shape.num_layers))]
    for _ in range(rounds):
        changed = False
        for function in functions:
            for backend in backends:
                for rows in grid(chunk):
                    place = stored_within(shape, placed(best_place, function, rows, chunk, backend, prompt_tokens,
                                                        cand.rows), cand, backends[0])
                    if place == best_place:
                        continue
                    got = price(place)
                    if got[0] < best[0] - 1e-9:
                        best_place, best, changed = place, got, True
        if not changed:
            break
    if grain:
        best_place, best = refined(price, best_place, best, functions, chunk, grain)
    return Overlapped(best_place, best[1], best[2], cand, bool(np.isfinite(best[0])))


def window_over(shape: DecoderShape, place: DensePlacement, resident_bytes: float, backend: str) -> float:
    """Bytes past the ANE's window of `resident_bytes` of experts beside the placement's functions on `backend`."""
    return ane_limits.resident_over_window({"experts": resident_bytes,
                                            "dense functions": dense_weight_bytes(shape, place, backend)})


def stored_within(shape: DecoderShape, place: DensePlacement, cand: Candidate, backend: str) -> DensePlacement:
    """`place` with its functions' weights on `backend` stored as the least compressed of `cand.stores` that fits
    the window beside the candidate's residents (the most compressed where none fits: the caller's check refuses
    it). Fidelity first: weights are compressed only where the window asks for it."""
    fits = (c for c in cand.stores
            if window_over(shape, dataclasses.replace(place, compress=c), cand.resident_bytes, backend) <= 0)
    return dataclasses.replace(place, compress=next(fits, cand.stores[-1]))


def refined(price: Callable, place: DensePlacement, best: tuple, functions: list[str], chunk: int,
            grain: int) -> tuple[DensePlacement, tuple]:
    """A local search below the grid's step: each statically placed function's rows (of a full chunk) `grain`
    fewer or more, kept while its schedule ends sooner (`price(place)` -> (ms, ...)), so that the static backend's
    and the host's parts of a step finish together; never worse than `place`."""
    changed = True
    while changed:
        changed = False
        for function in functions:
            backend = getattr(place, function)
            if backend is None or (function == "attention" and place.attention_block):
                continue
            rows = place.static_rows(function, chunk)
            for step in (-grain, grain):
                while 0 < rows + step <= chunk:
                    got = price(place.with_rows(function, rows + step if rows + step < chunk else None))
                    if got[0] >= best[0] - 1e-9:
                        break
                    rows, best, changed = rows + step, got, True
                    place = place.with_rows(function, rows if rows < chunk else None)
    return place, best
