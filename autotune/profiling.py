"""Microbenchmarks of this host's backends on the shapes the executor really runs.

Every record times runtime code, not a reimplementation:
- `group` (and tiny `call`) records: one static group call from `CpuStaticBackend.prepare` (G experts x capacity
  C), or one `run_exact` call over G experts (cpu-exact); G=1 across M = 1..thousands gives the per-expert curve;
- `pack` records: one `LayerExecutor` chunk whose groups run on a null backend (identity), i.e. the executor's
  routing bookkeeping, packing, unpacking and weighted combine with no expert compute;
- `exact_host` records: one all-exact `LayerExecutor` chunk with `run_exact` replaced by identity: the exact
  path's sorting, gathering and scattering;
- on macOS with coremltools, `ane` (Core ML, CPU_AND_NE) and `coreml-cpu` (Core ML, CPU_ONLY) group calls.
Each record keeps warm-up count, runs, median and spread; energy comes from an `EnergyMeter` when one is readable
(RAPL on Linux, zeus-apple-silicon on macOS) and is otherwise absent.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol

import numpy as np
import torch

log = logging.getLogger("npumoe")

# (hidden, expert FFN) of the model sizes we target.
SHAPES = {"tiny-moe": (256, 256), "bench-layer": (1024, 2048), "qwen3-30b-a3b": (2048, 768)}
CPU_BACKENDS = ("cpu-exact", "cpu-static")
COREML_BACKENDS = ("ane", "coreml-cpu")
MAX_PACK_ELEMENTS = 2**26  # padded buffers up to 256 MB (fp32): larger ones only measure this host's page faults


def _macos_module(module: str, not_macos: str, missing: str, ok: str) -> tuple[bool, str]:
    """(available, reason) for a macOS-only facility that needs `module` importable."""
    if platform.system() != "Darwin":
        return False, not_macos
    try:
        importlib.import_module(module)
    except ImportError:
        return False, missing
    return True, ok


@dataclass(frozen=True)
class Settings:
    """What to measure and how hard. `quick` fits in 5 minutes on 2 cores; the full run in 30."""
    shapes: dict[str, tuple[int, int]]
    tokens: list[int]  # M grid for single-expert calls
    groups: list[tuple[int, int]]  # (G experts, capacity C) for multi-expert calls
    pack_tokens: list[int]  # chunk sizes for pack / exact_host records
    top_k: int = 2
    num_experts: int = 16
    warmup: int = 1
    min_runs: int = 5
    max_runs: int = 50
    min_time_s: float = 0.15  # keep repeating small calls until this much time has passed
    quick: bool = False

    def to_json(self) -> dict:
        return {"shapes": {k: list(v) for k, v in self.shapes.items()}, "tokens": self.tokens,
                "groups": [list(g) for g in self.groups], "pack_tokens": self.pack_tokens, "top_k": self.top_k,
                "num_experts": self.num_experts, "warmup": self.warmup, "min_runs": self.min_runs,
                "max_runs": self.max_runs, "min_time_s": self.min_time_s, "quick": self.quick}


def settings(quick: bool) -> Settings:
    # Every M up to 16 (GEMM kernels switch there: per-expert time is not monotonic in M), then 2-4 per octave.
    if quick:
        tokens = [*range(1, 17), 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 256, 320, 384, 512, 640,
                  768, 1024, 1536, 2048]
        return Settings(SHAPES, tokens=tokens, groups=[(4, 16), (4, 64), (8, 32), (4, 256), (16, 64)],
                        pack_tokens=[32, 64, 128, 256, 512, 1024, 2048, 4096], quick=True)
    tokens = sorted({*range(1, 33), *(int(round(2 ** (i / 4))) for i in range(20, 49))})  # ... 4096
    return Settings(SHAPES, tokens=tokens,
                    groups=[(2, 8), (4, 16), (4, 64), (8, 32), (4, 256), (8, 128), (16, 64), (16, 16), (4, 1024)],
                    pack_tokens=[16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 4096], min_runs=9,
                    min_time_s=0.4, max_runs=100)


def parse_shapes(text: str) -> dict[str, tuple[int, int]]:
    """`tiny-moe,2048x768` -> {name: (hidden, ffn)}."""
    from runtime.errors import NpumoeError

    out = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item in SHAPES:
            out[item] = SHAPES[item]
            continue
        try:
            h, f = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise NpumoeError(f"--shapes: {item!r} is neither a named size ({', '.join(SHAPES)}) nor HIDDENxFFN") \
                from None
        out[f"{h}x{f}"] = (h, f)
    return out


# --- timing and energy ---------------------------------------------------------------------------------------------
class EnergyMeter(Protocol):
    name: str
    source: str

    def read_mj(self) -> dict[str, float]: ...  # cumulative energy per domain, mJ


class RaplMeter:
    """Linux RAPL package counters (/sys/class/powercap/intel-rapl:N). Package energy includes every process on
    the socket, which the profile says next to the figure."""
    name = "rapl"

    def __init__(self, root: str | Path = "/sys/class/powercap") -> None:
        self.domains = sorted(Path(root).glob("intel-rapl:[0-9]"))
        self.source = f"RAPL package counters under {root} (whole socket: other processes included)"
        self.wrap = {d.name: float((d / "max_energy_range_uj").read_text()) / 1e3
                     if (d / "max_energy_range_uj").exists() else None for d in self.domains}

    @classmethod
    def available(cls, root: str | Path = "/sys/class/powercap") -> tuple[bool, str]:
        domains = sorted(Path(root).glob("intel-rapl:[0-9]"))
        if not domains:
            return False, f"no RAPL domains under {root}"
        try:
            for d in domains:
                float((d / "energy_uj").read_text())
        except (OSError, ValueError) as e:
            return False, f"RAPL counters not readable ({e.__class__.__name__})"
        return True, "RAPL"

    def read_mj(self) -> dict[str, float]:
        return {d.name: float((d / "energy_uj").read_text()) / 1e3 for d in self.domains}

    def delta_mj(self, a: dict[str, float], b: dict[str, float]) -> float:
        """Energy between two readings; a counter that passed its maximum wrapped around to 0."""
        return sum((b[k] - a[k]) % self.wrap[k] if self.wrap.get(k) else b[k] - a[k] for k in a)


class ZeusMeter:
    """zeus-apple-silicon energy windows (mJ per unit, incl. the ANE) on macOS."""
    name = "zeus-apple-silicon"
    source = "zeus-apple-silicon AppleEnergyMonitor windows"

    def __init__(self) -> None:
        from zeus_apple_silicon import AppleEnergyMonitor  # type: ignore

        self.monitor = AppleEnergyMonitor()
        self._n = 0

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return _macos_module("zeus_apple_silicon", "zeus-apple-silicon is macOS only",
                             "zeus-apple-silicon is not installed (pip install 'npumoe[energy]')", "zeus-apple-silicon")

    @contextlib.contextmanager
    def window(self) -> Iterator[dict]:
        self._n += 1
        key, out = f"npumoe-{self._n}", {}
        self.monitor.begin_window(key)
        try:
            yield out
        finally:
            res = self.monitor.end_window(key)
            for unit in ("cpu_total_mj", "gpu_mj", "ane_mj", "dram_mj"):
                v = getattr(res, unit, None)
                if v is not None:
                    out[unit] = float(v)


def time_call(fn: Callable[[], object], s: Settings, meter=None, ane: bool = False, clock: str = "wall") -> dict:
    """Warm up, then repeat until min_runs and min_time_s are both met (or max_runs): median and spread in ms.

    Each run is timed twice: wall clock, and this process's CPU time. `clock` says which one `median_ms` (what
    the fit uses) reports: `cpu` excludes the time other processes on a shared host preempt us (right for
    one-thread CPU work, where CPU time is the latency of an unloaded host); `wall` is needed whenever work
    runs off the CPU (Core ML, the ANE) or on several threads."""
    for _ in range(s.warmup):
        fn()
    wall: list[float] = []
    cpu: list[float] = []
    energy = None
    start_e = meter.read_mj() if isinstance(meter, RaplMeter) else None
    ctx = meter.window() if isinstance(meter, ZeusMeter) else contextlib.nullcontext({})
    t_start = time.perf_counter()
    with ctx as zeus:
        while len(wall) < s.max_runs and (len(wall) < s.min_runs or time.perf_counter() - t_start < s.min_time_s):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
    wall_ms = (time.perf_counter() - t_start) * 1e3
    if start_e is not None:
        energy = meter.delta_mj(start_e, meter.read_mj())
    elif zeus:
        energy = zeus.get("ane_mj" if ane else "cpu_total_mj")
    times = cpu if clock == "cpu" else wall
    q = np.percentile(times, [10, 25, 75, 90])

    def r(v) -> float:
        return round(float(v), 6)

    rec = {"median_ms": r(statistics.median(times)), "p10_ms": r(q[0]), "p25_ms": r(q[1]), "p75_ms": r(q[2]),
           "p90_ms": r(q[3]), "min_ms": r(min(times)), "clock": clock, "wall_median_ms": r(statistics.median(wall)),
           "cpu_median_ms": r(statistics.median(cpu)), "runs": len(times), "warmup": s.warmup}
    if energy is not None and wall_ms > 0:
        rec["energy_mj_per_run"] = r(energy / len(times))
        rec["power_w"] = round(energy / wall_ms, 4)  # mJ / ms = W
    return rec


# --- what is measured ----------------------------------------------------------------------------------------------
def make_experts(hidden: int, ffn: int, num_experts: int, seed: int = 0) -> torch.nn.Module:
    """A transformers Qwen3Moe fused-experts module (the layout every MoE family uses) with random weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=ffn, num_experts=num_experts,
                            num_experts_per_tok=2)
    module = Qwen3MoeExperts(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=gen) * 0.02)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=gen) * 0.02)
    return module.eval().requires_grad_(False)


class _Rotor:
    """Cycles through experts between runs, so weights come from memory as in a real layer, not a warm cache."""

    def __init__(self, n: int) -> None:
        self.n, self.i = n, 0

    def next(self, g: int = 1) -> list[int]:
        out = [(self.i + j) % self.n for j in range(g)]
        self.i = (self.i + g) % self.n
        return out


def group_caller(backend: str, module: torch.nn.Module, caps: list[int], hidden: int,
                 rotor: _Rotor) -> Callable[[], object]:
    """One call of `backend` over len(caps) experts, as the executor makes it."""
    from runtime.backends import CpuStaticBackend, GroupSpec, run_exact

    g = len(caps)
    x = torch.randn(sum(caps), hidden)
    if backend == "cpu-exact":
        return lambda: run_exact(module, x, rotor.next(g), caps)
    if backend == "cpu-static":
        n_sets = max(1, module.num_experts // g)
        fns = [CpuStaticBackend().prepare(GroupSpec(0, i, tuple(range(i * g, i * g + g)), tuple(caps), module))
               for i in range(n_sets)]
        return lambda: fns[rotor.next()[0] % n_sets](x)
    if backend in COREML_BACKENDS:
        return _coreml_caller(backend, module, caps, hidden)
    raise ValueError(f"no microbenchmark for backend {backend!r}")


class _NullStatic:
    """A static backend that computes nothing (identity): isolates the executor's host-side work."""
    name = "cpu-static"
    overlaps_cpu = False

    def available(self) -> tuple[bool, str]:
        return True, "null"

    def prepare(self, group):
        return lambda packed: packed


def _layer_executor(module: torch.nn.Module, static: bool, tokens: int, top_k: int, capacity: int):
    from runtime.executor import LayerExecutor
    from runtime.plan import Group, LayerPlan, ModelSpec, Plan
    from runtime.stats import LayerStats

    e, h, f = module.num_experts, module.hidden_dim, module.intermediate_dim
    groups = [Group(backend="cpu-static", experts=list(range(i, min(i + 4, e))),
                    capacities=[capacity] * len(range(i, min(i + 4, e)))) for i in range(0, e, 4)]
    lp = LayerPlan(layer=0, groups=groups if static else [], cpu_exact=[] if static else list(range(e)))
    ref = ModelSpec(architecture="profile", model_type="qwen3_moe", num_layers=1, moe_layers=[0], num_experts=e,
                   top_k=top_k, hidden_size=h, expert_ffn_size=f, fingerprint="profile")
    plan = Plan(model=ref, chunk_tokens=tokens, overflow="drop", saliency="router_weight", layers=[lp])
    return LayerExecutor(lp, module, plan, LayerStats(), {"cpu-static": _NullStatic()})


def random_routing(tokens: int, num_experts: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.multinomial(torch.ones(tokens, num_experts), top_k, replacement=False, generator=gen)
    return idx, torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)


def pack_capacity(tokens: int, top_k: int, num_experts: int, ample: bool) -> int:
    """Per-expert capacity of a pack record: the chunk (ample: nothing overflows, padding is large) or twice the
    mean load (little padding, little overflow), so that slots and assignments vary apart."""
    return tokens if ample else max(1, 2 * tokens * top_k // num_experts)


def host_caller(kind: str, module: torch.nn.Module, tokens: int, top_k: int,
                capacity: int = 0) -> Callable[[], object]:
    """The executor's host-side work for one chunk: `pack` (static path) or `exact_host` (exact path)."""
    import runtime.executor as executor_mod

    ex = _layer_executor(module, kind == "pack", tokens, top_k, capacity or tokens)
    x = torch.randn(tokens, module.hidden_dim)
    idx, w = random_routing(tokens, module.num_experts, top_k)
    if kind == "pack":
        return lambda: ex(x, idx, w)

    def run():
        saved = executor_mod.run_exact
        executor_mod.run_exact = lambda module, x_sorted, experts, counts: x_sorted  # no compute: host work only
        try:
            return ex(x, idx, w)
        finally:
            executor_mod.run_exact = saved
    return run


# --- Core ML (macOS) -----------------------------------------------------------------------------------------------
def coreml_available() -> tuple[bool, str]:
    return _macos_module("coremltools", "Core ML prediction needs macOS", "coremltools is not installed", "Core ML")


def _coreml_caller(backend: str, module: torch.nn.Module, caps: list[int], hidden: int,
                   layout: str = "matmul") -> Callable[[], object]:
    """One call of a group function exactly as `autotune build` emits it (runtime.coreml_build), run through Core ML
    with CPU_AND_NE (`ane`) or CPU_ONLY (`coreml-cpu`), fed as the runtime's ane backend feeds it."""
    import coremltools as ct

    from runtime.ane import INPUT_NAME, expert_weights_fp16, to_layout
    from runtime.coreml_build import FunctionSpec, function_program

    experts = tuple(range(len(caps)))
    fs = FunctionSpec(0, 0, experts, tuple(caps), hidden, module.intermediate_dim)
    weights = {e: expert_weights_fp16(module, e) for e in experts}
    units = ct.ComputeUnit.CPU_AND_NE if backend == "ane" else ct.ComputeUnit.CPU_ONLY
    with contextlib.redirect_stderr(io.StringIO()):  # coremltools draws a bar per pass pipeline
        mlmodel = ct.convert(function_program(fs, weights, layout), convert_to="mlprogram",
                             minimum_deployment_target=ct.target.macOS15, compute_precision=ct.precision.FLOAT16,
                             compute_units=units)
    feed = {INPUT_NAME: to_layout(np.random.default_rng(0).standard_normal((fs.slots, hidden)).astype(np.float16),
                                  layout)}
    return lambda: mlmodel.predict(feed)


# --- the run -------------------------------------------------------------------------------------------------------
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
    tasks = []
    for b in backends:
        tasks.append(Task("call", b, "tiny-call", 16, 16, [1]))  # dispatch + sync: the smallest real call
        tasks += [Task("call", b, "tiny-call", 16, 16, [1] * g) for g in (4, 16) if g <= s.num_experts]
    for name, (h, f) in s.shapes.items():
        for b in backends:
            tokens, groups = s.tokens, s.groups
            if b in COREML_BACKENDS:
                # every Core ML shape is a conversion and an ANE compile (seconds): powers of two (quick: of four)
                base = 4 if s.quick else 2
                tokens = [m for m in s.tokens if m == base ** round(math.log(m, base))]
                groups = s.groups[:2] if s.quick else s.groups
            tasks += [Task("group", b, name, h, f, [m]) for m in tokens]
            tasks += [Task("group", b, name, h, f, [c] * g) for g, c in groups if g <= s.num_experts]
        if "cpu-exact" in backends or "cpu-static" in backends:
            for t in s.pack_tokens:
                caps = [pack_capacity(t, s.top_k, s.num_experts, ample) for ample in (True, False)]
                tasks += [Task("pack", "host", name, h, f, [c], t) for c in caps
                          if s.num_experts * c * h <= MAX_PACK_ELEMENTS]
                tasks.append(Task("exact_host", "host", name, h, f, tokens=t))
    return tasks


def clock_for(backend: str, threads: int) -> str:
    """CPU time for one-thread torch work (immune to other processes on a shared host), wall clock otherwise."""
    return "cpu" if threads == 1 and backend in (*CPU_BACKENDS, "host") else "wall"


def run_tasks(tasks: list[Task], s: Settings, meter=None, progress: bool = True, clock: str = "auto") -> list[dict]:
    """Measure every task; modules are built once per shape (and dropped after) to bound memory."""
    from tqdm import tqdm

    records = []
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
            if task.kind in ("pack", "exact_host"):
                fn = host_caller(task.kind, module, task.tokens, s.top_k,
                                 task.capacities[0] if task.capacities else 0)
            else:
                fn = group_caller(task.backend, module, task.capacities, task.hidden, _Rotor(s.num_experts))
            rec = task.describe()
            if task.kind in ("pack", "exact_host"):
                rec["assignments"] = task.tokens * s.top_k
                rec["slots"] = s.num_experts * task.capacities[0] if task.kind == "pack" else 0
            elif len(task.capacities) == 1:
                rec["tokens"] = task.capacities[0]
            which = clock_for(task.backend, torch.get_num_threads()) if clock == "auto" else clock
            rec.update(time_call(fn, s, meter, ane=task.backend == "ane", clock=which))
            records.append(rec)
    return records


def available_backends() -> dict[str, tuple[bool, str]]:
    ok_ml = coreml_available()
    return {"cpu-exact": (True, "torch on the CPU"), "cpu-static": (True, "torch on the CPU"),
            "ane": ok_ml, "coreml-cpu": ok_ml}


def energy_meter():
    """The energy meter this host offers, or None (then no energy is recorded), with the reason."""
    ok, why = ZeusMeter.available()
    if ok:
        return ZeusMeter(), why
    ok, why_rapl = RaplMeter.available()
    if ok:
        return RaplMeter(), why_rapl
    return None, f"no energy counters readable: {why_rapl}; {why}"


def power_by_backend(records: list[dict]) -> dict[str, float | None]:
    """Median measured power per backend (W), None where no record carries power."""
    out: dict[str, float | None] = {}
    for r in records:
        out.setdefault(r["backend"], None)
    for b in out:
        p = [r["power_w"] for r in records if r["backend"] == b and r.get("power_w")]
        out[b] = float(statistics.median(p)) if p else None
    return out


def build_profile(records: list[dict], host: dict, measured_by: str, settings_json: dict, energy: dict,
                  backend_options: dict[str, dict] | None = None):
    """Fit the cost model to the records, measure its held-out error, and wrap it all as a Profile."""
    from .costmodel import fit_cost_model, heldout_errors
    from .profile import Profile, _now

    power = power_by_backend(records)
    options = {b: dict(backend_options.get(b, {}) if backend_options else {}) for b in power if b != "host"}
    for b, opt in options.items():
        if power[b] is not None:
            opt.setdefault("power_w", power[b])
            opt.setdefault("power_source", energy.get("source"))
    heldout = heldout_errors(records, options)
    model = fit_cost_model(records, options)
    return Profile(host=host, cost_model=model, records=records, heldout=heldout, measured_by=measured_by,
                   settings=settings_json, energy=energy, created=_now())


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def profile_device(backends: list[str] | None = None, quick: bool = False, threads: int = 1,
                   progress: bool = True, s: Settings | None = None, clock: str = "auto"):
    """Measure this host's backends and fit the cost model: the whole `autotune profile-device`."""
    from runtime.errors import NpumoeError

    from .profile import host_facts

    avail = available_backends()
    if backends is None:
        backends = [b for b, (ok, _) in avail.items() if ok]
    for b in backends:
        if b not in avail:
            raise NpumoeError(f"unknown backend {b!r}; choose from {', '.join(avail)}")
        ok, why = avail[b]
        if not ok:
            raise NpumoeError(f"backend {b!r} is not available on this host: {why}")
    torch.set_num_threads(max(1, threads))
    s = s or settings(quick)
    meter, why = energy_meter()
    load_start = _loadavg()
    t0 = time.perf_counter()
    records = run_tasks(plan_tasks(backends, s), s, meter, progress, clock)
    wall = time.perf_counter() - t0
    energy = {"method": meter.name if meter else "none", "source": meter.source if meter else None,
              "note": why if meter is None else None}
    settings_json = {"quick": quick, "threads": torch.get_num_threads(), "backends": backends, "clock": clock,
                     "wall_s": round(wall, 1), "loadavg_1min": {"start": load_start, "end": _loadavg()},
                     "load_note": "other processes sharing the cores slow even CPU-time figures (SMT, caches, "
                                  "memory bandwidth): a profile describes the host under the load it had",
                     **s.to_json()}
    cmd = "autotune profile-device" + (" --quick" if quick else "")
    fp16 = {b: {"dtype_bytes": 2} for b in backends if b in COREML_BACKENDS}  # Core ML computes in fp16
    return build_profile(records, host_facts(torch.get_num_threads()), cmd, settings_json, energy, fp16)
