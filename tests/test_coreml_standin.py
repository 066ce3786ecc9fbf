"""The `ane` backend's own code run on Linux against packages `autotune build` made, with Core ML's compile and
predict replaced by a stand-in (tests/coreml_standin.py): every variant a user can build agrees with `ane-sim`, per
function and end to end, within one fp16 step of the output's scale (plus one step of a narrower output format)."""
from __future__ import annotations

import pytest
import torch
from coreml_standin import install
from helpers import random_model

from autotune.searching.templates import template_plan
from runtime import generation
from runtime.backends import GroupSpec
from runtime.coreml.ane import AneBackend
from runtime.coreml.ane_sim import AneSimBackend
from runtime.coreml.converter import build_package, quiet_coremltools_import
from runtime.coreml.dense_io import dense_weights
from runtime.dense.attention import allowed_keys
from runtime.dense.specs import backend_specs
from runtime.loading.model_loader import model_spec, moe_layers
from runtime.packages import bind_package, torch_target
from runtime.plan import Plan
from runtime.prefill import prefill_chunks

quiet_coremltools_import()
MODEL = "random:qwen3_moe"
# Of the output's scale. The stand-in (coremltools' numpy evaluation) and ane-sim (torch) compute the same fp16 ops,
# each in fp32 inside an op, but sum in different orders (and each CPU's kernels block differently): where an fp32
# result lies near the middle of two fp16 values the two paths round it to adjacent ones (on an AMD EPYC: 4 of 32,768
# after qkv's norm, 16 of 16,384 after its q projection). One such step, 2^-10 of a value, is the bound; the flips
# measured move the outputs by 3.5e-4 of their scale at most.
AGREE = torch.finfo(torch.float16).eps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|, less one step of the outputs' format at each value where that format is narrower than
    fp16 (bf16: 2^-7): two fp16 results one fp16 step apart round to bf16 values up to a bf16 step apart."""
    step = torch.finfo(a.dtype).eps if torch.finfo(a.dtype).eps > AGREE else 0.0
    a, b = a.float(), b.float()
    excess = ((a - b).abs() - step * torch.maximum(a.abs(), b.abs())).clamp(min=0)
    return float(excess.max() / b.abs().max())


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


def assert_agrees(name: str, model, plan: Plan, package: str, dtype: torch.dtype, tokens: int,
                  e2e_dtype: str = "auto") -> dict:
    backend = bind_package(package, plan, torch_target(model))["ane"]
    errors = per_function(model, plan, backend, dtype)
    assert errors and max(errors.values()) <= AGREE, errors
    e2e, calls = end_to_end(name, plan, package, tokens, e2e_dtype)
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


@pytest.fixture(scope="module")
def mlx_q4(tmp_path_factory):
    """tiny-moe converted by mlx-lm to 4 bits (groups of 64): packed QuantizedLinear projections without biases."""
    pytest.importorskip("mlx_lm")
    from helpers import convert_to_mlx

    return convert_to_mlx(tmp_path_factory.mktemp("mlx") / "q4", 4, 64)


def first_layer_plan(spec, chunk: int, groups: int | None = None, context: int | None = None) -> Plan:
    """Layer 0's first `groups` groups (default all) on ane, with its dense functions (q/k/v, o_proj, the attention
    core up to `context`) where given; the other layers exactly on the CPU: every kind of function, built in seconds."""
    d = template_plan(spec, "ample", backend="ane", chunk_tokens=chunk, dense="ane" if context else None,
                      context_tokens=context).model_dump(by_alias=True, exclude_none=True)
    for li, lp in enumerate(d["layers"]):
        lp["groups"] = lp["groups"][:groups] if li == 0 else []
        lp["cpu_exact"] = sorted(set(range(spec.num_experts)) - {e for g in lp["groups"] for e in g["experts"]})
    if context:
        d["dense"]["layers"] = d["dense"]["layers"][:1]
    return Plan.model_validate(d)


def test_coreml_standin_mlx_folder_with_dense_functions(tmp_path, monkeypatch, mlx_q4):
    """An MLX 4-bit folder built as `autotune build` does by default (--dtype auto: bf16 here): its o_proj (a packed
    QuantizedLinear without a bias) converts, the host check passes against bf16 references, and the package runs."""
    from runtime.loading.model_loader import load_model

    install(monkeypatch, tmp_path / "npumoe-cache")
    model, _ = load_model(str(mlx_q4), "auto")
    plan = first_layer_plan(model_spec(model), 64, groups=1, context=128)
    result = built(tmp_path, plan, model)
    kinds = {spec.kind for spec in result.dense}
    assert kinds == {"qkv", "o_proj", "attention"}
    checks = {c.function: c for c in result.checks}
    assert all(c.max_rel_error <= c.tolerance for c in checks.values())
    # end to end in float32: in bf16 one fp16 output rounded the other way (a different fp32 summation order) moves
    # a logit by a bf16 step, 2^-8 of its size, past the 1e-3 compared (7.4e-3 measured); per function it is bf16
    calls = assert_agrees(str(mlx_q4), model, plan, result.package, torch.bfloat16, 150, "float32")
    assert calls["dense"].get(("o_proj", "ane"), 0) > 0


def test_coreml_standin_several_packages_count_dense_functions(tmp_path, monkeypatch):
    """A build split into parts: no part past its budget counting every function's weights (dense ones included),
    each part's recorded weight bytes exactly the distinct weights its program holds; the manifest runs."""
    from runtime.coreml.mil_lint import load_package_program

    install(monkeypatch, tmp_path / "npumoe-cache")
    model, _ = random_model(MODEL)
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=16, dense="ane", context_tokens=32)
    budget = 120_000  # bytes: a layer's experts (73,728) and its q/k/v and o_proj (32,768 + 16,384) do not fit twice
    result = built(tmp_path, plan, model, package_weight_bytes=budget)
    assert len(result.packages) >= 4
    dense = {spec.name: spec for spec in result.dense}
    for pk in result.packages:
        assert pk["weight_bytes"] <= budget, pk
        _, prog = load_package_program(tmp_path / pk["path"])
        # the matrices as stored, once per package however many functions use them (an expert's are shared)
        matrices = {op.name: op.outputs[0].val.nbytes for fn in prog.functions.values() for op in fn.operations
                    if op.op_type == "const" and op.name.startswith("layer") and op.outputs[0].val.ndim == 2}
        # the norms' weight vectors, counted in fp16: coremltools folds them into the next projection
        vectors = sum(a.nbytes for name in pk["functions"] if name in dense
                      for a in dense_weights(dense[name]).values() if a.ndim == 1)
        assert sum(matrices.values()) + vectors == pk["weight_bytes"], pk["path"]
    assert any(name.endswith("_qkv") for name in result.packages[-1]["functions"])  # not all in the first part
    assert_agrees(MODEL, model, plan, result.manifest, torch.float32, 40)


def test_coreml_standin_second_run_reuses_the_compiled_package(tmp_path, monkeypatch, caplog):
    """Each process compiles a package once per machine: a second backend (another process's) loads the cached
    compiled model, says so, and leaves nothing in the temporary folder."""
    import tempfile

    standin = install(monkeypatch, tmp_path / "npumoe-cache")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    model, _ = random_model(MODEL)
    plan = first_layer_plan(model_spec(model), 16)
    package = built(tmp_path, plan, model).package
    before = set(tmp.iterdir())
    group = plan.layers[0].groups[0]
    spec = GroupSpec(0, 0, tuple(group.experts), tuple(group.capacities), moe_layers(model)[0].experts)
    x = torch.randn(sum(group.capacities), model.config.hidden_size)
    caplog.set_level("INFO", logger="npumoe")
    first, second = AneBackend(package), AneBackend(package)
    assert torch.equal(first.prepare(spec)(x), second.prepare(spec)(x))
    assert (first.compiles, second.compiles) == ({"compiled": 1}, {"reused": 1})
    assert standin.calls["compile"] == 1 and "not compiled again" in caplog.text
    assert set(tmp.iterdir()) == before  # the compile staged beside its cache entry, not in the temp folder
    assert [p.name for p in (tmp_path / "npumoe-cache" / "coreml-compiled").iterdir()] == [
        f"{next(iter(first._compiled.values())).split('/')[-1]}"]


def test_coreml_standin_compressed_package_for_an_fp16_plan_is_refused(tmp_path, monkeypatch, capsys):
    """A package built with --compress int8 for a plan of fp16 groups: `run --package` refuses it in one line naming
    the function, exit 2 (it computed other numbers than the plan was searched and gated for)."""
    from autotune.cli import main
    from runtime.plan import save_plan

    install(monkeypatch, tmp_path / "npumoe-cache")
    model, _ = random_model(MODEL)
    plan = first_layer_plan(model_spec(model), 16)
    save_plan(plan, tmp_path / "plan.json")
    package = built(tmp_path, plan, model, compress="int8").package
    rc = main(["run", "--model", MODEL, "--plan", str(tmp_path / "plan.json"), "--package", package,
               "--max-tokens", "32", "--json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "function layer0_group0 stores its weights as int8" in err[0] and "compress none" in err[0]


def test_coreml_standin_profile_rotates_groups_over_experts(monkeypatch):
    """profile-device's Core ML caller cycles its calls through functions over other experts (as the other
    backends' groups rotate), each fed as the backend feeds it."""
    from coreml_standin import install_loaded_programs

    from autotune.profiling.callers import make_experts
    from runtime.coreml.coreml_backends import ROTATION, profile_caller

    calls = install_loaded_programs(monkeypatch)
    module = make_experts(32, 32, 16)
    call = profile_caller("CPU_AND_NE")(module, [4, 4], 32)
    seen = []
    for _ in range(2 * ROTATION):
        y = call()["y"]
        seen.append(float(abs(y).sum()))
    assert calls["load"] == ROTATION and calls["predict"] == 2 * ROTATION
    assert len(set(seen[:ROTATION])) == ROTATION and seen[:ROTATION] == seen[ROTATION:]  # other weights each call


def test_coreml_standin_profile_times_dense_functions(monkeypatch):
    """profile-device times the ane backend's dense functions (the builder's q/k/v, o_proj and attention-core
    programs, fed their sample inputs): `dense_matmul` and `attention` records of that backend, which the cost model
    fits as measured prices instead of extrapolating the expert fit."""
    from coreml_standin import install_loaded_programs
    from helpers import TINY_PROFILE

    from autotune.costing.dense_prices import fit_dense
    from autotune.profiling import static_dense_records as sdr
    from runtime.backends import registry

    calls = install_loaded_programs(monkeypatch)
    monkeypatch.setattr(sdr, "ATTENTION_POINTS_QUICK", ((64, 64), (64, 256), (256, 256)))
    records = sdr.static_dense_records(TINY_PROFILE, registry.get("ane"), progress=False)
    kinds = [(r["function"], r.get("m", r.get("rows"))) for r in records]
    assert kinds == [(f, m) for m in (64, 256, 1024) for f in ("qkv", "o_proj")] + [("attention", 64),
                                                                                    ("attention", 64),
                                                                                    ("attention", 256)]
    assert all(r["backend"] == "ane" and r["dtype_bytes"] == 2 and r["median_ms"] > 0 for r in records)
    assert calls["load"] == len(records)
    fits = fit_dense(records)
    assert set(fits) == {"matmul", "attention"} and all(f.source.startswith("measured") for f in fits.values())
