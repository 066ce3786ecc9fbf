"""Every bad input a clear error: exit 2, one line on stderr naming the problem, no traceback, nothing left behind.

Each case runs `autotune.cli.main` in-process on argv with `{placeholders}` filled from a folder of bad files made
once per module; the working directory is a fresh empty folder, so the default output paths land there too."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from autotune.cli import main

M = ["--model", "random:qwen3_moe"]


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, str]:
    """Paths of the bad (and a few good) input files the cases name."""
    d = tmp_path_factory.mktemp("bad")
    (d / "adir").mkdir()
    (d / "notes.txt").write_text("not a plan\n")
    (d / "garbage.bin").write_bytes(os.urandom(256))
    paths = {"adir": str(d / "adir"), "notes": str(d / "notes.txt"), "garbage": str(d / "garbage.bin")}
    paths["dir"] = str(d)
    paths["missing"] = str(d / "missing" / "deeper")
    return paths


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse errors
        return e.code


def listing(*dirs: str | Path) -> set[str]:
    return {str(p) for d in dirs for p in Path(d).rglob("*")}


# (case id, argv, a word the one-line error must contain)
CASES = [
    ("trials-zero", ["search", *M, "--trials", "0"], "--trials"),
    ("trials-negative", ["search", *M, "--trials", "-5"], "--trials"),
    ("resident-mb-negative", ["search", *M, "--resident-mb", "-1"], "--resident-mb"),
    ("drop-budget-one", ["search", *M, "--drop-budget", "1"], "--drop-budget"),
    ("seed-negative", ["search", *M, "--seed", "-1"], "--seed"),
    ("threads-zero", ["calibrate", *M, "--threads", "0"], "--threads"),
    ("repeat-zero", ["run", *M, "--plan", "{notes}", "--repeat", "0"], "--repeat"),
    ("max-tokens-zero", ["calibrate", *M, "--max-tokens", "0"], "--max-tokens"),
    ("max-tokens-negative", ["calibrate", *M, "--max-tokens", "-1"], "--max-tokens"),
    ("chunk-zero", ["calibrate", *M, "--chunk", "0"], "--chunk"),
    ("chunk-negative", ["calibrate", *M, "--chunk", "-8"], "--chunk"),
    ("chunk-not-int", ["calibrate", *M, "--chunk", "many"], "--chunk"),
    ("prompt-tokens-zero", ["calibrate", *M, "--prompt-tokens", "0"], "--prompt-tokens"),
    ("template-chunk-zero", ["plan-template", *M, "--chunk", "0", "--out", "p.json"], "--chunk"),
    ("shapes-zero", ["profile-device", "--shapes", "0x0"], "--shapes"),
    ("shapes-negative", ["profile-device", "--shapes=-64x64"], "--shapes"),
    ("shapes-garbage", ["profile-device", "--shapes", "big"], "--shapes"),
    ("backends-empty", ["profile-device", "--backends", ""], "--backends"),
    ("storage-driver-missing", ["search", *M, "--storage", "mysql://u@localhost/db"], "driver"),
    ("storage-sqlite-not-db", ["search", *M, "--storage", "sqlite:///{notes}"], "not an SQLite"),
    ("storage-sqlite-missing-dir", ["search", *M, "--storage", "sqlite:///{missing}/s.db"], "no such directory"),
    ("storage-journal-garbage", ["search", *M, "--storage", "journal:{garbage}"], "journal"),
    ("storage-journal-missing-dir", ["search", *M, "--storage", "journal:{missing}/j.log"], "no such directory"),
    ("storage-unknown", ["search", *M, "--storage", "somewhere"], "storage URL"),
    ("search-out-directory", ["search", *M, "--out", "{adir}"], "directory"),
    ("search-out-read-only", ["search", *M, "--out", "/proc/p.json"], "cannot write"),
    ("calibrate-out-read-only", ["calibrate", *M, "--out", "/proc/t.npz"], "cannot write"),
    ("profile-out-directory", ["profile-device", "--out", "{adir}"], "directory"),
    ("template-out-directory", ["plan-template", *M, "--out", "{adir}"], "directory"),
    ("template-out-read-only", ["plan-template", *M, "--out", "/proc/p.json"], "cannot write"),
    ("build-out-not-package", ["build", *M, "--plan", "{notes}", "--out", "notes.txt"], ".mlpackage"),
    ("build-cache-dir-file", ["build", *M, "--plan", "{notes}", "--cache-dir", "{notes}"], "not a directory"),
    ("build-plan-missing", ["build", *M, "--plan", "{missing}/p.json"], "no such file"),
    ("run-plan-directory", ["run", *M, "--plan", "{adir}"], "directory"),
    ("run-package-missing", ["run", *M, "--plan", "{notes}", "--package", "{missing}/x.mlpackage"],
     "no such package"),
    ("plot-no-suffix", ["show-profile", "apple-m2-ultra-published", "--plot", "{adir}"], "must end in"),
    ("plot-read-only", ["show-profile", "apple-m2-ultra-published", "--plot", "/proc/p.png"], "cannot write"),
    ("no-command", [], "required"),
    ("unknown-option", ["search", *M, "--trails", "5"], "unrecognized"),
]


@pytest.mark.parametrize("argv,needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(argv, needle, bad, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = [a.format(**bad) for a in argv]
    before = listing(tmp_path, bad["dir"])
    code = run_cli(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("autotune"), err
    assert needle in lines[0], err
    assert listing(tmp_path, bad["dir"]) == before


def test_version_and_module_entry(capsys):
    import subprocess

    assert run_cli(["--version"]) == 0
    assert capsys.readouterr().out.startswith("autotune ")
    out = subprocess.run([sys.executable, "-m", "autotune", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("autotune ")


def test_every_option_has_help():
    from autotune.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    missing = [f"{name} {act.option_strings or act.dest}" for name, p in sub.choices.items()
               for act in p._actions if not act.help]
    assert missing == []
