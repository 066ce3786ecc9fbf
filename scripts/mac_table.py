"""What fits on a 16, 32, 64 and 192 GB Mac: Qwen3-30B-A3B and Phi-3.5-MoE (published configs) held as MLX 4-bit,
MLX 8-bit (group 64) or bf16, each searched with `autotune search --memory-gb <RAM - 8 GB>` on the published
M2 Ultra profile for 4096-token prompts. Every figure is predicted (costing/memory.py, the profile's cost model).

    python scripts/mac_table.py [--trials N] [--json]

Each model is a folder made here without its weights: config.json (with mlx's `quantization` table for the MLX
storages) and the routers (random, as scripts/make_shape_twin.py draws them) in one safetensors file, which is all
`autotune search` reads of a checkpoint; its traces are synthetic (Zipf 1.1, token-level, `synthetic_traces`), so
the routing is not the real model's. Budget: the Mac's RAM less 8 GB for macOS and apps (an assumption). Per cell:
whether any plan fits (else the refusal's figure), the CPU storage the search chose (a bf16 checkpoint may be
quantized at load), the experts resident on the ANE, the predicted memory and the predicted prefill of one prompt
(`predicted_prefill_ms`). Searches run with `--no-gate` (random routers: the gate would measure noise).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from make_shape_twin import ROUTER_STD, TWINS, _checkpoint_tensors, twin_config  # noqa: E402

MACS_GB = (16, 32, 64, 192)
RESERVED_GB = 8  # macOS and apps
STORAGES = {"MLX 4-bit": {"bits": 4, "group_size": 64}, "MLX 8-bit": {"bits": 8, "group_size": 64}, "bf16": None}
PROMPT = 4096
PROFILE = "apple-m2-ultra-published"


def config_folder(like: str, quantization: dict | None, out: Path) -> Path:
    """config.json and the routers of the published model, no other weight."""
    import transformers
    from safetensors.torch import save_file

    config = twin_config(like, TWINS[like]["num_hidden_layers"])
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    if quantization:
        obj = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**obj, "quantization": quantization}, indent=1))
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(0)
    # under the model's own parameter names: what the MLX reader looks up (the bf16 reader tries every form)
    routers = {name: torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, ROUTER_STD, generator=gen)
               for name, p in skeleton.named_parameters()
               for _, shape, role in _checkpoint_tensors(name, tuple(p.shape), config.model_type) if role == "router"}
    save_file(routers, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def traces_for(folder: Path, out: Path) -> Path:
    from autotune.calibration.traces import save_traces, synthetic_traces
    from runtime.loading.model_record import read_model_spec

    save_traces(synthetic_traces(read_model_spec(str(folder)).model_dump(), 10, PROMPT, skew=1.1, tokens=True), out)
    return out


def search(folder: Path, traces: Path, budget_gb: float, trials: int, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "autotune", "search", "--model", str(folder), "--traces",
                           str(traces), "--profile", PROFILE, "--memory-gb", str(budget_gb), "--prompt-tokens",
                           str(PROMPT), "--trials", str(trials), "--no-gate", "--threads", "1", "--out", str(out),
                           "--json"], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        return {"fits": False, "refusal": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return summary(json.loads(proc.stdout.strip().splitlines()[-1]), json.loads(out.read_text()))


def summary(r: dict, plan: dict) -> dict:
    """One cell from a search's report (`--json`, or the plan's .report.json) and its plan."""
    resident = {(lp["layer"], e) for lp in plan["layers"] for g in lp["groups"] if g["backend"] == "ane"
                for e in g["experts"]}
    experts = len(plan["layers"]) * plan["model"]["num_experts"]
    return {"fits": True, "cpu_storage": r["cpu_weights"]["storage"], "why": r["cpu_weights"]["reason"],
            "ane_resident": len(resident), "experts": experts, "memory_gb": r["predicted_memory"]["total_gb"],
            "ane_package_gb": round(r["predicted_memory"]["ane_package_bytes"] / 1e9, 3),
            "predicted_prefill_ms": r.get("predicted_prefill_ms"), "chunk_tokens": r["chunk_tokens"],
            "coreml_cpu_prefill_ms": (r.get("whole_prefill") or {}).get("prefill_baselines", {}).get(
                "coreml-cpu", {}).get("predicted_prefill_ms")}


def cell(r: dict) -> str:
    if not r["fits"]:
        found = re.search(r"(\d+\.\d+) GB predicted", r["refusal"])
        return f"no (needs {found.group(1) if found else '?'} GB)"
    return (f"{r['cpu_storage']} on the CPU, {r['ane_resident']}/{r['experts']} experts on the ANE, "
            f"{r['memory_gb']:.1f} GB, prefill {r['predicted_prefill_ms']:,.0f} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20, help="Optuna trials per layer (default 20)")
    p.add_argument("--models", default="qwen3-30b-a3b,phi-3.5-moe", help="models (default: both)")
    p.add_argument("--macs", default=",".join(map(str, MACS_GB)), help="Mac memory sizes in GB")
    p.add_argument("--json", action="store_true", help="also print every cell as one JSON line")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="npumoe-mac-table-") as d:
        work = Path(d)
        for like in args.models.split(","):
            for label, quantization in STORAGES.items():
                folder = config_folder(like, quantization, work / f"{like}-{label.replace(' ', '')}")
                traces = traces_for(folder, folder / "traces.npz")
                for mac in map(int, args.macs.split(",")):
                    print(f"{like} {label} {mac} GB ...", file=sys.stderr, flush=True)
                    r = search(folder, traces, mac - RESERVED_GB, args.trials, folder / f"plan-{mac}.json")
                    rows.append({"model": like, "storage": label, "mac_gb": mac, "budget_gb": mac - RESERVED_GB,
                                 **r})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    macs = sorted({r["mac_gb"] for r in rows})
    print(f"predicted ({PROFILE}, {PROMPT}-token prompts, budget = RAM - {RESERVED_GB} GB, synthetic routing)")
    print("| model | checkpoint | " + " | ".join(f"{m} GB Mac" for m in macs) + " |")
    print("|---|---|" + "---|" * len(macs))
    for like in dict.fromkeys(r["model"] for r in rows):
        for label in STORAGES:
            cells = {r["mac_gb"]: cell(r) for r in rows if r["model"] == like and r["storage"] == label}
            if cells:
                print(f"| {like} | {label} | " + " | ".join(cells.get(m, "-") for m in macs) + " |")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
