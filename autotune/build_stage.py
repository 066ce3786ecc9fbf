"""The build stage (`autotune build`): a plan's device functions built from a model, as Core ML packages or a Core
AI asset, each checked numerically on the host."""
from __future__ import annotations

import os
from pathlib import Path

from autotune.build_io import private_tempdir, progress_factory
from runtime.loading.model_loader import load_model, model_spec, moe_layers, read_model_spec
from runtime.plan import check_plan_matches, load_plan


def build(model: str, plan: str | os.PathLike, *, out: str | os.PathLike | None = None, layout: str = "matmul",
          compress: str | None = None, cache_dir: str | os.PathLike | None = None,
          function_weight_bytes: float | None = None, package_weight_bytes: float | None = None,
          dtype: str = "auto", progress: bool = True, format: str = "coreml"):
    """Build the Core ML package(s) of the plan's ANE groups (default `out`: the plan's path with .mlpackage),
    linted and checked numerically on the host; returns `runtime.coreml.converter.BuildResult`. `format` coreai:
    the plan's coreai groups and dense functions as one Core AI asset (`runtime.coreai.builder.AssetBuild`)."""
    from runtime.coreml import ane_limits
    from runtime.coreml.converter import build_package, quiet_coremltools_import
    from runtime.loading.expert_weights import CheckpointExperts, ModuleExperts

    if format == "coreai":
        return _build_coreai(model, plan, out, compress, function_weight_bytes, dtype, progress)
    out = out or Path(plan).with_suffix(".mlpackage")
    quiet_coremltools_import()
    loaded_plan = load_plan(plan)
    # A safetensors checkpoint is never loaded whole: each function's experts are read when it is converted and
    # checked (build memory is one function, not the model). Other models (random:, MLX folders: kept packed, each
    # expert dequantized when its function converts) are loaded.
    source = CheckpointExperts.open(model, dtype)
    dense_on_ane = loaded_plan.dense is not None and "ane" in loaded_plan.dense.backends  # needs the dense modules
    loaded = load_model(model, dtype)[0] if source is None or dense_on_ane else None
    if source is None:
        spec = model_spec(loaded)
        source = ModuleExperts({layer.index: layer.experts for layer in moe_layers(loaded)})
    else:
        spec = read_model_spec(model)
    check_plan_matches(loaded_plan, spec, str(plan))
    with private_tempdir():  # coremltools' own tmp*.mlpackage folders go there and leave with it
        return build_package(source, loaded_plan, out, layout, compress, cache_dir, progress_factory(progress),
                             function_weight_bytes=function_weight_bytes or ane_limits.FUNCTION_WEIGHT_BYTES,
                             package_weight_bytes=package_weight_bytes or ane_limits.PACKAGE_WEIGHT_BYTES,
                             dense_model=loaded if dense_on_ane else None)


def _build_coreai(model: str, plan: str | os.PathLike, out: str | os.PathLike | None, compress: str | None,
                  function_weight_bytes: float | None, dtype: str, progress: bool):
    """`build` of a Core AI asset: the model loaded (its dense functions' modules and its experts, an MLX folder's
    kept packed), the asset computing in float32 for `--dtype float32`, else (`auto` included, whatever the host
    computes a checkpoint in) in float16: the Neural Engine's precision, checked against ane-sim."""
    from runtime.coreai.builder import build_asset
    from runtime.coreml import ane_limits
    from runtime.loading.expert_weights import ModuleExperts

    loaded_plan = load_plan(plan)
    loaded = load_model(model, dtype)[0]
    check_plan_matches(loaded_plan, model_spec(loaded), str(plan))
    source = ModuleExperts({layer.index: layer.experts for layer in moe_layers(loaded)})
    asset_dtype = "float32" if dtype == "float32" else "float16"
    with private_tempdir():
        return build_asset(source, loaded_plan, out or Path(plan).with_suffix(".aimodel"), asset_dtype, compress,
                           loaded, function_weight_bytes or ane_limits.FUNCTION_WEIGHT_BYTES,
                           progress_factory(progress))
