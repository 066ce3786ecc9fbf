"""The torch modules `autotune build --format coreai` exports (`torch.export`) and converts with coreai-torch: one per
entrypoint of a Core AI asset, each holding its weights as constants of the asset's dtype.

- an expert group: the packed rows `[sum(capacities), H]` sliced per expert, each expert's gated FFN
  (`down(silu(gate) * up)`, the fused gate_up projection as one matrix), the outputs concatenated: what the `ane`
  group function computes (runtime/coreml/converter.py), here from torch;
- the dense functions (runtime.backends.DenseSpec): q/k/v with the input norm (RMSNorm in ANEMLL's form, LayerNorm
  of `[x, -x]`, as the Core ML builder and ane-sim compute it: no x^2 in fp16), o_proj, the dense MLP or shared
  expert, and the weight-free attention core per (chunk, bucket) with an additive mask input (masked keys at -1e4).

Compressed weights use coreai-torch's own constant ops (`coreai::constexpr_blockwise_shift_scale`: int8 per output
channel; `coreai::lut_to_dense`: 4-bit lookup tables, one per 16 output channels, stored as uint4 by the
converter), with the very values the Core ML builder stores (ane-sim's decompressed weights, from coremltools'
pass as `autotune build` configures it): the two formats compute with the same weights.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from runtime.backends import DenseSpec
from runtime.coreml.dense_io import MASKED
from runtime.cpu.quantized import linear_weight

PALETTE_ROWS = 16  # output channels sharing one 4-bit table (the Core ML builder's per_grouped_channel group)


def _load_custom_ops() -> None:
    """coreai-torch registers its compression ops (`torch.ops.coreai.*`) when this module is imported."""
    import coreai_torch._compression.custom_layers  # noqa: F401


def _int8(w16: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 data, per-row fp16 scale) of a symmetric per-channel int8 matrix stored as the fp16 values `w16` (what
    coremltools' pass decompresses to): the scale is the fp16 value, within a few ulps of max|row| / 127, whose
    products round to `w16` (coremltools' own), so an fp16 asset computes with `w16` exactly."""
    w = w16.astype(np.float32)
    base = (np.abs(w).max(axis=1, keepdims=True) / 127.0).astype(np.float16)
    base[base == 0] = 1.0
    q = np.clip(np.rint(w / base.astype(np.float32)), -127, 127)
    scale = base.copy()
    found = np.zeros(len(w), dtype=bool)
    for step in (0, -1, 1, -2, 2, -3, 3):
        cand = (base.view(np.uint16).astype(np.int32) + step).astype(np.uint16).view(np.float16)
        match = ~found & np.all((q * cand.astype(np.float32)).astype(np.float16) == w16, axis=1)
        scale[match], found = cand[match], found | match
    return torch.from_numpy(q.astype(np.int8)), torch.from_numpy(scale.astype(np.float32))


def _palette(w16: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 indices `[O, I]`, tables `[O/16, 1, 16, 1]`) of a matrix holding at most 16 values per 16 rows."""
    o, i = w16.shape
    groups = w16.reshape(o // PALETTE_ROWS, PALETTE_ROWS * i)
    luts = np.zeros((len(groups), 16), dtype=np.float32)
    idx = np.zeros(groups.shape, dtype=np.uint8)
    for g, row in enumerate(groups):
        values, inverse = np.unique(row, return_inverse=True)
        if len(values) > 16:
            raise ValueError(f"a 4-bit palette holds 16 values; rows {g * 16}.. hold {len(values)}")
        luts[g, :len(values)] = values
        idx[g] = inverse
    return torch.from_numpy(idx.reshape(o, i)), torch.from_numpy(luts[:, None, :, None])


class Weight(torch.nn.Module):
    """One matrix as the asset stores it: a constant of the asset's dtype, or compressed with Core AI's constant
    ops (`compressed`: the fp16 values the compressed matrix decompresses to)."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype, compress: str = "none",
                 compressed: np.ndarray | None = None) -> None:
        super().__init__()
        self.compress, self.dtype = compress, dtype
        if compress == "none":
            self.register_buffer("w", w.detach().to(dtype).contiguous())
            return
        _load_custom_ops()
        if compress == "int8":
            data, scale = _int8(compressed)
            self.register_buffer("data", data)
            self.register_buffer("scale", scale.to(dtype))
        elif compress == "palettize4":
            indices, lut = _palette(compressed)
            self.register_buffer("indices", indices)  # the converter finds a table's indices by this name
            self.register_buffer("lut", lut.to(dtype))
        else:
            raise ValueError(f"unknown compression {compress!r}")

    def forward(self) -> torch.Tensor:
        if self.compress == "none":
            return self.w
        if self.compress == "int8":
            return torch.ops.coreai.constexpr_blockwise_shift_scale(self.data, self.scale)
        return torch.ops.coreai.lut_to_dense(self.indices, self.lut, 0)

    def stored_bytes(self) -> int:
        bits = {"none": torch.finfo(self.dtype).bits, "int8": 8, "palettize4": 4}[self.compress]
        return sum(b.numel() * (bits if n in ("w", "data", "indices") else torch.finfo(self.dtype).bits) // 8
                   for n, b in self.named_buffers())


def matrix(w: torch.Tensor, dtype: torch.dtype, compress: str) -> Weight:
    """A weight matrix stored as `compress` says, with the values the Core ML builder stores for it."""
    if compress == "none":
        return Weight(w, dtype)
    from runtime.coreml.dense_sim import decompressed_matrix

    w16 = w.detach().to(torch.float16).contiguous().numpy()
    return Weight(w, dtype, compress, decompressed_matrix(w16, compress))


def _vector(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.detach().to(dtype).contiguous()


class GroupProgram(torch.nn.Module):
    """One expert group: packed rows `[sum(capacities), H]` -> outputs of the same shape."""

    def __init__(self, weights: list[tuple[torch.Tensor, torch.Tensor]], capacities: tuple[int, ...],
                 dtype: torch.dtype, compress: str = "none") -> None:
        super().__init__()
        self.capacities = list(capacities)
        self.gate_up = torch.nn.ModuleList(matrix(gu, dtype, compress) for gu, _ in weights)
        self.down = torch.nn.ModuleList(matrix(d, dtype, compress) for _, d in weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for xe, gate_up, down in zip(x.split(self.capacities), self.gate_up, self.down):
            gate, up = F.linear(xe, gate_up()).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, down()))
        return torch.cat(outs) if len(outs) > 1 else outs[0]


class Projection(torch.nn.Module):
    """A linear layer (an MLX checkpoint's packed one dequantized), its bias uncompressed."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, compress: str) -> None:
        super().__init__()
        self.weight = matrix(linear_weight(module), dtype, compress)
        self.register_buffer("bias", _vector(getattr(module, "bias", None), dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(), self.bias)


class Norm(torch.nn.Module):
    """RMSNorm as LayerNorm of `[x, -x]` (the first half, times the weight), or LayerNorm with its bias."""

    def __init__(self, module: torch.nn.Module, kind: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = kind
        self.eps = float(module.eps if kind == "layer" else module.variance_epsilon)
        self.register_buffer("weight", _vector(module.weight, dtype))
        self.register_buffer("bias", _vector(getattr(module, "bias", None), dtype) if kind == "layer" else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        if self.kind == "layer":
            return F.layer_norm(x, (n,), self.weight, self.bias, self.eps)
        doubled = torch.cat([x, -x], dim=-1)
        return F.layer_norm(doubled, (2 * n,), eps=self.eps)[..., :n] * self.weight


class QkvProgram(torch.nn.Module):
    """The input norm, then q, k, v (with their norms), concatenated along the last axis."""

    def __init__(self, spec: DenseSpec, dtype: torch.dtype) -> None:
        super().__init__()
        m, c = spec.modules, spec.compress
        self.form = spec.form
        self.norm = Norm(m["norm"], spec.form.norm, dtype)
        self.q, self.k, self.v = (Projection(m[r], dtype, c) for r in ("q", "k", "v"))
        self.qk_norms = torch.nn.ModuleDict({r: Norm(m[r], "rms", dtype) for r in ("q_norm", "k_norm") if r in m})

    def _qk(self, role: str, y: torch.Tensor) -> torch.Tensor:
        if role not in self.qk_norms:
            return y
        if self.form.qk_norm == "head":
            rows = y.shape[0]
            return self.qk_norms[role](y.reshape(rows, -1, self.form.head_dim)).reshape(rows, -1)
        return self.qk_norms[role](y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return torch.cat([self._qk("q_norm", self.q(h)), self._qk("k_norm", self.k(h)), self.v(h)], dim=-1)


class MlpProgram(torch.nn.Module):
    """The dense MLP (silu-gated), or a shared expert with its gate's logit concatenated."""

    def __init__(self, spec: DenseSpec, dtype: torch.dtype) -> None:
        super().__init__()
        mlp, c = spec.modules["mlp"], spec.compress
        if spec.form.act != "silu":
            raise ValueError(f"Core AI dense MLP: activation {spec.form.act!r} is not implemented (silu is)")
        self.gate_proj, self.up_proj, self.down_proj = (Projection(getattr(mlp, n), dtype, c)
                                                        for n in ("gate_proj", "up_proj", "down_proj"))
        self.shared_gate = Projection(spec.modules["gate"], dtype, c) if spec.form.shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return y if self.shared_gate is None else torch.cat([y, self.shared_gate(x)], dim=-1)


class AttentionProgram(torch.nn.Module):
    """The attention core: q `[heads, rows, d]`, k and v `[kv_heads, keys, d]`, an additive mask `[rows, keys]`
    (0 or -1e4) -> `[heads, rows, d]`; q scaled first, heads of one key/value head batched together."""

    def __init__(self, spec: DenseSpec) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.scaling = spec.heads, spec.kv_heads, spec.scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rep, rows, d = self.heads // self.kv_heads, q.shape[1], q.shape[2]
        grouped = (q * self.scaling).reshape(self.kv_heads, rep * rows, d)
        scores = grouped @ k.transpose(1, 2) + (mask.repeat(rep, 1) if rep > 1 else mask)
        return (torch.softmax(scores, dim=-1) @ v).reshape(self.heads, rows, d)


def dense_program(spec: DenseSpec, dtype: torch.dtype) -> torch.nn.Module:
    """The module of one dense function."""
    if spec.kind == "attention":
        return AttentionProgram(spec)
    if spec.kind == "o_proj":
        return Projection(spec.modules["o"], dtype, spec.compress)
    if spec.kind == "mlp":
        return MlpProgram(spec, dtype)
    return QkvProgram(spec, dtype)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The attention core's mask input for a bool mask (True: may attend)."""
    return torch.where(allowed, 0.0, MASKED).to(dtype)


def stored_bytes(program: torch.nn.Module) -> int:
    """The weight bytes a function stores (its matrices as compressed, its vectors in the asset's dtype)."""
    matrices = [m for m in program.modules() if isinstance(m, Weight)]
    inside = {id(b) for m in matrices for b in m.buffers()}
    rest = sum(b.numel() * b.element_size() for b in program.buffers() if id(b) not in inside)
    return sum(m.stored_bytes() for m in matrices) + rest
