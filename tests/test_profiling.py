"""Profiling this host: a tiny real profile-device run (and show-profile on its output), energy meters."""
from __future__ import annotations

import contextlib
import json
import time

import pytest
import torch
from helpers import TINY_PROFILE

from autotune.cli import main
from autotune.profiling.cache_state import Call, ForwardCaches
from autotune.profiling.device import profile_device
from autotune.profiling.energy import RaplMeter
from autotune.profiling.profile import save_profile
from autotune.profiling.settings import Settings
from autotune.profiling.timing import time_call, time_in_forward


def test_tiny_real_profile_device_run_and_show_profile(tmp_path, capsys):
    prof = profile_device(["cpu-exact", "cpu-static"], quick=True, threads=1, progress=False, s=TINY_PROFILE)
    kinds = {r["kind"] for r in prof.records}
    assert {"call", "group", "pack", "exact_host"} <= kinds
    for r in prof.records:
        assert r["runs"] == 3 and r["median_ms"] > 0 and r["p25_ms"] <= r["p75_ms"] and r["clock"] == "cpu"
    assert prof.settings["threads"] == 1 and prof.host["libraries"]["torch"]
    assert set(prof.heldout_mape) >= {"cpu-exact", "cpu-static", "host-pack", "host-exact"}
    if prof.energy["method"] == "none":
        assert not any("power_w" in r for r in prof.records) and not prof.cost_model.has_energy
    path = tmp_path / "tiny.json"
    save_profile(prof, path)
    assert main(["show-profile", str(path), "--json", "--plot", str(tmp_path / "fit.png")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["backends"]) == {"cpu-exact", "cpu-static"}
    assert all("heldout_mape" in b for b in out["backends"].values())
    assert (tmp_path / "fit.png").stat().st_size > 1000


def test_rapl_meter_reads_counters_and_handles_wraparound(tmp_path):
    d = tmp_path / "intel-rapl:0"
    d.mkdir()
    (d / "energy_uj").write_text("999000000\n")
    (d / "max_energy_range_uj").write_text("1000000000\n")
    assert RaplMeter.available(tmp_path)[0]
    m = RaplMeter(tmp_path)
    a = m.read_mj()
    (d / "energy_uj").write_text("1000000\n")  # wrapped: 1 J after the max, +2 J in all
    assert m.delta_mj(a, m.read_mj()) == pytest.approx(2000.0)
    assert not RaplMeter.available(tmp_path / "none")[0]


def test_rapl_window_is_the_energy_spent_inside_the_block(tmp_path):
    d = tmp_path / "intel-rapl:0"
    d.mkdir()
    (d / "energy_uj").write_text("5000000\n")
    (d / "max_energy_range_uj").write_text("1000000000\n")
    with RaplMeter(tmp_path).window() as spent:
        (d / "energy_uj").write_text("8000000\n")
    assert spent == {"cpu_total_mj": pytest.approx(3000.0)}


class _FixedMeter:
    """Any meter that implements the protocol's window: 1 J of CPU and 0.5 J of ANE per window."""
    name, source = "fixed", "test"

    @contextlib.contextmanager
    def window(self):
        out = {}
        yield out
        out.update(cpu_total_mj=1000.0, ane_mj=500.0)


@pytest.mark.parametrize("field,mj", [("cpu_total_mj", 1000.0), ("ane_mj", 500.0)])
def test_time_call_takes_energy_from_any_meter_window(field, mj):
    s = Settings({}, tokens=[], groups=[], pack_tokens=[], warmup=0, min_runs=4, max_runs=4, min_time_s=0.0)
    rec = time_call(lambda: sum(range(1000)), s, _FixedMeter(), energy_field=field, clock="wall")
    assert rec["runs"] == 4 and rec["energy_mj_per_run"] == pytest.approx(mj / 4)
    assert rec["power_w"] > 0


class _CountingMeter:
    """A meter whose window reads 1 mJ per call of `tick` inside it."""
    name, source = "counting", "test"

    def __init__(self) -> None:
        self.ticks = 0

    @contextlib.contextmanager
    def window(self):
        out, start = {}, self.ticks
        yield out
        out["cpu_total_mj"] = float(self.ticks - start)


def test_time_in_forward_rewrites_the_input_before_each_run_and_keeps_its_energy_out():
    """The eviction runs ahead of every run (warm-up too), untimed; the op's input keeps its values; the energy of
    the preparation (measured alone after) is taken off the record's."""
    s = Settings({}, tokens=[], groups=[], pack_tokens=[], warmup=1, min_runs=5, max_runs=5, min_time_s=0.0)
    meter, x = _CountingMeter(), torch.randn(64, 8)
    original, prepared, seen = x.clone(), [], []

    class Caches(ForwardCaches):
        def before(self, call):
            inner = super().before(call)

            def prepare():
                inner()
                meter.ticks += 3  # an eviction's energy
                prepared.append(self.buffer[0].item())
            return prepare

    def run():
        meter.ticks += 1  # the call's own energy
        seen.append(torch.equal(x, original))

    rec = time_in_forward(Call(run, (x,)), s, meter, "cpu_total_mj", "cpu", Caches(nbytes=1 << 20))
    assert rec["runs"] == 5 and len(seen) == 6 + 6 and all(seen)  # then 1 + 5 back to back: `warm_median_ms`
    assert len(prepared) == 6 + 5 and prepared[0] == 1.0  # before each run and the warm-up, then alone for energy
    assert rec["energy_mj_per_run"] == pytest.approx(1.0)


def test_warm_runs_go_back_to_back_without_the_eviction():
    """`warm_median_ms` times the call right after itself: a call that is slow after an eviction (2 ms of CPU) and
    fast after itself (0.5 ms) reads about 2 and 0.5."""
    s = Settings({}, tokens=[], groups=[], pack_tokens=[], warmup=1, min_runs=5, max_runs=5, min_time_s=0.0)
    state = {"evicted": False}

    class Caches(ForwardCaches):
        def before(self, call):
            def prepare():
                state["evicted"] = True
            return prepare

    def run():
        end = time.process_time() + (2e-3 if state["evicted"] else 0.5e-3)
        state["evicted"] = False
        while time.process_time() < end:
            pass

    rec = time_in_forward(Call(run, ()), s, clock="cpu", caches=Caches(nbytes=1 << 10))
    assert rec["median_ms"] == pytest.approx(2.0, rel=0.25) and rec["warm_median_ms"] == pytest.approx(0.5, rel=0.4)


@pytest.mark.parametrize("existing", [False, True])
def test_profile_device_checks_the_model_before_measuring_anything(existing, tmp_path, monkeypatch, capsys):
    """`profile-device --model nosuch-model`: one line, exit 2, before a record is timed (it measured the host's
    backends for 30 s first), and the profile at --out as it was."""
    from autotune.profiling import device, model_records

    def measured(*args, **kwargs):
        raise AssertionError("measured before the model was checked")

    monkeypatch.setattr(device, "profile_device", measured)
    monkeypatch.setattr(model_records, "measure_model", measured)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "host.json"
    if existing:
        out.write_text("{}")
    code = main(["profile-device", "--quick", "--model", "nosuch-model", "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("autotune profile-device: error: ") and \
        "nosuch-model" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["host.json"] if existing else [])
    assert not existing or out.read_text() == "{}"
