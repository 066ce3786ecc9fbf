"""A built package on the MLX spine (`run --engine mlx --package`): bound to the plan by the same code as on the
torch spine (`runtime.packages`), its functions run by its backend where the plan puts them. A Core AI asset
in float32 (Apple's in-package runtime on this CPU) holding tiny-moe's layer-0 group, beside mlx-exact: within 1e-5 of
mlx-lm's own forward, and of the same package on the torch spine. Core AI's own checks (the asset's digest before
Apple's parser, a dtype other than the run's said once, a function built for other shapes refused) hold here too,
as a Core ML build's manifest checks do."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("mlx_lm")

from helpers import one_line_exit_2  # noqa: E402

from autotune.cli import main  # noqa: E402
from runtime import generation  # noqa: E402
from runtime.prefill import max_rel_diff  # noqa: E402

TEXT = "Static capacity tiers, grouped experts and load-aware residency on the Neural Engine. " * 30
TOKENS, CHUNK = 256, 128


@pytest.fixture(scope="module")
def asset(tmp_path_factory) -> tuple[Path, Path]:
    """The mixed plan (groups on coreai, tight, spilling to mlx-exact) with one group kept, layer 0's first: every
    other expert on mlx-exact. One function, built in float32 (a second here)."""
    pytest.importorskip("coreai_torch")
    pytest.importorskip("coreai.runtime")
    d = tmp_path_factory.mktemp("mlxpkg")
    plan, out = d / "P.json", d / "X.aimodel"
    assert main(["plan-template", "--model", "tiny-moe", "--capacity", "tight", "--overflow", "spill", "--backend",
                 "coreai", "--exact", "mlx-exact", "--chunk", str(CHUNK), "--out", str(plan)]) == 0
    p = json.loads(plan.read_text())
    for layer in p["layers"]:
        kept = layer["groups"][:1] if layer["layer"] == 0 else []
        layer["cpu_exact"] = sorted(e for g in layer["groups"][len(kept):] for e in g["experts"])
        layer["groups"] = kept
    plan.write_text(json.dumps(p))
    assert main(["build", "--model", "tiny-moe", "--plan", str(plan), "--format", "coreai", "--dtype", "float32",
                 "--out", str(out), "--no-progress"]) == 0
    (d / "text.txt").write_text(TEXT)
    return plan, out


def _run(capsys, plan: Path, package: Path, engine: str) -> dict:
    capsys.readouterr()
    assert main(["run", "--model", "tiny-moe", "--plan", str(plan), "--package", str(package), "--engine", engine,
                 "--dtype", "float32", "--reference", "--json", "--text", str(plan.parent / "text.txt"),
                 "--max-tokens", str(TOKENS)]) == 0
    return json.loads(capsys.readouterr().out)


def test_core_ai_asset_on_the_mlx_spine_is_exact(asset, capsys):
    plan, package = asset
    ours, theirs = _run(capsys, plan, package, "mlx"), _run(capsys, plan, package, "torch")
    print(f"--engine mlx: max_rel_diff_vs_reference {ours['max_rel_diff_vs_reference']:.3e}; --engine torch: "
          f"{theirs['max_rel_diff_vs_reference']:.3e}")
    assert ours["engine"] == "mlx" and theirs["engine"] == "torch"
    assert ours["max_rel_diff_vs_reference"] <= 1e-5 and theirs["max_rel_diff_vs_reference"] <= 1e-5
    assert ours["backend_fallbacks"] == {} == theirs["backend_fallbacks"]
    assert ours["calls_per_backend"]["coreai"] == TOKENS // CHUNK  # layer 0's group, each chunk, on the asset
    for key in ("tokens_per_backend", "calls_per_backend", "assignments", "spilled", "static_slots"):
        assert ours[key] == theirs[key], key
    assert ours["spilled"] > 0 and set(ours["executed"]["experts"]) == {"coreai", "mlx-exact"}


def test_mlx_spine_with_the_package_against_the_torch_spine_with_it(asset):
    """Every position's logits of the two spines, each running the same asset: within 1e-5 of each other."""
    from runtime.mlx.spine_generation import prefill_logits
    from runtime.prefill import prefill_logits as torch_logits

    plan, package = asset
    ours = generation.load("tiny-moe", str(plan), str(package), engine="mlx", dtype="float32")
    theirs = generation.load("tiny-moe", str(plan), str(package), engine="torch", dtype="float32")
    ids = torch.tensor(ours.tokenizer.encode(TEXT, add_special_tokens=False))[:TOKENS]
    a = prefill_logits(ours.model, ids, CHUNK, every_position=True)
    with torch.inference_mode():
        b = torch_logits(theirs.model, ids, CHUNK)
    diff = max_rel_diff(a, b)
    print(f"MLX spine against torch spine, both with the Core AI asset: max relative difference {diff:.3e}")
    assert diff <= 1e-5
    assert ours.executor.fallbacks == {} and type(ours.executor.backends["coreai"]).__name__ == "CoreAiBackend"
    assert ours.stats.total().calls_per_backend["coreai"] == theirs.stats.total().calls_per_backend["coreai"] == 2


def test_function_of_other_capacities_is_refused_on_the_mlx_spine(asset, tmp_path, capsys):
    plan, package = asset
    p = json.loads(plan.read_text())
    p["layers"][0]["groups"][0]["capacities"][0] += 8
    mine = tmp_path / "P.json"
    mine.write_text(json.dumps(p))
    line = one_line_exit_2(["run", "--model", "tiny-moe", "--plan", str(mine), "--package", str(package),
                            "--engine", "mlx", "--dtype", "float32", "--max-tokens", "64"], capsys)
    assert "layer0_group0" in line and "capacities" in line


def test_corrupt_asset_is_refused_before_apples_parser_on_the_mlx_spine(asset, tmp_path, monkeypatch, capsys):
    """The asset's digest is checked before Apple's parser reads it (which aborts the process on a corrupt program:
    tests/test_coreai_mac.py holds that in a child process); nothing is lowered into the cache."""
    plan, package = asset
    copy = tmp_path / "C.aimodel"
    shutil.copytree(package, copy)
    program = copy / "main.mlirb"
    data = program.read_bytes()
    program.write_bytes(data[: len(data) // 2])
    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path / "cache"))
    line = one_line_exit_2(["run", "--model", "tiny-moe", "--plan", str(plan), "--package", str(copy), "--engine",
                            "mlx", "--dtype", "float32", "--text", str(plan.parent / "text.txt"), "--max-tokens",
                            "64"], capsys)
    assert str(program) in line and "corrupt" in line
    assert not (tmp_path / "cache" / "coreai").exists() or not any((tmp_path / "cache" / "coreai").iterdir())


def test_asset_dtype_other_than_the_runs_is_said_once_on_the_mlx_spine(asset, tmp_path, caplog):
    """The float32 asset in a bfloat16 run on the MLX spine (the other experts on cpu-exact: MLX's CPU gather_mm
    takes float32 only): the calls convert, said once."""
    from runtime.mlx.spine_generation import prefill_logits

    plan, package = asset
    p = json.loads(plan.read_text())
    p["exact"] = "cpu-exact"
    mine = tmp_path / "P.json"
    mine.write_text(json.dumps(p))
    with caplog.at_level(logging.WARNING, logger="npumoe"):
        loaded = generation.load("tiny-moe", str(mine), str(package), engine="mlx", dtype="bfloat16")
        ids = torch.tensor(loaded.tokenizer.encode(TEXT, add_special_tokens=False))[:TOKENS]
        prefill_logits(loaded.model, ids, CHUNK)
    said = [r.getMessage() for r in caplog.records if "computes in" in r.getMessage()]
    assert len(said) == 1 and "computes in float32, this run in bfloat16" in said[0], said
    assert loaded.stats.total().calls_per_backend["coreai"] == 2


def test_core_ml_manifest_is_checked_on_the_mlx_spine(tmp_path, capsys):
    """A split Core ML build's manifest naming a part that is gone: refused in one line before the plan runs, as on
    the torch spine (ane's own check, through the same binding)."""
    from runtime.loading.model_record import read_model_spec

    plan = tmp_path / "P.json"
    assert main(["plan-template", "--model", "tiny-moe", "--backend", "ane", "--exact", "mlx-exact", "--out",
                 str(plan)]) == 0
    manifest = tmp_path / "m.manifest.json"
    manifest.write_text(json.dumps({
        "schema": "npumoe.manifest/1", "model_fingerprint": read_model_spec("tiny-moe").fingerprint,
        "layout": "matmul", "compress": "none",
        "packages": [{"path": "gone.part1.mlpackage", "functions": ["layer0_group0"], "weight_bytes": 1, "bytes": 1}]}))
    line = one_line_exit_2(["run", "--model", "tiny-moe", "--plan", str(plan), "--package", str(manifest),
                            "--engine", "mlx", "--dtype", "float32", "--max-tokens", "64"], capsys)
    assert "gone.part1.mlpackage does not exist" in line
