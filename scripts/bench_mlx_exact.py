"""The decode step on mlx-exact against cpu-exact, side by side in one process, and the per-call cost of crossing
between torch and MLX.

Two measurements, each interleaving the two paths within every repetition (the order alternates) so that noise on a
shared machine hits them alike; figures are medians over repetitions:

- `layer`: one MoE layer's decode step (`ExactLayer.forward`: 1 and 4 rows, top-k experts each) on the same packed
  4-bit experts (mx.quantize, groups of 64) at a model's layer width (default Qwen3-30B-A3B's: hidden 2048, expert
  FFN 768, top-8; 32 experts, as a decode step reads only its k), cpu-exact (each expert dequantized by torch, then
  its matmuls) against mlx-exact (`mx.gather_qmm` on the codes);
- `generate`: `runtime.generate`'s median decode step on tiny-moe converted by mlx-lm to 4 bits (64 new greedy
  tokens), its plan's exact path cpu-exact against mlx-exact; and the run statistics' mean crossing per call.

`crossing_us`: the crossing alone at the layer width (a one-row decode step's rows, expert ids and router weights
into MLX, its output back as a torch view: what `forward` crosses), median, apart from any compute; the run's
figure is the statistics' mean per call (descheduling on a loaded machine included). Off a Mac MLX runs on its CPU
device: these are CPU figures, not a GPU's.

    python scripts/bench_mlx_exact.py --threads 1 [--repeats 15] [--model MLX_FOLDER]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # MLX's CPU device and torch both on one thread unless --threads
import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from script_deps import require  # noqa: E402  (scripts/)

import runtime  # noqa: E402
from runtime.cpu.cpu_backends import CpuExactLayer  # noqa: E402
from runtime.loading.model_loader import model_spec  # noqa: E402
from runtime.mlx.mlx_backends import packed_like  # noqa: E402
from runtime.mlx.mlx_exact import MlxExactLayer, device, step_inputs, to_mx, to_torch  # noqa: E402
from runtime.plan import LayerPlan, Plan  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (2048, 768, 8), "tiny-moe": (256, 256, 2)}


def _median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def side_by_side(impls: dict, repeats: int, calls: int) -> dict[str, float]:
    """Median over repeats of each implementation's median call (µs), interleaved, order alternating."""
    names, runs = list(impls), {name: [] for name in impls}
    for name in names:
        impls[name]()  # warm-up
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            runs[name].append(_median_us(impls[name], calls))
    return {name: statistics.median(v) for name, v in runs.items()}


def layer_bench(shape: str, repeats: int) -> dict:
    from autotune.profiling.callers import make_experts

    hidden, ffn, k = SHAPES[shape]
    module = packed_like(make_experts(hidden, ffn, 32))
    cpu, mlx = CpuExactLayer(module), MlxExactLayer(module)  # the same packed codes (torch views MLX's copy)
    gen = torch.Generator().manual_seed(0)
    out = {}
    with torch.inference_mode():
        for rows in (1, 4):
            x = torch.randn(rows, hidden, generator=gen)
            idx = torch.stack([torch.randperm(32, generator=gen)[:k] for _ in range(rows)])
            w = torch.softmax(torch.randn(rows, k, generator=gen), -1)
            gap = float((cpu.forward(x, idx, w) - mlx.forward(x, idx, w)).abs().max())
            t = side_by_side({"cpu-exact": lambda: cpu.forward(x, idx, w),
                              "mlx-exact": lambda: mlx.forward(x, idx, w)}, repeats, 20)
            out[f"rows_{rows}"] = {"cpu_exact_us": t["cpu-exact"], "mlx_exact_us": t["mlx-exact"],
                                   "ratio_cpu_over_mlx": t["cpu-exact"] / t["mlx-exact"], "max_abs_diff": gap}
        x, idx, w = x[:1], idx[:1], w[:1]
        y = to_mx(torch.randn(1, hidden, generator=gen))
        out["crossing_us"] = _median_us(lambda: (step_inputs(x, idx, w), to_torch(y, torch.float32)), 2000)
    return out


def all_exact_plan(model: torch.nn.Module, exact: str | None) -> Plan:
    spec = model_spec(model)
    return Plan(model=spec, chunk_tokens=256, overflow="spill", saliency="router_weight", exact=exact,
                layers=[LayerPlan(layer=i, groups=[], cpu_exact=list(range(spec.num_experts)))
                        for i in spec.moe_layers])


def converted_tiny_moe(out: Path) -> Path:
    """tiny-moe through mlx_lm.convert -q (4 bits, groups of 64), its rope_theta where mlx-lm reads it."""
    import shutil

    import mlx_lm

    from runtime.loading.model_loader import TINY_MOE_DIR

    src = out.parent / "src"
    shutil.copytree(TINY_MOE_DIR, src)
    config = json.loads((src / "config.json").read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    (src / "config.json").write_text(json.dumps(config))
    mlx_lm.convert(str(src), str(out), quantize=True, q_bits=4, q_group_size=64)
    return out


def generate_bench(folder: str, repeats: int, new_tokens: int) -> dict:
    cpu = runtime.load(folder, plan=None, dtype="float32")
    plans = {name: all_exact_plan(cpu.model, exact) for name, exact in (("cpu-exact", None),
                                                                         ("mlx-exact", "mlx-exact"))}
    loaded = {name: runtime.load(folder, plan=plan, dtype="float32") for name, plan in plans.items()}
    ids = loaded["cpu-exact"].tokenizer.encode("def main():\n    ", add_special_tokens=False)
    steps: dict[str, list[float]] = {name: [] for name in loaded}
    tokens = {}
    for name in loaded:  # warm-up
        runtime.generate(loaded[name], ids, max_tokens=new_tokens)
    for r in range(repeats):
        for name in (list(loaded) if r % 2 == 0 else list(loaded)[::-1]):
            result = runtime.generate(loaded[name], ids, max_tokens=new_tokens)
            steps[name].append(result.decode_step_ms)
            tokens[name] = result.token_ids
    decode = loaded["mlx-exact"].stats.total("decode").to_json()
    cpu_ms, mlx_ms = (statistics.median(steps[n]) for n in ("cpu-exact", "mlx-exact"))
    return {"decode_step_ms": {"cpu-exact": cpu_ms, "mlx-exact": mlx_ms}, "ratio_cpu_over_mlx": cpu_ms / mlx_ms,
            "same_tokens": tokens["cpu-exact"] == tokens["mlx-exact"],
            "crossing_us_per_call": decode["crossing_us_per_call"]["mlx-exact"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--shape", choices=SHAPES, default="qwen3-30b-a3b", help="the layer bench's width")
    ap.add_argument("--model", help="an MLX 4-bit folder of tiny-moe (default: converted here by mlx-lm)")
    args = ap.parse_args()
    require("bench_mlx_exact.py", "mlx", "mlx_lm")
    torch.set_num_threads(args.threads)
    report = {"device": f"MLX {device()}", "threads": args.threads, "shape": args.shape,
              "layer": layer_bench(args.shape, args.repeats)}
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or str(converted_tiny_moe(Path(tmp) / "q4"))
        report["generate"] = generate_bench(folder, args.repeats, args.new_tokens)
    for rows in ("rows_1", "rows_4"):
        r = report["layer"][rows]
        print(f"layer decode step ({args.shape}, {rows.replace('_', ' ')}): cpu-exact {r['cpu_exact_us']:.0f} us, "
              f"mlx-exact {r['mlx_exact_us']:.0f} us, ratio {r['ratio_cpu_over_mlx']:.2f}")
    g = report["generate"]
    print(f"generate decode step (tiny-moe 4-bit): cpu-exact {g['decode_step_ms']['cpu-exact']:.2f} ms, mlx-exact "
          f"{g['decode_step_ms']['mlx-exact']:.2f} ms, ratio {g['ratio_cpu_over_mlx']:.2f}, same tokens "
          f"{g['same_tokens']}")
    print(f"crossing: {report['layer']['crossing_us']:.1f} us bare at the layer width, "
          f"{g['crossing_us_per_call']:.1f} us mean per call in the run ({report['device']})")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
