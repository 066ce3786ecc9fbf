"""What the cost model predicts for a side `autotune bench` measures: a plan's whole prefill of one prompt on the
spine that runs it, its experts priced from the routing a run saw (`autotune.evaluation.run_parts.routed_experts`)
and its dense half where that spine runs it (`autotune.costing.whole_prefill.predict_prefill`): on the MLX spine
MLX's own exact path, whose lazy graph leaves the last layer's work out for rows no logit reads (`LazyLast`). A
baseline that is not a plan is priced as the plan that computes what it does (transformers' forward: every expert
exact on the CPU in torch; mlx-lm's: every expert and dense op on MLX's exact path)."""
from __future__ import annotations

from autotune.costing.costmodel import CostModel
from autotune.costing.whole_prefill import (
    DecoderShape,
    DensePlacement,
    ExpertFigures,
    LazyLast,
    PrefillPrediction,
    placement_of,
    predict_prefill,
)
from autotune.evaluation.run_parts import Routing, routed_experts
from runtime.plan import Plan


def all_exact(plan: Plan) -> bool:
    """Whether every expert of the plan runs on its one exact path and no dense function on a static backend: the
    plan that the engine's own forward (mlx-lm's on the MLX spine, the exact path's on torch) is."""
    exact = plan.exact_path
    return all(not lp.groups and all(lp.exact_path_of(e, exact) == exact for e in lp.cpu_exact)
               for lp in plan.layers) and (plan.dense is None or not plan.dense.backends)


def host_of(plan: Plan, engine: str) -> DensePlacement:
    """Where the plan's dense half runs: its dense functions as placed; on the MLX spine, the rest on its exact path
    (MLX), on torch on the CPU."""
    place = placement_of(plan.dense)
    if engine == "mlx" and plan.dense is None:
        return DensePlacement(host=plan.exact_path)
    return place


def predict_side(cost: CostModel, plan: Plan, engine: str, shape: DecoderShape, routing: Routing,
                 prompt_tokens: int, prompts: int) -> PrefillPrediction | None:
    """The plan's whole prefill of one `prompt_tokens` prompt on `engine`'s spine, its experts priced from
    `routing` (each chunk's assignments over `prompts` prompts in the plan's chunks, averaged per prompt); None
    where the cost model prices no lane the plan names (its exact path not profiled)."""
    if plan.exact_path not in cost.models:
        return None
    if engine == "mlx":
        cost = cost.with_exact(plan.exact_path)
    place = host_of(plan, engine)
    experts = _per_prompt(routed_experts(cost, plan, shape, routing), prompts)
    return predict_prefill(cost, shape, prompt_tokens, plan.chunk_tokens, experts, place,
                           lazy_last=_lazy_last(cost, plan, shape, routing, prompts, place))


def _per_prompt(figures: list[ExpertFigures], prompts: int) -> ExpertFigures:
    return ExpertFigures(sum(f.latency_ms for f in figures) / prompts, sum(f.cpu_ms for f in figures) / prompts, None)


def _lazy_last(cost: CostModel, plan: Plan, shape: DecoderShape, routing: Routing, prompts: int,
               place: DensePlacement) -> LazyLast | None:
    """The last decoder layer a lazy host leaves out past its keys and values (see `LazyLast`), where its experts
    run on that host's own exact path; the prompt's last token goes alone where every layer does (the MLX spine's
    `all_fast`, mlx-lm's prefill)."""
    if not cost.is_lazy(place.host):
        return None
    last = shape.num_layers - 1
    own = {lp.layer: not lp.groups and all(lp.exact_path_of(e, plan.exact_path) == place.host for e in lp.cpu_exact)
           for lp in plan.layers}
    split = all(own.values())
    if last not in shape.moe_layers:
        return LazyLast(None, split)
    if not own.get(last, False) or last not in routing:
        return None
    return LazyLast(_per_prompt(routed_experts(cost, plan, shape, {last: routing[last]}), prompts), split)
