"""`autotune bench`: a plan measured on this machine against mlx-lm, transformers and the all-exact plan, side by
side (`autotune.measuring.bench_run`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from autotune.calibration.texts import DEFAULT_EVAL_TEXT
from autotune.commands.argtypes import input_file, non_negative_int, output_file, positive_int
from autotune.commands.common import (
    add_dtype_argument,
    add_model_argument,
    add_text_argument,
    print_json,
)
from runtime.engines import ENGINES
from runtime.fileio import output_set


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure a plan on this machine against mlx-lm, transformers and the all-exact "
                                     "plan, side by side: whole prefill, parts, decode, memory, predicted beside "
                                     "measured")
    add_model_argument(p)
    p.add_argument("--plan", required=True, type=input_file, metavar="P", help="plan file (npumoe.plan/1 JSON)")
    add_dtype_argument(p)
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="the spine that runs the plan and the all-exact plan: torch, mlx, or auto (default: mlx "
                        "wherever mlx-lm is installed and the plan places anything on MLX, a Mac's GPU or MLX's CPU "
                        "device elsewhere; torch otherwise)")
    p.add_argument("--prompt-tokens", type=positive_int, default=None, metavar="N",
                   help="the prompt length timed (default: the plan's prompt, as its search was given)")
    p.add_argument("--prompts", type=positive_int, default=1, metavar="N",
                   help="prompts of the text timed, each from an empty cache (default 1)")
    p.add_argument("--repeats", type=positive_int, default=3, metavar="R",
                   help="rounds of every side, interleaved; each figure the median of its rounds, each ratio the "
                        "median of its rounds' pairs (default 3)")
    p.add_argument("--decode-tokens", type=non_negative_int, default=32, metavar="N",
                   help="greedy tokens generated after the first prompt to time decode (default 32; 0 or 1: no "
                        "decode timing)")
    p.add_argument("--threads", type=positive_int, default=1, metavar="N",
                   help="torch CPU threads every side runs on (default 1)")
    add_text_argument(p, DEFAULT_EVAL_TEXT)
    p.add_argument("--out", type=output_file(".json"), metavar="FILE.json",
                   help="also write the report there and its chart (measured beside predicted) beside it, as .png")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from autotune.measuring.bench_run import BenchConfig, plot_bench, run_bench

    c = BenchConfig(args.model, args.plan, args.dtype, args.engine, args.threads, args.prompt_tokens, args.prompts,
                    args.repeats, args.decode_tokens, args.text)
    out = run_bench(c, progress=not args.no_progress)
    if args.out:
        chart = Path(args.out).with_suffix(".png")
        out["chart"] = str(chart)
        with output_set(args.out, chart) as (report, png):
            import json

            report.write_text(json.dumps(out, indent=1))
            plot_bench(out, png)
    if args.json:
        print_json(out)
    else:
        _print_summary(out)
    return 0


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _print_summary(r: dict) -> None:
    print(f"{r['model']} under {r['plan']} on the {r['engine']} spine, {r['threads']} thread(s), {r['prompts']} "
          f"prompt(s) of {r['prompt_tokens']} tokens, {r['repeats']} rounds interleaved ({r['clock']} clock)")
    lanes = r["lanes"]
    print(f"lanes real here: {', '.join(lanes['real'])}; simulated: {', '.join(lanes['simulated']) or 'none'}")
    print(f"{'side':<14} {'measured ms':>12} {'predicted ms':>13} {'vs plan':>8} {'predicted':>10} {'decode tok/s':>13}"
          f" {'prefill rise GB':>16}")
    for name, s in r["sides"].items():
        vs = r["vs"].get(name, {})
        print(f"{name:<14} {s['measured_prefill_ms']:>12.1f} {_fmt(s['predicted_prefill_ms'], '.1f'):>13} "
              f"{_fmt(vs.get('latency')):>8} {_fmt(vs.get('predicted_latency')):>10} "
              f"{_fmt(s['decode_tok_s'], '.1f'):>13} {s['memory']['prefill_rise_gb']:>16.3f}"
              + ("  (the plan is this baseline)" if vs.get("is_plan") else ""))
    for name, why in r["left_out"].items():
        print(f"{name}: left out ({why})")
    if r.get("chart"):
        print(f"wrote {r['chart']}")
