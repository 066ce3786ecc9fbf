"""This host's speed now against when its profile was measured: a few of the profile's own matmul records timed
again as `profile-device` timed them (`timing.time_in_forward`, on the record's clock), so that a run's measured
parts can be read beside how much slower or faster the host itself runs than it did then (a shared VM's speed
moves by a third within minutes; a Mac's by its thermal state and power mode). What `run --json` reports as
`host_speed`; None where the profile is another host's or published (no record of this host to time again)."""
from __future__ import annotations

import statistics

import torch

from autotune.profiling.cache_state import ForwardCaches
from autotune.profiling.dense_records import matmul_call
from autotune.profiling.profile import Profile
from autotune.profiling.settings import settings_for
from autotune.profiling.timing import time_in_forward

PROBES = 4  # records timed again
PROBE_MS = (1.0, 20.0)  # records this long: past the timer's noise, short enough for a run to add about a second


def probe_records(profile: Profile) -> list[dict]:
    """The profile's one-thread CPU float32 matmul records of PROBE_MS (a model's records in its own dtype are not
    what `matmul_call` times), PROBES of them spread over that range."""
    lo, hi = PROBE_MS
    recs = sorted((r for r in profile.records if r.get("kind") == "dense_matmul" and r.get("clock") == "cpu"
                   and r.get("dtype", "float32") == "float32" and lo <= r["median_ms"] <= hi),
                  key=lambda r: r["median_ms"])
    if len(recs) <= PROBES:
        return recs
    return [recs[round(i * (len(recs) - 1) / (PROBES - 1))] for i in range(PROBES)]


def host_speed(profile: Profile | None) -> dict | None:
    """`profile`'s probe records timed again here: each one's time now over its time then, and their median
    (`now_over_profile`: 1.2 means this host runs those ops 1.2x slower now). None where the profile is not this
    host's own, was timed on other threads than this run's, or has no such record."""
    if profile is None or not profile.measured_here or profile.host.get("threads", 1) != torch.get_num_threads():
        return None
    recs = probe_records(profile)
    if not recs:
        return None
    s, caches = settings_for(bool(profile.settings.get("quick", True))), ForwardCaches()
    with torch.inference_mode():
        now = [time_in_forward(matmul_call(r["m"], r["n"], r["k"]), s, clock="cpu", caches=caches)["median_ms"]
               for r in recs]
    ratios = [t / r["median_ms"] for t, r in zip(now, recs)]
    return {"now_over_profile": round(statistics.median(ratios), 4),
            "records": [{"m": r["m"], "n": r["n"], "k": r["k"], "profile_ms": r["median_ms"], "now_ms": round(t, 6)}
                        for r, t in zip(recs, now)],
            "label": f"measured: {len(recs)} of profile {profile.path or '(in memory)'}'s matmul records timed again "
                     "as profile-device timed them, now over then (CPU clock)"}
