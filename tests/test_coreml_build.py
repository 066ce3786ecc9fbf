"""`autotune build` on Linux: the package, its lint, the host numeric check, weight sharing, the cache, limits."""
import json

import pytest
from helpers import one_ane_group, random_model

from autotune.cli import main
from autotune.searching.templates import template_plan
from runtime.coreml.ane import function_name
from runtime.coreml.ane_limits import MAX_AXIS
from runtime.coreml.converter import (
    FunctionSpec,
    build_package,
    convert_function,
    merge_functions,
    package_bytes,
    quiet_coremltools_import,
)
from runtime.errors import NpumoeError
from runtime.loading.model_loader import TINY_MOE_DIR, load_model, model_spec, moe_layers
from runtime.plan import Group, save_plan

quiet_coremltools_import()
MODEL = "random:qwen3_moe"


def _layers(model):
    return {layer.index: layer.experts for layer in moe_layers(model)}


@pytest.mark.slow
def test_cli_build_all_ane_lints_checks_and_prints_json_last(tmp_path, capsys):
    model, _ = random_model(MODEL)
    plan_path = tmp_path / "plan.json"
    save_plan(template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=16), plan_path)
    out = tmp_path / "g.mlpackage"
    rc = main(["build", "--model", MODEL, "--plan", str(plan_path), "--out", str(out), "--no-progress",
               "--cache-dir", str(tmp_path / "cache")])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["functions"] == 8  # 4 layers x 2 groups of 4 experts
    assert report["max_rel_error"] <= 1e-2
    assert report["package_bytes"] == package_bytes(out)
    assert report["unique_weight_bytes"] == 4 * 8 * 3 * 64 * 48 * 2
    # Random models are small: the program text is a visible share; weights themselves are stored once.
    assert report["package_bytes"] <= 1.25 * report["unique_weight_bytes"]

    import coremltools as ct

    spec = ct.utils.load_spec(str(out))
    names = {f.name for f in spec.description.functions}
    assert names == {function_name(layer, g) for layer in range(4) for g in range(2)}
    for f in spec.description.functions:
        assert list(f.input[0].type.multiArrayType.shape) == [64, 64]  # 4 experts x capacity 16, hidden 64
        assert f.input[0].type.multiArrayType.dataType == ct.proto.FeatureTypes_pb2.ArrayFeatureType.FLOAT16
        assert (f.input[0].name, f.output[0].name) == ("x", "y")


def test_conv1x1_layout_and_cache(tmp_path):
    model, _ = random_model(MODEL)
    plan = one_ane_group(template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=8))
    cache = tmp_path / "cache"
    first = build_package(_layers(model), plan, tmp_path / "a.mlpackage", "conv1x1", cache_dir=cache)
    assert len(first.functions) == 1 and first.cached == 0
    assert first.max_rel_error <= 1e-2
    import coremltools as ct

    shape = list(ct.utils.load_spec(str(tmp_path / "a.mlpackage")).description.functions[0].input[0]
                 .type.multiArrayType.shape)
    assert shape == [1, 64, 1, 32]  # channels first [1, H, 1, slots]
    again = build_package(_layers(model), plan, tmp_path / "b.mlpackage", "conv1x1", cache_dir=cache)
    assert again.cached == 1 and again.max_rel_error == first.max_rel_error
    other = build_package(_layers(model), plan, tmp_path / "c.mlpackage", "matmul", cache_dir=cache)
    assert other.cached == 0  # the layout is part of the cache key


@pytest.mark.parametrize("compress", ["int8", "palettize4"])
def test_compressed_build_is_smaller_and_within_its_tolerance(tmp_path, compress):
    from runtime.coreml.mil_eval import TOLERANCE

    model, _ = random_model(MODEL)
    plan = one_ane_group(template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=8))
    result = build_package(_layers(model), plan, tmp_path / "q.mlpackage", compress=compress,
                           cache_dir=tmp_path / "cache")
    assert 1e-3 < result.max_rel_error <= TOLERANCE[compress]  # compression shows, within what it allows
    assert result.package_bytes < result.unique_weight_bytes


def test_each_group_is_compressed_as_the_plan_says_unless_overridden(tmp_path):
    from runtime.coreml.mil_eval import TOLERANCE

    model, _ = random_model(MODEL)
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=8)
    lp = plan.layers[0]  # layer 0: group 0 int8, group 1 fp16 (absent); other layers on cpu-static
    groups = [lp.groups[0].model_copy(update={"compress": "int8"}), lp.groups[1]]
    layers = [lp.model_copy(update={"groups": groups})]
    layers += [l.model_copy(update={"groups": [g.model_copy(update={"backend": "cpu-static"}) for g in l.groups]})
               for l in plan.layers[1:]]
    plan = plan.model_copy(update={"layers": layers})
    mixed = build_package(_layers(model), plan, tmp_path / "m.mlpackage", cache_dir=tmp_path / "cache")
    assert [fs.compress for fs in mixed.functions] == ["int8", "none"] and mixed.compress == "mixed"
    assert mixed.packages[0]["weight_bytes"] == 4 * 3 * 64 * 48 * (1 + 2)  # 4 experts int8 + 4 in fp16
    worst = {c.function: c.max_rel_error for c in mixed.checks}
    assert worst[function_name(0, 0)] <= TOLERANCE["int8"] and worst[function_name(0, 1)] <= TOLERANCE["none"]
    meta = json.loads((tmp_path / "m.manifest.json").read_text())
    assert meta["compress"] == "mixed"
    forced = build_package(_layers(model), plan, tmp_path / "p.mlpackage", compress="palettize4",
                           cache_dir=tmp_path / "cache")
    assert {fs.compress for fs in forced.functions} == {"palettize4"} and forced.compress == "palettize4"
    assert forced.packages[0]["weight_bytes"] == 8 * 3 * 64 * 48 // 2


def test_functions_sharing_an_expert_store_it_once(tmp_path):
    model, _ = random_model(MODEL)
    module = moe_layers(model)[0].experts
    from runtime.coreml.ane import expert_weights_fp16

    weights = {e: expert_weights_fp16(module, e) for e in range(3)}
    a = FunctionSpec(0, 0, (0, 1), (4, 8), 64, 48)
    b = FunctionSpec(0, 1, (1, 2), (16, 8), 64, 48)  # expert 1 again, with another capacity
    parts = []
    for fs in (a, b):
        path = tmp_path / f"{fs.name}.mlpackage"
        convert_function(fs, {e: weights[e] for e in fs.experts}, "matmul", "none", path)
        parts.append((fs, path))
    merged = tmp_path / "shared.mlpackage"
    merge_functions(parts, merged, {"layout": "matmul"})
    weight_bin = sum(p.stat().st_size for p in merged.rglob("weight.bin"))
    three_experts = 3 * 3 * 64 * 48 * 2
    assert three_experts <= weight_bin <= 1.02 * three_experts  # four expert uses, three stored


def test_group_over_an_ane_axis_limit_is_refused_before_conversion(tmp_path):
    model, _ = random_model(MODEL)
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=16)
    big = Group(backend="ane", experts=[4, 5, 6, 7], capacities=[20_000] * 4)
    layers = [plan.layers[0], plan.layers[1].model_copy(update={"groups": [plan.layers[1].groups[0], big]}),
              *plan.layers[2:]]
    plan = plan.model_copy(update={"layers": layers})
    cache = tmp_path / "cache"
    with pytest.raises(NpumoeError, match=r"layer 1 group 1 .*80,000.*65,536"):
        build_package(_layers(model), plan, tmp_path / "x.mlpackage", cache_dir=cache)
    assert not cache.exists() or not any(cache.iterdir())  # nothing was converted
    assert MAX_AXIS == 65_536


def test_cli_refuses_a_group_past_the_function_weight_limit_in_one_line(tmp_path, capsys):
    model, _ = random_model(MODEL)
    plan_path, out, cache = tmp_path / "plan.json", tmp_path / "g.mlpackage", tmp_path / "cache"
    save_plan(template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=16), plan_path)
    group_mb = 4 * 3 * 64 * 48 * 2 / 1e6  # groups of four experts: 0.074 MB of fp16 weights
    rc = main(["build", "--model", MODEL, "--plan", str(plan_path), "--out", str(out), "--no-progress",
               "--cache-dir", str(cache), "--function-weight-mb", str(group_mb / 2)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "layer 0 group 0 (function layer0_group0): weight bytes is 0.1 MB (4 experts)" in err[0]
    assert "split the group into smaller groups" in err[0]
    assert not out.exists() and not (tmp_path / "g.manifest.json").exists()
    assert not cache.exists() or not any(cache.iterdir())  # refused before any conversion


def test_plan_without_ane_groups_is_refused(tmp_path):
    model, _ = random_model(MODEL)
    plan = template_plan(model_spec(model), "ample", backend="cpu-static", chunk_tokens=16)
    with pytest.raises(NpumoeError, match="no group on the ane backend"):
        build_package(_layers(model), plan, tmp_path / "x.mlpackage", cache_dir=tmp_path / "cache")


@pytest.mark.skipif(not (TINY_MOE_DIR / "config.json").exists(),
                    reason=f"the embedded model tiny-moe is missing ({TINY_MOE_DIR}); random models cover the rest")


@pytest.mark.slow
def test_tiny_moe_all_ane_build(tmp_path):
    model, _ = load_model("tiny-moe")
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=32)
    result = build_package(_layers(model), plan, tmp_path / "tiny.mlpackage", cache_dir=tmp_path / "cache")
    assert result.max_rel_error <= 1e-2
    assert result.package_bytes <= 1.05 * result.unique_weight_bytes




def test_a_large_build_leaves_no_second_copy_in_the_cache(tmp_path, monkeypatch):
    """Past CACHE_KEEP_BYTES the converted functions live in the build's work folder and go once merged."""
    import runtime.coreml.converter as cb

    monkeypatch.setattr(cb, "CACHE_KEEP_BYTES", 1)
    model, _ = random_model(MODEL)
    plan = one_ane_group(template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=16))
    cache = tmp_path / "cache"
    result = build_package(_layers(model), plan, tmp_path / "x.mlpackage", cache_dir=cache)
    assert result.max_rel_error <= 1e-2 and (tmp_path / "x.mlpackage").is_dir()
    assert not cache.exists() or not any(cache.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.manifest.json", "x.mlpackage"]


def test_build_refuses_functions_past_the_ane_window_before_converting(tmp_path, monkeypatch):
    """Everything resident at once, experts and dense functions together, against one window (here shrunk so that
    tiny weights pass it): refused in one line naming both parts, before any conversion."""
    from runtime.coreml import ane_limits

    model, _ = random_model(MODEL)
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=16, dense="ane")
    monkeypatch.setattr(ane_limits, "WINDOW_BYTES", 600_000)  # holds the experts (589,824 B) alone, not q/k/v beside
    with pytest.raises(NpumoeError, match=r"experts 0\.6 MB \+ dense functions 0\.1 MB = 0\.7 MB .* window of 0\.6"):
        build_package(_layers(model), plan, tmp_path / "w.mlpackage", cache_dir=tmp_path / "cache", dense_model=model)
    assert not (tmp_path / "cache").exists()
