"""The Core ML backends' registry entries: `ane` (a plan's groups as functions of a Core ML package on the Neural
Engine, runtime/coreml/ane.py), `ane-sim` (what those functions compute, on any host: runtime/coreml/ane_sim.py)
and `coreml-cpu` (the same functions on Core ML's CPU only, profiled for comparison;
nothing runs a plan on it). Core ML computes in fp16; each profiled shape is a conversion and a compile."""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

import numpy as np
import torch

from runtime.backends.protocol import DenseSpec
from runtime.backends.registry import BackendInfo
from runtime.coreml import ane_limits
from runtime.coreml.ane import INPUT_NAME, AneBackend, coreml_available, expert_weights_fp16, open_package, to_layout
from runtime.coreml.ane_sim import AneSimBackend

ROTATION = 4  # group functions a profiled shape cycles through, each over other experts: one conversion each


def profile_caller(compute_units: str, layout: str = "matmul") -> Callable[..., Callable[[], object]]:
    """How `autotune profile-device` times a Core ML backend: one call of a group function exactly as `autotune
    build` emits it (runtime.coreml.converter), run through Core ML on `compute_units` (`CPU_AND_NE`, `CPU_ONLY`),
    fed as this backend feeds it. Successive calls cycle through up to ROTATION functions over other experts, so a
    call's weights come from memory as in a run's layer, not warm from the call before (as the other backends'
    groups rotate). No package is needed: each synthetic group is converted on the spot."""

    def make(module: torch.nn.Module, caps: Sequence[int], hidden: int) -> Callable[[], object]:
        import coremltools as ct

        from runtime.coreml.converter import FunctionSpec, to_mlmodel

        g = len(caps)
        models = []
        for i in range(max(1, min(ROTATION, module.num_experts // g))):
            experts = tuple(range(i * g, i * g + g))
            fs = FunctionSpec(0, i, experts, tuple(caps), hidden, module.intermediate_dim)
            weights = {e: expert_weights_fp16(module, e) for e in experts}
            models.append(to_mlmodel(fs, weights, layout, compute_units=getattr(ct.ComputeUnit, compute_units)))
        x = np.random.default_rng(0).standard_normal((sum(caps), hidden)).astype(np.float16)
        feed = {INPUT_NAME: to_layout(x, layout)}
        turn = itertools.cycle(models)
        return lambda: next(turn).predict(feed)

    return make


def dense_caller(compute_units: str) -> Callable[[DenseSpec], Callable[[], object]]:
    """How `autotune profile-device` times a dense function on Core ML (q/k/v, o_proj, the attention core): the
    builder's own program of `spec` (runtime/coreml/dense_programs.py), loaded on `compute_units`, fed its sample
    inputs as the backend feeds them (fp16)."""

    def make(spec: DenseSpec) -> Callable[[], object]:
        import coremltools as ct

        from runtime.coreml.converter import program_mlmodel
        from runtime.coreml.dense_io import dense_weights
        from runtime.coreml.dense_programs import dense_program, sample_inputs

        mlmodel = program_mlmodel(dense_program(spec, dense_weights(spec)), getattr(ct.ComputeUnit, compute_units))
        feed, _ = sample_inputs(spec)
        return lambda: mlmodel.predict(feed)

    return make


BACKENDS = (
    # Off macOS (or without a package) ane's groups run on ane-sim: what the ANE function computes, simulated.
    BackendInfo("ane", AneBackend, overlaps_cpu=True, fallback=AneSimBackend.name, options=("package",),
                limits=ane_limits.group_violation, dtype_bytes=2, energy_field="ane_mj",
                profile_call=profile_caller("CPU_AND_NE"), profile_dense=dense_caller("CPU_AND_NE"),
                profile_available=coreml_available, compiles_per_shape=True, package_suffix=".mlpackage",
                open_package=open_package),
    # Always available; not profiled by default (its time says nothing about a device).
    BackendInfo(AneSimBackend.name, AneSimBackend, fallback=None, limits=ane_limits.group_violation, dtype_bytes=2,
                cpu_torch=True, profiled_by_default=False),
    BackendInfo("coreml-cpu", None, dtype_bytes=2, profile_call=profile_caller("CPU_ONLY"),
                profile_available=coreml_available, compiles_per_shape=True),
)
