"""The package as a user installs it: build the wheel, install it (not editable) into a fresh virtual environment
whose dependencies come from this one, and run the main job from a folder outside the repository: calibrate,
search on the shipped Apple profile, evaluate, and `python -m autotune --help`."""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "autotune", "runtime", "profiles")


def _run(cmd: list, cwd: Path, env: dict, timeout: int = 600) -> str:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd}: exit {out.returncode}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the new environment's bin folder, a work folder outside the repository, the environment variables)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # build from a copy: the build leaves build/ and *.egg-info next to the sources
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "NPUMOE_CACHE": str(tmp / "cache"),
           "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", tmp / "dist", src], tmp, env)
    (wheel,) = (tmp / "dist").glob("npumoe-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp, env)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    # dependencies from this environment (appended after the new site-packages; its .pth files, the editable
    # install's among them, are not processed), npumoe itself from the wheel
    site = Path(_run([bindir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp, env).strip())
    (site / "_npumoe_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([bindir / "python", "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], tmp, env)
    work = tmp / "work"
    work.mkdir()
    return bindir, work, env


@pytest.mark.slow
def test_wheel_runs_the_main_job_outside_the_repository(installed):
    bindir, work, env = installed
    where = _run([bindir / "python", "-c", "import autotune, runtime; print(autotune.__file__, runtime.__file__)"],
                 work, env).split()
    assert all(Path(p).is_relative_to(bindir.parent) for p in where), where  # the wheel's copy, not the repo's
    assert "search" in _run([bindir / "python", "-m", "autotune", "--help"], work, env)
    autotune = bindir / "autotune"
    _run([autotune, "calibrate", "--model", "tiny-moe", "--max-tokens", "5120", "--json"], work, env)
    plan = work / "plans" / "tiny-moe@apple-m2-ultra-published.json"
    report = json.loads(_run([autotune, "search", "--model", "tiny-moe", "--profile", "apple-m2-ultra-published",
                              "--trials", "12", "--json"], work, env).strip().splitlines()[-1])
    assert report["profile"] == "apple-m2-ultra-published" and report["predicted_latency_ms"] > 0
    assert plan.exists() and (work / "traces" / "tiny-moe.npz").exists()
    fidelity = json.loads(_run([autotune, "evaluate", "--model", "tiny-moe", "--plan", plan, "--max-tokens", "512",
                                "--json"], work, env).strip().splitlines()[-1])
    assert fidelity["top1_agreement"] > 0.5
