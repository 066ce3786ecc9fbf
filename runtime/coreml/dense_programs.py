"""Core ML emission of a plan's dense functions (`Plan.dense` entries on `ane`): one static-shape fp16 function each.

Forms, after ANEMLL (Anemll/Anemll `anemll/models/qwen_model.py`) and apple/ml-ane-transformers
(`ane_transformers/reference/multihead_attention.py`), see docs/ane-facts.md:
- RMSNorm as LayerNorm over `[x, -x]` (mean zero, so LayerNorm's variance is mean(x^2)), the first half kept, times
  the weight: ANEMLL's form, which the ANE runs natively and which keeps x^2 out of fp16 (no overflow past 256);
- each projection one `linear` with its bias; q/k norms over `[rows, heads, head_dim]` (3-D) or the projection;
- the attention core without 5-D tensors: q `[heads, chunk, d]` reshaped to `[kv_heads, group x chunk, d]` (heads
  of one key/value head are adjacent), batched matmuls against k and v `[kv_heads, bucket, d]`, the additive mask
  `[chunk, bucket]` tiled over the group, softmax; one function per (chunk, bucket) shape, weight-free, shared by
  every layer (executorch's static Core ML llama and issue #15833: prefer one function per static shape);
- q scaled before q k^T (ANEMLL and ml-ane-transformers scale the product; scaling q first keeps fp16 scores in
  range and is the same value in exact arithmetic); masked keys at -1e4 (ml-ane-transformers' masks).
ane-sim computes the same ops (runtime/coreml/dense_sim.py); the build checks each function on the host against
cpu-static (runtime.backends.dense_reference) with its compression's tolerance.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from runtime.backends import DenseSpec, attention_reference, dense_reference
from runtime.coreml import ane_limits
from runtime.coreml.dense_io import ATTENTION_INPUTS, MASKED, OUTPUT, ROW_INPUT, dense_weights
from runtime.errors import NpumoeError
from runtime.plan import Plan


def dense_weight_bytes(spec: DenseSpec, compress: str | None = None) -> int:
    """Stored bytes of the function's weights as `compress` (default: its own) stores its matrices; vectors fp16."""
    arrays = dense_weights(spec).values()
    per = ane_limits.BYTES_PER_WEIGHT[compress or spec.compress]
    return int(sum(a.size * (per if a.ndim == 2 else 2) for a in arrays))


def input_shapes(spec: DenseSpec) -> dict[str, tuple[int, ...]]:
    if spec.kind == "attention":
        d = spec.form.head_dim
        shapes = ((spec.heads, spec.rows, d), (spec.kv_heads, spec.keys, d), (spec.kv_heads, spec.keys, d),
                  (spec.rows, spec.keys))
        return dict(zip(ATTENTION_INPUTS, shapes))
    module = spec.modules["o" if spec.kind == "o_proj" else "norm" if spec.kind == "qkv" else "mlp"]
    width = module.in_features if spec.kind == "o_proj" else (
        module.weight.shape[0] if spec.kind == "qkv" else module.gate_proj.in_features)
    return {ROW_INPUT: (spec.rows, int(width))}


def ane_dense_specs(model: torch.nn.Module, plan: Plan, compress: str | None = None,
                    backend: str = "ane") -> list[DenseSpec]:
    """The dense functions a build converts: those the plan places on `backend` (`compress`: the same for all)."""
    from runtime.dense.specs import backend_specs

    specs = backend_specs(model, plan, backend)
    return [replace(s, compress=compress) if compress and s.kind != "attention" else s for s in specs]


def internal_shapes(spec: DenseSpec) -> list[tuple[int, ...]]:
    """The tensors a function makes inside, past its inputs: the attention core's queries grouped per key/value
    head, its scores and its mask tiled over the group, `[kv_heads, group x rows, d | bucket]` (`dense_program`)."""
    if spec.kind != "attention":
        return []
    grouped = spec.heads // spec.kv_heads * spec.rows
    return [(spec.kv_heads, grouped, spec.form.head_dim), (spec.kv_heads, grouped, spec.keys), (grouped, spec.keys)]


def check_dense_limits(specs: list[DenseSpec], function_weight_bytes: float) -> None:
    """Refuse, before conversion, a dense function past the ANE's limits: one line naming it."""
    for spec in specs:
        shapes = [*input_shapes(spec).values(), *internal_shapes(spec)]
        sizes = [d for shape in shapes for d in shape] + list(spec.splits)
        if max(sizes) > ane_limits.MAX_AXIS:
            raise NpumoeError(f"dense function {spec.name}: an axis of {max(sizes):,} is past the Neural Engine's "
                              f"{ane_limits.MAX_AXIS:,}")
        if dense_weight_bytes(spec) > function_weight_bytes:
            raise NpumoeError(f"dense function {spec.name}: {dense_weight_bytes(spec) / 1e6:,.1f} MB of weights, "
                              f"over the limit of {function_weight_bytes / 1e6:,.1f} MB per program; compress it")


def dense_program(spec: DenseSpec, weights: dict[str, np.ndarray]):
    """The MIL program of one dense function: static shapes, fp16."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    L, m = spec.layer, spec.modules

    def const(role: str, kind: str = "w"):
        name = f"layer{L}_{role}_{kind}"
        return mb.const(val=weights[name], name=name) if name in weights else None

    def linear(x, role: str, **name):
        bias = const(role, "b")
        return mb.linear(x=x, weight=const(role), **({"bias": bias} if bias is not None else {}), **name)

    def rms(x, role: str, eps: float):
        """ANEMLL's RMSNorm: LayerNorm of [x, -x] over the last axis, first half, times the weight."""
        n = x.shape[-1]
        doubled = mb.concat(values=[x, mb.mul(x=x, y=np.float16(-1.0))], axis=-1)
        normed = mb.layer_norm(x=doubled, axes=[-1], epsilon=np.float16(eps))
        begin, end = [0] * len(x.shape), [*x.shape[:-1], n]
        return mb.mul(x=mb.slice_by_index(x=normed, begin=begin, end=end), y=const(role))

    def norm(x, role: str, kind: str):
        module = m[role]
        if kind == "layer":
            return mb.layer_norm(x=x, axes=[-1], gamma=const(role), beta=const(role, "b"),
                                 epsilon=np.float16(module.eps))
        return rms(x, role, module.variance_epsilon)

    def qk_norm(y, role: str):
        if role not in m:
            return y
        if spec.form.qk_norm == "projection":
            return norm(y, role, "rms")
        rows, width, d = y.shape[0], y.shape[1], spec.form.head_dim
        heads = mb.reshape(x=y, shape=[rows, width // d, d])
        return mb.reshape(x=norm(heads, role, "rms"), shape=[rows, width])

    specs = [mb.TensorSpec(shape=shape, dtype=types.fp16) for shape in input_shapes(spec).values()]

    def attention(q, k, v, mask):
        rep, rows, d = spec.heads // spec.kv_heads, spec.rows, spec.form.head_dim
        grouped = mb.reshape(x=mb.mul(x=q, y=np.float16(spec.scaling)), shape=[spec.kv_heads, rep * rows, d])
        scores = mb.matmul(x=grouped, y=k, transpose_y=True)
        scores = mb.add(x=scores, y=mb.tile(x=mask, reps=[rep, 1]) if rep > 1 else mask)
        out = mb.matmul(x=mb.softmax(x=scores, axis=-1), y=v)
        return mb.reshape(x=out, shape=[spec.heads, rows, d], name=OUTPUT)

    def row_wise(x):
        if spec.kind == "o_proj":
            return linear(x, "o", name=OUTPUT)
        if spec.kind == "mlp":
            gate = mb.linear(x=x, weight=const("mlp", "gate_proj_w"))
            hidden = mb.mul(x=mb.silu(x=gate), y=mb.linear(x=x, weight=const("mlp", "up_proj_w")))
            if not spec.form.shared_gate:
                return mb.linear(x=hidden, weight=const("mlp", "down_proj_w"), name=OUTPUT)
            down = mb.linear(x=hidden, weight=const("mlp", "down_proj_w"))
            return mb.concat(values=[down, linear(x, "gate")], axis=-1, name=OUTPUT)
        h = norm(x, "norm", spec.form.norm)
        outs = [qk_norm(linear(h, "q"), "q_norm"), qk_norm(linear(h, "k"), "k_norm"), linear(h, "v")]
        return mb.concat(values=outs, axis=-1, name=OUTPUT)

    body = attention if spec.kind == "attention" else row_wise
    return mb.program(input_specs=specs, opset_version=ct.target.macOS15)(body)


def sample_inputs(spec: DenseSpec, seed: int = 0) -> tuple[dict[str, np.ndarray], torch.Tensor | None]:
    """Random fp16 inputs of the function; for the attention core also the bool mask behind its additive one
    (a causal chunk over half the padded keys, so the padding and causality are both exercised)."""
    rng = np.random.default_rng(seed)
    shapes = input_shapes(spec)
    mask = ATTENTION_INPUTS[-1]
    feed = {n: rng.standard_normal(s).astype(np.float16) for n, s in shapes.items() if n != mask}
    if spec.kind != "attention":
        return feed, None
    from runtime.dense.attention import allowed_keys

    allowed = allowed_keys(None, spec.rows, spec.rows + (spec.keys - spec.rows) // 2, spec.keys)
    feed[mask] = np.where(allowed.numpy(), 0.0, MASKED).astype(np.float16)
    return feed, allowed


def check_dense_function(function, spec: DenseSpec, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Evaluate a built dense function on the host; compare with cpu-static on the same fp16 inputs, computed in
    `dtype`: the model's compute dtype (`runtime.dense.specs.compute_dtype`), what its rows arrive in at run time."""
    from runtime.coreml.mil_eval import FunctionCheck, evaluate_output, max_rel_error, tolerance

    feed, allowed = sample_inputs(spec, seed)
    got = evaluate_output(function, feed, OUTPUT, spec.name)
    with torch.no_grad():
        if spec.kind == "attention":
            q, k, v = (torch.from_numpy(feed[n].astype(np.float32)) for n in ATTENTION_INPUTS[:3])
            ref = attention_reference(q, k, v, allowed, spec.scaling)
            dtype = torch.float32
        else:
            ref = dense_reference(spec)(torch.from_numpy(feed[ROW_INPUT].astype(np.float32)).to(dtype))
    return FunctionCheck(spec.name, max_rel_error(got, ref.float().numpy()), tolerance(spec.compress, dtype, spec.kind))


BUILDER_VERSION = 1  # bump when a dense program changes: invalidates its cache entries


@dataclass(frozen=True)
class ConvertedDense:
    spec: DenseSpec
    path: Path
    digest: str
    cached: bool

    def manifest(self) -> dict:
        s = self.spec
        return dict(kind=s.kind, layer=s.layer, rows=s.rows, keys=s.keys or None, compress=s.compress,
                    weights_sha256=self.digest)


def cache_key(spec: DenseSpec, digest: str) -> str:
    """What makes a converted dense function reusable: weights, shapes, form, compression, tool versions."""
    import coremltools as ct

    key = dict(v=BUILDER_VERSION, coremltools=ct.__version__, name=spec.name, shapes=input_shapes(spec),
               splits=list(spec.splits), compress=spec.compress, scaling=spec.scaling, form=repr(spec.form),
               weights=digest)
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]
