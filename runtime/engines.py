"""Which spine runs a model: `torch` (transformers in torch on the CPU: the reference, and where MLX is absent) or
`mlx` (mlx-lm's own model: `runtime.mlx.spine`). `auto`: MLX on a Mac where mlx imports and the plan places
anything on MLX; torch otherwise (so Linux stays on torch)."""
from __future__ import annotations

import importlib.util
import sys

from runtime.errors import NpumoeError
from runtime.plan import Plan

ENGINES = ("auto", "mlx", "torch")


def places_on_mlx(plan: Plan | None) -> bool:
    """Whether the plan puts any work on an MLX lane (an exact path or a group backend named for MLX)."""
    if plan is None:
        return False
    names = {plan.exact_path, *(p for lp in plan.layers for p in (lp.exact_split or {})),
             *(g.backend for lp in plan.layers for g in lp.groups)}
    return any("mlx" in n for n in names)


def mlx_importable() -> bool:
    return importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None


def resolve_engine(engine: str, plan: Plan | None) -> str:
    """The spine `engine` names for `plan`: `auto` decided as the module says; `mlx` refused where mlx-lm is not
    installed."""
    if engine not in ENGINES:
        raise NpumoeError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    if engine == "auto":
        return "mlx" if sys.platform == "darwin" and mlx_importable() and places_on_mlx(plan) else "torch"
    if engine == "mlx" and not mlx_importable():
        raise NpumoeError("--engine mlx needs mlx and mlx-lm (pip install mlx-lm); or use --engine torch")
    return engine
