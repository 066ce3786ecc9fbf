"""The pictures in README.md and docs/: the plan map the main job's search writes, and the whole prefill per part.

    python scripts/make_figures.py [--only map|prefill] [--trials N]

- docs/img/plan-map.png: `autotune search --model tiny-moe --profile apple-m2-ultra-published` (the README's main
  job, run in a temporary folder) writes the plan with its map (`<plan>.map.png`); this copies that map.
- docs/img/whole-prefill.png: at the paper's shapes (Qwen3-30B-A3B, Phi-3.5-MoE, Phi-tiny-MoE; 4,096-token
  prompts), the search with its dense decisions (scripts/bench_prefill.py) and each whole-model baseline, each
  design's predicted time per part of one prompt's prefill. Every bar is predicted by the cost model of the
  published M2 Ultra profile; nothing in it was measured.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_prefill import SHAPES, bench  # noqa: E402

from autotune.costing.whole_prefill import PARTS  # noqa: E402
from autotune.profiling.profile import load_profile  # noqa: E402
from autotune.searching.prefill_report import PREFILL_BASELINES  # noqa: E402
from runtime.plan import COMPRESSIONS  # noqa: E402

IMG = ROOT / "docs" / "img"
PROFILE = "apple-m2-ultra-published"
PROMPT = 4096
SHAPE_TITLES = {"qwen3-30b-a3b": "Qwen3-30B-A3B", "phi-3.5-moe": "Phi-3.5-MoE", "phi-tiny-moe": "Phi-tiny-MoE"}



def plan_map(out: Path) -> None:
    """Run the main job's search in a temporary folder and keep its plan map."""
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.json"
        subprocess.run([sys.executable, "-m", "autotune", "search", "--model", "tiny-moe", "--profile", PROFILE,
                        "--out", str(plan)], cwd=tmp, check=True, env=_env())
        shutil.copyfile(plan.with_suffix(".map.png"), out)


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _label(design: str) -> str:
    """A design's name on the chart: its description up to a colon or parenthesis, on lines of 30 characters."""
    if design == "plan":
        return "npumoe plan"
    return textwrap.fill(re.split(r"[:(]", PREFILL_BASELINES[design])[0].strip(), 30)


def prefill_chart(out: Path, trials: int) -> None:
    """Stacked bars: each design's predicted time per part of one 4,096-token prefill, one panel per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cost = load_profile(PROFILE).cost_model
    fig, axes = plt.subplots(1, len(SHAPES), figsize=(13, 4.6))
    colours = plt.get_cmap("tab10").colors
    for ax, shape in zip(axes, SHAPES):
        r = bench(cost, shape, PROMPT, "latency", 1.1, 10, trials, COMPRESSIONS)
        designs = {"plan": r["predicted_parts_ms"],
                   **{name: b["predicted_parts_ms"] for name, b in r["prefill_baselines"].items()}}
        names = ["plan", *PREFILL_BASELINES]
        bottom = [0.0] * len(names)
        for i, part in enumerate(PARTS):
            secs = [designs[n].get(part, 0.0) / 1000 for n in names]
            ax.barh(range(len(names)), secs, left=bottom, color=colours[i], label=part.replace("_", " "))
            bottom = [b + s for b, s in zip(bottom, secs)]
        ax.set_yticks(range(len(names)), [_label(n) for n in names], fontsize=6)
        ax.invert_yaxis()
        ax.set_title(f"{SHAPE_TITLES[shape]}, {PROMPT} tokens (chunk {r['chunk_tokens']})", fontsize=9)
        ax.set_xlabel("predicted seconds per prompt", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle("Whole prefill per part, predicted by the published M2 Ultra profile's cost model "
                 "(synthetic Zipf-1.1 routing)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("map", "prefill"), default=None, help="make one picture (default: both)")
    ap.add_argument("--trials", type=int, default=40, help="Optuna trials per layer of each search (default 40)")
    args = ap.parse_args()
    IMG.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "map"):
        plan_map(IMG / "plan-map.png")
        print(f"wrote {IMG / 'plan-map.png'}")
    if args.only in (None, "prefill"):
        prefill_chart(IMG / "whole-prefill.png", args.trials)
        print(f"wrote {IMG / 'whole-prefill.png'}")


if __name__ == "__main__":
    main()
