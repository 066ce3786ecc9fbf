"""One MoE layer, side by side in one process: our executor (all-exact plan, all-static ample plan) against
transformers' `grouped_mm` (its default) and its eager loop.

Layer: hidden 1024, expert FFN 2048, 16 experts, top-2, 512 tokens; balanced and skewed loads; 1 and 2 threads.
Implementations are interleaved within each repetition so that machine noise hits them alike, in an order that
changes every repetition (a balanced Latin square: each runs in every position and after every other one equally
often), so that no implementation always follows the same one on a shared host. Prints a table, then one JSON
line with `ratio_exact_vs_grouped_mm` = their time / ours (medians, 1 thread, worst of the loads), and the same
ratio of CPU time (`ratio_exact_vs_grouped_mm_cpu`: the process's CPU seconds per call, which time spent waiting
for a core on a shared host does not inflate).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from runtime.cpu.cpu_backends import CpuStaticBackend
from runtime.executor import LayerExecutor
from runtime.plan import Group, LayerPlan, ModelSpec, Plan
from runtime.stats import LayerStats

H, F, E, K, T = 1024, 2048, 16, 2, 512


def make_experts() -> torch.nn.Module:
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K)
    module = Qwen3MoeExperts(config)
    torch.manual_seed(0)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.02)
        module.down_proj.normal_(0, 0.02)
    return module.eval()


def make_routing(load: str, seed: int = 0, tokens: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 routing of `tokens` tokens: `balanced` (uniform popularity) or `skewed` (Zipf, s=1.2)."""
    g = torch.Generator().manual_seed(seed)
    popularity = torch.ones(E) if load == "balanced" else 1.0 / torch.arange(1, E + 1).float() ** 1.2
    idx = torch.multinomial(popularity.expand(tokens, E), K, replacement=False, generator=g)
    weights = torch.softmax(torch.randn(tokens, K, generator=g), dim=-1)
    return idx, weights


def make_plan(static: bool) -> tuple[Plan, LayerPlan]:
    groups = [Group(backend="cpu-static", experts=list(range(i, i + 4)), capacities=[T] * 4) for i in range(0, E, 4)]
    lp = LayerPlan(layer=0, groups=groups if static else [], cpu_exact=[] if static else list(range(E)))
    ref = ModelSpec(architecture="bench", model_type="qwen3_moe", num_layers=1, moe_layers=[0], num_experts=E, top_k=K,
                   hidden_size=H, expert_ffn_size=F, fingerprint="bench")
    return Plan(model=ref, chunk_tokens=T, overflow="drop", saliency="router_weight", layers=[lp]), lp


def implementations(module: torch.nn.Module) -> dict:
    def transformers_impl(name):
        def run(x, idx, w):
            module.config._experts_implementation = name
            return module(x, idx, w)
        return run

    ours = {}
    for label, static in (("npumoe all-exact", False), ("npumoe all-static ample", True)):
        plan, lp = make_plan(static)
        ours[label] = LayerExecutor(lp, module, plan, LayerStats(), {"cpu-static": CpuStaticBackend()})
    return {**ours, "transformers grouped_mm": transformers_impl("grouped_mm"),
            "transformers eager": transformers_impl("eager")}


def latin_orders(n: int) -> list[list[int]]:
    """Williams' balanced Latin square for an even `n`: row r is an order of range(n); over the n rows each item
    takes every position once and follows every other item once (for odd n the mirrored rows are added)."""
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    rows = [[(v + r) % n for v in first] for r in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def bench(threads: int, load: str, impls: dict, x: torch.Tensor, repeats: int, reference: str = "transformers eager",
          tolerance: dict[str, float] | None = None) -> tuple[dict, dict]:
    """Median wall ms and median CPU ms per implementation (each checked against `reference` first)."""
    torch.set_num_threads(threads)
    idx, w = make_routing(load, tokens=x.shape[0])
    times: dict[str, list[float]] = {name: [] for name in impls}
    cpu: dict[str, list[float]] = {name: [] for name in impls}
    with torch.inference_mode():
        outs = {name: fn(x, idx, w) for name, fn in impls.items()}  # warm-up, and a parity check
        ref = outs[reference].float()
        for name, out in outs.items():
            err = float((out.float() - ref).abs().max() / ref.abs().max())
            assert err < (tolerance or {}).get(name, 1e-4), f"{name} disagrees with {reference}: {err:.2e}"
        names, orders = list(impls), latin_orders(len(impls))
        for r in range(repeats):
            for i in orders[r % len(orders)]:
                c0, t0 = time.process_time(), time.perf_counter()
                impls[names[i]](x, idx, w)
                times[names[i]].append((time.perf_counter() - t0) * 1e3)
                cpu[names[i]].append((time.process_time() - c0) * 1e3)
    return ({name: statistics.median(ts) for name, ts in times.items()},
            {name: statistics.median(ts) for name, ts in cpu.items()})


# Quantization error of one layer's output against bf16 (relative to its largest value), at most.
TOLERANCE = {"int8": 0.05, "int4": 0.3}


def quantized_section(kinds: list[str], threads: int, repeats: int, group_size: int) -> dict:
    """bf16 experts through transformers' grouped_mm against our exact path over int8 / int4 experts (all-exact
    plan), at a 512-token chunk and a decode step (one token), side by side: each storage with the kernel its
    defaults pick (`npumoe exact <kind>`) and with each of its kernels forced (`<kind> <kernel>`); each one's
    relative error against bf16 (max |difference| / max |bf16 output| of the layer)."""
    from runtime.cpu.cpu_weights import KERNELS, quantize_experts

    module = make_experts().to(torch.bfloat16)
    impls = {"bf16 grouped_mm": lambda x, idx, w: module(x, idx, w)}
    module.config._experts_implementation = "grouped_mm"
    stores, tol = {}, {}

    def forced(executor, store, kernel_rows):
        def run(x, idx, w):
            saved, store.kernel_rows = store.kernel_rows, kernel_rows
            try:
                return executor(x, idx, w)
            finally:
                store.kernel_rows = saved
        return run

    for kind in kinds:
        q = copy.deepcopy(module)
        quantize_experts(q, kind, group_size)
        plan, lp = make_plan(False)
        executor = LayerExecutor(lp, q, plan, LayerStats(), {})
        stores[kind] = store = q.npumoe_weights
        impls[f"npumoe exact {kind}"] = executor
        tol[f"npumoe exact {kind}"] = TOLERANCE[kind]
        for kernel in KERNELS[kind]:
            impls[f"{kind} {kernel}"] = forced(executor, store, {kernel: 0})
            tol[f"{kind} {kernel}"] = TOLERANCE[kind]
    out: dict = {}
    for label, tokens, reps in (("prefill 512", T, repeats), ("decode 1", 1, repeats * 8)):
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        med, cpu = bench(threads, "balanced", impls, x, reps, "bf16 grouped_mm", tol)
        idx, w = make_routing("balanced", tokens=tokens)
        with torch.inference_mode():
            ref = impls["bf16 grouped_mm"](x, idx, w).float()
            errors = {n: float((fn(x, idx, w).float() - ref).abs().max() / ref.abs().max())
                      for n, fn in impls.items() if n != "bf16 grouped_mm"}
        rows = tokens * K // E if tokens > 1 else 1  # rows per expert at a balanced load
        out[label] = {"median_ms": med, "median_cpu_ms": cpu,
                      **{f"speed_{k}_vs_bf16_grouped_mm": med["bf16 grouped_mm"] / med[f"npumoe exact {k}"]
                         for k in kinds},
                      **{f"speed_{k}_vs_bf16_grouped_mm_cpu": cpu["bf16 grouped_mm"] / cpu[f"npumoe exact {k}"]
                         for k in kinds},
                      "speed_vs_bf16_grouped_mm": {n: med["bf16 grouped_mm"] / m for n, m in med.items()},
                      "speed_vs_bf16_grouped_mm_cpu": {n: cpu["bf16 grouped_mm"] / m for n, m in cpu.items()},
                      "rel_error_vs_bf16": errors,
                      "kernel": {k: stores[k].kernel(rows) for k in kinds}, "rows_per_expert": rows}
        print(f"{label:>12}: " + ", ".join(f"{n} {med[n]:.2f} ms (x{med['bf16 grouped_mm'] / med[n]:.2f})"
                                           for n in impls)
              + "; kernels " + ", ".join(f"{k} {stores[k].kernel(rows)}" for k in kinds))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=8, help="repetitions (default 8: two rounds of the order square)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--cpu-weights", default="", help="comma-separated int8,int4: also time experts stored so "
                    "against bf16 grouped_mm (first thread count), at a 512-token chunk and a decode step")
    ap.add_argument("--group-size", type=int, default=64, help="int4 group size (default 64)")
    args = ap.parse_args()
    module = make_experts()
    impls = implementations(module)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        for load in ("balanced", "skewed"):
            med, cpu = bench(threads, load, impls, x, args.repeats)
            rows.append((threads, load, med, cpu))
    names = list(impls)
    print(f"one MoE layer: H={H} F={F} E={E} top-{K} T={T}; median ms of {args.repeats} interleaved runs (measured)")
    print(f"{'threads':>7} {'load':>9} " + " ".join(f"{n:>24}" for n in names) + f" {'grouped_mm/exact':>17}")
    for threads, load, med, _ in rows:
        ratio = med["transformers grouped_mm"] / med["npumoe all-exact"]
        print(f"{threads:>7} {load:>9} " + " ".join(f"{med[n]:>24.1f}" for n in names) + f" {ratio:>17.2f}")
    one = [med for threads, _, med, _ in rows if threads == 1] or [rows[0][2]]
    one_cpu = [cpu for threads, _, _, cpu in rows if threads == 1] or [rows[0][3]]
    result = {
        "ratio_exact_vs_grouped_mm": min(m["transformers grouped_mm"] / m["npumoe all-exact"] for m in one),
        "ratio_exact_vs_eager": min(m["transformers eager"] / m["npumoe all-exact"] for m in one),
        "ratio_static_ample_vs_grouped_mm": min(m["transformers grouped_mm"] / m["npumoe all-static ample"]
                                                for m in one),
        "ratio_exact_vs_grouped_mm_cpu": min(m["transformers grouped_mm"] / m["npumoe all-exact"] for m in one_cpu),
        "median_ms": {f"{t}t/{load}": med for t, load, med, _ in rows},
        "median_cpu_ms": {f"{t}t/{load}": cpu for t, load, _, cpu in rows},
    }
    if args.cpu_weights:
        kinds = args.cpu_weights.split(",")
        result["cpu_weights"] = quantized_section(kinds, int(args.threads.split(",")[0]), args.repeats,
                                                  args.group_size)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
