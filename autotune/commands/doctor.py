"""`autotune doctor`: check this host for the whole ANE path, each check pass/fail/skip with its reason."""
from __future__ import annotations

import argparse

from autotune.commands.common import print_json
from autotune.profiling.host_checks import report, run_checks


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check this host for the ANE path: versions, macOS, a built group function, "
                                      "placement, parity, predict() overhead, energy counters")
    p.add_argument("--json", action="store_true", help="print one JSON object: {checks: [{name, status, detail}]}")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    checks = run_checks(progress=not args.json)
    out = report(checks)
    if args.json:
        print_json(out)
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.status.upper():<4}  {c.name:<{width}}  {c.detail}")
        n = out["counts"]
        print(f"{n['pass']} passed, {n['fail']} failed, {n['skip']} skipped")
    return 0 if out["ok"] else 1
