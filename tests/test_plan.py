"""Plan loading: every bad plan gives one FileFormatError naming its field; the CLI exits 2 with one line."""
import copy
import json

import pytest
from helpers import random_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotune.cli import main
from autotune.searching.templates import template_plan
from runtime.errors import FileFormatError
from runtime.executor import PlanExecutor
from runtime.loading.model_loader import model_spec
from runtime.plan import Plan, load_plan, plan_from_json, save_plan


@pytest.fixture(scope="module")
def good():
    model, _ = random_model("random:olmoe")
    return template_plan(model_spec(model), "tight", "drop", chunk_tokens=64).to_json()


def _mutate(obj, path, value):
    obj = copy.deepcopy(obj)
    target = obj
    for key in path[:-1]:
        target = target[key]
    if value is DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return obj


DELETE = object()
BAD = [  # (path, value, field named in the error)
    (["layers", 0, "groups", 0, "experts", 1], 99, "layers[0].groups[0].experts[1]"),  # unknown id
    (["layers", 0, "groups", 0, "experts", 1], 0, "layers[0].groups[0].experts[1]"),  # duplicate in a group
    (["layers", 1, "cpu_exact"], [3], "layers[1].cpu_exact[0]"),  # expert in two places
    (["layers", 0, "groups", 1, "capacities", 2], 0, "layers[0].groups[1].capacities[2]"),
    (["layers", 0, "groups", 1, "capacities", 2], -4, "layers[0].groups[1].capacities[2]"),
    (["layers", 0, "groups", 1, "capacities", 2], 2.5, "layers[0].groups[1].capacities[2]"),
    (["layers", 0, "groups", 1, "capacities", 2], "8", "layers[0].groups[1].capacities[2]"),
    (["layers", 0, "groups", 1, "capacities"], [4, 4], "layers[0].groups[1].capacities"),
    (["layers", 0, "groups", 0, "backend"], "gpu", "layers[0].groups[0].backend"),
    (["layers", 2, "groups"], [], "layers[2]"),  # experts left unplaced
    (["overflow"], "discard", "overflow"),
    (["saliency"], DELETE, "saliency"),
    (["schema"], "npumoe.plan/2", "schema"),
    (["schema"], "npumoe.profile/1", "schema"),
    (["chunk_tokens"], True, "chunk_tokens"),
    (["model", "num_experts"], 0, "model.num_experts"),
    (["layers", 1, "layer"], 0, "layers[1].layer"),
    (["extra"], 1, "extra"),
    (["exact"], "cpu-static", "exact"),  # a static backend is not an exact path
    (["layers", 1, "exact_split"], {"gpu": [0]}, "layers[1].exact_split"),  # no such exact path
    (["chunk_rows"], [32, 96], "chunk_rows[1]"),  # past chunk_tokens (64): the static functions' rows
    (["chunk_rows"], [0], "chunk_rows[0]"),
]


@pytest.mark.parametrize("path,value,field", BAD)
def test_bad_plan_names_field(good, path, value, field):
    with pytest.raises(FileFormatError) as e:
        plan_from_json(_mutate(good, path, value), "p.json")
    assert e.value.field == field, str(e.value)


def test_an_uneven_chunking_is_optional_and_round_trips(good):
    assert plan_from_json(good).chunk_rows is None  # chunks of chunk_tokens
    plan = plan_from_json({**good, "chunk_rows": [48, 64]})
    assert plan.chunk_rows == [48, 64] and plan_from_json(plan.to_json()) == plan


def test_exact_paths_are_optional_and_checked(good):
    assert plan_from_json(good).exact_path == "cpu-exact"  # a plan written before exact paths runs on the CPU
    layer = {**good["layers"][1], "groups": good["layers"][1]["groups"][:1]}
    cold = layer["cpu_exact"] = good["layers"][1]["groups"][1]["experts"]  # the second group's experts run exactly
    split = _mutate(_mutate(good, ["layers", 1], {**layer, "exact_split": {"mlx-exact": cold[:1]}}), ["exact"],
                    "cpu-exact")
    plan = plan_from_json(split)
    lp = plan.layer(good["layers"][1]["layer"])
    assert [lp.exact_path_of(e, plan.exact_path) for e in cold[:2]] == ["mlx-exact", "cpu-exact"]
    stray = _mutate(good, ["layers", 1, "exact_split"], {"mlx-exact": [good["layers"][1]["groups"][0]["experts"][0]]})
    with pytest.raises(FileFormatError) as e:
        plan_from_json(stray, "p.json")
    assert e.value.field == "layers[1].exact_split.mlx-exact" and "not in cpu_exact" in str(e.value)


def _calibrated(good, shares=None, rate=0.05):
    n = good["model"]["num_experts"]
    cal = {"load_shares": shares if shares is not None else [1 / n] * n, "heldout_overflow_rate": rate}
    return _mutate(good, ["layers"], [{**lp, "calibration": cal} for lp in good["layers"]])


def test_calibration_fields_are_optional_and_checked(good):
    old = plan_from_json(good)  # a plan written before calibration statistics existed still loads
    assert not old.calibrated and old.heldout_overflow_rate() is None
    new = plan_from_json(_calibrated(good, rate=0.04))
    assert new.calibrated and new.heldout_overflow_rate() == pytest.approx(0.04)
    assert plan_from_json(new.to_json()) == new
    n = good["model"]["num_experts"]
    for bad, field in [(_calibrated(good, shares=[1.0]), "layers[0].calibration.load_shares"),
                       (_calibrated(good, shares=[0.5 / n] * n), "layers[0].calibration.load_shares"),
                       (_calibrated(good, rate=1.5), "layers[0].calibration.heldout_overflow_rate")]:
        with pytest.raises(FileFormatError) as e:
            plan_from_json(bad, "p.json")
        assert e.value.field == field, str(e.value)


DENSE = {"attention_context_buckets": [64, 128], "layers": [
    {"layer": 0, "qkv": {"backend": "ane-sim"}, "o_proj": {"backend": "cpu-static", "compress": "int8"},
     "attention": "ane-sim", "mlp": {"backend": "ane-sim"}}, {"layer": 3, "attention": "cpu-static"}]}
BAD_DENSE = [  # (path under dense, value, field named in the error)
    (["attention_context_buckets", 1], 96, "dense.attention_context_buckets[1]"),  # not a multiple of the chunk
    (["attention_context_buckets"], [128, 64], "dense.attention_context_buckets[1]"),  # not ascending
    (["attention_context_buckets", 0], 0, "dense.attention_context_buckets[0]"),
    (["layers", 1, "layer"], 4, "dense.layers[1].layer"),  # past the model's 4 decoder layers
    (["layers", 1, "layer"], 0, "dense.layers[1].layer"),  # twice
    (["layers", 0, "qkv", "backend"], "gpu", "dense.layers[0].qkv.backend"),
    (["layers", 0, "attention"], "gpu", "dense.layers[0].attention"),
    (["layers", 0, "mlp", "compress"], "int3", "dense.layers[0].mlp.compress"),
    (["layers", 0, "o_proj", "extra"], 1, "dense.layers[0].o_proj.extra"),
    (["layers"], DELETE, "dense.layers"),
]


def test_dense_placement_is_optional_and_round_trips(good):
    assert plan_from_json(good).dense is None  # a plan written before dense placement loads as it was
    plan = plan_from_json({**good, "dense": DENSE})
    assert plan.dense.layers[0].o_proj.compression == "int8" and plan.dense.layers[0].qkv.compression == "none"
    assert plan.dense.layers[1].qkv is None and plan.dense.layers[1].attention == "cpu-static"
    assert plan_from_json(plan.to_json()) == plan and plan.to_json()["dense"] == DENSE


@pytest.mark.parametrize("path,value,field", BAD_DENSE)
def test_bad_dense_placement_names_field(good, path, value, field):
    with pytest.raises(FileFormatError) as e:
        plan_from_json({**good, "dense": _mutate(DENSE, path, value)}, "p.json")
    assert e.value.field == field, str(e.value)


def test_plan_for_other_model_refused(good):
    model, _ = random_model("random:olmoe")
    bad = plan_from_json(_mutate(good, ["model", "fingerprint"], "sha256:00"))
    with pytest.raises(FileFormatError, match="model.fingerprint"):
        PlanExecutor(model, bad)
    other, _ = random_model("random:mixtral")
    with pytest.raises(FileFormatError, match="model.architecture"):
        PlanExecutor(other, plan_from_json(good))


def test_round_trip_and_atomic_save(good, tmp_path):
    p = tmp_path / "plan.json"
    plan = plan_from_json(good)
    save_plan(plan, p)
    assert load_plan(p) == plan
    assert [f.name for f in tmp_path.iterdir()] == ["plan.json"]  # no temp files left behind


@pytest.mark.parametrize("path,value,field", BAD[:4] + BAD[12:13])
def test_cli_exits_2_with_one_line(good, tmp_path, capsys, text_file, path, value, field):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(_mutate(good, path, value)))
    rc = main(["run", "--model", "random:olmoe", "--plan", str(p), "--text", text_file])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and field in err[0], err


def test_cli_truncated_plan(good, tmp_path, capsys, text_file):
    p = tmp_path / "cut.json"
    p.write_text(json.dumps(good)[:200])
    assert main(["run", "--model", "random:olmoe", "--plan", str(p), "--text", text_file]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not valid JSON" in err[0]


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.floats(allow_nan=True), st.text(max_size=5))
json_value = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                         max_size=4), max_leaves=10)


@st.composite
def mangled(draw, base):
    obj = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 4))):
        # walk to a random container and replace, delete or add one entry
        target = obj
        while True:
            keys = list(target.keys()) if isinstance(target, dict) else list(range(len(target)))
            if not keys:
                break
            key = draw(st.sampled_from(keys))
            child = target[key]
            if isinstance(child, (dict, list)) and draw(st.booleans()):
                target = child
                continue
            action = draw(st.sampled_from(["replace", "delete", "add"]))
            if action == "replace":
                target[key] = draw(json_value)
            elif action == "delete":
                del target[key]
            elif isinstance(target, dict):
                target[draw(st.text(max_size=6))] = draw(json_value)
            else:
                target.append(draw(json_value))
            break
    return obj


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mangled_plans_never_crash_the_loader(good, data):
    obj = data.draw(mangled(good))
    try:
        plan = plan_from_json(obj)
    except FileFormatError as e:
        assert e.field and str(e).count("\n") == 0
    else:
        assert isinstance(plan, Plan)


@settings(max_examples=100, deadline=None)
@given(raw=st.binary(max_size=300))
def test_garbage_bytes_give_file_error(tmp_path_factory, raw):
    p = tmp_path_factory.mktemp("g") / "x.json"
    p.write_bytes(raw)
    with pytest.raises(FileFormatError):
        load_plan(p)
