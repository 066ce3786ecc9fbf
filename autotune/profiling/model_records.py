"""Records at one model's own shapes, added to a profile (`profile-device --model M`, and a search on a measured
host profile that lacks them): its experts' hidden x FFN at the row counts a plan gives an expert's call, static
groups of them, the executor's host work at its hidden size, its projections, router, MLP and lm_head at a chunk's
rows, its attention core at its heads and the contexts of a prompt, its norms. Timed as `profile-device` times
everything (`device.run_tasks`, `dense_records`), tagged `"model"` with the model's label, merged into the profile
(an earlier set of the same model's records replaced) and the cost model refitted over all of them.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from autotune.costing.costmodel import CostModel
from autotune.costing.fit_range import Reach, describe_parts
from autotune.costing.whole_prefill import DecoderShape, priced_outside
from autotune.profiling.dense_records import DenseShape, dense_records
from autotune.profiling.device import plan_tasks, run_tasks
from autotune.profiling.profile import Profile, build_profile, host_id, save_profile, utc_now
from autotune.profiling.settings import Settings, settings_for
from autotune.profiling.timing import clock_for
from runtime.backends import EXACT, registry
from runtime.errors import NpumoeError
from runtime.loading.compute_dtype import dtype_name

log = logging.getLogger("npumoe")

# An expert call's rows in a plan: one token's (decode) up to a skewed chunk's share; quick keeps one per octave.
ROWS_QUICK = (1, 4, 16, 64, 128, 256, 512, 1024, 2048)
ROWS_FULL = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096)
DENSE_ROWS = (1, 64, 256, 1024, 4096)  # a decode step up to a whole 4096-token chunk
PACK_TOKENS = (256, 1024, 4096)  # the chunks the executor's host work is timed at
MEASURE_PROBE_TOKENS = 256  # a chunk and context inside every profile's range: what is left is the model's shape


def model_settings(shape: DecoderShape, label: str, quick: bool) -> Settings:
    """What to time at the model's shapes: its experts (hidden x FFN) at the plan's row counts and a few static
    groups, its top-k for the host's packing, over as few experts as that takes (a large model's experts would not
    fit in memory; every record runs in a forward's evicted cache state anyway); no kernel records (the storage
    prices keep the default shapes')."""
    base = settings_for(quick)
    return dataclasses.replace(base, shapes={label: (shape.hidden, shape.expert_ffn)},
                               tokens=list(ROWS_QUICK if quick else ROWS_FULL), groups=[(4, 64), (4, 256)],
                               pack_tokens=list(PACK_TOKENS), top_k=max(1, shape.top_k),
                               num_experts=max(4, shape.top_k), kernels=False)


def dense_shape(shape: DecoderShape) -> DenseShape:
    """The model's dense ops as `dense_records` times them (lm_head's vocabulary capped as for the default shapes:
    its GEMV streams the weights, a capped width fits the same bandwidth term)."""
    mlp = max((shape.mlp_ffn(layer) for layer in range(shape.num_layers)), default=0)
    return DenseShape(shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, max(1, shape.num_experts),
                      min(shape.vocab, 32768), (1,), mlp, DENSE_ROWS, shape.norm)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set for the block: the profiler's modules and inputs are made in it."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def measure_model(shape: DecoderShape, label: str, backends: list[str], quick: bool = True, clock: str = "auto",
                  progress: bool = True, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Time the model's shapes on `backends` (the profile's) in the dtype it computes in (a half-precision model's
    CPU matmuls run another kernel: on an AMX host bf16 took 0.17-0.3x fp32's time); every record tagged
    `"model": label`, and `"dtype"` where not float32 (`profile.DTYPE`)."""
    s = model_settings(shape, label, quick)
    records = []
    with default_dtype(dtype):
        if shape.num_experts:
            tasks = [t for t in plan_tasks(backends, s) if t.kind != "call"]  # dispatch costs: the profile has them
            records += run_tasks(tasks, s, None, progress, clock)
        if EXACT in backends:
            which = clock_for(True, torch.get_num_threads()) if clock == "auto" else clock
            records += dense_records(s, which, progress, {label: dense_shape(shape)})
    tag = {"model": label, **({} if dtype == torch.float32 else {"dtype": dtype_name(dtype)})}
    return [{**r, **tag} for r in records]


def add_model_records(profile: Profile, shape: DecoderShape, label: str, quick: bool = True,
                      progress: bool = True, dtype: torch.dtype = torch.float32) -> tuple[Profile, int, float]:
    """The profile with the model's records in `dtype` added (the same model's earlier ones replaced) and refitted;
    with how many records were timed and in how many seconds. Timed on the profile's threads and clock, on its
    backends that run torch on the CPU (what the model's dtype changes)."""
    backends = [b for b in profile.settings.get("backends") or profile.cost_model.backends
                if registry.get(b) and (dtype == torch.float32 or registry.get(b).cpu_torch)]
    threads = int(profile.settings.get("threads") or 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        new = measure_model(shape, label, backends, quick, profile.settings.get("clock", "auto"), progress, dtype)
    finally:
        torch.set_num_threads(before)
    seconds = time.perf_counter() - t0
    own = None if dtype == torch.float32 else dtype_name(dtype)
    records = [r for r in profile.records if (r.get("model"), r.get("dtype")) != (label, own)] + new
    options = {b: {"dtype_bytes": m.dtype_bytes} for b, m in profile.cost_model.models.items()}
    about = {"dtype": dtype_name(dtype), "hidden": shape.hidden, "ffn": shape.expert_ffn, "heads": shape.heads,
             "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "records": len(new), "wall_s": round(seconds, 1),
             "quick": quick, "measured": utc_now()}
    models = {**profile.settings.get("models", {}), label + (f"@{own}" if own else ""): about}
    merged = build_profile(records, profile.host, profile.measured_by, {**profile.settings, "models": models},
                           profile.energy, options)
    merged.created, merged.path, merged.extra = profile.created, profile.path, profile.extra
    return merged, len(new), seconds


def require_measurable(profile: Profile, name: str) -> None:
    """Records can be added only to a profile measured by `profile-device` on this host's hardware."""
    if profile.published:
        raise NpumoeError(f"profile {name} holds published figures ({profile.measured_by}): records cannot be "
                          "measured into it here")
    if not profile.measured_here:
        raise NpumoeError(f"profile {name} was measured on {profile.host.get('id')!r}, not this host "
                          f"({host_id()!r}): records timed here would not describe it")


def model_label(model: str) -> str:
    """A model's name as its records are tagged: a folder by its last part."""
    return Path(model).name if Path(model).exists() else model


def shape_outside(cost: CostModel, shape: DecoderShape) -> dict[str, list[Reach]]:
    """The parts whose fits the model's own shape (hidden, FFN, heads, widths; not a plan's rows or context) lies
    past: what records at its shapes would cover."""
    parts = priced_outside(cost, shape, MEASURE_PROBE_TOKENS, MEASURE_PROBE_TOKENS)
    return {p: kept for p, rs in parts.items() if (kept := [r for r in rs if r.axis not in ("rows", "context")])}


def dtype_lacking(profile: Profile, dtype: torch.dtype) -> str | None:
    """What the profile lacks to price a model computing in `dtype` from its own records (None: nothing)."""
    if dtype == torch.float32 or dtype_name(dtype) in profile.by_dtype:
        return None
    return f"no {dtype_name(dtype)} records (the model computes in it; priced from float32's)"


def cover_model(profile: Profile, name: str, shape: DecoderShape, label: str, measure: bool, progress: bool,
                layer_bytes: int, dtype: torch.dtype = torch.float32) -> Profile:
    """The profile a search prices `label` on: where its shapes lie past the fits' ranges, or the profile timed
    nothing in the dtype it computes in, and the profile was measured here (and `measure`), with its records added
    first, saved into the profile's file and said in one line; else as it is (`outside_line` says what it prices
    past its records)."""
    outside = shape_outside(profile.cost_model_for(layer_bytes, dtype_name(dtype))[0], shape)
    lacks = [describe_parts(outside)] if outside else []
    lacks += [note] if (note := dtype_lacking(profile, dtype)) else []
    if not lacks or not measure or profile.published or not profile.measured_here or not profile.path:
        return profile
    merged, n, seconds = add_model_records(profile, shape, label, quick=True, progress=progress, dtype=dtype)
    save_profile(merged, profile.path)
    log.warning(f"measured {n} records at {label}'s shapes in {seconds:.0f} s into {profile.path} (profile {name} "
                f"lacked them: {'; '.join(lacks)}); --no-measure keeps the profile as it is")
    return merged


def outside_line(profile: Profile, name: str, label: str, outside: dict[str, list[Reach]], measure: bool,
                 dtype: torch.dtype = torch.float32) -> str | None:
    """The one line a search says of the parts it priced past the profile's records, and how far (None: none),
    with why they were not measured: published figures, --no-measure, or another host's profile."""
    lacks = [describe_parts(outside)] if outside else []
    lacks += [note] if (note := dtype_lacking(profile, dtype)) else []
    if not lacks:
        return None
    whose = "published figures" if profile.published else "--no-measure" if not measure else \
        "measured here" if profile.measured_here else "measured on another host"
    return f"profile {name} ({whose}) prices {label} past its records: {'; '.join(lacks)}"
