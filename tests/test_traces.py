"""Routing traces: per-chunk counts from recorded assignments, the held-out split, the .npz round trip, one clear
error for bad files, and a real recording on a random model."""
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import random_model

from autotune.calibration.traces import (
    HELDOUT_EVERY,
    SCHEMA,
    Traces,
    default_traces_path,
    load_traces,
    record_traces,
    save_traces,
    synthetic_traces,
)
from runtime.errors import FileFormatError
from runtime.loading.model_loader import model_spec

SPEC = dict(architecture="x", model_type="qwen3_moe", num_layers=2, moe_layers=[0, 1], num_experts=3, top_k=2,
            hidden_size=8, expert_ffn_size=4, fingerprint="t")


def _recorded() -> Traces:
    """Three tokens, two chunks (the second held out), top-2 of three experts in layers 0 and 1."""
    idx = np.array([[0, 1], [1, 2], [0, 2]], dtype=np.int16)
    layer = {"idx": idx, "weight": np.full((3, 2), 0.5, np.float32), "norm": np.ones(3, np.float32)}
    header = {"schema": SCHEMA, "model": SPEC, "n_chunks": 2, "chunk_tokens": 2, "prompt_tokens": 2, "tokens": 3}
    return Traces(header, {0: layer, 1: dict(layer)}, np.array([0, 0, 1], np.int32), np.array([False, True]))


def test_counts_are_assignments_per_expert_per_chunk_by_split():
    t = _recorded()
    assert t.counts(0, "all").tolist() == [[1, 2, 1], [1, 0, 1]]
    assert t.counts(0, "calib").tolist() == [[1, 2, 1]]
    assert t.counts(0, "heldout").tolist() == [[1, 0, 1]]


def test_recorded_traces_round_trip_through_npz(tmp_path):
    path = tmp_path / "sub" / "t.npz"
    save_traces(_recorded(), path)
    back = load_traces(path)
    assert back.header == _recorded().header and back.n_chunks == 2
    assert back.heldout_chunks.tolist() == [False, True]
    np.testing.assert_array_equal(back.layers[1]["idx"], _recorded().layers[1]["idx"])
    assert back.counts(1, "all").tolist() == [[1, 2, 1], [1, 0, 1]]


def test_synthetic_traces_hold_chunk_tokens_times_top_k_per_chunk(tmp_path):
    t = synthetic_traces(SPEC, n_chunks=10, chunk_tokens=32, seed=3)
    assert t.heldout_chunks.tolist() == [i % 5 == 4 for i in range(10)]
    for layer in SPEC["moe_layers"]:
        assert t.counts(layer, "all").sum(1).tolist() == [32 * 2] * 10
        assert t.counts(layer, "calib").shape == (8, 3)
    save_traces(t, tmp_path / "s.npz")
    back = load_traces(tmp_path / "s.npz")
    np.testing.assert_array_equal(back.counts(0, "heldout"), t.counts(0, "heldout"))


def test_record_traces_on_a_random_model_counts_every_assignment():
    model, tok = random_model("random:qwen3_moe")
    spec = model_spec(model)
    ids = torch.tensor(tok.encode("routing traces on a seeded random model " * 8)[:60])
    t = record_traces(model, ids, chunk_tokens=8, prompt_tokens=10, text="inline", progress=False)
    prompts = -(-60 // 10)
    assert t.n_chunks == 2 * prompts  # each 10-token prompt is an 8-token and a 2-token chunk
    assert t.heldout_chunks.sum() == 2 * (prompts // HELDOUT_EVERY)
    assert t.header["model"] == spec.to_json() and t.header["tokens"] == 60
    for layer in spec.moe_layers:
        assert t.counts(layer, "all").sum() == 60 * spec.top_k
        assert t.layers[layer]["norm"].shape == (60,)


def test_record_traces_never_computes_the_lm_head_and_sees_what_a_full_forward_routes():
    from autotune.calibration.modelstats import expert_counts

    model, tok = random_model("random:olmoe")
    ids = torch.tensor(tok.encode("the LM head's logits are not what calibration records " * 4)[:64])
    calls = []
    handle = model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        t = record_traces(model, ids, chunk_tokens=64, prompt_tokens=64, text="inline", progress=False)
    finally:
        handle.remove()
    assert calls == []
    full = expert_counts(model, ids.tolist(), chunk=64)  # routing seen through the whole CausalLM forward
    np.testing.assert_array_equal(np.stack([t.counts(l, "all").sum(0) for l in model_spec(model).moe_layers]), full)


def _npz(path: Path, **arrays) -> Path:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    path.write_bytes(buf.getvalue())
    return path


def _header(**change) -> np.ndarray:
    h = {"schema": SCHEMA, "model": SPEC, "n_chunks": 2, "chunk_tokens": 2, **change}
    return np.frombuffer(json.dumps(h).encode(), dtype=np.uint8)


@pytest.mark.parametrize("arrays,field", [
    ({}, "header"),
    ({"header": np.frombuffer(b"{not json", dtype=np.uint8)}, "header"),
    ({"header": _header(schema="npumoe.traces/2")}, "schema"),
    ({"header": _header(schema="npumoe.plan/1")}, "schema"),
    ({"header": _header(), "L0_counts": np.zeros((2, 3), int), "heldout_chunks": np.zeros(2, bool)}, "layers"),
    ({"header": _header(), "L0_counts": np.zeros((2, 3), int), "L1_counts": np.zeros((2, 3), int),
      "heldout_chunks": np.zeros(3, bool)}, "heldout_chunks"),
    ({"header": _header(), "L0_counts": np.array([None, 1], dtype=object)}, "file"),  # pickle is never loaded
])
def test_bad_traces_give_one_error_naming_the_field(tmp_path, arrays, field):
    with pytest.raises(FileFormatError) as e:
        load_traces(_npz(tmp_path / "bad.npz", **arrays))
    assert e.value.field == field and e.value.kind == "traces"


def test_missing_and_non_npz_files_are_file_errors(tmp_path):
    with pytest.raises(FileFormatError, match="no such file"):
        load_traces(tmp_path / "none.npz")
    (tmp_path / "t.npz").write_text("not a zip")
    with pytest.raises(FileFormatError, match="not a readable .npz"):
        load_traces(tmp_path / "t.npz")


def test_default_path_is_safe_for_any_model_name():
    assert default_traces_path("random:qwen3_moe") == Path("traces") / "random_qwen3_moe.npz"
    assert default_traces_path("org/model") == Path("traces") / "org_model.npz"


def test_header_model_is_a_model_spec(tmp_path):
    bad = dict(SPEC, num_experts="three")
    arrays = {"header": _header(model=bad), "L0_counts": np.zeros((2, 3), int), "L1_counts": np.zeros((2, 3), int),
              "heldout_chunks": np.zeros(2, bool)}
    with pytest.raises(FileFormatError) as e:
        load_traces(_npz(tmp_path / "bad.npz", **arrays))
    assert e.value.field == "header.model.num_experts"
