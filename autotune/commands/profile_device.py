"""`autotune profile-device`: microbenchmark this host's backends, fit the cost model, save the profile."""
from __future__ import annotations

import argparse
import time

from autotune import pipeline
from autotune.build_io import private_tempdir
from autotune.commands.argtypes import backend_list, output_file, positive_int, require_output, shape_list
from autotune.commands.common import add_dtype_argument
from autotune.profiling.model_records import model_label
from autotune.profiling.profile import host_profile_path
from autotune.profiling.profile_report import print_summary
from autotune.profiling.settings import CLOCKS, parse_shapes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile-device", help="measure this host's backends and fit the cost model")
    p.add_argument("--backends", type=backend_list, default=None, metavar="LIST",
                   help="comma-separated backends to profile, plugins included (default: every one this host has: "
                        "cpu-exact, cpu-static; on macOS with coremltools also ane, coreml-cpu; mlx-exact where "
                        "MLX runs on a Metal GPU; coreai where Core AI runs on the Neural Engine, macOS 27)")
    p.add_argument("--quick", action="store_true",
                   help="fewer shapes and runs: 4-5 minutes on a 2-core Intel AMX host, 14 on an AVX2-only one")
    p.add_argument("--threads", type=positive_int, default=1, metavar="N", help="torch CPU threads (default 1: steady)")
    p.add_argument("--out", type=output_file(), default=None, metavar="FILE",
                   help=f"where to write the profile (default: this host's cache, {host_profile_path()})")
    p.add_argument("--shapes", type=shape_list, default=None, metavar="LIST",
                   help="comma-separated model sizes to measure, by name (tiny-moe, bench-layer, qwen3-30b-a3b) or as "
                        "HIDDENxFFN (default: all three named sizes)")
    p.add_argument("--model", default=None, metavar="M",
                   help="also time the model's own shapes (a name, a folder or an MLX folder, as `search` takes): its "
                        "experts' hidden x FFN at the rows a plan gives an expert, its projections, router, attention "
                        "core at its heads and a prompt's contexts, lm_head; added to the profile at --out where one "
                        "is (measured here; the same model's earlier records replaced), else to a new one measured "
                        "first")
    add_dtype_argument(p)
    p.add_argument("--clock", choices=CLOCKS, default="auto",
                   help="what a record's median times: auto = this process's CPU time for one-thread CPU work "
                        "(other processes on a shared host don't count), wall clock otherwise")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = args.out or host_profile_path()
    require_output(out, "--out")
    t0 = time.perf_counter()
    with private_tempdir():  # what the measured functions' converters write (Core ML, Core AI, torch) goes with it
        profile = pipeline.profile_device(args.backends, quick=args.quick, threads=args.threads,
                                          shapes=parse_shapes(args.shapes) if args.shapes else None,
                                          clock=args.clock, out=out, progress=not args.no_progress, model=args.model,
                                          dtype=args.dtype)
    print_summary(profile)
    added = [m for key, m in profile.settings.get("models", {}).items()
             if args.model and key.split("@")[0] == model_label(args.model)]
    for m in added:
        print(f"{m['records']} records at {args.model}'s shapes in {m['dtype']} ({m['wall_s']:.0f} s)")
    print(f"wrote {out} ({len(profile.records)} records, {time.perf_counter() - t0:.0f} s, "
          f"{profile.settings['threads']} thread(s))")
    return 0
