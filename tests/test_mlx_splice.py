"""The dense functions a plan puts on a static backend, spliced into mlx-lm's forward (`runtime.mlx.splices`):
tiny-moe converted by mlx-lm to 4 bits, on MLX's CPU device in float32, with `plan-template --backend ane --dense ane
--exact mlx-exact` (ane-sim here), q/k/v and the attention core split by rows. Against the torch
spine on the same plan, by the fidelity gate's measures, and what `executed` says ran where."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from helpers import convert_family, convert_to_mlx  # noqa: E402

from autotune.cli import main  # noqa: E402
from autotune.evaluation.gate import MAX_PPL_DELTA, MIN_TOP1  # noqa: E402
from runtime import generation  # noqa: E402
from runtime.plan import load_plan  # noqa: E402

PROMPT = "Static groups for the prompt, the exact path for every new token. " * 16
TOKENS, CHUNK, QKV_ROWS, LAYERS = 300, 128, 96, 4  # chunks of 128, 128 and 44: q/k/v's first 96 rows static
HOST_PARTS = ["attention_projections", "attention_core", "lm_head", "rest"]  # the parts tiny-moe's dense host runs
ATTENTION_ROWS = 64  # the attention core's first 64 queries of a full chunk static


@pytest.fixture(scope="module")
def q4(tmp_path_factory) -> Path:
    return convert_to_mlx(tmp_path_factory.mktemp("splice") / "q4g64", 4, 64)


def _dense_plan(folder: Path, out: Path, rows: dict[str, int]) -> Path:
    """The template's dense functions on ane, split by `rows` per function (the attention core's queries too)."""
    assert main(["plan-template", "--model", str(folder), "--backend", "ane", "--dense", "ane", "--exact",
                 "mlx-exact", "--chunk", str(CHUNK), "--out", str(out)]) == 0
    p = json.loads(out.read_text())
    p["dense"]["attention_rows"] = ATTENTION_ROWS
    for dl in p["dense"]["layers"]:
        for kind, n in rows.items():
            dl[kind]["rows"] = n
    out.write_text(json.dumps(p))
    return out


@pytest.fixture(scope="module")
def plan(q4, tmp_path_factory) -> Path:
    return _dense_plan(q4, tmp_path_factory.mktemp("plans") / "dense.json", {"qkv": QKV_ROWS})


def _both_spines(folder: Path, plan: Path) -> tuple[generation.Loaded, torch.Tensor, torch.Tensor]:
    """(the MLX spine's load, every position's logits of TOKENS tokens on it, on the torch spine); the MLX spine's
    within the fidelity gate's limits of the torch spine's and within fp16 rounding of them."""
    from runtime.mlx.spine_generation import prefill_logits
    from runtime.prefill import max_rel_diff
    from runtime.prefill import prefill_logits as torch_logits

    ours = generation.load(str(folder), str(plan), engine="mlx", dtype="float32")
    theirs = generation.load(str(folder), str(plan), engine="torch", dtype="float32")
    ids = torch.tensor(ours.tokenizer.encode(PROMPT, add_special_tokens=False))[:TOKENS]
    assert ids.numel() == TOKENS
    a = prefill_logits(ours.model, ids, CHUNK, every_position=True)
    with torch.inference_mode():
        b = torch_logits(theirs.model, ids, CHUNK)
    nll = [float(torch.nn.functional.cross_entropy(x[:-1], ids[1:])) for x in (a, b)]
    assert abs(math.exp(nll[0] - nll[1]) - 1) <= MAX_PPL_DELTA
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= MIN_TOP1
    assert max_rel_diff(a, b) <= 2e-3  # the same fp16 functions (ane-sim); measured 3.0e-4 and 9.0e-5
    return ours, a, b


def test_spliced_plan_is_the_torch_spines_within_the_gates_tolerance(q4, plan):
    ours = _both_spines(q4, plan)[0]
    executed = ours.executor.executed().to_json()
    lanes = executed["attention_projections"]
    # q/k/v and o_proj on ane-sim for each of 3 chunks in 4 layers; mlx-lm's q/k/v for the 32 rows past the split
    # of the 2 full chunks
    assert lanes["ane-sim"]["calls"] == 2 * 3 * LAYERS and lanes["mlx-cpu"]["calls"] == 2 * LAYERS
    # the core of the 2 full chunks on ane-sim (the partial one on mlx-lm's); mlx-lm's rope and cache in every one
    assert executed["attention_core"] == {"ane-sim": {"calls": 2 * LAYERS}, "mlx-cpu": {"calls": 3 * LAYERS}}


def test_shared_expert_and_biased_qkv_spliced(tmp_path):
    """Qwen2-MoE (q/k/v biases, a shared expert with its gate) converted by mlx-lm: q/k/v and the shared expert
    split by rows, on both spines."""
    folder = convert_family(tmp_path / "qwen2_moe", "qwen2_moe")
    ours = _both_spines(folder, _dense_plan(folder, tmp_path / "p.json", {"qkv": QKV_ROWS, "mlp": 64}))[0]
    lanes = ours.executor.executed().to_json()["dense_mlp"]
    assert lanes == {"ane-sim": {"calls": 3 * 2}, "mlx-cpu": {"calls": 2 * 2}}  # 3 chunks (2 full) in 2 layers


def test_decode_steps_run_mlx_lms_own_modules(q4, plan):
    """A prompt of 150 tokens (chunks of 128 and 22, both past exact_below) and 3 decode steps: the steps call no
    static function, each runs mlx-lm's q, k, v, q/k norms and o in every layer."""
    loaded = generation.load(str(q4), str(plan), engine="mlx", dtype="float32")
    ids = loaded.tokenizer.encode(PROMPT, add_special_tokens=False)[:150]
    lanes = generation.generate(loaded, ids, max_tokens=4).executed["attention_projections"]
    assert lanes["ane-sim"]["calls"] == 2 * 2 * LAYERS  # q/k/v and o_proj, 2 chunks
    assert lanes["mlx-cpu"]["calls"] == 1 * LAYERS + 3 * 6 * LAYERS  # the split's rows of the full chunk; the steps


def _runs(q4: Path, plan: Path, capsys) -> dict[str, dict]:
    """`autotune run --json` of `plan` on each spine."""
    runs = {}
    for engine in ("mlx", "torch"):
        capsys.readouterr()
        assert main(["run", "--model", str(q4), "--plan", str(plan), "--engine", engine, "--dtype", "float32",
                     "--max-tokens", str(TOKENS), "--json"]) == 0
        runs[engine] = json.loads(capsys.readouterr().out)
    return runs


def test_run_json_names_the_dense_lanes_on_both_spines(q4, plan, capsys):
    full = _runs(q4, plan, capsys)
    runs = {engine: r["executed"] for engine, r in full.items()}
    assert set(runs["mlx"]["attention_projections"]) == {"ane-sim", "mlx-cpu"}
    assert set(runs["torch"]["attention_projections"]) == {"ane-sim", "torch-cpu"}
    assert runs["mlx"]["attention_projections"]["ane-sim"]["calls"] == \
        runs["torch"]["attention_projections"]["ane-sim"]["calls"] == 2 * 3 * LAYERS
    assert runs["mlx"]["attention_projections"]["ane-sim"]["ms"] > 0
    assert set(runs["mlx"]["attention_core"]) == {"ane-sim", "mlx-cpu"}
    assert set(runs["torch"]["attention_core"]) == {"ane-sim", "torch-cpu"}
    assert load_plan(plan).dense.layers[0].attention == "ane"
    # the template leaves the dense host at cpu-exact (the CPU in torch): the torch spine runs it as priced, the MLX
    # spine on MLX's dense ops
    assert full["torch"]["off_priced"] == []
    assert full["mlx"]["off_priced"] == [{"part": part, "lanes": ["mlx-cpu"]} for part in HOST_PARTS]


def test_a_plan_whose_dense_host_is_mlx_runs_as_priced_on_the_mlx_spine(q4, plan, tmp_path, capsys):
    """The same plan with its dense host on mlx-exact (as the search writes it for a Mac): the MLX spine runs every
    part where the plan prices it, ane's groups and functions on ane-sim, its stand-in here; the torch spine runs
    the host's share of every dense part on the CPU in torch, off priced."""
    p = json.loads(plan.read_text())
    p["dense"]["exact"] = "mlx-exact"
    host = tmp_path / "host.json"
    host.write_text(json.dumps(p))
    runs = _runs(q4, host, capsys)
    assert runs["mlx"]["priced"] == {"attention_projections": ["ane-sim", "mlx-cpu"],
                                     "attention_core": ["ane-sim", "mlx-cpu"], "experts": ["ane-sim", "mlx-exact"],
                                     "dense_mlp": ["mlx-cpu"], "lm_head": ["mlx-cpu"], "rest": ["mlx-cpu"]}
    assert runs["mlx"]["priced_stand_ins"] == runs["mlx"]["backend_fallbacks"] == {"ane": "ane-sim"}
    assert set(runs["mlx"]["executed"]["attention_core"]) == {"ane-sim", "mlx-cpu"}
    assert runs["mlx"]["off_priced"] == []
    assert runs["torch"]["off_priced"] == [{"part": part, "lanes": ["torch-cpu"]} for part in HOST_PARTS]


def test_core_ai_asset_with_dense_functions_on_the_mlx_spine_is_exact(tmp_path, capsys):
    """The mixed plan on coreai (layer 0's first group; q/k/v, o_proj and the attention core of layers 0 and 1, q/k/v
    and the core split by rows) built as a Core AI asset in float32 and run by Apple's in-package runtime on this
    CPU: the MLX spine with it within 1e-5 of mlx-lm's own forward."""
    pytest.importorskip("coreai_torch")
    pytest.importorskip("coreai.runtime")
    plan, package = tmp_path / "P.json", tmp_path / "X.aimodel"
    assert main(["plan-template", "--model", "tiny-moe", "--capacity", "tight", "--overflow", "spill", "--backend",
                 "coreai", "--dense", "coreai", "--prompt-tokens", "256", "--exact", "mlx-exact", "--chunk",
                 str(CHUNK), "--out", str(plan)]) == 0
    p = json.loads(plan.read_text())
    for layer in p["layers"]:
        kept = layer["groups"][:1] if layer["layer"] == 0 else []
        layer["cpu_exact"] = sorted(e for g in layer["groups"][len(kept):] for e in g["experts"])
        layer["groups"] = kept
    p["dense"]["layers"] = p["dense"]["layers"][:2]
    p["dense"]["layers"][0]["qkv"]["rows"], p["dense"]["attention_rows"] = QKV_ROWS, ATTENTION_ROWS
    plan.write_text(json.dumps(p))
    assert main(["build", "--model", "tiny-moe", "--plan", str(plan), "--format", "coreai", "--dtype", "float32",
                 "--out", str(package), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["run", "--model", "tiny-moe", "--plan", str(plan), "--package", str(package), "--engine", "mlx",
                 "--dtype", "float32", "--reference", "--json", "--max-tokens", "256"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["engine"] == "mlx" and r["backend_fallbacks"] == {}
    assert r["max_rel_diff_vs_reference"] <= 1e-5  # measured 8.7e-7
    executed = r["executed"]
    assert executed["attention_projections"]["coreai"]["calls"] == 2 * 2 * 2  # q/k/v and o, 2 layers, 2 chunks
    assert executed["attention_core"]["coreai"]["calls"] == 2 * 2
    assert executed["experts"]["coreai"]["calls"] == 2
