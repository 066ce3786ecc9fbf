"""The MLX spine's overhead against mlx-lm, beside today's torch spine with mlx-exact, measured side by side.

Three sides on one model folder (default tiny-moe, through mlx-lm's loader) in float32, with a plan that puts every
expert on mlx-exact and no static group:
- `mlx-lm`: mlx-lm's own `generate_step` on the same model object with the plan uninstalled (its prefill in chunks
  of the plan's size, then its decode steps);
- `mlx-spine`: `runtime.generate` on the MLX spine (`--engine mlx`);
- `torch-spine`: `runtime.generate` on the torch spine, the experts crossing to mlx-exact call by call.
Prefill is the time to the first token (wall, and the process's CPU time: a shared host's other load inflates the
wall clock only); decode is tokens/s after the first. The sides run interleaved, `--repeats` rounds, each figure the
median of its rounds; the ratios are from this one run: `prefill_vs_mlx_lm` = mlx-lm's prefill time / ours
(`prefill_cpu_vs_mlx_lm` on CPU time), `decode_vs_mlx_lm` = our decode tok/s / mlx-lm's (>= 1: ours is as fast),
and the same for the torch spine. On Linux MLX runs on its CPU device: the figures are the spine's overhead,
not a GPU's speed.

    python scripts/bench_spine.py --json [--quick] [--model DIR] [--threads 1]
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time

import torch

from autotune.calibration.texts import DEFAULT_EVAL_TEXT
from autotune.calibration.workload import encode_text
from autotune.searching.templates import template_plan
from runtime import generation
from runtime.loading.model_record import read_model_spec


def _mlx_lm_prefill(loaded, ids: list[int], chunk: int) -> None:
    """mlx-lm's own prefill (`generate_step` to its first token) on the spine's model, the plan uninstalled."""
    import mlx.core as mx

    step = importlib.import_module("mlx_lm.generate").generate_step
    with loaded.unmodified():
        for _ in step(mx.array(ids), loaded.model.mlx, max_tokens=1, prefill_step_size=chunk):
            pass


def _mlx_lm_decode(loaded, ids: list[int], tokens: int, chunk: int) -> float:
    """mlx-lm's `generate_step` tokens/s after its first token."""
    import mlx.core as mx

    step = importlib.import_module("mlx_lm.generate").generate_step
    with loaded.unmodified():
        first = None
        for n, _ in enumerate(step(mx.array(ids), loaded.model.mlx, max_tokens=tokens, prefill_step_size=chunk)):
            if n == 0:
                first = time.perf_counter()
        return (tokens - 1) / (time.perf_counter() - first)


def _decode(loaded, ids: list[int], tokens: int) -> float:
    r = generation.generate(loaded, ids, max_tokens=tokens)
    assert r.generated_tokens == tokens, r.finish_reason
    return r.generation_tok_s


def _clocked(fn) -> tuple[float, float]:
    """(wall s, process CPU s: every thread's, which a shared host's other load does not inflate) of `fn()`."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(model: str, prompt_tokens: int, decode_tokens: int, repeats: int, chunk: int) -> dict:
    plan = template_plan(read_model_spec(model), chunk_tokens=chunk, exact="mlx-exact", grouped=False)
    spine = generation.load(model, plan, engine="mlx", dtype="float32")
    torch_spine = generation.load(model, plan, engine="torch", dtype="float32")
    ids = encode_text(spine.tokenizer, DEFAULT_EVAL_TEXT, prompt_tokens).tolist()
    prefills = {"mlx-lm": lambda: _mlx_lm_prefill(spine, ids, chunk),
                "mlx-spine": lambda: generation.generate(spine, ids, max_tokens=1),
                "torch-spine": lambda: generation.generate(torch_spine, ids, max_tokens=1)}
    decodes = {"mlx-lm": lambda: _mlx_lm_decode(spine, ids, decode_tokens, chunk),
               "mlx-spine": lambda: _decode(spine, ids, decode_tokens),
               "torch-spine": lambda: _decode(torch_spine, ids, decode_tokens)}
    for run in [*prefills.values(), *decodes.values()]:  # untimed: first-call costs out of the rounds
        run()
    wall: dict[str, list[float]] = {s: [] for s in prefills}
    cpu: dict[str, list[float]] = {s: [] for s in prefills}
    tok_s: dict[str, list[float]] = {s: [] for s in prefills}
    for _ in range(repeats):  # interleaved: a shared host's load falls on every side alike
        for side in prefills:
            w, c = _clocked(prefills[side])
            wall[side].append(w)
            cpu[side].append(c)
            tok_s[side].append(decodes[side]())
    p, c, d = ({s: statistics.median(v) for s, v in fig.items()} for fig in (wall, cpu, tok_s))
    return {"model": model, "prompt_tokens": len(ids), "decode_tokens": decode_tokens, "chunk_tokens": chunk,
            "repeats": repeats, "dtype": "float32", "mlx_device": spine.executor.lane,
            "prefill_ms": {s: round(v * 1e3, 2) for s, v in p.items()},
            "prefill_cpu_ms": {s: round(v * 1e3, 2) for s, v in c.items()},
            "decode_tok_s": {s: round(v, 2) for s, v in d.items()},
            "prefill_vs_mlx_lm": round(p["mlx-lm"] / p["mlx-spine"], 4),
            "prefill_cpu_vs_mlx_lm": round(c["mlx-lm"] / c["mlx-spine"], 4),
            "decode_vs_mlx_lm": round(d["mlx-spine"] / d["mlx-lm"], 4),
            "torch_spine_prefill_vs_mlx_lm": round(p["mlx-lm"] / p["torch-spine"], 4),
            "torch_spine_prefill_cpu_vs_mlx_lm": round(c["mlx-lm"] / c["torch-spine"], 4),
            "torch_spine_decode_vs_mlx_lm": round(d["torch-spine"] / d["mlx-lm"], 4),
            "measured": "sides interleaved, median of the rounds: prefill wall and process CPU time to the first "
                        "token, decode tokens/s after it"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-moe", help="a model folder mlx-lm loads (default tiny-moe)")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=256, help="the plan's prefill chunk (default 256)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--quick", action="store_true", help="a 128-token prompt, 16 new tokens, one round")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.prompt_tokens, args.decode_tokens, args.repeats, args.chunk = 128, 16, 1, 64
    out = measure(args.model, args.prompt_tokens, args.decode_tokens, args.repeats, args.chunk)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
