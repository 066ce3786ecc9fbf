"""The whole prefill, predicted: every op of every decoder layer over a prompt's chunks, then the last position's
logits.

Per chunk of `rows` tokens at `context` keys (the tokens before it and its own: the attention core grows chunk by
chunk), per layer: the attention projections (q/k/v, then o), the attention core, the experts (the expert plan's
own prediction, `autotune.costing.evaluator`), the shared expert or dense MLP (`dense_mlp`) and the rest (norms,
rope, residual adds, the router); then the final norm and `lm_head` for one row (prefill needs one row of logits). The
parts a `DensePlacement` puts on a static backend run as static functions (one call each, the backend's
`call_ms`); the rest run on the placement's `host`, an exact path: the CPU in torch (cpu-exact, the default) or the
GPU through MLX (mlx-exact, priced at its own rates, off the CPU). Parts run one after another: a decoder layer is
a chain. Inside a step, the host works beside the ANE two ways: the experts' exact paths (inside the expert
figure), and a dense function split by rows (`DensePlacement.rows`): the static function computes the first rows
of each full chunk while the host computes the rest, so the step takes the longer of the two (their sum where both
are CPU work). Partial chunks run on the host, as the runtime runs them. A lazy host (MLX) leaves out the last
layer's work past its keys and values for rows no logit reads (`LazyLast`). The composition is the evaluator's
(`evaluator.chain`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autotune.costing import evaluator
from autotune.costing.costmodel import CostModel
from autotune.costing.cpu_storage import dequant_ms
from autotune.costing.fit_range import Reach, merge_reaches, reach
from runtime.backends import EXACT, REFERENCE
from runtime.dense.families import FAMILIES
from runtime.loading.model_config import head_dim, mlx_quantization, text_config
from runtime.loading.model_record import ModelRecord
from runtime.plan import static_reads
from runtime.prefill import chunk_spans

# The parts as the runtime measures them (runtime.dense.parts): `rest` is the norms, rope, residual adds and router.
PARTS = ("attention_projections", "attention_core", "experts", "dense_mlp", "lm_head", "rest")
DENSE_FUNCTIONS = ("qkv", "o_proj", "attention", "mlp")  # what a plan may place on a static backend, per layer


@dataclass(frozen=True)
class DecoderShape:
    """The shapes of one model's decoder that price its dense ops (from config.json)."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int = 0  # a shared expert's FFN size in every MoE layer (Qwen2-MoE); 0: none
    dense_ffn: int = 0  # the MLP of the layers that are not MoE layers
    context: int = 0  # max_position_embeddings
    qk_norm: int = 0  # the length of the vectors the q/k norms normalise (runtime.dense.families); 0: none
    sliding_window: int = 0  # the keys a query sees (config.json sliding_window); 0: all before it
    norm: str = "rms"  # the input norms' kind (runtime.dense.families): "rms" or "layer"
    packed: bool = False  # its matrices kept as mlx packed them: torch's CPU dequantizes each per call

    @classmethod
    def from_config(cls, cfg: dict) -> "DecoderShape":
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        dense_only = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step") or 1)
        moe = tuple(i for i in range(layers) if experts and i not in dense_only and (i + 1) % step == 0)
        return cls(hidden=hidden, heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=head_dim(cfg), vocab=int(cfg["vocab_size"]),
                   num_layers=layers, moe_layers=moe, num_experts=experts, top_k=int(cfg.get("num_experts_per_tok", 1)),
                   expert_ffn=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                   shared_ffn=int(cfg.get("shared_expert_intermediate_size") or 0),
                   dense_ffn=int(cfg.get("intermediate_size") or 0), context=int(cfg.get("max_position_embeddings", 0)),
                   qk_norm=qk_norm_length(cfg, heads), norm=getattr(FAMILIES.get(cfg.get("model_type")), "norm", "rms"),
                   sliding_window=int(cfg.get("use_sliding_window", True) and cfg.get("sliding_window") or 0))

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def mlp_ffn(self, layer: int) -> int:
        """The dense FFN size of a layer: its shared expert (MoE layer) or its MLP (dense layer); 0 if none."""
        return self.shared_ffn if layer in self.moe_layers else self.dense_ffn

    def flops_per_token(self, context: float) -> float:
        """FLOPs per prompt token at a mean attention context: every layer's matmuls and attention core, experts at
        their top-k (what the roofline divides by)."""
        per = 0.0
        for layer in range(self.num_layers):
            per += 2 * self.hidden * (self.qkv_width + self.heads * self.head_dim)
            per += 4 * context * self.heads * self.head_dim
            per += 6 * self.hidden * self.mlp_ffn(layer)
            if layer in self.moe_layers:
                per += 6 * self.hidden * self.expert_ffn * self.top_k + 2 * self.hidden * self.num_experts
        return per


def decoder_shape(record: ModelRecord) -> DecoderShape:
    """The record's decoder shapes (from its config.json's decoder part)."""
    shape = DecoderShape.from_config(text_config(record.config))
    return dataclasses.replace(shape, packed=mlx_quantization(record.config) is not None)


def qk_norm_length(cfg: dict, heads: int) -> int:
    """The q/k norms' vector length in a family that has them: per head (head_dim) or over the projection."""
    fam = FAMILIES.get(cfg.get("model_type"))
    width = head_dim(cfg)
    return 0 if fam is None or fam.qk_norm is None else width if fam.qk_norm == "head" else heads * width


@dataclass(frozen=True)
class DensePlacement:
    """Where the dense functions run: a static backend per function (None: the CPU), and the attention core's
    context buckets (a full chunk whose context fits one runs that bucket's static function, keys padded and
    masked; past the last, the CPU). With an `attention_block` b, a full chunk's static rows run in causal blocks
    of b queries instead, block j over the keys its queries need (the smallest bucket that holds them); the chunk
    runs them where its static rows' keys fit the last bucket."""
    qkv: str | None = None
    o_proj: str | None = None
    attention: str | None = None
    mlp: str | None = None
    buckets: tuple[int, ...] = ()
    rows: tuple[tuple[str, int], ...] = ()  # (function, r): its static function takes a full chunk's first r rows
    attention_block: int | None = None  # the core's static rows in causal blocks of this many queries
    host: str = EXACT  # the exact path running what no static function takes (the plan's `dense.exact`)
    # how its functions on a static backend other than the CPU's reference store their weights (the plan's
    # `DenseFunction.compress`): fewer bytes in the ANE's window and streamed per call
    compress: str = "none"

    def stored(self, function: str) -> str:
        """How `function`'s static weights are stored: the placement's `compress`, except on the CPU's reference
        backend (cpu-static computes with the model's own weights)."""
        backend = getattr(self, function)
        return self.compress if backend is not None and backend != REFERENCE else "none"

    def block_buckets(self, start: int, chunk: int) -> list[int] | None:
        """The bucket each static call of the attention core reads in a full chunk starting at offset `start`: one
        (the chunk's context's) without a block, one per block with one; None where the keys fit no bucket (the
        chunk's core runs on the CPU)."""
        return static_reads(self.buckets, chunk, start, self.static_rows("attention", chunk), self.attention_block)

    def static_rows(self, function: str, chunk: int) -> int:
        """The rows of a full chunk the function's static backend computes (the CPU, the rest, meanwhile)."""
        return min(dict(self.rows).get(function, chunk), chunk)

    def with_rows(self, function: str, rows: int | None) -> "DensePlacement":
        """The same placement with `function` split at `rows` (None: not split)."""
        kept = tuple((f, r) for f, r in self.rows if f != function)
        return dataclasses.replace(self, rows=kept + (((function, rows),) if rows else ()))

    def halved(self) -> "DensePlacement":
        """The placement as each half of a full chunk runs it (`pieces`): a split function's static side takes
        half the chunk's static rows; the attention core runs on the host (its static buckets are per chunk)."""
        return dataclasses.replace(self, attention=None, buckets=(), attention_block=None,
                                   rows=tuple((f, r // 2) for f, r in self.rows if f != "attention" and r // 2))


@dataclass
class ExpertFigures:
    """The experts' predicted cost over one prompt (all MoE layers): the expert plan's own prediction."""
    latency_ms: float
    cpu_ms: float
    energy_mj: float | None
    # per prompt, the experts' steps in order, each its units' busy ms side by side (`schedule`): the host's
    # packing, then the static groups beside the exact paths; () where unknown (one step on the host)
    steps: tuple[dict[str, float], ...] = ()
    # each MoE layer's own steps (as `steps`, which are their sums), in layer order; () where unknown (`schedule`
    # then spreads `steps` evenly over the layers)
    by_layer: tuple[tuple[dict[str, float], ...], ...] = ()


@dataclass(frozen=True)
class LazyLast:
    """The last decoder layer where a lazy host (MLX: `CostModel.is_lazy`) runs it: a prefill chunk evaluated for its
    KV cache only needs that layer's keys and values, so its queries, attention core, o_proj, later norms, MLP and
    experts run only for the rows whose output a logit reads (mlx-lm's prefill and the MLX spine's alike). `split`:
    the prompt's last token goes alone (every MoE layer runs the host's own experts), so one row of the final chunk
    runs them; else the final chunk's rows do. `experts`: that layer's expert figures over one prompt (none for a
    dense layer). Only where the layer's experts run lazily too: a layer with static groups evaluates its input
    (none of it is pruned), and a chunk whose dense functions run on a static backend is priced whole."""
    experts: ExpertFigures | None
    split: bool


@dataclass
class PrefillPrediction:
    """A whole prefill of `prompt_tokens`, predicted: total latency, CPU-busy time and energy, and each part's
    latency (`parts_ms`, keys `PARTS`)."""
    prompt_tokens: int
    chunk_tokens: int
    latency_ms: float
    cpu_ms: float
    energy_mj: float | None
    parts_ms: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # how each backend's dense ops are priced
    schedule: dict | None = None  # a schedule's figures (`autotune.costing.schedule`): each unit's busy and idle
    chunk_rows: tuple[int, ...] = ()  # an uneven chunking's rows (`prompt_chunks`); (): chunks of chunk_tokens

    def to_json(self) -> dict:
        out = {"predicted_prefill_ms": self.latency_ms, "predicted_prefill_cpu_ms": self.cpu_ms,
               "predicted_prefill_energy_mj": self.energy_mj,
               "predicted_parts_ms": {k: round(v, 6) for k, v in self.parts_ms.items()},
               "prompt_tokens": self.prompt_tokens, "chunk_tokens": self.chunk_tokens, "dense_pricing": self.sources}
        out = {**out, "chunk_rows": list(self.chunk_rows)} if self.chunk_rows else out
        return {**out, "predicted_schedule": self.schedule} if self.schedule else out


def prompt_chunks(prompt_tokens: int, chunk_tokens: int, rows: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """(rows, context) of each prefill chunk of a prompt: full chunks, then the partial last one; `rows`: an uneven
    chunking (the plan's `chunk_rows`), as the runtime chunks it (`runtime.prefill.chunk_spans`)."""
    return [(stop - start, stop) for start, stop in chunk_spans(prompt_tokens, chunk_tokens, rows)]


def pieces(prompt_tokens: int, chunk_tokens: int, halves: bool = False,
           rows: tuple[int, ...] = ()) -> list[tuple[int, int, bool, int]]:
    """(rows, context, full, experts' rows) of what runs as one forward: each chunk (`prompt_chunks`, `rows` an
    uneven chunking), or with `halves` each half of each chunk of two rows or more, the second's context the
    chunk's; `full`: the chunk is, or is one of an uneven chunking's (its static calls padded: `layer_links`). The
    experts' rows: the chunk's, on its last piece (a chunk's experts run once,
    over both halves), else 0."""
    out, listed = [], len(rows)
    for i, (n, context) in enumerate(prompt_chunks(prompt_tokens, chunk_tokens, rows)):
        full, first = n == chunk_tokens or i < listed, n // 2
        if halves and first:
            out.append((first, context - n + first, full, 0))
        out.append((n - first if halves else n, context, full, n))
    return out


def _on(backend: str | None, full: bool, host: str) -> str:
    """Where a dense function runs in a chunk: its static backend on full chunks, else the host (an exact path)."""
    return backend if backend is not None and full else host


def unit_of(cost: CostModel, backend: str) -> str:
    """The unit a backend computes on, as a schedule queues it: the CPU for every backend on it, else its own."""
    return cost.backend_model(backend).name if cost.overlaps(backend) else "cpu"


def dense_link(cost: CostModel, backend: str, ms: Any, calls: int = 1) -> evaluator.Link:
    """One step of the layer's chain on `backend`: a static function pays each of its `calls`; an exact path's
    work does not (the CPU's is torch's own; MLX's runs in the graph it is part of)."""
    t = float(np.sum(ms)) + (0.0 if cost.is_exact(backend) else calls * cost.call_ms(backend))
    return evaluator.Link(t, on_cpu=not cost.overlaps(backend), power_w=cost.power_w(backend),
                          units={unit_of(cost, backend): t})


def split_link(cost: CostModel, backend: str, rows: int, chunk: int, price, calls: int = 1,
               host: str = EXACT, padded: int = 0) -> evaluator.Link:
    """A step whose static function computes `rows` of the chunk's rows (in `calls` calls) and the host the rest
    at the same time (`price(backend, rows)` -> ms): the longer side's latency where either runs off the CPU, else
    their sum; `padded`: the static function's shape, its rows padded to it."""
    if backend == host or rows >= chunk:
        return dense_link(cost, backend, price(backend, chunk if backend == host else max(chunk, padded)), calls)
    static = dense_link(cost, backend, price(backend, max(rows, padded)), calls)
    rest = dense_link(cost, host, price(host, chunk - rows))
    both_cpu = static.on_cpu and rest.on_cpu
    latency = static.latency_ms + rest.latency_ms if both_cpu else max(static.latency_ms, rest.latency_ms)
    energy = None if static.energy_mj is None or rest.energy_mj is None else static.energy_mj + rest.energy_mj
    units = dict(static.units)
    for unit, ms in rest.units.items():
        units[unit] = units.get(unit, 0.0) + ms
    return evaluator.Link(latency, cpu_ms=static.cpu_ms + rest.cpu_ms, energy_mj=energy, units=units)


def layer_links(cost: CostModel, shape: DecoderShape, layer: int, rows: int, context: int, full: bool,
                place: DensePlacement, padded: int = 0) -> dict[str, list[evaluator.Link]]:
    """The dense steps of one decoder layer for one chunk, by part; `padded`: the static functions' rows where a
    chunk of an uneven chunking has fewer (`prompt_chunks`): as the runtime runs it (`RowFunction`), each row
    function's static side takes its static rows of the chunk, padded to its shape where the chunk has fewer, the
    attention core runs on the host."""
    h, ffn, host, short = shape.hidden, shape.mlp_ffn(layer), place.host, padded > rows
    qkv, o = _on(place.qkv, full, host), _on(place.o_proj, full, host)
    reads = place.block_buckets(context - rows, rows) if place.attention is not None and full and not short else None
    attn = place.attention if reads is not None else host
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def stored(b: str, function: str) -> str:  # the host computes with the model's own weights
        return "none" if cost.is_exact(b) else place.stored(function)

    def qkv_ms(b: str, r: int) -> float:  # a static function computes q, k and v as one matmul and holds the q/k
        # norms; an exact path runs the model's three modules, then the family's q/k norms
        if not cost.is_exact(b):
            return float(cost.stored_matmul_ms(b, r, shape.qkv_width, h, stored(b, "qkv")))
        norms = cost.norm_ms(b, r, q + kv, shape.qk_norm) if shape.qk_norm else 0.0
        return float(sum(cost.matmul_ms(b, r, w, h) for w in (q, kv, kv)) + norms)

    def attention_ms(b: str, r: int) -> float:  # each static call reads its bucket's keys; the host, the context's
        if cost.is_exact(b) or not reads:  # a window shorter than the context masks even a first chunk
            masked = cost.is_exact(b) and 0 < shape.sliding_window < context
            return float(cost.attention_ms(b, r, context, shape.heads, shape.kv_heads, shape.head_dim, masked))
        ms = cost.attention_ms(b, r // len(reads), np.asarray(reads), shape.heads, shape.kv_heads, shape.head_dim)
        return float(np.sum(ms))

    def split(function: str, backend: str, price, calls: int = 1) -> evaluator.Link:
        if not short:
            return split_link(cost, backend, place.static_rows(function, rows), rows, price, calls, host)
        static = place.static_rows(function, padded)
        return split_link(cost, backend, min(static, rows), rows, price, calls, host, static)

    out = {"attention_projections": [split("qkv", qkv, qkv_ms),
                                     split("o_proj", o, lambda b, r: cost.stored_matmul_ms(b, r, h, q,
                                                                                           stored(b, "o_proj")))],
           "attention_core": [split("attention", attn, attention_ms, len(reads or ()) or 1)],
           "rest": [dense_link(cost, host, cost.elementwise_ms(host, rows, h))]}
    if layer in shape.moe_layers:
        out["rest"].append(dense_link(cost, host, cost.matmul_ms(host, rows, shape.num_experts, h)))
    if ffn:
        out["dense_mlp"] = [split("mlp", _on(place.mlp, full, host),
                                  lambda b, r: cost.stored_matmul_ms(b, r, 2 * ffn, h, stored(b, "mlp"))
                                  + cost.stored_matmul_ms(b, r, h, ffn, stored(b, "mlp")))]
    return out


def expert_link(experts: ExpertFigures, left_out: ExpertFigures | None, share: float) -> evaluator.Link:
    """The experts' step: their figures, less `share` of the rows of a layer whose experts run only where an output
    reads them (`left_out`: that layer's figures, `LazyLast`), priced as a share of its rows."""
    if left_out is None or not share:
        return evaluator.Link(experts.latency_ms, cpu_ms=experts.cpu_ms, energy_mj=experts.energy_mj)
    energy = None if experts.energy_mj is None or left_out.energy_mj is None else (
        experts.energy_mj - share * left_out.energy_mj)
    return evaluator.Link(experts.latency_ms - share * left_out.latency_ms,
                          cpu_ms=experts.cpu_ms - share * left_out.cpu_ms, energy_mj=energy)


def cache_only_links(cost: CostModel, shape: DecoderShape, rows: int, host: str) -> dict[str, list[evaluator.Link]]:
    """What a lazy host computes of a decoder layer for rows no output reads (`LazyLast`): the input norm, then the
    keys and values (and their norm) the KV cache holds."""
    kv = shape.kv_heads * shape.head_dim
    norms = cost.norm_ms(host, rows, kv, shape.qk_norm) if shape.qk_norm else 0.0
    return {"attention_projections": [dense_link(cost, host, 2 * cost.matmul_ms(host, rows, kv, shape.hidden) + norms)],
            "rest": [dense_link(cost, host, cost.norm_ms(host, rows, shape.hidden, shape.hidden))]}


def predict_prefill(cost: CostModel, shape: DecoderShape, prompt_tokens: int, chunk_tokens: int,
                    experts: ExpertFigures, place: DensePlacement = DensePlacement(),
                    logits_rows: int = 1, lazy_last: LazyLast | None = None, halves: bool = False,
                    chunk_rows: tuple[int, ...] = ()) -> PrefillPrediction:
    """The whole prefill of one prompt under a placement of the dense functions and the experts' figures;
    `logits_rows`: the positions whose logits it computes (a prefill needs one; a run that scores every token,
    all); `lazy_last`: the last decoder layer's work that a lazy host leaves out (with one logits row only);
    `halves`: each chunk's dense ops run per half (`pieces`, `DensePlacement.halved`); `chunk_rows`: an uneven
    chunking (`prompt_chunks`), `chunk_tokens` its longest chunk (the static functions' rows)."""
    links: dict[str, list[evaluator.Link]] = {p: [] for p in PARTS}
    host, last = place.host, shape.num_layers - 1
    lazy = lazy_last if lazy_last is not None and cost.is_lazy(host) and logits_rows == 1 else None
    kinds: dict[tuple, list[int]] = {}  # layers of one shape cost the same: one of each, times their count
    for layer in range(shape.num_layers - (lazy is not None)):
        kinds.setdefault((layer in shape.moe_layers, shape.mlp_ffn(layer)), []).append(layer)
    chunks, pruned_rows = pieces(prompt_tokens, chunk_tokens, halves, chunk_rows), 0
    padded = chunk_tokens if chunk_rows else 0
    place = place.halved() if halves else place
    for i, (rows, context, full, _) in enumerate(chunks):
        layer_sets = [(same[0], len(same)) for same in kinds.values()]
        static = full and any((place.qkv, place.o_proj, place.attention, place.mlp))
        if lazy is not None and static:  # its static functions read the layer's input: priced whole
            layer_sets.append((last, 1))
        elif lazy is not None:
            read = 0 if i < len(chunks) - 1 else 1 if lazy.split else rows
            pruned_rows += rows - read
            steps = cache_only_links(cost, shape, rows - read, host)
            if read:
                for part, more in layer_links(cost, shape, last, read, context, full, place, padded).items():
                    steps[part] = steps.get(part, []) + more
            for part, more in steps.items():
                links[part] += more
        for layer, n in layer_sets:
            for part, steps in layer_links(cost, shape, layer, rows, context, full, place, padded).items():
                links[part] += [s.times(n) for s in steps]
    links["lm_head"] = [dense_link(cost, host, cost.matmul_ms(host, logits_rows, shape.vocab, shape.hidden)
                                   + cost.norm_ms(host, logits_rows, shape.hidden, shape.hidden)  # the final norm
                                   + head_dequant_ms(cost, shape, host))]
    links["experts"] = [expert_link(experts, lazy.experts if lazy else None, pruned_rows / prompt_tokens)]
    parts = {p: evaluator.chain(steps) for p, steps in links.items()}
    whole = evaluator.chain([s for steps in links.values() for s in steps])
    used = {b for b in (place.qkv, place.o_proj, place.attention, place.mlp) if b} | {host}
    sources = {f"{cost.backend_model(b).name}.{op}": cost.dense_fit(b, op).source for b in sorted(used)
               for op in ("matmul", "attention", "elementwise")}
    return PrefillPrediction(prompt_tokens, chunk_tokens, whole.latency_ms, whole.cpu_ms, whole.energy_mj,
                             {p: t.latency_ms for p, t in parts.items()}, sources, chunk_rows=tuple(chunk_rows))


def head_dequant_ms(cost: CostModel, shape: DecoderShape, host: str) -> float:
    """A packed head on torch's CPU (`runtime.cpu.quantized.QuantizedLinear`) dequantizes its whole weight for the
    one row of logits a prompt's prefill computes: 2.7 s of a 4-bit 152k vocabulary on one core, against 62 ms of
    bf16 matmul (the Qwen3 twin, measured). MLX's quantized matmul reads it packed: nothing."""
    if not shape.packed or host != EXACT:
        return 0.0
    return dequant_ms(cost, host, shape.vocab * shape.hidden, shape.hidden)


def roofline_ms(cost: CostModel, shape: DecoderShape, prompt_tokens: int, static_backend: str) -> float | None:
    """The prompt's FLOPs at the static backend's, the CPU's and (where the profile prices one) the GPU's matmul
    throughput together (the floor that `over_roofline_whole` divides by); None where no lane's fit prices FLOPs."""
    mean_context = (prompt_tokens + 1) / 2
    gflop = shape.flops_per_token(mean_context) * prompt_tokens / 1e9
    rate = gflop_per_ms([cost.dense_fit(b, "matmul").ms_per_gflop for b in {static_backend, EXACT, cost.plan_exact()}])
    return gflop / rate if rate else None


def gflop_per_ms(ms_per_gflop: list[float]) -> float:
    """Lanes' throughput together. A fitted rate of 0 (the call and byte terms absorbed its records' time) prices
    no throughput: that lane adds nothing, and the roofline is the other lanes' (0: none prices FLOPs)."""
    return sum(1.0 / r for r in ms_per_gflop if r > 0)


def placement_of(dense: Any) -> DensePlacement:
    """A plan's `dense` field (`runtime.plan.DensePlan`, or None) as the placement it prices: the backend its layers
    name per function (the search writes one per function for every layer) and the storage its compressed functions
    name."""
    if dense is None:
        return DensePlacement()
    host = dense.exact or EXACT
    first = lambda name: next((f.backend for dl in dense.layers if (f := getattr(dl, name)) is not None), None)  # noqa: E731
    rows = lambda name: next((f.rows for dl in dense.layers if (f := getattr(dl, name)) is not None), None)  # noqa: E731
    split = tuple((name, r) for name in ("qkv", "o_proj", "mlp") if (r := rows(name)))
    if dense.attention_rows:
        split += (("attention", dense.attention_rows),)
    stored = next((f.compression for dl in dense.layers for name in ("qkv", "o_proj", "mlp")
                   if (f := getattr(dl, name)) is not None and f.compression != "none"), "none")
    return DensePlacement(first("qkv"), first("o_proj"), next((dl.attention for dl in dense.layers if dl.attention),
                                                              None), first("mlp"),
                          tuple(dense.attention_context_buckets), split, dense.attention_block, host, stored)


def priced_outside(cost: CostModel, shape: DecoderShape, prompt_tokens: int, chunk_tokens: int,
                   static_backend: str | None = None) -> dict[str, list[Reach]]:
    """The parts of a prefill whose ops this cost model prices past its fits' ranges (`fit_range`), each with the
    axes it reaches past and how far: the experts at the rows an expert's call gets on average in a chunk, on the
    exact path's backend and the static one; the dense ops on the CPU at a full chunk's rows and the prompt's
    context."""
    rows, q, kv = chunk_tokens, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    name = lambda b: cost.backend_model(b).name  # noqa: E731
    matmul = lambda m, n, k: reach(cost.ranges, name(EXACT), "matmul", rows=m, out=n, **{"in": k})  # noqa: E731
    load = max(1.0, chunk_tokens * shape.top_k / max(1, shape.num_experts))
    experts = [r for b in {EXACT, static_backend or EXACT}
               for r in reach(cost.ranges, name(b), "experts", rows=load, hidden=shape.hidden, ffn=shape.expert_ffn)]
    parts = {"attention_projections": [*matmul(rows, q, shape.hidden), *matmul(rows, kv, shape.hidden),
                                       *matmul(rows, shape.hidden, q)],
             "attention_core": reach(cost.ranges, name(EXACT), "attention", rows=rows, context=prompt_tokens,
                                     width=q),
             "experts": experts if shape.moe_layers else [],
             "dense_mlp": [r for f in {shape.mlp_ffn(layer) for layer in range(shape.num_layers)} if f
                           for r in (*matmul(rows, 2 * f, shape.hidden), *matmul(rows, shape.hidden, f))],
             "lm_head": matmul(1, shape.vocab, shape.hidden),
             "rest": [*reach(cost.ranges, name(EXACT), "elementwise", rows=rows, hidden=shape.hidden),
                      *(matmul(rows, shape.num_experts, shape.hidden) if shape.moe_layers else [])]}
    return {part: merge_reaches(rs) for part, rs in parts.items() if rs}
