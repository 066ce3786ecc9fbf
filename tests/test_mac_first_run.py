"""The Mac first-run script and the macOS CI workflow: the script skips cleanly off macOS and gathers its steps into
one report; the workflow's YAML parses and names its steps (it runs on GitHub's Apple-silicon runners only)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "mac_first_run.sh"
WORKFLOW = ROOT / ".github" / "workflows" / "macos.yml"


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the non-macOS answer")
def test_first_run_skips_off_macos_saying_why(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "r.json")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "not macOS" in proc.stderr and "nothing was run" in proc.stderr
    assert not (tmp_path / "r.json").exists()


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


def _run_stubbed(tmp_path: Path, autotune: str) -> tuple[subprocess.CompletedProcess, Path]:
    """The script on a stub Mac (`uname` says Darwin) with `autotune` stubbed by the bash `case` body given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir / "uname", 'echo Darwin\n')
    _stub(bin_dir / "autotune", f'case "$1" in\n{autotune}esac\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable}
    report = tmp_path / "r.json"
    proc = subprocess.run(["bash", str(SCRIPT), str(report)], capture_output=True, text=True, env=env, timeout=120,
                          cwd=ROOT)
    return proc, report


def test_first_run_report_gathers_every_step(tmp_path):
    """The report's plumbing with stub commands (a stub `uname` says Darwin, a stub `autotune` answers each step):
    exit codes, JSON outputs, the template fallback when the tuned plan has no ANE group."""
    proc, report = _run_stubbed(tmp_path, """  build) if grep -q template <<<"$*"; then exit 0; fi
         echo "autotune build: error: the plan puts no group on the ane backend: nothing to build" >&2; exit 2;;
  doctor) echo '{"checks": [{"name": "os", "status": "pass", "detail": "stub"}], "ok": true}';;
  *) echo "{\\"step\\": \\"$1\\"}";;
""")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(report.read_text())
    assert r["schema"] == "npumoe.mac-first-run/1" and r["host"]["libraries"]
    steps = r["steps"]
    assert list(steps) == ["doctor", "profile", "search", "build", "template", "build_template", "run", "evaluate"]
    assert steps["doctor"]["json"]["checks"][0]["status"] == "pass"
    assert steps["build"]["exit_code"] == 2 and "no group on the ane backend" in steps["build"]["stderr_tail"]
    assert steps["run"]["json"] == {"step": "run"} and r["plan_run"].endswith("template.json")
    assert r["ok"]  # the expected build refusal is replaced by the template's build


def test_macos_workflow_parses_and_names_its_steps():
    wf = yaml.safe_load(WORKFLOW.read_text())
    triggers = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert "pull_request" in triggers and "push" in triggers
    job = wf["jobs"]["apple-silicon"]
    assert job["runs-on"] in ("macos-14", "macos-15")  # arm64 (Apple silicon) images
    names = [s["name"] for s in job["steps"]]
    assert names == ["Check out", "Set up Python", "Install", "Doctor (records op placement)", "macOS-marked tests",
                     "First-run script", "Upload report"]
    run = {s["name"]: s.get("run", "") for s in job["steps"]}
    assert "pytest -q -m macos" in run["macOS-marked tests"]
    assert "scripts/mac_first_run.sh" in run["First-run script"] and "autotune doctor --json" in run[
        "Doctor (records op placement)"]
    assert job["steps"][-1]["if"] == "always()" and "ci-out" in job["steps"][-1]["with"]["path"]


def test_first_run_exits_nonzero_when_a_step_fails(tmp_path):
    """A step that fails (here `run`, stubbed to exit 3) makes the script exit 1 after writing its report: the macOS
    workflow's first-run step goes red instead of green."""
    proc, report = _run_stubbed(tmp_path, """  run) echo "autotune run: error: the stand-in step failed" >&2; exit 3;;
  *) echo "{\\"step\\": \\"$1\\"}";;
""")
    assert proc.returncode == 1, proc.stderr
    r = json.loads(report.read_text())
    assert not r["ok"] and r["steps"]["run"]["exit_code"] == 3 and r["steps"]["evaluate"]["exit_code"] == 0
    assert "failed: run (exit 3)" in proc.stderr
