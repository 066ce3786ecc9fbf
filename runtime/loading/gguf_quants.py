"""llama.cpp's quantized blocks as mlx's affine groups of 32 (`runtime.cpu.quantized`: codes in uint32 words along
the input dimension, w = scale * q + bias per group), decoded from the block bytes with numpy.

Exact maps (the codes are llama.cpp's own, the group's scale and bias the products its dequantizer forms):
- Q8_0 (d, signed 8-bit):       scale d,        bias -128 d (codes q + 128)
- Q4_0 / Q5_0 (d, offset 8/16):  scale d,        bias -8 d / -16 d
- Q4_1 / Q5_1 (d, m):            scale d,        bias m
- Q4_K / Q5_K (256-value super-blocks of eight 32-value sub-blocks, 6-bit sc and mn under fp16 d and dmin):
                                 scale d * sc,   bias -dmin * mn
Scales and biases are held in fp16 as mlx holds them: exact for the first four rows (an fp16 times a power of two);
the K-quants' products of an fp16 and a 6-bit integer may round, and `Converted.fp16_rounding` measures by how much.
Every other type (Q6_K's 16-value groups, Q2_K, Q3_K, IQ*, ...) is dequantized by the `gguf` package and quantized
again to 8-bit groups of 32, its error measured the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32
REQUANT_BITS = 8  # the nearest affine format for types that do not map exactly: the widest one we run
HALF_WIDTHS = {"F32": np.float32, "F16": np.float16, "BF16": None}  # stored whole (BF16 read bit by bit)


@dataclass
class Converted:
    """One tensor (or one expert of it) in the affine format: `packed` uint32 [rows, n * bits / 32], `scales` and
    `biases` fp16 [rows, n / 32]; `fp16_rounding`: the largest change fp16 scales and biases make to a weight,
    relative to the tensor's largest weight; `requant_error`: the same for a type that does not map exactly."""
    packed: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    fp16_rounding: float = 0.0
    requant_error: float = 0.0

    def finite(self) -> bool:
        """Its scales and biases are numbers: a block whose fp16 factors are NaN or inf (or overflow fp16 once
        formed) makes every weight of its group one; the codes need no check (any code is a weight)."""
        return bool(np.isfinite(self.scales).all() and np.isfinite(self.biases).all())


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    """[rows, row_bytes] uint8 -> [rows, blocks, block_bytes]."""
    return data.reshape(data.shape[0], -1, block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per entry (last axis) as fp16 widened to float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-value nibble layout: value j in qs[j] & 15, value j + 16 in qs[j] >> 4."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 fifth bits (a little-endian uint32 per block) as 0/16 per value."""
    word = np.ascontiguousarray(qh).view(np.uint32)[..., 0]
    return (((word[..., None] >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _q8_0(b):
    d = _f16(b[..., 0:2])
    return (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128 * d, 8


def _q4_0(b):
    d = _f16(b[..., 0:2])
    return _nibbles(b[..., 2:18]), d, -8 * d, 4


def _q4_1(b):
    return _nibbles(b[..., 4:20]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 4


def _q5_0(b):
    d = _f16(b[..., 0:2])
    return _nibbles(b[..., 6:22]) | _high_bits(b[..., 2:6]), d, -16 * d, 5


def _q5_1(b):
    return _nibbles(b[..., 8:24]) | _high_bits(b[..., 4:8]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 5


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's `get_scale_min_k4` for the eight sub-blocks: 12 bytes -> (sc, mn) [..., 8], 6 bits each."""
    s = s.astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes -> 256 4-bit values: 64-value chunk j holds sub-block 2j in its bytes' low nibbles and
    sub-block 2j + 1 in their high ones."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([chunks & 15, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _k_affine(b: np.ndarray, codes: np.ndarray) -> tuple:
    """A K-quant super-block's codes [rows, blocks, 256] with per-sub-block scale d * sc and bias -dmin * mn."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    return codes, d[..., None] * sc, -(dmin[..., None] * mn), None


def _q4_k(b):
    codes, scale, bias, _ = _k_affine(b, _k_low(b[..., 16:144]))
    return codes, scale, bias, 4


def _q5_k(b):
    qh = b[..., 16:48]  # bit 2j of qh[l] is value l's fifth bit in sub-block 2j, bit 2j + 1 in sub-block 2j + 1
    high = ((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4  # [..., 8 sub-blocks, 32]
    codes = _k_low(b[..., 48:176]) | high.reshape(*qh.shape[:-1], 256)
    codes, scale, bias, _ = _k_affine(b, codes)
    return codes, scale, bias, 5


# type name -> (block bytes, decoder: blocks -> (codes [rows, blocks, values], scale, bias [rows, blocks, groups]))
EXACT = {"Q8_0": (34, _q8_0), "Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1), "Q5_0": (22, _q5_0), "Q5_1": (24, _q5_1),
         "Q4_K": (144, _q4_k), "Q5_K": (176, _q5_k)}
EXACT_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5}


def held_bits(type_name: str) -> int | None:
    """The code width a tensor of `type_name` is held at (None: held whole, at the model's dtype)."""
    return None if type_name in HALF_WIDTHS else EXACT_BITS.get(type_name, REQUANT_BITS)


def held_bytes(type_name: str, numel: int, dtype_bytes: int) -> int:
    """Bytes a tensor of `numel` values of `type_name` takes as this reader holds it: codes and fp16 scales and
    biases per group of 32, or whole at `dtype_bytes`."""
    bits = held_bits(type_name)
    return numel * dtype_bytes if bits is None else numel * bits // 8 + numel // GROUP * 4


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [rows, n] (uint8, < 2**bits) -> uint32 words [rows, n * bits / 32], least significant first, widths
    that do not divide 32 running on across words (mlx's little-endian bit stream)."""
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    if bits == 8:
        return codes.view(np.uint32)
    if bits == 4:
        return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.uint32)
    stream = ((codes[..., None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(codes.shape[0], -1)
    return np.packbits(stream, axis=-1, bitorder="little").view(np.uint32)


def _fp16_pair(scale: np.ndarray, bias: np.ndarray, codes: np.ndarray, peak: float) -> tuple:
    """Scales and biases in fp16, with the largest change that makes to a weight (relative to `peak`)."""
    s16, b16 = scale.astype(np.float16), bias.astype(np.float16)
    ds, db = s16.astype(np.float32) - scale, b16.astype(np.float32) - bias
    if not ds.any() and not db.any():
        return s16, b16, 0.0
    err = np.abs(codes.reshape(*ds.shape, -1) * ds[..., None] + db[..., None]).max()
    return s16, b16, float(err / peak) if peak else 0.0


def convert_exact(data: np.ndarray, type_name: str) -> Converted:
    """Rows of blocks of an exactly mapped type ([rows, row_bytes] uint8) in the affine format."""
    block_bytes, decode = EXACT[type_name]
    codes, scale, bias, bits = decode(_blocks(data, block_bytes))
    rows = data.shape[0]
    codes = codes.reshape(rows, -1)
    scale, bias = scale.reshape(rows, -1), bias.reshape(rows, -1)
    groups = codes.reshape(rows, scale.shape[1], GROUP).astype(np.float32)
    peak = float(np.abs(groups * scale[..., None] + bias[..., None]).max())
    s16, b16, rounding = _fp16_pair(scale, bias, codes, peak)
    return Converted(pack_codes(codes, bits), s16, b16, bits, fp16_rounding=rounding)


def requantize(weights: np.ndarray, bits: int = REQUANT_BITS) -> Converted:
    """Full-width rows [rows, n] (float32) quantized to `bits`-wide affine groups of 32 by rounding to nearest, the
    codes chosen against the fp16 scales and biases actually held; the error measured against `weights`."""
    rows = weights.shape[0]
    groups = weights.reshape(rows, -1, GROUP)
    low, high = groups.min(-1), groups.max(-1)
    levels = (1 << bits) - 1
    scale = np.where(high > low, (high - low) / levels, 1.0).astype(np.float16)
    bias = low.astype(np.float16)
    s32, b32 = scale.astype(np.float32)[..., None], bias.astype(np.float32)[..., None]
    codes = np.clip(np.rint((groups - b32) / s32), 0, levels)
    peak = float(np.abs(weights).max())
    err = float(np.abs(codes * s32 + b32 - groups).max() / peak) if peak else 0.0
    return Converted(pack_codes(codes.astype(np.uint8).reshape(rows, -1), bits), scale, bias, bits,
                     requant_error=err)


def bytes_per_row(type_name: str, n: int) -> int:
    """Stored bytes of one row of `n` values of a ggml type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return n // block * size
