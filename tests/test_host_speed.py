"""`run --json`'s `host_speed`: the profile's own matmul records timed again here, now over then."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autotune.evaluation.host_speed import PROBE_MS, PROBES, host_speed, probe_records
from autotune.profiling.dense_records import matmul_call
from autotune.profiling.profile import host_facts, load_profile
from autotune.profiling.settings import settings_for
from autotune.profiling.timing import time_in_forward


def _this_hosts(records: list[dict]):
    published = load_profile("apple-m2-ultra-published")
    return dataclasses.replace(published, host=host_facts(threads=1), records=records,
                               measured_by="autotune profile-device --quick", settings={"quick": True})


def _rec(m: int, n: int, k: int, ms: float) -> dict:
    return {"kind": "dense_matmul", "m": m, "n": n, "k": k, "clock": "cpu", "median_ms": ms}


def test_host_speed_times_the_profiles_own_records_again(monkeypatch):
    """A record whose profile time is 4x what this host takes for it now reads about 0.25 (a host 4x faster
    now); records too short to time well, wall-clock ones, or a model's records in another dtype (the probe times
    float32 matmuls) are not probed."""
    torch.set_num_threads(1)
    with torch.inference_mode():  # a square matmul whose 4x is a probe's length on this host (AMX: 512; AVX2: 256)
        for d in (256, 512, 1024):
            now = time_in_forward(matmul_call(d, d, d), settings_for(True))["median_ms"]
            if PROBE_MS[0] <= 4 * now <= PROBE_MS[1]:
                break
    assert PROBE_MS[0] <= 4 * now <= PROBE_MS[1], (d, now)
    short, wall = _rec(1, 256, 256, 0.01), dict(_rec(d, d, d, 4 * now), clock="wall")
    bf16 = dict(_rec(d, d, 2 * d, 4 * now), dtype="bfloat16", model="twin")
    profile = _this_hosts([short, wall, bf16, _rec(d, d, d, 4 * now)])
    assert probe_records(profile) == [_rec(d, d, d, 4 * now)]
    out = host_speed(profile)
    assert 0.1 < out["now_over_profile"] < 0.5, out  # now/then between 0.4x and 2x of this measure
    assert out["records"][0]["profile_ms"] == 4 * now and out["label"].startswith("measured: 1 of profile")
    # the probes spread over the records' range, PROBES of them
    many = _this_hosts([_rec(64, 64, 64 * i, 1.0 + i) for i in range(10)])
    assert [r["median_ms"] for r in probe_records(many)] == [1.0, 4.0, 7.0, 10.0][:PROBES]


@pytest.mark.parametrize("change", ["published", "other host", "other threads"])
def test_host_speed_is_none_without_this_hosts_records(change):
    torch.set_num_threads(1)
    profile = _this_hosts([_rec(512, 512, 512, 3.0)])
    if change == "published":
        profile = dataclasses.replace(profile, measured_by="the paper's figures")
    elif change == "other host":
        profile = dataclasses.replace(profile, host={**profile.host, "id": "macos-arm64-apple-m2-ultra-24c"})
    else:
        profile = dataclasses.replace(profile, host={**profile.host, "threads": 2})
    assert host_speed(profile) is None
