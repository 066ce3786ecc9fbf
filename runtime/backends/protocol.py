"""The static backend protocol (docs/backends.md): what a backend implements, what it is given, and the expert FFN
every torch backend computes. Public and stable: out-of-tree backends implement it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

GroupFn = Callable[[torch.Tensor], torch.Tensor]
# The exact path's compute: (experts module, rows grouped by expert, expert ids, rows per expert) -> outputs.
ExactFn = Callable[[torch.nn.Module, torch.Tensor, list[int], list[int]], torch.Tensor]


@dataclass(frozen=True)
class GroupSpec:
    """What a static backend needs to prepare one group: where it sits and which expert weights it uses."""
    layer: int
    index: int  # group index within the layer
    experts: tuple[int, ...]
    capacities: tuple[int, ...]
    module: torch.nn.Module  # the transformers experts module (fused gate_up_proj / down_proj, _apply_gate)
    compress: str = "none"  # how the group stores its weights on the ANE (the plan's `compress`; runtime.plan)


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


def expert_matrices(module: torch.nn.Module, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert `expert`'s (gate_up [2F, H], down [H, F]): views of the fused parameters, or dequantized from the
    packed weights of a quantized checkpoint (`runtime.quantized.QuantizedExperts`, `module.npumoe_weights`)."""
    packed = getattr(module, "npumoe_weights", None)
    if packed is not None:
        return packed.expert(expert, dtype)
    return module.gate_up_proj[expert], module.down_proj[expert]


def expert_ffn(module: torch.nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
    """One expert's gated FFN, exactly as transformers computes it (weights are views, never copied); packed
    storage that has its own kernels (`runtime.cpu_weights`) runs them."""
    packed = getattr(module, "npumoe_weights", None)
    if hasattr(packed, "ffn"):
        return packed.ffn(module, expert, x)
    gate_up, down = expert_matrices(module, expert, x.dtype)
    return F.linear(module._apply_gate(F.linear(x, gate_up)), down)
