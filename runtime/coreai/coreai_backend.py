"""The `coreai` backend: each planned expert group, and each dense function the plan places on it, is one function of
a Core AI asset (`.aimodel`) that `autotune build --format coreai` writes; Apple's runtime runs them.

The asset is loaded once per process (its lowering for the in-package runtime cached on disk by its digest,
runtime/coreai/assets.py), each function once, and a call feeds the packed rows (or the attention core's q, k, v and
additive mask) in the asset's dtype on the function's static shapes. On macOS 27 the OS framework runs it on the
Neural Engine; elsewhere Apple's in-package runtime runs it on the CPU, and the backend says so. Where Core AI's
packages are missing, or no asset was given, the backend is unavailable and its groups run on its fallback (ane-sim,
the ANE's fp16 numerics), said once. The asset's build record ties each function to the plan and the checkpoint:
a function of other shapes, weights or compression is refused in one line naming it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from runtime.backends.protocol import DenseFn, DenseSpec, GroupFn, GroupSpec
from runtime.coreai import assets
from runtime.coreai.programs import additive_mask
from runtime.coreml.ane import function_name, weights_digest
from runtime.coreml.dense_io import ROW_INPUT, dense_digest, dense_weights
from runtime.errors import NpumoeError
from runtime.fileio import read_versioned_json
from runtime.packages import PackageTarget
from runtime.plan import Plan

log = logging.getLogger("npumoe")

DTYPES = {"float32": torch.float32, "float16": torch.float16}


class _SilencedStderr:
    """fd 2 pointed at /dev/null while any caller is inside, restored when the last one leaves: the count and the
    swaps are held under one lock, so overlapping callers (the build's checks, the backend's loads, from any thread)
    can never leave fd 2 on /dev/null, and the redirection lasts only while a load is under way."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.saved: int | None = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self.lock:
            if self.users == 0:
                self.saved = self._swap()
            self.users += 1
        try:
            yield
        finally:
            with self.lock:
                self.users -= 1
                if self.users == 0 and self.saved is not None:
                    os.dup2(self.saved, 2)
                    os.close(self.saved)
                    self.saved = None

    @staticmethod
    def _swap() -> int | None:
        try:
            saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        except OSError:
            return None
        os.dup2(devnull, 2)
        os.close(devnull)
        return saved


native_stderr_silenced = _SilencedStderr()  # the in-package runtime prints a line per function it loads on fd 2


class CoreAiBackend:
    """Runs static groups and dense functions as functions of a built Core AI asset."""
    name = "coreai"

    def __init__(self, package: str | None = None) -> None:
        self.package_path = package  # the .aimodel, or the manifest.json beside it
        self.overlaps_cpu = assets.on_neural_engine()  # in-package runtime: its calls are this host's CPU
        self._record: dict | None = None
        self._model = None
        self._functions: dict[str, object] = {}
        self._lock = threading.Lock()
        self._said_dtype = False

    @property
    def asset(self) -> str:
        """The asset's path (a manifest names it)."""
        path = str(self.package_path or "")
        if path.endswith(".json"):
            packages = read_versioned_json(path, "manifest", 1).get("packages") or [{}]
            return str(Path(path).parent / packages[0].get("path", ""))
        return path

    def available(self) -> tuple[bool, str]:
        why = assets.coreai_import_error()
        if why:
            return False, why
        if not self.package_path:
            return False, "no Core AI asset given: build one with `autotune build --format coreai` and pass --package"
        if not self.asset.endswith(assets.ASSET_SUFFIX) or not Path(self.asset).is_dir():
            return False, f"{self.package_path} is not a Core AI asset (.aimodel)"
        return True, f"{assets.where_it_runs()} ({self.asset})"

    def record(self) -> dict:
        """The asset's build record (dtype, functions with their shapes, compression, digests and weight bytes)."""
        if self._record is None:
            self._record = assets.read_record(self.asset)
        return self._record

    def _function(self, name: str, what: str) -> dict:
        fn = self.record()["functions"].get(name)
        if fn is None:
            raise NpumoeError(f"{self.asset} has no function {name} for {what}; rebuild it with "
                              "`autotune build --format coreai` for this plan")
        return fn

    def check(self, group: GroupSpec) -> None:
        """Refuse an asset whose function for `group` has other experts, capacities, compression or weights."""
        name = function_name(group.layer, group.index)
        fn = self._function(name, f"layer {group.layer} group {group.index}")
        built = (fn.get("experts"), fn.get("capacities"), fn.get("compress"))
        planned = (list(group.experts), list(group.capacities), group.compress)
        if built != planned:
            raise NpumoeError(f"{self.asset}: function {name} was built for experts {built[0]}, capacities "
                              f"{built[1]}, compress {built[2]}, but the plan's has experts {planned[0]}, capacities "
                              f"{planned[1]}, compress {planned[2]}; rebuild it")
        if fn.get("weights_sha256") != weights_digest(group.module, group.experts):
            raise NpumoeError(f"{self.asset}: function {name} holds other weights than this model's (built from "
                              "another checkpoint); rebuild it")

    def check_dense(self, spec: DenseSpec) -> None:
        """Refuse an asset whose dense function `spec.name` is missing, of another shape, compression or weights."""
        fn = self._function(spec.name, "the plan's dense function")
        built = (fn.get("rows"), fn.get("keys") or 0, fn.get("compress"))
        if built != (spec.rows, spec.keys, spec.compress):
            raise NpumoeError(f"{self.asset}: function {spec.name} was built for {built[0]} rows, {built[1]} keys, "
                              f"compress {built[2]}, but the plan's has {spec.rows} rows, {spec.keys} keys, compress "
                              f"{spec.compress}; rebuild it")
        if spec.kind != "attention" and fn.get("weights_sha256") != dense_digest(dense_weights(spec)):
            raise NpumoeError(f"{self.asset}: function {spec.name} holds other weights than this model's (built "
                              "from another checkpoint); rebuild it")

    def _load(self, name: str):
        with self._lock:
            if self._model is None:
                self._model = assets.load_model(self.asset)
                if not assets.on_neural_engine():
                    log.warning("coreai: %s runs %s", assets.where_it_runs(), self.asset)
                else:
                    self._say_placement()
            if name not in self._functions:
                with native_stderr_silenced():
                    self._functions[name] = self._model.load_function(name)
            return self._functions[name]

    def _say_placement(self) -> None:
        """Once per asset, what its build read of Core AI's compute plan (or that it was never read)."""
        shares = self.record().get("placement")
        if not shares:
            log.warning("coreai: %s was built where Core AI's compute plan could not be read: its functions are not "
                        "proven to run on the Neural Engine (rebuild it on macOS 27)", self.asset)
            return
        low = min(shares, key=lambda n: shares[n]["share"])
        log.info("coreai: %s: Core AI's compute plan put every function mostly on the Neural Engine at build "
                 "(lowest %.0f%%, %s)", self.asset, 100 * shares[low]["share"], low)

    def _converted(self, run_dtype: torch.dtype, dtype: torch.dtype) -> None:
        """Said once: a run in another dtype than the asset's computes the asset's functions in the asset's."""
        if run_dtype == dtype or self._said_dtype:
            return
        self._said_dtype = True
        log.warning("coreai: %s computes in %s, this run in %s: each call's inputs are converted to %s and its "
                    "outputs back (expect a relative difference near %s from a run in the asset's dtype)",
                    self.asset, str(dtype).removeprefix("torch."), str(run_dtype).removeprefix("torch."),
                    str(dtype).removeprefix("torch."), "1e-1" if torch.bfloat16 in (dtype, run_dtype) else "1e-2")

    def _ready(self) -> torch.dtype:
        ok, reason = self.available()
        if not ok:
            raise NpumoeError(f"the coreai backend is unavailable: {reason}")
        return DTYPES[self.record()["dtype"]]

    def prepare(self, group: GroupSpec) -> GroupFn:
        dtype = self._ready()
        self.check(group)
        fn = self._load(function_name(group.layer, group.index))

        def run(packed: torch.Tensor) -> torch.Tensor:
            self._converted(packed.dtype, dtype)
            y = assets.call(fn, {ROW_INPUT: packed.detach().to(dtype).numpy()})
            return torch.from_numpy(y).to(packed.dtype)

        return run

    def prepare_dense(self, spec: DenseSpec) -> DenseFn:
        """A plan's dense function: the asset's function of that name (runtime/coreai/programs.py)."""
        dtype = self._ready()
        self.check_dense(spec)
        fn = self._load(spec.name)

        def feed(t: torch.Tensor) -> np.ndarray:
            self._converted(t.dtype, dtype)
            return t.detach().to(dtype).contiguous().numpy()

        if spec.kind == "attention":
            def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
                y = assets.call(fn, {"q": feed(q), "k": feed(k), "v": feed(v), "mask": feed(additive_mask(allowed,
                                                                                                          dtype))})
                return torch.from_numpy(y).to(q.dtype)

            return attention
        return lambda x: torch.from_numpy(assets.call(fn, {ROW_INPUT: feed(x)})).to(x.dtype)


def open_asset(package: str, plan: Plan, target: PackageTarget) -> CoreAiBackend:
    """The coreai backend over a built asset, checked on any host before the plan runs
    (`runtime.packages.bind_package`): each of the plan's coreai groups and dense functions built for its
    shapes, compression and these weights."""
    backend = CoreAiBackend(package)
    if not Path(backend.asset).is_dir():
        raise NpumoeError(f"{package}: no Core AI asset at {backend.asset}")
    for group in target.groups(plan, backend.name):
        backend.check(group)
    for spec in target.dense_specs(plan, backend.name):
        backend.check_dense(spec)
    return backend
