"""runtime/dense/parts.py: wall time per part of a prefill, from forward hooks; the parts sum to the forwards."""
import time

import torch
from helpers import random_model

from runtime.dense.parts import PARTS, measured_parts
from runtime.prefill import prefill_logits

IDS = torch.randint(3, 250, (96,), generator=torch.Generator().manual_seed(0))


def test_parts_sum_to_the_measured_forwards():
    model, _ = random_model("random:qwen2_moe")
    t0 = time.perf_counter()
    with measured_parts(model) as times:
        prefill_logits(model, IDS, 32)
    wall_ms = 1e3 * (time.perf_counter() - t0)
    parts = times.parts_ms()
    assert list(parts) == list(PARTS) and times.forwards == 3
    assert all(v > 0 for v in parts.values()), parts  # qwen2_moe has a shared expert: dense_mlp too
    assert abs(sum(parts.values()) - times.total_ms()) < 1e-2
    assert 0.5 * wall_ms < times.total_ms() <= wall_ms


def test_a_slow_part_is_counted_where_it_runs():
    model, _ = random_model("random:mixtral")
    layer = model.model.layers[0].self_attn.o_proj
    own = layer.forward
    layer.forward = lambda x: (time.sleep(0.02), own(x))[1]  # 20 ms more per o_proj call of layer 0
    try:
        with measured_parts(model) as times:
            prefill_logits(model, IDS, 32)
    finally:
        del layer.forward
    parts = times.parts_ms()
    assert parts["attention_projections"] >= 3 * 20 and parts["attention_core"] < 3 * 20, parts
    assert parts["dense_mlp"] == 0 and parts["rest"] >= 0  # mixtral: no shared expert, no dense MLP layer
    with measured_parts(model) as again:
        prefill_logits(model, IDS, 32)
    assert again.parts_ms()["attention_projections"] < 3 * 20  # the hooks were removed, nothing carried over


def test_parts_under_a_dense_plan_count_the_fused_functions_as_projections():
    from autotune.searching.templates import template_plan
    from runtime.executor import PlanExecutor
    from runtime.loading.model_loader import model_spec

    model, _ = random_model("random:olmoe")
    plan = template_plan(model_spec(model), "ample", "drop", "cpu-static", chunk_tokens=32, dense="cpu-static",
                         context_tokens=96)
    with PlanExecutor(model, plan), measured_parts(model) as times:
        prefill_logits(model, IDS, 32)
    parts = times.parts_ms()
    assert all(parts[p] > 0 for p in ("attention_projections", "attention_core", "experts", "lm_head")), parts
    assert parts["dense_mlp"] == 0 and abs(sum(parts.values()) - times.total_ms()) < 1e-2
