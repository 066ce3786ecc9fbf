"""`autotune doctor`: on Linux every macOS check is skipped with its reason and the rest pass (exit 0); the
version and macOS checks fail where they should; on macOS the whole ANE path passes."""
import json
import sys

import pytest

from autotune.cli import main
from autotune.profiling import host_checks as doctor

MACOS_CHECKS = {"chip", "macos_version", "ane", "placement", "ane_parity", "predict_overhead", "matmul_throughput",
                "energy", "attention_core", "coreai"}


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the non-macOS answer")
def test_doctor_json_on_linux_skips_macos_checks_and_passes_the_rest(capsys):
    rc = main(["doctor", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"]
    checks = {c["name"]: c for c in out["checks"]}
    assert set(checks) == {name for name, _ in doctor.CHECKS} and MACOS_CHECKS < set(checks)
    for name, c in checks.items():
        assert c["status"] == ("skip" if name in MACOS_CHECKS else "pass"), c
        assert c["detail"]
    assert all("macOS" in checks[n]["detail"] or "Mac" in checks[n]["detail"] for n in MACOS_CHECKS)
    # the group function really was built and evaluated on the host
    assert "max relative error" in checks["coreml_build"]["detail"]
    # MLX: its version, its device, and one mlx-exact call against the experts' own computation
    from importlib.metadata import version

    mlx = checks["mlx"]["detail"]
    assert f"mlx {version('mlx')} on MLX's CPU device" in mlx and "mlx-exact runs: max relative error" in mlx, mlx


@pytest.mark.skipif(sys.platform == "darwin", reason="the Linux run; macOS's is held by the macos-marked tests")
def test_doctor_leaves_no_temp_folder(tmp_path):
    """`autotune doctor` in a TMPDIR of its own: listed before and after, nothing is left (coremltools' converted
    packages and torch's inductor folder went there and stayed)."""
    import os
    import subprocess

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "NPUMOE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "autotune", "doctor", "--json"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert os.listdir(tmp) == []


def test_help_names_the_mac_defaults(capsys):
    """`calibrate`'s engine defaults to auto (MLX where it runs the model); `profile-device` names mlx-exact and
    coreai among its defaults."""
    from autotune.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    engine = next(a for a in sub["calibrate"]._actions if a.dest == "engine")
    assert engine.default == "auto" and engine.help.startswith("what runs the forward passes: auto (default")
    backends = next(a for a in sub["profile-device"]._actions if a.dest == "backends").help
    assert "mlx-exact" in backends and "coreai" in backends


@pytest.mark.parametrize("device,profiled", [("gpu", True), ("cpu", False)])
def test_mlx_exact_profiled_by_default_only_on_a_metal_gpu(device, profiled):
    """A darwin host whose MLX has no Metal GPU (a VM, hosted CI) does not profile mlx-exact by default: its CPU
    times are not a free lane beside the CPU. (A child process: sys.platform and mlx.core stubbed before import.)"""
    import subprocess

    code = ("import sys, types, torch, runtime.backends.registry, runtime.mlx.formats; sys.platform = 'darwin'; "
            "core = types.ModuleType('mlx.core'); "
            f"core.gpu, core.cpu = 'gpu', 'cpu'; core.default_device = lambda: {device!r}; "
            "sys.modules['mlx'] = types.ModuleType('mlx'); sys.modules['mlx.core'] = core; "
            "from runtime.mlx.mlx_backends import BACKENDS; print(BACKENDS[0].profiled_by_default)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == str(profiled), out.stderr


def test_a_library_outside_the_declared_range_fails(monkeypatch):
    monkeypatch.setattr(doctor, "_project_requirements", lambda: {"torch": ["<1.0"]})
    with pytest.raises(doctor.Failed, match="does not satisfy <1.0"):
        doctor.library_check("torch")(doctor.Probe())


@pytest.mark.parametrize("version,message", [((14, 6), "need macOS 15"), ((26, 3), "deadlock")])
def test_too_old_and_known_bad_macos_fail(monkeypatch, version, message):
    monkeypatch.setattr(doctor, "on_macos", lambda: True)
    monkeypatch.setattr(doctor, "macos_version", lambda: version)
    with pytest.raises(doctor.Failed, match=message):
        doctor.check_macos_version(doctor.Probe())
    monkeypatch.setattr(doctor, "macos_version", lambda: (26, 4))
    assert "26.4" in doctor.check_macos_version(doctor.Probe())


def test_a_crashing_check_is_a_failure_with_exit_1(monkeypatch, capsys):
    def broken(_):
        raise RuntimeError("boom")

    monkeypatch.setattr(doctor, "CHECKS", [("os", doctor.check_os), ("broken", broken)])
    assert main(["doctor", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [c["status"] for c in out["checks"]] == ["pass", "fail"] and "boom" in out["checks"][1]["detail"]


@pytest.mark.macos
@pytest.mark.skipif(sys.platform != "darwin", reason="the ANE path needs macOS")
def test_macos_doctor_passes_the_ane_path():
    checks = {c.name: c for c in doctor.run_checks()}
    for name in ("macos_version", "ane", "coreml_build", "ane_parity", "predict_overhead", "matmul_throughput",
                 "attention_core"):
        assert checks[name].status == "pass", checks[name]
