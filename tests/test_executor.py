"""The executor against the transformers reference, drop/spill accounting, and saliency order."""
import pytest
import torch
from helpers import random_model

from autotune.searching.templates import template_plan
from runtime.executor import LayerExecutor, PlanExecutor
from runtime.loading.model_loader import RANDOM_MODELS, model_spec, moe_layers
from runtime.plan import Group, LayerPlan
from runtime.prefill import max_rel_diff, prefill_logits
from runtime.stats import LayerStats

CHUNK = 64


def _ids(tok, n=200):
    return torch.tensor(tok.encode("Mixture of experts prefill on a neural engine. " * 10)[:n])


def _record_routing(model):
    """Hook every experts module to record top_k_index per call (the routing the executor really got)."""
    seen, hooks = {}, []
    for layer in moe_layers(model):
        def hook(mod, args, kwargs, i=layer.index):
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            seen.setdefault(i, []).append(idx.clone())
        hooks.append(layer.experts.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, hooks


@pytest.mark.parametrize("name", RANDOM_MODELS)
@pytest.mark.parametrize("capacity,overflow", [("ample", "drop"), ("tight", "spill")])
def test_matches_reference_when_nothing_drops(name, capacity, overflow):
    model, tok = random_model(name)
    ids = _ids(tok)
    ref = prefill_logits(model, ids, CHUNK)
    plan = template_plan(model_spec(model), capacity, overflow, chunk_tokens=CHUNK)
    with PlanExecutor(model, plan) as ex:
        got = prefill_logits(model, ids, CHUNK)
    assert max_rel_diff(got, ref) <= 1e-5
    total = ex.stats.total()
    assert total.dropped == 0
    assert total.assignments == ids.numel() * plan.model.top_k * len(plan.layers)
    if capacity == "ample":
        assert total.spilled == 0 and total.tokens_per_backend["cpu-static"] == total.assignments
    else:
        assert total.spilled > 0 and total.tokens_per_backend["cpu-exact"] == total.spilled


@pytest.mark.parametrize("name", RANDOM_MODELS)
def test_tight_drop_counts_match_routing(name):
    model, tok = random_model(name)
    ids = _ids(tok)
    spec = model_spec(model)
    plan = template_plan(spec, "tight", "drop", chunk_tokens=CHUNK)
    cap = plan.layers[0].groups[0].capacities[0]
    seen, hooks = _record_routing(model)
    try:
        with PlanExecutor(model, plan) as ex:
            got = prefill_logits(model, ids, CHUNK)
    finally:
        for h in hooks:
            h.remove()
    for index, calls in seen.items():
        want = sum(int((torch.bincount(c.reshape(-1), minlength=spec.num_experts) - cap).clamp_min(0).sum())
                   for c in calls)
        assert ex.stats.layers[index].dropped == want > 0
        # padding = empty slots: every slot not filled by a kept assignment
        s = ex.stats.layers[index]
        assert s.filled == s.assignments - s.dropped
        assert s.slots == len(calls) * spec.num_experts * cap
    ref = prefill_logits(model, ids, CHUNK)
    assert max_rel_diff(got, ref) > 1e-3  # dropping is visible


def test_mixed_plan_cold_experts_exact():
    model, tok = random_model("random:qwen2_moe")  # has a shared expert outside the routed ones
    ids = _ids(tok)
    spec = model_spec(model)
    ref = prefill_logits(model, ids, CHUNK)
    layers = [LayerPlan(layer=i, groups=[Group(backend="cpu-static", experts=[5, 1, 7], capacities=[CHUNK, 40, CHUNK])],
                        cpu_exact=[0, 2, 3, 4, 6]) for i in spec.moe_layers]
    plan = template_plan(spec, "ample", "spill", chunk_tokens=CHUNK).model_copy(update={"layers": layers})
    with PlanExecutor(model, plan) as ex:
        got = prefill_logits(model, ids, CHUNK)
    assert max_rel_diff(got, ref) <= 1e-5
    t = ex.stats.total()
    assert t.tokens_per_backend["cpu-exact"] + t.tokens_per_backend["cpu-static"] == t.assignments


def _one_layer(rule: str, caps: list[int], overflow: str = "drop"):
    model, _ = random_model("random:qwen3_moe")
    layer = moe_layers(model)[0]
    spec = model_spec(model)
    lp = LayerPlan(layer=layer.index, groups=[Group(backend="cpu-static", experts=list(range(8)), capacities=caps)],
                   cpu_exact=[])
    plan = template_plan(spec, "ample", overflow, chunk_tokens=64).model_copy(update={"saliency": rule})
    from runtime.cpu.cpu_backends import CpuStaticBackend
    return layer.experts, LayerExecutor(lp, layer.experts, plan, LayerStats(), {"cpu-static": CpuStaticBackend()})


def _expert_out(module, e, x):
    from runtime.backends import expert_ffn
    return expert_ffn(module, e, x)


@pytest.mark.parametrize("rule", ["router_weight", "weight_x_norm"])
def test_drops_lowest_saliency(rule):
    torch.manual_seed(0)
    module, ex = _one_layer(rule, [2] + [64] * 7)
    T = 6
    x = torch.randn(T, 64) * torch.linspace(0.5, 3.0, T)[:, None]  # distinct norms
    idx = torch.stack([torch.zeros(T, dtype=torch.long), torch.arange(1, T + 1) % 8], dim=1)  # all pick expert 0
    w = torch.stack([torch.tensor([0.30, 0.90, 0.10, 0.60, 0.50, 0.20]), torch.full((T,), 0.5)], dim=1)
    out = ex(x, idx, w)
    saliency = w[:, 0] * (x.norm(dim=-1) if rule == "weight_x_norm" else 1.0)
    keep = set(torch.argsort(saliency, descending=True)[:2].tolist())
    want = torch.zeros_like(x)
    for t in range(T):
        if t in keep:
            want[t] += w[t, 0] * _expert_out(module, 0, x[t:t + 1])[0]
        want[t] += w[t, 1] * _expert_out(module, int(idx[t, 1]), x[t:t + 1])[0]
    assert ex.stats.dropped == T - 2
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)


def test_ane_plan_falls_back_and_says_so_once(caplog):
    model, tok = random_model("random:mixtral")
    plan = template_plan(model_spec(model), "ample", "drop", backend="ane", chunk_tokens=CHUNK)
    with caplog.at_level("WARNING", logger="npumoe"):
        with PlanExecutor(model, plan) as ex:
            prefill_logits(model, _ids(tok, 100), CHUNK)
    msgs = [r.getMessage() for r in caplog.records if "ane" in r.getMessage()]
    assert len(msgs) == 1 and "ane-sim" in msgs[0]
    assert ex.fallbacks == {"ane": "ane-sim"}
    assert ex.stats.total().calls_per_backend["ane-sim"] > 0
