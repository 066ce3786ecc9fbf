"""The Core ML backends' registry entries: `ane` (a plan's groups as functions of a Core ML package on the Neural
Engine, runtime/coreml/ane.py), `ane-sim` (what those functions compute, on any host: runtime/coreml/ane_sim.py)
and `coreml-cpu` (the same functions on Core ML's CPU only, profiled for comparison;
nothing runs a plan on it). Core ML computes in fp16; each profiled shape is a conversion and a compile."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from runtime.backends.registry import BackendInfo
from runtime.coreml import ane_limits
from runtime.coreml.ane import INPUT_NAME, AneBackend, coreml_available, expert_weights_fp16, open_package, to_layout
from runtime.coreml.ane_sim import AneSimBackend


def profile_caller(compute_units: str, layout: str = "matmul") -> Callable[..., Callable[[], object]]:
    """How `autotune profile-device` times a Core ML backend: one call of a group function exactly as `autotune
    build` emits it (runtime.coreml.converter), run through Core ML on `compute_units` (`CPU_AND_NE`, `CPU_ONLY`),
    fed as this backend feeds it. No package is needed: each synthetic group is converted on the spot."""

    def make(module: torch.nn.Module, caps: Sequence[int], hidden: int) -> Callable[[], object]:
        import coremltools as ct

        from runtime.coreml.converter import FunctionSpec, to_mlmodel

        experts = tuple(range(len(caps)))
        fs = FunctionSpec(0, 0, experts, tuple(caps), hidden, module.intermediate_dim)
        weights = {e: expert_weights_fp16(module, e) for e in experts}
        mlmodel = to_mlmodel(fs, weights, layout, compute_units=getattr(ct.ComputeUnit, compute_units))
        x = np.random.default_rng(0).standard_normal((fs.slots, hidden)).astype(np.float16)
        feed = {INPUT_NAME: to_layout(x, layout)}
        return lambda: mlmodel.predict(feed)

    return make


BACKENDS = (
    # Off macOS (or without a package) ane's groups run on ane-sim: what the ANE function computes, simulated.
    BackendInfo("ane", AneBackend, overlaps_cpu=True, fallback=AneSimBackend.name, options=("package",),
                limits=ane_limits.group_violation, dtype_bytes=2, energy_field="ane_mj",
                profile_call=profile_caller("CPU_AND_NE"), profile_available=coreml_available, compiles_per_shape=True,
                package_suffix=".mlpackage", open_package=open_package),
    # Always available; not profiled by default (its time says nothing about a device).
    BackendInfo(AneSimBackend.name, AneSimBackend, fallback=None, limits=ane_limits.group_violation, dtype_bytes=2,
                cpu_torch=True, profiled_by_default=False),
    BackendInfo("coreml-cpu", None, dtype_bytes=2, profile_call=profile_caller("CPU_ONLY"),
                profile_available=coreml_available, compiles_per_shape=True),
)
