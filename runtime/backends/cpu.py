"""The torch backends on the CPU: `cpu-static` (padded static slices, the reference an ANE function is checked
against and every backend's last fallback) and `cpu-exact` (the exact path: exact token counts, no padding, no
dropping; not a plan group's backend, always there)."""
from __future__ import annotations

import torch

from runtime.backends.protocol import DenseFn, DenseSpec, GroupFn, GroupSpec, dense_reference, expert_ffn
from runtime.backends.registry import EXACT, REFERENCE, BackendInfo


class CpuStaticBackend:
    """Padded static slices run by torch: the same shapes an ANE function has, one call per group."""
    name = REFERENCE
    overlaps_cpu = False

    def available(self) -> tuple[bool, str]:
        return True, "torch on the CPU"

    def prepare(self, group: GroupSpec) -> GroupFn:
        module, experts, caps = group.module, group.experts, list(group.capacities)

        def run(packed: torch.Tensor) -> torch.Tensor:
            return torch.cat([expert_ffn(module, e, x) for e, x in zip(experts, packed.split(caps))])

        return run

    def prepare_dense(self, spec: DenseSpec) -> DenseFn:
        """A dense function on the model's own modules, in its dtype: the exact reference (padded rows only)."""
        return dense_reference(spec)


def run_exact(module: torch.nn.Module, x_sorted: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
    """The cpu-exact path: rows of `x_sorted` are grouped by expert (`counts[i]` rows for `experts[i]`)."""
    return torch.cat([expert_ffn(module, e, x) for e, x in zip(experts, x_sorted.split(counts))])


BACKENDS = (
    BackendInfo(REFERENCE, CpuStaticBackend, fallback=None, cpu_torch=True),
    BackendInfo(EXACT, None, fallback=None, exact=True, cpu_torch=True),
)
