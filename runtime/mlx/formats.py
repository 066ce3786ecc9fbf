"""What mlx-exact runs, without importing mlx: its name and the packed formats `mx.gather_qmm` takes."""
from __future__ import annotations

from runtime.cpu.quantized import BITS, GROUP_SIZES  # mlx's affine widths and groups: gather_qmm runs them all
from runtime.errors import NpumoeError
from runtime.plan import Plan

NAME = "mlx-exact"
# Float32 weights one mlx-exact call widens at a time where its rows compute in float32 (MLX's CPU device):
# `mlx_exact._Full`, and the gate's predicted peak (autotune/costing/memory.py `mlx_widen_bytes`)
WIDEN_BYTES = 64 << 20
# The dense functions (a plan's `dense` layers: qkv, o_proj, attention, mlp) the MLX spine runs on a static backend,
# spliced into mlx-lm's forward; a plan whose dense half is priced on MLX places only these (the search), and the
# spine refuses others.
SPINE_SPLICES: tuple[str, ...] = ("qkv", "o_proj", "attention", "mlp")


def placed_dense(plan: Plan | None) -> list[str]:
    """The kinds of dense function (qkv, o_proj, attention, mlp) the plan puts on a static backend."""
    if plan is None or plan.dense is None:
        return []
    return sorted({f for dl in plan.dense.layers for f in ("qkv", "o_proj", "attention", "mlp")
                   if getattr(dl, f) is not None})


def unspliced(plan: Plan | None) -> list[str]:
    """Those of `placed_dense` the MLX spine does not splice in."""
    return [f for f in placed_dense(plan) if f not in SPINE_SPLICES]


def check_format(name: str, bits: int, group_size: int, mode: str = "affine") -> None:
    """Refuse, in one line, packed weights `mx.gather_qmm` cannot run as mlx-exact runs them (affine mode)."""
    if mode != "affine" or bits not in BITS or group_size not in GROUP_SIZES:
        raise NpumoeError(f"{NAME}: {name} is packed in {mode} mode, {bits} bits, groups of {group_size}; "
                          f"{NAME} runs affine {', '.join(map(str, BITS))} bits in groups of "
                          f"{', '.join(map(str, GROUP_SIZES))}")
