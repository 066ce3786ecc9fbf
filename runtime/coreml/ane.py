"""The `ane` backend: each planned expert group, and each dense function the plan places on it (`prepare_dense`),
is one function of a Core ML multifunction package.

On macOS the package is compiled once, each group's function is loaded once and kept resident
(`compute_units=CPU_AND_NE`), and a call feeds the packed buffer as fp16 in the package's layout. The executor
runs the exact CPU path on a worker thread meanwhile (`overlaps_cpu`). Energy windows come from
`zeus-apple-silicon` when installed; on macOS 14.4+ `MLComputePlan` tells whether a group's ops are placed on the
Neural Engine. Elsewhere the backend says it is unavailable and the runtime runs the groups on its fallback
(its registry entry, with every fact about it, is in runtime/coreml/coreml_backends.py).

Layouts (what a function's input `x` and output `y` look like for a packed buffer of S rows of width H):
- `matmul`: `[S, H]`, linear layers;
- `conv1x1`: `[1, H, 1, S]`, channels first with 1x1 convolutions (apple/ml-ane-transformers).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import threading
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from runtime.apple_energy import energy_window, zeus_monitor
from runtime.backends.protocol import DenseFn, DenseSpec, GroupFn, GroupSpec, expert_matrices
from runtime.coreml.compiled_cache import compiled_package
from runtime.coreml.dense_io import ATTENTION_INPUTS, MASKED, ROW_INPUT, dense_digest, dense_weights, fp16
from runtime.coreml.dense_io import OUTPUT as DENSE_OUTPUT
from runtime.cpu.cpu_backends import is_packed
from runtime.errors import FileFormatError, NpumoeError
from runtime.fileio import read_versioned_json
from runtime.macos import macos_module, macos_version
from runtime.packages import PackageTarget
from runtime.plan import Plan

log = logging.getLogger("npumoe")

LAYOUTS = ("matmul", "conv1x1")
INPUT_NAME, OUTPUT_NAME = "x", "y"
MANIFEST_SCHEMA = "npumoe.manifest/1"  # <out>.manifest.json: the packages of one build, their functions
META_KEY = "npumoe.build"  # user-defined metadata: JSON with layout, compression and per-function provenance


def function_name(layer: int, group: int) -> str:
    """The package function that computes group `group` of MoE layer `layer` (builder and runtime agree here)."""
    return f"layer{layer}_group{group}"


def to_layout(packed: np.ndarray, layout: str) -> np.ndarray:
    """Packed rows `[S, H]` -> the function's input shape."""
    if layout == "matmul":
        return packed
    if layout == "conv1x1":
        return np.ascontiguousarray(packed.T)[None, :, None, :]
    raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")


def from_layout(y: np.ndarray, layout: str) -> np.ndarray:
    """The function's output -> packed rows `[S, H]`."""
    if layout == "matmul":
        return y
    if layout == "conv1x1":
        return np.ascontiguousarray(y[0, :, 0, :].T)
    raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")


def expert_weights_fp16(module: torch.nn.Module, expert: int) -> tuple[np.ndarray, np.ndarray]:
    """One expert's (gate_up `[2F, H]`, down `[H, F]`) as fp16 arrays, what a package stores for it. Packed experts
    (an MLX checkpoint's, `runtime.cpu.quantized`) are dequantized, this expert alone, in fp32 and rounded once."""
    dtype = torch.float32 if is_packed(module) else module.gate_up_proj.dtype
    return tuple(w.detach().to(torch.float16).contiguous().numpy() for w in expert_matrices(module, expert, dtype))


def weights_digest(module: torch.nn.Module, experts: tuple[int, ...] | list[int]) -> str:
    """sha256 of the fp16 weights of `experts`, in order: ties a package function to a checkpoint."""
    return arrays_digest(expert_weights_fp16(module, e) for e in experts)


def arrays_digest(expert_arrays: Iterable[tuple[np.ndarray, np.ndarray]]) -> str:
    """`weights_digest` of experts already converted by `expert_weights_fp16` (the builder has them at hand)."""
    h = hashlib.sha256()
    for pair in expert_arrays:
        for w in pair:
            h.update(str(w.shape).encode())
            h.update(w.tobytes())
    return h.hexdigest()


def coreml_available() -> tuple[bool, str]:
    """Whether Core ML can predict here: macOS 15+ (multifunction packages) with coremltools and its Core ML runtime
    bridge (`coremltools.libcoremlpython`, as `autotune doctor` checks: without it nothing compiles or predicts)."""
    ok, why = macos_module("coremltools.libcoremlpython",
                           f"Core ML prediction needs macOS; this host runs {sys.platform}",
                           "coremltools is not installed, or has no Core ML runtime bridge (coremltools."
                           "libcoremlpython: install a coremltools wheel built for this macOS)", "Core ML")
    if ok and macos_version() < (15,):
        return False, f"multifunction Core ML packages need macOS 15+, this is {platform.mac_ver()[0]}"
    return ok, why


class AneBackend:
    """Runs static groups as functions of a built Core ML package on the Neural Engine (macOS only)."""
    name = "ane"
    overlaps_cpu = True

    def __init__(self, package: str | None = None) -> None:
        self.package_path = package  # one .mlpackage, or the <out>.manifest.json of a build split in several
        self.energy: dict[str, Counter] = defaultdict(Counter)  # per function: summed mJ per field, and calls
        self._compiled: dict[str, str] = {}  # package path -> its compiled .mlmodelc (compiled_cache)
        self.compiles: Counter = Counter()  # packages compiled by this process, and reused from the compiled cache
        self._functions: dict[str, object] = {}  # function name -> resident CompiledMLModel
        self._meta: dict[str, dict] = {}  # package path -> its build metadata
        self._packages: dict[str, str] | None = None  # function name -> the package that holds it
        self._lock = threading.Lock()
        self._monitor = None
        self._compute_plan: dict[str, object] = {}  # package path -> its MLComputePlan
        self._checked: dict[tuple, str] = {}  # groups `check` passed -> their package

    def available(self) -> tuple[bool, str]:
        ok, why = coreml_available()
        if not ok:
            return False, why
        if not self.package_path:
            return False, "no Core ML package given: build one with `autotune build` and pass --package"
        if not (Path(self.package_path).is_dir() or Path(self.package_path).is_file()):
            return False, f"Core ML package {self.package_path} does not exist"
        return True, f"Core ML on the Neural Engine ({self.package_path})"

    # --- metadata: read with coremltools' protobuf reader, on any host ---

    def metadata(self, package: str | None = None) -> dict:
        """The build record the builder stored in a package (layout, compression, functions); by default the
        package holding the first function."""
        package = package or next(iter(self.packages().values()))
        if package not in self._meta:
            import coremltools as ct

            spec = ct.utils.load_spec(package)
            raw = spec.description.metadata.userDefined.get(META_KEY)
            if raw is None:
                raise NpumoeError(f"{package} was not built by `autotune build` (no {META_KEY} metadata)")
            self._meta[package] = json.loads(raw)
        return self._meta[package]

    def packages(self) -> dict[str, str]:
        """Function name -> path of the package holding it (one package, or every package of a manifest)."""
        if self._packages is None:
            if not self.package_path:
                raise NpumoeError("no Core ML package given: build one with `autotune build` and pass --package")
            if str(self.package_path).endswith(".json"):
                self._packages = read_manifest(self.package_path)
            else:
                self._packages = {name: self.package_path for name in self.metadata(self.package_path)["functions"]}
        return self._packages

    def check(self, group: GroupSpec) -> str:
        """Refuse a package built for another plan or checkpoint, naming the group; returns the function's package
        (a group checked once is not hashed again)."""
        name = function_name(group.layer, group.index)
        key = (name, group.experts, group.capacities, group.compress, id(group.module))
        if key in self._checked:
            return self._checked[key]
        self._checked[key] = self._check(group, name)
        return self._checked[key]

    def _check(self, group: GroupSpec, name: str) -> str:
        where = f"layer {group.layer} group {group.index}"
        package = self.packages().get(name)
        if package is None:
            raise NpumoeError(f"{self.package_path} has no function {name} for {where}; rebuild it with "
                              "`autotune build` for this plan")
        fn = self.metadata(package)["functions"].get(name)
        if fn is None:
            raise NpumoeError(f"{package} has no function {name} for {where}, though {self.package_path} says it "
                              "does; rebuild it")
        if fn["experts"] != list(group.experts) or fn["capacities"] != list(group.capacities):
            raise NpumoeError(f"{package}: function {name} was built for experts {fn['experts']} with "
                              f"capacities {fn['capacities']}, but the plan's {where} has experts "
                              f"{list(group.experts)} with capacities {list(group.capacities)}; rebuild it")
        check_compress(package, name, where, fn, group.compress)
        if fn["weights_sha256"] != weights_digest(group.module, group.experts):
            raise NpumoeError(f"{package}: function {name} holds other weights than this model's "
                              f"{where} (built from another checkpoint); rebuild it")
        return package

    # --- macOS only below: everything here needs Core ML's runtime ---

    def prepare(self, group: GroupSpec) -> GroupFn:
        ok, reason = self.available()
        if not ok:
            raise NpumoeError(f"the ane backend is unavailable: {reason}")
        name = function_name(group.layer, group.index)
        package = self.check(group)
        layout = self.metadata(package)["layout"]
        model = self._load(name, package)
        self._warn_if_not_on_ane(name, package)

        def run(packed: torch.Tensor) -> torch.Tensor:
            x = to_layout(packed.detach().to(torch.float16).numpy(), layout)
            with self._energy_window(name):
                y = model.predict({INPUT_NAME: x})[OUTPUT_NAME]
            return torch.from_numpy(from_layout(np.asarray(y), layout)).to(packed.dtype)

        return run

    def check_dense(self, spec: DenseSpec) -> str:
        """Refuse a package whose dense function `spec.name` is missing, of another shape, or built from other
        weights, naming it; returns its package."""
        package = self.packages().get(spec.name)
        if package is None:
            raise NpumoeError(f"{self.package_path} has no dense function {spec.name}; rebuild it with "
                              "`autotune build` for this plan")
        fn = self.metadata(package)["functions"].get(spec.name, {})
        if (fn.get("rows"), fn.get("keys") or 0) != (spec.rows, spec.keys):
            raise NpumoeError(f"{package}: dense function {spec.name} was built for {fn.get('rows')} rows and "
                              f"{fn.get('keys') or 0} keys, but the plan's has {spec.rows} and {spec.keys}; rebuild it")
        if spec.kind != "attention":
            check_compress(package, spec.name, f"dense function {spec.name}", fn, spec.compress)
        if spec.kind != "attention" and fn.get("weights_sha256") != dense_digest(dense_weights(spec)):
            raise NpumoeError(f"{package}: dense function {spec.name} holds other weights than this model's "
                              "(built from another checkpoint); rebuild it")
        return package

    def prepare_dense(self, spec: DenseSpec) -> DenseFn:
        """A plan's dense function (runtime.dense): the package's function of that name, fed fp16 inputs as the
        builder declared them (runtime/coreml/dense_programs.py: `x` rows, or the core's q, k, v and additive
        mask), its output in the caller's dtype."""
        ok, reason = self.available()
        if not ok:
            raise NpumoeError(f"the ane backend is unavailable: {reason}")
        name, package = spec.name, self.check_dense(spec)
        model = self._load(name, package)
        self._warn_if_not_on_ane(name, package)

        def predict(feed: dict[str, np.ndarray], like: torch.Tensor) -> torch.Tensor:
            with self._energy_window(name):
                y = model.predict(feed)[DENSE_OUTPUT]
            return torch.from_numpy(np.asarray(y, dtype=np.float32)).to(like.dtype)

        if spec.kind == "attention":
            def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
                mask = np.where(allowed.numpy(), 0.0, MASKED).astype(np.float16)
                return predict(dict(zip(ATTENTION_INPUTS, (fp16(q), fp16(k), fp16(v), mask))), q)

            return attention
        return lambda x: predict({ROW_INPUT: fp16(x)}, x)

    def _load(self, name: str, package: str):
        import coremltools as ct

        with self._lock:
            if package not in self._compiled:
                # Each package compiled once per machine (cached by digest); its functions load from that .mlmodelc.
                self._compiled[package], hit = compiled_package(package)
                self.compiles["reused" if hit else "compiled"] += 1
            if name not in self._functions:
                self._functions[name] = ct.models.CompiledMLModel(
                    self._compiled[package], compute_units=ct.ComputeUnit.CPU_AND_NE, function_name=name)
            return self._functions[name]

    def _warn_if_not_on_ane(self, name: str, package: str) -> None:
        """MLComputePlan (macOS 14.4+): warn, naming the group, when any compute op is not placed on the ANE."""
        if macos_version() < (14, 4):
            return
        try:
            off = ops_not_on_ane(self.compute_plan(package), name)
        except Exception as e:  # the placement check is advice; never fail a run on it
            log.warning("could not read MLComputePlan for %s: %s", name, e)
            return
        if off:
            shown = ", ".join(f"{op} on {dev}" for op, dev in off[:5])
            log.warning("function %s: %d op(s) not placed on the Neural Engine: %s", name, len(off), shown)

    def compute_plan(self, package: str | None = None):
        """The loaded package's MLComputePlan (where Core ML places each op; macOS 14.4+), read once per package
        (default: the first loaded): what the runtime's placement warning and `autotune doctor` read."""
        import coremltools as ct
        from coremltools.models.compute_plan import MLComputePlan

        package = package or next(iter(self._compiled))
        if package not in self._compute_plan:
            self._compute_plan[package] = MLComputePlan.load_from_path(self._compiled[package],
                                                                       compute_units=ct.ComputeUnit.CPU_AND_NE)
        return self._compute_plan[package]

    @contextmanager
    def _energy_window(self, name: str) -> Iterator[None]:
        """Energy of one call through zeus-apple-silicon (optional), added to `energy[name]`; windows are per
        thread and call."""
        if self._monitor is None:
            self._monitor = zeus_monitor() or False  # not installed: no energy figures, and none made up
        if not self._monitor:
            yield
            return
        with energy_window(self._monitor, f"{name}@{threading.get_ident()}") as used:
            yield
        self.energy[name].update(used, calls=1)


def check_compress(package: str, name: str, where: str, fn: dict, planned: str) -> None:
    """Refuse a function whose weights are stored otherwise than the plan says (a `--compress` build run with a plan
    of another compression computes other numbers than the plan was searched and gated for)."""
    built = fn.get("compress", "none")
    if built != planned:
        raise NpumoeError(f"{package}: function {name} stores its weights as {built}, but the plan's {where} has "
                          f"compress {planned}; rebuild it without --compress, or with a plan searched for {built}")


def package_bytes(path: str | os.PathLike) -> int:
    """A package's size on disk: what a build records per package in its manifest."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def read_manifest(path: str | os.PathLike) -> dict[str, str]:
    """Function name -> package path (beside the manifest) from a build's `<out>.manifest.json`; validated on any
    host, with an error that names the field: every package it names is present and of the size it records
    (`bytes`: a copy cut short or a part replaced shows here), every function in one package only."""
    p = str(path)
    obj = read_versioned_json(path, "manifest", 1)
    packages = obj.get("packages")
    if not isinstance(packages, list) or not packages:
        raise FileFormatError("manifest", p, "packages", "must be a non-empty list")
    out: dict[str, str] = {}
    for i, pk in enumerate(packages):
        if not isinstance(pk, dict) or not isinstance(pk.get("path"), str) or not isinstance(pk.get("functions"), list):
            raise FileFormatError("manifest", p, f"packages[{i}]", "needs a path and a list of functions")
        if not pk["path"] or not all(isinstance(name, str) and name for name in pk["functions"]):
            raise FileFormatError("manifest", p, f"packages[{i}]", "needs a path and function names (strings)")
        where = Path(path).parent / pk["path"]
        if not where.is_dir():
            raise FileFormatError("manifest", p, f"packages[{i}].path", f"{where} does not exist")
        recorded = pk.get("bytes")
        if recorded is not None and (not isinstance(recorded, int) or isinstance(recorded, bool)):
            raise FileFormatError("manifest", p, f"packages[{i}].bytes", f"must be an integer, got {recorded!r}")
        if recorded is not None and package_bytes(where) != recorded:
            raise FileFormatError("manifest", p, f"packages[{i}].bytes",
                                  f"{where} holds {package_bytes(where)} bytes, the build recorded {recorded}: it "
                                  "was changed or copied in part; rebuild it with `autotune build`")
        for name in pk["functions"]:
            if name in out:
                raise FileFormatError("manifest", p, f"packages[{i}].functions",
                                      f"function {name} is also in {out[name]}")
            out[name] = str(where)
    return out


def open_package(package: str, plan: Plan, target: PackageTarget) -> AneBackend:
    """The ane backend over a built package (or a split build's manifest), checked on any host before the plan
    runs (`runtime.packages.bind_package`): a manifest's parts present and as recorded (`read_manifest`),
    and each of the plan's ane groups built for its experts and capacities from these weights (the digests the
    build recorded, `AneBackend.check`)."""
    backend = AneBackend(package)
    backend.packages()
    for group in target.groups(plan, backend.name):
        backend.check(group)
    return backend


def ops_not_on_ane(compute_plan, name: str) -> list[tuple[str, str]]:
    """(op type, preferred device) for each non-const op of function `name` not preferred on the Neural Engine."""
    from coremltools.models.compute_device import MLNeuralEngineComputeDevice

    function = compute_plan.model_structure.program.functions[name]
    off = []
    for op in function.block.operations:
        if op.operator_name.startswith("const"):
            continue
        usage = compute_plan.get_compute_device_usage_for_mlprogram_operation(op)
        device = usage.preferred_compute_device if usage is not None else None
        if not isinstance(device, MLNeuralEngineComputeDevice):
            off.append((op.operator_name, type(device).__name__ if device is not None else "unknown device"))
    return off

