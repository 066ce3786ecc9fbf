"""`autotune search`: tune a plan for a model on a device profile against routing traces."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from autotune import pipeline
from autotune.calibration.traces import default_traces_path
from autotune.commands.argtypes import (
    choice_list,
    fraction_below_one,
    non_negative_float,
    non_negative_int,
    output_file,
    positive_float,
    positive_int,
    require_output,
    static_backend,
    storage_url,
    traces_file,
    unit_fraction,
)
from autotune.commands.common import (
    add_cpu_weights_argument,
    add_dtype_argument,
    add_model_argument,
    add_threads_argument,
    print_json,
)
from autotune.evaluation import gate
from autotune.searching.config import DEFAULTS, IN_FLIGHT, SearchConfig
from autotune.searching.gate_candidates import ROUNDS
from autotune.searching.optimizer import OBJECTIVES
from autotune.searching.report import format_report
from runtime.engines import ENGINES
from runtime.errors import NpumoeError
from runtime.plan import COMPRESSIONS, SALIENCY_RULES


def register(sub: argparse._SubParsersAction) -> None:
    d = DEFAULTS  # every default is the library's (`SearchConfig`): the command and `search_plan` are one search
    p = sub.add_parser("search", help="search tiers, groups and residency for a model on a device profile")
    add_model_argument(p)
    add_dtype_argument(p)
    p.add_argument("--profile", metavar="P", help="profile file or shipped name (e.g. apple-m2-ultra-published); "
                                                  "default: this host's saved profile (made quickly if missing)")
    p.add_argument("--traces", type=traces_file, metavar="T",
                   help="traces file (default traces/<model>.npz, calibrated if missing)")
    p.add_argument("--drop-budget", type=fraction_below_one, default=d.drop_budget, metavar="X",
                   help=f"max share of assignments dropped on held-out traces (default {d.drop_budget:g})")
    p.add_argument("--objective", choices=OBJECTIVES, default=d.objective,
                   help="what the search minimises (predicted by the profile's cost model); both: the Pareto front "
                        "of latency and energy; cpu: CPU-busy time (the paper's CPU cycles; latency breaks ties) "
                        f"(default {d.objective})")
    p.add_argument("--trials", type=positive_int, default=d.trials, metavar="N",
                   help=f"Optuna trials per MoE layer (default {d.trials})")
    p.add_argument("--storage", type=storage_url, metavar="URL",
                   help="Optuna storage to resume from: sqlite:///file.db (one search "
                        "at a time; a second is refused) or journal:FILE (JournalStorage, several processes)")
    p.add_argument("--resident-mb", type=positive_float, default=d.resident_mb, metavar="MB",
                   help="device budget for resident expert weights as stored (compressed where the plan compresses), "
                        f"all layers (default {d.resident_mb:g})")
    p.add_argument("--prompt-tokens", type=positive_int, metavar="N",
                   help="the prompt length the plan is for (default: the traces'); the chunk size is searched among "
                        "256..4096 tokens (powers of two, at most N and the model's context)")
    p.add_argument("--compress", type=choice_list(COMPRESSIONS), default=d.compress, metavar="K1,K2",
                   help=f"weight storage the search may give each layer's ANE groups, among {','.join(COMPRESSIONS)} "
                        "(default: all of them, a group kept compressed only where the fidelity gate holds; with "
                        "--no-gate: none, fp16)")
    p.add_argument("--memory-gb", type=positive_float, metavar="X",
                   help="the most memory the plan may need (predicted: CPU-side weights + ANE packages + one chunk's "
                        "activations + KV cache at the prompt length + the runtime); a plan over it is a violation, "
                        "a budget no plan can meet is refused")
    add_cpu_weights_argument(p, "the CPU's storage of every expert for the whole plan (default: bf16 as loaded, "
                                "or under --memory-gb the cheapest storage whose plan fits, bf16 when it fits)")
    p.add_argument("--saliency", choices=SALIENCY_RULES, default=d.saliency,
                   help="which assignments a full group drops first: lowest router weight, or lowest router "
                        f"weight x hidden-state norm (default {d.saliency})")
    p.add_argument("--seed", type=non_negative_int, default=d.seed, metavar="S",
                   help=f"sampler seed (default {d.seed})")
    p.add_argument("--out", type=output_file(), metavar="PLAN", help="plan file (default plans/<model>@<profile>.json)")
    add_threads_argument(p)
    p.add_argument("--robust", action="store_true",
                   help="pick the plan with the least worst-case latency regret when the profile is off (ANE call "
                        "cost x0.5/x2, compute per GFLOP x0.7/x1.3 per backend) instead of the nominal best")
    p.add_argument("--no-dense", action="store_true", default=DEFAULTS.no_dense,
                   help="tune the experts alone: every dense op (attention, projections, shared expert, dense MLP) "
                        "stays on the CPU (default: the search places them too, on the ANE where that pays)")
    p.add_argument("--no-measure", action="store_true",
                   help="keep the profile as it is: without it, a search on a profile measured on this host that "
                        "lacks the model's own shapes times them first (`profile-device --model`, a minute or a few "
                        "with --quick's settings) and saves them into it; either way, the parts priced past the "
                        "profile's records are named")
    p.add_argument("--backend", type=static_backend, default=d.backend, metavar="NAME",
                   help="the static backend the plan's groups run on (one the profile fits); default: chosen, the "
                        "Neural Engine's preferred framework first (Core AI on macOS 27, Core ML before)")
    p.add_argument("--engine", choices=ENGINES, default=d.engine,
                   help="the spine the plan is searched for: mlx prices the plan's exact path and the dense half on "
                        "mlx-exact, from the profile's mlx-exact records wherever they ran (MLX's CPU device off a "
                        "Mac), as `run --engine mlx` runs them; torch or auto (default): the profile's exact path")
    p.add_argument("--in-flight", type=int, choices=IN_FLIGHT, default=d.in_flight,
                   help="prefill chunks in flight the plan is chosen for (default 1: one at a time, a chain); 2 (with "
                        "--engine mlx): the chunking (uneven where that wins), the dense half and the experts (the "
                        "gate's, --measure's or --robust's pick where one chose them) whose schedule of two chunks in "
                        "flight ends first; the plan's in_flight, which `generate`/`run --engine mlx` run; --measure "
                        "times the candidates two in flight")
    add_gate_arguments(p, d)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_macs_arguments(p)
    p.set_defaults(func=run)


def add_gate_arguments(p: argparse.ArgumentParser, d: SearchConfig) -> None:
    """After the search: the fidelity gate's candidates and limits, and their measurement on this host."""
    p.add_argument("--no-gate", action="store_true",
                   help="skip the fidelity gate: write the search's pick from config and routers alone, unmeasured")
    p.add_argument("--gate-candidates", type=positive_int, default=d.gate_candidates, metavar="K",
                   help="the fidelity gate measures the K cheapest candidates that meet the drop budget on held-out "
                        "text, ane groups on ane-sim, and writes the cheapest within its limits; when none is, the "
                        "same plans tightened (spills for drops, then uncompressed), then the next K: at most "
                        f"{ROUNDS} rounds, the last ending on the all-CPU plan (default {d.gate_candidates})")
    p.add_argument("--max-ppl-delta", type=non_negative_float, default=d.max_ppl_delta, metavar="PCT",
                   help="gate limit: perplexity at most PCT percent above the unmodified model's "
                        f"(default {d.max_ppl_delta:g})")
    p.add_argument("--min-top1", type=unit_fraction, default=d.min_top1, metavar="X",
                   help=f"gate limit: top-1 next-token agreement with the unmodified model at least X (default "
                        f"{d.min_top1:g})")
    p.add_argument("--gate-tokens", type=positive_int, default=d.gate_tokens, metavar="N",
                   help=f"held-out tokens ({gate.GATE_TEXT}) each gate candidate runs, at least one chunk of the "
                        f"smallest chunk searched (default {d.gate_tokens})")
    p.add_argument("--measure", type=non_negative_int, default=d.measure, metavar="K",
                   help="after the gate, time the K best distinct candidates by predicted whole prefill and the "
                        "baselines that are plans on this host (held-out prompts, interleaved, repeated), write the "
                        "measured best within the fidelity limits, and store the runs in the profile so the next "
                        "search predicts them; 0: off (default: 8 on a profile measured on this host, else 0)")


# the split's options; each stage's search takes SearchConfig's
ACROSS_MACS = ("macs", "hosts", "mac_memory_gb", "link_gb_s")


def add_macs_arguments(p: argparse.ArgumentParser) -> None:
    """Past one Mac (autotune/searching/pipeline_search.py): the layers split across Macs (`ACROSS_MACS`), a plan
    per stage."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--macs", type=positive_int, metavar="N", help="split the model across N Macs of --profile "
                       "(writes <plan>.pipeline.json and <plan>.stage<k>.json next to the plan)")
    where.add_argument("--hosts", metavar="FILE", help="split it across the Macs of an MLX hostfile (mlx.launch "
                       "--hostfile), each with optional \"profile\" and \"memory_gb\"")
    p.add_argument("--mac-memory-gb", type=positive_float, default=192.0, metavar="GB",
                   help="each Mac's memory with --macs/--hosts (default 192: an M2 Ultra's)")
    p.add_argument("--link-gb-s", type=positive_float, metavar="X",
                   help="the link between Macs, GB/s one way (default: the profile's, Thunderbolt 5's published rate)")


def search_config(args: argparse.Namespace) -> SearchConfig:
    """The parsed options as the library's one search value (every field under its flag's name)."""
    return SearchConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SearchConfig)})


def run(args: argparse.Namespace) -> int:
    config = search_config(args)
    out = Path(config.out) if config.out else pipeline.default_plan_path(args.model, config.profile)
    for path in (out, *pipeline.search_sidecars(out, config.objective, tradeoff=True)):  # the plan and sidecars
        require_output(path, "--out")
    if not config.traces and not default_traces_path(args.model).exists():  # the search calibrates into it
        require_output(default_traces_path(args.model), "--traces")
    if args.macs or args.hosts:
        return run_across_macs(args, config.replace(out=str(out)))
    result = pipeline.search_plan(args.model, config.replace(out=str(out)), progress=not args.json)
    if args.json:
        print_json(result.to_json())
    else:
        print(format_report(result.to_json()))
        print(f"wrote {out} (+ {', '.join(p.name for p in result.sidecars)}) in {result.seconds:.1f} s")
    return 0


def run_across_macs(args: argparse.Namespace, config: SearchConfig) -> int:
    from autotune.searching import pipeline_search as ps

    hosts = (ps.read_hosts(args.hosts, config.profile, args.mac_memory_gb) if args.hosts else
             [ps.HostSpec(f"mac{i}", config.profile, args.mac_memory_gb) for i in range(args.macs)])
    if len(hosts) < 2:
        raise NpumoeError("--macs: a pipeline needs at least 2 Macs")
    out = Path(config.out)
    for path in (*pipeline.search_sidecars(out, config.objective, tradeoff=True), *ps.stage_paths(out, len(hosts))[1],
                 ps.stage_paths(out, len(hosts))[0]):
        require_output(path, "--out")
    report = pipeline.search_across_macs(args.model, config, hosts, args.link_gb_s, progress=not args.json)
    if args.json:
        print_json(report)
    else:
        for s in report["stages"]:
            print(f"stage {s['stage']} (rank {s['rank']}, {s['host']}): layers {s['layers'][0]}..{s['layers'][1] - 1}, "
                  f"predicted {s['predicted_stage_ms']:.1f} ms -> {s['plan']}")
        p = report["predicted"]
        print(f"predicted pipelined prefill of {p['prompt_tokens']} tokens: {p['prefill_ms']:.1f} ms (efficiency "
              f"{p['efficiency']:.2f}); link {report['link']['name']} ({report['link']['label']})")
    return 0
