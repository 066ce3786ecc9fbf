#!/usr/bin/env bash
# First run on a Mac: the whole ANE path in one command, with one JSON report to attach to an issue.
#
#   scripts/mac_first_run.sh [REPORT.json]      (default: mac_first_run.json; run inside npumoe's venv)
#
# Steps: autotune doctor; profile-device --quick (this Mac's profile); search tiny-moe on it; build the plan's device
# functions in the format the plan names (a Core AI .aimodel where its groups are on coreai, macOS 27; Core ML
# .mlpackage files where they are on ane; a template plan with every group on the ane backend when the tuned plan puts
# none on a device); run against the reference; evaluate; bench the tuned plan against mlx-lm; where Core AI is there (macOS 27 and the doctor's coreai
# check not skipped), a plan with every group and dense function on the coreai backend built into a Core AI asset and
# run against the reference. A failing step is recorded with its exit code and output and the run goes on where it
# can; the report holds each step's outcome and the Neural Engine shares Core AI's compute plan gave each build's
# functions. The script then exits 1 (the report says which steps failed), 0 only when every step passed. Off macOS it
# stops at once and says why (exit 0): there is no Neural Engine to exercise, and `autotune doctor` already covers
# what a Linux host can check.
set -uo pipefail

REPORT="${1:-mac_first_run.json}"
if [ "$(uname -s)" != "Darwin" ]; then
    echo "mac_first_run.sh: this host runs $(uname -s), not macOS: the ANE path (Core ML prediction) cannot run" \
         "here, so nothing was run and no report written; use 'autotune doctor' for this host's checks" >&2
    exit 0
fi
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/npumoe-first-run.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
MODEL=tiny-moe
STEPS=()

step() {  # step NAME COMMAND...: run, keep stdout/stderr/exit code/seconds under $WORK/NAME.*
    local name="$1"; shift
    echo "== $name: $*" >&2
    local t0; t0=$("$PYTHON" -c 'import time; print(time.time())')
    "$@" >"$WORK/$name.out" 2>"$WORK/$name.err"
    echo $? >"$WORK/$name.rc"
    "$PYTHON" -c "import time; print(time.time() - $t0)" >"$WORK/$name.seconds"
    STEPS+=("$name")
    tail -n 3 "$WORK/$name.err" >&2
}

step doctor autotune doctor --json
step profile autotune profile-device --quick --no-progress --out "$WORK/profile.json"
step search autotune search --model "$MODEL" --profile "$WORK/profile.json" --trials 40 --out "$WORK/plan.json" --json
PLAN="$WORK/plan.json"
# No --out: the build writes the format the plan names beside it (plan.aimodel or plan.mlpackage) and, either way,
# plan.manifest.json, which run and evaluate take.
step build autotune build --model "$MODEL" --plan "$PLAN" --no-progress
PACKAGE="$WORK/plan.manifest.json"
if [ "$(cat "$WORK/build.rc")" != 0 ] && grep -q "nothing to build" "$WORK/build.err"; then
    PLAN="$WORK/template.json"  # the tuned plan keeps everything on the CPU: exercise the ANE with a template
    step template autotune plan-template --model "$MODEL" --capacity ample --backend ane --out "$PLAN"
    step build_template autotune build --model "$MODEL" --plan "$PLAN" --no-progress
    PACKAGE="$WORK/template.manifest.json"
fi
step run autotune run --model "$MODEL" --plan "$PLAN" --package "$PACKAGE" --reference --json
step evaluate autotune evaluate --model "$MODEL" --plan "$PLAN" --package "$PACKAGE" --json
# The tuned plan measured against what a user runs instead (mlx-lm's own forward on the GPU, transformers, the
# all-exact plan), side by side on this Mac: its JSON is the report's `bench`.
step bench autotune bench --model "$MODEL" --plan "$WORK/plan.json" --no-progress --json
# Core AI on the Neural Engine (macOS 27, and the doctor found Core AI there): every group and dense function in
# one .aimodel asset.
coreai_here() {
    "$PYTHON" - "$WORK/doctor.out" <<'PY'
import json, sys
lines = [l for l in open(sys.argv[1]).read().splitlines() if l.startswith("{")]
checks = json.loads(lines[-1]).get("checks", []) if lines else []
sys.exit(0 if any(c.get("name") == "coreai" and c.get("status") != "skip" for c in checks) else 1)
PY
}
if [ "$(sw_vers -productVersion 2>/dev/null | cut -d. -f1)" -ge 27 ] 2>/dev/null && coreai_here 2>/dev/null; then
    step coreai_template autotune plan-template --model "$MODEL" --capacity ample --overflow spill --backend coreai \
        --dense coreai --chunk 64 --prompt-tokens 256 --out "$WORK/coreai.json"
    step coreai_build autotune build --model "$MODEL" --plan "$WORK/coreai.json" --out "$WORK/coreai.aimodel" \
        --no-progress
    step coreai_run autotune run --model "$MODEL" --plan "$WORK/coreai.json" --package "$WORK/coreai.aimodel" \
        --reference --json
fi

"$PYTHON" - "$WORK" "$REPORT" "$PLAN" "${STEPS[@]}" <<'PY'
"""Gather every step into one JSON report (written whole, then renamed)."""
import json
import os
import platform
import sys
from pathlib import Path

from autotune.profiling.profile import host_facts

work, report, plan, steps = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]


def parsed(text):
    lines = [l for l in text.splitlines() if l.startswith("{")]
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None


out = {"schema": "npumoe.mac-first-run/1", "host": host_facts(), "macos": platform.mac_ver()[0], "plan_run": plan,
       "steps": {}}
for name in steps:
    text = (work / f"{name}.out").read_text()
    out["steps"][name] = {"exit_code": int((work / f"{name}.rc").read_text()),
                          "seconds": round(float((work / f"{name}.seconds").read_text()), 2),
                          "json": parsed(text), "stdout_tail": text[-2000:],
                          "stderr_tail": (work / f"{name}.err").read_text()[-4000:]}
profile = work / "profile.json"
if profile.exists():
    obj = json.loads(profile.read_text())
    out["profile"] = {"heldout": obj["heldout"],
                      "backends": {b: {k: m[k] for k in ("call_ms", "ms_per_gflop", "power_w")}
                                   for b, m in obj["cost_model"]["backends"].items()}}
for name, step in out["steps"].items():  # where Core AI's compute plan put each build's functions (macOS 27)
    if name.endswith("build") and isinstance(step["json"], dict) and step["json"].get("placement"):
        out.setdefault("placement", {})[name] = {f: s["share"] for f, s in step["json"]["placement"].items()}
if "bench" in out["steps"]:  # the tuned plan against mlx-lm on this Mac, measured
    out["bench"] = out["steps"]["bench"]["json"]
for name in ("plan.json", "template.json"):
    if (work / name).exists():
        out.setdefault("plans", {})[name] = json.loads((work / name).read_text())
failed = [f"{n} (exit {s['exit_code']})" for n, s in out["steps"].items()  # the tuned plan's refused build excused
          if s["exit_code"] != 0 and not (n == "build" and "template" in steps)]  # where the template's replaced it
out["ok"] = not failed
tmp = report.with_name(report.name + ".tmp")
tmp.write_text(json.dumps(out, indent=1))
os.replace(tmp, report)
print(f"mac_first_run.sh: wrote {report} ({'every step passed' if out['ok'] else 'failed: ' + ', '.join(failed)}); "
      "attach it to an issue", file=sys.stderr)
sys.exit(0 if out["ok"] else 1)  # the script (and the workflow's step) fails when a step failed
PY
