"""How well does the cost model predict a real MoE layer? Measured `LayerExecutor` latency vs `layer_ms`.

One MoE layer (transformers Qwen3Moe experts: hidden 1024, expert FFN 2048, 16 experts, top-2, 512 tokens of
Zipf-skewed routing) runs through the runtime's `LayerExecutor` with the `cpu-static` backend under several plans:
all-exact, all-static (tier capacity, drop), all-static ample (capacity = the chunk: heavy padding), mixed (hot
experts static, the rest exact, spill). The prediction comes from a fresh `profile-device --quick` of this host
(or `--profile FILE`). Plans are interleaved within each repetition so machine noise hits them alike.

Latency is timed on the profile's clock: with one thread that is this process's CPU time (other engineers' jobs on
a shared 2-core host preempt us; CPU time is what an unloaded host would show as latency). Wall-clock medians are
printed beside it. Prints a table, then one JSON line with `max_rel_error` over the plans.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.costing.fitting import fit_cost_model
from autotune.profiling.callers import make_experts
from autotune.profiling.device import profile_device
from autotune.profiling.profile import load_profile, save_profile
from runtime.cpu.cpu_backends import CpuStaticBackend
from runtime.executor import LayerExecutor
from runtime.plan import Group, LayerPlan, ModelSpec, Plan
from runtime.stats import LayerStats

H, F, E, K, T = 1024, 2048, 16, 2, 512


def routing(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 routing of T tokens with Zipf(1.0) expert popularity: a few hot experts, a long tail."""
    g = torch.Generator().manual_seed(seed)
    popularity = 1.0 / torch.arange(1, E + 1).float()
    popularity = popularity[torch.randperm(E, generator=g)]
    idx = torch.multinomial(popularity.expand(T, E), K, replacement=False, generator=g)
    return idx, torch.softmax(torch.randn(T, K, generator=g), dim=-1)


def plans(counts: np.ndarray) -> dict[str, tuple[Plan, LayerPlan]]:
    """The plans under test. Capacities come from the mean load, not from this chunk's counts."""
    mean = T * K // E  # 64
    by_load = [int(e) for e in np.argsort(-counts, kind="stable")]
    hot, cold = sorted(by_load[:8]), sorted(by_load[8:])
    ref = ModelSpec(architecture="bench", model_type="qwen3_moe", num_layers=1, moe_layers=[0], num_experts=E,
                   top_k=K, hidden_size=H, expert_ffn_size=F, fingerprint="bench")

    def groups(experts: list[int], cap: int) -> list[Group]:
        return [Group(backend="cpu-static", experts=experts[i:i + 4], capacities=[cap] * len(experts[i:i + 4]))
                for i in range(0, len(experts), 4)]

    layer_plans = {
        "all-exact": (LayerPlan(layer=0, groups=[], cpu_exact=list(range(E))), "drop"),
        "all-static tier 1.5x mean, drop": (LayerPlan(layer=0, groups=groups(list(range(E)), mean * 3 // 2),
                                                      cpu_exact=[]), "drop"),
        "all-static ample (512), drop": (LayerPlan(layer=0, groups=groups(list(range(E)), T), cpu_exact=[]), "drop"),
        "mixed: 8 hot static 2x mean, spill": (LayerPlan(layer=0, groups=groups(hot, 2 * mean), cpu_exact=cold),
                                               "spill"),
    }
    return {name: (Plan(model=ref, chunk_tokens=T, overflow=ov, saliency="router_weight", layers=[lp]), lp)
            for name, (lp, ov) in layer_plans.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="use this profile instead of measuring a fresh --quick one")
    ap.add_argument("--save-profile", default=None, help="where to keep the fresh profile")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.profile:
        profile = load_profile(args.profile)
    else:
        t0 = time.perf_counter()
        profile = profile_device(quick=True, threads=args.threads)
        print(f"fresh profile-device --quick: {time.perf_counter() - t0:.0f} s, held-out MAPE "
              + ", ".join(f"{k} {v:.1%}" for k, v in profile.heldout_mape.items() if v is not None))
        out = args.save_profile or Path(tempfile.mkdtemp()) / "profile.json"
        save_profile(profile, out)
        print(f"saved it to {out}")
    clock = "cpu" if profile.settings.get("threads", 1) == 1 and args.threads == 1 else "wall"
    model = profile.cost_model

    module = make_experts(H, F, E)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    idx, w = routing()
    counts = np.bincount(idx.reshape(-1).numpy(), minlength=E)
    cases = plans(counts)
    execs = {name: LayerExecutor(lp, module, plan, LayerStats(), {"cpu-static": CpuStaticBackend()})
             for name, (plan, lp) in cases.items()}
    cpu: dict[str, list[float]] = {n: [] for n in cases}
    wall: dict[str, list[float]] = {n: [] for n in cases}
    with torch.inference_mode():
        for ex in execs.values():
            ex(x, idx, w)  # warm-up
        for _ in range(args.repeats):
            for name, ex in execs.items():
                c0, t0 = time.process_time(), time.perf_counter()
                ex(x, idx, w)
                wall[name].append((time.perf_counter() - t0) * 1e3)
                cpu[name].append((time.process_time() - c0) * 1e3)

    print(f"\nlayer: hidden {H}, expert FFN {F}, {E} experts, top-{K}, {T} tokens; loads {counts.tolist()}")
    print(f"threads {args.threads}; measured = median of {args.repeats} on the {clock} clock; "
          f"profile {profile.path or '(fresh, in memory)'}\n")
    # For reference only: the same records' wall-clock medians, refitted, against the layer's wall clock. On a
    # shared host both sides carry other people's load, so this column says how much that load moves things.
    wall_model = None
    if clock == "cpu" and all("wall_median_ms" in r for r in profile.records):
        wall_model = fit_cost_model([{**r, "median_ms": r["wall_median_ms"]} for r in profile.records])
    print(f"{'plan':38s} {'measured ms':>12s} {'predicted ms':>13s} {'rel error':>10s}   "
          f"{'wall ms':>9s} {'wall pred':>9s} {'wall err':>9s}")
    errors, wall_errors = {}, {}
    for name, (plan, lp) in cases.items():
        measured = statistics.median(cpu[name] if clock == "cpu" else wall[name])
        predicted = model.layer_ms(lp, counts, H, F, plan.overflow)
        errors[name] = abs(predicted - measured) / measured
        w_meas = statistics.median(wall[name])
        w_pred = wall_model.layer_ms(lp, counts, H, F, plan.overflow) if wall_model else float("nan")
        wall_errors[name] = (w_pred - w_meas) / w_meas
        print(f"{name:38s} {measured:12.2f} {predicted:13.2f} {(predicted - measured) / measured:+10.1%}   "
              f"{w_meas:9.2f} {w_pred:9.2f} {wall_errors[name]:+9.1%}")
    print(json.dumps({"max_rel_error": round(max(errors.values()), 4),
                      "rel_error": {k: round(v, 4) for k, v in errors.items()}, "clock": clock,
                      "wall_clock_rel_error_for_reference": {k: round(v, 4) for k, v in wall_errors.items()},
                      "threads": args.threads, "layer": {"hidden": H, "ffn": F, "experts": E, "top_k": K,
                                                          "tokens": T}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
