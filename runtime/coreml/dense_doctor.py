"""`autotune doctor`'s attention-core check (macOS only: Core ML's runtime): one function built as `autotune build`
builds it, its placement by MLComputePlan and a prediction's parity with the torch reference."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runtime.backends import DenseForm, DenseSpec, attention_reference
from runtime.coreml.dense_io import ATTENTION_INPUTS
from runtime.coreml.dense_programs import OUTPUT, dense_program, sample_inputs

# The attention core the doctor checks: small enough to convert and compile in seconds.
PROBE_ATTENTION = DenseSpec("attention", -1, 16, form=DenseForm(head_dim=16), keys=32, heads=4, kv_heads=2,
                            scaling=0.25)


def check_attention_core(folder: Path, spec: DenseSpec = PROBE_ATTENTION) -> dict:
    """macOS only (Core ML's runtime): build one attention-core function as `autotune build` does, load it on
    CPU_AND_NE, and report the ops MLComputePlan places off the Neural Engine and a prediction's max relative error
    against the torch reference (fp32 sdpa over the same padded, masked keys). `autotune doctor` calls it."""
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan

    from runtime.coreml.ane import ops_not_on_ane
    from runtime.coreml.converter import convert_program
    from runtime.coreml.mil_eval import TOLERANCE, max_rel_error

    path = Path(folder) / f"{spec.name}.mlpackage"
    convert_program(dense_program(spec, {}), "none", path)
    compiled = ct.models.utils.compile_model(str(path), str(Path(folder) / f"{spec.name}.mlmodelc"))
    plan = MLComputePlan.load_from_path(compiled, compute_units=ct.ComputeUnit.CPU_AND_NE)
    model = ct.models.CompiledMLModel(compiled, compute_units=ct.ComputeUnit.CPU_AND_NE)
    feed, allowed = sample_inputs(spec)
    got = np.asarray(model.predict(feed)[OUTPUT], dtype=np.float32)
    q, k, v = (torch.from_numpy(feed[n].astype(np.float32)) for n in ATTENTION_INPUTS[:3])
    ref = attention_reference(q, k, v, allowed, spec.scaling).numpy()
    return {"function": spec.name, "off_ane": ops_not_on_ane(plan, "main"), "max_rel_error": max_rel_error(got, ref),
            "tolerance": TOLERANCE["none"]}
