"""mlx-exact: the exact path on MLX (the Metal GPU on a Mac, MLX's CPU device here), on tiny-moe converted by mlx-lm
to 4 bits, against the all-CPU plan (float32) and against mlx-lm's own greedy generation on the same folder."""
from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

from helpers import all_cpu_plan, mlx_fp32, one_line_exit_2, prefilled_with_own_steps, random_model  # noqa: E402
from helpers import convert_to_mlx as convert  # noqa: E402

from autotune.cli import main  # noqa: E402
from autotune.profiling.callers import Rotor, group_caller, make_experts  # noqa: E402
from autotune.profiling.device import Task, run_tasks  # noqa: E402
from autotune.profiling.settings import settings_for  # noqa: E402
from runtime import generation  # noqa: E402
from runtime.backends import registry  # noqa: E402
from runtime.cpu.cpu_backends import CpuExactLayer  # noqa: E402
from runtime.errors import NpumoeError  # noqa: E402
from runtime.executor import LayerExecutor, PlanExecutor  # noqa: E402
from runtime.loading.model_loader import load_model, moe_layers  # noqa: E402
from runtime.mlx.mlx_exact import MlxExactLayer  # noqa: E402
from runtime.plan import CpuWeights, LayerPlan, load_plan  # noqa: E402
from runtime.prefill import prefill_chunks  # noqa: E402
from runtime.stats import LayerStats  # noqa: E402

# On "The static groups take the prompt; the exact path takes every token they leave, and each new one." the
# all-CPU plan and this one part from mlx-lm at token 54 alike, on a near tie (mlx-lm's top two 1.2e-5 apart).
PROMPT = "Static groups for the prompt, the exact path for every new token. " * 2


@pytest.fixture(scope="module")
def q4(tmp_path_factory) -> Path:
    return convert(tmp_path_factory.mktemp("mlx") / "q4g64", 4, 64)


@pytest.fixture(scope="module")
def plan(q4, tmp_path_factory) -> Path:
    """The issue's plan: tight groups on cpu-static, spills and decode steps on mlx-exact."""
    out = tmp_path_factory.mktemp("plans") / "mlx.json"
    assert main(["plan-template", "--model", str(q4), "--capacity", "tight", "--overflow", "spill",
                 "--exact", "mlx-exact", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def planned_tokens(q4, plan) -> list[int]:
    loaded = generation.load(str(q4), str(plan), dtype="float32")
    result = generation.generate(loaded, PROMPT, max_tokens=64)
    assert loaded.stats.total("decode").tokens_per_backend["mlx-exact"] > 0
    return result.token_ids


def test_plan_template_names_the_exact_path_and_run_agrees_with_the_all_cpu_plan(q4, plan, capsys):
    assert load_plan(plan).exact == "mlx-exact"
    capsys.readouterr()
    assert main(["run", "--model", str(q4), "--plan", str(plan), "--dtype", "float32", "--reference",
                 "--max-tokens", "512", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert run["max_rel_diff_vs_reference"] <= 1e-5
    assert run["tokens_per_backend"]["mlx-exact"] == run["spilled"] > 0 and run["backend_fallbacks"] == {}
    assert run["crossing_us_per_call"]["mlx-exact"] > 0
    # against the all-CPU plan itself, chunk by chunk: the same logits within 1e-5 of their scale
    cpu = generation.load(str(q4), all_cpu_plan(load_model(str(q4), "float32")[0]), dtype="float32")
    ours = generation.load(str(q4), str(plan), dtype="float32")
    ids = torch.tensor(cpu.tokenizer.encode(PROMPT * 8, add_special_tokens=False))[:512]
    with torch.inference_mode():
        a = torch.cat([o.logits[0] for o in prefill_chunks(cpu.model, ids, 256)])
        b = torch.cat([o.logits[0] for o in prefill_chunks(ours.model, ids, 256)])
    assert float((a - b).abs().max() / a.abs().max()) <= 1e-5
    assert ours.stats.total().tokens_per_backend["mlx-exact"] > 0


def test_greedy_tokens_equal_mlx_lm_generate_for_64_tokens(q4, planned_tokens):
    model = mlx_fp32(q4)
    _, tokenizer = mlx_lm.load(str(q4))
    ids = mx.array(tokenizer.encode(PROMPT, add_special_tokens=False))
    step = importlib.import_module("mlx_lm.generate").generate_step
    theirs = [int(t) for t, _ in step(ids, model, max_tokens=64)]
    assert len(planned_tokens) == 64 and planned_tokens == theirs


def test_batched_decode_steps_run_on_mlx_exact(q4, plan):
    from runtime.serving.decode_batch import DecodeBatch

    loaded = generation.load(str(q4), str(plan), dtype="float32")
    ids = torch.tensor(loaded.tokenizer.encode(PROMPT, add_special_tokens=False))
    gens, alone = prefilled_with_own_steps(loaded, ids, (9, 17, 12))
    loaded.reset()
    batch, got = DecodeBatch(loaded), []
    for gen in gens:
        batch.add(gen)
        gen.sample = got.append
    batch.step()
    for own, batched in zip(alone, got):
        assert float((own - batched).abs().max() / own.abs().max()) <= 1e-5
    decode = loaded.stats.total("decode")
    assert decode.tokens_per_backend == {"mlx-exact": 3 * 2 * len(loaded.plan.layers)}


def test_without_mlx_the_plan_runs_on_cpu_exact_said_once(q4, plan, planned_tokens, monkeypatch, caplog):
    for module in ("mlx", "mlx.core", "runtime.mlx.mlx_exact"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails, as where mlx is not installed
    with caplog.at_level(logging.WARNING, logger="npumoe"):
        loaded = generation.load(str(q4), str(plan), dtype="float32")
        result = generation.generate(loaded, PROMPT, max_tokens=64)
    said = [r.getMessage() for r in caplog.records if "mlx-exact" in r.getMessage()]
    assert len(said) == 1 and "running its experts on cpu-exact" in said[0], said
    assert loaded.executor.fallbacks == {"mlx-exact": "cpu-exact"}
    assert "mlx-exact" not in loaded.stats.total().tokens_per_backend
    assert loaded.stats.total("decode").tokens_per_backend["cpu-exact"] > 0
    assert result.token_ids == planned_tokens


def test_a_folder_mlx_exact_cannot_run_is_refused_in_one_line(q4, plan, tmp_path, capsys):
    bad = tmp_path / "mxfp4"
    shutil.copytree(q4, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization"]["mode"] = "mxfp4"
    (bad / "config.json").write_text(json.dumps(config))
    line = one_line_exit_2(["plan-template", "--model", str(bad), "--capacity", "tight", "--exact", "mlx-exact",
                             "--out", str(tmp_path / "p.json")], capsys)
    assert "error: mlx-exact:" in line and "mxfp4 mode" in line, line
    assert not (tmp_path / "p.json").exists()
    # the full-width model the folder was converted from: its routers are not the folder's (no longer 8-bit)
    line = one_line_exit_2(["run", "--model", "tiny-moe", "--plan", str(plan), "--max-tokens", "64"], capsys)
    assert "fingerprint" in line, line


def test_experts_held_in_the_cpus_storage_are_refused(tmp_path):
    model, _ = load_model("tiny-moe", "float32")
    plan = all_cpu_plan(model).model_copy(update={"exact": "mlx-exact", "cpu_weights": CpuWeights(kind="int8")})
    with pytest.raises(NpumoeError, match=r"^mlx-exact runs the checkpoint's own weights; .* int8 storage"):
        generation.load("tiny-moe", plan, dtype="float32")


def test_exact_split_runs_a_layers_cold_experts_on_both_paths_full_width():
    """Full-width experts through gather_mm: the first half on mlx-exact by the layer's exact_split, the rest on the
    plan's cpu-exact; the layer's output is the all-CPU layer's."""
    model, _ = random_model("random:qwen3_moe")
    layer = moe_layers(model)[0]
    n = layer.experts.num_experts
    base = all_cpu_plan(model)
    split = LayerPlan(layer=layer.index, groups=[], cpu_exact=list(range(n)),
                      exact_split={"mlx-exact": [*range(n // 2)]})
    torch.manual_seed(0)
    x = torch.randn(96, model.config.hidden_size)
    idx, w = torch.randint(0, n, (96, 2)), torch.rand(96, 2)
    with torch.inference_mode():
        ref = LayerExecutor(base.layer(layer.index), layer.experts, base, LayerStats(), {})(x, idx, w)
        st = LayerStats()
        ours = LayerExecutor(split, layer.experts, base, st, {})(x, idx, w)
    assert float((ours - ref).abs().max() / ref.abs().max()) <= 1e-5
    on_mlx = int((idx < n // 2).sum())
    assert st.tokens_per_backend == {"mlx-exact": on_mlx, "cpu-exact": idx.numel() - on_mlx}
    assert st.crossings["mlx-exact"] == 1


def test_the_profiler_times_mlx_exact_marked_with_mlxs_device():
    info = registry.get("mlx-exact")
    assert info.available_to_profile()[0] and not info.profiled_by_default  # not a Mac: MLX's CPU device
    module = make_experts(128, 64, 8)
    call = group_caller(info, module, [3, 5], 128, Rotor(8))
    with torch.inference_mode():
        y = call.run()
    assert y.shape == (8, 128) and bool(torch.isfinite(y).all())
    s = dataclasses.replace(settings_for(True), min_runs=2, max_runs=2, min_time_s=0.0)
    tasks = [Task("group", "mlx-exact", "t", 128, 64, [rows]) for rows in (1, 256)]  # a decode step, a chunk's
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        records = run_tasks(tasks, s, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert [r["device"] for r in records] == ["cpu", "cpu"] and all(r["median_ms"] > 0 for r in records)
    # one thread of this process computes them: read on its CPU clock, as torch's records are (a shared host's
    # load inflates the wall clock)
    assert all(r["clock"] == "cpu" and r["median_ms"] == r["cpu_median_ms"] for r in records)
    assert np.isfinite([r["median_ms"] for r in records]).all()


def test_served_requests_decode_together_on_mlx_exact_beside_a_prefill(q4, tmp_path):
    """`serve`: concurrent requests batch their decode steps on mlx-exact while other prompts prefill (their spills
    on mlx-exact too, from the prefill thread); each gets runtime.generate's greedy tokens alone."""
    import openai
    from helpers import served_on_a_thread

    from runtime.serving.engine import Engine

    plan = tmp_path / "p.json"
    assert main(["plan-template", "--model", str(q4), "--capacity", "tight", "--overflow", "spill", "--chunk", "16",
                 "--exact", "mlx-exact", "--out", str(plan)]) == 0
    loaded = generation.load(str(q4), str(plan), dtype="float32")
    ids = loaded.tokenizer.encode(PROMPT * 3, add_special_tokens=False)
    prompts, news = [ids[:n] for n in (5, 40, 23, 64)], [12, 9, 10, 6]
    refs = [generation.generate(loaded, p, max_tokens=n).token_ids for p, n in zip(prompts, news)]
    engine = Engine(loaded, "q4", max_queue=16, prefix_cache_mb=0)
    results = [None] * len(prompts)
    with served_on_a_thread(engine, "k") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        loaded.reset()

        def ask(i):
            results[i] = client.completions.create(model="q4", prompt=prompts[i], max_tokens=news[i], temperature=0)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [r.model_extra["npumoe"]["token_ids"] for r in results] == refs
    assert engine.batch.widest >= 2
    assert loaded.stats.total("decode").tokens_per_backend["mlx-exact"] > 0
    assert loaded.stats.total("prefill").tokens_per_backend["mlx-exact"] > 0


def test_bf16_rows_cross_as_words_and_land_within_torchs_bf16_error(q4):
    """`--dtype auto` keeps an MLX folder in bf16: rows and outputs cross as 16-bit words; against the float32
    result on the same codes, mlx-exact's bf16 error is no larger than cpu-exact's (MLX's CPU kernels would
    accumulate in bf16: there the layer computes in float32; measured 2.2% mean error before, 6x torch's)."""
    model, _ = load_model(str(q4), "auto")
    experts = moe_layers(model)[0].experts
    torch.manual_seed(0)
    x, idx, w = torch.randn(40, model.config.hidden_size), torch.randint(0, 16, (40, 2)), torch.rand(40, 2)
    cpu, mlx = CpuExactLayer(experts), MlxExactLayer(experts)

    def error(out: torch.Tensor, exact: torch.Tensor) -> float:
        assert out.dtype == torch.bfloat16
        return float((out.float() - exact).abs().max() / exact.abs().max())

    exact = cpu.forward(x, idx, w)
    assert 0 < error(mlx.forward(x.bfloat16(), idx, w), exact) <= error(cpu.forward(x.bfloat16(), idx, w), exact)
    exact = cpu.run(x, [0, 5], [25, 15])
    assert 0 < error(mlx.run(x.bfloat16(), [0, 5], [25, 15]), exact) <= error(cpu.run(x.bfloat16(), [0, 5], [25, 15]),
                                                                               exact)


def test_full_width_experts_run_on_the_exact_worker_thread(tmp_path, capsys):
    """Static groups beside mlx-exact start the layer's exact-path worker; a full-width expert's weights, made on the
    loading thread, must be evaluated there (MLX 0.31.2+: "There is no Stream(cpu, 0) in current thread")."""
    plan = tmp_path / "plan.json"
    assert main(["plan-template", "--model", "tiny-moe", "--capacity", "tight", "--overflow", "spill",
                 "--backend", "ane", "--exact", "mlx-exact", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", "--model", "tiny-moe", "--plan", str(plan), "--dtype", "float32", "--max-tokens", "128",
                 "--reference", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dropped"] == 0 and out["spilled"] > 0
    assert out["max_rel_diff_vs_reference"] < 1e-3  # ane-sim's fp16 groups; the spills exact on MLX


@pytest.mark.parametrize("folder", ["tiny-moe", "q4"])
def test_every_executor_reads_one_copy_of_the_experts(folder, q4):
    """The fidelity gate builds an executor per candidate: each wraps the same modules, so MLX holds the experts
    once (measured before the fix: 1.18, 2.36, 3.54, 4.72 MB after 1 to 4 executors)."""
    model, _ = load_model(str(q4) if folder == "q4" else folder, "float32")
    plan = all_cpu_plan(model).model_copy(update={"exact": "mlx-exact"})
    before = mx.get_active_memory()
    executors = [PlanExecutor(model, plan)]
    one = mx.get_active_memory() - before
    executors += [PlanExecutor(model, plan) for _ in range(3)]
    four = mx.get_active_memory() - before
    assert one > 0 and four <= 1.1 * one, (one, four)
    assert len(executors) == 4


def test_rows_widened_to_float32_widen_only_a_block_of_experts_at_a_time():
    """MLX's CPU kernels accumulate in the rows' dtype, so bf16 experts there compute float32 rows (`widen`):
    gather_mm promoted the whole weight to float32 at every call, 2x the layer's bf16 experts of MLX memory for a
    moment (the Qwen3-30B-A3B twin's gate: MLX's peak 3.5 GB for 1.15 GB of experts). Now only the experts the rows
    use, a block of WIDEN_BYTES at a time: the same output, bit for bit, for under half the experts' bytes."""
    import transformers

    from runtime.mlx.formats import WIDEN_BYTES

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(hidden_size=1024, moe_intermediate_size=512, num_experts=64,
                                         num_experts_per_tok=4, num_hidden_layers=1, num_attention_heads=8,
                                         num_key_value_heads=2, head_dim=64, vocab_size=256, intermediate_size=512)
    experts = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval().model.layers[0].mlp.experts
    held = 64 * 3 * 1024 * 512 * 2  # 192 MiB in bf16: a gate_up block of 16 experts is WIDEN_BYTES in float32
    layer = MlxExactLayer(experts)
    layer.widen = True  # as on MLX's CPU device (a Mac's GPU accumulates in float32 and never widens)
    x = torch.randn(256, 1024).bfloat16()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    ours = layer.run(x, list(range(64)), [4] * 64)
    transient = mx.get_peak_memory() - before
    assert WIDEN_BYTES < transient < 0.6 * held, (transient, held)  # whole: 2.0x held (388.5 MiB measured)

    ids = mx.array(np.repeat(np.arange(64, dtype=np.uint32), 4))  # what the whole promotion computed
    gate_up = mx.gather_mm(mx.array(x.float().numpy())[:, None, :], layer.gate_up.wt.astype(mx.float32),
                           rhs_indices=ids, sorted_indices=True)
    whole = mx.gather_mm(layer.act(gate_up[..., :512]) * gate_up[..., 512:], layer.down.wt.astype(mx.float32),
                         rhs_indices=ids, sorted_indices=True)[:, 0, :].astype(mx.bfloat16).astype(mx.float32)
    assert torch.equal(ours.float(), torch.from_numpy(np.array(whole)))
