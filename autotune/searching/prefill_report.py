"""The whole prefill in the search's report: the plan (its experts and dense functions) and the paper's baselines,
whole-model, each predicted over one prompt by `autotune.costing.whole_prefill`, and the plan's ratio against each."""
from __future__ import annotations

from autotune.costing.schedule import timeline_chart
from autotune.costing.whole_prefill import (
    DENSE_FUNCTIONS,
    DecoderShape,
    DensePlacement,
    ExpertFigures,
    LazyLast,
    PrefillPrediction,
    predict_prefill,
    prompt_chunks,
    roofline_ms,
)
from autotune.searching.layer_data import LayerData
from autotune.searching.optimizer import SearchOutcome, Solution, ranked_solutions, resident_bytes, solution
from autotune.searching.overlap_choice import Candidate, best_overlapped, expert_steps, rebalanced, with_steps
from autotune.searching.scores import weighted_cost
from autotune.searching.scoring import Scorer
from autotune.searching.space import LayerConfig
from runtime.backends import EXACT

PREFILL_BASELINES = {
    "coreml-cpu": "Core ML CPU-only: every op on the CPU",
    "coreml-naive": "naive Core ML: dense ops on the ANE, one graph per expert at a uniform capacity",
    "ane-dense-cpu-experts": "dense ops on the ANE, every expert exact on the CPU",
    "ane-dense-masked-experts": "dense ops on the ANE, all experts as one masked dense graph (ANEForge's MoE)",
    "paper-heuristic": "dense ops on the ANE, the paper's heuristic for the experts",
    "experts-only": "the experts-only plan (the search without dense decisions), dense ops on the CPU",
    "mlx-gpu": "every op on the GPU through MLX, as mlx-lm runs it (where the profile prices the GPU)",
}


def all_dense(backend: str, shape: DecoderShape, prompt_tokens: int, chunk_tokens: int) -> DensePlacement:
    """Every dense function on `backend`, an attention function for every full chunk's context."""
    buckets = tuple(c for r, c in prompt_chunks(prompt_tokens, chunk_tokens) if r == chunk_tokens)
    return DensePlacement(backend, backend, backend, backend, buckets)


def expert_figures(sol: Solution, prompts: float) -> ExpertFigures:
    """A design's expert figures per prompt (its totals are over the calibration prompts)."""
    return ExpertFigures(sol.latency_ms / prompts, sol.cpu_ms / prompts,
                         None if sol.energy_mj is None else sol.energy_mj / prompts)


def lazy_last(sol: Solution, layers: list[LayerData], scorer: Scorer, shape: DecoderShape,
              prompts: float) -> LazyLast | None:
    """The model's last decoder layer as a lazy host leaves out its work for rows no output reads (`LazyLast`),
    under a design whose experts there run on the host's own exact path (no static group, no CPU tail); None where
    they do not (a layer that runs static calls evaluates its input) or the plan's exact path is not lazy."""
    if not scorer.cost.is_lazy(scorer.exact):
        return None

    def own(c: LayerConfig) -> bool:  # every expert of the layer on the host's own exact path
        return c.resident == 0 and c.cpu_tail == 0

    split, last = all(own(c) for c in sol.configs), shape.num_layers - 1
    if last not in shape.moe_layers:
        return LazyLast(None, split)
    at = {d.layer: (d, c) for d, c in zip(layers, sol.configs)}.get(last)
    if at is None or not own(at[1]):
        return None
    score, energy = scorer.score(*at), scorer.energy(*at)
    return LazyLast(ExpertFigures(score.latency_ms / prompts, score.cpu_ms / prompts,
                                  None if energy is None else energy / prompts), split)


def prompts_in(layers: list[LayerData], prompt_tokens: int) -> float:
    """The calibration prompts the layers' traces hold (what a solution's totals are summed over)."""
    return float(layers[0].tokens.sum()) / prompt_tokens


def mlx_gpu_prefill(scorer: Scorer, shape: DecoderShape, layers: list[LayerData], prompt_tokens: int
                    ) -> PrefillPrediction:
    """mlx-lm's way, predicted: every expert on the GPU's exact path and every dense op on the GPU, in chunks of
    the layers' chunk size (`scorer.exact` must be the GPU's path)."""
    sol = solution([LayerConfig(0) for _ in layers], layers, scorer)
    prompts = prompts_in(layers, prompt_tokens)
    return predict_prefill(scorer.cost, shape, prompt_tokens, layers[0].chunk_tokens, expert_figures(sol, prompts),
                           DensePlacement(host=scorer.exact),
                           lazy_last=lazy_last(sol, layers, scorer, shape, prompts))


def tradeoff(outcome: SearchOutcome, scorer: Scorer, shape: DecoderShape, prompt_tokens: int) -> list[dict]:
    """The candidate plans a user could pick, whole prefill (experts and the chunk size's dense choice): each chunk
    size's optimum at each share of the drop budget (`ranked_solutions`), predicted latency and energy."""
    out = []
    for sol in ranked_solutions(outcome, scorer):
        choice = outcome.dense.get(sol.chunk_tokens)
        layers = outcome.chunks[sol.chunk_tokens].layers
        prompts = prompts_in(layers, prompt_tokens)
        pred = predict_prefill(scorer.cost, shape, prompt_tokens, sol.chunk_tokens, expert_figures(sol, prompts),
                               choice.placement if choice else DensePlacement(),
                               lazy_last=lazy_last(sol, layers, scorer, shape, prompts))
        out.append({"chunk_tokens": sol.chunk_tokens, "heldout_drops": sol.heldout_drops,
                    "predicted_prefill_ms": pred.latency_ms, "predicted_prefill_energy_mj": pred.energy_mj})
    return out


def overlap_candidates(outcome: SearchOutcome, scorer: Scorer, shape: DecoderShape, prompt_tokens: int,
                       within: float = 1.5) -> list[Candidate]:
    """For two chunks in flight (`overlap_choice`): at each chunk size whose plan is within `within` of the best's
    chain latency, that plan and its rebalanced variants (`rebalanced`), each with the size's dense placement."""
    out = []
    solved = {c: f for c, f in sorted(outcome.chunks.items()) if f.best is not None}
    least = min(f.best.latency_ms / prompts_in(f.layers, prompt_tokens) for f in solved.values())
    for chunk, found in solved.items():
        prompts = prompts_in(found.layers, prompt_tokens)
        if found.best.latency_ms / prompts > within * least:
            continue
        choice = outcome.dense.get(chunk)
        for sol in [found.best, *rebalanced(found, outcome.space, scorer, outcome.drop_budget)]:
            experts = with_steps(expert_figures(sol, prompts), expert_steps(sol, found.layers, scorer, prompts))
            out.append(Candidate(chunk, experts, choice.placement if choice else DensePlacement(host=scorer.exact),
                                 lazy_last(sol, found.layers, scorer, shape, prompts),
                                 resident_bytes(sol, scorer.hidden, scorer.ffn)))
    return out


def whole_prefill(outcome: SearchOutcome, scorer: Scorer, shape: DecoderShape, prompt_tokens: int,
                  in_flight: int = 1, timeline: str | None = None) -> dict:
    """`predicted_prefill_ms`, `predicted_parts_ms`, `prefill_baselines` (each design's whole-prefill latency,
    energy and CPU-busy time), `vs` (each baseline's figure over the plan's: > 1, the plan is ahead; None where the
    plan's is 0), `over_roofline_whole` (the plan's latency over the prompt's FLOPs at the throughput of the
    ANE, the CPU and the GPU together; None where no lane's fit prices FLOPs) and `tradeoff` (the candidate plans'
    latency and energy). With `in_flight` 2 the plan runs two chunks in flight: each chunk size's plan with its
    dense half chosen again under the schedule (`overlap_choice`) at no more energy than the GPU alone's, its latency
    the schedule's and `predicted_schedule` each unit's busy and idle ms; `one_in_flight_ms`: the search's plan as a
    chain; `timeline`: a PNG of its schedule's first two layers (`schedule.timeline_chart`)."""
    chunk = outcome.best.chunk_tokens
    layers = outcome.chunks[chunk].layers
    prompts = prompts_in(layers, prompt_tokens)
    choice = outcome.dense_choice  # none without a Core ML backend: the dense half on the host the search pinned
    host = DensePlacement(host=scorer.cost.exact_path or EXACT)  # (search --engine mlx: mlx-exact), else the CPU
    plan = predict_prefill(scorer.cost, shape, prompt_tokens, chunk, expert_figures(outcome.best, prompts),
                           choice.placement if choice else host,
                           lazy_last=lazy_last(outcome.best, layers, scorer, shape, prompts))
    ane = all_dense(scorer.backend, shape, prompt_tokens, chunk)
    n = shape.num_experts
    masked = solution([LayerConfig(n, n, capacity=chunk) for _ in layers], layers, scorer)
    solved = [s.best for s in outcome.chunks.values() if s.best]
    experts_only = min(solved, key=lambda s: weighted_cost(s, outcome.weights))
    designs = {"coreml-cpu": (outcome.baselines["cpu_only"], DensePlacement()),
               "coreml-naive": (outcome.baselines["naive_coreml"], ane),
               "ane-dense-cpu-experts": (outcome.baselines["cpu_only"], ane),
               "ane-dense-masked-experts": (masked, ane),
               "paper-heuristic": (outcome.baselines["paper_heuristic"], ane),
               "experts-only": (experts_only, DensePlacement())}
    base: dict[str, PrefillPrediction] = {}
    for name, (sol, place) in designs.items():
        at = outcome.chunks[sol.chunk_tokens].layers if sol.chunk_tokens in outcome.chunks else layers
        base[name] = predict_prefill(scorer.cost, shape, prompt_tokens, sol.chunk_tokens or chunk,
                                     expert_figures(sol, prompts_in(at, prompt_tokens)), place)
    if scorer.splits_exact:  # at the plan's chunk size (mlx-lm's prefill step is 2048)
        base["mlx-gpu"] = mlx_gpu_prefill(scorer, shape, layers, prompt_tokens)
    placement, one = choice.placement if choice else DensePlacement(), {}
    if in_flight > 1:
        cap = base["mlx-gpu"].energy_mj if "mlx-gpu" in base else None
        over = best_overlapped(scorer, shape, prompt_tokens, overlap_candidates(outcome, scorer, shape, prompt_tokens),
                               in_flight, cap)
        plan, placement, one = over.prediction, over.placement, {"one_in_flight_ms": plan.latency_ms}
        if timeline:
            timeline_chart(over.schedule, timeline, (0, 1))
    roof = roofline_ms(scorer.cost, shape, prompt_tokens, scorer.backend)
    vs = {name: {"latency": b.latency_ms / plan.latency_ms if plan.latency_ms > 0 else None,
                 "energy": None if b.energy_mj is None or not plan.energy_mj else b.energy_mj / plan.energy_mj,
                 "cpu": b.cpu_ms / plan.cpu_ms if plan.cpu_ms > 0 else None} for name, b in base.items()}
    return {"label": "predicted by the cost model (one prompt; dense prices as dense_pricing says)", **plan.to_json(),
            "dense_placement": placement_json(placement, prompt_tokens, plan.chunk_tokens), "in_flight": in_flight,
            **one,
            "prefill_baselines": {name: {"label": PREFILL_BASELINES[name], **b.to_json()} for name, b in base.items()},
            "vs": vs,
            "over_roofline_whole": plan.latency_ms / roof if roof else None,
            "tradeoff": tradeoff(outcome, scorer, shape, prompt_tokens)}


def placement_json(place: DensePlacement, prompt_tokens: int, chunk_tokens: int) -> dict:
    """The placement as the report gives it; `attention_reads`: per full chunk's offset, the keys each of its
    static core calls reads (one call unblocked, one per block with `attention_block`)."""
    starts = [c - r for r, c in prompt_chunks(prompt_tokens, chunk_tokens) if r == chunk_tokens]
    reads = {s: keys for s in starts if place.attention and (keys := place.block_buckets(s, chunk_tokens))}
    return {**{f: getattr(place, f) for f in DENSE_FUNCTIONS}, "attention_context_buckets": list(place.buckets),
            "static_rows": dict(place.rows), "attention_block": place.attention_block, "attention_reads": reads,
            "host": place.host}
