"""Starts for the schedule's choice (`overlap_choice`) beside the search's own plans.

A layer's CPU tail (`LayerConfig.cpu_tail`: its coldest experts on cpu-exact beside the GPU's exact path) shortens
the chain the search prices, which has no energy in its latency objective; at the CPU's power it can take a whole
plan past the GPU alone's energy, the cap two chunks in flight are held to. Where every plan of a chunk size within
the ANE's window carries tails past the cap (phi-3.5-moe at one chunk of 4,096 tokens, published M2 Ultra profile),
no placement of its dense half can bring it back under, and that chunk size fell back to the GPU alone. So each plan
with a tail is also offered without it (`tail_free`): the same residents and groups, the tail's experts on the
plan's exact path; and with as much of its tails as the cap allows (`energy_fit`: tails halved where that loses the
least latency per mJ; Qwen3-30B-A3B at one chunk of 4,096, published profile: 1,263.5 ms without tails, 1,229.8
with them halved in part). Likewise a plan whose residents overflow the ANE's window (the search's per-layer budget
does not see the window every layer shares) is also offered with the fewest residents taken off that fit it
(`window_fit`).

The schedule's choice of the dense half (`overlap_choice.choose_overlapped`) is a coordinate descent from the
candidate's own placement, one function at a time; the priced bound's LP (`autotune.costing.priced_bound`) splits
every function at once. So it is also started from the LP's split at that chunk size (`LpSeeds`), rounded to the
descent's grid, and for the candidate whose experts' split is nearest the LP's."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autotune.costing.costmodel import CostModel
from autotune.costing.priced_bound import BoundSetup
from autotune.costing.split_program import Solved
from autotune.costing.whole_prefill import DENSE_FUNCTIONS, DecoderShape, DensePlacement, unit_of
from autotune.searching.bound_report import bound_setup, solved_bound
from autotune.searching.layer_data import LayerData
from autotune.searching.optimizer import SearchOutcome, Solution, resident_bytes, solution
from autotune.searching.overlap_choice import (
    Candidate,
    Overlapped,
    choose_overlapped,
    layer_units,
    overlap_candidate,
    placed,
    projection_room,
    static_rows_grid,
)
from autotune.searching.priced_picks import priced_picks
from autotune.searching.scoring import Scorer
from autotune.searching.space import LayerConfig, compressions
from runtime.backends import EXACT
from runtime.coreml import ane_limits


def tail_free(sols: list[Solution], layers: list[LayerData], scorer: Scorer) -> list[Solution]:
    """Each of `sols` that runs a CPU tail in some layer, again with every layer's tail on its exact path (its
    drops unchanged: a tail's experts are computed either way)."""
    out = []
    for sol in sols:
        if sol.baseline is None and any(c.cpu_tail for c in sol.configs):
            configs = [dataclasses.replace(c, cpu_tail=0) for c in sol.configs]
            out.append(dataclasses.replace(solution(configs, layers, scorer, sol.exact_partial), dense=sol.dense))
    return out


def energy_fit(sols: list[Solution], layers: list[LayerData], scorer: Scorer, price: Callable[[Solution], float | None],
               prompts: float, energy_cap_mj: float | None) -> list[Solution]:
    """Each of `sols` whose CPU tails take it past the energy cap (`price`: its whole prefill's mJ, dense half
    included), with tails halved one layer at a time, each where that costs its layer's chain the least latency per mJ
    saved (the units' busy ms, `layer_units`, at their powers; `prompts`: the calibration prompts they sum), until
    it fits: the tails the cap allows, where `tail_free` takes all or none (its drops unchanged)."""
    if energy_cap_mj is None:
        return []
    cost = scorer.cost
    power = {unit_of(cost, b): cost.power_w(b) or 0.0 for b in {scorer.backend, scorer.exact, EXACT}}

    steps: dict[tuple[int, LayerConfig], tuple[float, LayerConfig, float] | None] = {}  # layer i's next halving

    def mj(data: LayerData, cfg: LayerConfig) -> float:
        units = layer_units(scorer, data, cfg)
        return sum(ms * power.get(u, 0.0) for step in units for u, ms in step.items()) / prompts

    def step(i: int, cfg: LayerConfig) -> tuple[float, LayerConfig, float] | None:
        """Layer i's tail halved: (latency lost per mJ saved, its decision, mJ saved); None where nothing is saved."""
        if (i, cfg) not in steps:
            data, fewer = layers[i], dataclasses.replace(cfg, cpu_tail=cfg.cpu_tail // 2)
            saved = mj(data, cfg) - mj(data, fewer) if cfg.cpu_tail else 0.0
            lost = scorer.score(data, fewer).latency_ms - scorer.score(data, cfg).latency_ms if saved > 0 else 0.0
            steps[i, cfg] = (lost / saved, fewer, saved) if saved > 0 else None
        return steps[i, cfg]

    def halved(configs: list[LayerConfig]) -> tuple[float, int, LayerConfig, float] | None:
        """The layer whose tail halved loses the least latency per mJ saved: (ratio, layer, its decision, mJ)."""
        options = [(got[0], i, got[1], got[2]) for i, cfg in enumerate(configs) if (got := step(i, cfg))]
        return min(options, key=lambda o: o[:2]) if options else None

    out = []
    for sol in sols:
        energy = price(sol) if sol.baseline is None and any(c.cpu_tail for c in sol.configs) else None
        configs, fit = list(sol.configs), sol
        while energy is not None and energy > energy_cap_mj:
            guess = energy  # halve on the layers' own figures, then price the whole plan again
            while guess > energy_cap_mj and (best := halved(configs)) is not None:
                configs[best[1]], guess = best[2], guess - best[3]
            if configs == list(fit.configs):
                break
            fit = dataclasses.replace(solution(list(configs), layers, scorer, sol.exact_partial), dense=sol.dense)
            energy = price(fit)
        if fit is not sol and energy is not None and energy <= energy_cap_mj:
            out.append(fit)
    return out


def window_fit(sols: list[Solution], layers: list[LayerData], scorer: Scorer, drop_budget: int,
               window: float | None = None) -> list[Solution]:
    """Each of `sols` whose resident experts overflow `window` bytes (the ANE's window, which the schedule's choice
    does not take; or what the window leaves beside dense functions), with residents taken off one at a time, each
    where one fewer costs its layer the least chain latency per byte freed, until they fit; those within the drop
    budget (fewer residents drop no more); `window` None: the ANE's."""
    window = ane_limits.WINDOW_BYTES if window is None else window
    out = []
    for sol in sols:
        configs = list(sol.configs)
        if sol.baseline is not None or resident_bytes(configs, scorer.hidden, scorer.ffn) <= window:
            continue
        latency = [scorer.score(d, c).latency_ms for d, c in zip(layers, configs)]
        while resident_bytes(configs, scorer.hidden, scorer.ffn) > window:
            options = []
            for i, (data, cfg) in enumerate(zip(layers, configs)):
                if cfg.resident:
                    fewer = dataclasses.replace(cfg, resident=cfg.resident - 1, gpu_head=min(cfg.gpu_head,
                                                                                               cfg.resident - 1))
                    ms = scorer.score(data, fewer).latency_ms
                    freed = ane_limits.expert_weight_bytes(scorer.hidden, scorer.ffn, cfg.compress)
                    options.append(((ms - latency[i]) / freed, i, fewer, ms))
            _, i, configs[i], latency[i] = min(options, key=lambda o: (o[0], o[1]))
        fit = dataclasses.replace(solution(configs, layers, scorer, sol.exact_partial), dense=sol.dense)
        if fit.heldout_drops <= drop_budget and all(f.configs != fit.configs for f in out):
            out.append(fit)
    return out


def lp_rows(solved: Solved, cost: CostModel, static: tuple[str, ...], chunk: int, grain: int
            ) -> dict[str, dict[str, float]]:
    """Per dense function, the rows of a full chunk the priced bound's LP (`priced_bound`, whole chunks) puts on each
    static backend: over the function's ops (layers of a kind, full chunks), their mean weighted by count."""
    backend_of = {unit_of(cost, b): b for b in static}
    sums: dict[str, dict[str, list[float]]] = {}
    for tag, count, roles in solved.ops:
        for role, bands in roles if tag in DENSE_FUNCTIONS else ():
            if role.suffix or role.unit not in backend_of:
                continue
            points = [*range(0, chunk, grain), chunk] if len(bands) > 1 else [0, chunk]  # as `priced_bound` splits
            widths = np.diff(points)
            acc = sums.setdefault(tag, {}).setdefault(backend_of[role.unit], [0.0, 0.0])
            acc[0] += count * float(np.dot(solved.x[bands], widths))
            acc[1] += count
    return {f: {b: rows / n for b, (rows, n) in by.items()} for f, by in sums.items()}


def lp_placements(rows: dict[str, dict[str, float]], host: str, chunk: int, prompt_tokens: int
                  ) -> list[DensePlacement]:
    """The LP's split as placements the runtime runs: each function on the static backend the LP gives most of its
    rows, those rows rounded to the schedule's grid (`static_rows_grid`) to the nearest, down and up (0: the host)."""
    grid = np.asarray(static_rows_grid(chunk))
    picks = (lambda r: grid[np.argmin(np.abs(grid - r))], lambda r: grid[grid <= r + 1e-6].max(),
             lambda r: grid[grid >= r - 1e-6].min())
    out = []
    for pick in picks:
        place = DensePlacement(host=host)
        for f, by in sorted(rows.items()):
            backend, r = max(by.items(), key=lambda kv: kv[1])
            place = placed(place, f, int(pick(r)), chunk, backend, prompt_tokens)
        out.append(place)
    return list(dict.fromkeys(out))


def nearest_experts(cands: list[Candidate], solved: Solved) -> Candidate:
    """Of `cands`, the one whose experts' busy ms per unit (its steps, per prompt) are nearest the LP's (its experts and
    their calls per unit), in the sum of absolute differences."""
    want = {u: ops.get("experts", 0.0) + ops.get("expert_calls", 0.0) for u, ops in solved.by_op.items()}

    def gap(c: Candidate) -> float:
        have: dict[str, float] = {}
        for step in c.experts.steps:
            for u, ms in step.items():
                have[u] = have.get(u, 0.0) + ms
        return sum(abs(have.get(u, 0.0) - want.get(u, 0.0)) for u in {*have, *want})
    return min(cands, key=gap)


@dataclass
class LpSeeds:
    """`best_by_chunk`'s seeds (its `seeds` hook, `overlap_choice.Seeds`): per chunk size, the schedule's choice
    (`choose_overlapped`) also started from the priced bound's LP solution there (whole chunks, the same energy cap):
    its dense split as placements (`lp_placements`), for the chunk size's first candidate and the one whose experts'
    split is nearest the LP's among those whose experts fit the ANE's window (`nearest_experts`); and (`picks`, where
    the caller's choice is near its best) the experts picked again with the cap and the window priced in
    (`priced_picks`: energy at `energy_shares` of the LP's dual on the cap, the residents within the window and
    within what it leaves beside q/k/v and o_proj), each from its own placement and the caller's choice's; what no
    placement within the cap and window reaches is not taken, as there."""
    outcome: SearchOutcome
    scorer: Scorer
    shape: DecoderShape
    prompt_tokens: int
    energy_cap_mj: float | None = None
    in_flight: int = 2
    bounds: dict = dataclasses.field(default_factory=dict, repr=False)  # `bound_report.solved_bound`'s cache
    energy_shares: tuple[float, ...] = (0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)

    def solved(self, chunk: int) -> tuple[Solved, BoundSetup] | None:
        """The priced bound at `chunk`, whole chunks within the cap (None where no split fits it), and its setup."""
        try:
            got = solved_bound(self.outcome, self.scorer, self.shape, self.prompt_tokens, chunk, self.energy_cap_mj,
                               cache=self.bounds)
        except ValueError:  # no split fits the cap: no seed
            return None
        return got, bound_setup(self.outcome, self.scorer, self.shape, self.prompt_tokens, chunk)

    def __call__(self, chunk: int, mine: list[Candidate]) -> list[Overlapped]:
        got = self.solved(chunk) if chunk in self.outcome.chunks else None
        if got is None or not mine:
            return []
        solved, setup = got
        rows = lp_rows(solved, self.scorer.cost, setup.static, chunk, setup.grain)
        starts = lp_placements(rows, setup.host, chunk, self.prompt_tokens)
        fits = [c for c in mine if c.resident_bytes <= ane_limits.WINDOW_BYTES] or mine
        cands = list(dict.fromkeys(map(id, (mine[0], nearest_experts(fits, solved)))))
        by_id = {id(c): c for c in mine}
        return [choose_overlapped(self.scorer.cost, setup.static, self.shape, self.prompt_tokens,
                                  dataclasses.replace(by_id[i], placement=start), self.in_flight, self.energy_cap_mj)
                for i in cands for start in starts]

    def picks(self, chunk: int, mine: list[Candidate], best: Overlapped) -> list[Overlapped]:
        """The schedule's choice for each of `picked`'s candidates, from its own placement and from `best`'s."""
        got = self.solved(chunk) if chunk in self.outcome.chunks else None
        if got is None or not mine:
            return []
        solved, setup = got
        return [choose_overlapped(self.scorer.cost, setup.static, self.shape, self.prompt_tokens, c, self.in_flight,
                                  self.energy_cap_mj)
                for pick in self.picked(chunk, mine, solved)
                for c in (pick, dataclasses.replace(pick, placement=best.placement))]

    def picked(self, chunk: int, mine: list[Candidate], solved: Solved) -> list[Candidate]:
        """The experts of the chunk size's first search solution picked again with the energy and the window priced
        (`priced_picks`), as candidates."""
        own = next((c.solution for c in mine if c.solution is not None and c.solution.baseline is None), None)
        if own is None:
            return []
        dual = solved.duals.get("energy_cap", 0.0) if self.energy_cap_mj is not None else 0.0
        prices = tuple(dict.fromkeys(share * dual for share in self.energy_shares)) if dual > 0 else (0.0,)
        stores, backend = compressions(self.outcome.space), self.scorer.backend
        windows = tuple(dict.fromkeys((ane_limits.WINDOW_BYTES, projection_room(self.shape, backend, stores[-1]))))
        found = self.outcome.chunks[chunk]
        sols = priced_picks(found, self.outcome.space, self.scorer, self.outcome.drop_budget, own, prices, windows)
        return [overlap_candidate(s, found.layers, self.scorer, self.shape, self.prompt_tokens,
                                  self.outcome.dense.get(chunk), stores) for s in sols]
