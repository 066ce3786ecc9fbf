"""Packed affine weights (runtime/quantized.py) against mlx's own quantize/dequantize, every width and group size."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.errors import NpumoeError
from runtime.quantized import BITS, GROUP_SIZES, check_format, check_packed, dequantize

mx = pytest.importorskip("mlx.core")


def _torch(a) -> torch.Tensor:
    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a).view(np.int32))
    return torch.from_numpy(np.array(a.astype(mx.float32))).to(torch.bfloat16)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUP_SIZES)
def test_dequantize_is_mlx_exactly(bits, group):
    mx.random.seed(bits * 1000 + group)
    w = mx.random.normal((3, 8, 256)).astype(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    ref = np.array(mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits))
    ours = dequantize(_torch(q), _torch(s), _torch(b), bits).numpy()
    assert ours.shape == ref.shape
    assert np.array_equal(ours, ref)


def test_formats_refused_by_name():
    with pytest.raises(NpumoeError, match="^x.q: quantization mode 'mxfp4'"):
        check_format("x.q", 4, 32, "mxfp4")
    with pytest.raises(NpumoeError, match="^x.q: 7-bit"):
        check_format("x.q", 7, 64)
    with pytest.raises(NpumoeError, match="^x.q: quantization group size 16"):
        check_format("x.q", 4, 16)
    with pytest.raises(NpumoeError, match=r"^x.weight: packed shape \[8, 31\]"):
        check_packed("x.weight", [8, 31], [8, 4], [8, 4], 256, 4, 64)
    with pytest.raises(NpumoeError, match=r"^x.weight: scales of shape \[8, 2\]"):
        check_packed("x.weight", [8, 32], [8, 2], [8, 4], 256, 4, 64)
    with pytest.raises(NpumoeError, match="^x.weight: quantized weight without its x.biases"):
        check_packed("x.weight", [8, 32], [8, 4], None, 256, 4, 64)
