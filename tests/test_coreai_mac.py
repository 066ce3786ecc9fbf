"""The Mac path's Core AI defects, each held here: the build's placement proof (against a stand-in for Core AI's
compute plan, tests/coreai_standin.py), `--dtype auto` building fp16 checked against ane-sim, a corrupt or
interrupted asset never taken, the extra's markers, the doctor's temp folders and UNKNOWN ops, fd 2's silencing."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch

pytest.importorskip("coreai_torch")
pytest.importorskip("coreai.runtime")

import coreai_standin  # noqa: E402

from autotune.cli import main  # noqa: E402
from runtime.coreai import assets, builder, placement, programs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _plan(d: Path, layers: int = 4) -> Path:
    """tiny-moe's groups on coreai in 64-token chunks, 8 rows per expert; only the first `layers` layers' groups."""
    plan = d / "P.json"
    assert main(["plan-template", "--model", "tiny-moe", "--capacity", "ample", "--overflow", "spill", "--backend",
                 "coreai", "--chunk", "64", "--out", str(plan)]) == 0
    p = json.loads(plan.read_text())
    for layer in p["layers"]:
        for g in layer["groups"]:
            g["capacities"] = [8] * len(g["experts"])
            if layer["layer"] >= layers:
                g["backend"] = "cpu-static"
    plan.write_text(json.dumps(p))
    return plan


def _build(capsys, plan: Path, out: Path, *args: str) -> tuple[int, list[str], str]:
    capsys.readouterr()
    code = main(["build", "--model", "tiny-moe", "--plan", str(plan), "--format", "coreai", "--out", str(out),
                 "--no-progress", *args])
    got = capsys.readouterr()
    return code, got.err.strip().splitlines(), got.out


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    """tiny-moe's layer-0 groups on coreai, built in float32 (fast here) with no compute plan read."""
    d = tmp_path_factory.mktemp("mac32")
    plan, asset = _plan(d, layers=1), d / "X.aimodel"
    assert main(["build", "--model", "tiny-moe", "--plan", str(plan), "--format", "coreai", "--dtype", "float32",
                 "--out", str(asset), "--no-progress"]) == 0
    return plan, asset


def test_build_without_core_ai_is_one_line_naming_the_package(tmp_path):
    plan = _plan(tmp_path, layers=1)
    code = ("import sys; sys.modules['coreai_torch'] = None; from autotune.cli import main; "
            f"sys.exit(main(['build', '--model', 'tiny-moe', '--plan', {str(plan)!r}, '--format', 'coreai']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "coreai_torch" in lines[0] and "pip install 'npumoe[coreai]'" in lines[0]
    assert not plan.with_suffix(".aimodel").exists()


def test_coreai_markers_hold_the_wheels_requires_python():
    """Each coreai requirement installs only where its wheel's Requires-Python (read from the installed dist) holds,
    on both platforms the wheels exist for, for every Python npumoe declares."""
    from importlib.metadata import metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = SpecifierSet(project["requires-python"])
    hosts = [{"sys_platform": "linux", "platform_machine": "x86_64", "platform_release": "6.8"},
             {"sys_platform": "darwin", "platform_machine": "arm64", "platform_release": "25.0"}]
    reqs = [Requirement(r) for r in project["optional-dependencies"]["coreai"]]
    assert {r.name for r in reqs} == {"coreai-torch", "coreai-core", "coreai-opt"}
    for req in reqs:
        wheel = SpecifierSet(metadata(req.name)["Requires-Python"])
        for minor in range(8, 17):
            py = f"3.{minor}"
            for host in hosts:
                installs = py in declared and req.marker.evaluate({**host, "python_version": py, "extra": "coreai"})
                assert not installs or f"{py}.0" in wheel, (req.name, py, host["sys_platform"], str(wheel))
        assert req.marker.evaluate({**hosts[1], "python_version": "3.11", "extra": "coreai"})


def test_placement_off_the_neural_engine_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    """The stand-in puts every matmul on the GPU: the build is refused naming the first function and its 0% share,
    before anything is written."""
    coreai_standin.install(monkeypatch, {"coreai.decomposable.broadcasting_batch_matmul": "GPU"})
    plan, out = _plan(tmp_path, layers=1), tmp_path / "X.aimodel"
    code, err, _ = _build(capsys, plan, out, "--dtype", "float32")
    assert code == 2 and len(err) == 1, err
    assert "function layer0_group0" in err[0] and "puts 0% of it on the Neural Engine" in err[0], err
    assert "GPU 8" in err[0] and err[0].endswith("build without --dtype float32")  # four experts, two matmuls each
    assert sorted(p.name for p in tmp_path.iterdir()) == ["P.json"]


def test_placement_shares_recorded_and_auto_builds_fp16_against_ane_sim(monkeypatch, tmp_path, capsys, caplog):
    """Placement passes (the graph's output, UNKNOWN in the plan, counted neither way): every function's share is 1
    in the asset's metadata and the manifest; `--dtype auto` builds float16 checked against ane-sim."""
    from runtime.loading import model_loader

    coreai_standin.install(monkeypatch, {"coreai.silu": "CPU"})
    # as on a Mac, whose torch has no fast bf16: `--dtype auto` loads tiny-moe in float32
    monkeypatch.setattr(model_loader, "auto_dtype_of", lambda name: (torch.float32, "as on a Mac"))
    plan, out = _plan(tmp_path, layers=1), tmp_path / "X.aimodel"
    p = json.loads(plan.read_text())
    for g in p["layers"][0]["groups"][1:]:  # one function: emulated fp16 is slow here
        g["backend"] = "cpu-static"
    plan.write_text(json.dumps(p))
    code, err, stdout = _build(capsys, plan, out)
    assert code == 0, err
    built = json.loads(stdout.strip().splitlines()[-1])
    assert built["dtype"] == "float16" and built["checked_against"] == "ane-sim" and built["max_rel_error"] <= 1e-2
    shares = assets.read_record(out)["placement"]
    # per expert: matmul, silu, mul, matmul placed (transposes and splits too); silu on the CPU
    s = shares["layer0_group0"]
    assert s["devices"]["CPU"] == 4 and s["ops"] == s["ops_on_neural_engine"] + 4
    assert s["matmul_flops"] == s["matmul_flops_on_neural_engine"] == 4 * 2 * 8 * 256 * (512 + 256)
    assert s["share"] == round((s["ops"] - 4) / s["ops"], 4) and s["share"] > 0.5
    manifest = json.loads(out.with_suffix(".manifest.json").read_text())
    assert manifest["packages"][0]["neural_engine_share"] == {"layer0_group0": s["share"]}
    assert "lowest share" in stdout
    from runtime.coreai.coreai_backend import CoreAiBackend

    with caplog.at_level(logging.INFO, logger="npumoe"):
        CoreAiBackend(str(out))._say_placement()
    said = [r.getMessage() for r in caplog.records if "compute plan" in r.getMessage()]
    assert len(said) == 1 and f"lowest {100 * s['share']:.0f}%, layer0_group0" in said[0], said


def test_doctor_off_list_leaves_unknown_ops_out():
    w = [(torch.randn(64, 32), torch.randn(32, 32))]
    program = assets.to_program([("g", programs.GroupProgram(w, (4,), torch.float32), (torch.randn(4, 32),), ["x"])])
    ops = placement._ops_by_function(program)
    entries = [{"operation_id": i, "devices": ["UNKNOWN"]} for i in ops]
    assert placement.off_neural_engine(program, {"entries": entries}) == []
    assert placement.shares(program, {"entries": entries})["g"].ops == 0
    entries[0]["devices"] = ["GPU"]
    assert placement.off_neural_engine(program, {"entries": entries}) == [ops[entries[0]["operation_id"]][1]]


@pytest.mark.parametrize("how", ["truncated", "random", "random-middle"])
def test_corrupt_asset_is_refused_in_one_line_before_apples_parser(how, fp32, tmp_path):
    """A corrupt `main.mlirb` aborted the process in Apple's parser (SIGABRT, exit 134) leaving an empty `.lower-*`
    folder, and was run as the good asset when that one was lowered before (the cache is keyed by the stored
    digest): the digest is checked first. In a child process, so that an abort would show."""
    plan, asset = fp32
    cache = tmp_path / "cache"
    env = {**os.environ, "NPUMOE_CACHE": str(cache)}
    lowered_before = how != "truncated"
    if lowered_before:
        good = subprocess.run([sys.executable, "-c", "import sys; from runtime.coreai import assets; "
                               "assets.compiled_path(sys.argv[1])", str(asset)],
                              capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
        assert good.returncode == 0, good.stderr
    copy = tmp_path / "C.aimodel"
    shutil.copytree(asset, copy)
    program = copy / "main.mlirb"
    data = bytearray(program.read_bytes())
    rng = np.random.default_rng(0)
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "random":
        data = bytearray(rng.integers(0, 256, len(data), dtype=np.uint8).tobytes())
    else:
        tenth = len(data) // 10
        data[5 * tenth: 6 * tenth] = rng.integers(0, 256, tenth, dtype=np.uint8).tobytes()
    program.write_bytes(bytes(data))
    text = tmp_path / "t.txt"
    text.write_text("Static capacity tiers on the Neural Engine. " * 20)
    proc = subprocess.run([sys.executable, "-m", "autotune", "run", "--model", "tiny-moe", "--plan", str(plan),
                           "--package", str(copy), "--dtype", "float32", "--text", str(text), "--max-tokens", "64"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert str(program) in lines[0] and "corrupt" in lines[0]
    left = sorted(p.name for p in (cache / "coreai").iterdir()) if (cache / "coreai").exists() else []
    assert left == ([f"{assets.asset_digest(asset)}.aimodelx"] if lowered_before else [])


def test_terminated_while_checking_leaves_no_asset(fp32, tmp_path, monkeypatch, capsys):
    """SIGTERM during the build's checks used to leave `out.aimodel` converted and unchecked, which `run --package`
    took: the asset now takes its name only once checked."""
    from runtime.interrupts import Terminated

    plan, _ = fp32

    def terminated(*_):
        raise Terminated()

    monkeypatch.setattr(builder, "_run_checks", terminated)
    out = tmp_path / "out" / "X.aimodel"
    out.parent.mkdir()
    code = main(["build", "--model", "tiny-moe", "--plan", str(plan), "--format", "coreai", "--dtype", "float32",
                 "--out", str(out), "--no-progress"])
    assert code == 143 and "terminated" in capsys.readouterr().err
    assert list(out.parent.iterdir()) == []


def test_sigterm_while_checking_leaves_nothing_run_could_take(tmp_path):
    """A real SIGTERM once the staged asset is saved (its checks under way, fp16: seconds here): exit 143 and no
    `X.aimodel`, no manifest, no staging folder."""
    import signal
    import time

    plan, out = _plan(tmp_path, layers=1), tmp_path / "X.aimodel"
    proc = subprocess.Popen([sys.executable, "-m", "autotune", "build", "--model", "tiny-moe", "--plan", str(plan),
                             "--format", "coreai", "--out", str(out), "--no-progress"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob(".X.aimodel.*.building/X.aimodel/metadata.json")) and proc.poll() is None:
        assert time.monotonic() < deadline, "the build never staged its asset"
        time.sleep(0.05)
    time.sleep(0.1)  # the asset saved and its metadata written: lowered, loaded and checked from now (seconds)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143 and "terminated" in err, err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["P.json"]


def test_asset_dtype_other_than_the_runs_is_said_once(fp32, caplog):
    """A float32 asset in a bfloat16 run: the calls convert, said once, with the difference to expect."""
    from runtime.backends import GroupSpec
    from runtime.coreai.coreai_backend import CoreAiBackend
    from runtime.loading.model_loader import load_model, moe_layers

    plan, asset = fp32
    p = json.loads(plan.read_text())
    g = p["layers"][0]["groups"][0]
    experts = moe_layers(load_model("tiny-moe", "bfloat16")[0])[0].experts
    fn = CoreAiBackend(str(asset)).prepare(GroupSpec(0, 0, tuple(g["experts"]), tuple(g["capacities"]), experts))
    x = torch.randn(sum(g["capacities"]), 256).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="npumoe"):
        y1, y2 = fn(x), fn(x)
    said = [r.getMessage() for r in caplog.records if "computes in" in r.getMessage()]
    assert len(said) == 1 and "computes in float32, this run in bfloat16" in said[0] and "1e-1" in said[0], said
    assert y1.dtype == torch.bfloat16 and torch.equal(y1, y2)


def test_on_neural_engine_asks_core_ai_not_the_macos_version(monkeypatch):
    from coreai.runtime import SpecializationOptions

    monkeypatch.setattr(assets, "on_macos", lambda: True)
    for supported in (True, False):
        monkeypatch.setattr(SpecializationOptions, "is_supported", staticmethod(lambda s=supported: s))
        assert assets.on_neural_engine() is supported
    monkeypatch.setattr(assets, "on_macos", lambda: False)
    assert assets.on_neural_engine() is False


def test_overlapping_silencers_restore_fd2():
    """Two overlapping callers (enter A, enter B, leave A, leave B) leave fd 2 where it was; inside, it is /dev/null."""
    from runtime.coreai.coreai_backend import native_stderr_silenced

    before = os.fstat(2)
    a, b = native_stderr_silenced(), native_stderr_silenced()
    a.__enter__()
    b.__enter__()
    inside = os.fstat(2)
    a.__exit__(None, None, None)
    still = os.fstat(2)
    b.__exit__(None, None, None)
    after = os.fstat(2)
    null = os.stat(os.devnull)
    assert (inside.st_ino, inside.st_dev) == (null.st_ino, null.st_dev) == (still.st_ino, still.st_dev)
    assert (after.st_ino, after.st_dev) == (before.st_ino, before.st_dev)


def test_doctor_and_profiling_leave_no_temp_folder(tmp_path, monkeypatch):
    """The doctor's compute-plan report (against the stand-in) and a profiled coreai group, in a TMPDIR of their own:
    listed before and after, nothing is left."""
    import gc
    import tempfile

    from runtime.coreai import device_checks
    from runtime.loading.model_loader import load_model, moe_layers

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("NPUMOE_CACHE", str(tmp_path / "cache"))
    coreai_standin.install(monkeypatch)
    experts = moe_layers(load_model("tiny-moe", "float32")[0])[0].experts
    before = sorted(os.listdir(tmp))
    r = device_checks.compute_plan_report(experts, (2, 2), 256)
    assert r["ops_off_neural_engine"] == [] and r["placement"]["group"]["share"] == 1.0
    call = device_checks.profile_caller(experts, (2, 2), 256)
    assert call().shape == (4, 256) and sorted(os.listdir(tmp)) != before
    del call
    gc.collect()
    assert sorted(os.listdir(tmp)) == before == []
