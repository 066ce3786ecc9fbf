"""npumoe's tuner: measure a device, calibrate a model's routing, search a plan, build its Core ML package, run
and evaluate the plan.

The pipeline as library functions (`autotune.pipeline`; each `autotune` command is a thin parser over one):

    from autotune import SearchConfig, build, calibrate, evaluate, resolve_model, run_plan, search_plan

    tiny = resolve_model("tiny-moe")  # config.json and the checkpoint's tables read once; the weights when needed
    traces = calibrate(tiny, "builtin:pydoc-calib", out="traces/tiny-moe.npz")
    config = SearchConfig(profile="apple-m2-ultra-published", traces=traces.path, out="plans/t.json")
    result = search_plan("tiny-moe", config)  # exactly `autotune search --model tiny-moe --profile ... --out ...`
    package = build(tiny, result.path)  # on a plan with `ane` groups
    stats = run_plan("tiny-moe", result.path, reference=True)  # what `autotune run --json` prints
    fidelity = evaluate("tiny-moe", result.path)  # what `autotune evaluate --json` prints

They load lazily, so importing a light submodule (`autotune.profiling.settings`) stays light.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotune.pipeline import (
        build,
        calibrate,
        describe_model,
        evaluate,
        evaluate_tasks,
        profile_device,
        record_prompt_traces,
        resolve_model,
        run_plan,
        search_plan,
    )
    from autotune.searching.config import SearchConfig

__all__ = ["SearchConfig", "build", "calibrate", "describe_model", "evaluate", "evaluate_tasks", "profile_device",
           "record_prompt_traces", "resolve_model", "run_plan", "search_plan"]


def __getattr__(name: str):
    if name == "SearchConfig":
        from autotune.searching.config import SearchConfig

        return SearchConfig
    if name in __all__:
        from autotune import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")
