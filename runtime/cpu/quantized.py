"""Quantized weights kept packed on the CPU: the affine group format mlx writes (`mlx_lm.convert -q`: uint32 words
holding `bits`-wide codes, little-endian and least significant first, one `scale` and `bias` per `group_size` inputs,
w = q * scale + bias), and the modules that compute with it (`QuantizedLinear`, `QuantizedEmbedding`,
`QuantizedExperts`). Each dequantizes what one call needs (a weight, the looked-up rows, one expert) and never holds
a full-width copy of the model. `runtime.loading.mlx_checkpoint` builds them; `runtime.cpu.cpu_backends` runs experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.errors import NpumoeError

BITS = (2, 3, 4, 5, 6, 8)  # the widths mlx's affine mode writes
GROUP_SIZES = (32, 64, 128)
BLOCK_WEIGHTS = 1 << 22  # weights dequantized at once by QuantizedLinear (its temporaries: about 40 MB)


def check_format(name: str, bits: int, group_size: int, mode: str = "affine") -> None:
    """Refuse, naming the module, a format this reader cannot decode."""
    if mode != "affine":
        raise NpumoeError(f"{name}: quantization mode {mode!r} is not supported (only mlx's 'affine' mode is)")
    if bits not in BITS:
        raise NpumoeError(f"{name}: {bits}-bit quantization is not supported (widths: {', '.join(map(str, BITS))})")
    if group_size not in GROUP_SIZES:
        raise NpumoeError(f"{name}: quantization group size {group_size} is not supported "
                          f"(sizes: {', '.join(map(str, GROUP_SIZES))})")


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint32 words [..., n * bits / 32] -> codes [..., n] (int32). Codes fill each word from its least significant
    bit; widths that do not divide 32 run on across words (a little-endian bit stream)."""
    words = packed.view(torch.int32)
    if 32 % bits == 0:
        per = 32 // bits
        shifts = torch.arange(0, 32, bits, dtype=torch.int32)
        codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)
    stream = packed.contiguous().view(torch.uint8)  # bytes in stream order (little-endian words)
    bit = (stream.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    bit = bit.reshape(*packed.shape[:-1], -1, bits).to(torch.uint8)
    weights = (1 << torch.arange(bits, dtype=torch.int32)).to(torch.uint8)
    return (bit * weights).sum(-1, dtype=torch.int32)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """The full-width weight [..., n] of packed codes with their per-group scales and biases [..., n / group], into
    `out` where given. Widths that divide 8 (2, 4, 8) unpack byte-wise, each code written into `out` as it is
    converted, then scaled in place: no full-width temporary, against the general path's int32 codes and their
    copies (3x faster at 4 bits; dequantizing is most of a packed model's prefill)."""
    n = packed.shape[-1] * 32 // bits
    shape = (*packed.shape[:-1], n)
    out = torch.empty(shape, dtype=dtype) if out is None else out
    groups = out.view(*scales.shape, n // scales.shape[-1])
    if 8 % bits == 0:
        per, mask = 8 // bits, (1 << bits) - 1
        stream = packed.contiguous().view(torch.uint8)  # [..., n / per]
        slots = out.view(*stream.shape, per)
        for j in range(per):  # each byte's j-th code, converted as it is written
            code = stream if per == 1 else stream & mask if j == 0 else stream >> (j * bits)
            slots[..., j].copy_(code if j in (0, per - 1) else code & mask)
    else:
        groups.copy_(unpack(packed, bits).view(groups.shape))
    return groups.mul_(scales.to(dtype).unsqueeze(-1)).add_(biases.to(dtype).unsqueeze(-1)).view(shape)


def check_packed(name: str, packed_shape: list[int], scales_shape: list[int] | None, biases_shape: list[int] | None,
                 inputs: int, bits: int, group_size: int) -> None:
    """A packed weight fits its format: `inputs` codes per row in `inputs * bits / 32` words, one scale and one bias
    per group of `group_size`. Each disagreement is one line naming the tensor."""
    if scales_shape is None or biases_shape is None:
        missing = "scales" if scales_shape is None else "biases"
        raise NpumoeError(f"{name}: quantized weight without its {name.rsplit('.', 1)[0]}.{missing}")
    words = inputs * bits / 32
    if packed_shape[-1] != words or inputs % group_size:
        raise NpumoeError(f"{name}: packed shape {packed_shape} does not fit {bits}-bit codes of {inputs} inputs in "
                          f"groups of {group_size} (expected {words:g} words per row)")
    groups = [*packed_shape[:-1], inputs // group_size]
    for kind, shape in (("scales", scales_shape), ("biases", biases_shape)):
        if list(shape) != groups:
            raise NpumoeError(f"{name}: {kind} of shape {list(shape)} for a packed weight of shape {packed_shape} "
                              f"in groups of {group_size} (expected {groups})")


class PackedWeight(torch.nn.Module):
    """One packed weight [..., out, in]: codes, scales and biases as buffers (they count in `model.buffers()`)."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
                 group_size: int) -> None:
        super().__init__()
        self.bits, self.group_size = bits, group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("biases", biases)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 32 // self.bits)

    def full(self, dtype: torch.dtype, index: int | slice | torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight at full width in `dtype`, or only `index` (rows, or experts) along its first dimension; into
        `out` (contiguous) where given."""
        if index is None:
            return dequantize(self.packed, self.scales, self.biases, self.bits, dtype, out)
        return dequantize(self.packed[index], self.scales[index], self.biases[index], self.bits, dtype, out)

    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.biases))

    def extra_repr(self) -> str:
        return f"shape={list(self.shape)}, bits={self.bits}, group_size={self.group_size}"


class QuantizedLinear(torch.nn.Module):
    """`nn.Linear` over a packed weight: dequantized per call, in the input's dtype."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight_q = weight
        self.out_features, self.in_features = weight.shape
        self.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # no rows (a prefill chunk's head before the last): nothing to dequantize
            return x.new_empty((*x.shape[:-1], self.out_features))
        rows = max(1, BLOCK_WEIGHTS // self.in_features)
        if self.out_features <= rows:
            return F.linear(x, self.weight_q.full(x.dtype), self.bias)
        # a large matrix (a vocabulary head) in blocks of output rows: dequantizing it whole would hold several
        # full-width temporaries of it at once; each block's product goes into the output in place (concatenating
        # them would hold the output twice: 0.31 GB more for a 1024-row chunk of a 152k vocabulary in bf16); each
        # block takes its slice of the bias, so the sum rounds as the whole weight's does (adding the bias after
        # the product rounds differently on some hosts: 2.4e-7 apart on an AMD EPYC)
        out = torch.empty((*x.shape[:-1], self.out_features), dtype=x.dtype)
        for a in range(0, self.out_features, rows):
            bias = None if self.bias is None else self.bias[a:a + rows]
            out[..., a:a + rows] = F.linear(x, self.weight_q.full(x.dtype, slice(a, a + rows)), bias)
        return out


def linear_weight(module: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight at full width, as a static function stores it: its own, or (an MLX checkpoint's
    `QuantizedLinear`) its packed weight dequantized in float32."""
    if isinstance(module, QuantizedLinear):
        return module.weight_q.full(torch.float32)
    return module.weight.detach()


class QuantizedEmbedding(torch.nn.Module):
    """`nn.Embedding` over a packed table: only the looked-up rows are dequantized."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype, padding_idx: int | None = None) -> None:
        super().__init__()
        self.weight_q, self.dtype, self.padding_idx = weight, dtype, padding_idx
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.weight_q.full(self.dtype, flat).reshape(*ids.shape, self.embedding_dim)


class QuantizedExperts(torch.nn.Module):
    """A layer's experts packed per projection (`gate` and `up` [E, F, H], `down` [E, H, F]): what a fused experts
    module's `gate_up_proj [E, 2F, H]` and `down_proj [E, H, F]` hold, one expert dequantized at a time."""

    def __init__(self, gate: PackedWeight, up: PackedWeight, down: PackedWeight) -> None:
        super().__init__()
        self.gate, self.up, self.down = gate, up, down

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `e`'s (gate_up [2F, H], down [H, F]) at full width in `dtype`."""
        f = self.gate.shape[-2]
        gate_up = torch.empty((2 * f, self.gate.shape[-1]), dtype=dtype)
        self.gate.full(dtype, e, gate_up[:f])
        self.up.full(dtype, e, gate_up[f:])
        return gate_up, self.down.full(dtype, e)

    def kernel(self, rows: int) -> str:
        return "dequant"  # each call dequantizes the expert it runs (in the rows' dtype)

    def stored_bytes(self) -> int:
        return self.gate.stored_bytes() + self.up.stored_bytes() + self.down.stored_bytes()
