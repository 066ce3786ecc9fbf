"""`autotune show-profile`: the fitted cost model of a profile, its held-out error, measured vs predicted."""
from __future__ import annotations

import argparse
import sys
import warnings

from autotune.commands.argtypes import plot_file
from autotune.commands.common import print_json
from autotune.profiling.profile import ProfileHostWarning, load_profile
from autotune.profiling.profile_report import plot, print_summary, summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show-profile", help="show a profile's cost-model fit and held-out error")
    p.add_argument("profile", metavar="FILE", help="a profile file, a shipped profile's name, or `host`")
    p.add_argument("--json", action="store_true", help="print one JSON object (per backend: heldout_mape, fit)")
    p.add_argument("--plot", type=plot_file, default=None, metavar="PNG",
                   help="write measured vs predicted per backend")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProfileHostWarning)
        profile = load_profile(args.profile)
    if args.plot:
        plot(profile, args.plot)
    for w in caught:  # after the plot is written, so that an error is always the only line
        print(f"autotune show-profile: warning: {w.message}", file=sys.stderr)
    if args.json:
        print_json(summary(profile))
    else:
        print_summary(profile)
        if args.plot:
            print(f"wrote {args.plot}")
    return 0
