"""Calibration through torch against mlx-lm on one folder and text, side by side: the routing each records and the
seconds each takes.

    python scripts/bench_calibrate.py --model DIR [--max-tokens N] [--prompt-tokens N] [--chunk N] [--repeat R]
                                      [--dtype D] [--threads N]

Runs `calibrate` (autotune/calibration/stage.py) with `--engine torch` and `--engine mlx` in one process,
alternating, `--repeat` times each (torch threads: `--threads`, 1 by default), and prints one JSON object: each
engine's seconds per run (the model's load and the recording, as `calibrate --json` reports `seconds`), the ratio of
the medians (torch / mlx: above 1, mlx is faster), the CPU seconds the process spent in each run (every thread: on
a host shared with other work, wall time waits for the cores, and MLX hands each op to its own thread), the device
MLX ran on, and the routing agreement of the two engines' traces (`traces.routing_agreement`: same experts, ties
within fp rounding, other differences). On Linux MLX runs on its CPU; on a Mac on the GPU. Measured, never
predicted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch
    from script_deps import require  # scripts/

    from autotune.calibration.stage import calibrate
    from autotune.calibration.texts import DEFAULT_CALIB_TEXT
    from autotune.calibration.traces import routing_agreement
    from runtime.loading.model_record import resolve_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model folder mlx-lm loads (an MLX folder)")
    p.add_argument("--text", default=DEFAULT_CALIB_TEXT)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dtype", default="float32", help="both engines' --dtype (float32: compared exactly)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    require("bench_calibrate.py", "mlx", "mlx_lm")
    torch.set_num_threads(args.threads)
    seconds, cpu_seconds, traces, device = {"torch": [], "mlx": []}, {"torch": [], "mlx": []}, {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            for engine in ("torch", "mlx") if r % 2 == 0 else ("mlx", "torch"):
                start = time.process_time()
                result = calibrate(resolve_model(args.model, args.dtype), args.text, chunk=args.chunk,
                                   prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                                   out=Path(tmp) / f"{engine}.npz", progress=False, engine=engine)
                seconds[engine].append(result.summary["seconds"])
                cpu_seconds[engine].append(round(time.process_time() - start, 3))
                traces[engine] = result.traces
                device = result.summary["device"] if engine == "mlx" else device
    median = {e: statistics.median(s) for e, s in seconds.items()}
    print(json.dumps({"model": args.model, "tokens": traces["torch"].header["tokens"], "dtype": args.dtype,
                      "threads": args.threads, "mlx_device": device, "seconds": seconds, "median_seconds": median,
                      "cpu_seconds": cpu_seconds,
                      "torch_over_mlx": round(median["torch"] / median["mlx"], 3),
                      "agreement": routing_agreement(traces["mlx"], traces["torch"])}))


if __name__ == "__main__":
    main()
