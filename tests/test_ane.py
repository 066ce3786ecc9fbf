"""The `ane` backend: unavailable off macOS (the runtime falls back to ane-sim and says so once); on macOS,
prediction parity with cpu-static, op placement on the Neural Engine, and energy windows."""
import copy
import logging
import sys

import numpy as np
import pytest
import torch
from helpers import random_model

from autotune.searching.templates import template_plan
from runtime.backends import GroupSpec, registry
from runtime.coreml.ane import AneBackend, from_layout, function_name, to_layout
from runtime.errors import FileFormatError, NpumoeError
from runtime.executor import PlanExecutor
from runtime.loading.model_loader import model_spec, moe_layers
from runtime.packages import bind_package, torch_target
from runtime.prefill import max_rel_diff, prefill_logits

MODEL = "random:qwen3_moe"
CHUNK = 16


def _ids(tok, n=40):
    return torch.tensor(tok.encode("Experts on the neural engine, the rest on the CPU. " * 4)[:n])


@pytest.mark.parametrize("layout", ["matmul", "conv1x1"])
def test_layouts_round_trip(layout):
    packed = np.arange(12, dtype=np.float16).reshape(4, 3)
    x = to_layout(packed, layout)
    assert x.shape == ((4, 3) if layout == "matmul" else (1, 3, 1, 4))
    assert np.array_equal(from_layout(x, layout), packed)


def test_function_names_are_per_layer_and_group():
    assert function_name(3, 1) != function_name(1, 3)
    assert function_name(0, 0).isidentifier()


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the non-macOS answer")
def test_unavailable_off_macos_with_the_reason():
    for backend in (AneBackend(None), AneBackend("whatever.mlpackage")):
        ok, reason = backend.available()
        assert not ok and "needs macOS" in reason
    assert AneBackend(None).overlaps_cpu and AneBackend(None).name == "ane"


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the non-macOS fallback")
@pytest.mark.parametrize("given", [False, True])
def test_plan_naming_ane_runs_on_ane_sim_and_says_so_once(given, caplog, tmp_path):
    model, tok = random_model(MODEL)
    ids = _ids(tok)
    ref = prefill_logits(model, ids, CHUNK)
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=CHUNK)
    backends = {"ane": AneBackend(str(tmp_path / "g.mlpackage"))} if given else None
    with caplog.at_level(logging.WARNING, logger="npumoe"):
        with PlanExecutor(model, plan, backends) as ex:
            got = prefill_logits(model, ids, CHUNK)
    said = [r.getMessage() for r in caplog.records if "'ane'" in r.getMessage()]
    assert len(said) == 1 and "needs macOS" in said[0] and "ane-sim" in said[0]
    assert ex.fallbacks == {"ane": "ane-sim"}
    total = ex.stats.total()
    assert total.tokens_per_backend["ane-sim"] == total.assignments and "ane" not in total.tokens_per_backend
    assert 1e-5 < max_rel_diff(got, ref) <= 1e-2  # fp16 inside the groups, as on the Neural Engine


def test_registered_ane_resolves_without_a_package(caplog):
    """A plan naming `ane` with no package resolves through the registry to AneBackend, which declines: its groups
    run on its fallback, ane-sim."""
    with caplog.at_level(logging.WARNING, logger="npumoe"):
        backend = registry.resolve("ane")
    assert backend.name == "ane-sim"
    reason = "needs macOS" if sys.platform != "darwin" else "no Core ML package given"
    assert reason in caplog.text and "not implemented" not in caplog.text


def test_ane_backend_reads_a_manifest_of_several_packages(tmp_path):
    """A build past the package limit is split; the backend finds each group's function in its package and checks
    its metadata (experts, capacities, weights) here on Linux; prediction itself stays macOS-only."""
    import json

    from runtime.coreml.converter import build_package, quiet_coremltools_import

    quiet_coremltools_import()
    model, _ = random_model(MODEL)
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=CHUNK)
    layers = [lp.model_copy(update={"groups": [g.model_copy(update={"backend": "ane" if li < 2 and gi == 0
                                                                    else "cpu-static"})
                                               for gi, g in enumerate(lp.groups)]})
              for li, lp in enumerate(plan.layers)]
    plan = plan.model_copy(update={"layers": layers})  # two ANE functions: layer 0 group 0, layer 1 group 0
    group_bytes = 4 * 3 * 64 * 48 * 2
    result = build_package({l.index: l.experts for l in moe_layers(model)}, plan, tmp_path / "g.mlpackage",
                           cache_dir=tmp_path / "cache", package_weight_bytes=1.5 * group_bytes)
    manifest = json.loads((tmp_path / "g.manifest.json").read_text())
    assert manifest["schema"] == "npumoe.manifest/1" and result.manifest == str(tmp_path / "g.manifest.json")
    assert [pk["path"] for pk in manifest["packages"]] == ["g.part1.mlpackage", "g.part2.mlpackage"]
    assert [pk["functions"] for pk in manifest["packages"]] == [["layer0_group0"], ["layer1_group0"]]
    assert all(pk["weight_bytes"] == group_bytes for pk in manifest["packages"])
    assert not (tmp_path / "g.mlpackage").exists()
    backend = AneBackend(result.manifest)
    for li in (0, 1):
        layer = moe_layers(model)[li]
        g = plan.layers[li].groups[0]
        spec = GroupSpec(layer.index, 0, tuple(g.experts), tuple(g.capacities), layer.experts)
        assert backend.check(spec) == str(tmp_path / f"g.part{li + 1}.mlpackage")
        assert backend.metadata(backend.check(spec))["functions"][function_name(li, 0)]["experts"] == g.experts
    wrong = GroupSpec(0, 0, tuple(g.experts), tuple(c + 1 for c in g.capacities), moe_layers(model)[0].experts)
    with pytest.raises(NpumoeError, match="g.part1.mlpackage: function layer0_group0 was built for"):
        backend.check(wrong)
    with pytest.raises(NpumoeError, match="has no function layer2_group0"):
        backend.check(GroupSpec(2, 0, tuple(g.experts), tuple(g.capacities), moe_layers(model)[2].experts))
    # binding the package checks the same on any host, for every ane group of the plan, before the plan runs
    assert bind_package(result.manifest, plan, torch_target(model))["ane"].packages() == backend.packages()
    # a part whose size is not the one the build recorded (cut short, or replaced) is refused, naming the field
    part2 = max((p for p in (tmp_path / "g.part2.mlpackage").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
    part2.write_bytes(part2.read_bytes()[:-1])
    with pytest.raises(FileFormatError, match=r"g.manifest.json\): packages\[1\].bytes: .* the build recorded"):
        bind_package(result.manifest, plan, torch_target(model))["ane"]


# --- macOS only: these need Core ML's runtime and the Neural Engine ---

def _build(tmp_path_factory, dense: str | None = None):
    """The random model's "ample" plan on ane (with its dense functions there too, `dense`), built."""
    from runtime.coreml.converter import build_package

    model, _ = random_model(MODEL)
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=CHUNK, dense=dense,
                         context_tokens=2 * CHUNK if dense else None)
    out = tmp_path_factory.mktemp("ane") / "g.mlpackage"
    build_package({l.index: l.experts for l in moe_layers(model)}, plan, out,
                  cache_dir=tmp_path_factory.mktemp("cache"), dense_model=model if dense else None)
    return model, plan, str(out)


def _prefill_on_the_ane(model, plan, package):
    """(logits under the plan with the package on ane, the unmodified model's, the executor after it ran)."""
    _, tok = random_model(MODEL)
    ids = _ids(tok)
    ref = prefill_logits(model, ids, CHUNK)
    with PlanExecutor(model, plan, {"ane": AneBackend(package)}) as ex:
        got = prefill_logits(model, ids, CHUNK)
    return got, ref, ex


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _build(tmp_path_factory)


@pytest.mark.macos
def test_macos_predict_parity_with_cpu_static(built):
    model, plan, package = built
    layer = moe_layers(model)[0]
    group = plan.layers[0].groups[0]
    spec = GroupSpec(layer.index, 0, tuple(group.experts), tuple(group.capacities), layer.experts)
    packed = torch.randn(group.slots, model.config.hidden_size)
    got = AneBackend(package).prepare(spec)(packed)
    from runtime.cpu.cpu_backends import CpuStaticBackend

    ref = CpuStaticBackend().prepare(spec)(packed)
    assert max_rel_diff(got, ref) <= 1e-2


@pytest.mark.macos
def test_macos_plan_runs_on_the_ane(built):
    got, ref, ex = _prefill_on_the_ane(*built)
    assert ex.fallbacks == {}
    assert ex.stats.total().tokens_per_backend["ane"] > 0
    assert max_rel_diff(got, ref) <= 2e-2


@pytest.mark.macos
def test_macos_ops_are_placed_on_the_neural_engine(built):
    import platform

    from runtime.coreml.ane import ops_not_on_ane
    from runtime.macos import macos_version

    if macos_version() < (14, 4):
        pytest.skip(f"MLComputePlan needs macOS 14.4+, this is {platform.mac_ver()[0]}")
    model, plan, package = built
    backend = AneBackend(package)
    backend._load(function_name(plan.layers[0].layer, 0), package)
    assert ops_not_on_ane(backend.compute_plan(), function_name(plan.layers[0].layer, 0)) == []


@pytest.mark.macos
def test_macos_energy_windows(built):
    pytest.importorskip("zeus_apple_silicon", reason="energy needs zeus-apple-silicon on macOS (extra: energy)")
    model, plan, package = built
    layer = moe_layers(model)[0]
    group = plan.layers[0].groups[0]
    backend = AneBackend(package)
    fn = backend.prepare(GroupSpec(layer.index, 0, tuple(group.experts), tuple(group.capacities), layer.experts))
    for _ in range(20):
        fn(torch.randn(group.slots, model.config.hidden_size))
    totals = backend.energy[function_name(layer.index, 0)]
    assert totals["calls"] == 20 and "ane_mj" in totals


@pytest.fixture(scope="module")
def built_dense(tmp_path_factory):
    return _build(tmp_path_factory, dense="ane")


@pytest.mark.macos
def test_macos_dense_functions_run_on_the_ane(built_dense):
    """The plan's attention projections and attention core run from the package through Core ML: no fallback to
    ane-sim, within fp16's error of the unmodified model."""
    got, ref, ex = _prefill_on_the_ane(*built_dense)
    calls = ex.dense.to_json()
    assert calls["qkv"].get("ane", 0) > 0 and calls["attention"].get("ane", 0) > 0, calls
    assert max_rel_diff(got, ref) <= 3e-2


def test_a_dense_function_of_another_shape_or_checkpoint_is_refused(built_dense):
    """On any host: the package's dense functions are checked against the plan's before any prediction."""
    import dataclasses

    from runtime.dense.specs import backend_specs

    model, plan, package = built_dense
    backend = AneBackend(package)
    specs = backend_specs(model, plan, "ane")
    assert {s.kind for s in specs} == {"qkv", "o_proj", "attention"}
    for spec in specs:
        assert backend.check_dense(spec) == package
    qkv = next(s for s in specs if s.kind == "qkv")
    with pytest.raises(NpumoeError, match=f"dense function {qkv.name} was built for {CHUNK} rows"):
        backend.check_dense(dataclasses.replace(qkv, rows=CHUNK // 2))
    q = copy.deepcopy(qkv.modules["q"])
    with torch.no_grad():
        q.weight.mul_(1.5)  # another checkpoint's q_proj
    with pytest.raises(NpumoeError, match="holds other weights"):
        backend.check_dense(dataclasses.replace(qkv, modules={**qkv.modules, "q": q}))


def test_coreml_needs_its_native_bridge(monkeypatch):
    """Without coremltools' Core ML runtime bridge nothing compiles or predicts: the backend says so (and the runtime
    falls back) instead of crashing when it loads a package, as `autotune doctor` checks it."""
    from runtime import macos
    from runtime.coreml import ane

    monkeypatch.setattr(macos, "on_macos", lambda: True)
    monkeypatch.setattr(ane, "macos_version", lambda: (15, 2))
    monkeypatch.setitem(sys.modules, "coremltools.libcoremlpython", None)  # importing it raises ImportError
    ok, why = ane.coreml_available()
    assert not ok and "runtime bridge" in why
