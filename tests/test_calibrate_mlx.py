"""`calibrate --engine mlx`: mlx-lm's own model of an MLX folder records the same routing traces as our torch
engine on the same folder and text (tiny-moe converted by mlx-lm to 4 bits, both computing in float32)."""
from __future__ import annotations

import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from helpers import convert_to_mlx  # noqa: E402

from autotune.calibration.mlx_engine import choose_engine  # noqa: E402
from autotune.calibration.stage import calibrate  # noqa: E402
from autotune.calibration.traces import Traces, load_traces, routing_agreement  # noqa: E402
from autotune.cli import main  # noqa: E402
from runtime.errors import NpumoeError  # noqa: E402

# 5 prompts of 128 tokens (the 5th held out), each in chunks of 64
RUN = dict(chunk=64, prompt_tokens=128, max_tokens=640, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    return convert_to_mlx(tmp_path_factory.mktemp("mlx") / "q4g64", 4, 64)


@pytest.fixture(scope="module")
def both(q4, tmp_path_factory):
    out = tmp_path_factory.mktemp("traces")
    return {e: calibrate(str(q4), out=out / f"{e}.npz", engine=e, **RUN) for e in ("torch", "mlx")}


@pytest.fixture(scope="module")
def full_width(tmp_path_factory):
    """tiny-moe as stored (bf16, full width; its rope_theta under rope_parameters, as transformers 5 writes it)."""
    out = tmp_path_factory.mktemp("full")
    return {e: calibrate("tiny-moe", out=out / f"{e}.npz", engine=e, **RUN) for e in ("torch", "mlx")}


@pytest.mark.parametrize("recorded", ["both", "full_width"])
def test_same_expert_choices_as_torch(recorded, request):
    """Every token's experts equal torch's (ties within fp rounding would be counted apart: none here), in the same
    order, with the same router weights and hidden-state norms to fp32 rounding: on the MLX folder and on the
    full-width one."""
    both = request.getfixturevalue(recorded)
    mlx, torch_ = both["mlx"].traces, both["torch"].traces
    assert mlx.header["model"] == torch_.header["model"]  # one model spec: a search cannot tell them apart
    assert np.array_equal(mlx.chunk, torch_.chunk) and np.array_equal(mlx.heldout_chunks, torch_.heldout_chunks)
    agreement = routing_agreement(mlx, torch_)
    assert agreement["tokens"] == 640 * 4
    assert (agreement["agree"], agreement["ties"], agreement["differ"]) == (640 * 4, 0, 0), agreement
    assert agreement["max_weight_diff"] < 1e-5 and agreement["max_norm_rel_diff"] < 1e-5
    for layer in mlx.layers:
        assert np.array_equal(mlx.layers[layer]["idx"], torch_.layers[layer]["idx"])


def test_written_traces_read_back(both):
    result = both["mlx"]
    back = load_traces(result.path)
    assert back.header["engine"] == "mlx" and back.header["device"] == str(mx.default_device())
    assert result.summary["engine"] == "mlx" and result.summary["tokens"] == 640
    for layer, arrays in result.traces.layers.items():
        assert all(np.array_equal(arrays[k], back.layers[layer][k]) for k in arrays)
        assert arrays["idx"].dtype == np.int16 and arrays["weight"].dtype == np.float32
    w = back.layers[0]["weight"]
    assert np.allclose(w.sum(1), 1.0, atol=1e-5) and (w[:, 0] >= w[:, 1]).all()  # qwen3 renormalises; largest first


def _traces(idx, weight) -> Traces:
    idx, weight = np.array(idx, dtype=np.int16), np.array(weight, dtype=np.float32)
    header = {"model": {}, "n_chunks": 1, "tokens": len(idx)}
    return Traces(header, {0: {"idx": idx, "weight": weight, "norm": np.ones(len(idx), np.float32)}},
                  np.zeros(len(idx), np.int32), np.array([False]))


def test_agreement_counts_ties_apart_from_differences():
    a = _traces([[0, 1], [2, 3], [4, 5], [6, 7]], [[0.6, 0.4], [0.5, 0.5], [0.7, 0.3], [0.9, 0.1]])
    b = _traces([[1, 0], [2, 9], [4, 8], [6, 7]], [[0.4, 0.6], [0.50001, 0.49999], [0.8, 0.2], [0.9, 0.1]])
    got = routing_agreement(a, b)
    assert {k: got[k] for k in ("tokens", "agree", "ties", "differ")} == {"tokens": 4, "agree": 2, "ties": 1,
                                                                        "differ": 1}
    assert got["max_weight_diff"] == 0.0  # only the 4th token is routed alike in one order
    with pytest.raises(NpumoeError, match="same tokens"):
        routing_agreement(a, _traces([[0, 1]], [[0.6, 0.4]]))


def test_auto_engine(q4):
    assert choose_engine("auto", str(q4)) == "mlx"  # an MLX folder mlx-lm runs
    assert choose_engine("auto", "tiny-moe") == "torch"  # full width: our loader
    assert choose_engine("auto", "random:qwen3_moe") == "torch"
    assert choose_engine("torch", str(q4)) == "torch"


def test_cli_json_and_refusals(q4, tmp_path, capsys):
    out = tmp_path / "t.npz"
    code = main(["calibrate", "--model", str(q4), "--engine", "mlx", "--dtype", "float32", "--chunk", "64",
                 "--prompt-tokens", "64", "--max-tokens", "320", "--out", str(out), "--threads", "1", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["engine"] == "mlx" and summary["chunks"] == 5 and summary["heldout_chunks"] == 1
    assert summary["seconds"] > 0 and "mlx_peak_gb" in summary["memory"]
    assert load_traces(out).n_chunks == 5
    for extra, needle in ((["--model", "random:qwen3_moe"], "--engine mlx: random:qwen3_moe is built by transformers"),
                          (["--model", str(q4), "--cpu-weights", "int8"], "--cpu-weights is how the torch engine")):
        code = main(["calibrate", "--engine", "mlx", "--out", str(tmp_path / "x.npz"), *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and needle in err[0], err


def test_full_width_on_mlx_cpu_computes_in_float32_by_default(full_width, tmp_path, capsys, caplog):
    """`calibrate --model tiny-moe --engine mlx` (dtype auto) on MLX's CPU: its bf16 experts' gather_mm takes
    float32 only (a traceback before); auto computes in float32, said once, and records what float32 records; a
    half dtype asked for is refused in one line, nothing written."""
    if mx.default_device() != mx.cpu:
        pytest.skip("MLX's GPU multiplies bf16 experts")
    out = tmp_path / "auto.npz"
    caplog.clear()
    assert main(["calibrate", "--model", "tiny-moe", "--engine", "mlx", "--chunk", "64", "--prompt-tokens", "128",
                 "--max-tokens", "640", "--out", str(out)]) == 0
    assert [r.getMessage() for r in caplog.records] == ["--engine mlx: tiny-moe's full-width experts computed in "
                                                        "float32 (MLX's CPU gather_mm takes no other)"]
    auto, fp32 = load_traces(out), full_width["mlx"].traces
    for layer in fp32.layers:
        assert np.array_equal(auto.layers[layer]["idx"], fp32.layers[layer]["idx"])
        assert np.array_equal(auto.layers[layer]["weight"], fp32.layers[layer]["weight"])
    capsys.readouterr()
    code = main(["calibrate", "--model", "tiny-moe", "--engine", "mlx", "--dtype", "bfloat16", "--chunk", "64",
                 "--prompt-tokens", "128", "--max-tokens", "640", "--out", str(tmp_path / "bf16.npz")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["autotune calibrate: error: --engine mlx --dtype bfloat16: MLX's CPU multiplies "
                                 "tiny-moe's full-width experts in float32 only (its gather_mm); give --dtype "
                                 "float32 or auto"], err
    assert not (tmp_path / "bf16.npz").exists()


def test_a_truncated_mlx_folder_is_refused_before_mlx_lm_reads_it(q4, tmp_path, capsys):
    """The checkpoint check the torch engine runs (files whole, config agreeing) runs for the MLX engine too: one
    line naming the file (mlx-lm's load_safetensors traceback before)."""
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(q4, cut)
    weights = cut / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    for engine in ("mlx", "auto"):
        code = main(["calibrate", "--model", str(cut), "--engine", engine, "--out", str(tmp_path / "t.npz")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err == [f"autotune calibrate: error: {weights}: truncated safetensors file "
                                     f"({size // 2} bytes; its header names {size})"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut"]
