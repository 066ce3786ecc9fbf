"""Packed affine weights (runtime/cpu/quantized.py) against mlx's own quantize/dequantize, every width and group
size."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.cpu.cpu_weights import INT4_LAYOUTS
from runtime.cpu.quantized import BITS, GROUP_SIZES, check_format, check_packed, dequantize
from runtime.errors import NpumoeError

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


def _aten_int4_pack(q: torch.Tensor, block: int, paired: bool) -> torch.Tensor:
    """Codes [N, K] packed as aten's weight_to_int4pack_kernel writes them for one CPU (its comments' formats)."""
    n, k = q.shape
    rows = q.reshape(n // block, block, k)
    if paired:  # non-vectorized: adjacent rows share a byte
        low, high = rows[:, 0::2], rows[:, 1::2]
    else:  # AVX-512 / AVX2: row j with row j + block / 2
        low, high = rows[:, : block // 2], rows[:, block // 2:]
    return ((high << 4) | low).transpose(1, 2).to(torch.uint8).reshape(n, k // 2)


@pytest.mark.parametrize("block,paired", [(lay.block, lay.paired) for lay in INT4_LAYOUTS])
def test_every_cpus_int4_layout_reads_back(block, paired):
    """The int4 layout of each CPU torch's kernel is built for reads back to its codes (an AVX2 host's, block 32,
    was refused before: int4 experts did not load there at all), and this host's is one of them."""
    from runtime.cpu.cpu_weights import Int4Layout, int4_layout

    q = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(block))
    assert torch.equal(Int4Layout(block, paired).unpack(_aten_int4_pack(q, block, paired), 128, 64).to(torch.int32), q)
    assert not torch.equal(Int4Layout(block, not paired).unpack(_aten_int4_pack(q, block, paired), 128, 64)
                           .to(torch.int32), q)
    here = int4_layout()
    assert here is not None
    assert torch.equal(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1),
                       _aten_int4_pack(q, here.block, here.paired))


@pytest.mark.parametrize("kind,bound", [("int8", 0.03), ("int4", 0.3)])
def test_cpu_experts_kernels_agree(kind, bound):
    """packed and dequant compute the same quantized expert, int_mm and int_mm_gate_up within their rows' rounding
    (int_mm_gate_up's, of the gate/up projection's rows only, less than int_mm's); against the full-width expert,
    the quantization error."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from runtime.backends.protocol import expert_ffn
    from runtime.cpu.cpu_weights import quantize_experts

    module = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=4,
                                            num_experts_per_tok=2))
    torch.manual_seed(0)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.02)
        module.down_proj.normal_(0, 0.02)
    x = torch.randn(32, 256)
    full = [expert_ffn(module, e, x) for e in range(4)]
    quantize_experts(module, kind, 64)
    store = module.npumoe_weights
    assert not hasattr(module, "gate_up_proj") and store.stored_bytes() < 4 * 3 * 256 * 128 * 2 / 1.5
    assert store.kernel(1) == "packed" and store.kernel(64) == ("dequant" if kind == "int8" else "packed")
    for e in range(4):
        store.kernel_rows = {"packed": 0}
        packed = expert_ffn(module, e, x)
        store.kernel_rows = {"dequant": 0}
        dequant = expert_ffn(module, e, x)
        assert float((packed - dequant).abs().max() / dequant.abs().max()) < 1e-4
        err = float((packed - full[e]).abs().max() / full[e].abs().max())
        assert 0 < err < bound
        if kind == "int8":  # the rows quantized too: their rounding on top of the weights'
            rounded = {}
            for kernel in ("int_mm", "int_mm_gate_up"):
                store.kernel_rows = {kernel: 0}
                out = expert_ffn(module, e, x)
                rounded[kernel] = float((out - dequant).abs().max() / dequant.abs().max())
                assert float((out - full[e]).abs().max() / full[e].abs().max()) < bound
            assert 1e-4 < rounded["int_mm_gate_up"] < rounded["int_mm"] < 0.03, rounded  # int_mm measured 0.020


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantize_at_load_runs_a_plan(kind):
    from runtime import generation
    from runtime.loading.model_loader import load_model, model_spec
    from runtime.plan import LayerPlan, Plan

    reference, tok = load_model("tiny-moe", "auto")
    model, _ = load_model("tiny-moe", "auto", cpu_weights=kind)
    spec = model_spec(model)
    assert spec == model_spec(reference)  # the routers are left whole: plans for the model fit
    plan = Plan(model=spec, chunk_tokens=64, overflow="drop", saliency="router_weight",
                layers=[LayerPlan(layer=l, groups=[], cpu_exact=list(range(spec.num_experts)))
                        for l in spec.moe_layers])
    loaded = generation.load("tiny-moe", plan, cpu_weights=kind)
    ids = torch.tensor([tok.encode("def parse(path):\n    with open(path) as f:\n        return f.read()\n" * 3)])
    with torch.inference_mode():
        ours, ref = loaded.model(ids).logits[0].float(), reference(ids).logits[0].float()
    agree = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    assert agree >= (0.9 if kind == "int8" else 0.6), agree


def test_quantized_linear_in_blocks_equals_the_whole_weight(monkeypatch):
    """A large packed matrix (a vocabulary head) runs in blocks of output rows, each written into the output in
    place: the same values as the whole dequantized weight, bias included."""
    import runtime.cpu.quantized as q

    torch.manual_seed(0)
    packed = torch.randint(-2**31, 2**31 - 1, (300, 256 * 4 // 32), dtype=torch.int32)
    weight = q.PackedWeight(packed, torch.rand(300, 4) * 0.01, torch.randn(300, 4) * 0.01, 4, 64)
    bias = torch.randn(300)
    x = torch.randn(2, 5, 256)
    whole = torch.nn.functional.linear(x, weight.full(x.dtype), bias)
    monkeypatch.setattr(q, "BLOCK_WEIGHTS", 64 * 256)  # blocks of 64 rows: 5 blocks, the last one of 44
    assert torch.equal(q.QuantizedLinear(weight, bias)(x), whole)


def test_dequant_converts_into_one_reused_buffer_per_thread():
    """The dequant kernel casts an expert's codes into this thread's scratch (a new tensor is mapped anew, its
    pages faulted in: 2.1-2.4x the FFN's time at the Qwen3 shape, measured); the same result as a fresh cast, one
    buffer per shape and thread."""
    import threading

    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from runtime.backends.protocol import gated_activation
    from runtime.cpu.cpu_weights import quantize_experts, scratch

    module = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=2,
                                            num_experts_per_tok=1))
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.02)
        module.down_proj.normal_(0, 0.02)
    quantize_experts(module, "int8", 64)
    store, x = module.npumoe_weights, torch.randn(32, 256)
    store.kernel_rows = {"dequant": 0}
    for e in (0, 1):
        got = store.ffn(module, e, x)
        h = torch.nn.functional.linear(x, store.gate_up_q[e].float()) * store.gate_up_s[e]
        want = torch.nn.functional.linear(gated_activation(module, h), store.down_q[e].float()) * store.down_s[e]
        assert float((got - want).abs().max() / want.abs().max()) < 1e-6  # a cast: fp32 sums alone differ
    mine = scratch(tuple(store.gate_up_q[0].shape), torch.float32)
    assert scratch(tuple(store.gate_up_q[1].shape), torch.float32) is mine  # reused, expert after expert
    other = []
    t = threading.Thread(target=lambda: other.append(scratch(tuple(store.gate_up_q[0].shape), torch.float32)))
    t.start()
    t.join()
    assert other[0] is not mine


def test_quantized_linear_of_no_rows_dequantizes_nothing(monkeypatch):
    """A prefill chunk before the last asks the head for no rows: its packed weight is not dequantized."""
    import runtime.cpu.quantized as q

    def dequantize(*args, **kwargs):
        raise AssertionError("dequantized for no rows")

    weight = q.PackedWeight(torch.zeros(300, 256 * 4 // 32, dtype=torch.int32), torch.ones(300, 4),
                            torch.zeros(300, 4), 4, 64)
    monkeypatch.setattr(q, "dequantize", dequantize)
    out = q.QuantizedLinear(weight)(torch.ones(1, 0, 256, dtype=torch.bfloat16))
    assert out.shape == (1, 0, 300) and out.dtype == torch.bfloat16
