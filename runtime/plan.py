"""The plan file `npumoe.plan/1`: the contract between the tuner and the runtime.

A plan says, per MoE layer, which experts run as static groups (on a registered static backend, each expert with
a fixed token capacity) and which run exactly on the CPU; optionally (`dense`), which dense functions of which decoder
layers (attention projections, the attention core, the dense MLP or shared expert) run on a static backend. Loading
validates everything and raises one `FileFormatError` that names the field.
"""
from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, field_validator

from runtime.backends.registry import EXACT, registry
from runtime.errors import FileFormatError
from runtime.fileio import atomic_write_json, check_schema, read_versioned_json, validation_error

SCHEMA = "npumoe.plan/1"
KIND, VERSION = "plan", 1
OVERFLOW_POLICIES = ("drop", "spill")
# How a static group stores its weights on the ANE (coremltools: fp16, int8 per channel, 4-bit palette).
COMPRESSIONS = ("none", "int8", "palettize4")
# `router_weight`: the assignment's top-k router weight. `weight_x_norm`: router weight x L2 norm of the token's
# hidden state, an activation-based saliency (the output an assignment adds scales with both).
SALIENCY_RULES = ("router_weight", "weight_x_norm")
# The CPU's kernels per quantized expert storage (runtime/cpu/cpu_weights.py), as `cpu_weights.kernel_rows` names them.
CPU_KERNELS = {"int8": ("packed", "dequant", "int_mm", "int_mm_gate_up"), "int4": ("packed", "dequant")}
# Chunks with fewer tokens than `exact_below_tokens` run wholly on cpu-exact (no static call, no padding, no drop).
# A plan without the field gets 2: decode steps (1 token) never call a static group. `autotune search` writes the
# cost model's break-even instead; values below 2 are refused, so decode always stays exact.
DEFAULT_EXACT_BELOW_TOKENS = 2

PositiveInt = Annotated[StrictInt, Field(gt=0)]
NonNegInt = Annotated[StrictInt, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0, strict=True)]  # a number (an int too), never "0.5" or true
SHARE_SUM_TOLERANCE = 1e-3  # load shares are written rounded; they must still sum to 1 within this
ATTENTION_BLOCK_GRAIN = 64  # an attention block's queries: a multiple of the ANE's preferred 64 rows


def static_reads(buckets: list[int] | tuple[int, ...], chunk: int, start: int, static: int,
                 block: int | None) -> list[int] | None:
    """The context bucket each static attention-core call reads in a full chunk at offset `start` whose first
    `static` queries run static (ascending `buckets`, `DensePlan`'s rule): one, the chunk's context's, without a
    `block`; with one, a call per block, each over the smallest bucket holding its keys. None: the keys fit no
    bucket (the chunk's core runs on the CPU). What the runtime calls and the search prices."""
    def bucket(keys: int) -> int | None:
        return next((b for b in buckets if b >= keys), None)

    if block is None:
        return None if (b := bucket(start + chunk)) is None else [b]
    if bucket(start + static) is None:
        return None
    return [bucket(start + end) for end in range(block, static + 1, block)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """The MoE shape and fingerprint of a model: what a plan (and a traces header) records, checked against the
    loaded model before running. `runtime.loading.model_loader.model_spec` computes it."""
    architecture: StrictStr
    model_type: StrictStr
    num_layers: PositiveInt
    moe_layers: list[NonNegInt]
    num_experts: PositiveInt
    top_k: PositiveInt
    hidden_size: PositiveInt
    expert_ffn_size: PositiveInt
    fingerprint: StrictStr

    def to_json(self) -> dict:
        return self.model_dump(mode="json")


def _registered_exact(name: str | None) -> str | None:
    """An exact path of the registry (`cpu-exact`, `mlx-exact`, plugins): what a plan's exact placement names."""
    names = registry.exact_paths()
    if name is not None and name not in names:
        raise ValueError(f"unknown exact path {name!r}; registered exact paths: {', '.join(names)}")
    return name


def _registered_backend(name: str | None) -> str | None:
    """A static backend of the registry (runtime.backends), plugins included: what a group or dense function names."""
    names = registry.plannable()
    if name is not None and name not in names:
        raise ValueError(f"unknown backend {name!r}; registered static backends: {', '.join(names)}")
    return name


class Group(_Strict):
    """Experts fused into one static graph: expert i gets a slice of `capacities[i]` token rows."""
    backend: StrictStr  # a static backend of the registry (runtime.backends), plugins included
    experts: list[NonNegInt] = Field(min_length=1)
    capacities: list[PositiveInt] = Field(min_length=1)
    tier: list[NonNegInt] | None = None  # optional tier label per expert, for reports
    compress: Literal[COMPRESSIONS] | None = None  # optional; absent means "none" (fp16 weights)

    _registered = field_validator("backend")(_registered_backend)

    @property
    def compression(self) -> str:
        return self.compress or "none"

    @property
    def slots(self) -> int:
        return sum(self.capacities)


class WindowSpread(_Strict):
    """How a layer's overflow rate varies between windows of `window_chunks` consecutive held-out chunks (every
    full window of the held-out chunks, in order): the drift monitor's yardstick for one window's rate."""
    window_chunks: PositiveInt
    windows: PositiveInt
    mean: Fraction
    sd: Annotated[float, Field(ge=0.0)]


class LayerCalibration(_Strict):
    """What the search saw on this layer's traces (optional; plans made before it lack it). The runtime's drift
    monitor compares a run's routing against it."""
    load_shares: list[Fraction] = Field(min_length=1)  # each expert's share of the calibration assignments
    # share of held-out assignments past their expert's capacity: dropped under `overflow: drop`, spilled under
    # `overflow: spill`
    heldout_overflow_rate: Fraction
    heldout_window_spread: WindowSpread | None = None  # optional; absent when held-out chunks fill no window


class CpuWeights(_Strict):
    """How the CPU holds the experts (runtime/cpu/cpu_weights.py): bf16 as loaded, int8 per output channel, int4 per
    group of `group_size` inputs. Optional in a plan; absent means as loaded."""
    kind: Literal["bf16", "int8", "int4"]
    group_size: Literal[32, 64, 128, 256] | None = None  # int4 only (default 64)
    # quantized kinds only: the row count (one expert's call) from which each kernel runs, one from 0 (absent: the
    # runtime's defaults, runtime/cpu_weights.KERNEL_ROWS)
    kernel_rows: dict[StrictStr, NonNegInt] | None = None


class LayerPlan(_Strict):
    layer: NonNegInt
    groups: list[Group]
    cpu_exact: list[NonNegInt]  # every expert in no group: run exactly (the name predates exact paths off the CPU)
    # optional: experts of `cpu_exact` that run on an exact path other than the plan's `exact`, by path name
    exact_split: dict[StrictStr, list[NonNegInt]] | None = None
    calibration: LayerCalibration | None = None

    @field_validator("exact_split")
    @classmethod
    def _split_paths(cls, split: dict[str, list[int]] | None) -> dict[str, list[int]] | None:
        for name in split or {}:
            _registered_exact(name)
        return split

    def exact_path_of(self, expert: int, default: str) -> str:
        """The exact path expert `expert` (one of `cpu_exact`) runs on; `default`: the plan's `exact_path`."""
        return next((name for name, experts in (self.exact_split or {}).items() if expert in experts), default)


class DenseFunction(_Strict):
    """One dense static function of a decoder layer (weights of that layer) on a static backend."""
    backend: StrictStr
    compress: Literal[COMPRESSIONS] | None = None  # optional; absent means "none" (fp16 weights)
    rows: PositiveInt | None = None  # optional: the function takes a full chunk's first `rows` rows, the CPU the
    # rest at the same time (absent: every row)

    _registered = field_validator("backend")(_registered_backend)

    @property
    def compression(self) -> str:
        return self.compress or "none"


class DenseLayer(_Strict):
    """Which dense functions of one decoder layer run on a static backend; an absent one runs on the CPU in torch."""
    layer: NonNegInt  # any decoder layer (MoE or dense-MLP)
    qkv: DenseFunction | None = None  # input norm + q/k/v projections (+ q/k norms and biases as the family has)
    o_proj: DenseFunction | None = None
    attention: StrictStr | None = None  # the attention core's backend (weight-free: one function per shape)
    mlp: DenseFunction | None = None  # a non-MoE layer's dense MLP, or an MoE layer's shared expert and its gate

    _registered = field_validator("attention")(_registered_backend)


class DensePlan(_Strict):
    """The dense static functions. A full chunk whose context (tokens before it and its own) is at most a bucket
    runs the attention core of the smallest such bucket (keys padded and masked); past the last bucket, a partial
    chunk or a decode step runs it on the CPU, exactly. With `attention_block`, a full chunk whose static queries'
    keys fit the last bucket runs them in causal blocks, each block on the smallest bucket holding its keys."""
    attention_context_buckets: list[PositiveInt]  # ascending, each a multiple of chunk_tokens (of the block)
    layers: list[DenseLayer]  # at most one per decoder layer
    attention_rows: PositiveInt | None = None  # optional: the core's function takes a full chunk's first queries,
    # sdpa on the CPU the rest at the same time (absent: every query)
    attention_block: PositiveInt | None = None  # optional: those queries run in causal blocks of this many, each
    # over the smallest bucket holding its keys (absent: one call per full chunk)
    # optional: the exact path running the dense work no static function takes (functions not placed, the rows past
    # a split, partial chunks, the core past the buckets, norms, router, lm_head); absent: the CPU in torch
    exact: StrictStr | None = None

    _registered = field_validator("exact")(_registered_exact)

    @property
    def backends(self) -> set[str]:
        """Every backend a dense function of the plan names."""
        return {name for dl in self.layers for name in (dl.attention, *(f.backend for f in (dl.qkv, dl.o_proj, dl.mlp)
                                                                          if f is not None)) if name is not None}


class Plan(_Strict):
    schema_: Literal["npumoe.plan/1"] = Field(SCHEMA, alias="schema")
    model: ModelSpec
    chunk_tokens: PositiveInt
    # optional: an uneven chunking, a prompt's first chunks' rows in order, each at most chunk_tokens (the static
    # functions' rows), then chunks of chunk_tokens past them (absent: chunks of chunk_tokens throughout)
    chunk_rows: list[PositiveInt] | None = None
    # optional: the prefill chunks in flight the plan was chosen for (runtime/mlx/overlap.py; the MLX spine runs it
    # so unless told otherwise, the torch spine one at a time); absent: 1
    in_flight: Annotated[StrictInt, Field(ge=1, le=2)] | None = None
    overflow: Literal[OVERFLOW_POLICIES]
    saliency: Literal[SALIENCY_RULES]
    layers: list[LayerPlan] = Field(min_length=1)
    exact_below_tokens: Annotated[StrictInt, Field(ge=DEFAULT_EXACT_BELOW_TOKENS)] | None = None
    dense: DensePlan | None = None  # absent: every dense op on the CPU in torch
    cpu_weights: CpuWeights | None = None  # optional, plan-wide: the CPU's storage of every expert
    # optional: the exact path of every expert in no group (unless its layer's `exact_split` says otherwise), of
    # spilled assignments and of decode steps (absent: cpu-exact)
    exact: StrictStr | None = None
    predicted: dict[str, Any] | None = None  # cost-model predictions, labelled as such by whoever writes them
    meta: dict[str, Any] | None = None  # provenance: tool version, search settings, profile used

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    _registered = field_validator("exact")(_registered_exact)

    @property
    def calibrated(self) -> bool:
        """Whether every layer carries calibration statistics (what the drift monitor compares against)."""
        return all(lp.calibration is not None for lp in self.layers)

    def heldout_overflow_rate(self) -> float | None:
        """The plan-wide expected overflow rate on held-out traces (layers weigh equally: each sees every token)."""
        if not self.calibrated:
            return None
        return sum(lp.calibration.heldout_overflow_rate for lp in self.layers) / len(self.layers)

    def window_spread(self) -> tuple[float, float] | None:
        """(mean, sd) of a plan-wide window's overflow rate: the layers' means averaged, and their sds averaged
        (the sd of an average of correlated rates is at most the average sd: the layers see the same text); None
        where a layer lacks the spread."""
        if not self.calibrated or any(lp.calibration.heldout_window_spread is None for lp in self.layers):
            return None
        spreads = [lp.calibration.heldout_window_spread for lp in self.layers]
        return sum(s.mean for s in spreads) / len(spreads), sum(s.sd for s in spreads) / len(spreads)

    def layer(self, index: int) -> LayerPlan:
        for lp in self.layers:
            if lp.layer == index:
                return lp
        raise KeyError(index)

    @property
    def exact_path(self) -> str:
        """The plan-wide exact path (`exact`, default cpu-exact)."""
        return self.exact or EXACT

    @property
    def exact_below(self) -> int:
        """The decode policy's threshold: chunks with fewer tokens run exactly."""
        return self.exact_below_tokens or DEFAULT_EXACT_BELOW_TOKENS

    def to_json(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def _check_layers(plan: Plan) -> tuple[str, str] | None:
    """Cross-field rules pydantic can't express: expert ids, placement, layer coverage. Returns (field, msg)."""
    n_experts = plan.model.num_experts
    seen_layers: set[int] = set()
    for li, lp in enumerate(plan.layers):
        where = f"layers[{li}]"
        if lp.layer not in plan.model.moe_layers:
            return f"{where}.layer", f"{lp.layer} is not an MoE layer of the model (model.moe_layers)"
        if lp.layer in seen_layers:
            return f"{where}.layer", f"layer {lp.layer} appears twice"
        seen_layers.add(lp.layer)
        placed: dict[int, str] = {}
        places = [(f"{where}.groups[{gi}]", g.experts) for gi, g in enumerate(lp.groups)]
        places.append((f"{where}.cpu_exact", lp.cpu_exact))
        for gi, g in enumerate(lp.groups):
            if len(g.capacities) != len(g.experts):
                return (f"{where}.groups[{gi}].capacities",
                        f"has {len(g.capacities)} entries for {len(g.experts)} experts")
            if g.tier is not None and len(g.tier) != len(g.experts):
                return f"{where}.groups[{gi}].tier", f"has {len(g.tier)} entries for {len(g.experts)} experts"
        for field, experts in places:
            for i, e in enumerate(experts):
                at = f"{field}.experts[{i}]" if "groups" in field else f"{field}[{i}]"
                if e >= n_experts:
                    return at, f"unknown expert id {e} (model has {n_experts} experts)"
                if e in placed:
                    return at, (f"duplicate expert id {e}" if placed[e] == field
                                else f"expert {e} is also in {placed[e]}; an expert has exactly one place")
                placed[e] = field
        for name, experts in (lp.exact_split or {}).items():
            stray = sorted(set(experts) - set(lp.cpu_exact))
            if stray:
                return f"{where}.exact_split.{name}", f"experts {stray} are not in cpu_exact (only those run exactly)"
        missing = sorted(set(range(n_experts)) - set(placed))
        if missing:
            return where, f"experts {missing} are in no group and not in cpu_exact"
        if lp.calibration is not None:
            shares = lp.calibration.load_shares
            if len(shares) != n_experts:
                return f"{where}.calibration.load_shares", f"has {len(shares)} entries for {n_experts} experts"
            if abs(sum(shares) - 1.0) > SHARE_SUM_TOLERANCE:
                return f"{where}.calibration.load_shares", f"sums to {sum(shares):.4f}, not 1"
    absent = sorted(set(plan.model.moe_layers) - seen_layers)
    if absent:
        return "layers", f"MoE layers {absent} have no entry"
    return _check_chunk_rows(plan) or _check_dense(plan) or _check_cpu_weights(plan)


def _check_chunk_rows(plan: Plan) -> tuple[str, str] | None:
    for i, rows in enumerate(plan.chunk_rows or ()):
        if rows > plan.chunk_tokens:
            return f"chunk_rows[{i}]", f"{rows} is past chunk_tokens ({plan.chunk_tokens}): the static functions' rows"
    return None


def _check_cpu_weights(plan: Plan) -> tuple[str, str] | None:
    rows = plan.cpu_weights.kernel_rows if plan.cpu_weights is not None else None
    if rows is None:
        return None
    kind, known = plan.cpu_weights.kind, CPU_KERNELS.get(plan.cpu_weights.kind, ())
    for name in rows:
        if name not in known:
            return ("cpu_weights.kernel_rows", f"{name!r} is not a kernel of {kind} experts ("
                    + (f"choose from {', '.join(known)})" if known else "bf16 runs no quantized kernel)"))
    if 0 not in rows.values():
        return "cpu_weights.kernel_rows", f"{rows}: no kernel starts at 0 rows (one must run the fewest rows)"
    return None


def _check_dense(plan: Plan) -> tuple[str, str] | None:
    """The dense placement's rules that need the plan alone (fit to the loaded model is checked when applied)."""
    if plan.dense is None:
        return None
    buckets = plan.dense.attention_context_buckets
    users = [dl.layer for dl in plan.dense.layers if dl.attention is not None]
    user = f": the attention core of layer {users[0]} has no such shape" if users else ""
    rows, block = plan.dense.attention_rows, plan.dense.attention_block
    if rows is not None and rows >= plan.chunk_tokens:
        return "dense.attention_rows", f"{rows} is not below chunk_tokens ({plan.chunk_tokens}){user}"
    static = rows or plan.chunk_tokens
    if block is not None and (block % ATTENTION_BLOCK_GRAIN or static % block):
        return "dense.attention_block", (f"{block} is not a multiple of {ATTENTION_BLOCK_GRAIN} dividing the core's "
                                         f"static rows ({static}: dense.attention_rows or chunk_tokens){user}")
    step, unit = (block, "dense.attention_block") if block else (plan.chunk_tokens, "chunk_tokens")
    for i, b in enumerate(buckets):
        where = f"dense.attention_context_buckets[{i}]"
        if b % step:
            return where, f"{b} is not a multiple of {unit} ({step}){user}"
        if i and b <= buckets[i - 1]:
            return where, f"{b} does not follow {buckets[i - 1]}: buckets ascend{user}"
    seen: set[int] = set()
    for i, dl in enumerate(plan.dense.layers):
        where = f"dense.layers[{i}]"
        for name in ("qkv", "o_proj", "mlp"):
            f = getattr(dl, name)
            if f is not None and f.rows is not None and f.rows >= plan.chunk_tokens:
                return (f"{where}.{name}.rows", f"{f.rows} is not below chunk_tokens ({plan.chunk_tokens}): layer "
                        f"{dl.layer}'s function would leave the CPU no rows")
        if dl.layer >= plan.model.num_layers:
            return f"{where}.layer", f"{dl.layer} is not a decoder layer (model.num_layers is {plan.model.num_layers})"
        if dl.layer in seen:
            return f"{where}.layer", f"layer {dl.layer} appears twice"
        seen.add(dl.layer)
    return None


def plan_from_json(obj: Any, path: str = "") -> Plan:
    """Validate a decoded JSON object as a plan; raises FileFormatError naming the first bad field."""
    check_schema(obj, KIND, VERSION, path)
    try:
        plan = Plan.model_validate(obj)
    except ValidationError as e:
        raise validation_error(KIND, path, e) from None
    bad = _check_layers(plan)
    if bad:
        raise FileFormatError(KIND, path, *bad)
    return plan


def load_plan(path: str | os.PathLike) -> Plan:
    return plan_from_json(read_versioned_json(path, KIND, VERSION), str(path))


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    atomic_write_json(path, plan.to_json())


def check_plan_matches(plan: Plan, spec: Any, path: str = "") -> None:
    """Refuse a plan made for another model: shape fields first (clearer), then the fingerprint."""
    got = spec.to_json()
    for name in ("architecture", "num_layers", "moe_layers", "num_experts", "top_k", "hidden_size",
                 "expert_ffn_size", "fingerprint"):  # shape fields first, then the fingerprint; not model_type
        want = getattr(plan.model, name)
        if want != got[name]:
            raise FileFormatError(KIND, path, f"model.{name}",
                                  f"plan is for a different model: plan has {want!r}, the model has {got[name]!r}")
