"""The MLX backends' registry entries: `mlx-exact`, an exact path (exact token counts, no padding, no drop) run by
MLX on the Mac's GPU, or on MLX's CPU device elsewhere. Where MLX is missing, its work runs on `cpu-exact`, said
once. Nothing here imports mlx until a plan or the profiler asks for the path (runtime/mlx/mlx_exact.py)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

from runtime.backends.registry import EXACT, BackendInfo
from runtime.errors import NpumoeError
from runtime.mlx.formats import NAME, check_format

PROFILE_BITS, PROFILE_GROUP = 4, 64  # the profiler's synthetic experts, packed as mlx_lm.convert -q packs them


def mlx_available() -> tuple[bool, str]:
    """Whether MLX imports here, and on which device it computes."""
    try:
        import mlx.core as mx
    except ImportError as e:
        return False, f"mlx does not import here ({e})"
    if mx.default_device() == mx.gpu:
        return True, "MLX on the Metal GPU"
    return True, "MLX's CPU device (no Metal GPU here: its times say nothing about a GPU)"


def check_folder(path: Path) -> None:
    """An MLX folder whose packed experts mlx-exact cannot run is refused (one line); other folders pass."""
    from runtime.loading.checkpoint_reader import is_mlx_checkpoint
    from runtime.loading.mlx_checkpoint import expert_formats

    if is_mlx_checkpoint(path):
        for module, fmt in expert_formats(path).items():
            check_format(f"{path}'s experts ({module})", *fmt)


def profile_device() -> str:
    """Where the profiler's mlx-exact calls ran: `gpu`, or `cpu` (MLX's CPU device), marked on its records."""
    from runtime.mlx import mlx_exact

    return mlx_exact.device()


class MlxExactPath:
    """mlx-exact: a layer's experts on MLX (`mlx_exact.MlxExactLayer`), overlapping the static groups' calls."""
    name = NAME
    overlaps_cpu = True

    def available(self) -> tuple[bool, str]:
        return mlx_available()

    def prepare(self, module: torch.nn.Module):
        from runtime.mlx.mlx_exact import MlxExactLayer

        return MlxExactLayer(module)


def packed_like(module: torch.nn.Module, bits: int = PROFILE_BITS, group: int = PROFILE_GROUP) -> torch.nn.Module:
    """A stand-in of full-width `module` whose experts are packed by MLX (`mx.quantize`, affine), as an MLX folder
    holds them: what mlx-exact runs on a Mac."""
    import mlx.core as mx

    from runtime.cpu.quantized import PackedWeight, QuantizedExperts
    from runtime.mlx.mlx_exact import to_mx, to_torch

    f = module.intermediate_dim
    weights = {"gate": module.gate_up_proj[:, :f], "up": module.gate_up_proj[:, f:], "down": module.down_proj}
    packed = {}
    for name, w in weights.items():
        q, scales, biases = mx.quantize(to_mx(w.float()), group, bits)
        packed[name] = PackedWeight(to_torch(q, torch.int32), to_torch(scales, torch.float32),
                                    to_torch(biases, torch.float32), bits, group)
    stand_in = torch.nn.Module()
    stand_in.act_fn, stand_in.num_experts = module.act_fn, module.num_experts
    stand_in.npumoe_weights = QuantizedExperts(packed["gate"], packed["up"], packed["down"])
    return stand_in


def profile_call(module: torch.nn.Module, caps: Sequence[int], hidden: int) -> Callable[[], object]:
    """How `autotune profile-device` times mlx-exact: one exact-path call over len(caps) experts (caps[i] rows for
    the i-th), 4-bit packed experts as an MLX folder holds them, crossings included, as the executor makes it."""
    from runtime.mlx.mlx_exact import MlxExactLayer

    ok, why = mlx_available()
    if not ok:
        raise NpumoeError(f"{NAME}: {why}")
    # packed in groups of 64, or 32 where the widths need it; widths neither divides (the 16-wide dispatch probe)
    # run full width (gather_mm)
    group = next((g for g in (PROFILE_GROUP, 32) if module.hidden_dim % g == 0 and module.intermediate_dim % g == 0),
                 None)
    layer = MlxExactLayer(packed_like(module, group=group) if group else module)
    x = torch.randn(sum(caps), hidden)
    n, g = module.num_experts, len(caps)
    turn = [0]

    def call() -> torch.Tensor:  # over other experts in turn, so weights come from memory as in a real layer
        experts = sorted((turn[0] + j) % n for j in range(g))  # the exact path's rows come sorted by expert
        turn[0] = (turn[0] + g) % n
        return layer.run(x, experts, list(caps))

    return call


BACKENDS = (
    # Not profiled by default off a Mac: there MLX runs on its CPU device, whose times say nothing about a GPU.
    BackendInfo(NAME, MlxExactPath, overlaps_cpu=True, lazy=True, fallback=EXACT, exact=True, dtype_bytes=2,
                energy_field="gpu_mj", profile_call=profile_call, profile_available=mlx_available,
                profile_device=profile_device, check_weights=check_folder,
                profiled_by_default=sys.platform == "darwin" and mlx_available()[1] == "MLX on the Metal GPU"),
)
