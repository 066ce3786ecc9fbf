"""What a dense function computes on the ANE, on any host (ane-sim's `prepare_dense`): fp16 inputs, weights and
outputs, fp32 inside an op and fp16 between ops, as for expert groups (runtime/coreml/ane_sim.py).

The ops, in order, as the builder emits them (runtime/coreml/dense_programs.py):
- input norm: RMSNorm as LayerNorm of `[x, -x]` (ANEMLL's form), its first half, then the weight; LayerNorm one op
  (Phimoe);
- each projection one `linear` (bias included where the model has one); q/k norms as the input norm, per head or
  over the projection; the outputs concatenated;
- MLP: gate, up (linear each), silu, product, down; a shared expert's gate logit one linear `[H -> 1]`;
- attention core: q scaled first (so fp16 scores stay in range), q k^T, the mask added (masked keys at -1e4),
  softmax, times v.
Compressed weights (`int8`, `palettize4`) are decompressed through coremltools' own pass, configured as the build
configures it, on a one-op program of that matrix (cached on disk like the experts' weights).
"""
from __future__ import annotations

import hashlib
import io
import zipfile

import numpy as np
import torch
import torch.nn.functional as F

from runtime.backends import DenseFn, DenseSpec
from runtime.coreml.dense_programs import MASKED
from runtime.cpu.quantized import linear_weight
from runtime.fileio import atomic_write_bytes, cache_root

SIM_VERSION = 1


def r16(t: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to fp16 and back: a value stored between two ops."""
    return t.to(torch.float16).to(torch.float32)


def _decompress(w: np.ndarray, compress: str) -> np.ndarray:
    from runtime.coreml.compression import COMPRESSION_FUNCTIONS, compression_config, one_kmeans_thread
    from runtime.coreml.converter import (
        quiet_coremltools_import,
        quiet_progress,
    )

    quiet_coremltools_import()
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types
    from coremltools.converters.mil.mil.passes.graph_pass import PassOption
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, w.shape[1]), dtype=types.fp16)], opset_version=ct.target.macOS15)
    def prog(x):
        return mb.linear(x=x, weight=mb.const(val=w, name="dense_w"))

    graph_pass = PASS_REGISTRY["compression::" + COMPRESSION_FUNCTIONS[compress]]
    graph_pass.set_options([PassOption("config", compression_config(compress)), PassOption("joint_compression", False)])
    with one_kmeans_thread(), quiet_progress():
        graph_pass.apply(prog)
    for op in prog.functions["main"].operations:
        if op.op_type.startswith("constexpr_") and op.name.startswith("dense_w"):
            return np.asarray(op.materialized_val_inference(), dtype=np.float16).reshape(w.shape)
    return w  # under the pass's size threshold: stored as it is


def decompressed_matrix(w: np.ndarray, compress: str) -> np.ndarray:
    """The fp16 matrix a function stored with `compress` computes with; kept on disk by the matrix's digest."""
    if compress == "none":
        return w
    h = hashlib.sha256(f"dense:{SIM_VERSION}:{compress}:{w.shape}".encode())
    h.update(w.tobytes())
    path = cache_root() / "ane-sim" / f"{h.hexdigest()[:40]}.npz"
    try:
        with np.load(path) as f:
            return f["w"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        pass
    out = _decompress(w, compress)
    buf = io.BytesIO()
    np.savez(buf, w=out)
    atomic_write_bytes(path, buf.getvalue())
    return out


def linear_fp16(module: torch.nn.Module, compress: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a Linear (or an MLX checkpoint's packed one) as fp32 tensors holding the fp16 values the
    function stores (bias uncompressed)."""
    w = linear_weight(module).to(torch.float16).contiguous().numpy()
    w = torch.from_numpy(np.ascontiguousarray(decompressed_matrix(w, compress))).float()
    b = None if module.bias is None else r16(module.bias.detach().float())
    return w, b


def _linear(x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    w, b = wb
    return r16(x @ w.T if b is None else x @ w.T + b)


def _norm(module: torch.nn.Module, kind: str):
    """An input or q/k norm as the function computes it."""
    w = r16(module.weight.detach().float())
    if kind == "layer":
        b = r16(module.bias.detach().float())
        return lambda x: r16(F.layer_norm(x, x.shape[-1:], w, b, module.eps))
    eps = module.variance_epsilon

    def rms(x: torch.Tensor) -> torch.Tensor:  # ANEMLL's form: LayerNorm of [x, -x], the first half, the weight
        doubled = torch.cat([x, -x], dim=-1)
        return r16(r16(F.layer_norm(doubled, doubled.shape[-1:], eps=eps))[..., :x.shape[-1]] * w)

    return rms


def attention_fp16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                   scaling: float) -> torch.Tensor:
    rep = q.shape[0] // k.shape[0]
    k, v = r16(k.float()).repeat_interleave(rep, 0), r16(v.float()).repeat_interleave(rep, 0)
    scores = r16(r16(r16(q.float()) * scaling) @ k.transpose(1, 2))
    scores = r16(scores + torch.where(allowed, 0.0, MASKED))
    return r16(r16(torch.softmax(scores, dim=-1)) @ v)


def dense_fp16(spec: DenseSpec) -> DenseFn:
    """The fp16 function of `spec` (weights prepared once, here)."""
    m, form, c = spec.modules, spec.form, spec.compress
    if spec.kind == "attention":
        return lambda q, k, v, allowed: attention_fp16(q, k, v, allowed, spec.scaling).to(q.dtype)
    if spec.kind == "o_proj":
        o = linear_fp16(m["o"], c)
        return lambda x: _linear(r16(x.float()), o).to(x.dtype)
    if spec.kind == "mlp":
        mlp = m["mlp"]
        gate, up, down = (linear_fp16(getattr(mlp, n), c) for n in ("gate_proj", "up_proj", "down_proj"))
        shared_gate = linear_fp16(m["gate"], c) if form.shared_gate else None
        if form.act != "silu":
            raise ValueError(f"ane-sim dense MLP: activation {form.act!r} is not implemented (silu is)")

        def run_mlp(x: torch.Tensor) -> torch.Tensor:
            x16 = r16(x.float())
            h = r16(r16(F.silu(_linear(x16, gate))) * _linear(x16, up))
            out = [_linear(h, down)] + ([_linear(x16, shared_gate)] if shared_gate is not None else [])
            return torch.cat(out, dim=-1).to(x.dtype)

        return run_mlp
    norm = _norm(m["norm"], form.norm)
    q, k, v = (linear_fp16(m[r], c) for r in ("q", "k", "v"))
    qk = {r: _norm(m[r], "rms") for r in ("q_norm", "k_norm") if r in m}

    def qk_normed(role: str, y: torch.Tensor) -> torch.Tensor:
        if role not in qk:
            return y
        if form.qk_norm == "head":
            return qk[role](y.view(y.shape[0], -1, form.head_dim)).reshape(y.shape[0], -1)
        return qk[role](y)

    def run_qkv(x: torch.Tensor) -> torch.Tensor:
        h = norm(r16(x.float()))
        out = [qk_normed("q_norm", _linear(h, q)), qk_normed("k_norm", _linear(h, k)), _linear(h, v)]
        return torch.cat(out, dim=-1).to(x.dtype)

    return run_qkv
