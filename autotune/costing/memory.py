"""Predicted memory of a plan: what a process running it holds at its peak, in parts. Every figure is predicted.

    total = CPU-side weights + ANE packages + activations of one chunk + KV cache at the prompt length + runtime

- CPU-side weights: the dense parts as held (the dtype the model runs in, or packed as an MLX checkpoint stores
  them) and every expert in the plan's CPU storage (`bf16` as loaded, `int8`, `int4` with its group size, or MLX
  packed as on disk; `storage_bytes_per_weight`). One copy: the runtime keeps every expert on the CPU, the
  ANE-resident ones too (decode steps, spilled overflow and short chunks run exactly on the CPU), but only in that
  storage, never a second full-width copy; `cpu_copy_of_ane_resident_bytes` says how much of it they are.
- ANE packages: the distinct experts of the plan's `ane` groups, stored as each group's `compress` says (fp16, int8,
  4-bit palettes; `runtime.coreml.ane_limits`), and the matrices of its dense functions on `ane`. On a Mac this is
  unified memory, on top of the CPU-side weights.
- Activations of one chunk: the hidden states, attention and MoE buffers of one decoder layer for `chunk_tokens`
  rows, and the chunk's logits (generation keeps only the last position's; `autotune run` keeps every position's,
  in fp32, for the whole text: `logits_rows`).
- KV cache: keys and values of every attention layer at `prompt_tokens`.
- Runtime: the interpreter with torch, transformers and the tokenizer loaded (RUNTIME_BYTES, measured).

`runtime.resources` measures the other side (peak RSS, CPU time) in a run.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.backends.registry import registry
from runtime.coreml import ane_limits
from runtime.cpu.allocator import matmuls_through_onednn, primitive_cache_bytes
from runtime.cpu.quantized import BLOCK_WEIGHTS
from runtime.errors import NpumoeError
from runtime.loading.model_config import head_dim
from runtime.loading.model_record import ModelRecord
from runtime.mlx.formats import NAME as MLX_EXACT
from runtime.mlx.formats import WIDEN_BYTES
from runtime.plan import LayerPlan, Plan

GB = 1e9
# The process around the weights: Python, torch 2.x (CPU), transformers 5 and a tokenizer, and what torch's compute
# libraries keep once the first forwards ran (kernels' code pages, oneDNN's caches, the heap those calls grew:
# 0.12 GB on any model, which a figure taken right after load_model missed), measured as peak RSS on this Linux
# x86-64 host: tiny-moe prefilling a 1024-token prompt in chunks of 256 peaks at 562 MB, 40 MB of it weights,
# activations and KV cache. A Mac's differs; it is the smallest part at any real model size.
RUNTIME_BYTES = 498 * 2**20
HIDDEN_BUFFERS = 8  # [chunk, hidden] tensors alive at once in a decoder layer (residual, norms, attention out, MoE)
GROUP_CALL_BYTES = 3 * 4  # a group call's bytes per packed row and hidden unit: fp32 input, outputs, concatenated


@dataclass(frozen=True)
class ModelSize:
    """The model facts memory depends on (from a loaded model or its meta-device skeleton)."""
    weight_bytes: int  # every parameter and buffer, in the dtype the model runs in
    dtype_bytes: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    top_k: int
    expert_ffn: int
    expert_bytes: int = 0  # of weight_bytes: the experts' part, as held
    expert_weights: int = 0  # the experts' weight count (every layer)
    experts_per_layer: int = 0
    storage: str = "bf16"  # how the experts are held as loaded: bf16 (the dtype), or mlx-<bits>bit-g<group>
    # per decoder layer, the weights (matrix entries) of its dense functions: (norm + q/k/v, o_proj, shared expert
    # or dense MLP; 0 where the layer has none)
    dense_function_weights: tuple[tuple[int, int, int], ...] = ()
    onednn: bool = False  # torch computes its matmuls through oneDNN's caches of compiled primitives on this host

    @property
    def layer_bytes(self) -> int:
        """One decoder layer's share of the weights as held: all but the input embedding (a gather reads only the
        prompt's rows of it), over the layers."""
        return max(0, self.weight_bytes - self.vocab * self.hidden * self.dtype_bytes) // max(1, self.layers)

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def of(cls, model: torch.nn.Module, dtype_bytes: int | None = None) -> "ModelSize":
        """`model`'s sizes; `dtype_bytes` overrides its parameters' (a meta skeleton made in another dtype)."""
        from runtime.loading.model_loader import moe_layers

        first = next(p for p in model.parameters() if p.is_floating_point())
        d = dtype_bytes or first.element_size()
        layers = moe_layers(model)
        # packed experts (quantized.py, cpu_weights.py): codes and scales as held, whatever the dtype
        packed = any(hasattr(l.experts, "npumoe_weights") for l in layers)

        def held(tensors: list[torch.Tensor]) -> int:
            return sum(t.numel() * (d if t.is_floating_point() and not packed else t.element_size()) for t in tensors)

        weights = held([*model.parameters(), *model.buffers()])
        experts_held = sum(held([*l.experts.parameters(), *l.experts.buffers()]) for l in layers)
        cfg = model.config
        heads = int(cfg.num_attention_heads)
        experts = layers[0].experts
        n_weights = len(layers) * int(experts.num_experts) * 3 * int(experts.hidden_dim) * int(experts.intermediate_dim)
        return cls(weight_bytes=int(weights), dtype_bytes=d, layers=int(cfg.num_hidden_layers),
                   hidden=int(cfg.hidden_size), heads=heads,
                   kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
                   head_dim=head_dim(cfg.to_dict()),
                   vocab=int(cfg.vocab_size), top_k=int(cfg.num_experts_per_tok),
                   expert_ffn=int(experts.intermediate_dim), expert_bytes=int(experts_held),
                   expert_weights=n_weights, experts_per_layer=int(experts.num_experts),
                   storage="packed" if packed else "bf16", dense_function_weights=_dense_function_weights(model),
                   onednn=dtype_bytes is None and matmuls_through_onednn(first.dtype))  # a skeleton: unknown

    @classmethod
    def of_config(cls, config: object, dtype_bytes: int, mlx: dict | None = None) -> "ModelSize":
        """Sizes of the model a transformers config describes, built on the meta device (no memory); `mlx`: its
        quantization table (`bits`, `group_size`) where the model is an MLX checkpoint, held packed as on disk."""
        import transformers

        with torch.device("meta"):
            skeleton = transformers.AutoModelForCausalLM.from_config(config)
        return cls.of_skeleton(skeleton, dtype_bytes, mlx)

    @classmethod
    def of_skeleton(cls, skeleton: torch.nn.Module, dtype_bytes: int, mlx: dict | None = None) -> "ModelSize":
        """Sizes of a model's meta-device `skeleton` in `dtype_bytes`; `mlx`: as `of_config`."""
        size = cls.of(skeleton, dtype_bytes)
        if not mlx:
            return size
        from dataclasses import replace

        bits, group = int(mlx.get("bits", 4)), int(mlx.get("group_size", 64))
        rate = storage_bytes_per_weight(f"mlx{bits}", group, dtype_bytes)
        matrices = sum(p.numel() for p in skeleton.parameters() if p.dim() >= 2)  # packed: every matrix
        whole = size.weight_bytes - matrices * dtype_bytes
        return replace(size, weight_bytes=int(whole + matrices * rate), expert_bytes=int(size.expert_weights * rate),
                       storage=f"mlx-{bits}bit-g{group}")


def _matrix_weights(modules: list[torch.nn.Module]) -> int:
    """Entries of every linear layer in `modules` (full-width or packed: what a function stores of them)."""
    return sum(int(m.out_features) * int(m.in_features) for root in modules for m in root.modules()
               if hasattr(m, "out_features") and hasattr(m, "in_features"))


def _dense_function_weights(model: torch.nn.Module) -> tuple[tuple[int, int, int], ...]:
    from runtime.dense.families import attention_modules, mlp_modules

    out = []
    for index in range(len(model.model.layers)):
        attn, _ = attention_modules(model, index)
        mlp = mlp_modules(model, index)
        out.append((_matrix_weights([attn[r] for r in ("q", "k", "v")]), _matrix_weights([attn["o"]]),
                    _matrix_weights(list(mlp[0].values())) if mlp else 0))
    return tuple(out)


def storage_bytes_per_weight(kind: str, group_size: int = 64, dtype_bytes: int = 2, rows_of: int = 768) -> float:
    """Bytes one weight takes on the CPU as `kind`: `bf16` (the dtype's), `int8` (a byte, and an fp32 scale per
    output row of `rows_of` inputs), `int4` (half a byte, an fp32 scale and zero per group), `mlx<bits>` (bits/8,
    a bf16 scale and bias per group: mlx's affine format)."""
    if kind in ("bf16", "none"):
        return float(dtype_bytes)
    if kind == "int8":
        return 1.0 + 4.0 / rows_of
    if kind == "int4":
        return 0.5 + 8.0 / group_size
    if kind.startswith("mlx"):
        return int(kind[3:]) / 8 + 4.0 / group_size
    raise NpumoeError(f"unknown CPU storage {kind!r}: bf16, int8, int4, mlx<bits>")


def cpu_weight_bytes(size: ModelSize, cpu_weights: str | None = None, group_size: int = 64) -> tuple[int, int]:
    """(dense bytes, expert bytes) the CPU holds: the model as held, its experts re-stored as `cpu_weights` where a
    plan or `--cpu-weights` says (int8 / int4 of full-width experts)."""
    dense = size.weight_bytes - size.expert_bytes
    if not cpu_weights or cpu_weights == "bf16" or size.storage != "bf16":
        return dense, size.expert_bytes
    rate = storage_bytes_per_weight(cpu_weights, group_size, size.dtype_bytes, size.hidden)
    return dense, int(size.expert_weights * rate)


def model_size(record: ModelRecord) -> ModelSize:
    """The record's sizes in the dtype it computes in (an MLX folder: held packed), from its meta skeleton (a
    `random:` model: the model)."""
    d = torch.empty(0, dtype=record.compute_dtype).element_size()
    if record.gguf is not None:  # GGUF hook (issue 57): its matrices held packed as the reader holds them
        from dataclasses import replace

        from runtime.loading.gguf_reader import held_sizes
        weights, experts = held_sizes(record.gguf, d)
        return replace(ModelSize.of(record.skeleton, d), weight_bytes=weights, expert_bytes=experts,
                       storage="packed")
    return ModelSize.of_skeleton(record.skeleton, d, record.mlx)


def is_coreml_function(backend: str) -> bool:
    """Groups on this backend are Core ML functions held in a package (the backends with the ANE's limits)."""
    return registry.get(backend).limits is not None


def simulated_functions(fallbacks: dict[str, str]) -> bool:
    """A run's Core ML groups run on a host stand-in (an executor's `fallbacks`: planned backend -> the one used)."""
    return any(is_coreml_function(name) for name in fallbacks)


def ane_package_bytes(plan: Plan, simulated: bool = False) -> int:
    """Bytes of the plan's ANE packages: each distinct (layer, expert) of an `ane` group once, as its group
    compresses it. `simulated`: the ane groups run on the host's simulator instead, which holds every one of those
    experts decompressed in fp16."""
    h, f = plan.model.hidden_size, plan.model.expert_ffn_size
    stored: dict[tuple[int, int], int] = {}
    for lp in plan.layers:
        for g in lp.groups:
            if is_coreml_function(g.backend):
                for e in g.experts:
                    stored[(lp.layer, e)] = ane_limits.expert_weight_bytes(h, f, "none" if simulated else
                                                                           g.compression)
    return sum(stored.values())


def simulated_expert_bytes(plans: list[Plan]) -> int:
    """What one host simulator (`runtime.coreml.ane_sim`, one per gate round) holds for `plans` together: each
    distinct (layer, expert, compression) of their ane groups once, decompressed in fp16 (candidates that share an
    expert as stored share its weights)."""
    if not plans:
        return 0
    held = {(lp.layer, e, g.compression) for p in plans for lp in p.layers for g in lp.groups
            if is_coreml_function(g.backend) for e in g.experts}
    return len(held) * ane_limits.expert_weight_bytes(plans[0].model.hidden_size, plans[0].model.expert_ffn_size,
                                                      "none")


def dense_function_bytes(plan: Plan, size: ModelSize, simulated: bool = False) -> int:
    """Bytes of the plan's dense functions on a Core ML backend, in its packages: each placed function's matrices as
    its `compress` stores them (vectors, a few KB, left out). `simulated`: on the host's simulator instead, which
    holds them in fp32 (runtime/coreml/dense_sim.py). The attention core holds no weights."""
    if plan.dense is None or not size.dense_function_weights:
        return 0
    total = 0
    for dl in plan.dense.layers:
        for placed, weights in zip((dl.qkv, dl.o_proj, dl.mlp), size.dense_function_weights[dl.layer]):
            if placed is not None and is_coreml_function(placed.backend):
                total += weights * (4 if simulated else ane_limits.BYTES_PER_WEIGHT[placed.compression])
    return int(total)


def moe_call_bytes(size: ModelSize, chunk_tokens: int, plans: Sequence[Plan] = (),
                   ane_simulated: bool = False) -> int:
    """What one chunk's MoE call holds at its peak (`runtime.executor.LayerExecutor._chunk`), in the layer of
    `plans` where it holds the most (none: every assignment on the exact path); `ane_simulated`: their Core ML groups
    run on the host's simulator, on the CPU. The exact path: every assignment's row, its gate/up and down (`chunk x
    top-k` rows; a short chunk runs whole there too). Static groups: the chunk's output and the groups' rows packed
    in one buffer; the groups run one after another, each call's output kept until all are concatenated, so beside
    those the peak holds all the outputs and their concatenation, or the other groups' outputs and the largest
    group's call (its rows in fp32, its experts' outputs and their concatenation: ane-sim's; an ANE function's fp16
    buffers and cpu-static's take less), or the concatenation while the exact path takes the rows the groups do not
    (experts outside them, overflow spilled from a slice shorter than the chunk; beside the groups instead where a
    call runs off the CPU). Measured (malloc's bytes in use, tests/test_memory.py), every expert on ane-sim padded
    to the chunk: this is 0.98x the measured on tiny-moe in bf16, 1.00x in float32, where every padded slot's
    gate/up and down priced at once (the price before) read 1.48x and 1.63x; 1.00x (before: 1.03x) at
    Qwen3-30B-A3B's expert shape (2048 x 768, bf16)."""
    h, d = size.hidden, size.dtype_bytes
    exact = chunk_tokens * size.top_k * (2 * h + 3 * size.expert_ffn) * d
    peak, out = exact, chunk_tokens * h * d
    for plan in plans:
        for lp in plan.layers:
            if not lp.groups:
                continue
            packed, largest = sum(g.slots for g in lp.groups) * h * d, max(g.slots for g in lp.groups)
            calls = max(2 * packed, packed - largest * h * d + GROUP_CALL_BYTES * largest * h)
            spills = plan.overflow == "spill" and min(c for g in lp.groups for c in g.capacities) < plan.chunk_tokens
            rest = exact if lp.cpu_exact or spills else 0
            beside = rest if _overlaps(plan, lp, ane_simulated) else 0
            peak = max(peak, out + packed + max(calls + beside, packed + rest))
    return peak


def _overlaps(plan: Plan, lp: LayerPlan, ane_simulated: bool) -> bool:
    """The layer's exact path runs beside its groups (the executor's `overlap`): a call of either runs off the CPU."""
    names = {plan.exact_path, *(lp.exact_split or {})}
    names |= {g.backend for g in lp.groups if not (ane_simulated and is_coreml_function(g.backend))}
    return any(registry.get(name).overlaps_cpu for name in names)


def activation_bytes(size: ModelSize, chunk_tokens: int, prompt_tokens: int, moe_bytes: int | None = None,
                     logits_rows: int = 1, chunk_logits: int = 1) -> int:
    """One chunk's working set in one decoder layer, plus the logits: hidden-state buffers, q/k/v, attention
    scores (fp32, the chunk against the cache), the MoE call (`moe_bytes`: `moe_call_bytes` of a plan's groups;
    default every assignment on the exact path), `chunk_logits` chunks' logits in the model's dtype (0: the decoder
    stack alone, as calibrate runs it) and `logits_rows` fp32 logits. Packed weights add what one call dequantizes:
    an expert, and a block of a packed matrix (`runtime.cpu.quantized`)."""
    c, d = chunk_tokens, size.dtype_bytes
    hidden = HIDDEN_BUFFERS * c * size.hidden * d
    qkv = c * (size.heads + 2 * size.kv_heads) * size.head_dim * d
    scores = 4 * size.heads * c * max(c, prompt_tokens)  # the last chunk attends to the whole prompt
    logits = chunk_logits * c * size.vocab * d + 4 * logits_rows * size.vocab
    dequantized = (3 * size.hidden * size.expert_ffn + BLOCK_WEIGHTS) * d if size.storage != "bf16" else 0
    moe = moe_call_bytes(size, c) if moe_bytes is None else moe_bytes
    return int(hidden + qkv + scores + moe + logits + dequantized)


@dataclass(frozen=True)
class MemoryPrediction:
    """The parts of a plan's predicted peak memory, in bytes."""
    cpu_weights: int
    ane_packages: int
    activations: int
    kv_cache: int
    runtime: int
    chunk_tokens: int
    prompt_tokens: int
    cpu_experts: int = 0  # of cpu_weights: the experts, in the CPU storage
    cpu_storage: str = "bf16"
    cpu_copy_of_ane_resident: int = 0  # of cpu_experts: the ANE-resident experts' one CPU copy
    transient: int = 0  # a moment of its own (never beside the activations) past the other parts' peak
    terms: tuple[tuple[str, int], ...] = ()  # the parts as a stage's memory trace names them (search: `gate_terms`)

    @property
    def total(self) -> int:
        return self.cpu_weights + self.ane_packages + self.activations + self.kv_cache + self.runtime + self.transient

    @property
    def fixed(self) -> int:
        """Everything but the ANE packages: what any plan of this chunk and prompt length needs."""
        return self.total - self.ane_packages

    def to_json(self) -> dict:
        parts = {"cpu_weights_bytes": self.cpu_weights, "ane_package_bytes": self.ane_packages,
                 "activations_bytes": self.activations, "kv_cache_bytes": self.kv_cache,
                 "runtime_bytes": self.runtime, **({"transient_bytes": self.transient} if self.transient else {}),
                 **({"terms_bytes": dict(self.terms)} if self.terms else {})}
        return {"total_gb": round(self.total / GB, 4), "total_bytes": self.total, **parts,
                "cpu_dense_bytes": self.cpu_weights - self.cpu_experts, "cpu_expert_bytes": self.cpu_experts,
                "cpu_storage": self.cpu_storage, "cpu_copy_of_ane_resident_bytes": self.cpu_copy_of_ane_resident,
                "one_copy": "each ANE-resident expert is held by the CPU once, in the CPU storage "
                            f"({self.cpu_storage}), never also at full width",
                "chunk_tokens": self.chunk_tokens, "prompt_tokens": self.prompt_tokens,
                "label": "predicted peak memory (autotune/costing/memory.py): CPU-side weights + ANE packages "
                         "(unified memory on a Mac) + one chunk's activations + KV cache at prompt_tokens + the "
                         "runtime"}

    def describe(self) -> str:
        return (f"{self.total / GB:.2f} GB predicted (CPU-side weights {self.cpu_weights / GB:.2f}, ANE packages "
                f"{self.ane_packages / GB:.2f}, activations {self.activations / GB:.3f}, KV cache at "
                f"{self.prompt_tokens} tokens {self.kv_cache / GB:.3f}, runtime {self.runtime / GB:.2f})")


def runs_mlx_exact(plans: list[Plan]) -> bool:
    """Some plan runs experts on mlx-exact (its exact path, or a layer's exact_split)."""
    return any(p.exact == MLX_EXACT or any(MLX_EXACT in (lp.exact_split or {}) for lp in p.layers) for p in plans)


def mlx_widen_bytes(size: ModelSize, plans: list[Plan]) -> int:
    """What one mlx-exact call holds past its rows where they compute in float32 (MLX's CPU device, off a Mac:
    `runtime/mlx/mlx_exact.py` `_Full`): one projection's used experts widened to float32, WIDEN_BYTES of them at
    a time (at most a layer's fused gate and up), and the full-width experts taken to make them. Packed experts
    dequantize inside gather_qmm: none."""
    if sys.platform == "darwin" or size.storage != "bf16" or not runs_mlx_exact(plans) or not size.experts_per_layer:
        return 0
    per_expert = 4 * 2 * size.expert_ffn * size.hidden  # fused gate and up, float32
    widened = min(max(1, WIDEN_BYTES // per_expert), size.experts_per_layer) * per_expert
    return widened + widened * size.dtype_bytes // 4


def mlx_move_bytes(size: ModelSize, plans: list[Plan]) -> int:
    """The transient of moving torch's experts into MLX's memory where a plan's exact path is mlx-exact on torch's
    model (`runtime/mlx/mlx_exact.py` `_held`): its largest tensor is held twice until torch's copy is dropped, one
    layer's fused gate and up at full width (2/3 of its experts; measured on the Qwen3-30B-A3B twin in bf16: peak
    RSS +790 MB for 805 MB), a packed projection's codes otherwise (1/3)."""
    if not runs_mlx_exact(plans) or not size.experts_per_layer:
        return 0
    moe_layers = size.expert_weights // max(1, size.experts_per_layer * 3 * size.hidden * size.expert_ffn)
    per_layer = size.expert_bytes // max(1, moe_layers)
    return per_layer * (2 if size.storage == "bf16" else 1) // 3


def predict_memory(plan: Plan, size: ModelSize, prompt_tokens: int, logits_rows: int = 1,
                   ane_simulated: bool = False, chunk_logits: int = 1) -> MemoryPrediction:
    """A plan's predicted peak memory for prompts of `prompt_tokens` (`logits_rows`, `chunk_logits`: see
    `activation_bytes`; `ane_simulated`: see `ane_package_bytes`)."""
    chunk = min(plan.chunk_tokens, prompt_tokens)
    kind = plan.cpu_weights.kind if plan.cpu_weights else None
    group = (plan.cpu_weights.group_size if plan.cpu_weights else None) or 64
    dense, experts = cpu_weight_bytes(size, kind, group)
    storage = size.storage if size.storage != "bf16" or not kind else (f"int4-g{group}" if kind == "int4" else kind)
    resident = {(lp.layer, e) for lp in plan.layers for g in lp.groups if is_coreml_function(g.backend)
                for e in g.experts}
    per_expert = experts / max(1, size.expert_weights) * 3 * size.hidden * size.expert_ffn
    return MemoryPrediction(dense + experts, ane_package_bytes(plan, ane_simulated) +
                            dense_function_bytes(plan, size, ane_simulated),
                            activation_bytes(size, chunk, prompt_tokens,
                                             moe_call_bytes(size, chunk, [plan], ane_simulated), logits_rows,
                                             chunk_logits),
                            size.kv_bytes_per_token * prompt_tokens, RUNTIME_BYTES, chunk, prompt_tokens,
                            experts, storage, int(len(resident) * per_expert))


def predicted_memory_gb(plan: Plan, size: ModelSize, prompt_tokens: int) -> float:
    """The plan's predicted peak memory in GB (10^9 bytes)."""
    return predict_memory(plan, size, prompt_tokens).total / GB


def fixed_memory(size: ModelSize, chunk_tokens: int, prompt_tokens: int, cpu_weights: str | None = None,
                 group_size: int = 64) -> MemoryPrediction:
    """The memory any plan needs at this chunk and prompt length before an expert is resident on the ANE (its
    experts on the CPU in `cpu_weights` storage where given)."""
    chunk = min(chunk_tokens, prompt_tokens)
    dense, experts = cpu_weight_bytes(size, cpu_weights, group_size)
    return MemoryPrediction(dense + experts, 0, activation_bytes(size, chunk, prompt_tokens),
                            size.kv_bytes_per_token * prompt_tokens, RUNTIME_BYTES, chunk, prompt_tokens, experts,
                            size.storage if size.storage != "bf16" or not cpu_weights else cpu_weights)


def ane_budget_bytes(memory_gb: float, size: ModelSize, chunk_tokens: int, prompt_tokens: int,
                     cpu_weights: str | None = None, group_size: int = 64) -> float:
    """What a budget of `memory_gb` leaves for ANE packages; refuses a budget no plan can meet."""
    fixed = fixed_memory(size, chunk_tokens, prompt_tokens, cpu_weights, group_size)
    left = memory_gb * GB - fixed.total
    if left < 0:
        raise NpumoeError(f"--memory-gb {memory_gb:g} is below what any plan needs: {fixed.describe()}; give "
                          f"--memory-gb {fixed.total / GB:.2f} or more")
    return left


def against_measured(plan: Plan, model: torch.nn.Module, prompt_tokens: int, measured_bytes: int,
                     logits_rows: int = 1, ane_simulated: bool = False, chunk_logits: int = 1) -> dict:
    """A run's measured peak RSS next to the plan's prediction for that same run (its prompt length, the logits
    it keeps, where its ane groups ran): what `run --json` and `generate --json` report as `memory`."""
    return beside_measured(predict_memory(plan, ModelSize.of(model), prompt_tokens, logits_rows, ane_simulated,
                                          chunk_logits), measured_bytes)


def beside_measured(predicted: MemoryPrediction, measured_bytes: int) -> dict:
    """A process's measured peak RSS next to its predicted peak (`memory` in `run`, `generate`, `calibrate`)."""
    return {"measured_peak_rss_gb": round(measured_bytes / GB, 4), "predicted_gb": round(predicted.total / GB, 4),
            "predicted_over_measured": round(predicted.total / measured_bytes, 4),
            "measured": "peak resident set size of this process (ru_maxrss)", "predicted": predicted.to_json()}


COMPARED_ROWS = 64  # positions whose fp32 logits the fidelity comparison holds at once (evaluation/fidelity.ROWS)


def stage_memory(size: ModelSize, stage: str, chunk_tokens: int, prompt_tokens: int, tokens: int = 0,
                 gate_candidates: int = 1, plan: Plan | list[Plan] | None = None) -> MemoryPrediction:
    """The predicted peak of a stage that runs the model without a plan of its own, or besides one:

    - `calibrate`: the decoder stack alone per chunk (routing is all it records: no logits), and the traces of
      `tokens` tokens it keeps (per MoE layer and token: top-k expert ids as int16 and weights as fp32, a norm);
    - `search`, its fidelity gate (`_gate_memory`): the unmodified model and `gate_candidates` plans side by side
      over each prompt, each with its own KV cache, the reference's chunk of logits and one candidate's at a time,
      COMPARED_ROWS positions of fp32 logits and log-probabilities at a time; the MoE call of `plan`'s padded groups
      (`moe_call_bytes`; the written plan, where known, or a gate round's candidates, measured side by side: the
      largest of their calls) and
      its ane groups and dense functions on the host's simulator (experts in fp16, each distinct one of a round
      once; dense matrices in fp32, a round's together: a bound); where a candidate runs mlx-exact, the
      experts held once (in MLX's memory, torch reading a view), a block widened per call, and their move; where
      torch's matmuls go through oneDNN (`ModelSize.onednn`), its caches of compiled primitives full: the gate's
      thousands of expert calls of every row count fill them in its first prompt (`allocator.primitive_cache_bytes`).

    `run` and `generate` are a plan's own prediction (`predict_memory`)."""
    chunk = min(chunk_tokens, prompt_tokens)
    plans = plan if isinstance(plan, list) else [plan] if plan is not None else []
    storage = plans[0].cpu_weights if plans else None  # a round's candidates share the CPU's storage
    dense, experts = cpu_weight_bytes(size, storage.kind if storage else None, (storage.group_size if storage
                                                                                else None) or 64)
    kv = size.kv_bytes_per_token * prompt_tokens
    if stage == "calibrate":
        activations = activation_bytes(size, chunk, prompt_tokens, logits_rows=0, chunk_logits=0)
        layers_moe = size.layers if size.experts_per_layer else 0
        activations += tokens * layers_moe * (size.top_k * (2 + 4) + 4)
        return MemoryPrediction(dense + experts, 0, activations, kv, RUNTIME_BYTES, chunk, prompt_tokens, experts,
                                size.storage)
    if stage == "search":
        return _gate_memory(size, chunk, prompt_tokens, gate_candidates, plans, dense, experts)
    raise NpumoeError(f"stage {stage!r}: calibrate or search (run and generate: predict_memory of the plan)")


def _gate_memory(size: ModelSize, chunk: int, prompt_tokens: int, candidates: int, plans: list[Plan], dense: int,
                 experts: int) -> MemoryPrediction:
    """The search stage's peak (`stage_memory`), with its terms named as the gate's memory trace finds them."""
    sides = 1 + candidates
    layer = activation_bytes(size, chunk, prompt_tokens, moe_call_bytes(size, chunk, plans, ane_simulated=True),
                             logits_rows=0, chunk_logits=0)
    # the reference's chunk of logits and one candidate's (evaluation/fidelity.py compares one at a time); fp32
    # rows alive at the KL: the reference's logits and log-probabilities, the candidate's, and the KL's three
    # temporaries (exp, difference, product)
    logits, rows = 2 * chunk * size.vocab * size.dtype_bytes, 4 * 7 * COMPARED_ROWS * size.vocab
    widen = mlx_widen_bytes(size, plans)
    ane = simulated_expert_bytes(plans) + sum(dense_function_bytes(p, size, simulated=True) for p in plans)
    kv = sides * size.kv_bytes_per_token * prompt_tokens
    # the move into MLX's memory peaks while the executors are built, before any comparison (each layer's exact
    # path before its groups: the simulator's weights of the layers before it beside it): a moment of its own
    move = mlx_move_bytes(size, plans)
    before = ane * (size.layers - 1) // max(1, size.layers)
    transient = max(0, move + before - (ane + layer + logits + rows + widen + kv))
    caches = primitive_cache_bytes() if size.onednn else 0
    terms = (("dense_weights", dense), ("experts_held_once", experts), ("ane_sim_weights", ane),
             ("layer_working_set", layer), ("logits_reference_and_one_candidate", logits),
             ("compared_rows_fp32", rows), ("mlx_widened_block", widen), ("kv_caches_every_side", kv),
             ("mlx_move_moment", move), ("onednn_primitive_caches", caches), ("runtime", RUNTIME_BYTES))
    return MemoryPrediction(dense + experts, ane, layer + logits + rows + widen, kv, RUNTIME_BYTES + caches, chunk,
                            prompt_tokens, experts, size.storage, transient=transient, terms=terms)
