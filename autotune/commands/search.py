"""`autotune search`: tune a plan for a model on a device profile against routing traces."""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from runtime.errors import NpumoeError
from runtime.fileio import atomic_write_json, output_set
from runtime.models import read_model_spec
from runtime.plan import SALIENCY_RULES, save_plan

from ..profile import ProfileHostWarning, host_profile_path, load_profile, save_profile
from ..report import format_report, plot_pareto, plot_plan_map, search_report, sidecar
from ..robustness import assess
from ..search import solution_plan, timed_search
from ..space import LayerData, Scorer
from ..texts import DEFAULT_CALIB_TEXT
from ..traces import default_traces_path, load_traces, require_heldout
from .argtypes import (fraction_below_one, non_negative_int, output_file, positive_float, positive_int,
                       require_output, storage_url, traces_file)
from .common import add_dtype_argument, add_model_argument, add_threads_argument, apply_threads, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("search", help="search tiers, groups and residency for a model on a device profile")
    add_model_argument(p)
    add_dtype_argument(p)
    p.add_argument("--profile", metavar="P", help="profile file or shipped name (e.g. apple-m2-ultra-published); "
                                                  "default: this host's saved profile (made quickly if missing)")
    p.add_argument("--traces", type=traces_file, metavar="T",
                   help="traces file (default traces/<model>.npz, calibrated if missing)")
    p.add_argument("--drop-budget", type=fraction_below_one, default=0.10, metavar="X",
                   help="max share of assignments dropped on held-out traces (default 0.10)")
    p.add_argument("--objective", choices=["latency", "energy", "both"], default="latency",
                   help="what the search minimises (predicted by the profile's cost model); both: the Pareto front "
                        "of latency and energy (default latency)")
    p.add_argument("--trials", type=positive_int, default=120, metavar="N",
                   help="Optuna trials per MoE layer (default 120)")
    p.add_argument("--storage", type=storage_url, metavar="URL",
                   help="Optuna storage to resume from: sqlite:///file.db (one search "
                        "at a time; a second is refused) or journal:FILE (JournalStorage, several processes)")
    p.add_argument("--resident-mb", type=positive_float, default=16384, metavar="MB",
                   help="device budget for resident expert weights, fp16, all layers (default 16384)")
    p.add_argument("--saliency", choices=SALIENCY_RULES, default="router_weight",
                   help="which assignments a full group drops first: lowest router weight, or lowest router "
                        "weight x hidden-state norm (default router_weight)")
    p.add_argument("--seed", type=non_negative_int, default=0, metavar="S", help="sampler seed (default 0)")
    p.add_argument("--out", type=output_file(), metavar="PLAN", help="plan file (default plans/<model>@<profile>.json)")
    add_threads_argument(p)
    p.add_argument("--robust", action="store_true",
                   help="pick the plan with the least worst-case latency regret when the profile is off (ANE call "
                        "cost x0.5/x2, compute per GFLOP x0.7/x1.3 per backend) instead of the nominal best")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _storage(url: str | None):
    if url is None:
        return None
    import optuna

    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url[len("journal:"):]))
    return url


def _profile(name: str | None, quiet: bool):
    if name:
        return load_profile(name), name
    path = host_profile_path()
    if not path.exists():
        from ..profiling.device import profile_device

        print(f"autotune search: no saved profile for this host; measuring a quick one into {path} "
              "(autotune profile-device --quick)", file=sys.stderr)
        save_profile(profile_device(quick=True, progress=not quiet), path)
    return load_profile(path), "host"


def _traces(args, spec) -> tuple[object, str]:
    path = Path(args.traces) if args.traces else default_traces_path(args.model)
    if path.exists():
        traces = load_traces(path)
        if traces.spec["fingerprint"] == spec.fingerprint:
            require_heldout(traces, str(path))
            return traces, str(path)
        if args.traces:
            raise NpumoeError(f"traces {path} are for another model (fingerprint {traces.spec['fingerprint']}, "
                              f"model {spec.fingerprint})")
    from .calibrate import calibrate

    print(f"autotune search: no traces for {args.model}; calibrating on {DEFAULT_CALIB_TEXT} into {path}",
          file=sys.stderr)
    calibrate(args.model, DEFAULT_CALIB_TEXT, 256, 1024, 32768, str(path), progress=not args.json,
              dtype=args.dtype)
    traces = load_traces(path)
    require_heldout(traces, str(path))
    return traces, str(path)


def _study_prefix(spec, cost, traces, args) -> str:
    """Studies resume only for the same model, cost model, traces, backend limits and objective: trials scored
    under another profile or other traces would mislead the sampler."""
    key = json.dumps([cost.to_json(), traces.header, args.resident_mb], sort_keys=True, default=str)
    return f"npumoe:{spec.fingerprint[7:19]}:{hashlib.sha256(key.encode()).hexdigest()[:12]}:{args.objective}"


def _default_out(model: str, profile: str | None) -> Path:
    """plans/<model>@<profile>.json, the profile named as `_profile` names it."""
    return Path("plans") / f"{Path(model).name.replace(':', '_')}@{profile or 'host'}.json"


@contextmanager
def _one_search_per_sqlite(url: str | None) -> Iterator[None]:
    """SQLite storage serves one search at a time: two at once race on creating its tables and on the trials
    they enqueue. A second search on it is refused (pointing to journal:, which is made for several processes)
    by an exclusive lock on <file>.lock, held for the whole search."""
    if not url or not url.startswith("sqlite:///"):
        yield
        return
    with open(url[len("sqlite:///"):] + ".lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise NpumoeError(f"--storage {url} is in use by another search; SQLite storage takes one search at a "
                              "time: run concurrent searches on --storage journal:FILE") from None
        yield


def run(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    with _one_search_per_sqlite(args.storage):
        return _search(args)


def _search(args: argparse.Namespace) -> int:
    spec = read_model_spec(args.model)
    out = Path(args.out) if args.out else _default_out(args.model, args.profile)
    require_output(out, "--out")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProfileHostWarning)
        profile, profile_name = _profile(args.profile, args.json)
    for w in caught:
        print(f"autotune search: warning: {w.message}", file=sys.stderr)
    traces, traces_path = _traces(args, spec)
    cost = profile.cost_model
    backend = "ane" if "ane" in cost.backends else "cpu-static"
    layers = LayerData.from_traces(traces)
    scorer = Scorer(cost, spec.hidden_size, spec.expert_ffn_size, backend,
                    args.resident_mb * 1e6 / len(layers))
    outcome, seconds = timed_search(layers, scorer, objective=args.objective, drop_budget=args.drop_budget,
                                    trials=args.trials, storage=_storage(args.storage),
                                    study_prefix=_study_prefix(spec, cost, traces, args),
                                    seed=args.seed, chunk_tokens=traces.header["chunk_tokens"],
                                    progress=not args.json)
    calib_chunks = int(layers[0].calib.shape[0])
    heldout_assignments = sum(int(d.heldout.sum()) for d in layers)
    outcome.best, robustness = assess(outcome, layers, scorer, calib_chunks, pick=args.robust)
    context = {"plan": str(out), "profile": profile_name, "static_backend": backend, "traces": traces_path,
               "objective": args.objective, "drop_budget": args.drop_budget,
               "chunk_tokens": traces.header["chunk_tokens"]}
    report = search_report(outcome, calib_chunks, heldout_assignments, seconds, context)
    report["robustness"] = robustness.to_json()
    predicted = {k: report[k] for k in ("predicted_latency_ms", "predicted_energy_mj", "heldout_drop_rate")}
    predicted["label"] = "predicted by the cost model of profile " + profile_name
    plan = solution_plan(outcome.best, layers, scorer, spec.to_json(), traces.header["chunk_tokens"],
                         args.saliency, predicted,
                         {"made_by": "autotune search", "profile": profile_name, "traces": traces_path,
                          "drop_budget": args.drop_budget, "objective": args.objective, "robust": args.robust,
                          "decisions": [c.to_json() for c in outcome.best.configs]})
    extras = [".report.json", ".map.png"] + ([".pareto.png"] if args.objective == "both" else [])
    with output_set(out, *(sidecar(out, e) for e in extras)) as (plan_tmp, report_tmp, map_tmp, *pareto_tmp):
        save_plan(plan, plan_tmp)
        atomic_write_json(report_tmp, report)
        plot_plan_map(plan, map_tmp)
        for path in pareto_tmp:
            plot_pareto(report, path)
    if args.json:
        print_json(report)
    else:
        print(format_report(report))
        print(f"wrote {out} (+ {', '.join(sidecar(out, e).name for e in extras)}) in {seconds:.1f} s")
    return 0
