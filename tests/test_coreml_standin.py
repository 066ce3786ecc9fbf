"""The `ane` backend's own code run on Linux against packages `autotune build` made, with Core ML's compile and
predict replaced by a stand-in (tests/coreml_standin.py): every variant a user can build agrees with `ane-sim`, per
function and end to end, within 1e-3 of the output's scale."""
from __future__ import annotations

import pytest
import torch
from coreml_standin import install
from helpers import random_model

from autotune.searching.templates import template_plan
from runtime import generation
from runtime.backends import GroupSpec
from runtime.coreml.ane import AneBackend, open_package
from runtime.coreml.ane_sim import AneSimBackend
from runtime.coreml.converter import build_package, quiet_coremltools_import
from runtime.dense.attention import allowed_keys
from runtime.dense.specs import backend_specs
from runtime.loading.model_loader import model_spec, moe_layers
from runtime.plan import Plan
from runtime.prefill import prefill_chunks

quiet_coremltools_import()
MODEL = "random:qwen3_moe"
AGREE = 1e-3  # of the output's scale: the stand-in and ane-sim compute the same fp16 ops


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def layers_of(model) -> dict:
    return {layer.index: layer.experts for layer in moe_layers(model)}


def sample(spec, dtype, gen):
    """Random inputs of a dense function as the runtime feeds it."""
    if spec.kind == "attention":
        d = spec.form.head_dim
        q = torch.randn(spec.heads, spec.rows, d, generator=gen)
        k, v = (torch.randn(spec.kv_heads, spec.keys, d, generator=gen) for _ in range(2))
        allowed = allowed_keys(None, spec.rows, spec.rows + (spec.keys - spec.rows) // 2, spec.keys)
        return q.to(dtype), k.to(dtype), v.to(dtype), allowed
    width = next(iter(spec.modules.values()))
    from runtime.coreml.dense_programs import input_shapes

    return (torch.randn(*input_shapes(spec)["x"], generator=gen).to(dtype),) if width is not None else ()


def per_function(model, plan: Plan, backend: AneBackend, dtype: torch.dtype) -> dict[str, float]:
    """Each function of the plan on the package (through the stand-in) against ane-sim, on the same random inputs."""
    sim, gen, out = AneSimBackend(backend.metadata()["layout"]), torch.Generator().manual_seed(0), {}
    for layer in moe_layers(model):
        for gi, g in enumerate(plan.layer(layer.index).groups):
            if g.backend == "ane":
                spec = GroupSpec(layer.index, gi, tuple(g.experts), tuple(g.capacities), layer.experts,
                                 g.compression)
                x = torch.randn(sum(g.capacities), model.config.hidden_size, generator=gen).to(dtype)
                out[f"layer{layer.index}_group{gi}"] = rel(backend.prepare(spec)(x), sim.prepare(spec)(x))
    for spec in backend_specs(model, plan, "ane"):
        args = sample(spec, dtype, gen)
        out[spec.name] = rel(backend.prepare_dense(spec)(*args), sim.prepare_dense(spec)(*args))
    return out


def end_to_end(name: str, plan: Plan, package: str, tokens: int, dtype: str = "auto") -> tuple[float, dict]:
    """A prefill's logits with the package (the stand-in) against the same plan on ane-sim; the package run's
    calls per backend."""
    ids = torch.randint(0, 200, (tokens,), generator=torch.Generator().manual_seed(1))
    out = []
    for pkg in (package, None):
        loaded = generation.load(name, plan, pkg, dtype)
        with torch.inference_mode():
            out.append(torch.cat([o.logits[0] for o in prefill_chunks(loaded.model, ids, plan.chunk_tokens)]))
        if pkg:
            calls = dict(loaded.stats.total().calls_per_backend)
            dense_calls = dict(loaded.executor.dense.calls) if loaded.executor.dense else {}
        loaded.executor.uninstall()
    return rel(*out), {"groups": calls, "dense": dense_calls}


def built(tmp_path, plan: Plan, model, **options):
    return build_package(layers_of(model), plan, tmp_path / "p.mlpackage", cache_dir=tmp_path / "cache",
                         dense_model=model, **options)


def assert_agrees(name: str, model, plan: Plan, package: str, dtype: torch.dtype, tokens: int) -> dict:
    backend = open_package(package, plan, model)
    errors = per_function(model, plan, backend, dtype)
    assert errors and max(errors.values()) <= AGREE, errors
    e2e, calls = end_to_end(name, plan, package, tokens)
    assert e2e <= AGREE, e2e
    assert calls["groups"].get("ane", 0) > 0 or not any(g.backend == "ane" for lp in plan.layers for g in lp.groups)
    return calls


@pytest.mark.parametrize("layout", ["matmul", "conv1x1"])
def test_coreml_standin_layouts_with_dense_functions(tmp_path, monkeypatch, layout):
    """Both layouts, every group and every dense function (q/k/v, o_proj, attention core buckets) on the package."""
    standin = install(monkeypatch, tmp_path / "npumoe-cache")
    model, _ = random_model(MODEL)
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=16, dense="ane", context_tokens=48)
    result = built(tmp_path, plan, model, layout=layout)
    calls = assert_agrees(MODEL, model, plan, result.package, torch.float32, 40)
    assert {part for part, backend in calls["dense"] if backend == "ane"} >= {"qkv", "o_proj", "attention"}
    assert standin.calls["compile"] == 1  # one package, compiled once for every function and both runs


def test_coreml_standin_blocks_splits_and_compressed_groups(tmp_path, monkeypatch):
    """The attention core in causal blocks, q/k/v and o_proj split by rows with the CPU, groups stored as int8 and
    4-bit palettes beside fp16 ones."""
    install(monkeypatch, tmp_path / "npumoe-cache")
    model, _ = random_model(MODEL)
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=128, dense="ane",
                         context_tokens=256)
    d = plan.model_dump(by_alias=True, exclude_none=True)
    d["layers"][0]["groups"][0]["compress"], d["layers"][0]["groups"][1]["compress"] = "int8", "palettize4"
    for lp in d["layers"][2:]:  # two layers are enough: the others run exactly on the CPU
        lp["groups"], lp["cpu_exact"] = [], list(range(model.config.num_experts))
    d["dense"].update(attention_block=64, attention_context_buckets=[64, 128, 192, 256],
                      layers=d["dense"]["layers"][:2])
    for dl in d["dense"]["layers"]:
        dl["qkv"]["rows"] = dl["o_proj"]["rows"] = 64
    plan = Plan.model_validate(d)
    result = built(tmp_path, plan, model)
    assert {fs.compress for fs in result.functions} == {"int8", "palettize4", "none"}
    calls = assert_agrees(MODEL, model, plan, result.package, torch.float32, 200)
    assert calls["dense"].get(("attention", "ane"), 0) > 0 and calls["dense"].get(("qkv", "ane"), 0) > 0
