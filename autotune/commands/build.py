"""`autotune build`: the plan's ANE groups as Core ML multifunction packages (one, or several under a manifest when
the weights pass one package's limit), linted and checked on the host."""
from __future__ import annotations

import argparse
from pathlib import Path

from autotune import pipeline
from autotune.commands.argtypes import directory, input_file, output_package, positive_float, require_output
from autotune.commands.common import add_dtype_argument, add_model_argument, print_json
from runtime.backends import registry
from runtime.coreml import ane_limits
from runtime.coreml.converter import LAYOUTS
from runtime.coreml.mil_eval import TOLERANCE
from runtime.errors import NpumoeError
from runtime.plan import COMPRESSIONS, load_plan

FORMATS = ("coreml", "coreai")
SUFFIX = {"coreml": ".mlpackage", "coreai": ".aimodel"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="build the Core ML package of a plan's ANE groups (one function per group) and "
                                     "dense functions (one per layer and kind; one attention core per shape)")
    add_model_argument(p)
    add_dtype_argument(p)
    p.add_argument("--plan", required=True, type=input_file, metavar="P", help="plan file (npumoe.plan/1 JSON)")
    p.add_argument("--layout", choices=LAYOUTS, default="matmul",
                   help="matmul: [slots, H] with linear layers; conv1x1: [1, H, 1, slots] with 1x1 convolutions "
                        "(the ml-ane-transformers form). Default matmul")
    p.add_argument("--compress", choices=COMPRESSIONS,
                   help="weights of every group: none (fp16), int8 (per-channel linear), palettize4 (4-bit k-means "
                        "tables); default: each group's `compress` in the plan (absent: none). Numeric-check "
                        "tolerance: " + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items()))
    p.add_argument("--format", choices=FORMATS,
                   help="coreml: Core ML packages (the ane backend); coreai: one Core AI asset (the coreai backend: "
                        "float32 for --dtype float32, else float16). Default: what the plan's groups and dense "
                        "functions name")
    p.add_argument("--out", type=output_package, metavar="X.mlpackage",
                   help="default: the plan's path with .mlpackage (.aimodel for --format coreai)")
    p.add_argument("--cache-dir", type=directory, metavar="D",
                   help="converted-function cache (default $NPUMOE_CACHE/coreml, else ~/.cache/npumoe/coreml)")
    p.add_argument("--function-weight-mb", type=positive_float, metavar="MB",
                   default=ane_limits.FUNCTION_WEIGHT_BYTES / 1e6,
                   help="most weight bytes one function (ANE program) may hold; a group past it is refused "
                        f"(default {ane_limits.FUNCTION_WEIGHT_BYTES / 1e6:,.0f}: ANEForge PR #45, Anemll issue 28)")
    p.add_argument("--package-weight-mb", type=positive_float, metavar="MB",
                   default=ane_limits.PACKAGE_WEIGHT_BYTES / 1e6,
                   help="most weight bytes per package; a larger plan is split into several packages named in "
                        f"<out>.manifest.json (default {ane_limits.PACKAGE_WEIGHT_BYTES / 1e6:,.0f}: Anemll issue 28)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    fmt = args.format or plan_format(args.plan)
    out = args.out or str(Path(args.plan).with_suffix(SUFFIX[fmt]))
    require_output(out, "--out", package=True)
    if Path(out).suffix != SUFFIX[fmt]:
        raise NpumoeError(f"--out {out}: a {fmt} build writes {SUFFIX[fmt]}")
    if fmt == "coreai":
        return _run_coreai(args, out)
    result = pipeline.build(args.model, args.plan, out=out, layout=args.layout, compress=args.compress,
                            cache_dir=args.cache_dir, function_weight_bytes=args.function_weight_mb * 1e6,
                            package_weight_bytes=args.package_weight_mb * 1e6, dtype=args.dtype,
                            progress=not args.no_progress)
    s = result.to_json()
    names = ", ".join(pk["path"] for pk in s["packages"])
    dense = (f" + {s['dense_functions']} dense ({s['attention_functions']} attention cores, one per shape)"
             if s["dense_functions"] else "")
    print(f"wrote {len(s['packages'])} package(s) ({names}) and {s['manifest']}: {s['functions']} functions{dense} "
          f"({s['cached_functions']} from the cache), layout {s['layout']}, weights "
          f"{', '.join(f'{k} x{n}' for k, n in s['compress_counts'].items())}, {s['build_seconds']:.1f} s "
          f"({s['build_mb_per_s']:.1f} MB/s of fp16 weights; convert {s['build_seconds_by_stage']['convert']} s, "
          f"merge {s['build_seconds_by_stage']['merge']} s, host check {s['build_seconds_by_stage']['verify']} s)")
    print(f"packages {s['package_bytes']:,} bytes = {s['size_ratio']:.3f} x the unique weights in fp16 "
          f"({s['unique_weight_bytes']:,} bytes); largest function {s['largest_function_weight_bytes']:,} weight "
          f"bytes (limit {s['function_weight_limit_bytes']:,}); lint passed")
    print(f"host evaluation of every function vs cpu-static: max relative error {s['max_rel_error']:.2e} "
          f"(tolerance {s['tolerance']:g})")
    print_json(s)
    return 0


def plan_format(plan: str) -> str:
    """The format a plan's device functions need: coreai where a backend its groups or dense functions name runs
    Core AI assets (the registry's `package_suffix`), else coreml."""
    p = load_plan(plan)
    named = {g.backend for lp in p.layers for g in lp.groups} | set(p.dense.backends if p.dense is not None else ())
    suffixes = {info.package_suffix for info in map(registry.get, named) if info is not None}
    return "coreai" if SUFFIX["coreai"] in suffixes else "coreml"


def _run_coreai(args: argparse.Namespace, out: str) -> int:
    from runtime.coreai.assets import coreai_import_error

    why = coreai_import_error()
    if why:
        raise NpumoeError(f"--format coreai: {why} (Python 3.11+, on Linux x86-64 or an Apple-silicon Mac with "
                          "macOS 26+)")
    result = pipeline.build(args.model, args.plan, out=out, compress=args.compress, dtype=args.dtype,
                            function_weight_bytes=args.function_weight_mb * 1e6, progress=not args.no_progress,
                            format="coreai")
    s = result.to_json()
    print(f"wrote {s['package']} and {s['manifest']}: {s['functions']} group functions + {s['dense_functions']} dense "
          f"({s['attention_functions']} attention cores, one per shape), {s['dtype']}, weights "
          f"{', '.join(s['compress'])}; {s['package_bytes']:,} bytes, largest function "
          f"{s['largest_function_weight_bytes']:,} weight bytes")
    print(f"every function run by {s['runs_on']}: max relative error {s['max_rel_error']:.2e} against "
          f"{s['checked_against']} (tolerance {s['tolerance']:g})")
    print(_placement_line(s["placement"]))
    print_json(s)
    return 0


def _placement_line(placement: dict | None) -> str:
    """What Core AI's compute plan said of the functions' placement, or that it could not be read here."""
    if not placement:
        return ("placement: not read (Core AI's compute plan needs its macOS 27 framework); the asset's functions "
                "are not proven to run on the Neural Engine")
    low = min(placement, key=lambda n: placement[n]["share"])
    return (f"placement (Core AI's compute plan): every function mostly on the Neural Engine; lowest share "
            f"{placement[low]['share']:.0%} ({low})")
