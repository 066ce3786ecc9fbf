"""The whole-prefill host check at the paper's three shapes, in one command: does the cost model predict the models
it plans on this host?

    python scripts/host_prefill_check.py [--shapes phi-3.5-moe,qwen3-30b-a3b,phi-tiny-moe] [--out DIR]
    python scripts/host_prefill_check.py --engine mlx --shapes phi-3.5-moe,qwen3-30b-a3b
    python scripts/host_prefill_check.py --model DIR --profile FILE --prompt-tokens 256 --prompts 1 --repeat 1

For each shape: its one-layer shape twin (scripts/make_shape_twin.py, made where missing), on a fresh
`autotune profile-device --quick --threads 1` with the twin's own shapes added (`--model`, in the dtype it computes
in), `calibrate` at 4,096-token prompts, `search --no-gate --json` (`predicted_prefill_ms`, `priced_outside`), then
`run --json --repeat 3` on one thread over two 4,096-token prompts (`--prompts`; medians: the first prefill after
loading also pages the weights in). The check: `predicted_prefill_ms` against `wall_ms_per_token` x 4096, and each
part's `predicted_parts_ms` / `measured_parts_ms` (goal: the whole within 0.8-1.25x, every part over 10% of the run
within 0.75-1.25x). A part that stays off is said with what the profile lacks there (the axes its price reaches past the
records, or "in range" where the fit misses inside them). The whole is also given on the CPU clock
(`cpu_ms_per_token` x 4096: on a shared host the wall clock counts other processes' time). Prints the host (its CPU
model from /proc/cpuinfo), each shape's compute dtype and the thread count, then a compact table, and writes
DIR/host_check.json with the same (`host`, `threads`, each result's `compute_dtype`; every command's JSON beside
it). Read the figures against `host_speed.now_over_profile` (this host now over its profile's matmul records: about
1.0 on a quiet machine).

`--engine mlx`: the same check through the MLX spine, where a GPU lane's prediction meets a measurement before a Mac
does (off a Mac MLX runs on its CPU device, slowly: tens of minutes at 4,096 tokens). The twin has two layers (MLX
computes what a logit reads: a chunk that fills the cache needs only the last layer's keys and values, which the
cost model prices as such, so a one-layer twin would measure little but those) and is converted as a Mac user holds
it (`mlx_lm convert -q`, 4 bits in groups of 64: what the profile's mlx-exact records pack), the profile times
mlx-exact too (`--backends cpu-exact,cpu-static,mlx-exact`; its records marked `device: cpu`), everything runs in
float32 (MLX's CPU gather kernels take nothing else), `search --engine mlx --resident-mb 1` prices every expert (no
static group holds one) and the dense half on mlx-exact and `run --engine mlx --repeat R` measures it; the parts
measured are `executed`'s (its timed pass, per prompt). Default DIR work-out/host-check-mlx.

`--model DIR`: the same check on that folder instead of the shapes' twins (the reduced form tests run: tiny-moe, a
given profile, a short prompt).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from make_shape_twin import default_dir  # noqa: E402

sys.path.insert(0, str(ROOT))
from autotune.profiling.profile import host_facts  # noqa: E402
from runtime.loading.compute_dtype import dtype_name  # noqa: E402
from runtime.loading.model_loader import resolve_dtype  # noqa: E402
from runtime.mlx.mlx_backends import PROFILE_BITS, PROFILE_GROUP  # noqa: E402

SHAPES = ("phi-3.5-moe", "qwen3-30b-a3b", "phi-tiny-moe")
WHOLE, PART, SHARE = (0.8, 1.25), (0.75, 1.25), 0.10
THREADS = 1  # every command's --threads


def autotune(*args: str, log: Path) -> dict | None:
    """One `autotune` command on one thread; its last stdout line parsed where it prints JSON (stderr to `log`)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.perf_counter()
    print(f"  autotune {' '.join(args)}", file=sys.stderr, flush=True)
    with open(log, "a") as err:
        done = subprocess.run([sys.executable, "-m", "autotune", *args], stdout=subprocess.PIPE, stderr=err,
                              text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        sys.exit(f"autotune {args[0]} failed (exit {done.returncode}); see {log}")
    print(f"    {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None


def twin(shape: str, log: Path, engine: str, layers: int) -> Path:
    """The shape's twin of `layers` decoder layers (made where missing); for the MLX engine its MLX folder, packed
    as the profile's mlx-exact records pack their experts."""
    path = default_dir(shape, layers)
    if not (path / "config.json").exists():
        with open(log, "a") as err:
            subprocess.run([sys.executable, str(ROOT / "scripts" / "make_shape_twin.py"), "--like", shape,
                            "--layers", str(layers)], check=True, stdout=err, stderr=err)
    if engine == "torch":
        return path
    packed = path.with_name(f"{path.name}-mlx{PROFILE_BITS}")
    if not (packed / "config.json").exists():
        with open(log, "a") as err:
            subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(path), "--mlx-path",
                            str(packed), "-q", "--q-bits", str(PROFILE_BITS), "--q-group-size", str(PROFILE_GROUP)],
                           check=True, stdout=err, stderr=err)
    return packed


def verdict(ratio: float, band: tuple[float, float]) -> str:
    return "ok" if band[0] <= ratio <= band[1] else "OFF"


def check(shape: str, model: Path, profile: Path, out: Path, prompt: int, dtype: str, repeat: int,
          engine: str, prompts: int = 2) -> dict:
    log, stem = out / "commands.log", out / shape
    traces, plan = f"{stem}.traces.npz", f"{stem}.plan.json"
    one = ("--threads", str(THREADS), "--dtype", dtype)
    if not Path(traces).exists():  # a rerun in the same folder keeps the routing it calibrated
        # torch's forward of the folder's own packed weights: the same routing, about 10x faster than MLX's CPU device
        autotune("calibrate", "--model", str(model), "--prompt-tokens", str(prompt), "--max-tokens",
                 str(5 * prompt), "--out", traces, "--engine", "torch", *one, log=log)
    lane = () if engine == "torch" else ("--resident-mb", "1")  # no expert fits a static group: all on mlx-exact
    search = autotune("search", "--model", str(model), "--profile", str(profile), "--traces", traces,
                      "--prompt-tokens", str(prompt), "--no-gate", "--json", "--out", plan, "--engine", engine, *lane,
                      *one, log=log)
    run = autotune("run", "--model", str(model), "--plan", plan, "--max-tokens", str(prompts * prompt),
                   "--prompt-tokens", str(prompt), "--repeat", str(repeat), "--json", "--engine", engine, *one, log=log)
    (out / f"{shape}.search.json").write_text(json.dumps(search))
    (out / f"{shape}.run.json").write_text(json.dumps(run))
    measured_ms, cpu_ms = run["wall_ms_per_token"] * prompt, run["cpu_ms_per_token"] * prompt
    whole = search["predicted_prefill_ms"] / measured_ms
    measured, predicted = by_part(run, search, prompt)
    total = sum(v for k, v in measured.items() if isinstance(v, (int, float)))
    outside = search.get("priced_outside") or {}
    parts = {}
    for part, ms in measured.items():
        if not isinstance(ms, (int, float)) or part not in predicted or ms <= 0:
            continue
        ratio, share = predicted[part] / ms, ms / total
        off = share > SHARE and verdict(ratio, PART) != "ok"
        lacks = "; ".join(r["text"] for r in outside.get(part, [])) or "in range: the fit misses inside its records"
        parts[part] = {"predicted_ms": predicted[part], "measured_ms": ms, "ratio": round(ratio, 3),
                       "share": round(share, 3), "verdict": ("OFF" if off else "ok") if share > SHARE else "-",
                       **({"profile_lacks": lacks} if off else {})}
    return {"shape": shape, "model": str(model), "engine": engine,
            "compute_dtype": dtype_name(resolve_dtype(str(model), dtype)),
            "predicted_prefill_ms": search["predicted_prefill_ms"],
            "measured_prefill_ms": measured_ms, "ratio": round(whole, 3), "verdict": verdict(whole, WHOLE),
            "measured_prefill_cpu_ms": cpu_ms, "ratio_cpu": round(search["predicted_prefill_ms"] / cpu_ms, 3),
            "parts": parts, "priced_outside": outside, "chunk_tokens": run["chunk_tokens"],
            "host_speed": run.get("host_speed"), "clock": measured.get("clock")}


def by_part(run: dict, search: dict, prompt: int) -> tuple[dict, dict]:
    """(measured, predicted) ms per part: the torch spine's `measured_parts_ms` and `predicted_parts_ms` (the run's
    routing priced); the MLX spine's `executed` (its timed pass over the run's prompts, each part's lanes summed,
    per prompt, on the wall clock) beside the search's `predicted_parts_ms` (one prompt, the calibration's
    routing)."""
    if run.get("engine") != "mlx":
        return run["measured_parts_ms"], run["predicted_parts_ms"]
    prompts = run["tokens"] / prompt
    measured = {part: sum(lane.get("ms", 0.0) for lane in lanes.values()) / prompts
                for part, lanes in (run.get("executed") or {}).items()}
    return {**measured, "clock": "wall"}, search["predicted_parts_ms"]


def table(results: list[dict], host: dict, threads: int, engine: str) -> str:
    dtypes = ", ".join(f"{r['shape']} {r['compute_dtype']}" for r in results)
    spine = "torch on the CPU" if engine == "torch" else "the MLX spine on MLX's CPU device"
    lines = [f"host: {host['cpu_model']} ({host['logical_cores']} logical cores, {host['os']}); engine {engine} "
             f"({spine}); {threads} torch thread(s); computed in: {dtypes}",
             f"{'shape':<15} {'predicted ms':>13} {'measured ms':>12} {'ratio':>6}  parts (predicted/measured, share)"]
    for r in results:
        parts = ", ".join(f"{p} {v['ratio']:.2f} ({v['share']:.0%}){' OFF' if v['verdict'] == 'OFF' else ''}"
                          for p, v in sorted(r["parts"].items(), key=lambda kv: -kv[1]["share"]))
        lines.append(f"{r['shape']:<15} {r['predicted_prefill_ms']:>13.0f} {r['measured_prefill_ms']:>12.0f} "
                     f"{r['ratio']:>6.2f} {r['verdict']:<3} {parts}")
        speed = (r.get("host_speed") or {}).get("now_over_profile")
        lines.append(f"{'':<15} on the CPU clock: {r['measured_prefill_cpu_ms']:.0f} ms, ratio {r['ratio_cpu']:.2f} "
                     f"(a shared host's wall clock counts other processes); host_speed.now_over_profile {speed}, "
                     f"chunk {r['chunk_tokens']}")
        for p, v in r["parts"].items():
            if v["verdict"] == "OFF":
                lines.append(f"{'':<15} {p} off: {v['profile_lacks']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, among {', '.join(SHAPES)}")
    ap.add_argument("--out", type=Path, default=None, metavar="DIR",
                    help="default work-out/host-check (work-out/host-check-mlx with --engine mlx)")
    ap.add_argument("--profile", type=Path, metavar="FILE",
                    help="an existing profile of this host to add the twins' shapes to (default: a fresh "
                         "`profile-device --quick --threads 1` into DIR/profile.json)")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--dtype", default=None,
                    help="the runs' --dtype (default auto, as a user runs them; float32 with --engine mlx)")
    ap.add_argument("--engine", choices=("torch", "mlx"), default="torch",
                    help="the spine that runs the twins (default torch); mlx: see above")
    ap.add_argument("--layers", type=int, default=None,
                    help="the twins' decoder layers (default 1; 2 with --engine mlx: MLX leaves out the last layer's "
                         "work past its keys and values for rows no logit reads, so a one-layer twin's prefill "
                         "would compute little else)")
    ap.add_argument("--prompts", type=int, default=2,
                    help="prompts each run prefills (default 2; at 4,096 tokens MLX's CPU device takes minutes each)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="run --repeat R: the whole's and each part's median over R prefills (default 3: the first "
                         "one after loading also pages the weights in)")
    ap.add_argument("--model", type=Path, metavar="DIR",
                    help="check this model folder instead of the shapes' twins (e.g. tiny-moe: the reduced form)")
    args = ap.parse_args()
    args.out = args.out or ROOT / "work-out" / ("host-check" if args.engine == "torch" else "host-check-mlx")
    args.dtype = args.dtype or ("auto" if args.engine == "torch" else "float32")
    shapes = [args.model.name] if args.model else [s for s in args.shapes.split(",") if s]
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "commands.log"
    print(f"host check: {', '.join(shapes)} (commands' stderr in {log})", file=sys.stderr)
    args.layers = args.layers or (1 if args.engine == "torch" else 2)
    models = {shapes[0]: args.model} if args.model else {s: twin(s, log, args.engine, args.layers) for s in shapes}
    profile = args.profile or args.out / "profile.json"
    backends = () if args.engine == "torch" else ("--backends", "cpu-exact,cpu-static,mlx-exact")
    if args.profile is None:
        autotune("profile-device", "--quick", "--threads", str(THREADS), "--out", str(profile), "--no-progress",
                 *backends, log=log)
    for s in shapes:  # the twin's own shapes, in the dtype it computes in (kept where the profile has them)
        measured = json.loads(profile.read_text()).get("settings", {}).get("models", {})
        if not any(key.split("@")[0] == models[s].name for key in measured):
            autotune("profile-device", "--quick", "--threads", str(THREADS), "--model", str(models[s]), "--out",
                     str(profile), "--dtype", args.dtype, "--no-progress", log=log)
    results = [check(s, models[s], profile, args.out, args.prompt_tokens, args.dtype, args.repeat, args.engine,
                     args.prompts) for s in shapes]
    host = {k: v for k, v in host_facts(THREADS).items() if k in ("cpu_model", "logical_cores", "description", "os")}
    report = {"profile": str(profile), "host": host, "prompt_tokens": args.prompt_tokens, "dtype": args.dtype,
              "threads": THREADS, "engine": args.engine, "layers": args.layers, "prompts": args.prompts,
              "repeat": args.repeat,
              "goal": {"whole": WHOLE, "part": PART, "part_share_over": SHARE}, "results": results,
              "met": all(r["verdict"] == "ok" and all(p["verdict"] != "OFF" for p in r["parts"].values())
                         for r in results)}
    (args.out / "host_check.json").write_text(json.dumps(report, indent=1))
    print(table(results, host, THREADS, args.engine))
    print(f"wrote {args.out / 'host_check.json'}; goal met: {report['met']}")


if __name__ == "__main__":
    main()
