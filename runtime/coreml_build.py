"""Core ML emission: a plan's ANE groups as one multifunction ML program package.

Each (layer, ANE group) becomes one function with a fixed-shape fp16 input of the group's packed slots; routing
and packing stay on the host, so a function holds only slices, the experts' gated FFNs and a concat. Every
expert's two weight matrices are one constant each, so `save_multifunction`'s cross-function deduplication
(per whole constant) stores an expert once however many functions use it. Functions are converted one by one
into a cache keyed by weights, shapes, layout and compression, then merged.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .ane import LAYOUTS, META_KEY, OUTPUT_NAME, expert_weights_fp16, function_name, weights_digest
from .backends import GroupSpec
from .errors import NpumoeError
from .fileio import cache_root
from .plan import Plan

COMPRESSIONS = ("none", "int8", "palettize4")
ANE_MAX_AXIS = 65_536  # per-axis size limit of the Neural Engine
ANE_MAX_OPS = 18_000  # MIL ops per program; the ANE compiler gives up around 18-21K (docs/ane-facts.md)
OPS_PER_EXPERT = 7  # slice, linear, 2 slices, silu, mul, linear (consts not counted)
BUILDER_VERSION = 1  # bump when the emitted program changes: invalidates the function cache


@dataclass(frozen=True)
class FunctionSpec:
    """One package function: group `group` of MoE layer `layer`, run on packed rows of width `hidden`."""
    layer: int
    group: int
    experts: tuple[int, ...]
    capacities: tuple[int, ...]
    hidden: int
    ffn: int

    @property
    def name(self) -> str:
        return function_name(self.layer, self.group)

    @property
    def slots(self) -> int:
        return sum(self.capacities)

    def input_shape(self, layout: str) -> tuple[int, ...]:
        return (self.slots, self.hidden) if layout == "matmul" else (1, self.hidden, 1, self.slots)


def ane_functions(plan: Plan) -> list[FunctionSpec]:
    """The package functions a plan needs: one per group whose backend is `ane`."""
    h, f = plan.model.hidden_size, plan.model.expert_ffn_size
    return [FunctionSpec(lp.layer, gi, tuple(g.experts), tuple(g.capacities), h, f)
            for lp in plan.layers for gi, g in enumerate(lp.groups) if g.backend == "ane"]


def check_ane_limits(functions: list[FunctionSpec]) -> None:
    """Refuse, before any conversion, a group whose graph would break a Neural Engine limit; name the group."""
    for fs in functions:
        where = f"layer {fs.layer} group {fs.group} (function {fs.name})"
        axes = {"packed slots (sum of capacities)": fs.slots, "hidden size": fs.hidden,
                "gate_up width (2 x expert FFN size)": 2 * fs.ffn}
        for axis, size in axes.items():
            if size > ANE_MAX_AXIS:
                raise NpumoeError(f"{where}: {axis} is {size:,}, over the Neural Engine's per-axis limit of "
                                  f"{ANE_MAX_AXIS:,}; split the group or lower its capacities")
        ops = OPS_PER_EXPERT * len(fs.experts) + 1
        if ops > ANE_MAX_OPS:
            raise NpumoeError(f"{where}: {len(fs.experts)} experts make about {ops:,} MIL ops, over the "
                              f"{ANE_MAX_OPS:,} a Neural Engine program can hold; split the group")


def check_expert_form(module: torch.nn.Module, layer: int) -> None:
    """The builder emits `down(silu(gate) * up)` without biases; refuse experts of another form, by behaviour."""
    f = module.down_proj.shape[-1]
    probe = torch.randn(3, 2 * f, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gated = module._apply_gate(probe)
    silu_gated = torch.nn.functional.silu(probe[:, :f]) * probe[:, f:]
    if (getattr(module, "has_bias", False) or getattr(module, "is_transposed", False)
            or not getattr(module, "has_gate", True) or not torch.allclose(gated, silu_gated, atol=1e-6)):
        raise NpumoeError(f"layer {layer}: experts {type(module).__name__} are not bias-free silu-gated FFNs "
                          "with [out, in] weights, the only form the Core ML builder emits")


def function_program(fs: FunctionSpec, weights: dict[int, tuple[np.ndarray, np.ndarray]], layout: str):
    """The MIL program of one group: slice each expert's rows, gated FFN, concat. Static shapes, fp16."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    if layout not in LAYOUTS:
        raise NpumoeError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    h, f = fs.hidden, fs.ffn
    conv = layout == "conv1x1"

    def rows(x, start: int, stop: int, channels: int):
        # Matmul layout slices rows of [S, C]; conv layout slices the width axis of [1, C, 1, S].
        if conv:
            return mb.slice_by_index(x=x, begin=[0, 0, 0, start], end=[1, channels, 1, stop])
        return mb.slice_by_index(x=x, begin=[start, 0], end=[stop, channels])

    def channels(x, start: int, stop: int, n: int):
        if conv:
            return mb.slice_by_index(x=x, begin=[0, start, 0, 0], end=[1, stop, 1, n])
        return mb.slice_by_index(x=x, begin=[0, start], end=[n, stop])

    def project(x, w: np.ndarray, const_name: str, **name):
        # One const per expert matrix, named by expert: functions sharing an expert share these bytes.
        if conv:
            return mb.conv(x=x, weight=mb.const(val=w[:, :, None, None], name=const_name), **name)
        return mb.linear(x=x, weight=mb.const(val=w, name=const_name), **name)

    @mb.program(input_specs=[mb.TensorSpec(shape=fs.input_shape(layout), dtype=types.fp16)],
                opset_version=ct.target.macOS15)
    def prog(x):
        outs, start = [], 0
        for e, c in zip(fs.experts, fs.capacities):
            gate_up_w, down_w = weights[e]
            xe = rows(x, start, start + c, h)
            start += c
            gate_up = project(xe, gate_up_w, f"layer{fs.layer}_expert{e}_gate_up")
            gated = mb.mul(x=mb.silu(x=channels(gate_up, 0, f, c)), y=channels(gate_up, f, 2 * f, c))
            last = {"name": OUTPUT_NAME} if len(fs.experts) == 1 else {}
            outs.append(project(gated, down_w, f"layer{fs.layer}_expert{e}_down", **last))
        return mb.concat(values=outs, axis=3 if conv else 0, name=OUTPUT_NAME) if len(outs) > 1 else outs[0]

    return prog


def _compress(mlmodel, compress: str):
    import coremltools.optimize.coreml as cto

    if compress == "none":
        return mlmodel
    if compress == "int8":
        cfg = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", granularity="per_channel",
                                          weight_threshold=2048)
        return cto.linear_quantize_weights(mlmodel, cto.OptimizationConfig(global_config=cfg))
    if compress == "palettize4":
        # A 16-entry table per group of 16 output channels: far closer than one table per tensor.
        cfg = cto.OpPalettizerConfig(nbits=4, mode="kmeans", granularity="per_grouped_channel", group_size=16,
                                     weight_threshold=2048)
        return cto.palettize_weights(mlmodel, cto.OptimizationConfig(global_config=cfg))
    raise NpumoeError(f"unknown compression {compress!r}; choose from {', '.join(COMPRESSIONS)}")


def quiet_coremltools_import() -> None:
    """Import coremltools without its import-time warnings (no Core ML runtime off macOS, untested torch and
    scikit-learn versions): true on Linux, and said where it matters (the backend reports why it can't run)."""
    level = logging.getLogger("coremltools").level
    logging.getLogger("coremltools").setLevel(logging.ERROR)
    try:
        import coremltools  # noqa: F401
    finally:
        logging.getLogger("coremltools").setLevel(level)


@contextlib.contextmanager
def _quiet() -> None:
    """coremltools draws a progress bar per pass pipeline; keep the build's own bar readable."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def to_mlmodel(fs: FunctionSpec, weights: dict[int, tuple[np.ndarray, np.ndarray]], layout: str,
               compute_units=None):
    """One function as an ML program, converted as every build converts it. With `compute_units` (a
    `ct.ComputeUnit`) the model is loaded for prediction (macOS); without, it is only converted."""
    import coremltools as ct

    load = {"skip_model_load": True} if compute_units is None else {"compute_units": compute_units}
    with _quiet():
        return ct.convert(function_program(fs, weights, layout), convert_to="mlprogram",
                          minimum_deployment_target=ct.target.macOS15, compute_precision=ct.precision.FLOAT16,
                          **load)


def convert_function(fs: FunctionSpec, weights: dict[int, tuple[np.ndarray, np.ndarray]], layout: str,
                     compress: str, dest: Path) -> None:
    """Convert one function to a single-function .mlpackage at `dest` (written whole, then renamed)."""
    mlmodel = to_mlmodel(fs, weights, layout)
    with _quiet():
        mlmodel = _compress(mlmodel, compress)
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent)) / dest.name
        mlmodel.save(str(tmp))
    try:
        os.replace(tmp, dest)
    except OSError:
        if not dest.is_dir():  # else a concurrent build stored the same function first: keep that one
            raise
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def cache_key(fs: FunctionSpec, digest: str, layout: str, compress: str) -> str:
    """What makes a converted function reusable: weights, shapes, layout, compression, tool versions."""
    import coremltools as ct

    key = dict(v=BUILDER_VERSION, coremltools=ct.__version__, layout=layout, compress=compress, hidden=fs.hidden,
               ffn=fs.ffn, capacities=list(fs.capacities), weights=digest)
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]


def default_cache_dir() -> Path:
    return cache_root() / "coreml"


def package_bytes(path: str | os.PathLike) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


@dataclass
class BuildResult:
    package: str
    functions: list[FunctionSpec]
    layout: str
    compress: str
    package_bytes: int
    unique_weight_bytes: int  # the distinct expert matrices the package needs, counted in fp16
    cached: int  # functions taken from the cache instead of converted
    build_seconds: float
    checks: list = field(default_factory=list)  # per-function numeric checks (runtime.mil_eval.FunctionCheck)

    @property
    def max_rel_error(self) -> float:
        return max((c.max_rel_error for c in self.checks), default=float("nan"))


def merge_functions(parts: list[tuple[FunctionSpec, Path]], dest: Path, meta: dict) -> None:
    """Merge single-function packages into one multifunction package with deduplicated weights, plus metadata."""
    import coremltools as ct
    from coremltools.models.utils import _try_get_weights_dir_path

    desc = ct.utils.MultiFunctionDescriptor()
    for fs, path in parts:
        desc.add_function(str(path), src_function_name="main", target_function_name=fs.name)
    desc.default_function_name = parts[0][0].name
    staging = dest.parent / ("merge-" + dest.name)
    with _quiet():
        ct.utils.save_multifunction(desc, str(staging))
    spec = ct.utils.load_spec(str(staging))
    spec.description.metadata.userDefined[META_KEY] = json.dumps(meta)
    spec.description.metadata.shortDescription = "npumoe: planned MoE expert groups, one function per group"
    ct.utils.save_spec(spec, str(dest), weights_dir=_try_get_weights_dir_path(str(staging)))
    shutil.rmtree(staging, ignore_errors=True)
    for p in Path(dest).rglob("*"):  # save_spec leaves the model file owner-only; a package is shared
        if p.is_file():
            p.chmod(0o644)


def build_package(model_layers: dict[int, torch.nn.Module], plan: Plan, out: str | os.PathLike,
                  layout: str = "matmul", compress: str = "none", cache_dir: str | os.PathLike | None = None,
                  progress: Callable[[str, int], object] | None = None, seed: int = 0) -> BuildResult:
    """Build `out` from the plan's ANE groups; `model_layers` maps MoE layer index -> fused experts module.

    The merged package is linted and every function evaluated on the host against `cpu-static` before it
    replaces `out`; a lint failure raises LintError, an error over `TOLERANCE[compress]` raises NpumoeError.
    `progress(stage, total)` returns an object with `update(n)` and `close()` (a tqdm bar), or None.
    """
    t0 = time.perf_counter()
    if layout not in LAYOUTS:
        raise NpumoeError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    if compress not in COMPRESSIONS:
        raise NpumoeError(f"unknown compression {compress!r}; choose from {', '.join(COMPRESSIONS)}")
    functions = ane_functions(plan)
    if not functions:
        raise NpumoeError("the plan puts no group on the ane backend: nothing to build")
    check_ane_limits(functions)  # before any conversion
    for layer in sorted({fs.layer for fs in functions}):
        check_expert_form(model_layers[layer], layer)

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    bar = progress("converting functions", len(functions)) if progress else None
    parts, cached, meta_functions, unique = [], 0, {}, set()
    try:
        for fs in functions:
            module = model_layers[fs.layer]
            weights = {e: expert_weights_fp16(module, e) for e in fs.experts}
            unique.update((fs.layer, e) for e in fs.experts)
            digest = weights_digest(module, fs.experts)
            path = cache / f"{cache_key(fs, digest, layout, compress)}.mlpackage"
            if path.is_dir():
                cached += 1
            else:
                convert_function(fs, weights, layout, compress, path)
            parts.append((fs, path))
            meta_functions[fs.name] = dict(layer=fs.layer, group=fs.group, experts=list(fs.experts),
                                           capacities=list(fs.capacities), weights_sha256=digest)
            if bar:
                bar.update(1)
        if bar:
            bar.close()
        meta = dict(layout=layout, compress=compress, hidden=functions[0].hidden, ffn=functions[0].ffn,
                    model_fingerprint=plan.model.fingerprint, functions=meta_functions)
        staged = work / out.name
        merge_functions(parts, staged, meta)
        checks = verify_package(staged, functions, model_layers, layout, compress, progress, seed)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(staged, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    h, f = functions[0].hidden, functions[0].ffn
    return BuildResult(package=str(out), functions=functions, layout=layout, compress=compress,
                       package_bytes=package_bytes(out), unique_weight_bytes=len(unique) * 3 * h * f * 2,
                       cached=cached, build_seconds=time.perf_counter() - t0, checks=checks)


def verify_package(path: Path, functions: list[FunctionSpec], model_layers: dict[int, torch.nn.Module],
                   layout: str, compress: str, progress: Callable[[str, int], object] | None = None,
                   seed: int = 0) -> list:
    """Lint the saved program, then evaluate each function on the host against cpu-static (see mil_eval)."""
    from .mil_eval import TOLERANCE, check_function
    from .mil_lint import lint_package, load_package_program

    spec, prog = load_package_program(path)
    lint_package(path, prog=prog, spec=spec)
    bar = progress("checking functions on the host", len(functions)) if progress else None
    checks = []
    for fs in functions:
        group = GroupSpec(fs.layer, fs.group, fs.experts, fs.capacities, model_layers[fs.layer])
        checks.append(check_function(prog.functions[fs.name], fs.name, group, layout, seed))
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    worst = max(checks, key=lambda c: c.max_rel_error)
    if not worst.max_rel_error <= TOLERANCE[compress]:
        raise NpumoeError(f"function {worst.function} differs from cpu-static by a relative error of "
                          f"{worst.max_rel_error:.3g}, over the {TOLERANCE[compress]:g} allowed for "
                          f"--compress {compress}")
    return checks
