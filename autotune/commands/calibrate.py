"""`autotune calibrate`: record a model's routing on real text into a traces file."""
from __future__ import annotations

import argparse

from autotune.calibration import stage
from autotune.calibration.mlx_engine import ENGINES
from autotune.calibration.texts import DEFAULT_CALIB_TEXT
from autotune.calibration.traces import default_traces_path
from autotune.commands.argtypes import output_file, positive_int, require_output
from autotune.commands.common import (
    add_cpu_weights_argument,
    add_dtype_argument,
    add_model_argument,
    add_text_argument,
    add_threads_argument,
    apply_threads,
    print_json,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="record routing traces of a model on real text")
    add_model_argument(p)
    add_dtype_argument(p)
    add_text_argument(p, DEFAULT_CALIB_TEXT)
    add_cpu_weights_argument(p, "how the CPU holds the experts while calibrating: quantized at load from a full-width "
                                "checkpoint (int8, int4[:group]; default bf16, as loaded)")
    p.add_argument("--chunk", type=positive_int, default=stage.CHUNK_TOKENS, metavar="N",
                   help=f"prefill chunk in tokens (default {stage.CHUNK_TOKENS})")
    p.add_argument("--prompt-tokens", type=positive_int, default=stage.PROMPT_TOKENS, metavar="N",
                   help="the text is cut into prompts of N tokens, each prefilled from an empty cache "
                        f"(default {stage.PROMPT_TOKENS})")
    p.add_argument("--max-tokens", type=positive_int, default=stage.MAX_TOKENS, metavar="N",
                   help=f"use at most N tokens (default {stage.MAX_TOKENS})")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="what runs the forward passes: auto (default: mlx for an MLX folder where MLX and mlx-lm run "
                        "it, else torch), torch (our loader, on the CPU) or mlx (mlx-lm's own model of the folder, "
                        "routers observed: the GPU on a Mac, MLX's CPU elsewhere)")
    p.add_argument("--out", type=output_file(), metavar="FILE", help="traces file (default traces/<model>.npz)")
    add_threads_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON summary object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    out = args.out or default_traces_path(args.model)
    require_output(out, "--out")
    result = stage.calibrate(args.model, args.text, chunk=args.chunk, prompt_tokens=args.prompt_tokens,
                                max_tokens=args.max_tokens, out=out, dtype=args.dtype, progress=not args.json,
                                cpu_weights=args.cpu_weights, engine=args.engine)
    path, summary = result.path, result.summary
    if args.json:
        print_json(summary)
    else:
        print(f"wrote {path}: {summary['tokens']} tokens, {summary['chunks']} chunks "
              f"({summary['heldout_chunks']} held out) in {summary['seconds']:.1f} s through {summary['engine']} "
              f"on {summary['device']}")
        print("most-used expert, x the uniform share, per layer: " +
              ", ".join(f"L{l} {v:.2f}" for l, v in summary["max_expert_share_x_uniform"].items()))
        m = summary["memory"]
        print(f"peak memory: {m['measured_peak_rss_gb']:.2f} GB (process peak RSS); {m['predicted_gb']:.2f} GB "
              "predicted for this stage")
    return 0
