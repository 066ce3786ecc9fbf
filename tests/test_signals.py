"""SIGTERM and SIGINT during build, calibrate, search, profile-device and evaluate: the command stops, leaves no
partial output and exits non-zero, whatever stage the signal lands in: a function's conversion, a model forward,
the search's trials, a save, the moment a build's packages land, and where a library swallows the exception: a
`__del__` run by the `gc.collect()` that ends every `ct.convert` (measured: a SIGTERM landing there let `build
--compress palettize4` run to its end), an import guard under a bare `except:` (coremltools' optional imports).
One subprocess runs every case (this file as a script: `python test_signals.py DIR`), each signal sent by the
process to itself where a wrapped function is entered, so nothing depends on timing."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _kill_on_entry(module, name: str, signum: int = signal.SIGTERM, nth: int = 1):
    """Patch `module.name` to send `signum` to this process when entered for the `nth` time, then run on."""
    original, calls = getattr(module, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            os.kill(os.getpid(), signum)
        return original(*args, **kwargs)
    return _patched(module, name, wrapper)


@contextlib.contextmanager
def _patched(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _swallowed_import(swallowed: list):
    """coremltools' import guard (`try: import torchao / except: _HAS_TORCHAO = False`) with the signal landing in
    it; then the work goes on (until the signal is raised again: the loop stands for the rest of the build)."""
    import time

    from runtime.coreml import converter

    original = converter.quiet_coremltools_import

    def guarded_import():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs here, inside the guard
                pass
        except:  # noqa: E722 (the guard as coremltools writes it)
            swallowed.append(True)
        original()
        while True:
            time.sleep(0.01)
    return _patched(converter, "quiet_coremltools_import", guarded_import)


def _swallowed_in_a_finalizer(swallowed: list):
    """The swallow measured on `build --compress palettize4`: `ct.convert` ends in `gc.collect()`, a palettizer
    pass object's `__del__` runs there, and an exception raised in a `__del__` is dropped ("Exception ignored"):
    the signal lands in one; then the work goes on (until the signal is raised again)."""
    import gc
    import time

    from runtime.coreml import converter

    class Pass:
        def __del__(self):
            swallowed.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs here, inside the finalizer
                pass

    def converted():
        cycle = Pass()
        cycle.me = cycle
        del cycle
        with contextlib.redirect_stderr(io.StringIO()):  # as quiet_progress hides the "Exception ignored" notice
            gc.collect()
        while True:
            time.sleep(0.01)
    return _patched(converter, "quiet_coremltools_import", converted)


@contextlib.contextmanager
def _at_forward(nth: int):
    """SIGTERM at the `nth` forward of the decoder stack (`<Family>Model`: a calibration chunk, an evaluation
    prompt's chunk)."""
    import torch

    original, calls = torch.nn.Module.__call__, [0]

    def call(self, *args, **kwargs):
        if type(self).__name__.endswith("Model"):
            calls[0] += 1
            if calls[0] == nth:
                os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)
    torch.nn.Module.__call__ = call
    try:
        yield
    finally:
        torch.nn.Module.__call__ = original


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def drive(work: Path) -> dict:
    """Run every case in this process; return {case: {code, left, stderr...}}."""
    from autotune.cli import main
    from autotune.profiling import settings
    from autotune.searching.templates import template_plan
    from runtime.coreml import converter
    from runtime.loading.model_record import read_model_spec
    from runtime.plan import save_plan

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import TINY_PROFILE

    import autotune.pipeline as pipeline
    import autotune.profiling.device as device
    import runtime.fileio as fileio

    converter.quiet_coremltools_import()  # whole before any case: a signal in an import would leave it half made
    inputs = work / "inputs"
    inputs.mkdir()
    cpu = template_plan(read_model_spec("tiny-moe"), "ample", "drop", "cpu-static", 64, "router_weight")
    save_plan(cpu, inputs / "cpu.json")
    first = cpu.layers[0].model_copy(update={"groups": [cpu.layers[0].groups[0].model_copy(update={"backend": "ane"}),
                                                        *cpu.layers[0].groups[1:]]})
    save_plan(cpu.model_copy(update={"layers": [first, *cpu.layers[1:]]}), inputs / "ane.json")  # one function
    (inputs / "text.txt").write_text("Routing skews toward a few experts; the rest idle. " * 8)
    calibrate = ["calibrate", "--model", "random:qwen3_moe", "--text", str(inputs / "text.txt"), "--chunk", "32",
                 "--prompt-tokens", "64"]
    assert main([*calibrate, "--out", str(inputs / "traces.npz")]) == 0
    cache = work / "coreml-cache"
    swallowed: list = []
    finalized: list = []

    def build(out: Path) -> list[str]:
        return ["build", "--model", "tiny-moe", "--plan", str(inputs / "ane.json"), "--compress", "none",
                "--out", str(out / "x.mlpackage"), "--cache-dir", str(cache), "--no-progress"]

    def search(out: Path) -> list[str]:
        return ["search", "--model", "random:qwen3_moe", "--traces", str(inputs / "traces.npz"), "--profile",
                "apple-m2-ultra-published", "--trials", "5", "--no-gate", "--out", str(out / "plan.json")]

    def profile(out: Path) -> list[str]:
        return ["profile-device", "--quick", "--backends", "cpu-exact", "--out", str(out / "profile.json"),
                "--no-progress"]

    def evaluate(out: Path) -> list[str]:
        return ["evaluate", "--model", "tiny-moe", "--plan", str(inputs / "cpu.json"), "--max-tokens", "256",
                "--prompt-tokens", "64"]

    fsync = os.fsync
    cases = {
        "build: coremltools' import guard swallows it": (build, _swallowed_import(swallowed)),
        "build: a finalizer in coremltools' gc.collect() swallows it": (build, _swallowed_in_a_finalizer(finalized)),
        "build: a function's conversion": (build, _kill_on_entry(converter, "compressed")),
        "build: Ctrl-C in a function's conversion": (build, _kill_on_entry(converter, "compressed", signal.SIGINT)),
        "build: the packages land": (build, _kill_on_entry(converter, "atomic_write_json")),
        "calibrate: the second chunk's forward": (lambda out: [*calibrate, "--out", str(out / "t.npz")],
                                                  _at_forward(2)),
        "calibrate: the save": (lambda out: [*calibrate, "--out", str(out / "t.npz")],
                                _kill_on_entry(fileio.os, "fsync")),
        "search: the trials": (search, _kill_on_entry(pipeline, "timed_search")),
        "search: the save": (search, _kill_on_entry(fileio.os, "fsync")),
        "profile-device: measuring": (profile, _kill_on_entry(device, "profile_device")),
        "profile-device: the save": (profile, _kill_on_entry(fileio.os, "fsync")),
        "evaluate: a chunk's forward": (evaluate, _at_forward(3)),
    }
    results = {}
    for i, (name, (argv, hook)) in enumerate(cases.items()):
        out = work / f"case{i}"
        out.mkdir()
        before_cache = _files(cache) if cache.exists() else set()
        err = io.StringIO()
        with hook, _patched(settings, "settings_for", lambda quick: TINY_PROFILE), \
                contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv(out))
        assert os.fsync is fsync
        temps = sorted(p for p in (_files(cache) if cache.exists() else set()) - before_cache
                       if Path(p).name.startswith(".convert-") or ".tmp" in p)
        results[name] = {"code": code, "left": sorted(_files(out)), "cache_temps": temps,
                         "last_line": (err.getvalue().strip().splitlines() or [""])[-1]}
    results["swallowed"] = bool(swallowed) and bool(finalized)
    return results


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    work = tmp_path_factory.mktemp("signals")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NPUMOE_CACHE": str(work / "npumoe-cache")}
    done = subprocess.run([sys.executable, __file__, str(work)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((work / "results.json").read_text())


@pytest.mark.parametrize("name", ["build: coremltools' import guard swallows it",
                                  "build: a finalizer in coremltools' gc.collect() swallows it"])
def test_the_swallowed_signal_is_raised_again_and_the_build_stops(outcome, name):
    """Before the watchdog, the build ran to its end (exit 0, the package and manifest written)."""
    case = outcome[name]
    assert outcome["swallowed"] and case["code"] == 128 + signal.SIGTERM, case
    assert case["left"] == [] and case["cache_temps"] == [] and case["last_line"] == "autotune build: terminated"


def test_a_signal_as_the_packages_land_leaves_them_whole_with_their_manifest(outcome):
    """Before, the packages were put in place and the manifest, written after, was not: a package without it."""
    case = outcome["build: the packages land"]
    assert case["code"] == 128 + signal.SIGTERM and case["left"] == ["x.manifest.json", "x.mlpackage"], case


@pytest.mark.parametrize("name", [
    "build: a function's conversion", "calibrate: the second chunk's forward", "calibrate: the save",
    "search: the trials", "search: the save", "profile-device: measuring", "profile-device: the save",
    "evaluate: a chunk's forward"])
def test_sigterm_stops_the_command_and_leaves_nothing(outcome, name):
    case = outcome[name]
    command = name.split(":")[0]
    assert case == {"code": 128 + signal.SIGTERM, "left": [], "cache_temps": [],
                    "last_line": f"autotune {command}: terminated"}


def test_ctrl_c_stops_a_build_and_leaves_nothing(outcome):
    case = outcome["build: Ctrl-C in a function's conversion"]
    assert case == {"code": 130, "left": [], "cache_temps": [], "last_line": "autotune build: interrupted"}


if __name__ == "__main__":
    work_dir = Path(sys.argv[1])
    (work_dir / "results.json").write_text(json.dumps(drive(work_dir)))
