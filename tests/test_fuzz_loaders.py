"""Fuzzing the loaders with Hypothesis: mutations of a valid file (a value of another type or out of range, a key
missing or added, an array of another dtype or shape, the file cut short) either load as valid or raise the
project's one error type (`runtime.errors.NpumoeError`, printed as one line) naming the file; never another
exception.

Each loader runs a bounded, derandomized number of examples (EXAMPLES), so CI runs the same cases every time;
the whole file takes well under a minute on a 2-core host.
"""
from __future__ import annotations

import copy
import io
import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from helpers import random_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotune.calibration.traces import load_traces, synthetic_traces
from autotune.profiling.profile import SHIPPED_PROFILES, ProfileHostWarning, load_profile
from autotune.searching.templates import template_plan
from runtime.coreml.ane import package_bytes, read_manifest
from runtime.errors import NpumoeError
from runtime.loading.model_loader import model_spec
from runtime.loading.model_record import read_model_spec
from runtime.plan import load_plan

MODEL = "random:qwen3_moe"
# Examples per loader (CI runs exactly these; derandomized): the cheap JSON loaders get more.
EXAMPLES = {"plan": 150, "profile": 100, "traces": 100, "manifest": 100, "model_config": 25}


def fuzz(loader: str):
    return settings(max_examples=EXAMPLES[loader], derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- mutations of a decoded JSON document ------------------------------------------------------------------------
ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 1, 2**31, 2**63, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6), st.sampled_from(["0.25", "1", "", "ane"]),
    st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(-2, 2), max_size=2))


def _mutate_once(data: st.DataObject, doc: Any) -> Any:
    """One change at a random place: a value replaced, a key (or item) removed, a key (or item) added."""
    holder, key, node = None, None, doc
    for _ in range(data.draw(st.integers(0, 6), label="depth")):
        if isinstance(node, dict) and node:
            k = data.draw(st.sampled_from(sorted(node)), label="key")
        elif isinstance(node, list) and node:
            k = data.draw(st.integers(0, len(node) - 1), label="index")
        else:
            break
        holder, key, node = node, k, node[k]
    op = data.draw(st.sampled_from(["replace", "remove", "add"]), label="op")
    if op == "add" and isinstance(node, (dict, list)):
        value = data.draw(ODD_VALUES, label="added")
        if isinstance(node, dict):
            node[data.draw(st.sampled_from(["extra", "", "x y", *sorted(node)[:3]]), label="new key")] = value
        else:
            node.append(value)
    elif op == "remove" and holder is not None:
        del holder[key]
    elif holder is not None:
        holder[key] = data.draw(ODD_VALUES, label="value")
    else:
        return data.draw(ODD_VALUES, label="root")
    return doc


def mutated_text(data: st.DataObject, doc: Any) -> str:
    """The document after 1-3 changes, as JSON text, possibly cut short."""
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3), label="changes")):
        doc = _mutate_once(data, doc)
    text = json.dumps(doc)
    if data.draw(st.booleans(), label="truncate?") and data.draw(st.booleans(), label="really?"):
        text = text[:data.draw(st.integers(0, max(0, len(text) - 1)), label="cut at")]
    return text


def loads_or_refuses(load: Callable[[], Any], names: str) -> None:
    """The property: a valid load, or NpumoeError whose message names `names` (the file); nothing else."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ProfileHostWarning)
            load()
    except NpumoeError as e:
        assert names in str(e), str(e)


@pytest.fixture(scope="module")
def work() -> Path:
    d = Path(tempfile.mkdtemp(prefix="npumoe-fuzz-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# --- plan ---------------------------------------------------------------------------------------------------------
@fuzz("plan")
@given(data=st.data())
def test_plan_loader(work, data):
    spec = model_spec(random_model(MODEL)[0])
    plan = template_plan(spec, "tight", "spill", "cpu-static", 64).to_json()
    plan["layers"][0]["calibration"] = {"load_shares": [1 / spec.num_experts] * spec.num_experts,
                                        "heldout_overflow_rate": 0.05}
    path = work / "plan.json"
    path.write_text(mutated_text(data, plan))
    loads_or_refuses(lambda: load_plan(path), str(path))


# --- profile ------------------------------------------------------------------------------------------------------
@fuzz("profile")
@given(data=st.data())
def test_profile_loader(work, data):
    doc = json.loads((SHIPPED_PROFILES / "linux-xeon-2c-quick.json").read_text())
    doc["records"] = doc["records"][:12]  # every kind of record is in the first few; the rest adds only time
    path = work / "profile.json"
    path.write_text(mutated_text(data, doc))
    loads_or_refuses(lambda: load_profile(path), str(path))


# --- traces -------------------------------------------------------------------------------------------------------
def _valid_traces(work: Path) -> dict[str, np.ndarray]:
    good = work / "good-traces.npz"
    if not good.exists():
        from autotune.calibration.traces import record_traces, save_traces

        model, tok = random_model(MODEL)
        ids = torch_ids(tok)
        save_traces(record_traces(model, ids, 8, 16, "inline", progress=False), good)
    with np.load(good) as z:
        return {k: z[k] for k in z.files}


def torch_ids(tok):
    import torch

    return torch.tensor(tok.encode("Routing skews toward a few experts; the rest idle. " * 2)[:80])


def _mutate_arrays(data: st.DataObject, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    arrays = dict(arrays)
    name = data.draw(st.sampled_from(sorted(arrays)), label="array")
    a = arrays[name]
    op = data.draw(st.sampled_from(["header", "remove", "extra", "dtype", "shape", "shorter", "value"]), label="op")
    if (op == "header" or name == "header" and op == "value") and "header" in arrays:
        try:
            header = json.loads(arrays["header"].tobytes())
        except ValueError:  # cut short by an earlier change: leave it so
            return arrays
        arrays["header"] = np.frombuffer(mutated_text(data, header).encode(), dtype=np.uint8)
    elif op == "remove":
        del arrays[name]
    elif op == "extra":
        arrays[data.draw(st.sampled_from(["L9_idx", "L0_counts", "junk", "chunk"]), label="extra")] = a[:3]
    elif op == "dtype":
        arrays[name] = a.astype(data.draw(st.sampled_from(["float32", "int64", "bool", "uint8", "int8", "float16"]),
                                          label="dtype"))
    elif op == "shape":
        arrays[name] = a.reshape(-1) if a.ndim > 1 else a[:, None]
    elif op == "shorter":
        arrays[name] = a[: data.draw(st.integers(0, max(0, len(a) - 1)), label="length")]
    elif a.size:
        a = a.copy()
        flat = a.reshape(-1)
        i = data.draw(st.integers(0, flat.size - 1), label="at")
        value = data.draw(st.sampled_from([-1, 0, 1, 7, 8, 255, 10**6, float("nan"), float("inf")]), label="to")
        try:
            flat[i] = value
        except (ValueError, OverflowError):  # nan into an integer array: not a value the file can hold
            pass
        arrays[name] = a
    return arrays


@fuzz("traces")
@given(data=st.data())
def test_traces_loader(work, data):
    arrays = _valid_traces(work)
    for _ in range(data.draw(st.integers(1, 2), label="changes")):
        arrays = _mutate_arrays(data, arrays)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    raw = buf.getvalue()
    if data.draw(st.booleans(), label="truncate?") and data.draw(st.booleans(), label="really?"):
        raw = raw[:data.draw(st.integers(0, len(raw) - 1), label="cut at")]
    path = work / "traces.npz"
    path.write_bytes(raw)

    def load_and_count() -> None:
        traces = load_traces(path)
        for layer in traces.layers:
            traces.counts(layer, "all")

    loads_or_refuses(load_and_count, str(path))


def test_synthetic_traces_survive_the_loader(work):
    """Counts-only traces (the other form) load back as written."""
    from autotune.calibration.traces import save_traces

    spec = model_spec(random_model(MODEL)[0]).to_json()
    path = work / "synthetic.npz"
    save_traces(synthetic_traces(spec, 10, 32), path)
    assert load_traces(path).counts(spec["moe_layers"][0], "all").sum() == 10 * 32 * spec["top_k"]


# --- build manifest -----------------------------------------------------------------------------------------------
@fuzz("manifest")
@given(data=st.data())
def test_manifest_loader(work, data):
    for i in (1, 2):
        part = work / f"g.part{i}.mlpackage"
        part.mkdir(exist_ok=True)
        (part / "Manifest.json").write_text("{}" * i)
    doc = {"schema": "npumoe.manifest/1", "model_fingerprint": "sha256:0", "layout": "matmul", "compress": "none",
           "function_weight_limit_bytes": 1500000000, "package_weight_limit_bytes": 2000000000,
           "packages": [{"path": f"g.part{i}.mlpackage", "functions": [f"layer{i}_group0"], "weight_bytes": 10,
                         "bytes": package_bytes(work / f"g.part{i}.mlpackage")} for i in (1, 2)]}
    path = work / "g.manifest.json"
    path.write_text(mutated_text(data, doc))
    loads_or_refuses(lambda: read_manifest(path), str(path))


# --- model config -------------------------------------------------------------------------------------------------
@fuzz("model_config")
@given(data=st.data())
def test_model_config_loader(work, data):
    model_dir = work / "model"
    if not model_dir.exists():
        random_model(MODEL)[0].save_pretrained(model_dir)
        shutil.copy(model_dir / "config.json", work / "config.good.json")
    config = json.loads((work / "config.good.json").read_text())
    (model_dir / "config.json").write_text(mutated_text(data, config))
    loads_or_refuses(lambda: read_model_spec(str(model_dir)), str(model_dir))
