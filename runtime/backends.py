"""Backends: one small protocol, several implementations (like Optuna's samplers).

A static backend turns a group of experts into a callable over a packed buffer of fixed shape
`[sum(capacities), H]` (expert i owns rows `offsets[i]:offsets[i+1]`). The exact path runs variable-size
per-expert batches with no padding. `cpu-static` is the reference for what an ANE graph computes.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger("npumoe")

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


class StaticBackend(Protocol):
    """What a static backend implements (docs/backends.md). Lifecycle, for one `PlanExecutor`:
    `available()` once, then `prepare()` once per planned group, both on the installing thread before the first
    forward pass; then the prepared functions, once per group per chunk, on the forward pass's thread."""

    name: str  # the name plans use (`Group.backend`) and run statistics count under
    overlaps_cpu: bool  # True when calls run off the CPU: the chunk's exact path then runs meanwhile on a worker

    def available(self) -> tuple[bool, str]:
        """(usable on this host, why): called once when a plan is installed, before any `prepare`. Cheap, and
        never raises for a missing platform: False makes the runtime run the groups on cpu-static, said once."""
        ...

    def prepare(self, group: GroupSpec) -> GroupFn:
        """The group's function over a packed buffer `[sum(capacities), H]` -> outputs of the same shape (expert i
        owns rows offsets[i]:offsets[i+1]; padding rows are zeros and their outputs are ignored). Loading,
        compiling and weight conversion belong here, not in the call. The function is called from the forward
        pass's thread while the exact path may run on another thread, never from two threads at once."""
        ...


def expert_ffn(module: torch.nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
    """One expert's gated FFN, exactly as transformers computes it (weights are views, never copied)."""
    h = module._apply_gate(F.linear(x, module.gate_up_proj[expert]))
    return F.linear(h, module.down_proj[expert])


class CpuStaticBackend:
    """Padded static slices run by torch: the same shapes an ANE function has, one call per group."""
    name = "cpu-static"
    overlaps_cpu = False

    def available(self) -> tuple[bool, str]:
        return True, "torch on the CPU"

    def prepare(self, group: GroupSpec) -> GroupFn:
        module, experts, caps = group.module, group.experts, list(group.capacities)

        def run(packed: torch.Tensor) -> torch.Tensor:
            return torch.cat([expert_ffn(module, e, x) for e, x in zip(experts, packed.split(caps))])

        return run


def run_exact(module: torch.nn.Module, x_sorted: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
    """The cpu-exact path: rows of `x_sorted` are grouped by expert (`counts[i]` rows for `experts[i]`)."""
    return torch.cat([expert_ffn(module, e, x) for e, x in zip(experts, x_sorted.split(counts))])


_STATIC_BACKENDS: dict[str, Callable[[], StaticBackend]] = {"cpu-static": CpuStaticBackend}
# Built-in backends in their own modules register on first use, so a plain import stays light.
_BUILTIN_MODULES = {"ane": "runtime.coreml.ane"}


def register_static_backend(name: str, factory: Callable[[], StaticBackend]) -> None:
    _STATIC_BACKENDS[name] = factory


def registered_static_backends() -> dict[str, Callable[[], StaticBackend]]:
    """Every static backend a plan can name, by name, built-in ones included (their modules imported)."""
    for name, module in _BUILTIN_MODULES.items():
        if name not in _STATIC_BACKENDS:
            importlib.import_module(module)
    return dict(_STATIC_BACKENDS)


def resolve_static_backend(name: str, instances: dict[str, StaticBackend] | None = None) -> StaticBackend:
    """The backend to run `name` on: the given or registered one if available, else `cpu-static` (said once)."""
    backend = (instances or {}).get(name)
    if backend is None and name not in _STATIC_BACKENDS and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if backend is None and name in _STATIC_BACKENDS:
        backend = _STATIC_BACKENDS[name]()
    reason = f"backend {name!r} is not implemented here"
    if backend is not None:
        ok, reason = backend.available()
        if ok:
            return backend
    log.warning("plan names backend %r but it is unavailable (%s): running its groups on cpu-static", name, reason)
    return CpuStaticBackend()
