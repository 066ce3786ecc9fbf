"""`autotune calibrate`: record a model's routing on real text into a traces file."""
from __future__ import annotations

import argparse

import numpy as np

from runtime.errors import NpumoeError
from runtime.models import load_model

from ..texts import DEFAULT_CALIB_TEXT
from ..traces import HELDOUT_EVERY, default_traces_path, record_traces, save_traces
from ..workload import encode_text
from .argtypes import output_file, positive_int, require_output
from .common import (add_dtype_argument, add_model_argument, add_text_argument, add_threads_argument, apply_threads,
                     print_json)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="record routing traces of a model on real text")
    add_model_argument(p)
    add_dtype_argument(p)
    add_text_argument(p, DEFAULT_CALIB_TEXT)
    p.add_argument("--chunk", type=positive_int, default=256, metavar="N", help="prefill chunk in tokens (default 256)")
    p.add_argument("--prompt-tokens", type=positive_int, default=1024, metavar="N",
                   help="the text is cut into prompts of N tokens, each prefilled from an empty cache (default 1024)")
    p.add_argument("--max-tokens", type=positive_int, default=32768, metavar="N",
                   help="use at most N tokens (default 32768)")
    p.add_argument("--out", type=output_file(), metavar="FILE", help="traces file (default traces/<model>.npz)")
    add_threads_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON summary object")
    p.set_defaults(func=run)


def calibrate(model_name: str, text: str, chunk: int, prompt_tokens: int, max_tokens: int, out: str | None,
              progress: bool = True, dtype: str = "auto") -> tuple[str, dict]:
    """Record and save traces; returns (path, summary). Used by `search` when traces are missing."""
    if chunk > prompt_tokens:
        raise NpumoeError(f"--chunk {chunk} is longer than --prompt-tokens {prompt_tokens}: a prompt is prefilled in "
                          "chunks of at most its length; give --chunk <= --prompt-tokens")
    path = str(out or default_traces_path(model_name))
    require_output(path, "--out")
    model, tokenizer = load_model(model_name, dtype)
    ids = encode_text(tokenizer, text, max_tokens)
    prompts = -(-len(ids) // prompt_tokens)
    if prompts < HELDOUT_EVERY:
        raise NpumoeError(f"{len(ids)} tokens of {text} make {prompts} prompt(s) of {prompt_tokens} tokens; held-out "
                          f"chunks come from every {HELDOUT_EVERY}th prompt, so give at least "
                          f"{HELDOUT_EVERY * prompt_tokens} tokens (a longer --text, a larger --max-tokens or a "
                          "smaller --prompt-tokens)")
    traces = record_traces(model, ids, chunk, prompt_tokens, text, progress=progress)
    save_traces(traces, path)
    first = traces.header["model"]["moe_layers"][0]
    shares = {str(l): (traces.counts(l, "calib").sum(0) / max(1, traces.counts(l, "calib").sum())).round(4).tolist()
              for l in traces.header["model"]["moe_layers"]}
    summary = {"traces": path, "tokens": traces.header["tokens"], "chunks": traces.n_chunks,
               "heldout_chunks": int(traces.heldout_chunks.sum()),
               "max_expert_share_x_uniform": {l: float(np.max(s) * len(s)) for l, s in shares.items()},
               "layer0_shares": shares[str(first)]}
    return path, summary


def run(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    path, summary = calibrate(args.model, args.text, args.chunk, args.prompt_tokens, args.max_tokens, args.out,
                              progress=not args.json, dtype=args.dtype)
    if args.json:
        print_json(summary)
    else:
        print(f"wrote {path}: {summary['tokens']} tokens, {summary['chunks']} chunks "
              f"({summary['heldout_chunks']} held out)")
        print("most-used expert, x the uniform share, per layer: " +
              ", ".join(f"L{l} {v:.2f}" for l, v in summary["max_expert_share_x_uniform"].items()))
    return 0
