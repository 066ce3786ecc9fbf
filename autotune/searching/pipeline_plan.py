"""A plan per Mac: the model's layers split across Macs by predicted cost (`pipeline_split`), each stage's plan made
by today's search on its own Mac's profile and memory, and the whole prefill with the prompt's chunks overlapping
across stages over the link between them (`autotune.costing.pipeline_link`). Every figure is predicted.

The split is found in two passes. First each layer is priced as mlx-lm runs it (every op on the Mac's exact path)
and the layers are split by those times; then each stage is searched, every layer is priced again under its stage's
plan, and where that moves the split, the stages whose layers changed are searched again. The stages share one
chunk size (activations cross between Macs chunk by chunk): the searched size whose pipelined prefill is fastest.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from autotune.costing.costmodel import CostModel
from autotune.costing.pipeline_link import LinkFigure, link_ms, pipeline_ms
from autotune.costing.stage_prefill import layer_bytes, stage_chunk_ms, stage_memory, stage_shape
from autotune.costing.whole_prefill import DecoderShape, DensePlacement, prompt_chunks
from autotune.searching.backend_choice import choose_static_backend
from autotune.searching.dense_choice import choose_dense
from autotune.searching.layer_data import LayerData
from autotune.searching.objective import prompts_in
from autotune.searching.optimizer import SearchOutcome, Solution, run_search
from autotune.searching.pipeline_split import balanced_split
from autotune.searching.scoring import Scorer
from autotune.searching.space import LayerConfig, layer_space
from runtime.coreml import ane_limits

MLX_LM_PREFILL_STEP = 2048  # mlx-lm's generate: prefill_step_size's default


@dataclass(frozen=True)
class Mac:
    """One Mac of the cluster: its cost model and memory budget (bytes)."""
    name: str
    cost: CostModel
    budget_bytes: float


@dataclass(frozen=True)
class StageSearch:
    """How each stage is searched (as `bench_prefill` and `autotune search` search one Mac)."""
    objective: str = "latency"
    trials: int = 40
    compress: tuple[str, ...] = ("none",)
    backend: str | None = None  # the static backend; None: the one today's search picks for each Mac's profile
    progress: bool = False
    dense: bool = True  # the dense functions' placement searched (False: all on the exact path: a sliced layer's)


@dataclass
class Stage:
    """One stage: layers first..last-1 on `mac`, its search and the scorer it was searched with."""
    first: int
    last: int
    mac: Mac
    shape: DecoderShape
    scorer: Scorer
    outcome: SearchOutcome
    ane_budget: float

    def at(self, chunk: int) -> tuple[Solution, DensePlacement]:
        """The stage's plan at one chunk size: its experts' solution and its dense placement."""
        choice = self.outcome.dense.get(chunk)
        return self.outcome.chunks[chunk].best, choice.placement if choice else DensePlacement(host=self.scorer.exact)


@dataclass
class PipelineOutcome:
    stages: list[Stage]
    chunk_tokens: int
    rebalanced: bool
    seconds: float
    first_split: list[tuple[int, int]] = field(default_factory=list)


def stage_layers(workloads: dict[int, list[LayerData]], first: int, last: int) -> dict[int, list[LayerData]]:
    """The MoE layers' traces of one stage, per chunk size."""
    return {c: [d for d in layers if first <= d.layer < last] for c, layers in workloads.items()}


def fixed_bytes(shape: DecoderShape, first: int, last: int, prompt: int, chunk: int) -> float:
    """A stage's memory but its ANE packages."""
    return stage_memory(shape, first, last, prompt, chunk).total


def static_backend(mac: Mac, shape: DecoderShape, layers: list[LayerData], how: StageSearch) -> str:
    """The static backend a stage's groups run on: `how.backend`, else the one the one-Mac search picks for this
    Mac's profile (`choose_static_backend`)."""
    return how.backend or choose_static_backend(
        mac.cost, layers, lambda b: Scorer(mac.cost, shape.hidden, shape.expert_ffn, b, float("inf")))


def search_stage(mac: Mac, shape: DecoderShape, workloads: dict[int, list[LayerData]], prompt: int, first: int,
                 last: int, how: StageSearch) -> Stage:
    """Today's search for one stage on its Mac: the ANE's resident experts within what its memory leaves (and the
    ANE's window), the dense functions' placement for its layers."""
    sub, mine = stage_shape(shape, first, last), stage_layers(workloads, first, last)
    free = mac.budget_bytes - fixed_bytes(shape, first, last, prompt, max(workloads))
    ane = max(0.0, min(free, ane_limits.WINDOW_BYTES))
    backend = static_backend(mac, shape, next(iter(mine.values())), how)
    scorer = Scorer(mac.cost, shape.hidden, shape.expert_ffn, backend, ane / max(1, len(sub.moe_layers)))
    calib = prompts_in(next(iter(mine.values())), prompt)

    def dense(chunk: int, weights, resident: float):
        return choose_dense(mac.cost, sub, prompt, chunk, scorer.backend, weights, calib, resident)

    outcome = run_search(mine, scorer, layer_space(shape.num_experts, how.compress, scorer.splits_exact),
                         objective=how.objective, trials=how.trials, progress=how.progress,
                         dense=dense if how.dense else None)
    return Stage(first, last, mac, sub, scorer, outcome, ane)


def stage_ms(stage: Stage, prompt: int, chunk: int, last: bool) -> list[float]:
    """The stage's time on each chunk under its plan at `chunk`."""
    sol, place = stage.at(chunk)
    layers = stage.outcome.chunks[chunk].layers
    return stage_chunk_ms(stage.mac.cost, stage.shape, prompt, chunk, sol.latency_ms / prompts_in(layers, prompt),
                          place, logits=last)


def layer_times(cost: CostModel, scorer: Scorer, shape: DecoderShape, layers: list[LayerData], prompt: int,
                configs: dict[int, LayerConfig] | None = None, place: DensePlacement | None = None,
                first: int = 0) -> list[float]:
    """The predicted time over the prompt of each decoder layer of `shape` (layer i is the model's first + i): its
    dense steps under `place` (default: all on the exact path) and its experts under `configs` (by the model's layer;
    default: every expert exact, as mlx-lm runs them)."""
    place = place or DensePlacement(host=scorer.exact)
    chunk, prompts = layers[0].chunk_tokens, prompts_in(layers, prompt)
    by_layer = {d.layer: d for d in layers}
    dense: dict[tuple, float] = {}
    out = []
    for i in range(shape.num_layers):
        kind = (i in shape.moe_layers, shape.mlp_ffn(i))
        if kind not in dense:
            dense[kind] = sum(stage_chunk_ms(cost, stage_shape(shape, i, i + 1), prompt, chunk, 0.0, place))
        data = by_layer.get(first + i)
        experts = 0.0 if data is None else \
            scorer.score(data, (configs or {}).get(first + i, LayerConfig(0))).latency_ms / prompts
        out.append(dense[kind] + experts)
    return out


def first_split(macs: list[Mac], shape: DecoderShape, layers: list[LayerData], prompt: int,
                how: StageSearch) -> tuple[list[tuple[int, int]], list[list[float]]]:
    """The split by each layer's time as mlx-lm runs it on each Mac, and those times."""
    est = [layer_times(m.cost, Scorer(m.cost, shape.hidden, shape.expert_ffn, static_backend(m, shape, layers, how),
                                      0.0), shape, layers, prompt) for m in macs]
    return _split(macs, shape, est, prompt, layers[0].chunk_tokens), est


def _split(macs: list[Mac], shape: DecoderShape, ms: list[list[float]], prompt: int, chunk: int
           ) -> list[tuple[int, int]]:
    per_layer = [layer_bytes(shape, i) + stage_memory(shape, i, i + 1, prompt, chunk).kv_cache
                 for i in range(shape.num_layers)]
    fixed = [stage_memory(shape, 0, 0, prompt, chunk).total + ane_limits.WINDOW_BYTES for _ in macs]
    return balanced_split(ms, per_layer, fixed, [m.budget_bytes for m in macs])


def best_chunk(stages: list[Stage], prompt: int, link: LinkFigure, hidden: int) -> int:
    """The chunk size every stage searched whose pipelined prefill is fastest."""
    common = [c for c in stages[0].outcome.chunks if all(s.outcome.chunks.get(c) and s.outcome.chunks[c].best
                                                        for s in stages)]
    return min(common, key=lambda c: pipeline_ms([stage_ms(s, prompt, c, i == len(stages) - 1)
                                                  for i, s in enumerate(stages)], chunk_links(link, prompt, c, hidden)))


def chunk_links(link: LinkFigure, prompt: int, chunk: int, hidden: int) -> list[float]:
    return [link_ms(link, rows, hidden) for rows, _ in prompt_chunks(prompt, chunk)]


def planned_times(stages: list[Stage], est: list[list[float]], prompt: int, chunk: int) -> list[list[float]]:
    """Each layer's time under the plan of the stage that holds it, per Mac (on another Mac: scaled by the ratio of
    the two Macs' first estimates)."""
    planned, owner = [], []
    for k, s in enumerate(stages):
        sol, place = s.at(chunk)
        layers = s.outcome.chunks[chunk].layers
        configs = {d.layer: cfg for d, cfg in zip(layers, sol.configs)}
        planned += layer_times(s.mac.cost, s.scorer, s.shape, layers, prompt, configs, place, s.first)
        owner += [k] * (s.last - s.first)
    return [[planned[i] * e[i] / max(est[owner[i]][i], 1e-12) for i in range(len(planned))] for e in est]


def plan_pipeline(macs: list[Mac], shape: DecoderShape, workloads: dict[int, list[LayerData]], prompt: int,
                  link: LinkFigure, how: StageSearch = StageSearch()) -> PipelineOutcome:
    """Split, search every stage, price every layer again under its stage's plan, and search again the stages whose
    layers that moves."""
    t0 = time.perf_counter()
    start = MLX_LM_PREFILL_STEP if MLX_LM_PREFILL_STEP in workloads else max(workloads)
    split, est = first_split(macs, shape, workloads[start], prompt, how)
    stages = [search_stage(m, shape, workloads, prompt, a, b, how) for m, (a, b) in zip(macs, split)]
    chunk = best_chunk(stages, prompt, link, shape.hidden)
    again = _split(macs, shape, planned_times(stages, est, prompt, chunk), prompt, chunk)
    if again != split:
        stages = [s if (s.first, s.last) == ab else search_stage(m, shape, workloads, prompt, *ab, how)
                  for s, m, ab in zip(stages, macs, again)]
        chunk = best_chunk(stages, prompt, link, shape.hidden)
    return PipelineOutcome(stages, chunk, again != split, time.perf_counter() - t0, split)
