"""`autotune generate`: text from a prompt under a plan (or the unmodified model), streamed, then measured figures.

A thin parser over the runtime API (`runtime.load` / `runtime.generate`)."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from autotune import pipeline
from autotune.calibration.texts import read_text
from autotune.commands.argtypes import (
    input_file,
    non_negative_float,
    non_negative_int,
    output_file,
    positive_int,
)
from autotune.commands.common import (
    add_cluster_arguments,
    add_cpu_weights_argument,
    add_dtype_argument,
    add_engine_argument,
    add_in_flight_argument,
    add_model_argument,
    add_package_argument,
    add_threads_argument,
    apply_threads,
    cluster_of,
    print_json,
    require_plan_for_package,
)
from autotune.costing.cpu_storage import load_options
from autotune.costing.memory import against_measured, simulated_functions
from autotune.evaluation.run_parts import plan_predictions
from runtime.engines import check_in_flight, set_in_flight
from runtime.errors import NpumoeError
from runtime.generation import DEFAULT_MAX_TOKENS, generate, load


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt under a plan: stream it, then report time to "
                                        "first token, prefill and generation speed, peak memory")
    add_model_argument(p)
    add_engine_argument(p)
    p.add_argument("--plan", type=input_file, metavar="P",
                   help="plan file (npumoe.plan/1 JSON); without it the unmodified model runs")
    add_package_argument(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="S", help="the prompt text")
    prompt.add_argument("--prompt-file", metavar="F",
                        help="read the prompt from a UTF-8 file (or a built-in text name, e.g. builtin:pydoc-heldout)")
    p.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help=f"generate at most N tokens (default {DEFAULT_MAX_TOKENS}; stops earlier at end of text, or "
                        "where the prompt + N reach the model's context: stopped: length); an N past the context "
                        "itself is refused up front")
    p.add_argument("--temp", type=non_negative_float, default=0.0, metavar="T",
                   help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=non_negative_int, default=0, metavar="S", help="sampling seed (default 0)")
    add_dtype_argument(p)
    add_cpu_weights_argument(p)
    add_threads_argument(p)
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the tokenizer's chat template (says so on stderr when it has none)")
    p.add_argument("--compare", action="store_true",
                   help="also run the unmodified model on the same prompt: speed ratios and whether the tokens match")
    p.add_argument("--record-traces", type=output_file(), metavar="T",
                   help="with --plan: write the prompt's routing under the plan as traces (npumoe.traces/1, every "
                        "5th chunk held out) for `autotune search --traces T`")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (figures and text) instead of streaming the text; under mlx.launch "
                        "every rank prints its own, with its `rank` and `layers`")
    add_in_flight_argument(p)
    add_cluster_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require_plan_for_package(args)
    if args.record_traces and not args.plan:
        raise NpumoeError("--record-traces records the routing under a plan: give --plan too")
    prompt = args.prompt if args.prompt is not None else read_text(args.prompt_file)
    if not prompt:  # before the model loads: nothing to generate from (with --chat, an empty user turn)
        raise NpumoeError(f"the prompt is empty ({'--prompt' if args.prompt is not None else args.prompt_file}): "
                          "give some text")
    cluster = cluster_of(args, args.plan)
    if cluster is not None and args.record_traces:
        raise NpumoeError("--record-traces records the routing of the whole model: run it in one process, not "
                          "under mlx.launch")
    apply_threads(args.threads)
    engine = "torch" if args.record_traces and args.engine == "auto" else args.engine
    if engine != "auto":  # before the model loads (auto is resolved as it loads)
        check_in_flight(args.in_flight, engine, bool(args.plan))
    if args.record_traces and engine == "mlx":
        raise NpumoeError("--engine mlx: --record-traces runs on the torch spine only; use --engine torch")
    loaded = load(args.model, args.plan, args.package, args.dtype, **load_options(args.cpu_weights), engine=engine,
                  cluster=cluster)
    set_in_flight(loaded, args.in_flight)
    if args.record_traces:
        pipeline.check_prompt_recordable(loaded, prompt, chat=args.chat)
    answers = cluster is None or cluster.rank == 0  # across Macs every rank computes the text; rank 0 shows it
    stream = None if args.json or not answers else (lambda piece: print(piece, end="", flush=True))
    result = generate(loaded, prompt, max_tokens=args.max_tokens, temp=args.temp, seed=args.seed, chat=args.chat,
                      compare=args.compare, on_text=stream)
    extra: dict = {"model": args.model, "plan": args.plan}
    if loaded.executor:
        extra["drift"] = loaded.executor.drift.report()  # the prompt's prefill chunks (decode runs exact)
    if loaded.executor and loaded.engine == "torch":
        # the KV cache holds the prompt and every generated token but the last
        extra["memory"] = against_measured(loaded.plan, loaded.model, result.prompt_tokens + result.generated_tokens,
                                           int(result.peak_rss_mb * 2**20),
                                           ane_simulated=simulated_functions(loaded.executor.fallbacks))
        extra["plan_predicted"] = plan_predictions(loaded.plan)
    if args.record_traces:
        extra["traces"] = pipeline.record_prompt_traces(loaded, prompt, args.record_traces, chat=args.chat,
                                                        text=args.prompt_file or "--prompt",
                                                        recorded_by=f"autotune generate --plan {args.plan}")
    report = dataclasses.replace(result, **extra).to_json() | (loaded.cluster.to_json() if loaded.cluster else {})
    if args.json:
        print_json(report)
    elif answers:
        print(flush=True)
        _print_summary(report)
    return 0


def _print_summary(r: dict) -> None:
    """The measured figures, on stderr so that stdout holds only the text."""
    def say(line: str) -> None:
        print(line, file=sys.stderr)

    gen = f"{r['generation_tok_s']:.1f} tokens/s" if r["generation_tok_s"] is not None else "n/a (one token)"
    say("=" * 10)
    say(f"prompt: {r['prompt_tokens']} tokens, {r['prefill_tok_s']:.1f} tokens/s "
        f"(prefill in chunks of {r['chunk_tokens']}); time to first token {r['ttft_ms']:.1f} ms")
    say(f"generation: {r['generated_tokens']} tokens, {gen} (stopped: {r['finish_reason']})")
    say(f"peak memory: {r['peak_rss_mb']:.0f} MB (process peak RSS)"
        + (f"; {r['memory']['predicted_gb'] * 1e3:.0f} MB predicted for this run" if "memory" in r else ""))
    if r["plan"]:
        say(f"dropped {r['dropped']}, spilled {r['spilled']}; static calls: prefill {r['prefill_static_calls']}, "
            f"decode {r['decode_static_calls']}")
    if "traces" in r:
        say(f"wrote {r['traces']['path']}: {r['traces']['chunks']} chunks ({r['traces']['heldout_chunks']} held out)")
    if r.get("drift", {}).get("alert"):
        say(f"drift: {r['drift']['reason']}")
    if "same_tokens" in r:
        ratio = r["generation_speedup"]
        say(f"unmodified model: time to first token {r['reference_ttft_ms']:.1f} ms; prefill speedup "
            f"{r['prefill_speedup']:.2f}x, generation speedup {'n/a' if ratio is None else f'{ratio:.2f}x'}; "
            f"same tokens: {'yes' if r['same_tokens'] else 'no'}")
