"""The build cache: entries sealed with a checksum; a corrupt one is detected, said so in one line, and rebuilt.
And a build stopped by SIGTERM leaves no temp folder behind (beside the output or in the temp dir)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from helpers import one_ane_group, random_model

from autotune.cli import main
from autotune.searching.templates import template_plan
from runtime.loading.model_loader import model_spec
from runtime.plan import save_plan

MODEL = "random:qwen3_moe"


def _plan(tmp_path, one_group: bool = True):
    model, _ = random_model(MODEL)
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=8)
    path = tmp_path / "plan.json"
    save_plan(one_ane_group(plan) if one_group else plan, path)
    return path


def _build(plan, out, cache) -> list[str]:
    return ["build", "--model", MODEL, "--plan", str(plan), "--out", str(out), "--cache-dir", str(cache),
            "--no-progress"]


def test_corrupt_cache_entry_is_detected_said_and_rebuilt(tmp_path, capsys, caplog):
    plan, cache = _plan(tmp_path), tmp_path / "cache"
    assert main(_build(plan, tmp_path / "a.mlpackage", cache)) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["cached_functions"] == 0
    entry = next(cache.glob("*.mlpackage"))
    assert (cache / (entry.name + ".sha256")).exists()
    weights = max((p for p in entry.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(weights.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte in the weights
    weights.write_bytes(bytes(raw))

    caplog.clear()
    assert main(_build(plan, tmp_path / "b.mlpackage", cache)) == 0
    said = [r.getMessage() for r in caplog.records if r.name == "npumoe.build_cache"]  # the CLI's stderr line
    assert len(said) == 1 and "corrupt" in said[0] and entry.name in said[0]
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["cached_functions"] == 0  # converted again
    caplog.clear()
    assert main(_build(plan, tmp_path / "c.mlpackage", cache)) == 0  # and the new entry is whole
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["cached_functions"] == 1
    assert not [r for r in caplog.records if r.name == "npumoe.build_cache"]

    shutil.rmtree(entry)
    entry.write_text("a file where the converted function belongs")
    for out in ("d", "e"):  # said and rebuilt once; the build after it finds the entry whole
        caplog.clear()
        assert main(_build(plan, tmp_path / f"{out}.mlpackage", cache)) == 0
        said = [r.getMessage() for r in caplog.records if r.name == "npumoe.build_cache"]
        assert said == ([f"build cache entry {entry} is not a package folder; rebuilding it"] if out == "d" else [])
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["cached_functions"] == (out == "e")
    assert entry.is_dir()


def test_sigterm_during_build_leaves_no_temp_folders(tmp_path):
    plan = _plan(tmp_path, one_group=False)  # 8 functions: time enough to be stopped mid-way
    out_dir, tmp = tmp_path / "out", tmp_path / "tmp"
    out_dir.mkdir()
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "autotune", *_build(plan, out_dir / "g.mlpackage",
                                                                     tmp_path / "cache")],
                            env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not any(tmp_path.joinpath("cache").glob("*.sha256")):
        time.sleep(0.2)  # until the first function is converted and sealed: the build is under way
    assert proc.poll() is None, "the build ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == "autotune build: terminated" and "Traceback" not in err
    assert list(out_dir.iterdir()) == []  # no .g.mlpackage.* work folder, no half package
    assert list(tmp.iterdir()) == []  # no coremltools tmp*.mlpackage
