"""The search at a paper shape: how close its plan comes to the compute roofline, and how long it takes.

1. Small instance: 8 experts, 2 layers, synthetic skewed traces. The Optuna search alone (exact enumeration off)
   against the exact optimum of the same space and cost model: `gap_vs_exact` (relative; 0 = optimal); and with the
   dense decisions in the space (`gap_vs_exact_whole`: the whole prefill, the experts' search plus the search's
   dense choice against the exact experts plus the best of every joint dense placement, enumerated;
   `dense_gap_vs_exact`: the dense choice alone against that enumeration).
2. A paper shape (`--shape`: Qwen3-30B-A3B, 48 layers x 128 experts, top-8; or Phi-3.5-MoE, 32 x 16, top-2) on
   Zipf(`--skew`) synthetic token-level traces of `--prompts` prompts of `--prompt-tokens` tokens: the whole search
   (chunk size among 256..4096, compression among `--compress`, every layer's decision) with its robustness
   analysis and the `--robust` pick, timed together (`search_seconds`, goal <= 120 s on a 2-core machine).
   `over_roofline`: the plan's predicted expert time per token over the profile's compute roofline per token
   (GFLOP per token / the ANE's and the CPU's throughput together).
All on the published-figures M2 Ultra profile (predicted costs). Prints, last, one JSON line.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from collections import Counter

from make_shape_twin import twin_config  # scripts/: the published configs of the paper's models

from autotune.calibration.traces import synthetic_traces
from autotune.costing.memory import ModelSize, predicted_memory_gb
from autotune.costing.whole_prefill import DecoderShape, DensePlacement, gflop_per_ms, predict_prefill, prompt_chunks
from autotune.profiling.profile import load_profile
from autotune.searching.dense_choice import NO_EXPERTS, ROW_GRAIN, choose_dense
from autotune.searching.layer_data import LayerData
from autotune.searching.optimizer import best_plan, chunk_candidates, optuna_layer, run_search, solution_plan
from autotune.searching.report import cpu_ms_per_token
from autotune.searching.robustness import assess
from autotune.searching.scoring import Scorer
from autotune.searching.space import layer_space
from runtime.plan import COMPRESSIONS

SMALL = dict(architecture="synthetic", model_type="qwen3_moe", num_layers=2, moe_layers=[0, 1], num_experts=8,
             top_k=2, hidden_size=1024, expert_ffn_size=512, fingerprint="synthetic-small")
SHAPES = {  # published configs (config.json of each model); context = max_position_embeddings
    "qwen3-30b-a3b": (dict(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", num_layers=48,
                           moe_layers=list(range(48)), num_experts=128, top_k=8, hidden_size=2048,
                           expert_ffn_size=768, fingerprint="synthetic-qwen3-30b-a3b"), 40960),
    "phi-3.5-moe": (dict(architecture="PhiMoEForCausalLM", model_type="phimoe", num_layers=32,
                         moe_layers=list(range(32)), num_experts=16, top_k=2, hidden_size=4096, expert_ffn_size=6400,
                         fingerprint="synthetic-phi-3.5-moe"), 131072),
}
SMALL_DECODER = DecoderShape(hidden=1024, heads=8, kv_heads=2, head_dim=128, vocab=32000, num_layers=2,
                             moe_layers=(0, 1), num_experts=8, top_k=2, expert_ffn=512, context=4096)
SMALL_PROMPT = 256
RESIDENT_BYTES = 64e9  # all layers: a 64 GB budget for resident expert weights


def best_dense_enumerated(cost, chunk: int) -> float:
    """The least latency of the small instance's dense parts over every joint placement: q/k/v and o_proj each on
    the host or the ANE (whole or split at each multiple of ROW_GRAIN), the attention core unblocked (any subset of
    the full chunks' contexts as buckets, whole or split) or in causal blocks of any multiple of ROW_GRAIN below the
    chunk dividing it (any subset of the blocks' key lengths as buckets, whole or split at a multiple of the
    block); the host is the one `choose_dense` gives (the GPU where the profile prices it, else the CPU)."""
    rows = [None, *range(ROW_GRAIN, chunk, ROW_GRAIN)]
    starts = [c - r for r, c in prompt_chunks(SMALL_PROMPT, chunk) if r == chunk]
    functions = [None, *[("ane", r) for r in rows]]
    cores = []  # (block, buckets, static rows)
    for block in [None, *range(ROW_GRAIN, chunk, ROW_GRAIN)]:
        if block and chunk % block:
            continue
        step = block or chunk
        keys = sorted({s + e for s in starts for e in range(step, chunk + 1, step)})
        subsets = [c for n in range(1, len(keys) + 1) for c in itertools.combinations(keys, n)]
        cores += [(block, b, r) for b in subsets for r in [None, *range(step, chunk, step)]]
    best = float("inf")
    for qkv, o, core in itertools.product(functions, functions, [None, *cores]):
        split = tuple((f, p[1]) for f, p in (("qkv", qkv), ("o_proj", o)) if p and p[1])
        block, buckets, r = core or (None, (), None)
        split += (("attention", r),) if r else ()
        place = DensePlacement(qkv and "ane", o and "ane", "ane" if core else None, None, buckets, split, block,
                               cost.plan_exact())  # the host the search's choice has: the GPU where priced
        best = min(best, predict_prefill(cost, SMALL_DECODER, SMALL_PROMPT, chunk, NO_EXPERTS, place).latency_ms)
    return best


def small_gap(cost, trials: int, seeds: int) -> dict:
    """Mean and worst gap of the Optuna-only search over several seeds and trace draws, the experts alone and the
    whole prefill (with the dense decisions)."""
    gaps, whole, dense = [], [], []
    for seed in range(seeds):
        layers = LayerData.from_traces(synthetic_traces(SMALL, 40, 256, skew=1.2, seed=seed))
        scorer = Scorer(cost, SMALL["hidden_size"], SMALL["expert_ffn_size"], "ane", 1e12)
        space = layer_space(SMALL["num_experts"], split_exact=scorer.splits_exact)
        budget = int(0.10 * sum(int(d.heldout.sum()) for d in layers))
        exact = run_search(layers, scorer, space, trials=0, progress=False)
        at = exact.chunks[exact.best.chunk_tokens]
        searched = [optuna_layer(d, scorer, space, "latency", trials, None, f"small{seed}:L{d.layer}", seed + d.layer)
                    for d in layers]
        found = best_plan(at, space, scorer, budget, (1.0, 0.0, 0.0), pool=searched)
        gaps.append(found.latency_ms / exact.best.latency_ms - 1.0)
        prompts = float(layers[0].tokens.sum()) / SMALL_PROMPT
        chunk = exact.best.chunk_tokens
        chosen = choose_dense(cost, SMALL_DECODER, SMALL_PROMPT, chunk, "ane", (1.0, 0.0, 0.0), 1.0)
        enumerated = best_dense_enumerated(cost, chunk)
        dense.append(chosen.prediction.latency_ms / enumerated - 1.0)
        whole.append((found.latency_ms + prompts * chosen.prediction.latency_ms)
                     / (exact.best.latency_ms + prompts * enumerated) - 1.0)
    return {"gap_vs_exact": max(gaps), "gap_vs_exact_mean": sum(gaps) / len(gaps), "seeds": seeds,
            "gap_vs_exact_whole": max(whole), "dense_gap_vs_exact": max(dense)}


def roofline_ms_per_token(cost, spec: dict) -> float:
    """GFLOP per token of the experts (top-k gated FFNs, every MoE layer) / (ANE + CPU [+ GPU] GFLOP per ms)."""
    gflop = len(spec["moe_layers"]) * spec["top_k"] * 6.0 * spec["hidden_size"] * spec["expert_ffn_size"] / 1e9
    return gflop / gflop_per_ms([cost.models[b].ms_per_gflop for b in {"ane", "cpu-exact", cost.plan_exact()}])


def shape_search(cost, shape: str, skew: float, compress: tuple[str, ...], prompt_tokens: int, prompts: int,
                 trials: int, layers: int | None = None) -> dict:
    spec, context = SHAPES[shape]
    if layers:  # the first `layers` MoE layers only (a quicker probe; per-token figures are per those layers)
        spec = {**spec, "num_layers": layers, "moe_layers": spec["moe_layers"][:layers]}
    traces = synthetic_traces(spec, prompts, prompt_tokens, skew=skew, tokens=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    workloads = {c: LayerData.from_traces(traces, c, prompt_tokens) for c in chunk_candidates(prompt_tokens, context)}
    scorer = Scorer(cost, spec["hidden_size"], spec["expert_ffn_size"], "ane", RESIDENT_BYTES / len(spec["moe_layers"]))
    out = run_search(workloads, scorer, layer_space(spec["num_experts"], compress, scorer.splits_exact),
                     trials=trials, progress=True)
    robust_plan, robust = assess(out, scorer, pick=True)  # the nominal plan's regret too
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(int(t) for t in out.layers[0].tokens)
    roof = roofline_ms_per_token(cost, spec)
    per_token = {k: v.latency_ms / tokens for k, v in out.baselines.items()}
    return {"shape": shape, "skew": skew, "compress_allowed": list(compress), "search_seconds": seconds,
            "search_cpu_seconds": cpu_seconds,  # this process's CPU time: what the wall time is on an idle machine
            "over_roofline": out.best.latency_ms / tokens / roof,
            "robust_over_roofline": robust_plan.latency_ms / tokens / roof,
            "roofline_us_per_token": roof * 1e3, "plan_us_per_token": out.best.latency_ms / tokens * 1e3,
            "baselines_us_per_token": {k: v * 1e3 for k, v in per_token.items()},
            "chunk_tokens": out.best.chunk_tokens, "robust_chunk_tokens": robust_plan.chunk_tokens,
            "chunks_searched": sorted(out.chunks),
            "chunk_us_per_token": {c: s.best.latency_ms / tokens * 1e3 for c, s in sorted(out.chunks.items())
                                   if s.best},
            "compress": dict(Counter(c.compress for c in out.best.configs if c.resident)),
            "partial_chunks": "exact" if out.best.exact_partial else "static",
            "heldout_drop_rate": out.best.heldout_drops / sum(int(d.heldout.sum()) for d in out.layers),
            "plan": plan_summary(out.best.configs),
            "max_regret": robust.nominal_max_regret, "robust_max_regret": robust.max_regret,
            "robust_regret": {c["case"]: c["regret"] for c in robust.cases},
            "robust_cost_of_robustness": robust.cost_of_robustness,
            "robust_compress": dict(Counter(c.compress for c in robust_plan.configs if c.resident)),
            "prompt_tokens": prompt_tokens, "calib_tokens": tokens, "trials_per_layer": trials,
            "layers": len(spec["moe_layers"]),
            **memory_and_cpu(out, scorer, spec, shape, prompt_tokens)}


def memory_and_cpu(out, scorer, spec: dict, shape: str, prompt_tokens: int) -> dict:
    """The plan's predicted peak memory (the whole model at the shape's published config, bf16, on the meta device;
    ANE packages of the searched layers) and each design's predicted CPU-busy ms per token (plan and baselines)."""
    config = twin_config(shape, SHAPES[shape][0]["num_layers"])
    size = ModelSize.of_config(config, 2)
    at = out.chunks[out.best.chunk_tokens].layers
    plan = solution_plan(out.best, at, scorer, spec)
    cpu = {"plan": cpu_ms_per_token(out.best, at)}
    cpu |= {name: cpu_ms_per_token(sol, out.chunks[sol.chunk_tokens].layers) for name, sol in out.baselines.items()}
    return {"predicted_memory_gb": predicted_memory_gb(plan, size, prompt_tokens), "cpu_ms_per_token": cpu}


def plan_summary(configs) -> dict:
    """What the plan decided, summed over layers: resident experts, group sizes, tiers, overflow policy."""
    resident = [c.resident for c in configs]
    return {"mean_resident_experts": sum(resident) / len(resident), "min_resident": min(resident),
            "max_resident": max(resident), "group_sizes": dict(Counter(c.group_size for c in configs if c.resident)),
            "tiers": dict(Counter(c.tiers for c in configs if c.resident)),
            "overflow": sorted({c.overflow for c in configs if c.resident})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="apple-m2-ultra-published")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--skew", type=float, default=1.1, help="Zipf skew of the synthetic routing (default 1.1)")
    ap.add_argument("--compress", default=",".join(COMPRESSIONS),
                    help="weight storage kinds the search may use (default all: none,int8,palettize4)")
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="prompt length (default 4096)")
    ap.add_argument("--prompts", type=int, default=10, help="synthetic prompts (every 5th held out; default 10)")
    ap.add_argument("--trials", type=int, default=40, help="Optuna trials per layer (default 40)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the small-instance gap check (0: skip it)")
    ap.add_argument("--layers", type=int, help="search only the first N MoE layers (default: all)")
    args = ap.parse_args()
    import warnings

    warnings.simplefilter("ignore")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cost = load_profile(args.profile).cost_model
    small = small_gap(cost, args.trials, args.seeds) if args.seeds else {}
    if small:
        print(f"small instance (8 experts, 2 layers): Optuna alone vs exact optimum: worst gap "
              f"{small['gap_vs_exact']:+.3%}, mean {small['gap_vs_exact_mean']:+.3%} over {args.seeds} seeds")
    big = shape_search(cost, args.shape, args.skew, tuple(args.compress.split(",")), args.prompt_tokens,
                       args.prompts, args.trials, args.layers)
    print(f"{args.shape} (skew {args.skew}): search + robustness took {big['search_seconds']:.1f} s "
          f"({big['search_cpu_seconds']:.1f} s of CPU); plan "
          f"{big['plan_us_per_token']:.0f} us/token = {big['over_roofline']:.2f}x the roofline "
          f"({big['roofline_us_per_token']:.0f} us/token), chunk {big['chunk_tokens']}, compress {big['compress']} "
          f"(predicted); per chunk size: " +
          ", ".join(f"{c} {v:.0f}" for c, v in big["chunk_us_per_token"].items()) + " us/token")
    print(f"{args.shape}: regret under perturbed profiles (predicted): worst {big['max_regret']:.2%}; the --robust "
          f"pick's worst {big['robust_max_regret']:.2%} at {big['robust_over_roofline']:.2f}x the roofline")
    print(json.dumps({**small, **big, "profile": args.profile}))


if __name__ == "__main__":
    main()
