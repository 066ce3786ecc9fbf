"""`autotune run`: chunked prefill of a text under a plan, with run statistics (and parity vs the reference)."""
from __future__ import annotations

import argparse

from autotune import pipeline
from autotune.calibration.texts import DEFAULT_EVAL_TEXT
from autotune.commands.argtypes import output_file, positive_int
from autotune.commands.common import (
    add_cluster_arguments,
    add_in_flight_argument,
    add_planned_arguments,
    apply_threads,
    cluster_of,
    print_json,
)

DEFAULT_TEXT = DEFAULT_EVAL_TEXT


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run prefill of a text under a plan and report what the executor did")
    add_planned_arguments(p, DEFAULT_TEXT, 1024)
    p.add_argument("--reference", action="store_true",
                   help="also run the unmodified model and compare every position's logits (both sides then "
                        "compute them all; without it each chunk computes its last row, as a prefill does)")
    p.add_argument("--repeat", type=positive_int, default=1, metavar="R",
                   help="time R runs, report the median, of the whole and of each part (default 1)")
    p.add_argument("--prompt-tokens", type=positive_int, default=None, metavar="N",
                   help="cut the text into prompts of N tokens, each prefilled from an empty cache "
                        "(default: the whole text is one prompt)")
    p.add_argument("--record-traces", type=output_file(), metavar="T",
                   help="write the routing the planned run saw as traces (npumoe.traces/1, every 5th chunk held "
                        "out) for `autotune search --traces T`")
    add_in_flight_argument(p)
    add_cluster_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cluster = cluster_of(args, args.plan)
    apply_threads(args.threads)
    result = pipeline.run_plan(args.model, args.plan, text=args.text, max_tokens=args.max_tokens,
                               prompt_tokens=args.prompt_tokens, package=args.package, dtype=args.dtype,
                               reference=args.reference, repeat=args.repeat, record_traces=args.record_traces,
                               cpu_weights=args.cpu_weights, engine=args.engine, cluster=cluster,
                               in_flight=args.in_flight)
    if args.json:
        print_json(result.to_json())
    else:
        _print_summary(result.to_json())
    return 0


def _print_summary(r: dict) -> None:
    print(f"{r['tokens']} tokens in chunks of {r['chunk_tokens']}: {r['latency_ms']:.1f} ms (measured), process CPU "
          f"time {r['cpu_ms_per_token']:.3f} ms per token, wall {r['wall_ms_per_token']:.3f} ms per token")
    m = r["memory"]
    print(f"memory: peak RSS {m['measured_peak_rss_gb']:.3f} GB (measured)" + (
        f", {m['predicted_gb']:.3f} GB predicted for this run ({m['predicted_over_measured']:.2f}x)"
        if "predicted_gb" in m else ""))
    if r.get("executed"):
        print(f"executed on the {r['engine']} spine: " + "; ".join(
            f"{part} on {', '.join(lanes)}" for part, lanes in r["executed"].items()))
    print(f"assignments {r['assignments']}, dropped {r['dropped']} ({r['drop_rate']:.2%}), spilled {r['spilled']} "
          f"({r['spill_rate']:.2%}), padding {r['padding_fraction']:.1%}")
    print("per backend: " + ", ".join(f"{b} {n} assignments / {r['calls_per_backend'].get(b, 0)} calls"
                                      for b, n in r["tokens_per_backend"].items()))
    for name, used in r["backend_fallbacks"].items():
        print(f"note: plan names {name}, which is unavailable here; ran on {used}")
    for name, used in r.get("energy_per_backend", {}).items():
        print(f"energy measured on {name} over {used['calls']:.0f} calls: "
              + ", ".join(f"{k} {v:.1f}" for k, v in used.items() if k != "calls"))
    if "max_rel_diff_vs_reference" in r:
        print(f"max relative difference vs the unmodified model: {r['max_rel_diff_vs_reference']:.2e}")
    if "traces" in r:
        print(f"wrote {r['traces']['path']}: {r['traces']['chunks']} chunks ({r['traces']['heldout_chunks']} held out)")
    d = r["drift"]
    if d["calibrated"]:
        print(f"drift over the last {d['chunks_in_window']} chunks: {d['overflow']} rate {d['rate']:.2%} "
              f"(plan expects {d['expected_rate']:.2%}, alert past {d['rate_limit']:.2%}), largest load-share "
              f"distance TV {d['tv_max']:.3f} (alert past {d['tv_threshold']}): "
              + ("ALERT" if d["alert"] else "no alert"))
