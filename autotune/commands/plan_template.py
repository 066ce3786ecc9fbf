"""`autotune plan-template`: a valid plan for a model before any search (all experts in groups of four)."""
from __future__ import annotations

import argparse

from autotune.commands.argtypes import exact_path, output_file, positive_int, static_backend
from autotune.commands.common import add_model_argument
from autotune.searching.templates import CAPACITIES, template_plan
from runtime.backends import EXACT, REFERENCE, registry
from runtime.errors import NpumoeError
from runtime.loading.model_loader import RANDOM_PREFIX, context_length, model_dir, read_model_spec
from runtime.plan import OVERFLOW_POLICIES, SALIENCY_RULES, save_plan


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan-template", help="write a template plan (uniform capacity, groups of four)")
    add_model_argument(p)
    p.add_argument("--capacity", choices=CAPACITIES, default="ample",
                   help="ample: capacity >= chunk tokens (nothing can overflow); tight: a quarter of the mean load")
    p.add_argument("--overflow", choices=OVERFLOW_POLICIES, default="drop",
                   help="what happens to tokens beyond a group's capacity: drop them (the router's other experts "
                        "still count) or spill them to the exact path (default drop)")
    p.add_argument("--exact", type=exact_path, metavar="NAME",
                   help=f"the exact path of every expert in no group, of spilled assignments and of decode steps: "
                        f"a registered exact path (default {EXACT}); a model whose weights it cannot run as stored "
                        "is refused")
    p.add_argument("--backend", type=static_backend, default=REFERENCE, metavar="NAME",
                   help=f"backend of every group: a registered static backend, plugins included (default {REFERENCE})")
    p.add_argument("--no-groups", action="store_true",
                   help="no static group: every expert of every layer on the exact path (--exact)")
    p.add_argument("--chunk", type=positive_int, default=256, metavar="N", help="prefill chunk in tokens (default 256)")
    p.add_argument("--saliency", choices=SALIENCY_RULES, default="router_weight",
                   help="which assignments a full group drops first: lowest router weight, or lowest router "
                        "weight x hidden-state norm (default router_weight)")
    p.add_argument("--dense", type=static_backend, metavar="NAME",
                   help="also place every dense function of every layer (q/k/v with the input norm, o_proj, the "
                        "attention core, the dense MLP or shared expert) on this backend (ane, ane-sim, cpu-static "
                        "...); default: the dense ops stay on the CPU")
    p.add_argument("--prompt-tokens", type=positive_int, metavar="N",
                   help="with --dense: attention buckets at every multiple of the chunk up to N tokens (default and "
                        "at most: the model's context)")
    p.add_argument("--out", required=True, type=output_file(), metavar="P", help="plan file to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    context = _dense_context(args)
    check = registry.get(args.exact).check_weights if args.exact else None
    if check is not None and not args.model.startswith(RANDOM_PREFIX):
        check(model_dir(args.model))
    plan = template_plan(read_model_spec(args.model), args.capacity, args.overflow, args.backend, args.chunk,
                         args.saliency, dense=args.dense, context_tokens=context, exact=args.exact,
                         grouped=not args.no_groups)
    save_plan(plan, args.out)
    groups = (f"{len(plan.layers[0].groups)} groups per layer on {args.backend}, capacity "
              f"{plan.layers[0].groups[0].capacities[0]} per expert" if plan.layers[0].groups else "no groups")
    print(f"wrote {args.out}: {len(plan.layers)} layers, {groups}, overflow {args.overflow}, exact path "
          f"{plan.exact_path}")
    if plan.dense is not None:
        buckets = plan.dense.attention_context_buckets
        print(f"dense functions of {len(plan.dense.layers)} layers on {args.dense}; attention buckets "
              f"{buckets[0]}..{buckets[-1]} ({len(buckets)}, every {args.chunk} tokens)")
    return 0


def _dense_context(args: argparse.Namespace) -> int | None:
    """The attention buckets' reach: --prompt-tokens, within the model's context and holding one chunk."""
    if args.dense is None:
        if args.prompt_tokens is not None:
            raise NpumoeError("--prompt-tokens sets the attention buckets of --dense: give --dense too")
        return None
    context = context_length(args.model)
    tokens = args.prompt_tokens or context
    if tokens is None:
        raise NpumoeError("the model's config states no context length: give --prompt-tokens")
    if context is not None and tokens > context:
        raise NpumoeError(f"--prompt-tokens {tokens} is past the model's context of {context} positions")
    if tokens < args.chunk:
        raise NpumoeError(f"--prompt-tokens {tokens} holds no full chunk of {args.chunk} tokens")
    return tokens
