"""ane-sim against its reference, the builder's MIL host evaluation of each built function (none, int8,
palettize4), and as the runtime's stand-in for `ane` groups off macOS."""
import numpy as np
import pytest
import torch
from helpers import one_ane_group, random_model

from autotune.searching.templates import template_plan
from runtime.backends import GroupSpec
from runtime.coreml.ane import INPUT_NAME, OUTPUT_NAME, from_layout, to_layout
from runtime.coreml.ane_sim import AneSimBackend
from runtime.coreml.converter import build_package, quiet_coremltools_import
from runtime.cpu.cpu_backends import CpuStaticBackend
from runtime.executor import PlanExecutor
from runtime.loading.model_loader import model_spec, moe_layers
from runtime.prefill import prefill_logits

quiet_coremltools_import()
MODEL = "random:qwen3_moe"
# max|ane-sim - MIL| / max|MIL| per function. Measured (random:qwen3_moe, matmul and conv1x1): none 1.4e-5, int8
# 2.3e-4, palettize4 6.1e-5; tiny-moe (4 experts): 1.2e-4, 5.8e-5, 1.2e-4. One fp16 ulp where fp32 sums round
# differently (>= 98.8% of outputs equal bit for bit). cpu-static is 7.4e-4, 1.3e-2 and 0.17 from MIL there.
SIM_TOLERANCE = {"none": 5e-4, "int8": 5e-4, "palettize4": 5e-4}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Decompressed weights are cached under $NPUMOE_CACHE: a test's own, not the user's."""
    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path / "cache"))


def _rel(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("compress", ["none", "int8", "palettize4"])
@torch.no_grad()
def test_ane_sim_agrees_with_the_builders_host_evaluation(compress, tmp_path):
    from runtime.coreml.mil_eval import evaluate_function
    from runtime.coreml.mil_lint import load_package_program

    model, _ = random_model(MODEL)
    layers = {layer.index: layer.experts for layer in moe_layers(model)}
    plan = one_ane_group(template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=16))
    built = build_package(layers, plan, tmp_path / "g.mlpackage", compress=compress, cache_dir=tmp_path / "c")
    _, prog = load_package_program(built.package)
    sim = AneSimBackend()
    for fs in built.functions:
        group = GroupSpec(fs.layer, fs.group, fs.experts, fs.capacities, layers[fs.layer], compress)
        packed = np.random.default_rng(0).standard_normal((fs.slots, fs.hidden)).astype(np.float16)
        y = evaluate_function(prog.functions[fs.name], {INPUT_NAME: to_layout(packed, "matmul")})
        mil = from_layout(y[OUTPUT_NAME], "matmul")
        x = torch.from_numpy(packed.astype(np.float32))
        got = sim.prepare(group)(x).numpy()
        assert _rel(got, mil) <= SIM_TOLERANCE[compress]
        static = CpuStaticBackend().prepare(group)(x).numpy()
        if compress != "none":  # the compressed weights are what ane-sim computes with, not the originals
            assert _rel(static, mil) > 10 * _rel(got, mil)


@torch.no_grad()
def test_a_compressed_group_runs_its_decompressed_weights():
    model, _ = random_model(MODEL)
    layer = moe_layers(model)[0]
    sim = AneSimBackend()
    x = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    outs = {c: sim.prepare(GroupSpec(layer.index, 0, (0, 2), (4, 2), layer.experts, c))(x)
            for c in ("none", "int8", "palettize4")}
    ref = CpuStaticBackend().prepare(GroupSpec(layer.index, 0, (0, 2), (4, 2), layer.experts))(x)
    errors = {c: float((y - ref).abs().max() / ref.abs().max()) for c, y in outs.items()}
    assert errors["none"] < 2e-3 < errors["int8"] < errors["palettize4"] < 0.5  # fp16 < int8 < 4-bit palette
    assert sim.weights(layer.experts, 0, "int8")[0].dtype == torch.float16


@torch.no_grad()
def test_plan_compress_field_reaches_ane_sim():
    """The runtime hands each group its plan `compress`: the same plan with int8 groups computes otherwise."""
    model, tok = random_model(MODEL)
    ids = torch.tensor(tok.encode("Experts stored in eight bits on the neural engine. " * 4)[:48])
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=16)
    int8 = plan.model_copy(update={"layers": [lp.model_copy(update={"groups": [
        g.model_copy(update={"compress": "int8"}) for g in lp.groups]}) for lp in plan.layers]})
    sim = AneSimBackend()
    with PlanExecutor(model, plan, {"ane": sim}) as ex:
        fp16 = prefill_logits(model, ids, 16)
    with PlanExecutor(model, int8, {"ane": sim}):
        q8 = prefill_logits(model, ids, 16)
    ref = prefill_logits(model, ids, 16)
    assert ex.stats.total().calls_per_backend["ane-sim"] > 0 and ex.fallbacks == {"ane": "ane-sim"}
    assert float((fp16 - ref).abs().max()) < float((q8 - ref).abs().max())
