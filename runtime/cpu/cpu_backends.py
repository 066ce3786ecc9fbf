"""The torch backends on the CPU: `cpu-static` (padded static slices, the reference an ANE function is checked
against and every backend's last fallback) and `cpu-exact` (the exact path: exact token counts, no padding, no
dropping; not a plan group's backend, always there)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

from runtime.backends.protocol import DenseFn, DenseSpec, GroupFn, GroupSpec, dense_reference, expert_ffn
from runtime.backends.registry import EXACT, REFERENCE, BackendInfo

if TYPE_CHECKING:
    from runtime.stats import LayerStats

PACKED_IMPLEMENTATION = "npumoe-packed"  # the experts implementation of a model whose experts are packed


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


# Half-precision CPU matmuls run oneDNN's kernels, made for (and cached by) each row count: a call at a row count not
# seen before makes one first (measured on an AMX Xeon, bf16, one thread: 3.8 ms at a Qwen3-30B-A3B-width expert
# whose call then takes 2.9 ms, 22 ms at Phi-3.5-MoE's; float32 runs MKL, which makes none). A prefill's per-expert
# row counts are new chunk after chunk, so the exact path rounds them up to few sizes (`call_rows`), whose kernels
# stay cached; the rows past an expert's own are computed and dropped (each output row depends on its input row only).
SIZED_DTYPES = (torch.bfloat16, torch.float16)
EXACT_ROWS = 64  # up to here every row count runs as it is (few sizes); past it, eight sizes per octave


def call_rows(rows: Any) -> Any:
    """The rows a half-precision exact-path call runs for `rows` rows of an expert: `rows` up to EXACT_ROWS, else
    rounded up to a multiple of an eighth of its octave (at most 12.5% more rows); int or ndarray."""
    m = np.asarray(rows, dtype=np.int64)
    octave = np.floor(np.log2(np.maximum(m, EXACT_ROWS))).astype(np.int64)
    step = np.where(m > EXACT_ROWS, 2 ** (octave - 3), 1)
    out = -(-m // step) * step
    return int(out) if np.ndim(out) == 0 else out


def run_exact(module: torch.nn.Module, x_sorted: torch.Tensor, experts: list[int], counts: list[int]) -> torch.Tensor:
    """The cpu-exact path: rows of `x_sorted` are grouped by expert (`counts[i]` rows for `experts[i]`); in half
    precision each expert's call runs `call_rows` rows (the rows after its own, or zeros past the end)."""
    if x_sorted.dtype not in SIZED_DTYPES or is_packed(module):
        return torch.cat([expert_ffn(module, e, x) for e, x in zip(experts, x_sorted.split(counts))])
    outs, start = [], 0
    for e, m in zip(experts, counts):
        rows = call_rows(m)
        x = x_sorted[start:start + rows]
        if x.shape[0] < rows:
            x = F.pad(x, (0, 0, 0, rows - x.shape[0]))
        outs.append(expert_ffn(module, e, x)[:m])
        start += m
    return torch.cat(outs)


def is_packed(module: torch.nn.Module) -> bool:
    """The experts' weights are packed (`runtime.cpu.quantized.QuantizedExperts`): transformers' kernels cannot
    run them."""
    return getattr(module, "npumoe_weights", None) is not None


def exact_experts_forward(module: torch.nn.Module, x: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """Every assignment on the exact path, expert by expert: what `grouped_mm` computes, for packed experts."""
    eid = top_k_index.reshape(-1)
    order = torch.argsort(eid, stable=True)
    counts = torch.bincount(eid, minlength=module.num_experts)
    experts = counts.nonzero().squeeze(1).tolist()
    tok = order // top_k_index.shape[1]
    y = run_exact(module, x[tok], experts, counts[experts].tolist())
    out = torch.zeros_like(x)
    out.index_add_(0, tok, y * top_k_weights.reshape(-1)[order, None].to(y.dtype))
    return out


ExpertsInterface.register(PACKED_IMPLEMENTATION, exact_experts_forward)


class CpuExactLayer:
    """A layer's experts on cpu-exact: expert by expert in torch (`run_exact`); a decode step in one call of
    transformers' grouped kernel (packed experts: `exact_experts_forward`). Nothing crosses: no crossing counted."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.fused = exact_experts_forward if is_packed(module) else grouped_mm_experts_forward

    def run(self, x_sorted: torch.Tensor, experts: list[int], counts: list[int],
            stats: LayerStats | None = None) -> torch.Tensor:
        return run_exact(self.module, x_sorted, experts, counts)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                stats: LayerStats | None = None) -> torch.Tensor:
        return self.fused(self.module, x, top_k_index, top_k_weights)


class CpuExactPath:
    """cpu-exact: torch on this process's threads, always there (every exact path's last fallback)."""
    name = EXACT
    overlaps_cpu = False

    def available(self) -> tuple[bool, str]:
        return True, "torch on the CPU"

    def prepare(self, module: torch.nn.Module) -> CpuExactLayer:
        return CpuExactLayer(module)

BACKENDS = (
    BackendInfo(REFERENCE, CpuStaticBackend, fallback=None, cpu_torch=True),
    BackendInfo(EXACT, CpuExactPath, fallback=None, exact=True, cpu_torch=True),
)
