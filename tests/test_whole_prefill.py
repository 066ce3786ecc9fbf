"""The whole prefill, predicted (autotune/costing/whole_prefill.py), the dense-op prices it reads
(autotune/costing/dense_prices.py) and the search's dense decisions (autotune/searching/dense_choice.py)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from helpers import apple_like

from autotune.costing.dense_prices import fit_dense, record_ms
from autotune.costing.whole_prefill import (
    PARTS,
    DecoderShape,
    DensePlacement,
    ExpertFigures,
    LazyLast,
    predict_prefill,
    prompt_chunks,
)
from autotune.profiling.dense_records import matmul_call
from autotune.profiling.profile import load_profile
from autotune.profiling.settings import settings_for
from autotune.profiling.timing import time_in_forward
from autotune.searching.dense_choice import choose_dense, dense_plan
from autotune.searching.prefill_report import placement_json
from autotune.searching.report import format_whole_prefill
from runtime.backends import EXACT
from runtime.loading.model_loader import TINY_MOE_DIR
from runtime.plan import plan_from_json

QWEN = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
            num_hidden_layers=4, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
            intermediate_size=6144, max_position_embeddings=40960)


def test_shape_from_config_reads_the_decoder():
    tiny = DecoderShape.from_config(json.loads((TINY_MOE_DIR / "config.json").read_text()))
    assert (tiny.hidden, tiny.heads, tiny.kv_heads, tiny.head_dim, tiny.expert_ffn) == (256, 4, 2, 64, 256)
    assert tiny.moe_layers == (0, 1, 2, 3) and tiny.mlp_ffn(0) == 0  # no shared expert
    mixed = DecoderShape.from_config({**QWEN, "mlp_only_layers": [1], "shared_expert_intermediate_size": 512})
    assert mixed.moe_layers == (0, 2, 3) and mixed.mlp_ffn(1) == 6144 and mixed.mlp_ffn(0) == 512


def test_prompt_chunks_grow_their_context():
    assert prompt_chunks(2500, 1024) == [(1024, 1024), (1024, 2048), (452, 2500)]


def test_parts_sum_to_the_prefill_and_attention_grows_with_the_prompt():
    cost, shape = apple_like(), DecoderShape.from_config(QWEN)
    experts = ExpertFigures(100.0, 60.0, 900.0)
    one, four = (predict_prefill(cost, shape, p, 1024, experts) for p in (1024, 4096))
    assert set(one.parts_ms) == set(PARTS)
    assert sum(one.parts_ms.values()) == pytest.approx(one.latency_ms)
    assert one.parts_ms["experts"] == 100.0 and one.cpu_ms == pytest.approx(one.latency_ms - 100.0 + 60.0)
    # 4x the tokens: projections 4x; the attention core (0.5 + 2 + 3 + 4) / 0.5 = 19x: each chunk sees all before
    # it, and the first, with nothing cached, runs sdpa's causal kernel (half its block)
    assert four.parts_ms["attention_projections"] == pytest.approx(4 * one.parts_ms["attention_projections"])
    assert four.parts_ms["attention_core"] / one.parts_ms["attention_core"] == pytest.approx(19.0, rel=0.05)
    assert four.parts_ms["lm_head"] == one.parts_ms["lm_head"]  # one row of logits either way


def test_a_packed_head_on_the_cpu_is_dequantized_once_per_prompt():
    """An mlx checkpoint's head on torch's CPU dequantizes its whole weight for the prompt's one row of logits: once
    however many chunks (the runtime computes no logits before the last chunk), and nothing off torch's CPU."""
    cost, shape = apple_like(), DecoderShape.from_config(QWEN)
    packed, experts = dataclasses.replace(shape, packed=True), ExpertFigures(100.0, 60.0, 900.0)
    head = float(cost.norm_ms(EXACT, shape.vocab, shape.hidden, shape.hidden))
    assert head > 0
    for chunk in (4096, 1024):
        plain, dequant = (predict_prefill(cost, s, 4096, chunk, experts).parts_ms["lm_head"] for s in (shape, packed))
        assert dequant == pytest.approx(plain + head)
    on_ane = DensePlacement(host="ane")
    assert predict_prefill(cost, packed, 4096, 1024, experts, on_ane).parts_ms["lm_head"] == \
        predict_prefill(cost, shape, 4096, 1024, experts, on_ane).parts_ms["lm_head"]


def test_placement_moves_the_dense_work_off_the_cpu():
    cost, shape = apple_like(), DecoderShape.from_config(QWEN)
    none = ExpertFigures(0.0, 0.0, 0.0)
    cpu = predict_prefill(cost, shape, 2048, 1024, none)
    ane = predict_prefill(cost, shape, 2048, 1024, none, DensePlacement("ane", "ane", "ane", None, (1024, 2048)))
    # the ANE's matmul throughput is twice the CPU's (apple_like), plus one call per function
    calls = 2 * 2 * shape.num_layers * 0.095  # two functions per layer (qkv, o_proj), two chunks
    assert ane.parts_ms["attention_projections"] == pytest.approx(cpu.parts_ms["attention_projections"] / 2
                                                                  + calls, rel=1e-6)
    assert ane.cpu_ms < 0.1 * cpu.cpu_ms and ane.energy_mj < 0.2 * cpu.energy_mj
    assert all(s.startswith("derived") for s in ane.sources.values())  # no dense records: said so


def test_the_search_places_what_pays_and_writes_a_valid_plan_field():
    cost, shape = apple_like(), DecoderShape.from_config(QWEN)
    fast = choose_dense(cost, shape, 2048, 1024, "ane", (1.0, 0.0, 0.0), 4.0)
    # the core runs in causal blocks: each block of a chunk's static rows reads only the keys up to its own end
    # (unblocked, the first chunk stayed on the CPU: sdpa's causal kernel computes half its block there, as fast
    # as the ANE's whole padded block at twice the throughput, without a call)
    block, static = fast.placement.attention_block, fast.placement.static_rows("attention", 1024)
    assert block and static % block == 0 and block % 64 == 0
    ends = range(block, static + 1, block)
    assert fast.placement.buckets == tuple(s + e for s in (0, 1024) for e in ends)
    unblocked = dataclasses.replace(fast.placement, attention_block=None, buckets=(2048,), rows=())
    assert fast.prediction.latency_ms < choose_dense(cost, shape, 2048, 1024, "ane", (1.0, 0.0, 0.0), 4.0).priced(
        unblocked, cost).prediction.latency_ms
    assert dataclasses.replace(fast.placement, rows=(), buckets=(), attention_block=None) == DensePlacement(
        "ane", "ane", "ane", None)
    assert fast.score.latency_ms == pytest.approx(4.0 * fast.prediction.latency_ms)
    cost.models["ane"].call_ms = 1e4  # a call dearer than any layer's work on the CPU: nothing moves
    assert choose_dense(cost, shape, 2048, 1024, "ane", (1.0, 0.0, 0.0), 4.0).placement == DensePlacement()
    spec = dict(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", num_layers=4, moe_layers=[0, 1, 2, 3],
                num_experts=128, top_k=8, hidden_size=2048, expert_ffn_size=768, fingerprint="x")
    plan = plan_from_json({"schema": "npumoe.plan/1", "model": spec, "chunk_tokens": 1024, "overflow": "drop",
                           "saliency": "router_weight",
                           "layers": [{"layer": i, "groups": [], "cpu_exact": list(range(128))} for i in range(4)],
                           "dense": dense_plan(fast.placement, shape)})
    assert plan.dense.attention_context_buckets == list(fast.placement.buckets) and len(plan.dense.layers) == 4
    assert plan.dense.attention_block == block
    assert plan.dense.layers[0].qkv.backend == "ane" and plan.dense.layers[0].mlp is None
    assert plan.dense.layers[0].qkv.rows == dict(fast.placement.rows)["qkv"]
    assert plan.dense.attention_rows == dict(fast.placement.rows)["attention"]


def test_a_row_split_runs_the_cpu_beside_the_ane():
    """A function split at r rows costs the longer of the ANE's r rows (and its call) and the CPU's other rows."""
    cost, shape = apple_like(), DecoderShape.from_config(QWEN)
    none = ExpertFigures(0.0, 0.0, 0.0)
    whole = DensePlacement("ane", "ane", "ane", None, (1024, 2048))
    a, b = (predict_prefill(cost, shape, 2048, 1024, none, p) for p in (whole, whole.with_rows("o_proj", 384)))
    o = lambda backend, rows: cost.matmul_ms(backend, rows, shape.hidden, shape.heads * shape.head_dim)  # noqa: E731
    call, n = cost.call_ms("ane"), 2 * shape.num_layers  # two full chunks, every layer
    split = max(o("ane", 384) + call, o(EXACT, 640))
    assert a.parts_ms["attention_projections"] - b.parts_ms["attention_projections"] == pytest.approx(
        n * (o("ane", 1024) + call - split), rel=1e-6)
    assert b.cpu_ms - a.cpu_ms == pytest.approx(n * o(EXACT, 640), rel=1e-6)  # the CPU's rows are CPU-busy time
    # the search splits where it pays: a faster prefill than every function whole on the ANE
    fast = choose_dense(cost, shape, 2048, 1024, "ane", (1.0, 0.0, 0.0), 1.0)
    assert {"qkv", "o_proj", "attention"} <= set(dict(fast.placement.rows))
    assert all(r % 64 == 0 and 0 < r < 1024 for _, r in fast.placement.rows)
    assert fast.prediction.latency_ms < 0.85 * a.latency_ms
    # for energy the CPU's watts make a split dearer: nothing is split
    assert choose_dense(cost, shape, 2048, 1024, "ane", (0.0, 1.0, 0.0), 1.0).placement.rows == ()


def test_measured_matmul_fit_predicts_held_out_shapes():
    """This host's matmuls as profile-device times them: a fit on some shapes predicts the others. Each shape's
    record is the least disturbed (lowest median) of three rounds that interleave the shapes: on a shared CI host
    another job's burst lands on one round of a few shapes, not on all three."""
    torch.set_num_threads(1)
    s = settings_for(True)
    shapes = [(m, n, k) for m in (16, 64, 256) for n, k in ((384, 128), (128, 256), (512, 256), (256, 512))]
    with torch.inference_mode():
        rounds = [[time_in_forward(matmul_call(m, n, k), s) for m, n, k in shapes] for _ in range(3)]
    recs = [{"kind": "dense_matmul", "m": m, "n": n, "k": k, "backend": "cpu-exact", "dtype_bytes": 4,
             **min((r[i] for r in rounds), key=lambda t: t["median_ms"])} for i, (m, n, k) in enumerate(shapes)]
    held = recs[1::4]
    fit = fit_dense([r for r in recs if r not in held])["matmul"]
    errors = [abs(record_ms(fit, r) / r["median_ms"] - 1) for r in held]
    assert fit.source.startswith("measured") and np.mean(errors) < 0.35, errors


def test_causal_blocks_price_each_block_over_its_own_keys():
    """The qwen3-30b-a3b shape on the published profile, one 4096-token chunk: unblocked, the ANE's core reads the
    whole bucket for every query; in blocks of 1024, block j reads only the first (j + 1) x 1024 keys, one call each."""
    cost = load_profile("apple-m2-ultra-published").cost_model
    shape = DecoderShape.from_config({**QWEN, "num_hidden_layers": 48})
    none, call, layers = ExpertFigures(0.0, 0.0, 0.0), cost.call_ms("ane"), 48
    attn = lambda backend, rows, keys: float(cost.attention_ms(backend, rows, keys, 32, 4, 128))  # noqa: E731
    whole = DensePlacement(attention="ane", buckets=(4096,))
    blocked = DensePlacement(attention="ane", buckets=(1024, 2048, 3072, 4096), attention_block=1024)
    a, b = (predict_prefill(cost, shape, 4096, 4096, none, p).parts_ms["attention_core"] for p in (whole, blocked))
    assert a == pytest.approx(layers * (call + attn("ane", 4096, 4096)), rel=1e-9)
    assert b == pytest.approx(layers * sum(call + attn("ane", 1024, k) for k in (1024, 2048, 3072, 4096)), rel=1e-9)
    assert b < 0.75 * a, (a, b)
    # split at 3072 rows: three blocks on the ANE while sdpa computes the last 1024 queries over every key
    split = predict_prefill(cost, shape, 4096, 4096, none, blocked.with_rows("attention", 3072))
    ane = sum(call + attn("ane", 1024, k) for k in (1024, 2048, 3072))
    assert split.parts_ms["attention_core"] == pytest.approx(layers * max(ane, attn(EXACT, 1024, 4096)), rel=1e-9)
    # the search finds a block: its core is priced below the best unblocked one (the CPU as the host: on this
    # profile's GPU the core runs faster than any ANE share of it)
    cost.models.pop("mlx-exact")
    chosen = choose_dense(cost, shape, 4096, 4096, "ane", (1.0, 0.0, 0.0), 1.0)
    unblocked = min((chosen.priced(dataclasses.replace(chosen.placement, attention_block=None, buckets=(4096,),
                                                       rows=r), cost) for r in ((), chosen.placement.rows)),
                    key=lambda c: c.prediction.latency_ms)
    assert chosen.placement.attention_block and chosen.prediction.parts_ms["attention_core"] < min(
        a, unblocked.prediction.parts_ms["attention_core"])


def test_the_report_names_the_block_and_the_keys_each_block_reads():
    place = DensePlacement("ane", None, "ane", None, (128, 256, 640, 768), (("attention", 256),), attention_block=128)
    j = placement_json(place, 1100, 512)  # two full chunks (at 0 and 512), then a partial one of 76 tokens
    assert j["attention_block"] == 128 and j["attention_reads"] == {0: [128, 256], 512: [640, 768]}
    w = {"predicted_parts_ms": {"attention_core": 1.0}, "dense_placement": j, "vs": {}, "prompt_tokens": 1100,
         "chunk_tokens": 512, "predicted_prefill_ms": 1.0, "over_roofline_whole": 1.0}
    assert format_whole_prefill(w)[1] == ("  attention core: its first 256 queries of each full chunk in causal "
                                          "blocks of 128, each reading the smallest bucket holding its keys (the "
                                          "chunk at 0: 128..256 keys over 2 calls, not 512; the chunk at 512: "
                                          "640..768 keys over 2 calls, not 1024)")


def test_the_searched_block_and_split_are_the_enumerated_best():
    """The core's block (none, 512 .. 64) and static rows (multiples of the block), every one priced: the search's
    ternary search over the rows per block finds the cheapest within 1%."""
    cost, shape = apple_like(), DecoderShape.from_config(QWEN)
    fast = choose_dense(cost, shape, 2048, 1024, "ane", (1.0, 0.0, 0.0), 1.0)
    others = tuple((f, r) for f, r in fast.placement.rows if f != "attention")
    priced = []
    for block in (None, 512, 256, 128, 64):
        step = block or 1024
        keys = tuple(sorted({s + e for s in (0, 1024) for e in range(step, 1025, step)}))
        for rows in range(step, 1025, step):
            split = others + ((("attention", rows),) if rows < 1024 else ())
            place = dataclasses.replace(fast.placement, buckets=keys, attention_block=block, rows=split)
            priced.append((fast.priced(place, cost).prediction.latency_ms, block, rows))
    best = min(priced)
    assert fast.prediction.latency_ms <= 1.01 * best[0], (fast.placement, best)
    assert best[1] is not None  # a block is the optimum here


def test_dense_functions_share_the_ane_window_with_the_resident_experts():
    """One window for everything resident at once: the same placement that fits beside no experts leaves its weighted
    functions on the CPU beside experts that take the window (the attention core holds no weights and stays)."""
    from runtime.coreml import ane_limits

    cost, shape = apple_like(), DecoderShape.from_config(QWEN)
    alone = choose_dense(cost, shape, 2048, 1024, "ane", (1.0, 0.0, 0.0), 4.0)
    assert alone.placement.qkv == "ane" and alone.fits_beside(0.0)
    full = choose_dense(cost, shape, 2048, 1024, "ane", (1.0, 0.0, 0.0), 4.0, ane_limits.WINDOW_BYTES - 1e6)
    assert (full.placement.qkv, full.placement.o_proj, full.placement.mlp) == (None, None, None)
    assert full.placement.attention == "ane" and not alone.fits_beside(ane_limits.WINDOW_BYTES - 1e6)
    assert ane_limits.resident_over_window({"experts": 3 * 2**30, "dense functions": 2**30 + 5}) == 5


def test_a_dense_half_priced_on_mlx_places_only_what_the_spine_runs(monkeypatch):
    """The GPU host runs on the MLX spine: a static dense function is placed beside it only where the spine splices
    it into mlx-lm's forward (`SPINE_SPLICES`), so no plan is priced on a lane its engine cannot run."""
    from autotune.searching import dense_choice
    from runtime.backends.registry import registry

    cost, shape = apple_like(), DecoderShape.from_config(QWEN)
    gpu = dataclasses.replace(cost.models["cpu-exact"], name="mlx-exact", overlaps_cpu=True)
    cost = dataclasses.replace(cost, models={**cost.models, "mlx-exact": gpu}, _lut={})
    assert registry.get("mlx-exact").exact and cost.plan_exact() == "mlx-exact"
    monkeypatch.setattr(dense_choice, "SPINE_SPLICES", ())
    alone = choose_dense(cost, shape, 2048, 1024, "ane", (1.0, 0.0, 0.0), 4.0).placement
    assert alone == DensePlacement(host="mlx-exact")
    monkeypatch.setattr(dense_choice, "SPINE_SPLICES", ("qkv",))
    spliced = choose_dense(cost, shape, 2048, 1024, "ane", (1.0, 0.0, 0.0), 4.0).placement
    assert spliced.qkv == "ane" and not (spliced.o_proj or spliced.attention or spliced.mlp)


def test_a_lazy_host_leaves_out_the_last_layers_work_for_rows_no_output_reads():
    """MLX computes what an output reads: a cache-only chunk needs the last layer's keys and values only, so its
    queries, attention, o_proj and experts run for the prompt's last token alone (mlx-lm's prefill and the spine's)."""
    cost = apple_like()
    one = DecoderShape.from_config({**QWEN, "num_hidden_layers": 1, "model_type": "qwen3_moe"})  # q/k norms
    four = DecoderShape.from_config(QWEN)
    experts, last = ExpertFigures(400.0, 40.0, None), ExpertFigures(100.0, 10.0, None)
    mlx = DensePlacement(host="mlx-exact")
    split = LazyLast(last, split=True)
    whole = predict_prefill(cost, four, 4096, 1024, experts, mlx)
    lazy = predict_prefill(cost, four, 4096, 1024, experts, mlx, lazy_last=split)
    assert lazy.parts_ms["experts"] == pytest.approx(400.0 - 100.0 * 4095 / 4096)
    assert lazy.cpu_ms < whole.cpu_ms and sum(lazy.parts_ms.values()) == pytest.approx(lazy.latency_ms)
    # three layers' cores whole, the last one's for one query over the prompt's keys
    row = cost.attention_ms("mlx-exact", 1, 4096, one.heads, one.kv_heads, one.head_dim, False)
    assert lazy.parts_ms["attention_core"] == pytest.approx(whole.parts_ms["attention_core"] * 3 / 4 + row)
    # one layer: its projections are the keys' and values' (the prompt's less one row) and one row's q/k/v and o
    alone = predict_prefill(cost, one, 4096, 1024, experts, mlx, lazy_last=split)
    kv = one.kv_heads * one.head_dim
    assert one.qk_norm
    kv_ms = 2 * cost.matmul_ms("mlx-exact", 4095, kv, one.hidden) + cost.norm_ms("mlx-exact", 4095, kv, one.qk_norm)
    row_ms = predict_prefill(cost, one, 1, 1, experts, mlx).parts_ms["attention_projections"]
    assert alone.parts_ms["attention_projections"] == pytest.approx(kv_ms + row_ms, rel=1e-6)
    # the final chunk's rows all run without the split; a CPU host computes everything; so does a chunk whose
    # dense functions run on a static backend
    final = predict_prefill(cost, four, 4096, 1024, experts, mlx, lazy_last=LazyLast(last, split=False))
    assert final.parts_ms["experts"] == pytest.approx(400.0 - 100.0 * 3072 / 4096)
    cpu = DensePlacement()
    assert predict_prefill(cost, four, 4096, 1024, experts, cpu, lazy_last=split).parts_ms == \
        predict_prefill(cost, four, 4096, 1024, experts, cpu).parts_ms
    ane = DensePlacement(qkv="ane", host="mlx-exact")
    assert predict_prefill(cost, four, 4096, 1024, experts, ane, lazy_last=split).parts_ms == \
        pytest.approx(predict_prefill(cost, four, 4096, 1024, experts, ane).parts_ms)
