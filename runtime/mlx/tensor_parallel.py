"""A model across Macs in tensor parallel on MLX's ring (the layout `autotune search --macs N` prices as `tensor`):
every rank holds every layer, sliced as mlx-lm's own `shard(group)` slices it (1/N of each attention head group,
of each dense MLP's width and of each expert's FFN width; the router, norms, embedding and `lm_head` whole), and
runs its slice under its plan on the MLX spine: the plan's static groups take this rank's slice of their experts,
the rest mlx-exact. mlx-lm's sharded layers sum the ranks' parts (`mx.distributed.all_sum`, twice per layer: after
the attention's `o_proj` and after the MoE block), so every rank computes the same hidden states and logits.
Imports mlx.
"""
from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from runtime.errors import NpumoeError

LAYOUTS = ("pipeline", "tensor")  # what a pipeline file's `layout` may name (absent: the pipeline)


def read_layout(path: str | Path) -> str:
    """The layout a pipeline file names (`layout`; absent: the pipeline)."""
    try:
        layout = json.loads(Path(path).read_text(encoding="utf-8")).get("layout", "pipeline")
    except (OSError, ValueError, AttributeError) as e:
        raise NpumoeError(f"cannot read the layout in {path}: {e}") from None
    if layout not in LAYOUTS:
        raise NpumoeError(f"{path} names the layout {layout!r}; the runtime runs {' or '.join(LAYOUTS)}")
    return layout


def check_shardable(config: dict, ranks: int, plan: str | None) -> None:
    """mlx-lm's `shard()` divides the heads, the KV heads and every FFN width by the ranks: refuse widths it
    cannot, and a plan that places dense functions on a static backend (the spine splices whole projections, not
    slices), before the ring is joined."""
    from runtime.mlx.formats import placed_dense
    from runtime.plan import load_plan

    if plan is not None and placed_dense(load_plan(plan)):
        raise NpumoeError(f"{plan} places dense functions on a static backend; the tensor layout slices them, "
                          "which the spine does not splice: use the pipeline layout, or a plan with no dense "
                          "placement")
    widths = {k: config.get(k) for k in ("num_attention_heads", "num_key_value_heads", "moe_intermediate_size",
                                         "intermediate_size")}
    odd = [f"{k} {v}" for k, v in widths.items() if v and v % ranks]
    if odd:
        raise NpumoeError(f"tensor parallel over {ranks} ranks slices each width {ranks} ways; {', '.join(odd)} "
                          "does not divide: use the pipeline layout")


def load_shard(path: Path, group: mx.distributed.Group, dtype: str) -> nn.Module:
    """mlx-lm's model of the folder, sliced for this rank by its own `shard(group)` (lazily loaded: only the slice
    is made), floats in `dtype` (`spine_loading.compute_dtype`)."""
    from mlx_lm.utils import load_model

    from runtime.mlx.spine_loading import cast_floats, folder_config

    model, _ = load_model(path, lazy=True, model_config=folder_config(path))
    if not hasattr(model, "shard"):
        raise NpumoeError(f"mlx-lm has no tensor parallel for {type(model).__module__.rsplit('.', 1)[-1]!r} models "
                          f"({path}): use the pipeline layout")
    model.shard(group)
    cast_floats(model, dtype)
    return model
