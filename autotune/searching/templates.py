"""Template plans: every expert in groups of four on one backend, with uniform capacity. Tests and newcomers
use them before a search has produced a tuned plan."""
from __future__ import annotations

import math

from runtime.backends import REFERENCE
from runtime.dense.families import FAMILIES
from runtime.plan import DenseFunction, DenseLayer, DensePlan, Group, LayerPlan, ModelSpec, Plan

GROUP_SIZE = 4
CAPACITIES = ("ample", "tight")


def template_capacity(spec: ModelSpec, chunk_tokens: int, capacity: str) -> int:
    """`ample`: the chunk's token count, so no expert can overflow (a token picks an expert at most once).
    `tight`: a quarter of the mean per-expert load of a full chunk."""
    if capacity == "ample":
        return chunk_tokens
    if capacity == "tight":
        return max(1, math.floor(chunk_tokens * spec.top_k / spec.num_experts / 4))
    raise ValueError(f"capacity must be one of {CAPACITIES}, got {capacity!r}")


def dense_template(spec: ModelSpec, backend: str, chunk_tokens: int, context_tokens: int) -> DensePlan:
    """Every dense function of every decoder layer on `backend`: q/k/v with the input norm, o_proj, the attention
    core (buckets: every multiple of the chunk up to `context_tokens`), and the dense MLP of a non-MoE layer or
    the shared expert of an MoE layer where the family has one."""
    if context_tokens < chunk_tokens:
        raise ValueError(f"a context of {context_tokens} tokens holds no full chunk of {chunk_tokens}")
    shared = spec.model_type in FAMILIES and FAMILIES[spec.model_type].shared_expert
    fn = DenseFunction(backend=backend)
    layers = [DenseLayer(layer=i, qkv=fn, o_proj=fn, attention=backend,
                         mlp=fn if shared or i not in spec.moe_layers else None) for i in range(spec.num_layers)]
    buckets = list(range(chunk_tokens, context_tokens + 1, chunk_tokens))
    return DensePlan(attention_context_buckets=buckets, layers=layers)


def template_plan(spec: ModelSpec, capacity: str = "ample", overflow: str = "drop", backend: str = REFERENCE,
                  chunk_tokens: int = 256, saliency: str = "router_weight", dense: str | None = None,
                  context_tokens: int | None = None, exact: str | None = None, grouped: bool = True) -> Plan:
    """`dense`: every dense function on that backend too (`dense_template`, buckets up to `context_tokens`);
    `exact`: the plan's exact path (`Plan.exact`; None: cpu-exact); `grouped` False: no static group, every expert
    on the exact path."""
    cap = template_capacity(spec, chunk_tokens, capacity)
    experts = list(range(spec.num_experts))
    chunks = [experts[i:i + GROUP_SIZE] for i in range(0, len(experts), GROUP_SIZE)]
    groups = [Group(backend=backend, experts=chunk, capacities=[cap] * len(chunk)) for chunk in chunks]
    layers = [LayerPlan(layer=i, groups=groups, cpu_exact=[]) if grouped else
              LayerPlan(layer=i, groups=[], cpu_exact=experts) for i in spec.moe_layers]
    dense_plan = dense_template(spec, dense, chunk_tokens, context_tokens or chunk_tokens) if dense else None
    return Plan(model=spec, chunk_tokens=chunk_tokens, overflow=overflow, saliency=saliency, layers=layers,
                dense=dense_plan, exact=exact, meta={"made_by": f"autotune plan-template --capacity {capacity}"})
