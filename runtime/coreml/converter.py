"""Core ML emission: a plan's ANE groups as one multifunction ML program package.

Each (layer, ANE group) becomes one function with a fixed-shape fp16 input of the group's packed slots; routing
and packing stay on the host, so a function holds only slices, the experts' gated FFNs and a concat. Every
expert's two weight matrices are one constant each, so `save_multifunction`'s cross-function deduplication
(per whole constant) stores an expert once however many functions use it. Functions are converted one by one
into a cache keyed by weights, shapes, layout and compression, then merged. Each function stores its weights as its
plan group's `compress` says (absent: fp16); a build's `compress` overrides every group's.
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

from runtime.backends import GroupSpec
from runtime.coreml import ane_limits, build_cache, dense_io, dense_programs
from runtime.coreml.ane import (
    LAYOUTS,
    MANIFEST_SCHEMA,
    META_KEY,
    OUTPUT_NAME,
    arrays_digest,
    expert_weights_fp16,
    function_name,
    package_bytes,
)
from runtime.coreml.build_result import BuildResult
from runtime.coreml.compression import compressed
from runtime.dense.specs import compute_dtype
from runtime.errors import NpumoeError
from runtime.fileio import atomic_write_json, cache_root
from runtime.interrupts import held
from runtime.loading.expert_weights import ExpertWeights, ModuleExperts
from runtime.plan import COMPRESSIONS, Plan

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
    compress: str = "none"  # how the function stores its weights (runtime.plan.COMPRESSIONS)

    @property
    def name(self) -> str:
        return function_name(self.layer, self.group)

    @property
    def slots(self) -> int:
        return sum(self.capacities)

    def usage(self) -> ane_limits.Usage:
        return ane_limits.group_usage(self.capacities, self.hidden, self.ffn, self.compress)

    @property
    def expert_bytes(self) -> int:
        """Stored bytes of one of its experts."""
        return ane_limits.expert_weight_bytes(self.hidden, self.ffn, self.compress)

    def input_shape(self, layout: str) -> tuple[int, ...]:
        return (self.slots, self.hidden) if layout == "matmul" else (1, self.hidden, 1, self.slots)


def ane_functions(plan: Plan, compress: str | None = None, backend: str = "ane") -> list[FunctionSpec]:
    """The package functions a plan needs: one per group whose backend is `backend` (an asset of Core AI's holds
    the same functions), compressed as its group says (`compress`: the same for all instead)."""
    h, f = plan.model.hidden_size, plan.model.expert_ffn_size
    return [FunctionSpec(lp.layer, gi, tuple(g.experts), tuple(g.capacities), h, f, compress or g.compression)
            for lp in plan.layers for gi, g in enumerate(lp.groups) if g.backend == backend]


def compression_summary(functions: list) -> str:
    """The build's compression: the one kind every function with weights uses (none without any), or `mixed`."""
    kinds = {fs.compress for fs in functions if getattr(fs, "kind", None) != "attention"}
    return kinds.pop() if len(kinds) == 1 else "mixed" if kinds else "none"


def check_ane_limits(functions: list[FunctionSpec],
                     function_weight_bytes: float = ane_limits.FUNCTION_WEIGHT_BYTES) -> None:
    """Refuse, before any conversion, a group whose program would break a Neural Engine limit (ane_limits):
    one line naming the group, the limit and what to change."""
    for fs in functions:
        over = fs.usage().over(function_weight_bytes)
        if over:
            what, value, limit, advice = over[0]
            if what == "weight bytes":
                value_s, limit_s = f"{value / 1e6:,.1f} MB ({len(fs.experts)} experts)", f"{limit / 1e6:,.1f} MB"
            else:
                value_s, limit_s = f"{value:,}", f"{limit:,}"
            raise NpumoeError(f"layer {fs.layer} group {fs.group} (function {fs.name}): {what} is {value_s}, over "
                              f"the Neural Engine's limit of {limit_s} per program; {advice}")


def split_packages(functions: list[FunctionSpec], package_weight_bytes: float, dense: list = ()
                   ) -> list[tuple[list[FunctionSpec], list]]:
    """The groups' functions in plan order, then the `dense` functions (DenseSpec), cut into packages of at most
    `package_weight_bytes` of distinct weights as stored (an expert shared by two functions of one package is stored
    once; a dense function's weights are its own, the attention core holds none): per package, (groups, dense)."""
    packages: list[tuple[list, list]] = [([], [])]
    held: dict = {}  # weight -> stored bytes, in the current package
    for item in [*functions, *dense]:
        weights = stored_weights([item])
        new = {k: b for k, b in weights.items() if k not in held}
        if any(packages[-1]) and sum(held.values()) + sum(new.values()) > package_weight_bytes:
            packages.append(([], []))
            held, new = {}, weights
        packages[-1][0 if isinstance(item, FunctionSpec) else 1].append(item)
        held.update(new)
    return packages


def stored_weights(items: list) -> dict:
    """Each distinct weight of package functions (FunctionSpec: its experts by (layer, expert); DenseSpec: its own,
    by name) -> its stored bytes."""
    out: dict = {}
    for item in items:
        if isinstance(item, FunctionSpec):
            out.update({(item.layer, e): item.expert_bytes for e in item.experts})
        else:
            out[item.name] = dense_programs.dense_weight_bytes(item)
    return out


def stored_weight_bytes(items: list) -> int:
    """Distinct weights of package functions as stored (`stored_weights`)."""
    return sum(stored_weights(items).values())


def package_paths(out: Path, n: int) -> list[Path]:
    """`out` itself for a plan that fits one package, else `<stem>.part<i>.mlpackage` beside it."""
    if n == 1:
        return [out]
    return [out.with_name(f"{out.stem}.part{i + 1}{out.suffix}") for i in range(n)]


def manifest_path(out: str | os.PathLike) -> Path:
    """The manifest the builder writes beside `out`: `<out without .mlpackage>.manifest.json`."""
    return Path(out).with_suffix(".manifest.json")


def check_expert_form(module: torch.nn.Module, layer: int) -> None:
    """The builder emits `down(silu(gate) * up)` without biases; refuse experts of another form, by behaviour."""
    f = module.intermediate_dim
    probe = torch.randn(3, 2 * f, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gated = module._apply_gate(probe)
    silu_gated = torch.nn.functional.silu(probe[:, :f]) * probe[:, f:]
    if (getattr(module, "has_bias", False) or getattr(module, "is_transposed", False)
            or not getattr(module, "has_gate", True) or not torch.allclose(gated, silu_gated, atol=1e-6)):
        raise NpumoeError(f"layer {layer}: experts {type(module).__name__} are not bias-free silu-gated FFNs "
                          "with [out, in] weights, the only form the Core ML builder emits")


def check_build_options(layout: str = LAYOUTS[0], compress: str = "none") -> None:
    """Refuse an unknown layout or compression, naming the choices: one check for every way into a build."""
    if layout not in LAYOUTS:
        raise NpumoeError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    if compress not in COMPRESSIONS:
        raise NpumoeError(f"unknown compression {compress!r}; choose from {', '.join(COMPRESSIONS)}")


def function_program(fs: FunctionSpec, weights: dict[int, tuple[np.ndarray, np.ndarray]], layout: str):
    """The MIL program of one group: slice each expert's rows, gated FFN, concat. Static shapes, fp16."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    check_build_options(layout)
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
def quiet_progress() -> None:
    """coremltools draws a progress bar per pass pipeline; keep our own bars and lines readable."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def program_mlmodel(prog, compute_units=None):
    """A MIL program as an ML program, converted as every build converts it. With `compute_units` (a
    `ct.ComputeUnit`) the model is loaded for prediction (macOS); without, it is only converted."""
    import coremltools as ct

    load = {"skip_model_load": True} if compute_units is None else {"compute_units": compute_units}
    with quiet_progress():
        return ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.macOS15,
                          compute_precision=ct.precision.FLOAT16, **load)


def to_mlmodel(fs: FunctionSpec, weights: dict[int, tuple[np.ndarray, np.ndarray]], layout: str,
               compute_units=None):
    """One group's function as an ML program (`program_mlmodel`)."""
    return program_mlmodel(function_program(fs, weights, layout), compute_units)


def convert_function(fs: FunctionSpec, weights: dict[int, tuple[np.ndarray, np.ndarray]], layout: str,
                     compress: str, dest: Path) -> None:
    """Convert one group's function to a single-function .mlpackage at `dest` (`convert_program`)."""
    convert_program(function_program(fs, weights, layout), compress, dest)


def convert_program(prog, compress: str, dest: Path) -> None:
    """Convert one MIL program to a single-function .mlpackage at `dest`, its weights stored as `compress` says
    (written whole, then renamed)."""
    mlmodel = program_mlmodel(prog)
    with quiet_progress():
        mlmodel = compressed(mlmodel, compress)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent)) / dest.name
    try:
        # The converter already wrote a whole package to its temp folder; `save` would copy it (weights written
        # twice: ~13% of a large function's conversion time). Move it instead: a rename on the same filesystem.
        shutil.move(mlmodel.package_path, tmp)
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


def merge_functions(parts: list[tuple[FunctionSpec, Path]], dest: Path, meta: dict) -> None:
    """Merge single-function packages into one multifunction package with deduplicated weights, plus metadata."""
    import coremltools as ct
    from coremltools.models.utils import _try_get_weights_dir_path

    desc = ct.utils.MultiFunctionDescriptor()
    for fs, path in parts:
        desc.add_function(str(path), src_function_name="main", target_function_name=fs.name)
    desc.default_function_name = parts[0][0].name
    staging = dest.parent / ("merge-" + dest.name)
    with quiet_progress():
        ct.utils.save_multifunction(desc, str(staging))
    spec = ct.utils.load_spec(str(staging))
    spec.description.metadata.userDefined[META_KEY] = json.dumps(meta)
    spec.description.metadata.shortDescription = "npumoe: planned MoE expert groups, one function per group"
    ct.utils.save_spec(spec, str(dest), weights_dir=_try_get_weights_dir_path(str(staging)))
    shutil.rmtree(staging, ignore_errors=True)
    for p in Path(dest).rglob("*"):  # save_spec leaves the model file owner-only; a package is shared
        if p.is_file():
            p.chmod(0o644)


def build_package(model_layers: dict[int, torch.nn.Module] | ExpertWeights, plan: Plan, out: str | os.PathLike,
                  layout: str = "matmul", compress: str | None = None, cache_dir: str | os.PathLike | None = None,
                  progress: Callable[[str, int], object] | None = None, seed: int = 0,
                  function_weight_bytes: float = ane_limits.FUNCTION_WEIGHT_BYTES,
                  package_weight_bytes: float = ane_limits.PACKAGE_WEIGHT_BYTES,
                  dense_model: torch.nn.Module | None = None) -> BuildResult:
    """Build the plan's ANE groups into `out` (or, past `package_weight_bytes`, into several packages beside it)
    and write `<out>.manifest.json` naming them; `model_layers` maps MoE layer index -> fused experts module, or
    is an ExpertWeights source (runtime.loading.expert_weights: a checkpoint read a function's experts at a time).
    Each function stores its weights as its plan group's `compress` says; `compress` overrides every group's.

    A group past a Neural Engine limit (ane_limits, `function_weight_bytes` included) is refused before any
    conversion. Each package is linted and every function evaluated on the host against `cpu-static` before the
    packages replace earlier ones; a lint failure raises LintError, an error over its compression's TOLERANCE raises
    NpumoeError. Functions are converted one at a time (only that function's experts in fp16) into the cache; a
    build of more than CACHE_KEEP_BYTES of weights converts into its work folder instead and drops each package's
    converted functions once merged, so no second copy of a large build stays on disk. `progress(stage, total)`
    returns an object with `update(n)` and `close()` (a tqdm bar), or None. `dense_model`: the loaded model, whose
    dense functions the plan places on `ane` follow the groups' in the packages, counted against their budget
    (runtime/coreml/dense_programs.py); all of them together within the ANE's window (`ane_limits.check_window`).
    """
    t0 = time.perf_counter()
    check_build_options(layout, compress or "none")
    functions, h, f = ane_functions(plan, compress), plan.model.hidden_size, plan.model.expert_ffn_size
    dense = dense_programs.ane_dense_specs(dense_model, plan, compress) if dense_model is not None else []
    source = _checked_source(functions, dense, model_layers, min(function_weight_bytes, package_weight_bytes))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    groups = split_packages(functions, package_weight_bytes, dense)
    paths = package_paths(out, len(groups))
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    keep = sum(fs.usage().weight_bytes for fs in functions) <= CACHE_KEEP_BYTES
    cache = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) if keep else work / "functions"
    cache.mkdir(parents=True, exist_ok=True)
    run = _Build(source, layout, cache, keep, work, seed,
                 compute_dtype(dense_model) if dense_model is not None else torch.float32,
                 progress("converting functions", len(functions)) if progress else None)
    try:
        packages = [run.package(group, dense_group, work / path.name, plan) for (group, dense_group), path
                    in zip(groups, paths)]
        if run.bar:
            run.bar.close()
        manifest = manifest_path(out)
        summary = compression_summary([*functions, *dense])
        _land(out, paths, work, manifest, {"schema": MANIFEST_SCHEMA, "model_fingerprint": plan.model.fingerprint,
                                           "layout": layout, "compress": summary,
                                           "function_weight_limit_bytes": int(function_weight_bytes),
                                           "package_weight_limit_bytes": int(package_weight_bytes),
                                           "packages": packages})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    unique = {(fs.layer, e) for fs in functions for e in fs.experts}
    dense_bytes = [dense_programs.dense_weight_bytes(d) for d in dense]
    return BuildResult(package=str(paths[0]), functions=functions, layout=layout, compress=summary, cached=run.cached,
                       package_bytes=sum(pk["bytes"] for pk in packages),
                       unique_weight_bytes=len(unique) * ane_limits.expert_weight_bytes(h, f)
                       + sum(dense_programs.dense_weight_bytes(d, "none") for d in dense),
                       build_seconds=time.perf_counter() - t0, checks=run.checks, packages=packages,
                       manifest=str(manifest),
                       largest_function_weight_bytes=max([fs.usage().weight_bytes for fs in functions] + dense_bytes),
                       seconds={k: round(v, 2) for k, v in run.seconds.items()},
                       function_weight_limit_bytes=int(function_weight_bytes), dense=dense)


def _checked_source(functions: list[FunctionSpec], dense: list, model_layers: dict[int, torch.nn.Module] |
                    ExpertWeights, weight_limit: float) -> ExpertWeights:
    """The experts' source, once every function is checked against the Neural Engine's limits (before any
    conversion) and each layer's experts have the form a function converts."""
    if not functions and not dense:
        raise NpumoeError("the plan puts no group on the ane backend, nor a dense function: nothing to build")
    check_ane_limits(functions, weight_limit)
    dense_programs.check_dense_limits(dense, weight_limit)
    ane_limits.check_window({"experts": stored_weight_bytes(functions), "dense functions": stored_weight_bytes(dense)})
    source = _expert_source(model_layers)
    for layer in sorted({fs.layer for fs in functions}):
        check_expert_form(source.experts(layer, (0,))[0], layer)
    return source


@dataclass
class _Build:
    """One build's state: the experts' source, where functions convert (the cache, or the build's work folder when
    not `keep`), the seconds per stage, the functions found cached and the host checks."""
    source: ExpertWeights
    layout: str
    cache: Path
    keep: bool
    work: Path
    seed: int
    dtype: torch.dtype  # the dense functions' (the model's compute dtype)
    bar: object | None
    seconds: dict = field(default_factory=lambda: {"convert": 0.0, "merge": 0.0, "verify": 0.0})
    cached: int = 0
    checks: list = field(default_factory=list)

    def package(self, group: list[FunctionSpec], dense_group: list, staged: Path, plan: Plan) -> dict:
        """One package staged at `staged`: its functions converted (or found cached), merged with its metadata and
        checked on the host; returns its manifest entry."""
        t = time.perf_counter()
        parts, meta_functions = [], {}
        for fs in group:
            hit, digest, cpath = _convert_cached(fs, self.source, self.layout, self.cache, self.keep)
            self.cached += hit
            parts.append((fs, cpath))
            meta_functions[fs.name] = dict(layer=fs.layer, group=fs.group, experts=list(fs.experts),
                                           capacities=list(fs.capacities), compress=fs.compress, weights_sha256=digest)
            if self.bar:
                self.bar.update(1)
        converted = [convert_dense(d, self.cache, self.keep) for d in dense_group]
        parts += [(c.spec, c.path) for c in converted]
        meta_functions.update({c.spec.name: c.manifest() for c in converted})
        self.cached += sum(c.cached for c in converted)
        self.seconds["convert"] += time.perf_counter() - t
        t = time.perf_counter()
        meta = dict(layout=self.layout, compress=compression_summary([*group, *dense_group]),
                    hidden=plan.model.hidden_size, ffn=plan.model.expert_ffn_size,
                    model_fingerprint=plan.model.fingerprint, functions=meta_functions)
        merge_functions(parts, staged, meta)
        if not self.keep:
            for _, cpath in parts:
                shutil.rmtree(cpath, ignore_errors=True)
        self.seconds["merge"] += time.perf_counter() - t
        t = time.perf_counter()
        self.checks += verify_package(staged, group, self.source, self.layout, None, self.seed, dense_group, self.dtype)
        self.seconds["verify"] += time.perf_counter() - t
        return dict(path=staged.name, functions=list(meta_functions),
                    weight_bytes=stored_weight_bytes([*group, *dense_group]), bytes=package_bytes(staged))


def _land(out: Path, paths: list[Path], work: Path, manifest: Path, content: dict) -> None:
    """The staged packages and their manifest land together, replacing an earlier build's (a signal here is raised
    once they have)."""
    with held():
        for path in (out, *paths, *_stale_parts(out)):
            if path.exists():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in paths:
            os.replace(work / path.name, path)
        atomic_write_json(manifest, content)


def convert_dense(spec, cache: Path, sealed: bool = True) -> dense_programs.ConvertedDense:
    """One dense function (a DenseSpec) converted into `cache`, reused when its weights, shapes and compression
    match (runtime/coreml/dense_programs.py builds the program)."""
    weights = dense_io.dense_weights(spec)
    digest = dense_io.dense_digest(weights)
    path = cache / f"dense-{dense_programs.cache_key(spec, digest)}.mlpackage"
    if sealed and build_cache.usable(path):
        return dense_programs.ConvertedDense(spec, path, digest, True)
    convert_program(dense_programs.dense_program(spec, weights), spec.compress, path)
    if sealed:
        build_cache.seal(path)
    return dense_programs.ConvertedDense(spec, path, digest, False)


CACHE_KEEP_BYTES = 256 * 2**20  # builds of more weights keep no converted functions: no second copy on disk


def _stale_parts(out: Path) -> list[Path]:
    """Packages an earlier build of `out` split into, which this build replaces."""
    return sorted(out.parent.glob(f"{out.stem}.part*{out.suffix}"))


def _expert_source(model_layers: dict[int, torch.nn.Module] | ExpertWeights) -> ExpertWeights:
    return ModuleExperts(model_layers) if isinstance(model_layers, dict) else model_layers


def _convert_cached(fs: FunctionSpec, source: ExpertWeights, layout: str, cache: Path,
                    sealed: bool = True) -> tuple[bool, str, Path]:
    """(taken from the cache, weights digest, converted package) of one function; its experts are held in fp16
    only while it converts (read from a checkpoint source, they are dropped in the model's dtype first).
    `sealed`: `cache` is the shared cache (checksummed entries), not a build's own folder."""
    module, index = source.experts(fs.layer, fs.experts)
    weights = {e: expert_weights_fp16(module, i) for e, i in zip(fs.experts, index)}
    del module
    digest = arrays_digest(weights[e] for e in fs.experts)
    path = cache / f"{cache_key(fs, digest, layout, fs.compress)}.mlpackage"
    if sealed and build_cache.usable(path):  # whole and matching its checksum; a corrupt entry is removed, said so
        return True, digest, path
    convert_function(fs, weights, layout, fs.compress, path)
    if sealed:
        build_cache.seal(path)
    return False, digest, path


def verify_package(path: Path, functions: list[FunctionSpec],
                   model_layers: dict[int, torch.nn.Module] | ExpertWeights, layout: str,
                   progress: Callable[[str, int], object] | None = None, seed: int = 0, dense: list = (),
                   dense_dtype: torch.dtype = torch.float32) -> list:
    """Lint the saved program, then evaluate each function on the host against cpu-static (see mil_eval), with
    only that function's experts at hand from `model_layers` (see build_package), and each `dense` function
    (DenseSpec) likewise, its reference in `dense_dtype` (the model's compute dtype); each function's error must be
    within its tolerance (`mil_eval.tolerance`: its compression's and its reference's rounding)."""
    from runtime.coreml.mil_eval import check_function
    from runtime.coreml.mil_lint import lint_package, load_package_program

    spec, prog = load_package_program(path)
    lint_package(path, prog=prog, spec=spec)
    bar = progress("checking functions on the host", len(functions)) if progress else None
    checks, source = [], _expert_source(model_layers)
    for fs in functions:
        module, index = source.experts(fs.layer, fs.experts)
        group = GroupSpec(fs.layer, fs.group, index, fs.capacities, module, fs.compress)
        checks.append(check_function(prog.functions[fs.name], fs.name, group, layout, seed))
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    checks += [dense_programs.check_dense_function(prog.functions[d.name], d, dense_dtype, seed) for d in dense]
    for fs, check in zip([*functions, *dense], checks):
        if not check.max_rel_error <= check.tolerance:
            raise NpumoeError(f"function {check.function} differs from cpu-static by a relative error of "
                              f"{check.max_rel_error:.3g}, over the {check.tolerance:.3g} allowed for "
                              f"compress {fs.compress}")
    return checks
