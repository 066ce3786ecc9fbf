"""Scale benchmark: every stage of the pipeline on shape twins of the paper's models, each stage its own process.

    python scripts/bench_scale.py [--quick] [--threads N]

Makes (or reuses) random-weight twins with the real configs (scripts/make_shape_twin.py, cached under
~/.cache/npumoe/twins), then runs plan-template, calibrate, search, run, evaluate and build on each as separate
`python -m autotune` processes and reads each child's peak RSS from the kernel (os.wait4's ru_maxrss). Prints a
table (stage x twin: wall s, peak RSS, peak RSS / checkpoint bytes, tokens/s) and, last, one JSON object:
- peak_rss_over_checkpoint_max: the worst stage's (peak RSS - 1 GB) / checkpoint bytes (goal <= 1.3);
- calibrate_overhead_vs_forward: routing capture vs the unmodified decoder forward on the same tokens, timed side
  by side in one process, alternating, best of each (goal <= 0.10);
- largest_function_weight_bytes, function_weight_limit_bytes: from the build of the searched plan;
- build_mb_per_s: fp16 expert weights built per second (the worst twin);
- search_gate_memory: per twin, the search's fidelity gate's peak RSS measured beside its predicted peak
  (`costing/memory.py`'s search stage; goal: within 10%).
--quick: one twin (Qwen3-30B-A3B, 1 layer) and fewer tokens, within 10 minutes on a 2-core host. Without it:
Qwen3-30B-A3B with 2 layers and Phi-3.5-MoE with 1 layer. Threads: 1 by default (2-core hosts shared with other
work swing 10x at 2 threads); the search plans for the published Apple M2 Ultra profile so that the plan has ANE
groups to build. The build takes the searched plan; where the fidelity gate kept only the all-CPU plan (random
weights: every plan with ANE groups misses its limits), it takes the search's own pick without the gate (`search
--no-gate`, its own stage), and says so (`built_from`). Nothing here is a Neural Engine measurement: the build
converts and checks on the host.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GB = 1e9
RSS_ALLOWANCE = 1 * GB  # the goal is (peak RSS - 1 GB) / checkpoint bytes: the interpreter and libraries


def _twin_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_shape_twin", ROOT / "scripts" / "make_shape_twin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def twin(like: str, layers: int) -> Path:
    """The cached twin, made (as its own process) when missing."""
    path = _twin_script().default_dir(like, layers)
    if not (path / "TWIN.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_shape_twin.py"), "--like", like, "--layers",
                        str(layers), "--out", str(path)], check=True, stdout=subprocess.DEVNULL)
    return path


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def stage(argv: list[str], threads: int) -> dict:
    """Run one child process; its wall time, peak RSS (bytes, the kernel's ru_maxrss of that child alone, read with
    os.wait4) and the last JSON line it printed."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, *argv], stdout=out, stderr=err, env=env, cwd=ROOT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        last = (stderr.strip().splitlines() or ["(no error output)"])[-1]
        raise SystemExit(f"stage failed with exit {proc.returncode} ({' '.join(argv[:3])} ...): {last}")
    lines = [line for line in stdout.strip().splitlines() if line.startswith("{")]
    return {"wall_s": wall, "peak_rss": int(usage.ru_maxrss * 1024),  # Linux reports KiB
            "json": json.loads(lines[-1]) if lines else {}}


def autotune(*args: str) -> list[str]:
    return ["-m", "autotune", *args]


def measure_overhead(model_dir: str, tokens: int, chunk: int, threads: int) -> dict:
    """Child mode: the decoder forward with and without routing capture on the same tokens, alternating, best of
    five each (one process, one model, side by side: the machine's other load hits both alike)."""
    import torch

    from autotune.calibration.traces import record_traces
    from autotune.calibration.workload import encode_text
    from runtime.loading.model_loader import load_model

    torch.set_num_threads(threads)
    model, tok = load_model(model_dir, "auto")
    ids = encode_text(tok, "builtin:pydoc-calib", tokens)

    def forward() -> None:
        with torch.inference_mode():
            for s in range(0, ids.numel(), chunk):
                model.model(input_ids=ids[s:s + chunk][None], use_cache=False)

    def record() -> None:
        record_traces(model, ids, chunk, chunk, "bench", progress=False)

    best = {"forward": float("inf"), "record": float("inf")}
    forward()  # warm-up
    for _ in range(5):
        for name, fn in (("forward", forward), ("record", record)):
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {"tokens": int(ids.numel()), "forward_s": best["forward"], "record_s": best["record"],
            "overhead": best["record"] / best["forward"] - 1.0}


def bench_twin(like: str, layers: int, quick: bool, threads: int, work: Path) -> tuple[list[dict], dict]:
    path = twin(like, layers)
    ckpt = checkpoint_bytes(path)
    name = f"{like} L{layers}"
    model = str(path)
    cal_tokens, run_tokens, prompt = (2048, 512, 256) if quick else (8192, 1024, 1024)
    traces, plan = work / f"{like}.npz", work / f"{like}.plan.json"
    th = ["--threads", str(threads)]
    search = ["search", "--model", model, "--profile", "apple-m2-ultra-published", "--traces", str(traces),
              "--trials", "20" if quick else "60", "--json", *th]
    stages = [
        ("plan-template", autotune("plan-template", "--model", model, "--out", str(work / "template.json")), None),
        ("calibrate", autotune("calibrate", "--model", model, "--max-tokens", str(cal_tokens), "--prompt-tokens",
                               str(prompt), "--out", str(traces), "--json", *th), cal_tokens),
        ("search", autotune(*search, "--out", str(plan)), None),
        ("run", autotune("run", "--model", model, "--plan", str(plan), "--max-tokens", str(run_tokens), "--json",
                         *th), run_tokens),
        ("evaluate", autotune("evaluate", "--model", model, "--plan", str(plan), "--max-tokens", str(run_tokens),
                              "--json", *th), run_tokens),
    ]
    rows, results = [], {}

    def run_stage(stage_name: str, argv: list[str], tokens: int | None) -> None:
        print(f"[{name}] {stage_name} ...", file=sys.stderr, flush=True)
        r = stage(argv, threads)
        results[stage_name] = r
        rows.append({"twin": name, "stage": stage_name, "wall_s": r["wall_s"], "peak_rss": r["peak_rss"],
                     "checkpoint_bytes": ckpt, "tokens_per_s": tokens / r["wall_s"] if tokens else None})

    for stage_name, argv, tokens in stages:
        run_stage(stage_name, argv, tokens)
    # On random weights the fidelity gate may keep only the all-CPU plan (nothing for `build`, which refuses it in
    # one line): the build then takes the search's own pick, unmeasured (`--no-gate`), said in the output; where that
    # places nothing on the ANE either (a one-layer twin's only layer is the last, which the objective may leave on
    # the host's lazy path), the build takes a template plan of ANE groups, said too.
    built, built_from = plan, "the gated plan"
    if not has_ane_groups(plan):
        built, built_from = work / f"{like}.ungated.json", "the search's pick without the gate (the gate kept the " \
                                                          "all-CPU plan: nothing to build)"
        run_stage("search --no-gate", autotune(*search, "--no-gate", "--out", str(built)), None)
    if not has_ane_groups(built):
        built, built_from = work / f"{like}.ane-template.json", "a template plan of ANE groups (the search's picks " \
                                                                "place nothing on the ANE: nothing to build)"
        run_stage("plan-template --backend ane", autotune("plan-template", "--model", model, "--backend", "ane",
                                                          "--out", str(built)), None)
    run_stage("build", autotune("build", "--model", model, "--plan", str(built), "--out",
                                str(work / f"{like}.mlpackage"), "--cache-dir", str(work / "cache"), "--no-progress"),
              None)
    print(f"[{name}] calibration overhead vs forward ...", file=sys.stderr, flush=True)
    over = stage([str(Path(__file__).resolve()), "--overhead-child", model, "--tokens", str(512 if quick else 1024),
                  "--threads", str(threads)], threads)["json"]
    build = results["build"]["json"]
    return rows, {"overhead": over, "build": build, "checkpoint_bytes": ckpt, "built_from": built_from,
                  "gate_chosen": results["search"]["json"].get("gate", {}).get("chosen"),
                  "gate_memory": _gate_memory(results["search"]["json"].get("gate") or {})}


def _gate_memory(gate: dict) -> dict | None:
    """The search stage's fidelity gate: its measured peak RSS beside its predicted peak (MiB; None: no gate)."""
    if not gate.get("predicted_peak_mb"):
        return None
    return {"measured_peak_rss_mb": gate["peak_rss_mb"], "predicted_peak_mb": gate["predicted_peak_mb"],
            "predicted_over_measured": round(gate["predicted_peak_mb"] / gate["peak_rss_mb"], 3)}


def has_ane_groups(plan: Path) -> bool:
    """Whether `plan` places a group on the ANE (what `build` compiles)."""
    return any(g["backend"] == "ane" for lp in json.loads(plan.read_text())["layers"] for g in lp["groups"])


def print_table(rows: list[dict]) -> None:
    print(f"{'twin':<22} {'stage':<14} {'wall s':>8} {'peak RSS GB':>12} {'RSS/ckpt':>9} {'(RSS-1GB)/ckpt':>15} "
          f"{'tok/s':>8}")
    for r in rows:
        tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-"
        print(f"{r['twin']:<22} {r['stage']:<14} {r['wall_s']:8.1f} {r['peak_rss'] / GB:12.2f} "
              f"{r['peak_rss'] / r['checkpoint_bytes']:9.2f} "
              f"{(r['peak_rss'] - RSS_ALLOWANCE) / r['checkpoint_bytes']:15.2f} {tps:>8}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one twin (Qwen3-30B-A3B, 1 layer), fewer tokens")
    p.add_argument("--threads", type=int, default=1, metavar="N", help="torch threads per stage (default 1)")
    p.add_argument("--overhead-child", metavar="MODEL", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=512, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.overhead_child:
        print(json.dumps(measure_overhead(args.overhead_child, args.tokens, 256, args.threads)))
        return 0
    twins = [("qwen3-30b-a3b", 1)] if args.quick else [("qwen3-30b-a3b", 2), ("phi-3.5-moe", 1)]
    rows, extras = [], []
    with tempfile.TemporaryDirectory(prefix="npumoe-bench-scale-") as d:
        for like, layers in twins:
            r, e = bench_twin(like, layers, args.quick, args.threads, Path(d))
            rows += r
            extras.append(e)
    print(f"threads per stage: {args.threads}; each stage a separate process; peak RSS = the child's ru_maxrss")
    print_table(rows)
    for (like, layers), e in zip(twins, extras):
        o, b = e["overhead"], e["build"]
        print(f"{like} L{layers}: routing capture {o['record_s']:.2f} s vs decoder forward {o['forward_s']:.2f} s on "
              f"{o['tokens']} tokens (+{o['overhead']:.1%}); build {b['build_mb_per_s']} MB/s "
              f"({b['build_seconds_by_stage']}), {len(b['packages'])} package(s), {b['package_bytes'] / GB:.2f} GB, "
              f"largest function {b['largest_function_weight_bytes'] / GB:.3f} GB; built {e['built_from']}")
        if e["gate_memory"]:
            g = e["gate_memory"]
            print(f"{like} L{layers}: search's fidelity gate peak RSS {g['measured_peak_rss_mb']:,.0f} MiB measured, "
                  f"{g['predicted_peak_mb']:,.0f} MiB predicted ({g['predicted_over_measured']:.3f}x)")
    print(json.dumps({
        "peak_rss_over_checkpoint_max": round(max((r["peak_rss"] - RSS_ALLOWANCE) / r["checkpoint_bytes"]
                                                  for r in rows), 3),
        "calibrate_overhead_vs_forward": round(max(e["overhead"]["overhead"] for e in extras), 4),
        "largest_function_weight_bytes": max(e["build"]["largest_function_weight_bytes"] for e in extras),
        "function_weight_limit_bytes": min(e["build"]["function_weight_limit_bytes"] for e in extras),
        "build_mb_per_s": min(e["build"]["build_mb_per_s"] for e in extras),
        "built_from": [e["built_from"] for e in extras],
        "search_gate_memory": [e["gate_memory"] for e in extras],
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
