"""The dense ops' prices (autotune/costing/dense_prices.py) as profile-device's records fit them
(autotune/profiling/dense_records.py), and a run's experts priced from its own routing
(autotune/evaluation/run_parts.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import apple_like

from autotune.costing.costmodel import BackendModel
from autotune.costing.dense_prices import attention_work, fit_dense, fresh_mb, matmul_work, record_ms, record_work
from autotune.costing.whole_prefill import DecoderShape
from autotune.evaluation.run_parts import routed_experts
from autotune.profiling.dense_records import DenseShape, attention_call
from autotune.profiling.settings import settings_for
from autotune.profiling.timing import time_in_forward
from runtime.plan import LayerPlan

# Two head shapes: tiny-moe's (4 heads of 64, 2 KV heads) and twice the heads at twice the width.
SHAPES = (DenseShape(256, 4, 2, 64, 16, 4096), DenseShape(1024, 8, 2, 128, 16, 4096))
POINTS = ((128, 128), (256, 256), (512, 512), (1024, 1024), (128, 512), (128, 1024), (256, 1024), (512, 1024))
HELD = ((512, 512), (256, 1024))  # a first chunk (causal) and a later one (masked), held out at each shape


def _record(shape: DenseShape, rows: int, context: int, ms: float | None = None) -> dict:
    rec = {"kind": "attention", "rows": rows, "context": context, "heads": shape.heads, "kv_heads": shape.kv_heads,
           "head_dim": shape.head_dim, "backend": "cpu-exact", "dtype_bytes": 4}
    return {**rec, "median_ms": ms} if ms is not None else rec


def test_the_attention_fit_keeps_head_shapes_apart():
    """Records of one head shape running at half the other's rate: the held-out points of each are predicted from
    their own shape (the residual's head-shape axis), not from the other's."""
    recs = []
    for shape, ms_per_gflop in zip(SHAPES, (10.0, 20.0)):
        for rows, context in POINTS:
            g, mb, _, _ = attention_work(rows, context, shape.heads, shape.kv_heads, shape.head_dim, 4, sdpa=True)
            recs.append(_record(shape, rows, context, float(ms_per_gflop * g + 0.01 * mb)))
    held = [r for r in recs if (r["rows"], r["context"]) in HELD]
    fit = fit_dense([r for r in recs if r not in held])["attention"]
    errors = [abs(record_ms(fit, r) / r["median_ms"] - 1) for r in held]
    assert max(errors) < 0.05, errors
    fit.residual = None  # the linear form alone, shared by both shapes, cannot tell them apart
    assert max(abs(record_ms(fit, r) / r["median_ms"] - 1) for r in held) > 0.2


def test_measured_attention_fit_predicts_held_out_points_of_two_head_shapes():
    """This host's attention core as profile-device times it (rope, the KV cache's update, sdpa as a run
    dispatches it), at two head shapes: a fit on the other points predicts the held-out ones. Measured on the
    shared 2-core host: held-out MAPE 10.9% and 12.4% (worst point 21.5%); the bound leaves room for its load."""
    torch.set_num_threads(1)
    s = settings_for(True)
    with torch.inference_mode():
        recs = [{**_record(shape, r, c), **time_in_forward(attention_call(shape, r, c), s)}
                for shape in SHAPES for r, c in POINTS]
    held = [r for r in recs if (r["rows"], r["context"]) in HELD]
    fit = fit_dense([r for r in recs if r not in held])["attention"]
    errors = [abs(record_ms(fit, r) / r["median_ms"] - 1) for r in held]
    assert fit.source.startswith("measured") and np.mean(errors) < 0.25, errors


def test_causal_first_chunks_and_masked_later_ones_price_the_work_sdpa_does():
    # a chunk with nothing cached runs sdpa's causal kernel: half the block; a later chunk the whole block
    first, later = (attention_work(1024, c, 32, 4, 128, 4, sdpa=True)[0] for c in (1024, 2048))
    assert later == pytest.approx(4 * first)
    static = attention_work(1024, 1024, 32, 4, 128, 2)[0]  # a static function computes its whole padded block
    assert static == pytest.approx(2 * first)


def test_a_kernel_that_skips_past_the_diagonal_prices_a_later_chunk_causal():
    """MLX's sdpa on Metal (`skips`) stops each query block at its diagonal, the chunk's offset counted: 1,024 queries
    after 1,024 cached keys compute 1,024 x 1,024 + 1,024^2 / 2 scores, three quarters of the whole block, and no
    float mask; a first chunk is the causal half either way. On the published profile MLX (the GPU) prices it so,
    the CPU's torch sdpa does not."""
    whole = 4.0 * 1024 * 2048 * 32 * 128 / 1e9
    later, masked = (attention_work(1024, 2048, 32, 4, 128, 2, sdpa=True, skips=s) for s in (True, False))
    assert later[0] == pytest.approx(0.75 * whole) and masked[0] == pytest.approx(whole)
    assert later[1] < masked[1]  # no mask written and read, k and v not repeated
    assert attention_work(1024, 1024, 32, 4, 128, 2, sdpa=True, skips=True)[0] == pytest.approx(
        attention_work(1024, 1024, 32, 4, 128, 2, sdpa=True)[0])
    from autotune.profiling.profile import load_profile

    cost = load_profile("apple-m2-ultra-published").cost_model
    mlx = [float(cost.attention_ms("mlx-exact", 2048, c, 32, 4, 128)) for c in (2048, 4096)]
    cpu = [float(cost.attention_ms("cpu-exact", 2048, c, 32, 4, 128)) for c in (2048, 4096)]
    assert mlx[1] < 3.1 * mlx[0] and cpu[1] > 3.5 * cpu[0]  # 3x the work (1.5 / 0.5), against 4x


def test_only_buffers_glibc_maps_anew_count_as_fresh():
    assert fresh_mb(32 * 2**20 - 4) == 0.0 and fresh_mb(32 * 2**20) == pytest.approx(32 * 2**20 / 1e6)
    # 2048 rows of tiny-moe's 4096 logits in fp32 are 32 MiB: fresh; 1024 rows are not
    assert matmul_work(2048, 4096, 256, 4)[3] > 0 and matmul_work(1024, 4096, 256, 4)[3] == 0
    rec = {"kind": "dense_matmul", "m": 2048, "n": 4096, "k": 256}
    assert record_work(rec)[3] == pytest.approx(2048 * 4096 * 4 / 1e6)


def test_a_runs_experts_are_priced_from_its_own_routing():
    cost = apple_like()
    shape = DecoderShape(hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=100, num_layers=2, moe_layers=(0, 1),
                         num_experts=4, top_k=2, expert_ffn=32)
    plan = type("P", (), {"layers": [LayerPlan(layer=i, groups=[], cpu_exact=[0, 1, 2, 3]) for i in (0, 1)],
                          "exact_below": 2, "overflow": "drop", "exact_path": "cpu-exact"})()
    hot = np.array([64, 0, 0, 0])  # one chunk of 32 tokens, every one on expert 0 (twice: top-2 counts)
    spread = np.array([16, 16, 16, 16])
    routing = {0: [hot, spread], 1: [spread, spread]}
    figures = routed_experts(cost, plan, shape, routing)
    assert len(figures) == 2
    for chunk, counts in enumerate(([hot, spread], [spread, spread])):
        want = sum(cost.exact_ms(c, 64, 32) for c in counts)
        assert figures[chunk].latency_ms == pytest.approx(want)
    assert figures[0].latency_ms != pytest.approx(figures[1].latency_ms)  # the routing, not a mean per chunk
    # a plan whose exact path is another lane is priced on that lane (mlx-exact here: every term twice the CPU's)
    cost.models["mlx-exact"] = BackendModel("mlx-exact", 0.02, 0.01, 1.2, 0.0, 2, False, None)
    plan.exact_path = "mlx-exact"
    on_mlx = routed_experts(cost, plan, shape, routing)
    assert [f.latency_ms for f in on_mlx] == pytest.approx([2 * f.latency_ms for f in figures])


def test_a_runs_parts_are_each_parts_median_over_its_repeats(monkeypatch):
    from contextlib import contextmanager
    from statistics import median

    from autotune.evaluation import run_parts
    from runtime.loading.model_loader import load_model

    model, _ = load_model("tiny-moe", "float32")
    seen, calls = [], []
    real = run_parts.measured_parts

    @contextmanager
    def spied(m, clock):
        with real(m, clock) as times:
            yield times
        seen.append(times.parts_ms())

    monkeypatch.setattr(run_parts, "measured_parts", spied)
    ids = torch.arange(10, 138).unsqueeze(0)

    def prefill():
        calls.append(1)
        with torch.inference_mode():
            model(input_ids=ids, logits_to_keep=1)

    parts, routing = run_parts.measure_parts(model, prefill, False, 128, repeat=3)
    assert len(calls) == len(seen) == 3
    for part in ("attention_core", "experts", "lm_head"):
        assert parts[part] == median(run[part] for run in seen)
    assert all(len(chunks) == 1 for chunks in routing.values())  # the first run's routing alone: one chunk each
