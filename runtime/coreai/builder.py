"""`autotune build --format coreai`: a plan's `coreai` groups and dense functions as one Core AI asset (`.aimodel`),
with its manifest beside it (`<out>.manifest.json`, as for Core ML packages), checked through Apple's runtime.

The functions are those the Core ML builder makes for `ane` (runtime/coreml/converter.py `ane_functions`,
runtime/coreml/dense_programs.py `ane_dense_specs`), refused past the same Neural Engine limits before anything is
converted (per function, and the weights resident at once against the ANE's 4 GiB window), then each one's torch
module (runtime/coreai/programs.py) exported and converted by coreai-torch into one asset, one function's torch copy
of its weights at a time (the converted program holds them all until it is saved). The asset computes in float32
for a float32 build (the CPU's and GPU's precision: the plumbing checked exact) and in float16 otherwise (the Neural
Engine's: what `--dtype auto` builds). Where Core AI's compute plan can be read (macOS 27), each function's share
on the Neural Engine is read from it before anything is written (runtime/coreai/placement.py): a function mostly
elsewhere is refused in one line with its share, and the shares go into the asset's metadata and the manifest.
The build record (dtype, per function: shapes, compression, weights digest, stored weight bytes) lives in the
asset's metadata; the runtime refuses an asset that does not match its plan from it.

Each function is then run once through Apple's runtime on random inputs of its static shapes: a float32 asset
against cpu-static (the model's own computation, compressed weights within their compression's tolerance), a
float16 one against ane-sim (the same fp16 function simulated, within fp16 rounding). The asset is written and
checked under a staging name beside `out`, and takes its name (with its manifest) only once every check passed: an
interrupted or failed build leaves nothing a later `run --package` could take.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from runtime.backends import GroupSpec, attention_reference, dense_reference, expert_ffn
from runtime.backends.protocol import DenseSpec, expert_matrices
from runtime.coreai import assets, placement, programs
from runtime.coreml import ane_limits, dense_programs
from runtime.coreml.ane import MANIFEST_SCHEMA, package_bytes, weights_digest
from runtime.coreml.converter import (
    FunctionSpec,
    ane_functions,
    check_ane_limits,
    check_build_options,
    check_expert_form,
    compression_summary,
    manifest_path,
    stored_weight_bytes,
)
from runtime.coreml.dense_io import ROW_INPUT, dense_digest, dense_weights
from runtime.coreml.mil_eval import TOLERANCE, max_rel_error
from runtime.errors import NpumoeError
from runtime.fileio import atomic_write_json
from runtime.interrupts import held
from runtime.loading.expert_weights import ExpertWeights
from runtime.plan import Plan

BACKEND = "coreai"
EXACT_TOLERANCE = 1e-5  # a float32 asset with uncompressed weights: the plumbing, exact up to summation order


@dataclass
class AssetBuild:
    """What `autotune build --format coreai` returns (and prints as JSON)."""
    package: str
    manifest: str
    dtype: str
    functions: list[FunctionSpec]
    dense: list[DenseSpec]
    package_bytes: int
    weight_bytes: int  # every function's stored weights (an expert shared by two functions counted twice)
    largest_function_weight_bytes: int
    checks: dict[str, float] = field(default_factory=dict)  # function -> max relative error of Apple's runtime
    checked_against: str = ""
    tolerance: float = 0.0
    seconds: dict[str, float] = field(default_factory=dict)
    placement: dict[str, dict] = field(default_factory=dict)  # function -> its share on the Neural Engine (macOS 27)

    def to_json(self) -> dict:
        kinds = [fs.compress for fs in self.functions] + [d.compress for d in self.dense if d.kind != "attention"]
        return {"format": "coreai", "package": self.package, "manifest": self.manifest, "dtype": self.dtype,
                "functions": len(self.functions), "dense_functions": len(self.dense),
                "attention_functions": sum(d.kind == "attention" for d in self.dense),
                "compress": sorted(set(kinds)), "package_bytes": self.package_bytes,
                "weight_bytes": self.weight_bytes,
                "largest_function_weight_bytes": self.largest_function_weight_bytes,
                "max_rel_error": max(self.checks.values(), default=float("nan")),
                "checked_against": self.checked_against,
                "tolerance": self.tolerance, "checks": self.checks, "runs_on": assets.where_it_runs(),
                "placement": self.placement or None,
                "build_seconds_by_stage": {k: round(v, 2) for k, v in self.seconds.items()}}


def _group_program(fs: FunctionSpec, source: ExpertWeights, dtype: torch.dtype
                   ) -> tuple[programs.GroupProgram, GroupSpec, str]:
    module, index = source.experts(fs.layer, fs.experts)
    weights = [expert_matrices(module, i, torch.float32) for i in index]
    group = GroupSpec(fs.layer, fs.group, index, fs.capacities, module, fs.compress)
    return programs.GroupProgram(weights, fs.capacities, dtype, fs.compress), group, weights_digest(module, index)


def _dense_inputs(spec: DenseSpec, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Random inputs of the function's static shapes (the Core ML builder's), in the asset's dtype."""
    feed, allowed = dense_programs.sample_inputs(spec)
    return {k: torch.from_numpy(v.astype(np.float32)).to(dtype) for k, v in feed.items()}, allowed


def _group_expected(group: GroupSpec, x: torch.Tensor, fp16: bool) -> torch.Tensor:
    if fp16:
        from runtime.coreml.ane_sim import AneSimBackend

        return AneSimBackend().prepare(group)(x.float())
    return torch.cat([expert_ffn(group.module, e, xe) for e, xe in zip(group.experts,
                                                                       x.float().split(list(group.capacities)))])


def _dense_expected(spec: DenseSpec, feed: dict[str, torch.Tensor], allowed, fp16: bool) -> torch.Tensor:
    if fp16:
        from runtime.coreml.dense_sim import dense_fp16

        fn = dense_fp16(spec)
        return fn(*(feed[n].float() for n in "qkv"), allowed) if spec.kind == "attention" else fn(feed[ROW_INPUT])
    if spec.kind == "attention":
        return attention_reference(*(feed[n].float() for n in "qkv"), allowed, spec.scaling)
    return dense_reference(spec)(feed[ROW_INPUT].float())


def build_asset(source: ExpertWeights, plan: Plan, out: str | Path, dtype: str = "float16",
                compress: str | None = None, dense_model: torch.nn.Module | None = None,
                function_weight_bytes: float = ane_limits.FUNCTION_WEIGHT_BYTES,
                progress: Callable[[str, int], object] | None = None, seed: int = 0) -> AssetBuild:
    """Build the plan's coreai functions into `out` (an `.aimodel`) and `<out>.manifest.json`; `dtype` float32 or
    float16 (the asset's); `compress` overrides every function's. Refused before conversion past a limit."""
    t0 = time.perf_counter()
    out = Path(out)
    if out.suffix != assets.ASSET_SUFFIX:
        raise NpumoeError(f"{out} must end in {assets.ASSET_SUFFIX}")
    check_build_options(compress=compress or "none")
    if dtype not in ("float32", "float16"):
        raise NpumoeError(f"a Core AI asset computes in float32 or float16, not {dtype}")
    functions = ane_functions(plan, compress, BACKEND)
    dense = dense_programs.ane_dense_specs(dense_model, plan, compress, BACKEND) if dense_model is not None else []
    if not functions and not dense:
        raise NpumoeError(f"the plan puts no group on the {BACKEND} backend, nor a dense function: nothing to build")
    check_ane_limits(functions, function_weight_bytes)  # before conversion, as for Core ML packages
    dense_programs.check_dense_limits(dense, function_weight_bytes)
    ane_limits.check_window({"experts": stored_weight_bytes(functions),
                             "dense functions": stored_weight_bytes(dense)})
    for layer in sorted({fs.layer for fs in functions}):
        check_expert_form(source.experts(layer, (0,))[0], layer)

    tdtype = torch.float32 if dtype == "float32" else torch.float16
    record, checks_todo = {}, []
    bar = progress("exporting functions", len(functions) + len(dense)) if progress else None
    entries = _entries(source, functions, dense, tdtype, seed, record, checks_todo, bar)
    program = assets.to_program(entries)  # each function exported as it is made: one torch copy at a time
    if bar:
        bar.close()
    seconds = {"export": time.perf_counter() - t0}
    t = time.perf_counter()
    found = placement.read(program)  # macOS 27: Core AI's compute plan, before anything is written
    if found is not None:
        placement.check(found, dtype)
    shares = {name: s.to_json() for name, s in (found or {}).items()}
    meta = dict(dtype=dtype, hidden=plan.model.hidden_size, ffn=plan.model.expert_ffn_size,
                model_fingerprint=plan.model.fingerprint, functions=record, placement=shares or None)
    seconds["placement"] = time.perf_counter() - t
    out.parent.mkdir(parents=True, exist_ok=True)
    with assets.staged(out) as staging:  # `out` appears only once every function is checked
        t = time.perf_counter()
        assets.save(program, staging, meta)
        seconds["convert"] = time.perf_counter() - t
        t = time.perf_counter()
        checks = _run_checks(staging, checks_todo, progress)
        seconds["verify"] = time.perf_counter() - t
        tolerances = _check_tolerances(checks, record, tdtype)
        with held():  # a SIGTERM here lands after the asset and its manifest are both in place
            assets.commit(staging, out)
            _write_manifest(out, plan, dtype, functions, record, function_weight_bytes, shares)
    seconds["total"] = time.perf_counter() - t0
    weights = {name: fn["weight_bytes"] for name, fn in record.items()}
    return AssetBuild(str(out), str(manifest_path(out)), dtype, functions, dense, package_bytes(out),
                      sum(weights.values()), max(weights.values()), checks,
                      "cpu-static" if tdtype == torch.float32 else "ane-sim", max(tolerances.values()), seconds,
                      shares)


def _entries(source: ExpertWeights, functions: list[FunctionSpec], dense: list[DenseSpec], tdtype: torch.dtype,
             seed: int, record: dict, checks_todo: list, bar) -> Iterator[assets.Function]:
    """Each function's module, made when the converter asks for it; its build record and its check noted."""
    rng = torch.Generator().manual_seed(seed)
    fp16 = tdtype != torch.float32
    for fs in functions:
        program, group, digest = _group_program(fs, source, tdtype)
        x = torch.randn(fs.slots, fs.hidden, generator=rng).to(tdtype)
        record[fs.name] = dict(layer=fs.layer, group=fs.group, experts=list(fs.experts),
                               capacities=list(fs.capacities), compress=fs.compress, weights_sha256=digest,
                               weight_bytes=programs.stored_bytes(program), inputs={ROW_INPUT: list(x.shape)})
        checks_todo.append((fs.name, {ROW_INPUT: x}, lambda x=x, g=group: _group_expected(g, x, fp16)))
        yield fs.name, program, (x,), [ROW_INPUT]
        if bar:
            bar.update(1)
    for spec in dense:
        program = programs.dense_program(spec, tdtype)
        feed, allowed = _dense_inputs(spec, tdtype)
        if spec.kind == "attention":
            feed["mask"] = programs.additive_mask(allowed, tdtype)
        record[spec.name] = dict(kind=spec.kind, layer=spec.layer, rows=spec.rows, keys=spec.keys or None,
                                 compress=spec.compress, weight_bytes=programs.stored_bytes(program),
                                 weights_sha256=None if spec.kind == "attention" else dense_digest(dense_weights(spec)),
                                 inputs={k: list(v.shape) for k, v in feed.items()})
        checks_todo.append((spec.name, feed, lambda s=spec, f=feed, a=allowed: _dense_expected(s, f, a, fp16)))
        yield spec.name, program, tuple(feed.values()), list(feed)
        if bar:
            bar.update(1)


def _check_tolerances(checks: dict[str, float], record: dict, tdtype: torch.dtype) -> dict[str, float]:
    """Each function's allowed error; the first over it refused in one line."""
    tolerances = {name: (EXACT_TOLERANCE if tdtype == torch.float32 and record[name]["compress"] == "none"
                         else TOLERANCE[record[name]["compress"]]) for name in checks}
    for name, err in checks.items():
        if not err <= tolerances[name]:
            raise NpumoeError(f"function {name}, run by Apple's runtime, differs from "
                              f"{'cpu-static' if tdtype == torch.float32 else 'ane-sim'} by a relative error of "
                              f"{err:.3g}, over the {tolerances[name]:g} allowed")
    return tolerances


def _write_manifest(out: Path, plan: Plan, dtype: str, functions: list[FunctionSpec], record: dict,
                    function_weight_bytes: float, shares: dict) -> None:
    weights = {name: fn["weight_bytes"] for name, fn in record.items()}
    atomic_write_json(manifest_path(out), {
        "schema": MANIFEST_SCHEMA, "format": "coreai", "model_fingerprint": plan.model.fingerprint, "dtype": dtype,
        "compress": compression_summary(functions) if functions else "none",
        "function_weight_limit_bytes": int(function_weight_bytes),
        "packages": [dict(path=out.name, functions=list(record), weight_bytes=sum(weights.values()),
                          function_weight_bytes=weights, bytes=package_bytes(out),
                          neural_engine_share={n: s["share"] for n, s in shares.items()} or None)]})


def _run_checks(out: Path, todo: list, progress) -> dict[str, float]:
    """Each function once through Apple's runtime against what it should compute."""
    from runtime.coreai.coreai_backend import native_stderr_silenced

    model = assets.load_model(out)
    bar = progress("checking functions in Apple's runtime", len(todo)) if progress else None
    checks = {}
    for name, feed, expected in todo:
        with native_stderr_silenced():
            fn = model.load_function(name)
        got = assets.call(fn, {k: v.numpy() for k, v in feed.items()})
        with torch.no_grad():
            ref = expected().float().numpy()
        checks[name] = max_rel_error(got.astype(np.float32), ref)
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    return checks
