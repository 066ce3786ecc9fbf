"""`autotune evaluate`: measure a plan's fidelity on held-out (or shifted-domain) text."""
from __future__ import annotations

import argparse

from ..fidelity import evaluate_plan
from ..texts import DEFAULT_EVAL_TEXT
from .argtypes import positive_int
from .common import add_planned_arguments, planned_inputs, print_json

SHIFT_TOLERANCE = 1.5  # a plan "holds" on shifted text when its measured drop rate is within 1.5x its budget


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="measure a plan's drop/spill rates, perplexity and top-1 agreement")
    add_planned_arguments(p, DEFAULT_EVAL_TEXT, 8192)
    p.add_argument("--prompt-tokens", type=positive_int, default=1024, metavar="N",
                   help="prompts of N tokens, each prefilled from an empty cache (default 1024)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model, plan, ids, backends = planned_inputs(args)
    result = {"model": args.model, "plan": args.plan, "text": args.text,
              **evaluate_plan(model, plan, ids, args.prompt_tokens, backends, progress=not args.json)}
    budget = (plan.meta or {}).get("drop_budget")
    if budget is not None:
        result["drop_budget"] = budget
        result["drop_rate_within_1_5x_budget"] = result["drop_rate"] <= SHIFT_TOLERANCE * budget
    if args.json:
        print_json(result)
        return 0
    print(f"{result['tokens']} tokens of {args.text} in {result['prompts']} prompts (measured)")
    print(f"perplexity: reference {result['ppl_reference']:.3f}, plan {result['ppl_plan']:.3f} "
          f"({result['ppl_delta_rel']:+.2%}); top-1 agreement {result['top1_agreement']:.2%}")
    print(f"drop rate {result['drop_rate']:.2%}, spill rate {result['spill_rate']:.2%}, "
          f"padding {result['padding_fraction']:.1%}, max rel. diff {result['max_rel_diff_vs_reference']:.2e}")
    if budget is not None and not result["drop_rate_within_1_5x_budget"]:
        print(f"warning: the measured drop rate {result['drop_rate']:.2%} exceeds 1.5x the plan's budget "
              f"{budget:.0%}: the routing on this text differs from the calibration text")
    return 0
