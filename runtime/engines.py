"""Which spine runs a model: `torch` (transformers in torch on the CPU: the reference, and where MLX is absent) or
`mlx` (mlx-lm's own model: `runtime.mlx.spine`). `auto`: MLX on a Mac where mlx imports and the plan places
anything on MLX; torch otherwise (so Linux stays on torch)."""
from __future__ import annotations

import importlib.util
import sys

from runtime.errors import NpumoeError
from runtime.mlx.formats import unspliced
from runtime.plan import Plan

ENGINES = ("auto", "mlx", "torch")


def places_on_mlx(plan: Plan | None) -> bool:
    """Whether the plan puts any work on an MLX lane (an exact path, a group backend or the dense half's host named
    for MLX)."""
    if plan is None:
        return False
    names = {plan.exact_path, *(p for lp in plan.layers for p in (lp.exact_split or {})),
             *(g.backend for lp in plan.layers for g in lp.groups), (plan.dense.exact if plan.dense else None) or ""}
    return any("mlx" in n for n in names)


def mlx_importable() -> bool:
    return importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None


def torch_only(plan: Plan | None, cpu_weights: str | None = None) -> str | None:
    """What in a run only the torch spine runs (None: nothing): CPU expert storage, a plan's dense functions on a
    static backend that the MLX spine does not splice in. (A built package runs on either spine:
    `runtime.packages`.)"""
    if cpu_weights or (plan is not None and plan.cpu_weights is not None):
        return "CPU expert storage (--cpu-weights)"
    if unspliced(plan):
        return f"a plan's dense functions on a static backend ({', '.join(unspliced(plan))})"
    return None


def resolve_engine(engine: str, plan: Plan | None, needs_torch: str | None = None) -> str:
    """The spine `engine` names for `plan`: `auto` decided as the module says, torch wherever the run holds something
    only torch runs (`needs_torch`: what, e.g. from `torch_only`); `mlx` refused in one line there, and where mlx-lm
    is not installed."""
    if engine not in ENGINES:
        raise NpumoeError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    if engine == "auto":
        mlx = sys.platform == "darwin" and mlx_importable() and places_on_mlx(plan) and needs_torch is None
        return "mlx" if mlx else "torch"
    if engine == "mlx" and needs_torch is not None:
        raise NpumoeError(f"--engine mlx: {needs_torch} runs on the torch spine only; use --engine torch")
    if engine == "mlx" and not mlx_importable():
        raise NpumoeError("--engine mlx needs mlx and mlx-lm (pip install mlx-lm); or use --engine torch")
    return engine


def check_in_flight(in_flight: int | None, engine: str, planned: bool) -> None:
    """`--in-flight` above 1 only for a plan (`planned`) on the MLX spine (`engine`: the spine that runs it)."""
    if (in_flight or 1) > 1 and (engine != "mlx" or not planned):
        raise NpumoeError(f"--in-flight {in_flight} runs a plan's prefill on the MLX spine: give --plan and "
                          "--engine mlx")


def set_in_flight(loaded: object, in_flight: int | None) -> None:
    """`--in-flight` on a loaded model (`runtime.generation.Loaded`): its prefill's chunks in flight
    (`check_in_flight`); None: as loaded (the plan's `in_flight` on the MLX spine, one at a time on torch's)."""
    check_in_flight(in_flight, loaded.engine, loaded.plan is not None)
    if in_flight is not None and loaded.engine == "mlx":
        loaded.model.in_flight = in_flight
