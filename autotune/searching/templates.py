"""Template plans: every expert in groups of four on one backend, with uniform capacity. Tests and newcomers
use them before a search has produced a tuned plan."""
from __future__ import annotations

import math

from runtime.backends import REFERENCE
from runtime.plan import Group, LayerPlan, ModelSpec, Plan

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


def template_plan(spec: ModelSpec, capacity: str = "ample", overflow: str = "drop", backend: str = REFERENCE,
                  chunk_tokens: int = 256, saliency: str = "router_weight") -> Plan:
    cap = template_capacity(spec, chunk_tokens, capacity)
    experts = list(range(spec.num_experts))
    chunks = [experts[i:i + GROUP_SIZE] for i in range(0, len(experts), GROUP_SIZE)]
    groups = [Group(backend=backend, experts=chunk, capacities=[cap] * len(chunk)) for chunk in chunks]
    layers = [LayerPlan(layer=i, groups=groups, cpu_exact=[]) for i in spec.moe_layers]
    return Plan(model=spec, chunk_tokens=chunk_tokens, overflow=overflow, saliency=saliency,
                layers=layers, meta={"made_by": f"autotune plan-template --capacity {capacity}"})
