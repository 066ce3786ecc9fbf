"""Measured wall time per part of a prefill (what `run --json` reports as `measured_parts_ms`), from forward hooks.

Parts, as the cost model names them (issue 26): `attention_projections` (q/k/v/o and the q/k norms; under a plan's
`qkv` function its input norm too), `attention_core` (the attention block less its projections: rope, the KV cache
update and the core), `experts`, `dense_mlp` (a non-MoE layer's MLP, a shared expert and its gate), `lm_head`, and
`rest` (the whole forward less the others: embeddings, norms, the router, residuals). Each hook pair reads
`time.perf_counter` on the forward's thread; the parts sum to the forwards' wall time.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from runtime.dense.families import dense_mlp, shared_expert
from runtime.stats import PARTS

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def _timed_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(bucket, module) for every module timed: the model itself as `total`, each attention block as `block`."""
    out: list[tuple[str, torch.nn.Module]] = [("total", model)]
    if getattr(model, "lm_head", None) is not None:
        out.append(("lm_head", model.lm_head))
    for layer in model.model.layers:
        attn = layer.self_attn
        out.append(("block", attn))
        out += [("attention_projections", getattr(attn, n)) for n in PROJECTIONS if hasattr(attn, n)]
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            out.append(("experts", experts))
        shared = shared_expert(layer)
        out += [("dense_mlp", m) for m in shared or ()]
        if dense_mlp(layer) is not None:
            out.append(("dense_mlp", layer.mlp))
    return out


class PartTimes:
    """Summed wall time per bucket while collecting; `parts_ms()` turns it into the parts."""

    def __init__(self) -> None:
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()  # calls per bucket
        self.forwards = 0

    def parts_ms(self) -> dict[str, float]:
        s = self.seconds
        core = s["block"] - s["attention_projections"]
        named = {"attention_projections": s["attention_projections"], "attention_core": core,
                 "experts": s["experts"], "dense_mlp": s["dense_mlp"], "lm_head": s["lm_head"]}
        named["rest"] = s["total"] - sum(named.values())
        return {part: round(1e3 * named[part], 3) for part in PARTS}

    def parts_calls(self) -> dict[str, int]:
        """Calls per part: the attention core once per attention block, the rest once per forward."""
        c = self.calls
        return {"attention_projections": c["attention_projections"], "attention_core": c["block"],
                "experts": c["experts"], "dense_mlp": c["dense_mlp"], "lm_head": c["lm_head"], "rest": c["total"]}

    def total_ms(self) -> float:
        return round(1e3 * self.seconds["total"], 3)


@contextmanager
def measured_parts(model: torch.nn.Module, clock: Callable[[], float] = time.perf_counter) -> Iterator[PartTimes]:
    """Collect time per part of every forward of `model` inside the block (a prefill, or several), on `clock`:
    the wall clock, or `time.process_time` for one-thread CPU work on a shared host (what other processes'
    preemption does not inflate)."""
    times, handles, starts = PartTimes(), [], {}

    def pre(key):
        def hook(module, args):
            starts[key] = clock()
        return hook

    def post(key, bucket):
        def hook(module, args, output):
            times.seconds[bucket] += clock() - starts.pop(key)
            times.calls[bucket] += 1
            if bucket == "total":
                times.forwards += 1
        return hook

    for i, (bucket, module) in enumerate(_timed_modules(model)):
        handles.append(module.register_forward_pre_hook(pre(i)))
        handles.append(module.register_forward_hook(post(i, bucket)))
    try:
        yield times
    finally:
        for h in handles:
            h.remove()
