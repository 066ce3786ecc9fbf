"""Each mlx-lm MoE block's experts (`switch_mlp`) as the plan's block, on the block's own weights.

mlx-lm's block computes its router and then `y = switch_mlp(x, inds)`, `(y * scores[..., None]).sum(axis=-2)` (every
family it writes: Qwen3Moe, Qwen2Moe, Olmoe, Mixtral, PhiMoE). The spine replaces `switch_mlp` only, so the router
is mlx-lm's own code, whatever the family:
- `CountedSwitch` (a layer with no static group, every expert on mlx-exact): mlx-lm's own `switch_mlp`, unchanged,
  its assignments counted after the forward is evaluated (no sync inside the graph).
- `PlannedSwitch` (any other layer): returns `Assignments`, whose product with the router weights and sum over k
  run the plan through the torch spine's `LayerExecutor` (one accounting for both spines) on zero-copy torch views.
`SwitchExactPath` is mlx-exact on the spine: mlx-lm's `gather_qmm` / `gather_mm` projections on the block's own
weights (no second copy); `torch_experts` is the torch experts module the static backends and cpu-exact read, its
weights views of MLX's memory."""
from __future__ import annotations

import threading
from contextlib import nullcontext

import mlx.core as mx
import numpy as np
import torch

from runtime.cpu.quantized import PackedWeight, QuantizedExperts
from runtime.errors import NpumoeError
from runtime.executor import LayerExecutor
from runtime.mlx.formats import NAME
from runtime.mlx.mlx_exact import TORCH_DTYPES, crossed, sorted_inputs, step_inputs, to_mx, to_torch, torch_view
from runtime.stats import LayerStats


class SplitExperts(torch.nn.Module):
    """Full-width experts as mlx-lm holds them (gate and up [E, F, H], down [E, H, F]), viewed by torch: each call
    of `expert` joins one expert's gate and up (a copy of that expert only; the static backends read it once)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate, self.up, self.down = gate, up, down

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.gate[e], self.up[e]]).to(dtype), self.down[e].to(dtype)

    def kernel(self, rows: int) -> str:
        return "dequant"

    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down))


def torch_experts(switch, layer: int, check: bool = True) -> torch.nn.Module:
    """A torch experts module over `switch`'s weights (views of MLX's memory, no copy): what `GroupSpec.module` and
    cpu-exact read (`npumoe_weights`, `act_fn`, the widths). `check`: refuse experts torch would compute otherwise
    (a layer mlx-lm's own switch_mlp runs wholly needs no torch form)."""
    if check and (type(switch.activation).__name__ != "SwiGLU" or "bias" in switch.gate_proj):
        raise NpumoeError(f"layer {layer}: mlx-lm's experts here are not a bias-free SwiGLU; the MLX spine runs "
                          "them on mlx-exact only (plan-template --exact mlx-exact, no groups)")
    projections = (switch.gate_proj, switch.up_proj, switch.down_proj)
    module = torch.nn.Module()
    if hasattr(switch.gate_proj, "scales"):
        module.npumoe_weights = QuantizedExperts(*(
            PackedWeight(torch_view(p.weight), torch_view(p.scales), torch_view(p.biases), p.bits, p.group_size)
            for p in projections))
    else:
        module.npumoe_weights = SplitExperts(*(torch_view(p.weight) for p in projections))
    module.act_fn = torch.nn.SiLU()
    module.num_experts = int(switch.gate_proj.weight.shape[0])
    # a packed row holds `bits`-wide codes in 32-bit words
    module.intermediate_dim = int(switch.down_proj.weight.shape[-1]) * 32 // getattr(switch.down_proj, "bits", 32)
    module.hidden_dim = int(switch.down_proj.weight.shape[-2])
    module.switch = switch  # the spine's mlx-exact runs the block's own projections
    return module


def switch_ffn(switch, x: mx.array, idx: mx.array, sorted_indices: bool) -> mx.array:
    """mlx-lm's SwitchGLU over rows `x` [R, 1, H] already gathered per assignment (expert ids `idx` [R])."""
    up = switch.up_proj(x, idx, sorted_indices=sorted_indices)
    gate = switch.gate_proj(x, idx, sorted_indices=sorted_indices)
    return switch.down_proj(switch.activation(up, gate), idx, sorted_indices=sorted_indices)


class SwitchExactLayer:
    """mlx-exact on the spine: a layer's exact assignments through the block's own `switch_mlp` projections."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.switch = module.switch
        self.lanes = None  # two chunks in flight (`runtime.mlx.overlap.Lanes`): the host lane around each call

    def run(self, x_sorted: torch.Tensor, experts: list[int], counts: list[int],
            stats: LayerStats | None = None) -> torch.Tensor:
        def compute(x: mx.array, idx: mx.array) -> mx.array:
            return switch_ffn(self.switch, x, idx, sorted_indices=True)[:, 0, :].astype(x.dtype)

        # one chunk at a time, no lock: the thread that runs the forward waits for this call (its static groups are
        # torch); two in flight, the host lane (the other chunk's thread builds MLX work meanwhile)
        return crossed(lambda: sorted_inputs(x_sorted, experts, counts), compute, x_sorted.dtype, stats,
                       nullcontext() if self.lanes is None else self.lanes.host())

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                stats: LayerStats | None = None) -> torch.Tensor:
        """A decode step: mlx-lm's SwitchGLU on every assignment, router-weighted and summed in MLX."""
        def compute(xm: mx.array, idx: mx.array, w: mx.array) -> mx.array:
            return (self.switch(xm, idx) * w[..., None]).sum(axis=-2).astype(xm.dtype)

        return crossed(lambda: step_inputs(x, top_k_index, top_k_weights), compute, x.dtype, stats, nullcontext())


class SwitchExactPath:
    """The exact path `mlx-exact` as the spine runs it (`SwitchExactLayer`); its registry entry's facts."""
    name = NAME
    overlaps_cpu = True

    def available(self) -> tuple[bool, str]:
        return True, "mlx-lm's own experts on the MLX spine"

    def prepare(self, module: torch.nn.Module) -> SwitchExactLayer:
        return SwitchExactLayer(module)


def fast_layer(layer_plan, plan) -> bool:
    """A layer whose every assignment runs on mlx-exact with no static group: mlx-lm's own switch_mlp runs it."""
    return not layer_plan.groups and not layer_plan.exact_split and plan.exact_path == NAME \
        and plan.cpu_weights is None


class CountedSwitch:
    """mlx-lm's own `switch_mlp` for a layer all on mlx-exact; each call's expert ids kept (`take`), counted once
    the forward is evaluated (`count`: `LayerExecutor.count_exact`, the torch spine's accounting). `timer`: the
    spine's part timer (`spine._Timer`), which times the call in a timed pass. The ids are kept per thread: a server
    prefills on one thread while it decodes on another, and each thread's arrays are evaluated on its own stream."""

    def __init__(self, switch, layer: LayerExecutor, timer) -> None:
        self.switch, self.layer, self.timer = switch, layer, timer
        self._local = threading.local()

    @property
    def pending(self) -> list[mx.array]:
        """The calling thread's expert ids not counted yet."""
        if not hasattr(self._local, "pending"):
            self._local.pending = []
        return self._local.pending

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        self.pending.append(inds)
        if not self.timer.timing or self.timer.pruning:  # a pruned layer's experts: built, never computed
            return self.switch(x, inds)
        y, seconds = self.timer.time("experts", self.switch, x, inds)
        self.layer.stats.seconds_per_backend[NAME] += seconds
        return y

    def take(self) -> list[mx.array]:
        """The calling thread's calls kept since the last take (their ids, maybe not evaluated yet)."""
        inds, self._local.pending = self.pending, []
        return inds

    def count(self, calls: list[mx.array]) -> None:
        """Count taken calls (`take`) once their forward is evaluated."""
        for inds in calls:
            self.layer.count_exact(np.asarray(inds).reshape(-1, inds.shape[-1]))


class PlannedSwitch:
    """A layer with static groups (or exact paths beside mlx-exact): the block's router weights meet its
    assignments in `Assignments`, where the plan runs."""

    def __init__(self, switch, layer: LayerExecutor, timer) -> None:
        self.switch, self.layer, self.timer = switch, layer, timer
        self.lanes = None  # two chunks in flight (`runtime.mlx.overlap.Lanes`): the plan's layer runs off the host lane

    def __call__(self, x: mx.array, inds: mx.array) -> Assignments:
        return Assignments(self, x, inds)

    def combine(self, x: mx.array, inds: mx.array, scores: mx.array) -> mx.array:
        """The router-weighted sum over each token's experts, as the plan runs them (timed in a timed pass)."""
        mx.eval(x, inds, scores)
        if not self.timer.timing:
            return self._combine(x, inds, scores)
        return self.timer.time("experts", self._combine, x, inds, scores)[0]

    def _combine(self, x: mx.array, inds: mx.array, scores: mx.array) -> mx.array:
        """`LayerExecutor` on torch views of the evaluated rows and weights (no copy), its output copied back."""
        h = x.shape[-1]
        xt = to_torch(x.reshape(-1, h), TORCH_DTYPES[x.dtype])
        idx = torch.from_numpy(np.asarray(inds).reshape(-1, inds.shape[-1]).astype(np.int64))
        w = to_torch(scores.reshape(-1, inds.shape[-1]), TORCH_DTYPES[scores.dtype])
        with torch.inference_mode(), nullcontext() if self.lanes is None else self.lanes.off_host():
            y = self.layer(xt, idx, w)
        return to_mx(y).reshape(*x.shape[:-1], h)


class Assignments:
    """What `PlannedSwitch` gives mlx-lm's block in place of the experts' outputs: the block's next steps, `y *
    scores[..., None]` and `.sum(axis=-2)`, hand the router weights to the plan. Anything else a block does with it
    is refused: that family combines its experts another way."""

    def __init__(self, planned: PlannedSwitch, x: mx.array, inds: mx.array) -> None:
        self.planned, self.x, self.inds = planned, x, inds
        self.dtype = x.dtype

    def __mul__(self, scores: mx.array) -> _Weighted:
        if scores.shape[-1] != 1 or scores.shape[:-1] != self.inds.shape:
            self._refuse()
        return _Weighted(self, scores[..., 0])

    def __getattr__(self, name: str):
        self._refuse()

    def _refuse(self):
        raise NpumoeError("this mlx-lm MoE block combines its experts' outputs in a way the MLX spine does not "
                          "know; run it with --engine torch")


class _Weighted:
    def __init__(self, assignments: Assignments, scores: mx.array) -> None:
        self.a, self.scores = assignments, scores

    def sum(self, axis: int) -> mx.array:
        if axis not in (-2, len(self.a.inds.shape) - 1):
            self.a._refuse()
        return self.a.planned.combine(self.a.x, self.a.inds, self.scores)

