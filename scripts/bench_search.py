"""The search against the exact optimum on a small instance, and its wall time at Qwen3-30B-A3B's shape.

1. Small instance: 8 experts, 2 layers, synthetic skewed traces. The Optuna search alone (exact enumeration off)
   against the exact optimum of the same space and cost model: `gap_vs_exact` (relative; 0 = optimal).
2. Qwen3-30B-A3B shape: 48 layers, 128 experts, top-8, hidden 2048, expert FFN 768, Zipf-skewed synthetic
   traces; the full search's wall time: `search_seconds_qwen3_30b` (goal <= 120 s on a 2-core machine).
   Then its regret under perturbed profiles (autotune.searching.robustness), and the energy ratios against the baselines
   where the profile has power (the paper reports 1.81-7.37x better energy efficiency, measured).
Both on the published-figures M2 Ultra profile (predicted costs). Prints, last, one JSON line.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from autotune.calibration.traces import synthetic_traces
from autotune.profiling.profile import load_profile
from autotune.searching.optimizer import _best_over_overflow, exact_layer, optuna_layer, run_search
from autotune.searching.robustness import assess
from autotune.searching.space import LayerData, Scorer

SMALL = dict(architecture="synthetic", model_type="qwen3_moe", num_layers=2, moe_layers=[0, 1], num_experts=8,
             top_k=2, hidden_size=1024, expert_ffn_size=512, fingerprint="synthetic-small")
QWEN3_30B = dict(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", num_layers=48,
                 moe_layers=list(range(48)), num_experts=128, top_k=8, hidden_size=2048, expert_ffn_size=768,
                 fingerprint="synthetic-qwen3-30b-a3b")


def small_gap(cost, trials: int, seeds: int) -> dict:
    """Mean and worst gap of the Optuna-only search over several seeds and trace draws."""
    gaps = []
    for seed in range(seeds):
        layers = LayerData.from_traces(synthetic_traces(SMALL, 40, 256, skew=1.2, seed=seed))
        scorer = Scorer(cost, SMALL["hidden_size"], SMALL["expert_ffn_size"], "ane", 1e12)
        budget = int(0.10 * sum(int(d.heldout.sum()) for d in layers))
        searched = [optuna_layer(d, scorer, "latency", trials, None, f"small{seed}:L{d.layer}", seed + d.layer)
                    for d in layers]
        exact = [exact_layer(d, scorer) for d in layers]
        w = (1.0, 0.0)
        found = _best_over_overflow(searched, layers, scorer, budget, w)
        best = _best_over_overflow(exact, layers, scorer, budget, w)
        gaps.append(found.latency_ms / best.latency_ms - 1.0)
    return {"gap_vs_exact": max(gaps), "gap_vs_exact_mean": sum(gaps) / len(gaps), "seeds": seeds}


def qwen3_search(cost, trials: int, objective: str = "latency") -> dict:
    t0 = time.perf_counter()
    traces = synthetic_traces(QWEN3_30B, 20, 512, skew=1.1)
    layers = LayerData.from_traces(traces)
    scorer = Scorer(cost, QWEN3_30B["hidden_size"], QWEN3_30B["expert_ffn_size"], "ane", 64e9 / 48)
    out = run_search(layers, scorer, objective=objective, trials=trials, chunk_tokens=512, progress=True)
    seconds = time.perf_counter() - t0
    n = layers[0].calib.shape[0]
    t1 = time.perf_counter()
    _, nominal = assess(out, layers, scorer, n)
    robust_plan, robust = assess(out, layers, scorer, n, pick=True)
    robust_seconds = time.perf_counter() - t1
    base = {k: v.latency_ms / n for k, v in out.baselines.items()}
    energy = None if out.best.energy_mj is None else {k: v.energy_mj / out.best.energy_mj
                                                      for k, v in out.baselines.items() if v.energy_mj is not None}
    return {"search_seconds_qwen3_30b": seconds, "qwen3_30b_predicted_latency_ms": out.best.latency_ms / n,
            "qwen3_30b_baselines_ms": base,
            "qwen3_30b_predicted_energy_mj": None if out.best.energy_mj is None else out.best.energy_mj / n,
            "qwen3_30b_energy_ratio_vs": energy,
            "qwen3_30b_heldout_drop_rate": out.best.heldout_drops / sum(int(d.heldout.sum()) for d in layers),
            "qwen3_30b_plan": plan_summary(out.best.configs),
            "qwen3_30b_max_regret": nominal.max_regret, "qwen3_30b_regret_objective": nominal.objective,
            "qwen3_30b_regret": {c["case"]: c["regret"] for c in nominal.cases},
            "qwen3_30b_robust_max_regret": robust.max_regret,
            "qwen3_30b_robust_latency_ms": robust_plan.latency_ms / n,
            "qwen3_30b_robustness_seconds": robust_seconds}


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
    ap.add_argument("--trials", type=int, default=100, help="Optuna trials per layer (default 100)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--objective", choices=["latency", "energy", "both"], default="latency",
                    help="the Qwen3-30B-A3B search's objective (energy and both need a profile with power)")
    args = ap.parse_args()
    import warnings

    warnings.simplefilter("ignore")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cost = load_profile(args.profile).cost_model
    small = small_gap(cost, args.trials, args.seeds)
    print(f"small instance (8 experts, 2 layers): Optuna alone vs exact optimum: worst gap "
          f"{small['gap_vs_exact']:+.3%}, mean {small['gap_vs_exact_mean']:+.3%} over {args.seeds} seeds")
    big = qwen3_search(cost, args.trials, args.objective)
    print(f"Qwen3-30B-A3B shape (48 x 128 experts, top-8): search took {big['search_seconds_qwen3_30b']:.1f} s; "
          f"predicted {big['qwen3_30b_predicted_latency_ms']:.2f} ms per chunk vs " +
          ", ".join(f"{k} {v:.2f}" for k, v in big["qwen3_30b_baselines_ms"].items()) + " (predicted)")
    print(f"Qwen3-30B-A3B shape: plan {big['qwen3_30b_plan']}; regret under perturbed profiles "
          f"({big['qwen3_30b_regret_objective']}, predicted): "
          f"worst {big['qwen3_30b_max_regret']:.2%} (" + ", ".join(f"{k} {v:.2%}" for k, v in
                                                         big["qwen3_30b_regret"].items()) +
          f"); the --robust pick's worst {big['qwen3_30b_robust_max_regret']:.2%}")
    if big["qwen3_30b_energy_ratio_vs"]:
        print("Qwen3-30B-A3B shape: baseline energy / plan energy (predicted): " +
              ", ".join(f"{k} {v:.2f}x" for k, v in big["qwen3_30b_energy_ratio_vs"].items()) +
              "; the paper reports 1.81-7.37x better energy efficiency (measured, against its baselines)")
    print(json.dumps({**small, **big, "profile": args.profile, "trials_per_layer": args.trials,
                      "objective": args.objective}))


if __name__ == "__main__":
    main()
