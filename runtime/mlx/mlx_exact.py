"""The mlx-exact path: a layer's routed experts computed by MLX, as mlx-lm's `SwitchGLU` computes them, on the
checkpoint's own weights: `mx.gather_qmm` on an MLX folder's packed affine codes (`runtime.cpu.quantized`
`QuantizedExperts`), `mx.gather_mm` on full-width experts. Imports mlx: only `mlx_backends` names it, lazily.

Weights are wrapped once per module (`_held`): each tensor is copied into MLX's memory and the torch module's buffer
(or parameter) then made a view of that memory, so the process holds one copy, read by torch's paths (the static
groups, cpu-exact, the reference) and by MLX alike, however many executors wrap the module (the fidelity gate
builds one per candidate). Every array a layer keeps is evaluated where it is made: MLX's command encoders are per
thread (0.31.2+), and a lazy array first evaluated on the layer's exact-path worker fails there ("There is no
Stream(cpu, 0) in current thread"). On a Mac that memory is unified: the GPU reads the
same pages torch does, no transfer per call. On Linux MLX runs on its CPU device and the memory is plain host memory.
Each call still crosses: its rows are copied into an MLX array (`mx.array` copies), its outputs read back as a view
(the buffer protocol: no copy); the time both take is counted per call (`LayerStats.crossing_us`), and a decode
step crosses once for the whole layer (routing weights applied and summed in MLX).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import mlx.core as mx
import numpy as np
import torch

from runtime.cpu.quantized import PackedWeight, QuantizedExperts
from runtime.errors import NpumoeError
from runtime.mlx.formats import NAME, WIDEN_BYTES, check_format
from runtime.stats import LayerStats

SORT_FROM = 64  # assignments from which a decode step's rows are sorted by expert (mlx-lm's SwitchGLU: indices >= 64)
ACTIVATIONS = {"SiLUActivation": lambda x: x * mx.sigmoid(x), "SiLU": lambda x: x * mx.sigmoid(x),
               "GELUActivation": lambda x: 0.5 * x * (1 + mx.erf(x / np.sqrt(2.0)))}
ACTIVATIONS["GELU"] = ACTIVATIONS["GELUActivation"]
# torch dtypes numpy cannot hold cross as unsigned words of their width, then viewed (no copy)
_WORDS = {torch.bfloat16: (torch.int16, np.uint16, mx.bfloat16)}
# One MLX computation at a time in this process: a server prefills on one thread while it decodes on another, and
# MLX's streams are not documented as safe to evaluate from two threads at once (the GPU runs one at a time anyway).
_LOCK = threading.Lock()


def device() -> str:
    """Where MLX computes here: "gpu" (Metal) or "cpu" (MLX's CPU device, off a Mac)."""
    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def to_mx(t: torch.Tensor) -> mx.array:
    """A copy of `t` in MLX's memory, same dtype (int32 codes become uint32 words, as MLX's format has them)."""
    t = t.detach().contiguous()
    if t.dtype in _WORDS:
        signed, words, dtype = _WORDS[t.dtype]
        return mx.array(t.view(signed).numpy().view(words)).view(dtype)
    a = t.numpy()
    return mx.array(a.view(np.uint32) if a.dtype == np.int32 else a)


def to_torch(a: mx.array, dtype: torch.dtype) -> torch.Tensor:
    """A torch view of evaluated array `a`'s memory (no copy), as `dtype` (a bf16 array is read as words)."""
    if dtype in _WORDS:
        signed, _, _ = _WORDS[dtype]
        a = as_words(a, dtype)
        mx.eval(a)
        return torch.from_numpy(np.asarray(a)).view(signed).view(dtype)
    mx.eval(a)
    out = torch.from_numpy(np.asarray(a))
    return out.view(dtype) if out.dtype != dtype else out


TORCH_DTYPES = {mx.float32: torch.float32, mx.bfloat16: torch.bfloat16, mx.float16: torch.float16}


def torch_view(a: mx.array) -> torch.Tensor:
    """A torch view of weight `a` (no copy): floats in their dtype, packed uint32 codes as int32 words."""
    return to_torch(a, torch.int32 if a.dtype == mx.uint32 else TORCH_DTYPES[a.dtype])


def step_inputs(x: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> tuple[mx.array, mx.array, mx.array]:
    """A decode step's crossing in: its rows, expert ids and router weights (in the rows' dtype) as MLX arrays."""
    return to_mx(x), mx.array(top_k_index.numpy().astype(np.uint32)), to_mx(top_k_weights.to(x.dtype))


def sorted_inputs(x_sorted: torch.Tensor, experts: list[int], counts: list[int]) -> tuple[mx.array, mx.array]:
    """An exact call's crossing in: its rows [R, 1, H] (sorted by expert) and each row's expert id, in MLX."""
    return to_mx(x_sorted)[:, None, :], mx.array(np.repeat(np.asarray(experts, dtype=np.uint32), counts))


def crossed(inputs: Callable[[], tuple], compute: Callable[..., mx.array], dtype: torch.dtype,
            stats: LayerStats | None, lock: AbstractContextManager) -> torch.Tensor:
    """One call across to MLX and back: `inputs()` copied in, `compute(*inputs)` evaluated under `lock`, read back
    as a torch view in `dtype`; the time of both crossings counted in `stats`."""
    start = time.perf_counter()
    args = inputs()
    seconds = time.perf_counter() - start
    with lock:
        y = as_words(compute(*args), dtype)
        mx.eval(y)
    start = time.perf_counter()
    out = to_torch(y, dtype)
    _count(stats, seconds + time.perf_counter() - start)
    return out


def as_words(a: mx.array, dtype: torch.dtype) -> mx.array:
    """`a` as it crosses back into a torch tensor of `dtype`: bf16 as 16-bit words (viewed, not converted); made
    part of the call's evaluation, so reading it back evaluates nothing more."""
    return a.view(mx.uint16) if dtype in _WORDS and a.dtype != mx.uint16 else a


def _shared(t: torch.Tensor) -> tuple[mx.array, torch.Tensor]:
    """`t` moved into MLX's memory once: the MLX array and a torch view of the same memory to hold in its place."""
    a = to_mx(t)
    mx.eval(a)
    return a, to_torch(a, t.dtype).view(t.shape)


def _held(owner: torch.nn.Module, name: str) -> mx.array:
    """The MLX array behind `owner`'s tensor `name`, made once (`_shared`) and remembered on the owner: the next
    layer wrapping the same module finds the tensor already a view of it and takes it, no second copy."""
    held = owner.__dict__.setdefault("_npumoe_mlx", {})
    tensor = getattr(owner, name)
    if name not in held or held[name][1] != tensor.data_ptr():
        a, view = _shared(tensor.data)
        if isinstance(tensor, torch.nn.Parameter):
            tensor.data = view
        else:
            setattr(owner, name, view)  # torch now reads MLX's copy: the process holds one
        held[name] = (a, view.data_ptr())
    return held[name][0]


class _Packed:
    """One projection's packed weight as MLX arrays (codes, scales, biases), shared with the torch buffers."""

    def __init__(self, weight: PackedWeight) -> None:
        self.bits, self.group_size = weight.bits, weight.group_size
        self.q, self.scales, self.biases = (_held(weight, buffer) for buffer in ("packed", "scales", "biases"))

    def __call__(self, x: mx.array, idx: mx.array, sorted_indices: bool) -> mx.array:
        return mx.gather_qmm(x, self.q, self.scales, self.biases, rhs_indices=idx, transpose=True,
                             group_size=self.group_size, bits=self.bits, sorted_indices=sorted_indices)


class _Full:
    """One full-width projection [E, out, in] as an MLX array, shared with the torch parameter."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self.w = _held(module, name)
        self.wt = self.w.swapaxes(-1, -2)
        mx.eval(self.wt)  # a strided view, no copy: evaluated here, not first on the exact-path worker
        self.block = max(1, WIDEN_BYTES // (4 * self.w[0].size))  # experts widened at once

    def __call__(self, x: mx.array, idx: mx.array, sorted_indices: bool) -> mx.array:
        if x.dtype == self.w.dtype:
            return mx.gather_mm(x, self.wt, rhs_indices=idx, sorted_indices=sorted_indices)
        # Widened rows (`MlxExactLayer.widen`): gather_mm would promote the whole weight to the rows' dtype, a float32
        # copy of every expert (measured on the Qwen3-30B-A3B twin's gate: MLX's peak 3.5 GB for 1.15 GB of
        # experts); only the experts the rows use are widened, `block` at a time, each block evaluated before the next
        ids = np.asarray(idx).reshape(-1)
        used, local = np.unique(ids, return_inverse=True)
        if not sorted_indices or used.size <= self.block:
            return self._widened(x, used, local.reshape(idx.shape), sorted_indices)
        outs = []
        for first in range(0, used.size, self.block):  # rows sorted by expert: each block's rows are contiguous
            experts = used[first:first + self.block]
            a, b = np.searchsorted(ids, experts[0], "left"), np.searchsorted(ids, experts[-1], "right")
            outs.append(self._widened(x[a:b], experts, local[a:b] - first, True))
            mx.eval(outs[-1])
        return mx.concatenate(outs)

    def _widened(self, x: mx.array, experts: np.ndarray, local: np.ndarray, sorted_indices: bool) -> mx.array:
        """`x` against `experts`' weights in `x`'s dtype, `local` each row's position in `experts`."""
        w = mx.take(self.wt, mx.array(experts.astype(np.uint32)), axis=0).astype(x.dtype)
        return mx.gather_mm(x, w, rhs_indices=mx.array(local.astype(np.uint32)), sorted_indices=sorted_indices)


class MlxExactLayer:
    """A layer's experts on MLX: gate and up, the gated activation, down, per assignment, from the shared weights."""

    def __init__(self, module: torch.nn.Module) -> None:
        act = type(module.act_fn).__name__
        if act not in ACTIVATIONS:
            raise NpumoeError(f"{NAME}: the experts' activation {act} has no MLX form here "
                              f"(takes: {', '.join(sorted(ACTIVATIONS))})")
        self.act = ACTIVATIONS[act]
        # MLX's CPU kernels accumulate in the rows' dtype: bf16 rows there compute in float32 (measured on tiny-moe:
        # 2.2% mean error against float32 in bf16, 6x torch's, which accumulates in float32); Metal's accumulate in
        # float32 whatever the rows' dtype
        self.widen = device() == "cpu"
        packed = getattr(module, "npumoe_weights", None)
        if isinstance(packed, QuantizedExperts):
            for name in ("gate", "up", "down"):
                weight = getattr(packed, name)
                check_format(f"the experts' {name} projection", weight.bits, weight.group_size)
            self.gate, self.up, self.down = _Packed(packed.gate), _Packed(packed.up), _Packed(packed.down)
            self.gate_up = None
        elif packed is not None:
            raise NpumoeError(f"{NAME} runs the checkpoint's own weights; these experts are held in the CPU's "
                              f"{getattr(packed, 'kind', type(packed).__name__)} storage (the plan's cpu_weights), "
                              "which MLX cannot read: drop cpu_weights, or run them on cpu-exact")
        else:
            self.gate_up, self.down = _Full(module, "gate_up_proj"), _Full(module, "down_proj")
            self.ffn = module.intermediate_dim

    def _ffn(self, x: mx.array, idx: mx.array, sorted_indices: bool) -> mx.array:
        """x [..., 1, H] with expert ids `idx` [...] -> [..., 1, H]."""
        if self.gate_up is None:
            gate, up = self.gate(x, idx, sorted_indices), self.up(x, idx, sorted_indices)
        else:
            gate_up = self.gate_up(x, idx, sorted_indices)
            gate, up = gate_up[..., :self.ffn], gate_up[..., self.ffn:]
        return self.down(self.act(gate) * up, idx, sorted_indices)

    def run(self, x_sorted: torch.Tensor, experts: list[int], counts: list[int],
            stats: LayerStats | None = None) -> torch.Tensor:
        def compute(x: mx.array, idx: mx.array) -> mx.array:
            return self._ffn(self._computed(x), idx, sorted_indices=True)[:, 0, :].astype(x.dtype)

        return crossed(lambda: sorted_inputs(x_sorted, experts, counts), compute, x_sorted.dtype, stats, _LOCK)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                stats: LayerStats | None = None) -> torch.Tensor:
        """As mlx-lm's SwitchGLU: each token's k experts, rows sorted by expert from `SORT_FROM` assignments; the
        router weights applied and the k outputs summed in MLX, so one array crosses back."""
        def compute(xm: mx.array, idx: mx.array, w: mx.array) -> mx.array:
            return self._weighted(self._computed(xm), idx, self._computed(w)).astype(xm.dtype)

        return crossed(lambda: step_inputs(x, top_k_index, top_k_weights), compute, x.dtype, stats, _LOCK)

    def _computed(self, x: mx.array) -> mx.array:
        """The rows in the dtype the layer computes them in (`widen`)."""
        return x.astype(mx.float32) if self.widen else x

    def _weighted(self, x: mx.array, idx: mx.array, w: mx.array) -> mx.array:
        tokens, k = idx.shape
        if idx.size >= SORT_FROM:
            flat = idx.flatten()
            order = mx.argsort(flat)
            y = self._ffn(x[order // k][:, None, :], flat[order], sorted_indices=True)[:, 0, :]
            y = y[mx.argsort(order)].reshape(tokens, k, -1)
        else:
            y = self._ffn(x[:, None, None, :], idx, sorted_indices=False)[:, :, 0, :]
        return (y * w[..., None]).sum(axis=1)


def _count(stats: LayerStats | None, seconds: float) -> None:
    if stats is not None:
        stats.crossing_us[NAME] += seconds * 1e6
        stats.crossings[NAME] += 1
