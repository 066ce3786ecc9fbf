"""Write docs/commands.md, the command reference, from the argparse parsers (`autotune.cli.build_parser`), and
check the figures the docs quote against the commands that make them.

    python scripts/make_docs.py [--check | --figures]

Every command, its usage and every flag with its help (defaults expanded as `--help` prints them). tests/test_docs.py
fails when the page differs from what the parsers give; `--check` does the same here (exit 1, nothing written).

docs/figures.json lists every figure the README's table and docs/measurements.md quote, with the command that makes
it; `--check` also reruns the cheap ones (`"check"` names how) and fails where the output differs from the docs: the
main job's printed plan summary against the block under docs/measurements.md's "The main job on tiny-moe".
The check runs it on traces pinned in docs/traces/ (calibrated once by PIN_TRACES): the summary is the plan's
predicted figures given those traces, the same on every host; `--figures` rewrites that block from a fresh run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAGE = ROOT / "docs" / "commands.md"
REGENERATE = "python scripts/make_docs.py"
HOST_PROFILE = "$NPUMOE_CACHE/profiles/HOST-ID.json"  # a default that names this host: the page names none
FIGURES = ROOT / "docs" / "figures.json"
MEASUREMENTS = ROOT / "docs" / "measurements.md"
MAIN_JOB = "## The main job on tiny-moe"
# The README's main job on pinned traces, as docs/figures.json lists it: traces calibrated on a host are measured (bf16
# routing differs in a few tokens between CPUs' kernels; tests/test_docs.py bounds that), the plan's figures given
# them are predicted. Its summary leaves out the gate's lines (measured: seconds and memory differ by host), not the
# gate: the robustness line is of the plan the gate chose.
PINNED_TRACES = "docs/traces/tiny-moe.npz"
PIN_TRACES = ["calibrate", "--model", "tiny-moe", "--max-tokens", "8192", "--threads", "1", "--out", PINNED_TRACES]
MAIN_JOB_CHECK = ["search", "--model", "tiny-moe", "--profile", "apple-m2-ultra-published", "--traces", PINNED_TRACES]


def _cell(text: str) -> str:
    """Text for one table cell: one line, its pipes and angle brackets escaped (GitHub reads `<x>` as HTML)."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _metavar(action: argparse.Action) -> str:
    """What follows a flag on the command line: its metavar, or its choices, or its destination in capitals."""
    if action.nargs == 0:
        return ""
    if action.metavar is not None:
        return " ".join(action.metavar) if isinstance(action.metavar, tuple) else action.metavar
    if action.choices is not None:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.dest.upper()


def _synopsis(action: argparse.Action) -> str:
    """An argument as the usage line shows it: `--flag METAVAR`, or the positional's metavar."""
    if not action.option_strings:
        return _metavar(action)
    return " ".join(filter(None, (action.option_strings[0], _metavar(action))))


def _flag(action: argparse.Action) -> str:
    """The flag cell: every spelling with its metavar, `(required)` where it must be given."""
    metavar = _metavar(action)
    names = ", ".join(f"`{o}{' ' + metavar if metavar else ''}`" for o in action.option_strings) \
        if action.option_strings else f"`{metavar}`"
    return names.replace("|", "\\|") + (" (required)" if action.required and action.option_strings else "")


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS]


def _usage(name: str, parser: argparse.ArgumentParser) -> str:
    """One usage line, built here rather than by argparse, whose wrapping changes across Python versions."""
    parts = [_synopsis(a) if a.required or not a.option_strings else f"[{_synopsis(a)}]" for a in _arguments(parser)]
    return " ".join([f"autotune {name}", *parts])


def _section(name: str, help_text: str, parser: argparse.ArgumentParser) -> list[str]:
    """One command's section: what it does, its usage, and a row per flag with its help as `--help` expands it."""
    formatter = parser._get_formatter()
    lines = [f"## `autotune {name}`", "", _cell(help_text or ""), ""]
    if parser.description and parser.description.strip() != (help_text or "").strip():
        lines += [_cell(parser.description), ""]
    lines += ["```", _usage(name, parser), "```", "", "| flag | what it does |", "|---|---|"]
    for action in _arguments(parser):
        lines.append(f"| {_flag(action)} | {_cell(formatter._expand_help(action) if action.help else '')} |")
    return lines + [""]


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The page for `parser` (default: `autotune`'s own)."""
    from autotune.cli import build_parser
    from autotune.profiling.profile import host_profile_path

    parser = parser or build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    lines = ["# Command reference", "",
             f"Generated from the command's parsers by `{REGENERATE}`; tests/test_docs.py fails when it is out "
             "of date.",
             "Every command also answers `--help`; `python -m autotune` is the same command, and `autotune "
             "--version` prints the version.", "",
             *(f"- [`autotune {name}`](#autotune-{name}): {_cell(helps.get(name) or '')}" for name in sub.choices),
             ""]
    for name, p in sub.choices.items():
        lines += _section(name, helps.get(name) or "", p)
    page = "\n".join(lines).rstrip() + "\n"
    return page.replace(str(host_profile_path()), HOST_PROFILE)


def plan_summary(output: str) -> str:
    """The plan summary of `autotune search`'s printed output: every line but the fidelity gate's (measured) and the
    closing `wrote ...` line."""
    lines, gate = [], False
    for line in output.splitlines():
        if line.startswith("fidelity gate"):
            gate = True
        elif gate and not line.startswith("   "):
            gate = False
        if not gate and not line.startswith("wrote "):
            lines.append(line)
    return "\n".join(lines).strip() + "\n"


def documented_summary(page: str) -> str:
    """The fenced block under the main job's heading of docs/measurements.md."""
    section = page.split(MAIN_JOB + "\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```text\n", 1)[1].split("```", 1)[0]


def main_job_output() -> str:
    """The main job's search on the pinned traces, run in a fresh folder."""
    argv = [str(ROOT / a) if a == PINNED_TRACES else a for a in MAIN_JOB_CHECK]
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        done = subprocess.run([sys.executable, "-m", "autotune", *argv, "--out", "plan.json"], cwd=tmp,
                              env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the main job failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout


def check_figures(run_main_job: Callable[[], str] = main_job_output, page: str | None = None) -> list[str]:
    """Where the docs' figures differ from their commands' output now (the cheap ones, rerun): one line each."""
    listed = json.loads(FIGURES.read_text(encoding="utf-8"))["figures"]
    job = next((f["command"] for f in listed if f.get("check") == "main-job"), None)
    if job != "autotune " + " ".join(MAIN_JOB_CHECK):
        return [f"docs/figures.json: the main-job check runs `autotune {' '.join(MAIN_JOB_CHECK)}`, it lists {job!r}"]
    page = MEASUREMENTS.read_text(encoding="utf-8") if page is None else page
    now = plan_summary(run_main_job())
    if documented_summary(page) != now:
        return [f"docs/measurements.md \"{MAIN_JOB[3:]}\": the main job now prints\n{now}"]
    return []


def write_figures(run_main_job: Callable[[], str] = main_job_output) -> None:
    """docs/measurements.md's main-job block rewritten from the main job's summary now."""
    page = MEASUREMENTS.read_text(encoding="utf-8")
    head, section = page.split(MAIN_JOB + "\n", 1)
    section = section.replace(documented_summary(page), plan_summary(run_main_job()), 1)
    MEASUREMENTS.write_text(head + MAIN_JOB + "\n" + section, encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/commands.md is out of date, or a figure the "
                                                         "docs quote differs from its command's output; write nothing")
    ap.add_argument("--figures", action="store_true", help="rewrite the main job's summary in docs/measurements.md "
                                                           f"from a run on {PINNED_TRACES} (remade by `autotune "
                                                           f"{' '.join(PIN_TRACES)}`)")
    args = ap.parse_args()
    if args.figures:
        write_figures()
        print(f"wrote {MEASUREMENTS.relative_to(ROOT)}")
        return 0
    page = render()
    if args.check:
        current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
        problems = [] if current == page else [f"docs/commands.md is out of date: run `{REGENERATE}`"]
        problems += check_figures()
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
