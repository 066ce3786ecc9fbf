"""A plan's dense functions (`Plan.dense`): the attention projections, the attention core and the dense MLP or shared
expert of chosen decoder layers on static backends, through the same backend protocol as expert groups
(`StaticBackend.prepare_dense`, `DenseSpec`). `families` holds what differs between the MoE families, `attention`
the attention core through transformers' attention interface, `dense_executor` the installation (by
`runtime.executor.PlanExecutor`, with the experts), `parts` the
measured wall time per part of a prefill (`measured_parts`)."""
from __future__ import annotations

from runtime.dense.dense_executor import DenseExecutor, check_dense_fits
from runtime.dense.parts import PARTS, measured_parts

__all__ = ["PARTS", "DenseExecutor", "check_dense_fits", "measured_parts"]
