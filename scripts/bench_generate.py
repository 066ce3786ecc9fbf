"""Generation side by side in one process: the unmodified model (transformers' default experts kernel) vs an
all-exact plan vs the tuned plan (its static groups on cpu-static here), through `runtime.generate`.

tiny-moe, a 512-token prompt (builtin:pydoc-heldout), 64 new greedy tokens, 1 torch thread by default, float32.
All three prefill in the tuned plan's chunks, so the only difference is the experts runtime. The implementations
are interleaved within each repetition (the order rotates) so that noise on a shared machine hits them alike;
figures are medians over repetitions (decode: of each run's median step time, robust to bursts of other work),
after one untimed warm-up each. Prints a table, then one JSON line with `prefill_ratio_vs_transformers` and
`decode_ratio_vs_transformers` for the all-exact plan (their time / ours within each repeat, median over repeats:
>= 1 means ours is as fast). Peak RSS is the process's, over all three.

    python scripts/bench_generate.py [--plan plans/tiny-moe@apple-m2-ultra-published.json] [--repeats 15]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import runtime
from runtime.loading.model_loader import model_spec
from runtime.plan import LayerPlan, Plan, load_plan
from runtime.resources import peak_rss_mb

DEFAULT_PLAN = "plans/tiny-moe@apple-m2-ultra-published.json"


def all_exact_plan(model: torch.nn.Module, chunk_tokens: int) -> Plan:
    """Every expert on cpu-exact: the runtime where static groups cannot help."""
    spec = model_spec(model)
    layers = [LayerPlan(layer=i, groups=[], cpu_exact=list(range(spec.num_experts))) for i in spec.moe_layers]
    return Plan(model=spec, chunk_tokens=chunk_tokens, overflow="spill",
                saliency="router_weight", layers=layers)


def prompt_ids(tokenizer: object, tokens: int) -> list[int]:
    from autotune.calibration.workload import encode_text

    ids = encode_text(tokenizer, "builtin:pydoc-heldout", tokens).tolist()
    if len(ids) < tokens:
        sys.exit(f"bench_generate: the built-in text has only {len(ids)} tokens")
    return ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default=DEFAULT_PLAN, help=f"the tuned plan (default {DEFAULT_PLAN}, from the "
                                                         "README's main job)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    if not Path(args.plan).is_file():
        sys.exit(f"bench_generate: no tuned plan at {args.plan}; make it with `autotune search --model tiny-moe "
                 "--profile apple-m2-ultra-published` (or pass --plan)")
    torch.set_num_threads(args.threads)

    tuned_plan = load_plan(args.plan)
    tuned = runtime.load("tiny-moe", plan=tuned_plan, dtype="float32")
    exact = runtime.load("tiny-moe", plan=all_exact_plan(tuned.model, tuned_plan.chunk_tokens), dtype="float32")
    ids = prompt_ids(tuned.tokenizer, args.prompt_tokens)

    def transformers_default() -> dict:
        with exact.unmodified():  # same weights and prefill chunks, transformers' own experts kernel
            return runtime.generate(exact, ids, max_tokens=args.new_tokens)

    impls = {"transformers": transformers_default,
             "all_exact": lambda: runtime.generate(exact, ids, max_tokens=args.new_tokens),
             "tuned": lambda: runtime.generate(tuned, ids, max_tokens=args.new_tokens)}
    names = list(impls)
    for name in names:  # warm-up
        impls[name]()
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names[r % 3:] + names[:r % 3]:
            runs[name].append(impls[name]().to_json())
            print(f"repeat {r + 1}/{args.repeats} {name}: prefill {runs[name][-1]['ttft_ms']:.1f} ms", file=sys.stderr)

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[name])

    def decode_ms(name: str) -> float:  # a run's median decode step (robust to bursts of other work), median of runs
        return statistics.median(x["decode_step_ms"] for x in runs[name])

    def ratio(name: str, key: str) -> float:
        """Median over repeats of transformers' time / ours within the same repeat: the runs of one repeat are
        seconds apart, so slow swings of the shared machine's load cancel."""
        return statistics.median(ref[key] / ours[key] for ref, ours in zip(runs["transformers"], runs[name]))

    tokens = {name: runs[name][-1]["token_ids"] for name in names}
    print(f"tiny-moe, {len(ids)}-token prompt in chunks of {tuned_plan.chunk_tokens}, {args.new_tokens} new tokens, "
          f"{args.threads} thread(s), float32, medians of {args.repeats} interleaved repeats (measured)")
    print(f"{'implementation':<14} {'prefill ms':>11} {'decode ms/token':>16} {'decode static calls':>20}")
    for name in names:
        print(f"{name:<14} {med(name, 'ttft_ms'):>11.1f} {decode_ms(name):>16.2f} "
              f"{runs[name][-1]['decode_static_calls']:>20}")
    result = {
        "model": "tiny-moe", "threads": args.threads, "dtype": "float32", "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens, "chunk_tokens": tuned_plan.chunk_tokens, "repeats": args.repeats,
        "tuned_plan": args.plan, "tuned_exact_below_tokens": tuned_plan.exact_below,
        "prefill_ms": {n: med(n, "ttft_ms") for n in names},
        "decode_ms_per_token": {n: decode_ms(n) for n in names},
        "prefill_ratio_vs_transformers": ratio("all_exact", "ttft_ms"),
        "decode_ratio_vs_transformers": ratio("all_exact", "decode_step_ms"),
        "tuned_prefill_ratio_vs_transformers": ratio("tuned", "ttft_ms"),
        "tuned_decode_ratio_vs_transformers": ratio("tuned", "decode_step_ms"),
        "tuned_decode_static_calls": runs["tuned"][-1]["decode_static_calls"],
        "same_tokens_all_exact": tokens["all_exact"] == tokens["transformers"],
        "same_tokens_tuned": tokens["tuned"] == tokens["transformers"],
        "peak_rss_mb": peak_rss_mb(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
