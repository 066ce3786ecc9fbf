"""The decode policy: chunks below the plan's threshold run exactly; prefill and decode are counted apart."""
import numpy as np
import pytest
import torch
from helpers import random_model
from transformers.integrations.moe import grouped_mm_experts_forward

from autotune.searching.templates import template_plan
from runtime.errors import FileFormatError
from runtime.executor import LayerExecutor, PlanExecutor
from runtime.loading.model_loader import model_spec, moe_layers
from runtime.plan import DEFAULT_EXACT_BELOW_TOKENS, LayerPlan, plan_from_json
from runtime.stats import LayerStats


def _layer(threshold: int | None):
    model, _ = random_model("random:qwen3_moe")
    layer = moe_layers(model)[0]
    plan = template_plan(model_spec(model), "tight", "drop", chunk_tokens=64)
    plan = plan.model_copy(update={"exact_below_tokens": threshold})
    from runtime.cpu.cpu_backends import CpuStaticBackend
    ex = LayerExecutor(plan.layer(layer.index), layer.experts, plan, LayerStats(), {"cpu-static": CpuStaticBackend()})
    return layer.experts, ex


def test_a_layer_without_groups_runs_planned_chunks_on_the_exact_path_and_decode_through_transformers(monkeypatch):
    import runtime.cpu.cpu_backends

    model, _ = random_model("random:qwen3_moe")
    layer = moe_layers(model)[0]
    plan = template_plan(model_spec(model), "tight", "drop", chunk_tokens=64)
    lp = LayerPlan(layer=layer.index, groups=[], cpu_exact=list(range(layer.experts.num_experts)))
    fused = []  # the rows transformers' kernel ran

    def recorded(module, x, idx, w):
        fused.append(x.shape[0])
        return grouped_mm_experts_forward(module, x, idx, w)

    monkeypatch.setattr(runtime.cpu.cpu_backends, "grouped_mm_experts_forward", recorded)
    ex = LayerExecutor(lp, layer.experts, plan, LayerStats(), {})
    torch.manual_seed(0)
    n, k, experts = 40, 2, layer.experts.num_experts
    x, idx, w = torch.randn(n, 64), torch.randint(0, experts, (n, k)), torch.rand(n, k)
    assert torch.allclose(ex(x, idx, w), grouped_mm_experts_forward(layer.experts, x, idx, w), rtol=1e-5, atol=1e-6)
    assert fused == [] and ex.stats.tokens_per_backend["cpu-exact"] == n * k
    ex(x[:1], idx[:1], w[:1])  # a decode step: transformers' kernel
    assert fused == [1]


@pytest.mark.parametrize("threshold", [None, 5])
def test_chunks_below_threshold_run_exact(threshold):
    module, ex = _layer(threshold)
    below = (threshold or DEFAULT_EXACT_BELOW_TOKENS) - 1
    torch.manual_seed(0)
    x = torch.randn(below, 64)
    idx = torch.zeros(below, 2, dtype=torch.long)
    idx[:, 1] = 1  # every token on experts 0 and 1: a tight static slice would overflow and drop
    w = torch.full((below, 2), 0.5)
    out = ex(x, idx, w)
    assert torch.allclose(out, grouped_mm_experts_forward(module, x, idx, w), rtol=1e-5, atol=1e-6)
    s = ex.stats
    assert s.slots == 0 and s.dropped == 0 and s.calls_per_backend["cpu-static"] == 0
    assert s.tokens_per_backend["cpu-exact"] == 2 * below and s.calls_per_backend["cpu-exact"] == 2
    # at the threshold the static groups run again (and drop what overflows the tight slices)
    n = below + 1
    ex(torch.randn(n, 64), idx[:1].expand(n, 2).contiguous(), w[:1].expand(n, 2).contiguous())
    assert s.calls_per_backend["cpu-static"] > 0 and s.slots > 0


def test_threshold_below_two_is_refused():
    model, _ = random_model("random:qwen3_moe")
    obj = template_plan(model_spec(model), "ample", "spill").to_json()
    obj["exact_below_tokens"] = 1
    with pytest.raises(FileFormatError, match="exact_below_tokens"):
        plan_from_json(obj)
    del obj["exact_below_tokens"]  # optional: plans written before the field still load
    assert plan_from_json(obj).exact_below == DEFAULT_EXACT_BELOW_TOKENS


def test_decode_steps_never_call_static_groups_and_are_counted_apart():
    model, tok = random_model("random:mixtral")
    ids = torch.tensor([tok.encode("Decode runs exactly, one token at a time.")])
    plan = template_plan(model_spec(model), "tight", "spill", chunk_tokens=16)
    with torch.inference_mode():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False)
        with PlanExecutor(model, plan) as ex:
            got = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, ref)
    n_moe = len(plan.layers)
    prefill, decode = ex.stats.total("prefill"), ex.stats.total("decode")
    assert prefill.tokens == ids.shape[1] * n_moe and prefill.calls_per_backend["cpu-static"] > 0
    assert decode.tokens == 5 * n_moe  # the first new token comes from the prefill forward
    assert ex.stats.static_calls("decode") == 0 and decode.slots == 0
    assert decode.tokens_per_backend["cpu-exact"] == decode.assignments == 5 * n_moe * plan.model.top_k
    j = ex.stats.to_json()
    assert j["decode"]["assignments"] + j["prefill"]["assignments"] == j["assignments"]


def test_pinned_phase_wins_over_the_forward_classifier():
    model, tok = random_model("random:olmoe")
    plan = template_plan(model_spec(model), "ample", "drop", chunk_tokens=4)
    ids = torch.tensor([tok.encode("abcde")])  # 5 tokens in chunks of 4: the last prefill chunk has 1 token
    with torch.inference_mode(), PlanExecutor(model, plan) as ex:
        ex.set_phase("prefill", pin=True)
        out = model(input_ids=ids[:, :4], use_cache=True)
        model(input_ids=ids[:, 4:], cache=out.cache, use_cache=True)
    assert ex.stats.total("decode").tokens == 0
    assert ex.stats.total("prefill").tokens == 5 * len(plan.layers)


def test_static_break_even_is_clamped_and_found():
    from autotune.profiling.profile import load_profile

    model, _ = random_model("random:qwen3_moe")
    spec = model_spec(model)
    plan = template_plan(spec, "ample", "spill", chunk_tokens=64)
    cost = load_profile("linux-xeon-2c-quick", check_host=False).cost_model
    mean = [np.full(spec.num_experts, 64 * spec.top_k / spec.num_experts)] * len(plan.layers)
    n = cost.static_break_even(plan.layers, mean, 64, spec.hidden_size, spec.expert_ffn_size, "spill")
    assert 2 <= n <= 64
    # a one-token chunk size leaves nothing to pay off: still at least 2, so decode never hits a static group
    assert cost.static_break_even(plan.layers, mean, 1, spec.hidden_size, spec.expert_ffn_size, "spill") == 2
