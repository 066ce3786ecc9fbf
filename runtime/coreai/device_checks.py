"""The Core AI backend on the device (macOS 27, the OS framework): `autotune doctor`'s compute-plan report and
`autotune profile-device`'s timed calls. Written to Apple's coreai-torch and coreai-core APIs
(`coreai_torch.debugging.compute_plan.ComputePlan.from_program`, `SpecializationOptions.
from_preferred_compute_unit_kind(ComputeUnitKind.neural_engine())`); elsewhere they are not called (the doctor
skips its check, the profiler does not profile `coreai` by default)."""
from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from runtime.backends import GroupSpec, attention_reference, expert_ffn
from runtime.backends.protocol import expert_matrices
from runtime.coreai import assets, placement, programs
from runtime.coreml.dense_doctor import PROBE_ATTENTION
from runtime.coreml.dense_io import ROW_INPUT
from runtime.coreml.mil_eval import TOLERANCE, max_rel_error


def available_on_device() -> tuple[bool, str]:
    """Whether Core AI runs on the Neural Engine here (what profiling and the doctor's report need)."""
    why = assets.coreai_import_error()
    if why:
        return False, why
    if not assets.on_neural_engine():
        return False, "Core AI runs on the Neural Engine from macOS 27 (the OS framework); here " \
                      + assets.where_it_runs()
    return True, assets.where_it_runs()


def _group_function(module: torch.nn.Module, caps: Sequence[int], hidden: int) -> assets.Function:
    weights = [expert_matrices(module, e, torch.float32) for e in range(len(caps))]
    x = torch.randn(sum(caps), hidden, generator=torch.Generator().manual_seed(0)).half()
    return "group", programs.GroupProgram(weights, tuple(caps), torch.float16), (x,), [ROW_INPUT]


def _attention_function() -> tuple[assets.Function, torch.Tensor]:
    from runtime.coreml.dense_programs import sample_inputs

    spec = PROBE_ATTENTION
    feed, allowed = sample_inputs(spec)
    args = tuple(torch.from_numpy(feed[n]) for n in "qkv") + (programs.additive_mask(allowed, torch.float16),)
    return (spec.name, programs.dense_program(spec, torch.float16), args, ["q", "k", "v", "mask"]), allowed


def profile_caller(module: torch.nn.Module, caps: Sequence[int], hidden: int) -> Callable[[], object]:
    """How `autotune profile-device` times a coreai group on the device: the group converted as `autotune build
    --format coreai` converts it (float16), loaded specialized for the Neural Engine, one call on random rows."""
    folder = Path(tempfile.mkdtemp(prefix="npumoe-coreai-profile-"))
    try:
        fn = _group_function(module, caps, hidden)
        assets.convert([fn], folder / "group.aimodel", {"functions": {}})
        loaded = assets.load_model(folder / "group.aimodel").load_function("group")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    feed = {ROW_INPUT: fn[2][0].numpy()}

    def caller() -> object:
        return assets.call(loaded, feed)

    weakref.finalize(caller, shutil.rmtree, folder, True)  # the asset lives as long as its caller (or the process)
    return caller


def compute_plan_report(module: torch.nn.Module, caps: Sequence[int], hidden: int) -> dict:
    """macOS 27: where Core AI's compute plan places each op of one group function (of `module`'s first experts)
    and of one attention core specialized for the Neural Engine, and each function's parity (float16, on the
    device) against the torch reference. `autotune doctor` reports it."""
    group, (attention, allowed) = _group_function(module, caps, hidden), _attention_function()
    program = assets.to_program([group, attention], debug=True)
    plan = placement.compute_plan(program)
    off = placement.off_neural_engine(program, plan)  # ops the plan leaves UNKNOWN are not counted off
    shares = {name: s.to_json() for name, s in placement.shares(program, plan).items()}
    x, (q, k, v, mask) = group[2][0], attention[2]
    with tempfile.TemporaryDirectory(prefix="npumoe-coreai-doctor-") as folder:
        assets.convert([group, attention], Path(folder) / "doctor.aimodel", {"functions": {}})
        model = assets.load_model(Path(folder) / "doctor.aimodel")
        got = assets.call(model.load_function("group"), {ROW_INPUT: x.numpy()}).astype(np.float32)
        got_attention = assets.call(model.load_function(attention[0]), {"q": q.numpy(), "k": k.numpy(),
                                                                        "v": v.numpy(), "mask": mask.numpy()})
    g = GroupSpec(0, 0, tuple(range(len(caps))), tuple(caps), module)
    with torch.no_grad():
        ref = torch.cat([expert_ffn(module, e, xe) for e, xe in zip(g.experts, x.float().split(list(caps)))])
    ref_attention = attention_reference(q.float(), k.float(), v.float(), allowed, PROBE_ATTENTION.scaling)
    return {"device_histogram": plan["device_histogram"], "ops_off_neural_engine": off, "placement": shares,
            "group_max_rel_error": max_rel_error(got, ref.float().numpy()),
            "attention_max_rel_error": max_rel_error(got_attention.astype(np.float32), ref_attention.numpy()),
            "tolerance": TOLERANCE["none"], "attention_function": attention[0]}
