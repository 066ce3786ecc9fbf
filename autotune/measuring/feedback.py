"""What was measured goes back into the profile: whole plans timed on this host (`search --measure`) are kept in the
host's profile as records (`plan_records`: each plan's predicted parts and its measured whole prefill), and the
objective corrects its prices from them: one factor per part of the prefill (`whole_prefill.PARTS`), fitted to the
model's records in the dtype being priced by bounded least squares on the relative error, each factor held near 1
by a small ridge so a part no record varies stays as priced. The next search of that model in that dtype on this
host then predicts what it measured; a run in another dtype (its parts' speeds differ) never corrects it."""
from __future__ import annotations

import datetime

import numpy as np
from scipy.optimize import lsq_linear

from autotune.costing.fitting import DTYPE
from autotune.costing.whole_prefill import PARTS
from autotune.profiling.profile import Profile, save_profile

KEY = "plan_records"  # the profile's extra field holding them
RIDGE = 1e-3  # the pull of each factor towards 1, against the records' relative errors
BOUNDS = (0.05, 20.0)  # a factor outside is a broken record, not a price


def add_records(profile: Profile, model: str, dtype: str, prompt_tokens: int, rows: list[dict]) -> Profile:
    """`profile` with `rows` (each a measured candidate: `predicted_parts_ms` as priced before any correction and
    `measured_ms`) kept as records of `model`'s whole plans computing in `dtype` at `prompt_tokens`, saved where it
    was loaded from."""
    when = datetime.date.today().isoformat()
    new = [{"model": model, "dtype": dtype, "prompt_tokens": prompt_tokens, "chunk_tokens": r["chunk_tokens"],
            "predicted_parts_ms": r["predicted_parts_ms"], "measured_ms": r["measured_ms"], "date": when}
           for r in rows if r.get("measured_ms")]
    profile.extra[KEY] = [*profile.extra.get(KEY, []), *new]
    if profile.path:
        save_profile(profile, profile.path)
    return profile


def part_factors(profile: Profile, model: str, dtype: str) -> dict[str, float]:
    """Each part's factor fitted to the profile's whole-plan records of `model` computing in `dtype` (a record
    without one: float32, as the profile's own records; empty: none)."""
    records = [r for r in profile.extra.get(KEY, []) if r["model"] == model and r.get("dtype", DTYPE) == dtype
               and r["measured_ms"] > 0]
    parts = [p for p in PARTS if any(r["predicted_parts_ms"].get(p, 0.0) > 0 for r in records)]
    if not records or not parts:
        return {}
    a = np.array([[r["predicted_parts_ms"].get(p, 0.0) / r["measured_ms"] for p in parts] for r in records])
    pull = np.sqrt(RIDGE)
    fit = lsq_linear(np.vstack([a, pull * np.eye(len(parts))]),
                     np.concatenate([np.ones(len(records)), pull * np.ones(len(parts))]), bounds=BOUNDS)
    return {p: float(f) for p, f in zip(parts, fit.x)}
