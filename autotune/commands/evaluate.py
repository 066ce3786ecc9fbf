"""`autotune evaluate`: measure a plan's fidelity on held-out (or shifted-domain) text."""
from __future__ import annotations

import argparse

from autotune import pipeline
from autotune.calibration.texts import DEFAULT_EVAL_TEXT
from autotune.commands.argtypes import input_directory, non_negative_int, positive_int
from autotune.commands.common import (
    add_cluster_arguments,
    add_planned_arguments,
    apply_threads,
    cluster_of,
    print_json,
)
from runtime.engines import resolve_engine
from runtime.errors import NpumoeError
from runtime.plan import load_plan


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="measure a plan's drop/spill rates, perplexity and top-1 agreement")
    add_planned_arguments(p, DEFAULT_EVAL_TEXT, 8192)
    p.add_argument("--prompt-tokens", type=positive_int, default=1024, metavar="N",
                   help="prompts of N tokens (at least the plan's chunk), each prefilled from an empty cache "
                        "(default 1024)")
    p.add_argument("--tasks", type=task_list, metavar="T1,T2",
                   help="instead of the text: lm-evaluation-harness tasks (needs the extra: pip install -e "
                        "'.[eval]'), accuracy of the plan vs the unmodified model on the same examples; "
                        "builtin:pydoc-nextsent is built in, others need their datasets cached or local")
    p.add_argument("--limit", type=positive_int, metavar="N", help="with --tasks: at most N examples per task")
    p.add_argument("--num-fewshot", type=non_negative_int, metavar="K",
                   help="with --tasks: K few-shot examples (default: each task's own)")
    p.add_argument("--include-path", type=input_directory, metavar="DIR",
                   help="with --tasks: a folder of extra lm-eval task YAMLs (local datasets)")
    add_cluster_arguments(p)
    p.set_defaults(func=run)


def task_list(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise argparse.ArgumentTypeError(f"expected task names separated by commas, got {text!r}")
    return tasks


def _print_tasks(result: dict) -> None:
    print(f"lm-evaluation-harness, metric {result['metric']} (measured; delta = plan - reference, paired stderr):")
    for name, t in result["tasks"].items():
        print(f"  {name}: reference {t['accuracy_reference']:.2%}, plan {t['accuracy_plan']:.2%}, "
              f"delta {100 * t['delta']:+.2f} +- {100 * t['stderr']:.2f} points, n {t['n']}")
    print(f"plan on the tasks' text: drop rate {result['drop_rate']:.2%}, spill rate {result['spill_rate']:.2%}")


TASK_OPTIONS = ("limit", "num_fewshot", "include_path")  # what only --tasks reads


def run(args: argparse.Namespace) -> int:
    given = [f"--{name.replace('_', '-')}" for name in TASK_OPTIONS if getattr(args, name) is not None]
    if given and not args.tasks:  # said, not silently ignored
        raise NpumoeError(f"{', '.join(given)} applies to lm-evaluation-harness tasks only: give --tasks too, or "
                          "--max-tokens to evaluate less of the text")
    cluster = cluster_of(args, args.plan)
    if cluster is not None and args.tasks:
        raise NpumoeError("--tasks scores through the torch model in one process: under mlx.launch, evaluate the text "
                          "(leave --tasks out)")
    apply_threads(args.threads)
    if args.tasks:  # lm-evaluation-harness scores through the torch model
        resolve_engine(args.engine, load_plan(args.plan), "evaluate --tasks")
        result = pipeline.evaluate_tasks(args.model, args.plan, args.tasks, limit=args.limit,
                                         num_fewshot=args.num_fewshot, include_path=args.include_path,
                                         package=args.package, dtype=args.dtype, cpu_weights=args.cpu_weights)
    else:
        result = pipeline.evaluate(args.model, args.plan, text=args.text, max_tokens=args.max_tokens,
                                   prompt_tokens=args.prompt_tokens, package=args.package, dtype=args.dtype,
                                   progress=not args.json, cpu_weights=args.cpu_weights, engine=args.engine,
                                   cluster=cluster)
    if args.json:
        print_json(result.to_json())
    elif args.tasks:
        _print_tasks(result.to_json())
    else:
        _print_summary(result.to_json())
    return 0


def _print_summary(result: dict) -> None:
    print(f"{result['tokens']} tokens of {result['text']} in {result['prompts']} prompts (measured)")
    print(f"perplexity: reference {result['ppl_reference']:.3f}, plan {result['ppl_plan']:.3f} "
          f"({result['ppl_delta_rel']:+.2%}); top-1 agreement {result['top1_agreement']:.2%}")
    print(f"drop rate {result['drop_rate']:.2%}, spill rate {result['spill_rate']:.2%}, "
          f"padding {result['padding_fraction']:.1%}, max rel. diff {result['max_rel_diff_vs_reference']:.2e}")
    budget = result.get("drop_budget")
    if budget is not None and not result["drop_rate_within_1_5x_budget"]:
        print(f"warning: the measured drop rate {result['drop_rate']:.2%} exceeds 1.5x the plan's budget "
              f"{budget:.0%}: the routing on this text differs from the calibration text")
