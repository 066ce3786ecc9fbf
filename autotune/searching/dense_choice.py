"""The search's dense decisions: at one chunk size, which dense functions run on the static backend (q/k/v, o_proj,
the shared expert or dense MLP) and which attention context buckets get a static function, for the least weighted
cost of the whole prefill (`autotune.costing.whole_prefill`); and for each function placed, how many of a full chunk's
rows it takes while the CPU computes the rest (a row split). The dense steps run in sequence with the experts, so
their cost adds to the experts' and each function is decided on its own: against the CPU, with the others as
chosen. A split's cost is the longer of its two sides, convex in the rows, so a ternary search over the rows finds
it in a few evaluations."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autotune.costing.costmodel import CostModel
from autotune.costing.whole_prefill import (
    DENSE_FUNCTIONS,
    DecoderShape,
    DensePlacement,
    ExpertFigures,
    PrefillPrediction,
    predict_prefill,
    prompt_chunks,
)
from autotune.searching.scores import Score, Weights, weighted_cost
from runtime.backends import EXACT
from runtime.coreml import ane_limits
from runtime.mlx.formats import NAME as MLX_EXACT
from runtime.mlx.formats import SPINE_SPLICES

NO_EXPERTS = ExpertFigures(0.0, 0.0, 0.0)
ROW_GRAIN = 64  # a split function's static rows are a multiple of this (the ANE's preferred multiple of 64)


@dataclass
class DenseChoice:
    """The dense placement chosen at one chunk size and what the dense parts then cost: per prompt
    (`prediction`, experts left out) and over the calibration prompts (`score`, the search's units); with what it
    was chosen for, so that another cost model can price it again (`cost_under`, `best_under`)."""
    placement: DensePlacement
    prediction: PrefillPrediction
    score: Score
    shape: DecoderShape
    prompts: float
    backend: str | None
    resident_bytes: float = 0.0  # the experts resident on the static backend beside these functions (its window)

    def priced(self, place: DensePlacement, cost: CostModel) -> "DenseChoice":
        """Another placement at this one's shape, prompt and chunk size, priced under `cost`."""
        p = self.prediction
        pred = predict_prefill(cost, self.shape, p.prompt_tokens, p.chunk_tokens, NO_EXPERTS, place)
        return DenseChoice(place, pred, dense_score(pred, self.prompts), self.shape, self.prompts, self.backend,
                           self.resident_bytes)

    def fits_beside(self, resident_bytes: float) -> bool:
        """Whether this placement's functions and `resident_bytes` of experts fit the ANE's window at once."""
        stored = dense_weight_bytes(self.shape, self.placement)
        return ane_limits.resident_over_window({"experts": resident_bytes, "dense functions": stored}) == 0

    def cost_under(self, cost: CostModel, weights: Weights, place: DensePlacement | None = None) -> float:
        """The weighted cost of this placement (or `place`) under another cost model (a perturbed profile)."""
        return weighted_cost(self.priced(self.placement if place is None else place, cost).score, weights)

    def best_under(self, cost: CostModel, weights: Weights) -> "DenseChoice":
        """The best placement under another cost model, at this chunk size: a case's optimum in the robustness
        analysis."""
        p = self.prediction
        return choose_dense(cost, self.shape, p.prompt_tokens, p.chunk_tokens, self.backend, weights, self.prompts,
                            self.resident_bytes)


def dense_score(pred: PrefillPrediction, prompts: float) -> Score:
    """A dense prediction over `prompts` prompts, as the search scores decisions (summed over calibration)."""
    return Score(pred.latency_ms * prompts, None if pred.energy_mj is None else pred.energy_mj * prompts, 0, 0.0,
                 cpu_ms=pred.cpu_ms * prompts)


def dense_weight_bytes(shape: DecoderShape, place: DensePlacement, backend: str | None = None) -> float:
    """Weights the placement puts on a static backend (every layer's functions, each as it stores them:
    `DensePlacement.stored`); with `backend`, on that one only (the ANE's window holds its own, not the CPU's)."""
    def on(function: str) -> bool:
        return bool(getattr(place, function)) and backend in (None, getattr(place, function))

    def stored(function: str) -> float:
        return ane_limits.BYTES_PER_WEIGHT[place.stored(function)]

    per = {"qkv": shape.hidden * shape.qkv_width, "o_proj": shape.hidden * shape.heads * shape.head_dim}
    total = sum(per[f] * stored(f) for f in per if on(f)) * shape.num_layers
    if on("mlp"):
        total += sum(3 * shape.hidden * shape.mlp_ffn(layer) for layer in range(shape.num_layers)) * stored("mlp")
    return total


def choose_dense(cost: CostModel, shape: DecoderShape, prompt_tokens: int, chunk_tokens: int, backend: str | None,
                 weights: Weights, prompts: float, resident_bytes: float = 0.0) -> DenseChoice:
    """The placement of least weighted cost (`weights` as the search's, over `prompts` calibration prompts); a
    function past the ANE's limits per function, or one that would push what is resident at once (the dense weights
    and `resident_bytes` of experts) past the ANE's window, stays on the host: the profile's exact path off the CPU
    where it prices one (the GPU, `CostModel.plan_exact`), else the CPU. Without a static backend, everything stays
    on the host."""
    def cost_of(place: DensePlacement) -> float:
        return weighted_cost(dense_score(predict_prefill(cost, shape, prompt_tokens, chunk_tokens, NO_EXPERTS, place),
                                         prompts), weights)

    place = DensePlacement(host=cost.plan_exact())
    runnable = executable(place.host)
    if backend is not None and runnable:
        best = cost_of(place)
        for name in (f for f in ("qkv", "o_proj", "mlp") if f in runnable):
            trial = dataclasses.replace(place, **{name: backend})
            resident = {"experts": resident_bytes, "dense functions": dense_weight_bytes(shape, trial)}
            if ane_limits.resident_over_window(resident) > 0:
                continue
            trial, c = best_split(cost_of, trial, name, chunk_tokens)
            if c < best:
                place, best = trial, c
        if "attention" in runnable:
            place, best = choose_attention(cost_of, place, best, backend, shape, prompt_tokens, chunk_tokens)
    pred = predict_prefill(cost, shape, prompt_tokens, chunk_tokens, NO_EXPERTS, place)
    return DenseChoice(place, pred, dense_score(pred, prompts), shape, prompts, backend, resident_bytes)


def executable(host: str) -> tuple[str, ...]:
    """The dense functions a static backend may take beside `host`, as the runtime runs them: any, where the host
    is the CPU (the torch engine); those the MLX spine splices into its forward, where it is MLX (the GPU)."""
    return SPINE_SPLICES if host == MLX_EXACT else DENSE_FUNCTIONS


def attention_blocks(chunk: int) -> list[int | None]:
    """The attention core's block sizes the search tries: none (one call per full chunk), then chunk/2, chunk/4, ...
    while a multiple of ROW_GRAIN."""
    out: list[int | None] = [None]
    while chunk % 2 == 0 and (chunk := chunk // 2) % ROW_GRAIN == 0:
        out.append(chunk)
    return out


def block_keys(prompt_tokens: int, chunk_tokens: int, block: int | None, context: int) -> tuple[int, ...]:
    """The key lengths a full chunk's static calls need, over the prompt's full chunks within the model's
    `context`: each chunk's context without a block, each block's end with one."""
    step = block or chunk_tokens
    ends = range(step, chunk_tokens + 1, step)
    return tuple(sorted({s + end for s in full_starts(prompt_tokens, chunk_tokens, context) for end in ends}))


def full_starts(prompt_tokens: int, chunk_tokens: int, context: int) -> list[int]:
    """The offsets of the prompt's full chunks whose context is within the model's `context`."""
    return [c - r for r, c in prompt_chunks(prompt_tokens, chunk_tokens) if r == chunk_tokens and c <= context]


def choose_attention(cost_of, place: DensePlacement, best: float, backend: str, shape: DecoderShape,
                     prompt_tokens: int, chunk_tokens: int) -> tuple[DensePlacement, float]:
    """The attention core's buckets, block and row split of least `cost_of` (`place` as it is where none costs
    less than `best`). Unblocked, each full chunk's context is tried as a bucket in turn; with a block, every key
    length the blocks need is one, the split in multiples of the block, and the buckets no call reads are
    dropped."""
    context = shape.context or prompt_tokens
    found = [(place, best)]
    unblocked, cost = place, best
    for key in block_keys(prompt_tokens, chunk_tokens, None, context):  # one static function per context bucket
        trial = dataclasses.replace(unblocked, attention=backend, buckets=(*unblocked.buckets, key))
        if (c := cost_of(trial)) < cost:
            unblocked, cost = trial, c
    if unblocked.attention:
        found.append(best_split(cost_of, unblocked, "attention", chunk_tokens))
    for block in attention_blocks(chunk_tokens)[1:]:
        keys = block_keys(prompt_tokens, chunk_tokens, block, context)
        if not keys:
            break
        trial = dataclasses.replace(place, attention=backend, buckets=keys, attention_block=block)
        trial, c = best_split(cost_of, trial, "attention", chunk_tokens, block)
        used = {k for s in full_starts(prompt_tokens, chunk_tokens, context)
                for k in trial.block_buckets(s, chunk_tokens) or ()}
        found.append((dataclasses.replace(trial, buckets=tuple(k for k in keys if k in used)), c))
    return min(found, key=lambda pc: pc[1])


def best_split(cost_of, place: DensePlacement, function: str, chunk: int, grain: int = ROW_GRAIN
               ) -> tuple[DensePlacement, float]:
    """`place` with `function` split at the rows of least `cost_of` (multiples of `grain` below the chunk), or
    not split where that costs least; with its cost."""
    whole = cost_of(place)
    steps = chunk // grain
    if steps < 2:
        return place, whole
    seen: dict[int, float] = {}

    def at(k: int) -> float:
        if k not in seen:
            seen[k] = cost_of(place.with_rows(function, k * grain))
        return seen[k]

    lo, hi = 1, steps - 1
    while hi - lo > 2:
        a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        lo, hi = (lo, b - 1) if at(a) < at(b) else (a + 1, hi)
    k = min(range(lo, hi + 1), key=at)
    return (place.with_rows(function, k * grain), at(k)) if at(k) < whole else (place, whole)


def dense_plan(place: DensePlacement, shape: DecoderShape) -> dict | None:
    """The plan's `dense` field a placement means (None: nothing placed and the host the CPU): every decoder
    layer's functions, and the host where it is not the CPU (`exact`)."""
    host = {"exact": place.host} if place.host != EXACT else {}
    if not any((place.qkv, place.o_proj, place.attention, place.mlp)):
        return {"attention_context_buckets": [], "layers": [], **host} if host else None
    rows = dict(place.rows)

    def function(name: str, backend: str) -> dict:
        stored = place.stored(name)
        return {"backend": backend, **({"compress": stored} if stored != "none" else {}),
                **({"rows": rows[name]} if name in rows else {})}

    layers = []
    for layer in range(shape.num_layers):
        entry = {"layer": layer, **{f: function(f, b) for f in ("qkv", "o_proj") if (b := getattr(place, f))}}
        if place.attention:
            entry["attention"] = place.attention
        if place.mlp and shape.mlp_ffn(layer):
            entry["mlp"] = function("mlp", place.mlp)
        layers.append(entry)
    out = {"attention_context_buckets": list(place.buckets) if place.attention else [], "layers": layers, **host}
    if place.attention and "attention" in rows:
        out["attention_rows"] = rows["attention"]
    if place.attention and place.attention_block:
        out["attention_block"] = place.attention_block
    return out
