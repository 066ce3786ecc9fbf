"""`autotune models`: the built-in models, their MoE shape and how their routing loads the experts."""
from __future__ import annotations

import argparse

from autotune import pipeline
from autotune.calibration.texts import DEFAULT_CALIB_TEXT
from autotune.commands.argtypes import positive_int
from autotune.commands.common import (
    add_dtype_argument,
    add_text_argument,
    add_threads_argument,
    apply_threads,
    print_json,
)
from runtime.errors import NpumoeError
from runtime.loading.model_loader import BUILTIN_MODELS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the built-in models with their MoE shape and expert load shares")
    p.add_argument("--model", action="append", metavar="M",
                   help=f"only these models (repeatable; default: all of {', '.join(BUILTIN_MODELS)})")
    add_dtype_argument(p)
    add_text_argument(p, DEFAULT_CALIB_TEXT)
    p.add_argument("--max-tokens", type=positive_int, default=16384, metavar="N",
                   help="measure load shares on the first N tokens of the text (default 16384)")
    add_threads_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    names = args.model or BUILTIN_MODELS
    unknown = [n for n in names if n not in BUILTIN_MODELS]
    if unknown:
        raise NpumoeError(f"not a built-in model: {', '.join(unknown)}; built-in: {', '.join(BUILTIN_MODELS)}")
    models = []
    for name in names:
        try:
            models.append(pipeline.describe_model(name, args.text, max_tokens=args.max_tokens, dtype=args.dtype))
        except NpumoeError as e:
            if len(names) == 1:
                raise
            models.append({"name": name, "error": str(e)})
    if args.json:
        print_json({"text": args.text, "max_tokens": args.max_tokens, "models": models})
        return 0
    for m in models:
        if "error" in m:
            print(f"{m['name']}: unavailable: {m['error']}\n")
            continue
        print(f"{m['name']}: {m['about']}")
        print(f"  {m['architecture']}, {m['parameters'] / 1e6:.2f}M parameters, {m['layers']} layers "
              f"({len(m['moe_layers'])} MoE), {m['experts']} experts, top-{m['top_k']}, hidden {m['hidden_size']}, "
              f"expert width {m['expert_ffn_size']}")
        print(f"  expert load shares on {m['text']} ({m['tokens']} tokens); most-used expert x uniform share:")
        for (layer, row), sk in zip(m["expert_shares"].items(), m["max_share_x_uniform"]):
            print(f"    layer {layer:>2}: max {sk:5.2f}x  " + " ".join(f"{s:.3f}" for s in row))
        print()
    return 0
