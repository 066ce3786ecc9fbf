"""Evaluate built ML program functions on the host, and compare them with the `cpu-static` torch computation.

Core ML cannot predict on Linux, so this is how a Linux build knows the package computes what the plan means.
Each op runs through coremltools' own `value_inference` where the op has one (linear, matmul, mul, slices,
concat, weight decompression ...); the few it lacks (silu, conv) are written out here. Values are carried in
fp32 and rounded to fp16 after every fp16 op: fp16 storage between ops, wider accumulation inside them, which
is how the Neural Engine computes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from runtime.backends import GroupSpec
from runtime.coreml.ane import INPUT_NAME, OUTPUT_NAME, from_layout, to_layout
from runtime.cpu.cpu_backends import CpuStaticBackend, is_packed
from runtime.errors import NpumoeError

# Tolerances of the numeric check, on max|y - ref| / max|ref| per function against the fp32 torch reference.
# fp16 weights and activations: ~1e-3 measured. int8 per-channel weights: ~1.5e-2 measured. 4-bit palettes
# (16 values per 16 output channels) move each weight by ~10% RMS, the optimum for 16 levels, and outputs by
# up to ~0.4 of their scale: there the check catches a wrong graph (wrong expert or slice: errors >= 1), while
# the quality of a compressed model is a perplexity question, not this check's.
TOLERANCE = {"none": 1e-2, "int8": 3e-2, "palettize4": 0.5}
# Values the reference (cpu-static: the model's own modules in its dtype) rounds to its dtype on the longest chain of
# each function: an expert group's gate_up, activation, gated product and down; qkv's norm, projection and q/k norm;
# o_proj's projection; an MLP's gate, activation, product and down. The attention core's reference runs in float32.
REFERENCE_ROUNDINGS = {"group": 4, "qkv": 3, "o_proj": 1, "mlp": 4, "attention": 0}


def tolerance(compress: str, reference_dtype: torch.dtype, kind: str = "group") -> float:
    """The host check's bound for a function of `kind` against a reference computed in `reference_dtype`: its
    compression's TOLERANCE (set against float32 references) plus what the reference itself rounds, each of its
    REFERENCE_ROUNDINGS off by up to its dtype's unit roundoff (eps/2: bf16 3.9e-3, fp16 4.9e-4, float32 6e-8) of
    the output's scale. A bf16 reference is that much less exact than an fp16 function, not a looser check."""
    return TOLERANCE[compress] + REFERENCE_ROUNDINGS[kind] * torch.finfo(reference_dtype).eps / 2


class _Held:
    """Stands in for a Var's symbolic value while an op's value_inference runs (keeps fp32, unlike types)."""
    __slots__ = ("val",)

    def __init__(self, val: np.ndarray) -> None:
        self.val = val


def _silu(op, value: Callable) -> np.ndarray:
    x = value(op.x)
    return x / (1.0 + np.exp(-x))


def _conv(op, value: Callable) -> np.ndarray:
    """1x1 convolution, stride 1, no padding, one group: a matmul over channels of `[N, C, H, W]`."""
    w = value(op.weight)
    for arg, ok in (("strides", 1), ("dilations", 1)):
        v = getattr(op, arg, None)
        if v is not None and v.val is not None and np.any(v.val != ok):
            raise NpumoeError(f"host evaluation of conv {op.name}: only {arg}=1 is implemented")
    groups = getattr(op, "groups", None)
    if w.ndim != 4 or w.shape[2:] != (1, 1) or (groups is not None and groups.val not in (None, 1)):
        raise NpumoeError(f"host evaluation of conv {op.name}: only 1x1 kernels with one group are implemented")
    pad = getattr(op, "pad", None)
    if pad is not None and pad.val is not None and np.any(pad.val != 0):
        raise NpumoeError(f"host evaluation of conv {op.name}: padding is not implemented")
    y = np.einsum("oi,nihw->nohw", w[:, :, 0, 0], value(op.x), optimize=True)
    if op.bias is not None:
        y = y + value(op.bias)[None, :, None, None]
    return y


HAND_EVALUATED: dict[str, Callable] = {"silu": _silu, "conv": _conv}


def _input_vars(op) -> list:
    out = []
    for v in op.inputs.values():
        out.extend(v if isinstance(v, (list, tuple)) else [v])
    return out


def evaluate_function(function, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run one pymil function on the host; returns its outputs by name (fp32 arrays holding fp16 values)."""
    from coremltools.converters.mil.mil import types

    env: dict[str, np.ndarray] = {name: np.asarray(inputs[name], dtype=np.float32) for name in function.inputs}

    def value(var) -> np.ndarray:
        if var.name in env:
            return env[var.name]
        if var.val is not None:
            return np.asarray(var.val, dtype=np.float32) if types.is_float(var.dtype) else np.asarray(var.val)
        raise NpumoeError(f"host evaluation: {var.name} has no value (op order?)")

    for op in function.operations:
        if op.op_type == "const":
            continue  # read from the var when used
        if op.op_type.startswith("constexpr_"):
            result = op.materialized_val_inference()  # weight decompression, coremltools' own
        elif op.op_type in HAND_EVALUATED:
            result = HAND_EVALUATED[op.op_type](op, value)
        else:
            result = _coremltools_eval(op, value)
        outs = result if isinstance(result, tuple) else (result,)
        for var, y in zip(op.outputs, outs):
            y = np.asarray(y)
            if types.is_float(var.dtype):
                y = y.astype(np.float16 if var.dtype == types.fp16 else np.float32).astype(np.float32)
            if tuple(y.shape) != tuple(var.shape):
                raise NpumoeError(f"host evaluation of {op.op_type} {op.name}: got shape {y.shape}, the program "
                                  f"says {tuple(var.shape)}")
            env[var.name] = y
    return {var.name: env[var.name] for var in function.outputs}


def evaluate_output(function, inputs: dict[str, np.ndarray], output: str, name: str) -> np.ndarray:
    """`evaluate_function`'s output `output`, the one the runtime reads; a function (`name`) without it is refused
    here, naming what it has, rather than at run time."""
    y = evaluate_function(function, inputs)
    if output not in y:
        raise NpumoeError(f"function {name} has outputs {sorted(y)}, not {output!r}, the output the runtime reads")
    return y[output]


def _coremltools_eval(op, value: Callable):
    """coremltools' own op semantics: bind runtime values to the op's inputs, call value_inference, unbind."""
    bound = [v for v in _input_vars(op) if v.val is None]
    saved = [v._sym_val for v in bound]
    try:
        for v in bound:
            v._sym_val = _Held(value(v))
        try:
            return op.value_inference()
        except NotImplementedError:
            raise NpumoeError(f"host evaluation: coremltools has no evaluation for op {op.op_type} ({op.name}) "
                              "and npumoe has none either") from None
    finally:
        for v, s in zip(bound, saved):
            v._sym_val = s


def max_rel_error(y: np.ndarray, ref: np.ndarray) -> float:
    """max|y - ref| / max|ref|: elementwise errors relative to the output's scale (no blow-up near zeros)."""
    scale = float(np.max(np.abs(ref)))
    return float(np.max(np.abs(y - ref))) / scale if scale > 0 else float(np.max(np.abs(y - ref)))


@dataclass(frozen=True)
class FunctionCheck:
    function: str
    max_rel_error: float
    tolerance: float  # what this function may differ by (`tolerance`: its compression and reference's dtype)


def check_function(function, name: str, group: GroupSpec, layout: str, seed: int = 0) -> FunctionCheck:
    """Evaluate `function` on a random packed buffer and compare with cpu-static on the same fp16 inputs."""
    rng = np.random.default_rng(seed)
    hidden = group.module.hidden_dim
    packed = rng.standard_normal((sum(group.capacities), hidden)).astype(np.float16)
    got = from_layout(evaluate_output(function, {INPUT_NAME: to_layout(packed, layout)}, OUTPUT_NAME, name), layout)
    with torch.no_grad():
        # in the model's dtype; packed experts (dequantized per call in the rows' dtype) in float32
        dtype = torch.float32 if is_packed(group.module) else group.module.gate_up_proj.dtype
        x = torch.from_numpy(packed.astype(np.float32)).to(dtype)
        ref = CpuStaticBackend().prepare(group)(x).float().numpy()
    return FunctionCheck(name, max_rel_error(got, ref), tolerance(group.compress, dtype))
