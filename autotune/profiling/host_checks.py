"""`autotune doctor`: can this host run the whole ANE path? Each check passes, fails or is skipped, with a reason.

Host checks (OS, Python and library versions against what npumoe declares) run everywhere. The small grouped
expert function is built with the real builder (`runtime.coreml.converter.build_package`: convert, merge, lint, host
evaluation against cpu-static), which coremltools can do on Linux too. What needs Core ML's runtime (the ANE,
MLComputePlan placement, parity of a real prediction, predict() overhead, matmul throughput, energy counters) is
checked on macOS only and skipped elsewhere with the reason: nothing here is simulated.
"""
from __future__ import annotations

import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path
from typing import Callable

import numpy as np

from runtime.macos import macos_version, on_macos

STATUSES = ("pass", "fail", "skip")
LIBRARIES = ("torch", "transformers", "coremltools", "numpy")
MIN_MACOS = (15,)  # multifunction Core ML packages (one function per group) need the macOS 15 runtime
# macOS versions with a reported breakage of the path the runtime takes, and where it was reported.
KNOWN_BAD_MACOS = {(26, 3): "CPU_AND_NE is reported to deadlock the ANE daemon on macOS 26.3 "
                            "(atomgradient/hybrid-ane-mlx-bench, M2 Ultra)"}
CONSTRAINTS = Path(__file__).resolve().parents[2] / "constraints-linux.txt"
PROBE_MODEL = "random:qwen3_moe"  # a tiny seeded random MoE: its group function converts in seconds
PROBE_EXPERTS, PROBE_CAPACITY = 4, 8
MATMUL_MNK = (512, 1024, 1024)  # one fp16 matmul, big enough that compute outweighs the call's fixed cost
TIMED_CALLS = 50


@dataclass
class Check:
    name: str
    status: str  # pass | fail | skip
    detail: str


@dataclass
class Probe:
    """What later checks share: the built package and the experts module it was built from."""
    package: str | None = None
    module: object = None
    group: object = None  # runtime.backends.GroupSpec of the built function
    backend: object = None  # runtime.coreml.ane.AneBackend over the package (macOS)
    fn: object = None  # its prepared group function
    tmp: tempfile.TemporaryDirectory = field(
        default_factory=lambda: tempfile.TemporaryDirectory(prefix="npumoe-doctor-"))


class Skip(Exception):
    """A check that does not apply on this host; the message says why."""


class Failed(Exception):
    """A check that ran and failed; the message says what was found."""


def _need_macos(what: str) -> None:
    if not on_macos():
        raise Skip(f"{what} needs macOS; this host runs {platform.system()}")


# --- host ------------------------------------------------------------------------------------------------------
def check_os(_: Probe) -> str:
    return f"{platform.system()} {platform.release()} ({platform.machine()})"


def check_chip(_: Probe) -> str:
    from autotune.profiling.profile import cpu_model

    chip = cpu_model()
    if not on_macos():
        raise Skip(f"not a Mac: {chip} has no Neural Engine")
    if platform.machine() != "arm64" or not chip.startswith("Apple"):
        raise Failed(f"{chip} ({platform.machine()}): only Apple silicon has a Neural Engine")
    return chip


def _project_requirements() -> dict[str, list[str]]:
    """Version specifiers per library: npumoe's declared dependencies, plus the Linux pins where they apply."""
    from packaging.requirements import Requirement

    out: dict[str, list[str]] = {}
    for line in requires("npumoe") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.setdefault(req.name.lower(), []).append(str(req.specifier))
    if platform.system() == "Linux" and CONSTRAINTS.is_file():
        for line in CONSTRAINTS.read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                req = Requirement(line.split("#")[0].strip())
                out.setdefault(req.name.lower(), []).append(f"{req.specifier} ({CONSTRAINTS.name})")
    return out


def check_python(_: Probe) -> str:
    from importlib.metadata import metadata

    from packaging.specifiers import SpecifierSet

    spec = metadata("npumoe").get("Requires-Python") or ""
    here = platform.python_version()
    if spec and here not in SpecifierSet(spec):
        raise Failed(f"Python {here}; npumoe requires {spec}")
    return f"Python {here} (npumoe requires {spec or 'any'})"


def check_cpu_dtype(_: Probe) -> str:
    """What `--dtype auto` computes the built-in bf16 model in here (`runtime.loading.compute_dtype`)."""
    from runtime.loading.model_loader import auto_dtype_of

    return f"--dtype auto on tiny-moe (a bfloat16 checkpoint) computes in {auto_dtype_of('tiny-moe')[1]}"


def library_check(name: str) -> Callable[[Probe], str]:
    def check(_: Probe) -> str:
        from packaging.specifiers import SpecifierSet

        try:
            have = version(name)
        except PackageNotFoundError:
            raise Failed(f"{name} is not installed") from None
        wanted = _project_requirements().get(name, [])
        bad = [w for w in wanted if have.split("+")[0] not in SpecifierSet(w.split(" (")[0])]
        if bad:
            raise Failed(f"{name} {have} does not satisfy {', '.join(bad)}")
        return f"{name} {have}" + (f" satisfies {', '.join(w for w in wanted if w)}" if any(wanted) else "")
    check.__name__ = f"check_{name}"
    return check


def check_macos_version(_: Probe) -> str:
    _need_macos("the macOS version check")
    v = macos_version()
    shown = ".".join(map(str, v)) or platform.mac_ver()[0]
    if v < MIN_MACOS:
        raise Failed(f"macOS {shown}: multifunction Core ML packages need macOS {'.'.join(map(str, MIN_MACOS))}+")
    if v[:2] in KNOWN_BAD_MACOS:
        raise Failed(f"macOS {shown}: {KNOWN_BAD_MACOS[v[:2]]}")
    return f"macOS {shown} (>= 15, not a known-bad version)"


def check_ane(_: Probe) -> str:
    _need_macos("the Neural Engine")
    if platform.machine() != "arm64":
        raise Failed(f"{platform.machine()} Mac: no Neural Engine")
    try:
        import coremltools.libcoremlpython  # noqa: F401  (Core ML's runtime bridge: prediction needs it)
    except ImportError as e:
        raise Failed(f"coremltools has no Core ML runtime bridge here ({e})") from None
    return "Apple silicon with Core ML's runtime bridge (compute units CPU_AND_NE)"


# --- the small grouped expert function --------------------------------------------------------------------------
def check_coreml_build(probe: Probe) -> str:
    """Build one group of PROBE_EXPERTS experts with the real builder; host evaluation against cpu-static."""
    from runtime.backends import GroupSpec
    from runtime.coreml.converter import build_package, quiet_coremltools_import
    from runtime.loading.model_loader import load_model, model_spec, moe_layers
    from runtime.plan import Group, LayerPlan, ModelSpec, Plan

    quiet_coremltools_import()
    model, _ = load_model(PROBE_MODEL)
    spec = model_spec(model)
    layer = moe_layers(model)[0]
    experts = list(range(PROBE_EXPERTS))
    plan = Plan(model=ModelSpec(**spec.to_json()), chunk_tokens=16, overflow="drop", saliency="router_weight",
                layers=[LayerPlan(layer=layer.index, cpu_exact=list(range(PROBE_EXPERTS, spec.num_experts)),
                                  groups=[Group(backend="ane", experts=experts,
                                                capacities=[PROBE_CAPACITY] * PROBE_EXPERTS)])])
    out = Path(probe.tmp.name) / "doctor.mlpackage"
    result = build_package({layer.index: layer.experts}, plan, out, cache_dir=Path(probe.tmp.name) / "cache")
    probe.package, probe.module = str(out), layer.experts
    probe.group = GroupSpec(layer.index, 0, tuple(experts), (PROBE_CAPACITY,) * PROBE_EXPERTS, layer.experts)
    return (f"{PROBE_EXPERTS} experts x capacity {PROBE_CAPACITY} of {PROBE_MODEL} (hidden {spec.hidden_size}) "
            f"converted, merged and linted in {result.build_seconds:.1f} s; host evaluation vs cpu-static: max "
            f"relative error {result.max_rel_error:.2e}")


def _need_package(probe: Probe, what: str) -> None:
    _need_macos(what)
    if probe.package is None:
        raise Failed(f"{what}: the group function was not built (see coreml_build)")


def _ane_fn(probe: Probe):
    from runtime.coreml.ane import AneBackend

    if probe.fn is None:
        probe.backend = AneBackend(probe.package)
        probe.fn = probe.backend.prepare(probe.group)
    return probe.fn


def check_placement(probe: Probe) -> str:
    _need_package(probe, "MLComputePlan placement")
    from runtime.coreml.ane import function_name, ops_not_on_ane

    if macos_version() < (14, 4):
        raise Skip("MLComputePlan needs macOS 14.4+")
    _ane_fn(probe)
    off = ops_not_on_ane(probe.backend.compute_plan(), function_name(probe.group.layer, probe.group.index))
    if off:
        raise Failed(f"{len(off)} op(s) not placed on the Neural Engine: "
                     + ", ".join(f"{op} on {dev}" for op, dev in off[:8]))
    return "every compute op of the group function is preferred on the Neural Engine"


def check_ane_parity(probe: Probe) -> str:
    _need_package(probe, "Core ML prediction")
    import torch

    from runtime.coreml.mil_eval import TOLERANCE, max_rel_error
    from runtime.cpu.cpu_backends import CpuStaticBackend

    x = torch.from_numpy(np.random.default_rng(0).standard_normal(
        (sum(probe.group.capacities), probe.module.gate_up_proj.shape[-1])).astype(np.float16).astype(np.float32))
    with torch.no_grad():
        got = _ane_fn(probe)(x).numpy()
        ref = CpuStaticBackend().prepare(probe.group)(x).numpy()
    err = max_rel_error(got, ref)
    if not err <= TOLERANCE["none"]:
        raise Failed(f"Core ML predict() differs from cpu-static by {err:.2e} (tolerance {TOLERANCE['none']:g})")
    return f"Core ML predict() vs cpu-static: max relative error {err:.2e} (tolerance {TOLERANCE['none']:g})"


def _median_ms(fn: Callable[[], object], n: int = TIMED_CALLS) -> float:
    for _ in range(3):
        fn()  # warm-up: first calls load and specialise the program
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def check_predict_overhead(probe: Probe) -> str:
    _need_package(probe, "timing Core ML predict()")
    import torch

    fn = _ane_fn(probe)
    x = torch.zeros(sum(probe.group.capacities), probe.module.gate_up_proj.shape[-1])
    ms = _median_ms(lambda: fn(x))
    return (f"median {ms:.3f} ms per predict() of the small group function over {TIMED_CALLS} calls (its compute "
            "is negligible: this is the fixed cost per call; the published Apple profile predicts "
            "its own call_ms)")


def check_attention_core(probe: Probe) -> str:
    """One attention-core function (runtime/coreml/dense_programs.py): placement and parity on CPU_AND_NE."""
    _need_macos("an attention-core function on the Neural Engine")
    from runtime.coreml.dense_doctor import check_attention_core as run

    r = run(Path(probe.tmp.name))
    if r["off_ane"] or not r["max_rel_error"] <= r["tolerance"]:
        raise Failed(f"{r['function']}: ops off the Neural Engine {r['off_ane'][:8]}, max relative error "
                     f"{r['max_rel_error']:.2e} (tolerance {r['tolerance']:g})")
    return (f"{r['function']}: every op on the Neural Engine; predict() vs sdpa: max relative error "
            f"{r['max_rel_error']:.2e} (tolerance {r['tolerance']:g})")


def check_coreai(_: Probe) -> str:
    """macOS 27: Core AI's compute plan of a group function and an attention core on the Neural Engine, and parity."""
    from runtime.coreai.device_checks import available_on_device, compute_plan_report
    from runtime.loading.model_loader import load_model, moe_layers

    ok, why = available_on_device()
    if not ok:
        raise Skip(why)
    layer = moe_layers(load_model(PROBE_MODEL)[0])[0]
    hidden = layer.experts.gate_up_proj.shape[-1]
    r = compute_plan_report(layer.experts, (PROBE_CAPACITY,) * PROBE_EXPERTS, hidden)
    errors = f"group {r['group_max_rel_error']:.2e}, {r['attention_function']} {r['attention_max_rel_error']:.2e}"
    if r["ops_off_neural_engine"] or max(r["group_max_rel_error"], r["attention_max_rel_error"]) > r["tolerance"]:
        raise Failed(f"Core AI: ops off the Neural Engine {r['ops_off_neural_engine'][:8]}; max relative error "
                     f"{errors} (tolerance {r['tolerance']:g})")
    shares = ", ".join(f"{name} {s['share']:.0%}" for name, s in r["placement"].items())
    return (f"Core AI's compute plan: every placed op of a group function and an attention core on the Neural "
            f"Engine ({r['device_histogram']}; shares {shares}); max relative error vs torch {errors} (tolerance "
            f"{r['tolerance']:g})")


def check_mlx(_: Probe) -> str:
    """MLX's version and device, and one call of the mlx-exact path against the experts' own computation: the plan
    runs its exact experts there (on the Metal GPU on a Mac)."""
    import torch

    from runtime.backends import expert_ffn
    from runtime.coreml.mil_eval import max_rel_error
    from runtime.loading.model_loader import load_model, moe_layers
    from runtime.mlx.mlx_backends import MlxExactPath, mlx_available

    ok, device = mlx_available()
    if not ok:
        if on_macos():
            raise Failed(f"{device}: the plan's exact experts (mlx-exact) need MLX on the GPU (pip install mlx)")
        raise Skip(f"{device} (mlx-exact runs on a Mac's GPU; pip install 'mlx[cpu]' for its CPU device here)")
    layer = moe_layers(load_model(PROBE_MODEL, "float32")[0])[0]
    hidden, counts = layer.experts.gate_up_proj.shape[-1], [3, 5]
    x = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = torch.cat([expert_ffn(layer.experts, e, xe) for e, xe in zip((1, 2), x.split(counts))])
        got = MlxExactPath().prepare(layer.experts).run(x, [1, 2], counts)
    err = max_rel_error(got.float().numpy(), ref.float().numpy())
    where = f"mlx {version('mlx')} on {device}"
    if not err <= 1e-5:
        raise Failed(f"{where}: mlx-exact differs from the experts' computation by {err:.2e} (tolerance 1e-05)")
    if on_macos() and device != "MLX on the Metal GPU":
        raise Failed(f"{where}: mlx-exact runs, but not on a GPU, so the plan's GPU lane is this Mac's CPU")
    return f"{where}; mlx-exact runs: max relative error {err:.2e} against the experts' own computation"


def check_matmul_throughput(_: Probe) -> str:
    _need_macos("a Core ML matmul on the Neural Engine")
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    m, n, k = MATMUL_MNK
    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float16) / np.sqrt(k)

    @mb.program(input_specs=[mb.TensorSpec(shape=(m, k), dtype=types.fp16)], opset_version=ct.target.macOS15)
    def prog(x):
        return mb.matmul(x=x, y=mb.const(val=w), name="y")

    model = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.macOS15,
                       compute_precision=ct.precision.FLOAT16, compute_units=ct.ComputeUnit.CPU_AND_NE)
    feed = {"x": np.random.default_rng(1).standard_normal((m, k)).astype(np.float16)}
    ms = _median_ms(lambda: model.predict(feed))
    return f"[{m}x{k}] x [{k}x{n}] fp16 on CPU_AND_NE: median {ms:.3f} ms = {2 * m * n * k / ms / 1e6:.0f} GFLOP/s"


def check_energy(_: Probe) -> str:
    from autotune.profiling.energy import ZeusMeter

    ok, reason = ZeusMeter.available()
    if not on_macos():
        raise Skip(reason)
    if not ok:
        raise Failed(reason)
    return "zeus-apple-silicon energy windows (CPU, GPU, ANE, DRAM in mJ)"


CHECKS: list[tuple[str, Callable[[Probe], str]]] = [
    ("os", check_os), ("chip", check_chip), ("python", check_python), ("cpu_dtype", check_cpu_dtype),
    *[(name, library_check(name)) for name in LIBRARIES],
    ("macos_version", check_macos_version), ("ane", check_ane), ("coreml_build", check_coreml_build),
    ("placement", check_placement), ("ane_parity", check_ane_parity), ("predict_overhead", check_predict_overhead),
    ("attention_core", check_attention_core), ("coreai", check_coreai), ("mlx", check_mlx),
    ("matmul_throughput", check_matmul_throughput), ("energy", check_energy),
]


def run_checks(progress: bool = False) -> list[Check]:
    """Every check in order; an unexpected error in one is that check's failure, never the end of the run."""
    from autotune.build_io import private_tempdir

    with private_tempdir():  # whatever a check's converters leave in the temp folder (Core ML, torch) goes with it
        return _run_all(progress)


def _run_all(progress: bool) -> list[Check]:
    from tqdm import tqdm

    probe, out = Probe(), []
    try:
        for name, fn in tqdm(CHECKS, desc="doctor", unit="check", disable=not progress, file=sys.stderr):
            try:
                out.append(Check(name, "pass", fn(probe)))
            except Skip as e:
                out.append(Check(name, "skip", str(e)))
            except Failed as e:
                out.append(Check(name, "fail", str(e)))
            except Exception as e:  # noqa: BLE001 - a broken step is reported as this check's failure
                out.append(Check(name, "fail", f"{type(e).__name__}: {e}"))
    finally:
        probe.tmp.cleanup()
    return out


def report(checks: list[Check]) -> dict:
    return {"checks": [asdict(c) for c in checks], "ok": all(c.status != "fail" for c in checks),
            "counts": {s: sum(c.status == s for c in checks) for s in STATUSES}}
