"""The whole prefill in the search's report: the plan (its experts and dense functions) and the paper's baselines,
whole-model, each predicted over one prompt as the search's objective prices it (`autotune.searching.objective`),
and the plan's ratio against each."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from autotune.costing.schedule import timeline_chart
from autotune.costing.whole_prefill import (
    DENSE_FUNCTIONS,
    DecoderShape,
    DensePlacement,
    PrefillPrediction,
    prompt_chunks,
    roofline_ms,
)
from autotune.searching.bound_seed import LpSeeds, energy_fit, tail_free, window_fit
from autotune.searching.layer_data import LayerData
from autotune.searching.objective import WholePrefill, host_of, placement, prompts_in
from autotune.searching.optimizer import SearchOutcome, Solution, ranked_solutions, solution
from autotune.searching.overlap_choice import (
    Candidate,
    Overlapped,
    best_by_chunk,
    best_overlapped,
    overlap_candidate,
    projection_room,
    rebalanced,
)
from autotune.searching.scores import weighted_cost
from autotune.searching.scoring import Scorer
from autotune.searching.space import LayerConfig, compressions
from runtime.coreml import ane_limits

PREFILL_BASELINES = {
    "coreml-cpu": "Core ML CPU-only: every op on the CPU",
    "coreml-naive": "naive Core ML: dense ops on the ANE, one graph per expert at a uniform capacity",
    "ane-dense-cpu-experts": "dense ops on the ANE, every expert exact on the CPU",
    "ane-dense-masked-experts": "dense ops on the ANE, all experts as one masked dense graph (ANEForge's MoE)",
    "paper-heuristic": "dense ops on the ANE, the paper's heuristic for the experts",
    "experts-only": "the experts-only plan (the search without dense decisions), dense ops on the CPU",
    "mlx-gpu": "every op on the GPU through MLX, as mlx-lm runs it (where the profile prices the GPU)",
}


def mlx_gpu_prefill(scorer: Scorer, shape: DecoderShape, layers: list[LayerData], prompt_tokens: int
                    ) -> PrefillPrediction:
    """mlx-lm's way, predicted: every expert on the GPU's exact path and every dense op on the GPU, in chunks of
    the layers' chunk size (`scorer.exact` must be the GPU's path)."""
    sol = solution([LayerConfig(0) for _ in layers], layers, scorer)
    return WholePrefill(shape, prompt_tokens).price(dataclasses.replace(sol, dense=DensePlacement(host=scorer.exact)),
                                                    layers, scorer)


def tradeoff(outcome: SearchOutcome, scorer: Scorer, shape: DecoderShape, prompt_tokens: int) -> list[dict]:
    """The candidate plans a user could pick, whole prefill (experts and their dense placement): each chunk size's
    optimum at each share of the drop budget and the objective's other candidates (`ranked_solutions`), predicted
    latency and energy."""
    whole = outcome.whole or WholePrefill(shape, prompt_tokens)
    out = []
    for sol in ranked_solutions(outcome, scorer):
        pred = whole.price(sol, outcome.chunks[sol.chunk_tokens].layers, scorer, outcome.dense.get(sol.chunk_tokens))
        out.append({"chunk_tokens": sol.chunk_tokens, "heldout_drops": sol.heldout_drops,
                    "predicted_prefill_ms": pred.latency_ms, "predicted_prefill_energy_mj": pred.energy_mj})
    return out


def pick_candidates(outcome: SearchOutcome, scorer: Scorer, shape: DecoderShape, prompt_tokens: int,
                    energy_cap_mj: float | None = None) -> list[Candidate]:
    """For two chunks in flight where the search's pick's experts are fixed (the fidelity gate, `--measure` or
    `--robust` chose them): the pick as it is, without its CPU tail and with as much of it as `energy_cap_mj` allows
    (`bound_seed.tail_free`, `energy_fit`: a tail's experts are exact either way), the schedule choosing their
    chunking and dense half, its functions' weights fp16 as the gate measured them (no compression it did not
    check)."""
    sol = outcome.best
    layers = outcome.chunks[sol.chunk_tokens].layers
    fits = energy_fit([sol], layers, scorer, _energy(outcome, scorer, shape, prompt_tokens, sol.chunk_tokens),
                      prompts_in(layers, prompt_tokens), energy_cap_mj)
    return [overlap_candidate(s, layers, scorer, shape, prompt_tokens, outcome.dense.get(sol.chunk_tokens))
            for s in (sol, *tail_free([sol], layers, scorer), *fits)]


def _energy(outcome: SearchOutcome, scorer: Scorer, shape: DecoderShape, prompt_tokens: int, chunk: int
            ) -> Callable[[Solution], float | None]:
    """A whole plan's energy at `chunk` as the search's objective prices it (mJ, one prompt)."""
    whole, layers = outcome.whole or WholePrefill(shape, prompt_tokens), outcome.chunks[chunk].layers
    return lambda sol: whole.price(sol, layers, scorer, outcome.dense.get(chunk)).energy_mj


def overlap_candidates(outcome: SearchOutcome, scorer: Scorer, shape: DecoderShape, prompt_tokens: int,
                       within: float = 1.5, energy_cap_mj: float | None = None) -> list[Candidate]:
    """For two chunks in flight (`overlap_choice`): at each chunk size whose cheapest whole plan, as the search's
    objective prices it (`WholePrefill.price`), is within `within` of the least latency over all sizes, the
    objective's whole plans there (`WholePrefill.candidates`) and the experts' optimum rebalanced (`rebalanced`),
    each with a CPU tail also without it (`bound_seed.tail_free`: the energy cap may not allow the tail), each past
    the ANE's window also trimmed to fit it, and to leave room for every layer's q/k/v and o_proj at the space's
    most compressed storage (`bound_seed.window_fit`, `overlap_choice.projection_room`), each past `energy_cap_mj`
    with its tails also halved until it fits (`bound_seed.energy_fit`)."""
    whole = outcome.whole or WholePrefill(shape, prompt_tokens)
    plans: dict[int, list[Solution]] = {}
    chain: dict[int, float] = {}
    for chunk, found in sorted(outcome.chunks.items()):
        if found.best is None:
            continue
        choice = outcome.dense.get(chunk)
        sols = [*whole.candidates(found, choice, scorer, outcome.space, outcome.drop_budget, outcome.drop_rate,
                                  outcome.weights), *rebalanced(found, outcome.space, scorer, outcome.drop_budget)]
        sols += tail_free(sols, found.layers, scorer)
        windows = dict.fromkeys((ane_limits.WINDOW_BYTES,  # and room for the projections, where they take any
                                 projection_room(shape, scorer.backend, compressions(outcome.space)[-1])))
        sols += [fit for w in windows for fit in window_fit(sols, found.layers, scorer, outcome.drop_budget, w)]
        plans[chunk] = [*sols, *energy_fit(sols, found.layers, scorer,
                                           _energy(outcome, scorer, shape, prompt_tokens, chunk),
                                           prompts_in(found.layers, prompt_tokens), energy_cap_mj)]
        chain[chunk] = min(whole.price(s, found.layers, scorer, choice).latency_ms for s in plans[chunk])
    least = min(chain.values())
    return [overlap_candidate(sol, outcome.chunks[chunk].layers, scorer, shape, prompt_tokens, outcome.dense.get(chunk),
                              compressions(outcome.space))
            for chunk, sols in plans.items() if chain[chunk] <= within * least for sol in sols]


def whole_prefill(outcome: SearchOutcome, scorer: Scorer, shape: DecoderShape, prompt_tokens: int,
                  in_flight: int = 1, timeline: str | None = None, bounds: dict | None = None) -> dict:
    """`whole_prefill_choice`'s figures."""
    return whole_prefill_choice(outcome, scorer, shape, prompt_tokens, in_flight, timeline, bounds=bounds)[0]


def whole_prefill_choice(outcome: SearchOutcome, scorer: Scorer, shape: DecoderShape, prompt_tokens: int,
                         in_flight: int = 1, timeline: str | None = None, pick_only: bool = False,
                         bounds: dict | None = None) -> tuple[dict, Overlapped | None]:
    """`predicted_prefill_ms`, `predicted_parts_ms`, `prefill_baselines` (each design's whole-prefill latency,
    energy and CPU-busy time, and `candidate`: whether it is a plan the search weighed, `objective.PLAN_ROWS`),
    `vs` (each baseline's figure over the plan's: > 1, the plan is ahead; None where the plan's is 0),
    `over_roofline_whole` (the plan's latency over the prompt's FLOPs at the throughput of the ANE, the CPU and the
    GPU together; None where no lane's fit prices FLOPs) and `tradeoff` (the candidate plans' latency and energy).
    The plan and every row are priced as the search's objective prices them (`objective.WholePrefill`). With
    `in_flight` 2 the plan runs two chunks in flight: the objective's whole plans at each chunk size and their
    rebalanced variants (`overlap_candidates`), each with its dense half chosen again under the schedule
    (`overlap_choice`) at no more energy than the GPU alone's, whole chunks also from the priced bound's split
    (`bound_seed.LpSeeds`); the plan the fastest schedule the runtime runs (whole
    chunks: `runtime_executes` true, `executable` its figures again), its latency the schedule's and
    `predicted_schedule` each unit's busy and idle ms (the CPU a third unit where its dense functions run there);
    `by_chunk`: each chunk size's best so (`overlap_choice.best_by_chunk`), `half_chunks` the same as half-chunks and
    `half_chunk` the fastest of those (`executable_json`: not the plan, the runtime does not run it);
    `one_in_flight_ms`: the search's plan as a chain; `timeline`: a PNG of its schedule's first two layers
    (`schedule.timeline_chart`); `pick_only`: of the experts, the search's pick's alone (`pick_candidates`). With the
    figures, the schedule chosen (what a plan of it writes; None with `in_flight` 1). `bounds`: the priced bounds
    solved so far, shared with the caller's (`bound_report.solved_bound`'s cache)."""
    whole = outcome.whole or WholePrefill(shape, prompt_tokens)
    chunk = outcome.best.chunk_tokens
    layers = outcome.chunks[chunk].layers
    choice = outcome.dense_choice  # none without a Core ML backend: the dense half on the host the search pinned
    plan = whole.price(outcome.best, layers, scorer, choice)
    solved = [s.best for s in outcome.chunks.values() if s.best]
    experts_only = min(solved, key=lambda s: weighted_cost(s, outcome.weights))
    at = outcome.chunks[experts_only.chunk_tokens].layers
    rows = whole.rows(layers, scorer, outcome.drop_rate, experts_only)
    base = {name: whole.price(sol, at if name == "experts-only" else layers, scorer) for name, sol in rows.items()}
    candidate = {name: whole.is_plan(sol, at if name == "experts-only" else layers, scorer, outcome.drop_budget)
                 for name, sol in rows.items()}
    place, plan_is, one, runs = placement(outcome.best, choice, host_of(scorer)), outcome.best.baseline, {}, None
    roof = roofline_ms(scorer.cost, shape, prompt_tokens, scorer.backend)
    if in_flight > 1:
        cap = base["mlx-gpu"].energy_mj if "mlx-gpu" in base else None
        cands = (pick_candidates(outcome, scorer, shape, prompt_tokens, cap) if pick_only
                 else overlap_candidates(outcome, scorer, shape, prompt_tokens, energy_cap_mj=cap))
        seeds = LpSeeds(outcome, scorer, shape, prompt_tokens, cap, in_flight, {} if bounds is None else bounds)
        by_chunk = best_by_chunk(scorer, shape, prompt_tokens, cands, in_flight, cap, seeds=seeds)
        by_half = best_by_chunk(scorer, shape, prompt_tokens, cands, in_flight, cap, halves=True)
        runs, half = best_overlapped(by_chunk), best_overlapped(by_half)
        one = {"one_in_flight_ms": plan.latency_ms, "by_chunk": by_chunk_json(by_chunk, prompt_tokens),
               "half_chunks": by_chunk_json(by_half, prompt_tokens), "runtime_executes": True,
               "executable": executable_json(runs, base, roof), "half_chunk": executable_json(half, base, roof, HALF)}
        plan, place = runs.prediction, runs.placement
        plan_is = runs.candidate.baseline
        if timeline:
            timeline_chart(runs.schedule, timeline, (0, 1))
    vs = {name: {"latency": b.latency_ms / plan.latency_ms if plan.latency_ms > 0 else None,
                 "energy": None if b.energy_mj is None or not plan.energy_mj else b.energy_mj / plan.energy_mj,
                 "cpu": b.cpu_ms / plan.cpu_ms if plan.cpu_ms > 0 else None} for name, b in base.items()}
    return {"label": "predicted by the cost model (one prompt; dense prices as dense_pricing says)", **plan.to_json(),
            "plan_is": plan_is,
            "dense_placement": placement_json(place, prompt_tokens, plan.chunk_tokens, plan.chunk_rows),
            "in_flight": in_flight, **one,
            "prefill_baselines": {name: {"label": PREFILL_BASELINES[name], "candidate": candidate[name], **b.to_json()}
                                  for name, b in base.items()},
            "vs": vs,
            "over_roofline_whole": plan.latency_ms / roof if roof else None,
            "tradeoff": tradeoff(outcome, scorer, shape, prompt_tokens)}, runs


WHOLE = "the fastest schedule the runtime runs (whole chunks, the plan), predicted"
HALF = "the fastest half-chunk schedule (a micro-pipeline inside each chunk the runtime does not run), predicted"


def executable_json(runs: Overlapped, base: dict[str, PrefillPrediction], roof: float | None,
                    label: str = WHOLE) -> dict:
    """A schedule's figures beside the plan's: its latency, energy (and whether within the cap), its `vs` the GPU
    alone and its roofline ratio, each unit's busy and idle ms (predicted); `executable` the plan's own schedule
    (whole chunks, `runtime/mlx/overlap.py`), `half_chunk` the fastest half-chunk one."""
    pred, gpu = runs.prediction, base.get("mlx-gpu")
    return {"label": label, "chunk_tokens": pred.chunk_tokens,
            **({"chunk_rows": list(pred.chunk_rows)} if pred.chunk_rows else {}),
            "predicted_prefill_ms": pred.latency_ms,
            "predicted_prefill_energy_mj": pred.energy_mj, "within_energy_cap": runs.within_cap,
            "vs_mlx_gpu_latency": gpu.latency_ms / pred.latency_ms if gpu and pred.latency_ms else None,
            "over_roofline_whole": pred.latency_ms / roof if roof else None, "units": runs.schedule.to_json()["units"],
            "runtime_executes": not runs.schedule.halves}


def by_chunk_json(by_chunk: dict, prompt_tokens: int) -> dict:
    """Per chunking (a chunk size, or an uneven chunking's rows joined by "+"), its best plan with two chunks in
    flight: latency, energy (whether within the GPU alone's and the ANE's window), each unit's busy and idle ms and the
    dense functions' backends and static rows (predicted)."""
    return {"+".join(map(str, rows)) if rows else str(chunk): {
                "chunks": len(prompt_chunks(prompt_tokens, chunk, rows)),
                "predicted_prefill_ms": o.prediction.latency_ms,
                "predicted_prefill_energy_mj": o.prediction.energy_mj, "within_energy_cap": o.within_cap,
                "units": o.schedule.to_json()["units"],
                "dense": {**{f: getattr(o.placement, f) for f in DENSE_FUNCTIONS},
                          "static_rows": dict(o.placement.rows), "compress": o.placement.compress}}
            for (chunk, rows), o in sorted(by_chunk.items())}


def placement_json(place: DensePlacement, prompt_tokens: int, chunk_tokens: int, chunk_rows: tuple[int, ...] = ()
                   ) -> dict:
    """The placement as the report gives it; `attention_reads`: per full chunk's offset (of the uneven chunking
    `chunk_rows`), the keys each of its static core calls reads (one call unblocked, one per block with
    `attention_block`)."""
    starts = [c - r for r, c in prompt_chunks(prompt_tokens, chunk_tokens, chunk_rows) if r == chunk_tokens]
    reads = {s: keys for s in starts if place.attention and (keys := place.block_buckets(s, chunk_tokens))}
    return {**{f: getattr(place, f) for f in DENSE_FUNCTIONS}, "attention_context_buckets": list(place.buckets),
            "static_rows": dict(place.rows), "attention_block": place.attention_block, "attention_reads": reads,
            "host": place.host, "compress": place.compress}
