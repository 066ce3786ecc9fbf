"""Measure what the drift monitor sees: per 16-chunk window, the overflow rate and each layer's TV distance from the
plan's calibration shares, on in-domain held-out text and on shifted text (stdlib code, numeric CSV records).

    python scripts/drift_windows.py --plan plans/tiny-moe@apple-m2-ultra-published.json --write-texts DIR

`--write-texts DIR` also writes the shifted texts used in the drift note: csv-a.txt / csv-b.txt (numeric CSV
records from two seeds) and stdlib-a.txt / stdlib-b.txt (the even / odd files of builtin:stdlib-code), so a plan
re-tuned on one half can be checked on the other. Prints one JSON object per text (1 torch thread).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch

from autotune.calibration.texts import stdlib_code_files, stdlib_root
from autotune.calibration.workload import encode_text
from runtime.drift import WINDOW_CHUNKS, DriftMonitor
from runtime.executor import PlanExecutor
from runtime.loading.model_loader import load_model
from runtime.plan import load_plan
from runtime.prefill import prefill_logits

HALF_CHARS = 150_000


def csv_records(seed: int, rows: int = 6000) -> str:
    """Sensor-style CSV: an id, an ISO date, and five numeric columns."""
    rng = random.Random(seed)
    lines = ["id,date,station,temperature,humidity,pressure,wind_speed,price"]
    for i in range(rows):
        lines.append(f"{rng.randint(10000, 99999)},2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d},"
                     f"{rng.randint(1, 400)},{rng.uniform(-20, 40):.2f},{rng.uniform(0, 100):.1f},"
                     f"{rng.uniform(950, 1050):.1f},{rng.uniform(0, 30):.2f},{rng.uniform(0, 1000):.2f}")
    return "\n".join(lines) + "\n"


def write_texts(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "csv-a.txt").write_text(csv_records(1))
    (out / "csv-b.txt").write_text(csv_records(2))
    files = stdlib_code_files()
    for name, part in (("stdlib-a.txt", files[0::2]), ("stdlib-b.txt", files[1::2])):
        sources = ((stdlib_root() / f).read_text(encoding="utf-8", errors="replace").strip() for f in part)
        (out / name).write_text("\n\n".join(sources)[:HALF_CHARS])


def windows(model, plan, ids: torch.Tensor, prompt_tokens: int, window: int) -> list[dict]:
    """Every full window's figures, as the monitor judges them after each chunk."""
    executor = PlanExecutor(model, plan)
    monitor, seen = DriftMonitor(plan, window), []
    observe = monitor.observe

    def spy(layer, loads, overflow):
        observe(layer, loads, overflow)
        if layer == monitor.last_layer and len(monitor.recent[layer]) == monitor.window:
            layers, rate = monitor._window()
            seen.append({"rate": rate, "tv": [layers[i]["tv"] for i in sorted(layers)]})

    for index in executor.layers:
        executor.stats.layer(index).watcher = lambda loads, overflow, i=index: spy(i, loads, overflow)
    with executor:
        for start in range(0, ids.numel(), prompt_tokens):
            prefill_logits(model, ids[start:start + prompt_tokens], plan.chunk_tokens)
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--texts", nargs="+", default=["builtin:pydoc-heldout", "builtin:stdlib-code"])
    ap.add_argument("--write-texts", metavar="DIR", help="write the shifted texts there and measure them too")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=WINDOW_CHUNKS, help="chunks per window")
    args = ap.parse_args()
    torch.set_num_threads(1)
    texts = list(args.texts)
    if args.write_texts:
        write_texts(Path(args.write_texts))
        texts += [str(Path(args.write_texts) / n) for n in ("csv-a.txt", "csv-b.txt", "stdlib-a.txt", "stdlib-b.txt")]
    model, tokenizer = load_model(args.model)
    plan = load_plan(args.plan)
    if not plan.calibrated:  # a template's plan: no calibration shares to measure drift against
        ap.error(f"--plan {args.plan}: the plan has no calibration (make one with `autotune search`)")
    for text in texts:
        ws = windows(model, plan, encode_text(tokenizer, text, args.max_tokens), args.prompt_tokens, args.window)
        if not ws:  # the text is shorter than one window, or the plan has no static layer to watch
            ap.error(f"{text}: no full window of {args.window} chunks (a longer --max-tokens, or a plan with groups)")
        rates = np.array([w["rate"] for w in ws])
        tv = np.array([w["tv"] for w in ws])
        print(json.dumps({"text": text, "window": args.window, "windows": len(ws),
                          "expected_rate": plan.heldout_overflow_rate(),
                          "rate_median": float(np.median(rates)), "rate_max": float(rates.max()),
                          "tv_max_per_layer": tv.max(0).round(4).tolist(),
                          "tv_median_per_layer": np.median(tv, 0).round(4).tolist(),
                          "tv_worst_layer_min": float(tv.max(1).min())}), flush=True)


if __name__ == "__main__":
    main()
