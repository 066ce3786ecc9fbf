"""The static backend protocol (docs/backends.md): what a backend implements, what it is given, and the expert FFN
every torch backend computes. Public and stable: out-of-tree backends implement it."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from runtime.stats import LayerStats

GroupFn = Callable[[torch.Tensor], torch.Tensor]
# A row-wise dense function: [rows, in] -> [rows, out]; the attention core: (q, k, v, allowed) -> out (DenseSpec).
DenseFn = Callable[..., torch.Tensor]
DENSE_KINDS = ("qkv", "o_proj", "mlp", "attention")
# The exact path's compute: (experts module, rows grouped by expert, expert ids, rows per expert) -> outputs.
ExactFn = Callable[[torch.nn.Module, torch.Tensor, list[int], list[int]], torch.Tensor]


@dataclass(frozen=True)
class GroupSpec:
    """What a static backend needs to prepare one group: where it sits and which expert weights it uses."""
    layer: int
    index: int  # group index within the layer
    experts: tuple[int, ...]
    capacities: tuple[int, ...]
    module: torch.nn.Module  # the transformers experts module (fused gate_up_proj / down_proj, act_fn)
    compress: str = "none"  # how the group stores its weights on the ANE (the plan's `compress`; runtime.plan)


@dataclass(frozen=True)
class DenseForm:
    """What differs between families in a dense function (runtime.dense.families reads it off the model)."""
    norm: str = "rms"  # the input norm of `qkv`: "rms" (RMSNorm) or "layer" (LayerNorm with bias: Phimoe)
    qk_norm: str | None = None  # RMSNorm of q and k: None, "head" (over each head: Qwen3Moe), "projection" (Olmoe)
    head_dim: int = 0
    shared_gate: bool = False  # `mlp` is a shared expert whose output carries its gate's logit (Qwen2Moe)
    act: str = "silu"  # the MLP's activation


@dataclass(frozen=True)
class DenseSpec:
    """One dense static function of a plan (`Plan.dense`). Row-wise kinds (`qkv`, `o_proj`, `mlp`) map a chunk
    `[rows, in]` (padded to `rows` = the plan's chunk; padding rows are zeros and their outputs ignored) to
    `[rows, out]`, computing what the transformers `modules` of `layer` compute:
    `qkv`: norm -> q, k, v (with q/k norms and biases) concatenated along the last axis (`splits` widths);
    `o_proj`: o; `mlp`: mlp (a dense MLP), or for a shared expert its output and its gate's logit concatenated.
    The attention core (`attention`, weight-free, shared by every layer: `layer` is -1) maps q `[heads, rows, d]`,
    k and v `[kv_heads, keys, d]` and a bool mask `[rows, keys]` (True: may attend) to `[heads, rows, d]`."""
    kind: str  # one of DENSE_KINDS
    layer: int
    rows: int
    modules: Mapping[str, torch.nn.Module] = field(default_factory=dict)  # by role: norm, q, k, v, q_norm, ...
    form: DenseForm = DenseForm()
    splits: tuple[int, ...] = ()  # widths of the concatenated outputs
    compress: str = "none"  # how the function stores its weights on the ANE (runtime.plan.COMPRESSIONS)
    keys: int = 0  # attention: the context bucket
    heads: int = 0
    kv_heads: int = 0
    scaling: float = 1.0

    @property
    def name(self) -> str:
        """The function's name in a package: per layer, or per shape for the weight-free attention core."""
        if self.kind == "attention":
            return f"attention_q{self.rows}_k{self.keys}"
        return f"layer{self.layer}_{self.kind}"


class StaticBackend(Protocol):
    """What a static backend implements (docs/backends.md). Lifecycle, for one `PlanExecutor`:
    `available()` once, then `prepare()` once per planned group, both on the installing thread before the first
    forward pass; then the prepared functions, once per group per chunk, on the forward pass's thread."""

    name: str  # the name plans use (`Group.backend`) and run statistics count under
    overlaps_cpu: bool  # True when calls run off the CPU: the chunk's exact path then runs meanwhile on a worker

    def available(self) -> tuple[bool, str]:
        """(usable on this host, why): called once when a plan is installed, before any `prepare`. Cheap, and
        never raises for a missing platform: False makes the runtime run the groups on the backend's fallback
        (cpu-static unless its registry entry says otherwise), said once."""
        ...

    def prepare(self, group: GroupSpec) -> GroupFn:
        """The group's function over a packed buffer `[sum(capacities), H]` -> outputs of the same shape (expert i
        owns rows offsets[i]:offsets[i+1]; padding rows are zeros and their outputs are ignored). Loading,
        compiling and weight conversion belong here, not in the call. The function is called from the forward
        pass's thread while the exact path may run on another thread, never from two threads at once."""
        ...

    # Optional: `prepare_dense(spec: DenseSpec) -> DenseFn`, a plan's dense function (runtime.dense). A backend
    # without it cannot run dense functions: they run on the first backend down its fallbacks that has it.


class ExactLayer(Protocol):
    """One layer's experts on an exact path (exact token counts, no padding, no drop), prepared by `ExactPath`.
    Both calls count what crossing to another runtime cost (`LayerStats.crossing_us`) in `stats` where given;
    they may run on the layer's exact-path worker while the static groups run on the forward pass's thread."""

    def run(self, x_sorted: torch.Tensor, experts: list[int], counts: list[int],
            stats: LayerStats | None = None) -> torch.Tensor:
        """Rows of `x_sorted` grouped by expert (`counts[i]` rows for `experts[i]`) -> their expert outputs."""
        ...

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                stats: LayerStats | None = None) -> torch.Tensor:
        """Every assignment of `x` [T, H] (a decode step): the router-weighted sum of its experts' outputs."""
        ...


class ExactPath(Protocol):
    """An exact path (a registry entry with `exact=True`, made by its factory): where a plan's experts in no group,
    its spilled assignments and its decode steps run (`Plan.exact`, `LayerPlan.exact_split`)."""

    name: str
    overlaps_cpu: bool  # computes off the CPU: the layer's exact work then runs on a worker beside the static calls

    def available(self) -> tuple[bool, str]:
        """(usable on this host, why); False runs the plan's work for it on its fallback (cpu-exact), said once."""
        ...

    def prepare(self, module: torch.nn.Module) -> ExactLayer:
        """The layer's experts ready to run (weights wrapped once, here, never per call); refuses (NpumoeError, one
        line) weights this path cannot run."""
        ...


def gated_activation(module: torch.nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up over the fused gate_up projection's output `[..., 2F]`: the gate transformers' experts
    implementations apply in every family the runtime runs (Qwen3Moe, Qwen2Moe, Mixtral, Olmoe, Phimoe; none
    overrides transformers' default; tests/test_backends.py checks it against transformers)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def expert_matrices(module: torch.nn.Module, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert `expert`'s (gate_up [2F, H], down [H, F]): views of the fused parameters, or dequantized from the
    packed weights of a quantized checkpoint (`runtime.cpu.quantized.QuantizedExperts`, `module.npumoe_weights`)."""
    packed = getattr(module, "npumoe_weights", None)
    if packed is not None:
        return packed.expert(expert, dtype)
    return module.gate_up_proj[expert], module.down_proj[expert]


def expert_ffn(module: torch.nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
    """One expert's gated FFN, exactly as transformers computes it (weights are views, never copied); packed
    storage that has its own kernels (`runtime.cpu.cpu_weights`) runs them."""
    packed = getattr(module, "npumoe_weights", None)
    if hasattr(packed, "ffn"):
        return packed.ffn(module, expert, x)
    gate_up, down = expert_matrices(module, expert, x.dtype)
    return F.linear(gated_activation(module, F.linear(x, gate_up)), down)


def _rows_norm(norm: torch.nn.Module, x: torch.Tensor, form: DenseForm, per_head: bool) -> torch.Tensor:
    """A q/k norm as transformers applies it: over each head (a view of `head_dim` columns), or the projection."""
    if not per_head:
        return norm(x)
    return norm(x.view(x.shape[0], -1, form.head_dim)).reshape(x.shape[0], -1)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                        scaling: float) -> torch.Tensor:
    """The attention core over padded keys as torch computes it (sdpa, grouped-query heads repeated)."""
    rep = q.shape[0] // k.shape[0]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0),
                                          attn_mask=allowed, scale=scaling)


def dense_reference(spec: DenseSpec) -> DenseFn:
    """A dense function exactly as transformers computes it: the model's own modules, in the model's dtype, through
    their class's forward (the runtime replaces the instances' forwards with the function itself)."""
    m = {role: type(module).forward.__get__(module) for role, module in spec.modules.items()}
    form = spec.form
    if spec.kind == "attention":
        return lambda q, k, v, allowed: attention_reference(q, k, v, allowed, spec.scaling)
    if spec.kind == "o_proj":
        return m["o"]
    if spec.kind == "mlp":
        if form.shared_gate:
            return lambda x: torch.cat([m["mlp"](x), m["gate"](x)], dim=-1)
        return m["mlp"]

    def qkv(x: torch.Tensor) -> torch.Tensor:
        h = m["norm"](x)
        q, k, v = m["q"](h), m["k"](h), m["v"](h)
        if form.qk_norm is not None:
            q = _rows_norm(m["q_norm"], q, form, form.qk_norm == "head")
            k = _rows_norm(m["k_norm"], k, form, form.qk_norm == "head")
        return torch.cat([q, k, v], dim=-1)

    return qkv
