"""Benchmark callers: each returns a `cache_state.Call` that makes one call of runtime code (a static group through
its backend's `StaticBackend` protocol, or as its registry entry says to time it; an exact-path call; the
executor's host-side work for a chunk), with the input a forward's op before it writes, for `timing`."""
from __future__ import annotations

import torch

from autotune.profiling.cache_state import Call
from runtime.backends import REFERENCE, BackendInfo, ExactFn, GroupSpec
from runtime.cpu.cpu_backends import run_exact
from runtime.executor import LayerExecutor
from runtime.plan import Group, LayerPlan, ModelSpec, Plan
from runtime.stats import LayerStats


def make_experts(hidden: int, ffn: int, num_experts: int, seed: int = 0) -> torch.nn.Module:
    """A transformers Qwen3Moe fused-experts module (the layout every MoE family uses) with random weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=ffn, num_experts=num_experts,
                            num_experts_per_tok=2)
    module = Qwen3MoeExperts(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=gen) * 0.02)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=gen) * 0.02)
    return module.eval().requires_grad_(False)


class Rotor:
    """Cycles through experts between runs, so weights come from memory as in a real layer, not a warm cache."""

    def __init__(self, n: int) -> None:
        self.n, self.i = n, 0

    def next(self, g: int = 1) -> list[int]:
        out = [(self.i + j) % self.n for j in range(g)]
        self.i = (self.i + g) % self.n
        return out


def group_caller(info: BackendInfo, module: torch.nn.Module, caps: list[int], hidden: int,
                 rotor: Rotor) -> Call:
    """One call of the backend over len(caps) experts, as the executor makes it: the backend's own profiling call
    where its registry entry has one, else cpu-exact's for an exact path, else its prepared function of a synthetic
    group (groups over other experts in turn)."""
    g = len(caps)
    x = torch.randn(sum(caps), hidden)
    if info.profile_call is not None:
        return Call(info.profile_call(module, caps, hidden), ())
    if info.exact:
        return Call(lambda: run_exact(module, x, rotor.next(g), caps), (x,))
    backend = info.create()
    n_sets = max(1, module.num_experts // g)
    fns = [backend.prepare(GroupSpec(0, i, tuple(range(i * g, i * g + g)), tuple(caps), module))
           for i in range(n_sets)]
    return Call(lambda: fns[rotor.next()[0] % n_sets](x), (x,))


class _NullStatic:
    """A static backend that computes nothing (identity): isolates the executor's host-side work."""
    name = REFERENCE
    overlaps_cpu = False

    def available(self) -> tuple[bool, str]:
        return True, "null"

    def prepare(self, group):
        return lambda packed: packed


def _layer_executor(module: torch.nn.Module, static: bool, tokens: int, top_k: int, capacity: int,
                    exact: ExactFn = run_exact) -> LayerExecutor:
    e, h, f = module.num_experts, module.hidden_dim, module.intermediate_dim
    groups = [Group(backend=REFERENCE, experts=list(range(i, min(i + 4, e))),
                    capacities=[capacity] * len(range(i, min(i + 4, e)))) for i in range(0, e, 4)]
    lp = LayerPlan(layer=0, groups=groups if static else [], cpu_exact=[] if static else list(range(e)))
    ref = ModelSpec(architecture="profile", model_type="qwen3_moe", num_layers=1, moe_layers=[0], num_experts=e,
                   top_k=top_k, hidden_size=h, expert_ffn_size=f, fingerprint="profile")
    plan = Plan(model=ref, chunk_tokens=tokens, overflow="drop", saliency="router_weight", layers=[lp])
    return LayerExecutor(lp, module, plan, LayerStats(), {REFERENCE: _NullStatic()}, exact=exact)


def random_routing(tokens: int, num_experts: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.multinomial(torch.ones(tokens, num_experts), top_k, replacement=False, generator=gen)
    return idx, torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)


def pack_capacity(tokens: int, top_k: int, num_experts: int, ample: bool) -> int:
    """Per-expert capacity of a pack record: the chunk (ample: nothing overflows, padding is large) or twice the
    mean load (little padding, little overflow), so that slots and assignments vary apart."""
    return tokens if ample else max(1, 2 * tokens * top_k // num_experts)


def host_caller(kind: str, module: torch.nn.Module, tokens: int, top_k: int,
                capacity: int = 0) -> Call:
    """The executor's host-side work for one chunk: `pack` (static path) or `exact_host` (exact path, its expert
    compute replaced by identity, so only the sorting, gathering and scattering are timed)."""
    ex = _layer_executor(module, kind == "pack", tokens, top_k, capacity or tokens, exact=_no_compute)
    x = torch.randn(tokens, module.hidden_dim)
    idx, w = random_routing(tokens, module.num_experts, top_k)
    return Call(lambda: ex(x, idx, w), (x, w))


def _no_compute(module: torch.nn.Module, x_sorted: torch.Tensor, experts: list[int], counts: list[int]
                ) -> torch.Tensor:
    return x_sorted

