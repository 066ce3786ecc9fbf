"""A plan's dense functions (`Plan.dense`): the attention projections, the attention core and the dense MLP or shared
expert of chosen decoder layers on static backends, through the same backend protocol as expert groups
(`StaticBackend.prepare_dense`, `DenseSpec`). `families` holds what differs between the MoE families, `attention`
the attention core through transformers' attention interface, `dense_executor` the installation, `parts` the
measured wall time per part of a prefill (`measured_parts`)."""
from __future__ import annotations

import torch

from runtime.backends import StaticBackend
from runtime.dense.dense_executor import DenseExecutor, check_dense_fits
from runtime.dense.parts import PARTS, measured_parts
from runtime.plan import Plan


def install(model: torch.nn.Module, plan: Plan, backends: dict[str, StaticBackend] | None = None,
            options: dict | None = None) -> DenseExecutor | None:
    """The plan's dense functions prepared and installed on `model`; None for a plan without any."""
    if plan.dense is None:
        return None
    return DenseExecutor(model, plan, backends, options).install()


__all__ = ["PARTS", "DenseExecutor", "check_dense_fits", "install", "measured_parts"]
