"""The MLX spine (`--engine mlx`): mlx-lm's own model of tiny-moe converted by mlx-lm to 4 bits, on MLX's CPU device
in float32, with each MoE block's experts as the plan's block. Against mlx-lm's own forward and generation of the
same folder, and against the torch spine on the same plans (one accounting of capacity, drops and spills)."""
from __future__ import annotations

import importlib
import json
import math
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

from helpers import all_cpu_plan, convert_family, convert_to_mlx, mlx_fp32, one_line_exit_2  # noqa: E402

from autotune.cli import main  # noqa: E402
from autotune.evaluation.gate import MAX_PPL_DELTA, MIN_TOP1  # noqa: E402
from runtime import generation  # noqa: E402
from runtime.engines import resolve_engine, torch_only  # noqa: E402
from runtime.errors import NpumoeError  # noqa: E402
from runtime.executor import LayerExecutor  # noqa: E402
from runtime.loading.model_loader import load_model, moe_layers  # noqa: E402
from runtime.plan import LayerPlan, load_plan  # noqa: E402
from runtime.stats import LayerStats  # noqa: E402

PROMPT = "Static groups for the prompt, the exact path for every new token. " * 2
TOKENS = 256


@pytest.fixture(scope="module")
def q4(tmp_path_factory) -> Path:
    return convert_to_mlx(tmp_path_factory.mktemp("spine") / "q4g64", 4, 64)


def _template(q4: Path, out: Path, *flags: str) -> Path:
    assert main(["plan-template", "--model", str(q4), "--exact", "mlx-exact", *flags, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def exact_plan(q4, tmp_path_factory) -> Path:
    """Every expert of every layer on mlx-exact, no static group: mlx-lm's own switch_mlp runs each block."""
    return _template(q4, tmp_path_factory.mktemp("plans") / "exact.json", "--no-groups")


def _run(capsys, q4: Path, plan: Path, engine: str, *flags: str) -> dict:
    capsys.readouterr()
    assert main(["run", "--model", str(q4), "--plan", str(plan), "--engine", engine, "--dtype", "float32",
                 "--max-tokens", str(TOKENS), "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_run_on_the_mlx_spine_is_mlx_lms_forward(q4, exact_plan, capsys):
    r = _run(capsys, q4, exact_plan, "mlx", "--reference")
    assert r["engine"] == "mlx" and r["tokens"] == TOKENS
    assert r["max_rel_diff_vs_reference"] <= 1e-5
    assert r["tokens_per_backend"] == {"mlx-exact": TOKENS * 2 * 4} and r["dropped"] == r["spilled"] == 0
    executed = r["executed"]
    assert set(executed) == {"attention_projections", "attention_core", "experts", "lm_head", "rest"}
    assert set(executed["experts"]) == {"mlx-exact"}
    assert all(set(lanes) == {"mlx-cpu"} for part, lanes in executed.items() if part != "experts")
    assert executed["attention_core"]["mlx-cpu"]["calls"] == 4  # one chunk of 256 through 4 layers
    assert all(lane["ms"] > 0 for lanes in executed.values() for lane in lanes.values())


def test_greedy_tokens_equal_mlx_lm_generate(q4, exact_plan):
    loaded = generation.load(str(q4), str(exact_plan), engine="mlx", dtype="float32")
    ours = generation.generate(loaded, PROMPT, max_tokens=64)
    model = mlx_fp32(q4)
    _, tokenizer = mlx_lm.load(str(q4))
    step = importlib.import_module("mlx_lm.generate").generate_step
    theirs = [int(t) for t, _ in step(mx.array(tokenizer.encode(PROMPT, add_special_tokens=False)), model,
                                      max_tokens=64)]
    assert len(ours.token_ids) == 64 and ours.token_ids == theirs
    decode = loaded.stats.total("decode")
    assert decode.tokens_per_backend["mlx-exact"] == 63 * 2 * 4  # every step after the first token, every layer
    assert ours.executed["experts"]["mlx-exact"]["calls"] > 0
    sampled = generation.generate(loaded, PROMPT, max_tokens=8, temp=0.8, seed=3)
    again = generation.generate(loaded, PROMPT, max_tokens=8, temp=0.8, seed=3)
    assert sampled.token_ids == again.token_ids and len(sampled.token_ids) == 8


def test_a_greedy_decode_step_is_evaluated_once(q4, exact_plan, monkeypatch):
    """As mlx-lm's `generate_step` pipelines: each decode forward after the first token is scheduled once
    (`mx.async_eval`) and nothing else evaluates it (no `mx.eval` per step or per layer: the step's expert ids are
    counted once computed, read from host memory)."""
    loaded = generation.load(str(q4), str(exact_plan), engine="mlx", dtype="float32")
    run = generation.Generation(loaded, generation.prompt_ids(loaded, PROMPT), 16, 0.0, 0, loaded.plan.chunk_tokens)
    tokens = run.token_ids()
    next(tokens)  # the prefill and the first token
    calls = Counter()
    for name in ("eval", "async_eval"):
        def counted(*args, _own=getattr(mx, name), _name=name, **kwargs):
            calls[_name] += 1
            return _own(*args, **kwargs)
        monkeypatch.setattr(mx, name, counted)
    assert len(list(tokens)) == 15
    assert calls == {"async_eval": 15}  # one per new token's forward
    assert loaded.stats.total("decode").tokens_per_backend["mlx-exact"] == 15 * 2 * 4  # every step, every layer


def test_tight_spilling_plan_accounts_as_the_torch_spine(q4, tmp_path, capsys):
    """The issue's crash case (groups on ane, run here on ane-sim, spills on mlx-exact) on both spines: the same
    routing, so the same spills, calls and assignments per backend; the logits within fp16 rounding."""
    plan = _template(q4, tmp_path / "tight.json", "--capacity", "tight", "--overflow", "spill", "--backend", "ane")
    ours, theirs = _run(capsys, q4, plan, "mlx", "--reference"), _run(capsys, q4, plan, "torch")
    assert ours["spilled"] == theirs["spilled"] > 0
    for key in ("tokens_per_backend", "calls_per_backend", "assignments", "static_slots"):
        assert ours[key] == theirs[key], key
    assert ours["max_rel_diff_vs_reference"] <= 5e-3
    assert set(ours["executed"]["experts"]) == {"ane-sim", "mlx-exact"}
    assert set(theirs["executed"]["experts"]) == {"ane-sim", "mlx-exact"}
    assert set(theirs["executed"]["attention_core"]) == {"torch-cpu"} and theirs["engine"] == "torch"


def test_mixed_plan_on_both_spines_within_the_gates_tolerance(q4, tmp_path):
    """Groups on ane (ane-sim here) beside mlx-exact: the MLX spine's next-token distribution against the torch
    spine's, by the fidelity gate's own measures (perplexity delta, top-1 agreement)."""
    from runtime.mlx.spine_generation import prefill_logits
    from runtime.prefill import prefill_logits as torch_logits

    plan = _template(q4, tmp_path / "ane.json", "--backend", "ane")
    ours = generation.load(str(q4), str(plan), engine="mlx", dtype="float32")
    theirs = generation.load(str(q4), str(plan), engine="torch", dtype="float32")
    ids = torch.tensor(ours.tokenizer.encode(PROMPT * 12, add_special_tokens=False))[:TOKENS]
    a = prefill_logits(ours.model, ids, 128, every_position=True)
    with torch.inference_mode():
        b = torch_logits(theirs.model, ids, 128)
    nll = [float(torch.nn.functional.cross_entropy(x[:-1], ids[1:])) for x in (a, b)]
    assert abs(math.exp(nll[0] - nll[1]) - 1) <= MAX_PPL_DELTA
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= MIN_TOP1
    assert ours.stats.total().tokens_per_backend["ane-sim"] == theirs.stats.total().tokens_per_backend["ane-sim"] > 0


def test_count_exact_counts_as_the_executor_runs():
    """The all-mlx-exact layers count without computing (`LayerExecutor.count_exact`): the same figures as the
    executor computing them, for a prefill chunk and a decode step."""
    model = load_model("random:qwen3_moe")[0]
    layer = moe_layers(model)[0]
    plan = all_cpu_plan(model, chunk=128)
    ran, counted, from_mlx = LayerStats(), LayerStats(), LayerStats()
    runner = LayerExecutor(plan.layer(layer.index), layer.experts, plan, ran, {})
    counter = LayerExecutor(plan.layer(layer.index), layer.experts, plan, counted, {})
    mlx_counter = LayerExecutor(plan.layer(layer.index), layer.experts, plan, from_mlx, {})
    gen = torch.Generator().manual_seed(0)
    for tokens in (300, 1, 1):
        x = torch.randn(tokens, layer.experts.hidden_dim, generator=gen)
        idx = torch.stack([torch.randperm(layer.experts.num_experts, generator=gen)[:2] for _ in range(tokens)])
        runner(x, idx, torch.full(idx.shape, 0.5))
        counter.count_exact(idx)
        mlx_counter.count_exact(idx.numpy().astype(np.uint32))  # the MLX spine's ids, as numpy reads them
    for name in ("tokens", "assignments", "dropped", "spilled", "tokens_per_backend", "calls_per_backend"):
        assert getattr(ran, name) == getattr(counted, name) == getattr(from_mlx, name), name
    assert ran.tokens == 302 and ran.calls_per_backend


def test_engine_auto_is_torch_off_a_mac_and_mlx_on_one(exact_plan, monkeypatch):
    plan = load_plan(exact_plan)
    assert resolve_engine("auto", plan) == "torch"
    monkeypatch.setattr("sys.platform", "darwin")
    assert resolve_engine("auto", plan) == "mlx"
    assert resolve_engine("auto", plan.model_copy(update={"exact": None})) == "torch"  # nothing on MLX
    # what only torch runs keeps auto on torch (CPU expert storage, --record-traces), and refuses mlx in one line; a
    # built package runs on either spine
    assert torch_only(plan) is None
    assert resolve_engine("auto", plan, torch_only(plan, cpu_weights="int8")) == "torch"
    assert resolve_engine("auto", plan, "--record-traces") == "torch"
    with pytest.raises(NpumoeError, match=r"--engine mlx: CPU expert storage \(--cpu-weights\) runs on the torch"):
        resolve_engine("mlx", plan, torch_only(plan, cpu_weights="int8"))
    with pytest.raises(NpumoeError):
        resolve_engine("gpu", plan)


def test_what_the_mlx_spine_does_not_run_is_refused_in_one_line(q4, exact_plan, tmp_path, capsys, monkeypatch):
    assert "in memory only" in one_line_exit_2(
        ["serve", "--model", str(q4), "--plan", str(exact_plan), "--engine", "mlx", "--port", "0",
         "--prefix-cache-dir", str(tmp_path / "kv")], capsys)
    assert "torch spine only" in one_line_exit_2(
        ["evaluate", "--model", str(q4), "--plan", str(exact_plan), "--engine", "mlx", "--tasks",
         "builtin:pydoc-nextsent"], capsys)
    dense = _template(q4, tmp_path / "dense.json", "--dense", "ane-sim")
    monkeypatch.setattr("runtime.mlx.formats.SPINE_SPLICES", ("qkv",))  # a kind of dense function not spliced in
    assert "dense functions on a static backend (attention, o_proj)" in one_line_exit_2(
        ["run", "--model", str(q4), "--plan", str(dense), "--engine", "mlx", "--dtype", "float32"], capsys)


def test_a_top_k_past_the_experts_is_refused_before_mlx_lm_routes(q4, tmp_path, capsys):
    """An MLX folder whose top-k is more than its experts: one line from the folder's check (mlx-lm's argpartition
    would fail inside the first forward)."""
    folder = tmp_path / "topk"
    shutil.copytree(q4, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 32}))
    before = sorted(tmp_path.rglob("*"))
    assert "num_experts_per_tok 32 is more than the model's 16 experts" in one_line_exit_2(
        ["generate", "--model", str(folder), "--engine", "mlx", "--prompt", "To be", "--max-tokens", "4"], capsys)
    assert sorted(tmp_path.rglob("*")) == before


def test_layer_plan_without_groups_is_the_fast_path(exact_plan):
    from runtime.mlx.moe_block import fast_layer

    plan = load_plan(exact_plan)
    assert all(fast_layer(lp, plan) for lp in plan.layers)
    grouped = LayerPlan(layer=0, groups=[], cpu_exact=[0], exact_split={"cpu-exact": [0]})
    assert not fast_layer(grouped, plan)
    assert np.all(np.asarray([len(lp.groups) for lp in plan.layers]) == 0)


@pytest.mark.parametrize("family", ["mixtral", "phimoe"])
def test_mixtral_and_phimoe_folders_on_the_mlx_spine(family, tmp_path, capsys):
    """Folders mlx_lm.convert -q writes for the families whose block is `block_sparse_moe` (PhiMoE: its own
    sparsemixer router): the plan with no group is mlx-lm's forward; a tight spilling plan accounts as on torch."""
    folder = convert_family(tmp_path / family, family)
    exact = _template(folder, tmp_path / "exact.json", "--no-groups")
    r = _run(capsys, folder, exact, "mlx", "--reference")
    assert r["engine"] == "mlx" and r["max_rel_diff_vs_reference"] <= 1e-5
    tight = _template(folder, tmp_path / "tight.json", "--capacity", "tight", "--overflow", "spill")
    ours, theirs = _run(capsys, folder, tight, "mlx"), _run(capsys, folder, tight, "torch")
    assert ours["spilled"] == theirs["spilled"] > 0 and ours["tokens_per_backend"] == theirs["tokens_per_backend"]


def test_bench_spine_quick_measures_every_side(capsys):
    import importlib.util

    script = Path(__file__).parents[1] / "scripts" / "bench_spine.py"
    spec = importlib.util.spec_from_file_location("bench_spine", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--json", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == 128 and out["mlx_device"] == "mlx-cpu"
    for key in ("prefill_vs_mlx_lm", "prefill_cpu_vs_mlx_lm", "decode_vs_mlx_lm", "decode_cpu_vs_mlx_lm",
                "torch_spine_prefill_vs_mlx_lm", "torch_spine_decode_vs_mlx_lm", "torch_spine_decode_cpu_vs_mlx_lm"):
        assert out[key] > 0, key
    assert set(out["prefill_ms"]) == set(out["decode_tok_s"]) == set(out["decode_cpu_tok_s"]) \
        == {"mlx-lm", "mlx-spine", "torch-spine"}
    # one round: each ratio is that round's pair, mlx-lm's prefill time over the spine's
    assert out["prefill_cpu_vs_mlx_lm"] == pytest.approx(
        out["prefill_cpu_ms"]["mlx-lm"] / out["prefill_cpu_ms"]["mlx-spine"], rel=1e-3)
    assert out["best_round"]["decode_cpu_vs_mlx_lm"] == pytest.approx(out["decode_cpu_vs_mlx_lm"], rel=1e-3)


def test_a_plan_whose_dense_half_is_priced_on_mlx_runs_there(q4, exact_plan):
    """`dense.exact` mlx-exact and no static dense function: the MLX spine runs the dense half itself (auto picks
    it on a Mac for that alone); a plan with static dense functions is refused (the refusal test)."""
    from runtime.engines import places_on_mlx
    from runtime.plan import DensePlan

    plan = load_plan(exact_plan)
    hosted = plan.model_copy(update={"exact": None, "dense": DensePlan(attention_context_buckets=[256], layers=[],
                                                                       exact="mlx-exact")})
    assert places_on_mlx(hosted) and not places_on_mlx(plan.model_copy(update={"exact": None}))
    loaded = generation.load(str(q4), hosted, engine="mlx", dtype="float32")
    result = generation.generate(loaded, PROMPT, max_tokens=4)
    assert set(result.executed["attention_core"]) == {"mlx-cpu"} and set(result.executed["experts"]) == {"torch-cpu"}


def test_a_timed_pass_leaves_out_what_a_cache_only_forward_never_computes(q4, exact_plan, monkeypatch):
    """MLX computes what an output reads: a chunk that fills the cache needs the last layer's keys and values only.
    The timed pass (each part evaluated around itself) leaves the same work out, so `executed`'s times measure what
    a run computes (and what the cost model prices: `LazyLast`)."""
    from runtime.mlx import spine as spine_module
    from runtime.mlx.spine_generation import prefill_logits

    loaded = generation.load(str(q4), str(exact_plan), engine="mlx", dtype="float32")
    spine = loaded.executor
    assert spine.prunes_last and spine.all_fast
    timed: list[str] = []
    real = spine_module._Timer.time

    def record(self, bucket, fn, *args, **kwargs):
        timed.append(bucket)
        return real(self, bucket, fn, *args, **kwargs)

    monkeypatch.setattr(spine_module._Timer, "time", record)
    ids = torch.arange(512) % 200 + 5
    untimed = prefill_logits(loaded.model, ids, 256)
    loaded.reset()
    with spine.timed():
        logits = prefill_logits(loaded.model, ids, 256)
    assert torch.allclose(logits, untimed, atol=1e-5)
    # forwards: 256 and 255 tokens filling the cache, then the last token (every layer on mlx-lm's experts);
    # 4 layers, the last one's experts and q/o projections left out of the two cache-only forwards
    assert timed.count("experts") == 3 * 4 - 2
    # six projection modules a layer (q/k/v/o and the q/k norms), three of them making the cache's keys and values
    assert timed.count("attention_projections") == 3 * 4 * 6 - 2 * 3
    assert timed.count("block") == 3 * 4
    assert spine.stats.total().tokens_per_backend["mlx-exact"] == 512 * 2 * 3 + 2  # the last layer: one token


def test_an_uneven_chunking_gives_the_equal_chunkings_logits(q4, exact_plan):
    """A plan's `chunk_rows` (an uneven chunking: 96 then 160 rows at chunk_tokens 160): the MLX spine's prefill
    runs those forwards, every position's logits equal chunks of 128's within float32 rounding, and `generate`
    under the plan (its prefill the plan's chunks) says the same greedy text."""
    from runtime.mlx.spine_generation import prefill_forwards, prefill_logits
    from runtime.prefill import max_rel_diff

    plan = load_plan(exact_plan)
    even = generation.load(str(q4), plan.model_copy(update={"chunk_tokens": 128}), engine="mlx", dtype="float32")
    uneven_plan = plan.model_copy(update={"chunk_tokens": 160, "chunk_rows": [96]})
    uneven = generation.load(str(q4), uneven_plan, engine="mlx", dtype="float32")
    ids = torch.arange(256) % 200 + 5
    assert list(prefill_forwards(uneven.model, 256, 160, rows=(96,))) == [(0, 96, "none"), (96, 255, "none"),
                                                                           (255, 256, "last")]
    a = prefill_logits(even.model, ids, 128, every_position=True)
    b = prefill_logits(uneven.model, ids, 160, every_position=True, rows=(96,))
    assert a.shape == b.shape == (256, a.shape[1]) and max_rel_diff(b, a) <= 1e-5
    text = PROMPT * 12
    assert generation.generate(uneven, text, max_tokens=8).text == generation.generate(even, text, max_tokens=8).text
