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
from runtime.plan import Plan

log = logging.getLogger("npumoe")

DTYPES = {"float32": torch.float32, "float16": torch.float16}


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """The in-package runtime prints a line per function it loads on the process's stderr: kept out of our output."""
    try:
        saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


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
            if name not in self._functions:
                with native_stderr_silenced():
                    self._functions[name] = self._model.load_function(name)
            return self._functions[name]

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
            y = assets.call(fn, {ROW_INPUT: packed.detach().to(dtype).numpy()})
            return torch.from_numpy(y).to(packed.dtype)

        return run

    def prepare_dense(self, spec: DenseSpec) -> DenseFn:
        """A plan's dense function: the asset's function of that name (runtime/coreai/programs.py)."""
        dtype = self._ready()
        self.check_dense(spec)
        fn = self._load(spec.name)

        def feed(t: torch.Tensor) -> np.ndarray:
            return t.detach().to(dtype).contiguous().numpy()

        if spec.kind == "attention":
            def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
                y = assets.call(fn, {"q": feed(q), "k": feed(k), "v": feed(v), "mask": feed(additive_mask(allowed,
                                                                                                          dtype))})
                return torch.from_numpy(y).to(q.dtype)

            return attention
        return lambda x: torch.from_numpy(assets.call(fn, {ROW_INPUT: feed(x)})).to(x.dtype)


def open_asset(package: str, plan: Plan, model: torch.nn.Module, plan_path: str = "") -> CoreAiBackend:
    """The coreai backend over a built asset, checked on any host before the plan runs: each of the plan's coreai
    groups and dense functions built for its shapes, compression and these weights."""
    from runtime.dense.specs import backend_specs
    from runtime.loading.model_loader import model_spec, moe_layers
    from runtime.plan import check_plan_matches

    check_plan_matches(plan, model_spec(model), plan_path)
    backend = CoreAiBackend(package)
    if not Path(backend.asset).is_dir():
        raise NpumoeError(f"{package}: no Core AI asset at {backend.asset}")
    for layer in moe_layers(model):
        for gi, g in enumerate(plan.layer(layer.index).groups):
            if g.backend == backend.name:
                backend.check(GroupSpec(layer.index, gi, tuple(g.experts), tuple(g.capacities), layer.experts,
                                        g.compression))
    for spec in backend_specs(model, plan, backend.name):
        backend.check_dense(spec)
    return backend
