"""CPU-side storage of a layer's experts quantized by us, one expert at a time, from full-width fused weights:
`int8` (one scale per output channel) and `int4` (per group of `group_size` inputs, a scale and a zero), with
their kernels:

- `packed`: torch's int kernels on the packed weights (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), fast
  for few rows (decode steps, short chunks, spills);
- `dequant`: the expert dequantized to the rows' dtype (fp32 rows: fp32, where sgemm beats the int kernels, as
  Accelerate does on Apple's CPUs; bf16 rows: bf16, where AMX does) and one matmul, for many rows sharing it. An
  int8 expert's per-channel scale factors out of the matmul: its codes are only cast, and the output scaled;
- `int_mm` (int8): the rows quantized to int8 too (one scale per row, on the fly) and one int8 matmul
  (`torch._int_mm`: oneDNN's AMX-int8 / VNNI kernels where the host has them), for many rows;
- `int_mm_gate_up` (int8): `int_mm` for the gate/up projection (its rows are the normed hidden states, rounded to
  int8 with little loss) and `dequant` for the down projection (its rows, the gated activations, have the outliers
  that one scale per row rounds badly).

Which kernel is faster at which row count is the host's fact: `kernel_rows` (the row count from which each kernel
runs) is the plan's `cpu_weights.kernel_rows` (`autotune search` takes it from
the profile's kernel records, `autotune.costing.kernel_choice.kernel_rows`, and its fidelity gate decides) or, without
it, the defaults below (measured on the Linux x86-64 host by scripts/bench_moe_layer.py --cpu-weights).
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from collections import Counter

import torch
import torch.nn.functional as F

from runtime.backends.protocol import gated_activation
from runtime.errors import NpumoeError
from runtime.plan import CPU_KERNELS

KINDS = ("bf16", "int8", "int4")
KERNELS = CPU_KERNELS  # each storage's (the names a plan's cpu_weights.kernel_rows uses)
# A kernel that rounds the rows too, and the one that replaces it where the gate refuses it (rounding fewer rows).
ROUNDING_FALLBACK = {"int_mm": "int_mm_gate_up", "int_mm_gate_up": "dequant"}
INT4_GROUPS = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu takes
# The row count from which each kernel runs (the one of the largest threshold at or under a call's rows), measured
# on this Linux x86-64 host (AMX) by scripts/bench_moe_layer.py --cpu-weights: int8 packed for decode and spills,
# dequant from 16 rows per expert (0.66-0.79x bf16 at a 512-token layer). The kernels that round the rows too are
# faster there (int_mm 1.1-1.3x, int_mm_gate_up 0.85x) but cost accuracy: tiny-moe's all-CPU int8 plan measured
# top-1 0.9871 with int_mm and 0.9888 with int_mm_gate_up at chunk 256, against the gate's 0.99 (dequant 0.9919;
# at chunk 1024 int_mm_gate_up 0.9915, int_mm 0.9851), so they run only where a plan sets them (`autotune search`
# sets the profile's fastest, and the gate keeps each only where it passes). int4 packed at every row count
# (0.26-0.33x bf16: torch's int4 CPU kernel does not use AMX, and dequantizing 4M weights in eager torch costs 4x
# the matmul).
KERNEL_ROWS = {"int8": {"packed": 0, "dequant": 16}, "int4": {"packed": 0}}
_SCRATCH = threading.local()  # per thread (a server prefills on one thread while it decodes on another)


def scratch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """This thread's buffer of `shape` and `dtype` for one expert's matrix at full width, reused call after call
    (one per shape: a few MB). A fresh one is above the mmap threshold the quantized runtime sets
    (`runtime.cpu.allocator.return_temporaries_to_the_os`), so glibc maps it anew and faulting its pages in cost more
    than the conversion itself: a 4096 x 1024 int8 matrix to bf16 took 4.0-4.5 ms into a new tensor,
    0.9 ms into this."""
    bufs = _SCRATCH.__dict__.setdefault("bufs", {})
    key = (tuple(shape), dtype)
    if key not in bufs:
        bufs[key] = torch.empty(shape, dtype=dtype)
    return bufs[key]


def _int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> int8 codes and one fp32 scale per output row (symmetric)."""
    w = w.float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def _int4_codes(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> codes 0..15 (int32) and [K / group, N, 2] (scale, zero) with w = (q - 8) * scale + zero."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous()


@dataclasses.dataclass(frozen=True)
class Int4Layout:
    """torch's CPU int4 layout, which depends on the CPU its kernel was dispatched for (aten's int4mm_kernel.cpp):
    bytes [N / block, K, block / 2]; byte j of a block holds rows j and j + block / 2 (`paired` False: AVX-512's
    block of 64, AVX2's of 32) or rows 2j and 2j + 1 (`paired` True: the non-vectorized path, e.g. Arm's, whose
    block is four float vectors)."""

    block: int
    paired: bool

    def unpack(self, packed: torch.Tensor, n: int, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Packed bytes back to codes [N, K] (into `out`, converted as written, where given)."""
        b = packed.reshape(n // self.block, k, self.block // 2)
        out = torch.empty((n, k), dtype=torch.uint8) if out is None else out
        rows = out.view(n // self.block, self.block // 2, 2, k) if self.paired else \
            out.view(n // self.block, 2, self.block // 2, k).transpose(1, 2)
        rows[:, :, 0].copy_((b & 15).transpose(1, 2))
        rows[:, :, 1].copy_((b >> 4).transpose(1, 2))
        return out


# The layouts aten writes: AVX-512, AVX2, the non-vectorized path on x86 (8-float vectors) and on Arm (4-float).
INT4_LAYOUTS = (Int4Layout(64, False), Int4Layout(32, False), Int4Layout(32, True), Int4Layout(16, True))


@functools.cache
def int4_layout() -> Int4Layout | None:
    """This process's CPU int4 layout, found by packing known codes and reading them back; None where no layout
    this runtime knows reads them back."""
    q = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    except RuntimeError:
        return None
    if packed.numel() * 2 != q.numel():
        return None
    return next((lay for lay in INT4_LAYOUTS if torch.equal(lay.unpack(packed, *q.shape).to(torch.int32), q)), None)


class QuantizedCpuExperts(torch.nn.Module):
    """A layer's experts as `int8` or `int4` (module docstring), made from the fused `gate_up [E, 2F, H]` and
    `down [E, H, F]` one expert at a time (the caller may free each full-width expert as it goes)."""

    def __init__(self, kind: str, experts: int, hidden: int, ffn: int, group_size: int = 64,
                 kernel_rows: dict[str, int] | None = None) -> None:
        super().__init__()
        if kind not in ("int8", "int4"):
            raise NpumoeError(f"cpu weights {kind!r}: choose from {', '.join(KINDS)}")
        if kind == "int4":
            if group_size not in INT4_GROUPS:
                raise NpumoeError(f"int4 group size {group_size}: choose from {', '.join(map(str, INT4_GROUPS))}")
            self.layout = layout = int4_layout()
            if layout is None:
                raise NpumoeError("int4 experts: this torch build's CPU int4 layout is not one this runtime reads")
            if hidden % group_size or ffn % group_size or hidden % layout.block or (2 * ffn) % layout.block:
                raise NpumoeError(f"int4 experts need hidden {hidden} and FFN {ffn} divisible by the group "
                                  f"{group_size} and by {layout.block}")
        self.kind, self.group_size = kind, group_size
        self.kernel_rows = dict(KERNEL_ROWS[kind] if kernel_rows is None else kernel_rows)
        self.calls: Counter[str] = Counter()  # expert calls per kernel run (what ran, for reports and tests)
        self.shapes = ((2 * ffn, hidden), (hidden, ffn))
        codes = torch.int8 if kind == "int8" else torch.uint8
        for name, (n, k) in zip(("gate_up", "down"), self.shapes):
            self.register_buffer(f"{name}_q", torch.empty(experts, n, k if kind == "int8" else k // 2, dtype=codes))
            aux = (experts, n) if kind == "int8" else (experts, k // group_size, n, 2)
            self.register_buffer(f"{name}_s", torch.empty(aux, dtype=torch.float32))

    def set_expert(self, e: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        for name, w in (("gate_up", gate_up), ("down", down)):
            if self.kind == "int8":
                q, s = _int8(w)
            else:
                codes, s = _int4_codes(w, self.group_size)
                q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            getattr(self, f"{name}_q")[e].copy_(q)
            getattr(self, f"{name}_s")[e].copy_(s)

    def _full(self, name: str, e: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """Expert `e`'s matrix `name` at full width in `dtype` (int4: written into `out` where given)."""
        q, s = getattr(self, f"{name}_q")[e], getattr(self, f"{name}_s")[e]
        if self.kind == "int8":
            return (q.to(torch.float32) * s[:, None]).to(dtype)
        # one pass into the output in `dtype`: codes converted as unpacked, then w = q * scale + (zero - 8 * scale)
        n, k = self.shapes[0 if name == "gate_up" else 1]
        w = self.layout.unpack(q, n, k, torch.empty((n, k), dtype=dtype) if out is None else out)
        scale, zero = s[..., 0].T, s[..., 1].T  # [N, K / group]
        groups = w.view(n, k // self.group_size, self.group_size)
        return groups.mul_(scale.to(dtype)[..., None]).add_((zero - 8 * scale).to(dtype)[..., None]).view(n, k)

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `e`'s (gate_up, down) at full width in `dtype`."""
        return self._full("gate_up", e, dtype), self._full("down", e, dtype)

    def kernel(self, rows: int) -> str:
        """The kernel a call of `rows` rows runs: the one of the largest `kernel_rows` threshold at or under it."""
        return max((k for k, r in self.kernel_rows.items() if r <= rows), key=self.kernel_rows.__getitem__)

    def _mm(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        q, s = getattr(self, f"{name}_q")[e], getattr(self, f"{name}_s")[e]
        if self.kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, q, s.to(x.dtype))
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, q, self.group_size, s.to(x.dtype))

    def _int_mm(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """int8 rows (one symmetric scale per row) times the int8 codes, int32 sums scaled back to x's dtype."""
        xf = x.float()
        xs = (xf.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
        xq = torch.round(xf / xs).to(torch.int8)
        y = torch._int_mm(xq, getattr(self, f"{name}_q")[e].t()).float()
        return (y.mul_(xs).mul_(getattr(self, f"{name}_s")[e])).to(x.dtype)

    def _dequant_mm(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """Rows `x` times expert `e`'s int8 matrix `name`: its codes cast to x's dtype in this thread's scratch, one
        matmul, the output scaled per channel."""
        q = getattr(self, f"{name}_q")[e]
        return F.linear(x, scratch(q.shape, x.dtype).copy_(q)) * getattr(self, f"{name}_s")[e].to(x.dtype)

    def ffn(self, module: torch.nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e`'s gated FFN of rows `x`, by the kernel for its row count."""
        kernel = self.kernel(x.shape[0])
        self.calls[kernel] += 1
        if kernel in ("int_mm", "int_mm_gate_up"):
            h = gated_activation(module, self._int_mm("gate_up", e, x))
            return self._int_mm("down", e, h) if kernel == "int_mm" else self._dequant_mm("down", e, h)
        if kernel == "dequant" and self.kind == "int8":
            return self._dequant_mm("down", e, gated_activation(module, self._dequant_mm("gate_up", e, x)))
        if kernel == "dequant":
            gate_up, down = (self._full(name, e, x.dtype, scratch(shape, x.dtype))
                             for name, shape in zip(("gate_up", "down"), self.shapes))
            return F.linear(gated_activation(module, F.linear(x, gate_up)), down)
        return self._mm("down", e, gated_activation(module, self._mm("gate_up", e, x)).contiguous())

    def stored_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


def fallback_kernel_rows(kernel_rows: dict[str, int]) -> dict[str, int] | None:
    """`kernel_rows` with each kernel that rounds the rows too replaced by its `ROUNDING_FALLBACK` (one step: it
    rounds fewer) from the same row count (a kernel already running below keeps its start); None where no such
    kernel runs."""
    if not any(k in ROUNDING_FALLBACK for k in kernel_rows):
        return None
    out: dict[str, int] = {}
    for kernel, rows in sorted(kernel_rows.items(), key=lambda kv: kv[1]):
        out.setdefault(ROUNDING_FALLBACK.get(kernel, kernel), rows)
    return out


def kernel_calls(stores) -> dict[str, int]:
    """Expert calls per kernel summed over `stores` (QuantizedCpuExperts) since they were made."""
    return dict(sum((s.calls for s in stores), Counter()))


def quantized_store(module: torch.nn.Module, kind: str, group_size: int = 64,
                    kernel_rows: dict[str, int] | None = None) -> QuantizedCpuExperts:
    """A fused experts module's weights as `kind` storage, quantized one expert at a time; the module is left as it
    is; `kernel_rows`: the plan's (None: the defaults)."""
    with torch.no_grad():
        store = QuantizedCpuExperts(kind, module.num_experts, module.hidden_dim, module.intermediate_dim, group_size,
                                    kernel_rows)
        for e in range(module.num_experts):
            store.set_expert(e, module.gate_up_proj[e], module.down_proj[e])
    return store


def quantize_experts(module: torch.nn.Module, kind: str, group_size: int = 64,
                     kernel_rows: dict[str, int] | None = None) -> None:
    """Replace a fused experts module's full-width `gate_up_proj` / `down_proj` by `kind` storage
    (`quantized_store`: `module.npumoe_weights`, which the exact path runs)."""
    store = quantized_store(module, kind, group_size, kernel_rows)
    del module.gate_up_proj, module.down_proj
    module.npumoe_weights = store
