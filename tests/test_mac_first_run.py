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


def _run_stubbed(tmp_path: Path, autotune: str, macos: str = "15.5") -> tuple[subprocess.CompletedProcess, Path]:
    """The script on a stub Mac (`uname` says Darwin, `sw_vers` says `macos`) with `autotune` stubbed by the bash
    `case` body given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir / "uname", 'echo Darwin\n')
    _stub(bin_dir / "sw_vers", f'echo {macos}\n')
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
    assert list(steps) == ["doctor", "profile", "search", "build", "template", "build_template", "run", "evaluate",
                           "bench"]
    assert steps["doctor"]["json"]["checks"][0]["status"] == "pass"
    assert steps["build"]["exit_code"] == 2 and "no group on the ane backend" in steps["build"]["stderr_tail"]
    assert steps["run"]["json"] == {"step": "run"} and r["plan_run"].endswith("template.json")
    assert r["ok"]  # the expected build refusal is replaced by the template's build
    assert r["bench"] == {"step": "bench"}  # bench's JSON, the tuned plan against mlx-lm


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


def test_first_run_on_macos_27_builds_the_plans_core_ai_asset(tmp_path):
    """macOS 27 with Core AI (a stub `sw_vers` says 27.0, the stub doctor's coreai check passes): the tuned plan's
    build is asked without --out, so it writes the format the plan names (the stub writes plan.aimodel as `build`
    does for a coreai plan), run and evaluate take its manifest, the Core AI steps run, and the report holds every
    build's Neural Engine shares. The script exits 0."""
    proc, report = _run_stubbed(tmp_path, """  build) plan=$(sed -E 's/.*--plan ([^ ]+).*/\\1/' <<<"$*")
         out="${plan%.json}.aimodel"
         if grep -q -- --out <<<"$*"; then out=$(sed -E 's/.*--out ([^ ]+).*/\\1/' <<<"$*"); fi
         mkdir -p "$out" && touch "${out%.*}.manifest.json"
         echo "{\\"package\\": \\"$out\\", \\"placement\\": {\\"layer0_group0\\": {\\"share\\": 0.97}}}";;
  doctor) echo '{"checks": [{"name": "coreai", "status": "pass", "detail": "stub"}], "ok": true}';;
  *) echo "{\\"step\\": \\"$1\\", \\"args\\": \\"$*\\"}";;
""", macos="27.0")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(report.read_text())
    assert list(r["steps"]) == ["doctor", "profile", "search", "build", "run", "evaluate", "bench", "coreai_template",
                                "coreai_build", "coreai_run"]
    assert "--plan" in r["bench"]["args"] and r["bench"]["args"].endswith("/plan.json --no-progress --json")
    assert r["ok"] and all(s["exit_code"] == 0 for s in r["steps"].values())
    assert r["steps"]["build"]["json"]["package"].endswith("/plan.aimodel")
    args = r["steps"]["run"]["json"]["args"]
    assert "--package" in args and "plan.manifest.json" in args
    assert r["placement"] == {"build": {"layer0_group0": 0.97}, "coreai_build": {"layer0_group0": 0.97}}


def test_first_run_skips_core_ai_where_the_doctor_skipped_it(tmp_path):
    """macOS 27 whose doctor skipped its coreai check (Core AI not installed, or not the OS framework): no Core AI
    steps."""
    proc, report = _run_stubbed(tmp_path, """  doctor) echo '{"checks": [{"name": "coreai", "status": "skip"}]}';;
  *) echo "{\\"step\\": \\"$1\\"}";;
""", macos="27.0")
    assert proc.returncode == 0, proc.stderr
    assert "coreai_build" not in json.loads(report.read_text())["steps"]
