"""Profiling this host: plan the benchmark tasks, run them, fit the cost model (`autotune profile-device`)."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from autotune.profiling.cache_state import ForwardCaches
from autotune.profiling.callers import Rotor, group_caller, host_caller, make_experts, pack_capacity
from autotune.profiling.dense_records import dense_records
from autotune.profiling.energy import EnergyMeter, energy_meter
from autotune.profiling.kernels import kernel_records
from autotune.profiling.profile import Profile, build_profile, host_facts
from autotune.profiling.settings import MAX_PACK_ELEMENTS, Settings, settings_for
from autotune.profiling.static_dense_records import static_dense_records
from autotune.profiling.timing import clock_for, time_call, time_in_forward
from runtime.backends import CPU_ENERGY, EXACT, registry
from runtime.errors import NpumoeError


@dataclass
class Task:
    kind: str
    backend: str
    shape: str
    hidden: int
    ffn: int
    capacities: list[int] = field(default_factory=list)
    tokens: int = 0

    def describe(self) -> dict:
        out = {"kind": self.kind, "backend": self.backend, "shape": self.shape, "hidden": self.hidden,
               "ffn": self.ffn}
        if self.kind in ("pack", "exact_host"):
            out["tokens"] = self.tokens
            if self.kind == "pack":
                out["capacity"] = self.capacities[0]
        else:
            out["capacities"] = self.capacities
            out["experts"] = len(self.capacities)
        return out


def plan_tasks(backends: list[str], s: Settings) -> list[Task]:
    infos = [registry.get(b) for b in backends]
    tasks = []
    for b in backends:
        tasks.append(Task("call", b, "tiny-call", 16, 16, [1]))  # dispatch + sync: the smallest real call
        tasks += [Task("call", b, "tiny-call", 16, 16, [1] * g) for g in (4, 16) if g <= s.num_experts]
    for name, (h, f) in s.shapes.items():
        for info in infos:
            tokens, groups = s.tokens, s.groups
            if info.compiles_per_shape:
                # every shape is a conversion and a compile (seconds): powers of two (quick: of four)
                base = 4 if s.quick else 2
                tokens = [m for m in s.tokens if m == base ** round(math.log(m, base))]
                groups = s.groups[:2] if s.quick else s.groups
            tasks += [Task("group", info.name, name, h, f, [m]) for m in tokens]
            tasks += [Task("group", info.name, name, h, f, [c] * g) for g, c in groups if g <= s.num_experts]
        if any(info.cpu_torch for info in infos):  # the executor's host-side work runs beside torch on the CPU
            for t in s.pack_tokens:
                caps = [pack_capacity(t, s.top_k, s.num_experts, ample) for ample in (True, False)]
                tasks += [Task("pack", "host", name, h, f, [c], t) for c in caps
                          if s.num_experts * c * h <= MAX_PACK_ELEMENTS]
                tasks.append(Task("exact_host", "host", name, h, f, tokens=t))
    return tasks


def run_tasks(tasks: list[Task], s: Settings, meter: EnergyMeter | None = None, progress: bool = True,
              clock: str = "auto") -> list[dict]:
    """Measure every task; modules are built once per shape (and dropped after) to bound memory."""
    records, caches = [], ForwardCaches()
    modules: dict[str, torch.nn.Module] = {}
    bar = tqdm(tasks, desc="profile-device", unit="rec", disable=not progress, dynamic_ncols=True)
    with torch.inference_mode():
        for task in bar:
            bar.set_postfix_str(f"{task.backend} {task.shape} {task.kind}", refresh=False)
            key = f"{task.hidden}x{task.ffn}"
            if key not in modules:
                modules.clear()  # one shape at a time
                modules[key] = make_experts(task.hidden, task.ffn, s.num_experts)
            module = modules[key]
            host = task.kind in ("pack", "exact_host")
            info = None if host else registry.get(task.backend)
            if host:
                call = host_caller(task.kind, module, task.tokens, s.top_k,
                                   task.capacities[0] if task.capacities else 0)
            else:
                call = group_caller(info, module, task.capacities, task.hidden, Rotor(s.num_experts))
            rec = task.describe()
            if info is not None and info.profile_device is not None:
                rec["device"] = info.profile_device()  # e.g. mlx-exact on MLX's CPU device: no GPU's time
            if host:
                rec["assignments"] = task.tokens * s.top_k
                rec["slots"] = s.num_experts * task.capacities[0] if task.kind == "pack" else 0
            elif len(task.capacities) == 1:
                rec["tokens"] = task.capacities[0]
            on_cpu = host or info.cpu_torch
            # MLX's CPU device computes on one thread of this process: CPU work too, read on the CPU clock like
            # torch's (on the wall clock a shared host's load inflated these records 2.5x and more)
            cpu_work = on_cpu or rec.get("device") == "cpu"
            which = clock_for(cpu_work, torch.get_num_threads()) if clock == "auto" else clock
            field = info.energy_field if info is not None else CPU_ENERGY  # host-side work is CPU work
            if on_cpu:  # CPU work meets the caches as a forward leaves them; a backend off the CPU runs as it is
                rec.update(time_in_forward(call, s, meter, field, which, caches))
            else:
                rec.update(time_call(call.run, s, meter, energy_field=field, clock=which))
            records.append(rec)
    return records


def available_backends() -> dict[str, tuple[bool, str]]:
    """Every registered backend (plugins included) with whether the profiler can run it here, and why."""
    return {name: info.available_to_profile() for name, info in registry.infos().items()}


def default_backends(avail: dict[str, tuple[bool, str]] | None = None) -> list[str]:
    """What `profile-device` measures without --backends: every backend profiled by default that it can run here."""
    avail = available_backends() if avail is None else avail
    return [b for b, (ok, _) in avail.items() if ok and registry.get(b).profiled_by_default]


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def profile_device(backends: list[str] | None = None, quick: bool = False, threads: int = 1,
                   progress: bool = True, s: Settings | None = None, clock: str = "auto") -> Profile:
    """Measure this host's backends and fit the cost model: the whole `autotune profile-device`."""
    avail = available_backends()
    if backends is None:
        backends = default_backends(avail)
    for b in backends:
        if b not in avail:
            raise NpumoeError(f"unknown backend {b!r}; choose from {', '.join(avail)}")
        ok, why = avail[b]
        if not ok:
            raise NpumoeError(f"backend {b!r} is not available on this host: {why}")
    torch.set_num_threads(max(1, threads))
    s = s or settings_for(quick)
    meter, why = energy_meter()
    load_start = _loadavg()
    t0 = time.perf_counter()
    records = run_tasks(plan_tasks(backends, s), s, meter, progress, clock)
    if EXACT in backends:  # the rest of a decoder layer, as the runtime runs it on the CPU
        records += dense_records(s, clock_for(True, torch.get_num_threads()) if clock == "auto" else clock,
                                 progress)
    for info in (registry.get(b) for b in backends):  # the dense functions a static backend runs, on it
        if info.profile_dense is not None:
            records += static_dense_records(s, info, meter, progress)
    wall = time.perf_counter() - t0
    energy = {"method": meter.name if meter else "none", "source": meter.source if meter else None,
              "note": why if meter is None else None}
    settings_json = {"quick": quick, "threads": torch.get_num_threads(), "backends": backends, "clock": clock,
                     "wall_s": round(wall, 1), "loadavg_1min": {"start": load_start, "end": _loadavg()},
                     "load_note": "other processes sharing the cores slow even CPU-time figures (SMT, caches, "
                                  "memory bandwidth): a profile describes the host under the load it had",
                     **s.to_json()}
    cmd = "autotune profile-device" + (" --quick" if quick else "")
    dtypes = {b: {"dtype_bytes": registry.get(b).dtype_bytes} for b in backends}  # e.g. Core ML computes in fp16
    profile = build_profile(records, host_facts(torch.get_num_threads()), cmd, settings_json, energy, dtypes)
    if s.kernels and any(registry.get(b).cpu_torch for b in backends):
        # each CPU storage kind's kernels at decode and prefill rows: a list of its own, beside the cost model's
        with torch.inference_mode():
            profile.extra["kernel_records"] = [r for name, (h, f) in s.shapes.items()
                                               for r in kernel_records(s, h, f, name)]
    return profile
