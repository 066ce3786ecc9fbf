"""`autotune models`: the built-in models, their MoE shape and how their routing loads the experts."""
from __future__ import annotations

import argparse

import numpy as np

from autotune.calibration import modelstats
from autotune.calibration.texts import DEFAULT_CALIB_TEXT
from autotune.calibration.workload import encode_text
from autotune.commands.argtypes import positive_int
from autotune.commands.common import (
    add_dtype_argument,
    add_text_argument,
    add_threads_argument,
    apply_threads,
    print_json,
)
from runtime.errors import NpumoeError
from runtime.loading.model_loader import BUILTIN_MODELS, TINY_MOE_DIR, load_model, model_spec

_ABOUT = {"tiny-moe": f"embedded trained Qwen3-MoE ({TINY_MOE_DIR}, see MODEL_CARD.md)"}


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


def describe(name: str, text: str, max_tokens: int, dtype: str = "auto") -> dict:
    """Shape, size and per-layer expert load shares of one model on the first `max_tokens` tokens of `text`."""
    model, tokenizer = load_model(name, dtype)
    spec = model_spec(model)
    ids = encode_text(tokenizer, text, max_tokens).tolist()
    if len(ids) < 2:
        raise NpumoeError(f"--text {text!r} holds too few tokens")
    shares = modelstats.shares(modelstats.expert_counts(model, ids))
    return {
        "name": name,
        "about": _ABOUT.get(name, "seeded random model of this transformers MoE family (for tests)"),
        "architecture": spec.architecture,
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "layers": spec.num_layers,
        "moe_layers": spec.moe_layers,
        "experts": spec.num_experts,
        "top_k": spec.top_k,
        "hidden_size": spec.hidden_size,
        "expert_ffn_size": spec.expert_ffn_size,
        "text": text,
        "tokens": len(ids),
        "max_share_x_uniform": [round(float(x), 3) for x in modelstats.skew(shares)],
        "expert_shares": {str(l): np.round(row, 4).tolist() for l, row in zip(spec.moe_layers, shares)},
    }


def run(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    names = args.model or BUILTIN_MODELS
    unknown = [n for n in names if n not in BUILTIN_MODELS]
    if unknown:
        raise NpumoeError(f"not a built-in model: {', '.join(unknown)}; built-in: {', '.join(BUILTIN_MODELS)}")
    models = []
    for name in names:
        try:
            models.append(describe(name, args.text, args.max_tokens, args.dtype))
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
