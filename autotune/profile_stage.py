"""The profile stage: this host's backends measured and the cost model fitted (`profile_device`), a model's own
shapes added to a profile (`measure_model_shapes`). Moved out of `autotune/pipeline.py`, which re-exports these with
the other stages."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from autotune.costing.whole_prefill import decoder_shape
from autotune.profiling.model_records import add_model_records, model_label, require_measurable
from autotune.profiling.profile import Profile, host_profile_path, load_profile, save_profile
from runtime.loading.model_record import ModelRecord, resolve_model


def profile_device(backends: list[str] | None = None, *, quick: bool = False, threads: int = 1,
                   shapes: dict[str, tuple[int, int]] | None = None, clock: str = "auto",
                   out: str | os.PathLike | None = None, progress: bool = True, model: str | None = None,
                   dtype: str = "auto") -> Profile:
    """Measure this host's backends, fit the cost model and save the profile to `out` (default: this host's cache,
    `host_profile_path()`); returns it with `path` set. With `model`: records at that model's own shapes
    (`profiling.model_records`), timed in the dtype it computes in (`dtype`, auto resolved here), added to the
    profile at `out` where one is there (measured on this host), else to a new one measured first."""
    from autotune.profiling.device import profile_device as measure
    from autotune.profiling.settings import settings_for

    out = out or host_profile_path()
    record = resolve_model(model, dtype) if model is not None else None  # a bad model: refused before measuring
    if model is not None and Path(out).exists():
        profile = load_profile(out, check_host=False)
        require_measurable(profile, str(out))
    else:
        s = settings_for(quick)
        if shapes:
            s = dataclasses.replace(s, shapes=shapes)
        profile = measure(backends, quick, threads, progress=progress, s=s, clock=clock)
    profile.path = str(out)
    if record is not None:
        profile = measure_model_shapes(profile, record, quick, progress)[0]
    save_profile(profile, out)
    return profile


def measure_model_shapes(profile: Profile, record: ModelRecord, quick: bool = True,
                         progress: bool = True) -> tuple[Profile, int, float]:
    """`profile` with records at the model's own shapes added and refitted (`model_records.add_model_records`);
    with the records' count and the seconds they took."""
    return add_model_records(profile, decoder_shape(record), model_label(record.name), quick, progress,
                             record.compute_dtype)
