"""Helpers shared by several test files (test modules never import each other)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from autotune.costing.costmodel import BackendModel, CostModel
from autotune.costing.fitting import record_features
from autotune.costing.whole_prefill import DecoderShape
from autotune.profiling.settings import Settings
from runtime.loading.model_loader import load_model
from runtime.serving.server import listen, make_server

_MODELS: dict = {}


def random_model(name: str):
    """Random models are seeded; cache them per session (they are only read)."""
    if name not in _MODELS:
        _MODELS[name] = load_model(name)
    return _MODELS[name]


def one_ane_group(plan):
    """The plan with only layer 0 group 0 on `ane` (one function: fast build tests); every other group on
    cpu-static."""
    layers = []
    for li, lp in enumerate(plan.layers):
        groups = [g.model_copy(update={"backend": "ane" if (li, gi) == (0, 0) else "cpu-static"})
                  for gi, g in enumerate(lp.groups)]
        layers.append(lp.model_copy(update={"groups": groups}))
    return plan.model_copy(update={"layers": layers})


TRUE = {"call_ms": 0.05, "expert_ms": 0.012, "ms_per_gflop": 6.0, "ms_per_mb": 0.02}
SHAPES = [(256, 256), (1024, 2048), (2048, 768)]


def synthetic_records(backend: str, noise: float = 0.02, seed: int = 0) -> list[dict]:
    """Records timed on a fake device whose cost is exactly TRUE, with multiplicative noise."""
    rng = np.random.default_rng(seed)
    truth = BackendModel(backend, **TRUE)
    recs = []
    for h, f in SHAPES:
        for m in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]:
            recs.append({"kind": "ffn", "backend": backend, "tokens": m, "hidden": h, "ffn": f})
        for g, c in [(1, 1), (4, 16), (8, 64), (4, 256)]:
            recs.append({"kind": "group", "backend": backend, "capacities": [c] * g, "hidden": h, "ffn": f})
    recs.append({"kind": "call", "backend": backend, "capacities": [1], "hidden": 8, "ffn": 8})
    for r in recs:
        r["median_ms"] = float(truth.analytic(*record_features(r, 4))) * float(np.exp(rng.normal(0, noise)))
    return recs


# A real profile-device run's few records of one small shape, tiny-moe's dense ops only: what a test needs, not the
# minutes a real --quick profile takes.
TINY_PROFILE = Settings({"t": (32, 32)}, tokens=[1, 2, 4, 8, 16, 32], groups=[(2, 4)], pack_tokens=[8, 32],
                        num_experts=4, warmup=1, min_runs=3, max_runs=3, min_time_s=0.0, quick=True,
                        dense_shapes=("tiny-moe",))


def small_profiling(monkeypatch) -> None:
    """profile-device --quick at TINY_PROFILE's shape, the dense ops at fewer rows and contexts, and a model's own
    records (tiny-moe's, in the dtype it computes in) at fewer rows: a host profile in seconds, not minutes."""
    import dataclasses

    from autotune.profiling import dense_records, model_records, settings

    monkeypatch.setattr(settings, "settings_for", lambda quick: dataclasses.replace(TINY_PROFILE, kernels=False))
    tiny = dataclasses.replace(dense_records.DENSE_SHAPES["tiny-moe"], rows=(1, 256))
    for module, name, value in ((dense_records, "DENSE_SHAPES", {"tiny-moe": tiny}),
                                (dense_records, "ELEMENTWISE_ROWS", (64, 256)),
                                (dense_records, "ATTENTION_POINTS_QUICK", ((256, 256), (256, 512))),
                                (model_records, "ROWS_QUICK", (1, 16, 64)), (model_records, "DENSE_ROWS", (1, 64)),
                                (model_records, "PACK_TOKENS", (256,))):
        monkeypatch.setattr(module, name, value)


def apple_like(power: bool = True) -> CostModel:
    """An ANE-like device: 0.095 ms fixed cost per call, twice the CPU's throughput."""
    w = lambda x: x if power else None  # noqa: E731
    return CostModel({"ane": BackendModel("ane", 0.095, 0.0, 0.3, 0.0, 2, True, w(2.0)),
                      "cpu-exact": BackendModel("cpu-exact", 0.01, 0.005, 0.6, 0.0, 2, False, w(20.0)),
                      "cpu-static": BackendModel("cpu-static", 0.01, 0.005, 0.6, 0.0, 2, False, w(20.0))})


def mil_program(body, shape=(8, 16)):
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(input_specs=[mb.TensorSpec(shape=shape, dtype=types.fp16)], opset_version=ct.target.macOS15)
    def prog(x):
        return body(mb, x)

    return prog


def shape_twin_script():
    """scripts/make_shape_twin.py as a module (scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "make_shape_twin.py"
    spec = importlib.util.spec_from_file_location("make_shape_twin", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A twin's real config with every width shrunk: the same code paths (per-expert keys, shards, tokenizer) in seconds.
TINY_SHAPES = dict(vocab_size=4096, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def tiny_twin(path, like: str = "qwen3-30b-a3b", layers: int = 2, **overrides):
    """A tiny twin-like checkpoint at `path` (bf16 safetensors shards, BPE tokenizer): never a big twin in tests."""
    twin = shape_twin_script()
    wanted = {**TINY_SHAPES, **overrides}
    shapes = {k: v for k, v in wanted.items() if k in twin.TWINS[like] or k in ("head_dim", *overrides)}
    twin.make_twin(like, layers, path, progress=False, **shapes)
    return path


SMALL = dict(architecture="x", model_type="qwen3_moe", num_layers=2, moe_layers=[0, 1], num_experts=8, top_k=2,
             hidden_size=1024, expert_ffn_size=512, fingerprint="small")


# `autotune search --json`'s keys, in order, before its report was typed (a contract scripts read)
SEARCH_REPORT_KEYS = [
    "predicted_latency_ms", "predicted_energy_mj", "heldout_drop_rate", "figures", "baselines", "baseline_details",
    "speedup_vs", "energy_ratio_vs", "gap_vs_exact", "exact_layers", "trials", "search_seconds", "pareto_front",
    "plan", "profile", "static_backend", "traces", "objective", "drop_budget", "chunk_tokens", "prompt_tokens",
    "chunks_searched", "compress_allowed", "compress", "partial_chunks", "memory_gb", "packing_measured",
    "predicted_cpu_ms_per_token", "cpu_ratio_vs", "robustness", "gate", "predicted_memory", "explanation"]
# added to the search's report since those were recorded: the whole prefill (where the model's decoder shape is known)
SEARCH_REPORT_ADDED = ["predicted_prefill_ms", "predicted_parts_ms", "whole_prefill", "cpu_weights", "priced_outside",
                       "measure"]


def convert_to_mlx(out, bits: int, group: int):
    """tiny-moe through mlx_lm.convert -q (test extra) into folder `out`; its config gets `rope_theta` at the top
    level, which mlx-lm reads."""
    import json
    import shutil

    from runtime.loading.model_loader import TINY_MOE_DIR

    src = out.parent / f"{out.name}-src"
    shutil.copytree(TINY_MOE_DIR, src)
    config = json.loads((src / "config.json").read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    (src / "config.json").write_text(json.dumps(config))
    import mlx_lm

    mlx_lm.convert(str(src), str(out), quantize=True, q_bits=bits, q_group_size=group)
    shutil.rmtree(src)
    return out


def mlx_fp32(folder):
    """mlx-lm's model of the folder, computing in float32 (its bf16 scales and norms widened exactly)."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_map

    model, _ = mlx_lm.load(str(folder))
    model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a, model.parameters()))
    return model


def all_cpu_plan(model, chunk: int = 256):
    """Every expert of every MoE layer of `model` on cpu-exact."""
    from runtime.loading.model_loader import model_spec
    from runtime.plan import LayerPlan, Plan

    spec = model_spec(model)
    return Plan(model=spec, chunk_tokens=chunk, overflow="drop", saliency="router_weight",
                layers=[LayerPlan(layer=l, groups=[], cpu_exact=list(range(spec.num_experts)))
                        for l in spec.moe_layers])


def prefilled_with_own_steps(loaded, ids, lengths):
    """A Generation per prompt length (prefilled, its first token accepted) and each one's next-step logits run
    alone (its cache cropped back after): what a batched decode step must give each row."""
    import torch

    from runtime.generation import Generation

    gens, alone = [], []
    for n in lengths:
        gen = Generation(loaded, ids[:n], 8, 0.0, 0, None)
        for _ in gen.prefill_steps():
            pass
        gen.accept()
        gens.append(gen)
    for gen in gens:
        with torch.inference_mode():
            out = loaded.model(input_ids=torch.tensor([[gen.tokens[-1]]]), cache=gen.cache, use_cache=True,
                               logits_to_keep=1)
        alone.append(out.logits[0, -1].clone())
        gen.cache.crop(-1)
    return gens, alone


@contextmanager
def served_on_a_thread(engine, api_key: str):
    """`engine`'s app on a free loopback port from a thread (uvicorn, as `autotune serve` runs it): yields its URL,
    then stops it."""
    sock = listen("127.0.0.1", 0)
    server = make_server(engine, api_key)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:  # waits for a condition, not for a time
        assert thread.is_alive()
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


# a small random Mixtral / PhiMoE shape (`convert_family`)
FAMILY_CONFIG = dict(vocab_size=4096, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
             rope_theta=10000.0)


def convert_family(out, family: str):
    """A random `family` checkpoint (mixtral, phimoe or qwen2_moe: a shared expert; tiny-moe's tokenizer), through
    mlx_lm.convert -q (4 bits, groups of 32) into folder `out`."""
    import json
    import shutil

    import mlx_lm
    import torch
    import transformers

    from runtime.loading.model_loader import TINY_MOE_DIR

    torch.manual_seed(0)
    configs = {"mixtral": lambda: transformers.MixtralConfig(**FAMILY_CONFIG),
               "phimoe": lambda: transformers.PhimoeConfig(**FAMILY_CONFIG, attention_bias=True, lm_head_bias=True),
               "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
                   **FAMILY_CONFIG, num_experts=FAMILY_CONFIG["num_local_experts"], moe_intermediate_size=32,
                   shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[])}
    config = configs[family]()
    src = out.parent / f"{out.name}-src"
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(src)
    saved = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**saved, "rope_theta": FAMILY_CONFIG["rope_theta"]}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_MOE_DIR / name, src / name)
    mlx_lm.convert(str(src), str(out), quantize=True, q_bits=4, q_group_size=32)
    shutil.rmtree(src)
    return out


def one_line_exit_2(argv: list[str], capsys) -> str:
    """`autotune argv` in-process: exit 2 (returned, or raised as argparse raises it) with exactly one line on
    stderr, returned."""
    from autotune.cli import main

    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as out:
        code = out.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # a rank's environment under mlx.launch


def free_ports(n: int, consecutive: bool = False) -> list[int]:
    """`n` ports nothing listens on (consecutive ones for mlx.launch's --starting-port)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        ports = [first + i for i in range(n)] if consecutive else [first] + free_ports(n - 1) if n > 1 else [first]
        try:
            for p in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return ports
        except OSError:
            continue
    raise RuntimeError("no free ports")


def launch(args: list[str], cwd: Path, timeout: float = 240) -> list[dict]:
    """`args` of autotune under `mlx.launch --backend ring --hosts 127.0.0.1 -n 2`: each rank's JSON line, rank 0
    first (the launcher exits 0 whatever its ranks do: every rank must print its own)."""
    port = free_ports(2, consecutive=True)[0]
    cmd = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
           "--starting-port", str(port), "--env", f"PYTHONPATH={ROOT}", "--env", "OMP_NUM_THREADS=1",
           "--python", sys.executable, "-m", "autotune", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 2, done.stdout[-2000:] + done.stderr[-3000:]
    return sorted(lines, key=lambda r: r["rank"])


def ring_file(tmp_path: Path) -> tuple[Path, str]:
    ports = free_ports(2)
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    return hostfile, f"rank 1 (127.0.0.1:{ports[1]})"


# a small synthetic decoder the priced bound's tests search (tests/test_priced_bound.py, test_bound_seed.py)
BOUND_SPEC = dict(architecture="synthetic", model_type="qwen3_moe", num_layers=4, moe_layers=[0, 1, 2, 3],
                  num_experts=16, top_k=2, hidden_size=256, expert_ffn_size=128, fingerprint="synthetic-bound")
BOUND_SHAPE = DecoderShape(hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=1000, num_layers=4,
                           moe_layers=(0, 1, 2, 3), num_experts=16, top_k=2, expert_ffn=128, context=4096)
BOUND_PROMPT = 2048


def bound_search(cost: CostModel, backend: str | None, chunks: tuple[int, ...] = (512, 1024),
                 shape: DecoderShape = BOUND_SHAPE):
    """A search of a small synthetic decoder (`BOUND_SHAPE`) at `chunks` on `cost`, the dense half on `backend`:
    what the priced bound's and its starts' tests price."""
    from autotune.calibration.traces import synthetic_traces
    from autotune.searching.dense_choice import choose_dense
    from autotune.searching.layer_data import LayerData
    from autotune.searching.objective import WholePrefill
    from autotune.searching.optimizer import run_search
    from autotune.searching.scoring import Scorer
    from autotune.searching.space import layer_space

    spec = {**BOUND_SPEC, "moe_layers": list(shape.moe_layers)}
    traces = synthetic_traces(spec, 4, BOUND_PROMPT, skew=1.2, seed=5, tokens=True)
    workloads = {c: LayerData.from_traces(traces, c, BOUND_PROMPT) for c in chunks}
    scorer = Scorer(cost, 256, 128, "ane", 1e9)
    prompts = float(next(iter(workloads.values()))[0].tokens.sum()) / BOUND_PROMPT

    def dense(chunk, weights, resident):
        return choose_dense(cost, shape, BOUND_PROMPT, chunk, backend, weights, prompts, resident)

    out = run_search(workloads, scorer, layer_space(16, ("none", "int8"), split_exact=scorer.splits_exact), trials=0,
                     progress=False, dense=dense, whole=WholePrefill(shape, BOUND_PROMPT))
    return out, scorer
