"""The whole prefill at a paper shape: the search with its dense decisions, against the paper's baselines.

    python scripts/bench_prefill.py --shape qwen3-30b-a3b --prompt-tokens 4096 [--objective latency|energy|cpu]

On Zipf(`--skew`) synthetic token-level traces of `--prompts` prompts at the shape's published config
(scripts/make_shape_twin.py), the search (chunk size, every layer's expert decision, the dense functions'
placement) on the published M2 Ultra profile, timed (`search_seconds`); then the plan's whole prefill of one prompt
and every whole-model baseline (`autotune.searching.prefill_report`; `mlx-gpu`: every op on the GPU through MLX),
all predicted by the cost model. Prints, last, one JSON line: `predicted_prefill_ms`, `predicted_parts_ms`,
`chunk_tokens`, `over_roofline_whole`, `vs` (each baseline's latency, energy and CPU-busy time over the plan's),
`search_seconds`, `tradeoff` (the candidate plans' latency and energy; `--chart PATH` draws them), `in_flight`,
`predicted_schedule` (each unit's busy and idle ms with two chunks in flight, the default; `--timeline PATH` draws
its first layers); the plan and every top-level figure are the fastest schedule the runtime runs (whole chunks:
`runtime_executes` true, `executable` the same figures; `chunk_rows` where an uneven two-chunk split is the plan),
`half_chunk` the fastest half-chunk schedule beside it (a micro-pipeline inside each chunk the runtime does not run:
its latency, `vs_mlx_gpu_latency`, `over_roofline_whole`, units), `by_chunk` and `half_chunks` (each chunk size's
best of each shape; `by_chunk` also two uneven two-chunk splits, keyed "first+second"),
`one_in_flight_ms` (the search's plan as a chain), `unit_bound` (the least makespan any split of
the prompt's FLOPs over the units reaches within the GPU alone's energy, with and without the CPU: what caps `vs`
and `over_roofline_whole`; `autotune.costing.unit_bound`), `priced_bound` (per chunk size the search tried, the
least makespan any split of the prompt's ops reaches at the cost model's own prices, within the GPU alone's energy
and the ANE's window, and the best: `autotune.costing.priced_bound`; also printed as a line of text before the
JSON) and `mlx_gpu_pp`:
the all-GPU plan's predicted prompt throughput at pp512 and pp2048 (one chunk each), beside llama.cpp's measured M2
Ultra figures for Qwen3-30B-A3B (Q8_0, PR #15616).

    python scripts/bench_prefill.py --shape qwen3-235b-a22b --macs 2 --prompt-tokens 4096 [--budget-gb 192]

With `--macs N`, the model's layers split across N Macs of the profile, each with `--budget-gb` of memory (an M2
Ultra's 192 GB), joined by the profile's link (Thunderbolt 5's published rate; `--link-gb-s` replaces it): the
split, each stage's plan and memory, the link time, the pipelined prefill, the tensor and expert layouts with our plan
on each Mac (`autotune.searching.pipeline_layouts`) and the fastest of the three (`layout`, whose prefill `vs` is
over), and the same Macs running mlx-lm's pipeline and its `shard()` on the GPU alone
(`autotune.searching.pipeline_report`). All predicted.
"""
from __future__ import annotations

import argparse
import json
import time

from make_shape_twin import TWINS  # scripts/: the published configs of the paper's models

from autotune.calibration.traces import synthetic_traces
from autotune.costing.pipeline_link import profile_link
from autotune.costing.unit_bound import prefill_bound
from autotune.costing.whole_prefill import DecoderShape, roofline_ms
from autotune.profiling.profile import load_profile
from autotune.searching.bound_report import priced_bounds
from autotune.searching.dense_choice import choose_dense
from autotune.searching.layer_data import LayerData
from autotune.searching.objective import WholePrefill
from autotune.searching.optimizer import chunk_candidates, run_search
from autotune.searching.pipeline_layouts import plan_expert, plan_tensor
from autotune.searching.pipeline_plan import Mac, StageSearch, plan_pipeline
from autotune.searching.pipeline_report import pipeline_report
from autotune.searching.prefill_report import mlx_gpu_prefill, whole_prefill
from autotune.searching.report import plot_tradeoff
from autotune.searching.scoring import Scorer
from autotune.searching.space import layer_space
from runtime.plan import COMPRESSIONS

SHAPES = ("qwen3-30b-a3b", "phi-3.5-moe", "phi-tiny-moe")  # the paper's (make_figures.py draws each)
LARGE_SHAPES = ("qwen3-235b-a22b",)  # past the paper's, for --macs
RESIDENT_BYTES = 64e9  # all layers: a 64 GB budget for resident expert weights (as bench_search.py)
# measured by others on an M2 Ultra: llama.cpp Metal, Qwen3-30B-A3B Q8_0, -ub 2048 (llama.cpp PR #15616), tok/s
LLAMA_CPP_M2_ULTRA = {"qwen3-30b-a3b": {512: 2045.0, 2048: 2273.0}}


def spec_of(name: str, shape: DecoderShape) -> dict:
    return dict(architecture=name, model_type=TWINS[name]["model_type"], num_layers=shape.num_layers,
                moe_layers=list(shape.moe_layers), num_experts=shape.num_experts, top_k=shape.top_k,
                hidden_size=shape.hidden, expert_ffn_size=shape.expert_ffn, fingerprint=f"synthetic-{name}")


def gpu_pp(cost, name: str, skew: float, prompts: int) -> dict:
    """The all-GPU plan's predicted prompt throughput at pp512 and pp2048 (one chunk of the prompt, as llama-bench
    -ub 2048 and mlx-lm's 2048-token prefill step run them), beside the measured figures others published."""
    shape = DecoderShape.from_config(TWINS[name])
    scorer = Scorer(cost, shape.hidden, shape.expert_ffn, "ane", RESIDENT_BYTES / len(shape.moe_layers))
    if not scorer.splits_exact:
        return {}
    out = {}
    for p in (512, 2048):
        layers = LayerData.from_traces(synthetic_traces(spec_of(name, shape), prompts, p, skew=skew, tokens=True), p, p)
        tok_s = p / mlx_gpu_prefill(scorer, shape, layers, p).latency_ms * 1e3
        measured = LLAMA_CPP_M2_ULTRA.get(name, {}).get(p)
        out[f"pp{p}"] = {"predicted_tok_s": tok_s, "llama_cpp_measured_tok_s": measured,
                         "predicted_over_measured": None if measured is None else tok_s / measured}
    return {"label": "predicted (published M2 Ultra profile) beside measured (llama.cpp Metal, Q8_0, PR #15616)",
            **out}


def bench(cost, name: str, prompt_tokens: int, objective: str, skew: float, prompts: int, trials: int,
          compress: tuple[str, ...], in_flight: int = 2, timeline: str | None = None) -> dict:
    shape = DecoderShape.from_config(TWINS[name])
    spec = spec_of(name, shape)
    traces = synthetic_traces(spec, prompts, prompt_tokens, skew=skew, tokens=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    workloads = {c: LayerData.from_traces(traces, c, prompt_tokens)
                 for c in chunk_candidates(prompt_tokens, shape.context)}
    scorer = Scorer(cost, shape.hidden, shape.expert_ffn, "ane", RESIDENT_BYTES / len(shape.moe_layers))
    calib_prompts = float(next(iter(workloads.values()))[0].tokens.sum()) / prompt_tokens

    def dense(chunk: int, weights, resident: float) -> object:  # beside `resident` bytes of experts on the ANE
        return choose_dense(cost, shape, prompt_tokens, chunk, scorer.backend, weights, calib_prompts, resident)

    out = run_search(workloads, scorer, layer_space(shape.num_experts, compress, scorer.splits_exact),
                     objective=objective, trials=trials, progress=True, dense=dense,
                     whole=WholePrefill(shape, prompt_tokens))
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    bounds: dict = {}  # the priced bounds the report's starts solve, shared with `priced_bound`'s
    report = whole_prefill(out, scorer, shape, prompt_tokens, in_flight, timeline, bounds)
    gpu = report["prefill_baselines"]["mlx-gpu"]
    bound = prefill_bound(cost, shape, prompt_tokens, scorer.backend, gpu["predicted_prefill_ms"],
                          gpu["predicted_prefill_energy_mj"])
    priced = priced_bounds(out, scorer, shape, prompt_tokens, gpu["predicted_prefill_ms"],
                           gpu["predicted_prefill_energy_mj"], roofline_ms(cost, shape, prompt_tokens, scorer.backend),
                           bounds)
    return {"shape": name, "prompt_tokens": prompt_tokens, "objective": objective, "skew": skew,
            "chunk_tokens": out.best.chunk_tokens, "search_seconds": seconds, "search_cpu_seconds": cpu_seconds,
            "label": "predicted by the cost model of the published M2 Ultra profile", **report,
            "unit_bound": bound, "priced_bound": priced, "mlx_gpu_pp": gpu_pp(cost, name, skew, prompts)}


def priced_line(result: dict) -> str:
    """The priced bound's best in one line of text (predicted)."""
    best, exact = result["priced_bound"]["best"], result["priced_bound"]["best_without_drops"]
    if best is None:
        return "priced_bound: no chunk size solved"
    busy = ", ".join(f"{u} {v['busy_ms']:.1f}" for u, v in best["units"].items())
    one = result["priced_bound"]["by_chunk"].get(str(result["prompt_tokens"]), {}).get("chain")
    chain = (f"; one chunk as its chain {one['bound_ms']:.1f} ms ({one['vs_latency_at_most']:.3f}, over_roofline at "
             f"least {one['over_roofline_at_least']})") if one else ""
    return (f"priced_bound (predicted): {best['bound_ms']:.1f} ms at {best['chunk_tokens']}-token {best['shape']}, "
            f"vs mlx-gpu at most {best['vs_latency_at_most']:.3f}, over_roofline at least "
            f"{best['over_roofline_at_least']}; busy ms: {busy}; without drops {exact['bound_ms']:.1f} ms "
            f"({exact['vs_latency_at_most']:.3f}){chain}; the plan (whole chunks) "
            f"{result['predicted_prefill_ms']:.1f} ms, vs mlx-gpu {result['vs']['mlx-gpu']['latency']:.3f}")


def bench_macs(profile, name: str, macs: int, budget_gb: float, link_gb_s: float | None, prompt_tokens: int,
               objective: str, skew: float, prompts: int, trials: int, compress: tuple[str, ...]) -> dict:
    """The model split across `macs` Macs of one profile (see the module docstring)."""
    shape = DecoderShape.from_config(TWINS[name])
    traces = synthetic_traces(spec_of(name, shape), prompts, prompt_tokens, skew=skew, tokens=True)
    workloads = {c: LayerData.from_traces(traces, c, prompt_tokens) for c in chunk_candidates(prompt_tokens,
                                                                                              shape.context)}
    cluster = [Mac(f"mac{i}", profile.cost_model, budget_gb * 1e9) for i in range(macs)]
    link = profile_link(profile.extra, link_gb_s)
    how = StageSearch(objective, trials, compress, progress=True)
    out = plan_pipeline(cluster, shape, workloads, prompt_tokens, link, how)
    others = tuple(plan(cluster, shape, workloads, prompt_tokens, link, how) for plan in (plan_tensor, plan_expert))
    return {"shape": name, "objective": objective, "skew": skew, **pipeline_report(out, shape, workloads,
                                                                                   prompt_tokens, link, others)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="apple-m2-ultra-published")
    ap.add_argument("--shape", choices=SHAPES + LARGE_SHAPES, default="qwen3-30b-a3b")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--objective", choices=("latency", "energy", "cpu"), default="latency")
    ap.add_argument("--skew", type=float, default=1.1, help="Zipf skew of the synthetic routing (default 1.1)")
    ap.add_argument("--prompts", type=int, default=10, help="synthetic prompts (every 5th held out; default 10)")
    ap.add_argument("--trials", type=int, default=40, help="Optuna trials per layer (default 40)")
    ap.add_argument("--compress", default=",".join(COMPRESSIONS))
    ap.add_argument("--chart", help="write the latency/energy trade of the candidate plans to this PNG")
    ap.add_argument("--in-flight", type=int, choices=(1, 2), default=2, help="prefill chunks in flight: 2 (default) "
                    "prices the plan as a schedule of both units' queues (autotune.costing.schedule), 1 as a chain")
    ap.add_argument("--timeline", help="with --in-flight 2, draw the plan's schedule (layers 0-1) to this PNG")
    ap.add_argument("--macs", type=int, default=1, help="split the model across this many Macs (default 1)")
    ap.add_argument("--budget-gb", type=float, default=192.0, help="each Mac's memory with --macs (default 192: an "
                    "M2 Ultra's)")
    ap.add_argument("--link-gb-s", type=float, help="the link's rate one way with --macs (default: the profile's)")
    args = ap.parse_args()
    if args.macs > 1:
        print(json.dumps(bench_macs(load_profile(args.profile), args.shape, args.macs, args.budget_gb, args.link_gb_s,
                                    args.prompt_tokens, args.objective, args.skew, args.prompts, args.trials,
                                    tuple(args.compress.split(",")))))
        return
    cost = load_profile(args.profile).cost_model
    result = bench(cost, args.shape, args.prompt_tokens, args.objective, args.skew, args.prompts, args.trials,
                   tuple(args.compress.split(",")), args.in_flight, args.timeline)
    if args.chart:
        plot_tradeoff(result, args.chart)
    print(priced_line(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
