"""Our stderr carries our lines: known, harmless import-time lines of coremltools and coreai-torch are filtered by
message (runtime/import_noise.py), an unknown one still shows, and a command's one-line error is the only line."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_known_import_noise_is_filtered_and_the_rest_shows():
    """coremltools' import lines (untested scikit-learn and torch; off macOS, no Core ML runtime) and coreai-torch's
    torch stamp are filtered; an unknown coremltools warning still shows."""
    pytest.importorskip("coreai_torch")
    code = ("import logging, runtime; logging.basicConfig(format='%(message)s'); import coremltools, coreai_torch; "
            "import coremltools.models.ml_program.experimental.compute_plan_utils; "
            "logging.getLogger('coremltools').warning('something new')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and proc.stderr.strip().splitlines() == ["something new"], proc.stderr


def test_int8_package_for_an_fp16_plan_is_one_line_on_stderr(tmp_path):
    """`build --compress int8`, then `run --package` with the plan (compress none): exit 2, and stderr is the one
    error line (it followed ten lines of coremltools' import noise)."""
    plan, package = tmp_path / "P.json", tmp_path / "X.mlpackage"
    assert main(["plan-template", "--model", "tiny-moe", "--capacity", "ample", "--overflow", "spill", "--backend",
                 "ane", "--chunk", "64", "--out", str(plan)]) == 0
    p = json.loads(plan.read_text())
    for layer in p["layers"]:  # one function keeps the build short
        for g in layer["groups"]:
            g["capacities"] = [8] * len(g["experts"])
            if (layer["layer"], layer["groups"].index(g)) != (0, 0):
                g["backend"] = "cpu-static"
    plan.write_text(json.dumps(p))
    assert main(["build", "--model", "tiny-moe", "--plan", str(plan), "--compress", "int8", "--out", str(package),
                 "--no-progress"]) == 0
    proc = subprocess.run([sys.executable, "-m", "autotune", "run", "--model", "tiny-moe", "--plan", str(plan),
                           "--package", str(package), "--max-tokens", "64"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "layer0_group0 stores its weights as int8" in lines[0]
