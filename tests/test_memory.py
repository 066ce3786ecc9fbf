"""Predicted memory of a plan (autotune/costing/memory.py): each part from the model's sizes, compression, budget."""
import pytest
from helpers import random_model

from autotune.costing.memory import (
    GB,
    RUNTIME_BYTES,
    ModelSize,
    ane_budget_bytes,
    ane_package_bytes,
    predict_memory,
)
from autotune.searching.templates import template_plan
from runtime.errors import NpumoeError
from runtime.loading.model_loader import model_spec

H, F, E, LAYERS = 64, 48, 8, 4  # random:qwen3_moe: 4 layers of 8 experts, hidden 64, expert width 48, fp32


@pytest.fixture(scope="module")
def model():
    return random_model("random:qwen3_moe")[0]


def test_parts_from_the_model_and_the_plan(model):
    size = ModelSize.of(model)
    assert size.weight_bytes == 4 * sum(p.numel() for p in model.parameters()) + 4 * sum(
        b.numel() for b in model.buffers() if b.is_floating_point())
    assert size.kv_bytes_per_token == 2 * LAYERS * 2 * 16 * 4  # K and V, 2 KV heads of 16, fp32
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=32)
    m = predict_memory(plan, size, prompt_tokens=100)
    assert m.ane_packages == LAYERS * E * 3 * H * F * 2  # every expert resident once, fp16
    assert m.kv_cache == 100 * size.kv_bytes_per_token and m.runtime == RUNTIME_BYTES
    assert m.cpu_weights == size.weight_bytes  # the CPU keeps every expert: decode runs exactly
    assert m.total == m.cpu_weights + m.ane_packages + m.activations + m.kv_cache + m.runtime
    assert m.to_json()["total_bytes"] == m.total and "predicted" in m.to_json()["label"]
    on_cpu = template_plan(model_spec(model), "ample", backend="cpu-static", chunk_tokens=32)
    assert predict_memory(on_cpu, size, 100).ane_packages == 0  # cpu-static groups use the torch weights


def test_ane_bytes_follow_each_groups_compression(model):
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=32)
    fp16 = ane_package_bytes(plan)
    lp = plan.layers[0]
    squeezed = lp.model_copy(update={"groups": [g.model_copy(update={"compress": "palettize4"}) for g in lp.groups]})
    plan = plan.model_copy(update={"layers": [squeezed, *plan.layers[1:]]})
    assert ane_package_bytes(plan) == fp16 - E * 3 * H * F * 2 + E * 3 * H * F // 2  # layer 0 at 4 bits


def test_budget_leaves_the_rest_for_ane_packages_and_refuses_the_impossible(model):
    size = ModelSize.of(model)
    plan = template_plan(model_spec(model), "ample", backend="cpu-static", chunk_tokens=32)
    fixed = predict_memory(plan, size, 64)
    assert ane_budget_bytes(fixed.total / GB + 0.5, size, 32, 64) == pytest.approx(0.5 * GB, abs=2e6)
    with pytest.raises(NpumoeError, match="--memory-gb 0.001 is below what any plan needs"):
        ane_budget_bytes(0.001, size, 32, 64)


def test_run_reports_measured_memory_and_cpu_time_next_to_the_prediction(tmp_path, text_file):
    import autotune
    from runtime.plan import save_plan

    model = random_model("random:qwen3_moe")[0]
    save_plan(template_plan(model_spec(model), "ample", backend="cpu-static", chunk_tokens=32), tmp_path / "p.json")
    r = autotune.run_plan("random:qwen3_moe", tmp_path / "p.json", text=text_file, max_tokens=96).to_json()
    assert r["tokens"] == 96 and r["cpu_ms_per_token"] > 0
    assert r["wall_ms_per_token"] == pytest.approx(r["latency_ms"] / 96)
    m = r["memory"]
    assert m["measured_peak_rss_gb"] > 0 and m["predicted"]["prompt_tokens"] == 96
    assert m["predicted_over_measured"] == pytest.approx(m["predicted"]["total_bytes"] / (m["measured_peak_rss_gb"]
                                                                                          * GB), rel=1e-3)
    assert r["plan_predicted"] is None  # a template carries no predictions
