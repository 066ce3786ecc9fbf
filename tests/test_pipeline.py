"""The pipeline as library functions (what the commands call): calibrate, search a plan, build its package, from
`import autotune`, on a seeded random model."""
import json

import pytest
from helpers import random_model

import autotune
from autotune.searching.templates import template_plan
from runtime.errors import NpumoeError
from runtime.loading.model_loader import model_spec
from runtime.plan import load_plan, save_plan


def test_library_pipeline_calibrate_search_build(tmp_path, text_file, caplog):
    traces = autotune.calibrate("random:qwen3_moe", text_file, chunk=32, prompt_tokens=64, max_tokens=1024,
                                out=tmp_path / "t.npz", progress=False)
    assert traces.path == str(tmp_path / "t.npz") and traces.summary["chunks"] == traces.traces.n_chunks > 0
    config = autotune.SearchConfig(profile="apple-m2-ultra-published", traces=traces.path, trials=4,
                                   out=str(tmp_path / "plan.json"), no_gate=True)  # the gate: test_gate.py
    result = autotune.search_plan("random:qwen3_moe", config, progress=False)
    # said through the npumoe logger, once: a published profile is announced as such, not as a host mismatch
    assert caplog.text.count("holds published figures") == 1 and "is for host" not in caplog.text
    assert load_plan(result.path) == result.plan and result.plan.meta["traces"] == traces.path
    assert json.loads(result.sidecars[0].read_text()) == result.to_json() == result.report.to_json()
    assert result.report.predicted_latency_ms > 0 and result.report.profile == "apple-m2-ultra-published"
    memory = result.plan.predicted["memory"]  # at the traces' prompt length, within the budget it was given
    assert memory == result.report.predicted_memory and memory["prompt_tokens"] == 64
    assert memory["total_bytes"] == sum(memory[k] for k in ("cpu_weights_bytes", "ane_package_bytes",
                                                            "activations_bytes", "kv_cache_bytes", "runtime_bytes"))
    assert result.plan.predicted["predicted_cpu_ms_per_token"] > 0
    # the profile prices the dense half on the GPU: the plan names that host, static functions or none
    assert result.plan.dense is not None and result.plan.dense.exact == "mlx-exact"
    assert result.report.explanation[0].startswith(f"chunk {result.plan.chunk_tokens} tokens")
    assert len(result.report.explanation) == 1 + len(result.plan.layers)


def test_library_build(tmp_path):
    model, _ = random_model("random:qwen3_moe")
    plan = template_plan(model_spec(model), "tight", backend="ane", chunk_tokens=16)
    save_plan(plan.model_copy(update={"layers": plan.layers[:1] + [
        lp.model_copy(update={"groups": [g.model_copy(update={"backend": "cpu-static"}) for g in lp.groups]})
        for lp in plan.layers[1:]]}), tmp_path / "plan.json")
    built = autotune.build("random:qwen3_moe", tmp_path / "plan.json", out=tmp_path / "p.mlpackage",
                           cache_dir=tmp_path / "cache", progress=False)
    assert len(built.functions) == len(plan.layers[0].groups) and built.max_rel_error <= 1e-2
    assert (tmp_path / "p.mlpackage").is_dir()


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        autotune.nope


def test_library_run_evaluate_describe_and_record(tmp_path, text_file):
    """What `run`, `evaluate`, `models` and `generate --record-traces` print, from the library; the plan loaded by
    runtime.load. A tight spill plan computes exactly what the unmodified model computes; a tight drop plan does
    not (so the reference really ran without the plan)."""
    import numpy as np

    import runtime
    from autotune.calibration.traces import load_traces

    model, _ = random_model("random:olmoe")
    save_plan(template_plan(model_spec(model), "tight", "spill", chunk_tokens=32), tmp_path / "plan.json")
    save_plan(template_plan(model_spec(model), "tight", "drop", chunk_tokens=32), tmp_path / "drop.json")
    plan = str(tmp_path / "plan.json")
    run = autotune.run_plan("random:olmoe", tmp_path / "drop.json", text=text_file, max_tokens=200,
                            reference=True, record_traces=tmp_path / "run.npz")
    assert run.tokens == 200 and run.stats["dropped"] > 0 and run.max_rel_diff_vs_reference > 1e-3
    assert run.energy_per_backend is None and "energy_per_backend" not in run.to_json()  # none measures energy
    assert run.traces["chunks"] == load_traces(tmp_path / "run.npz").n_chunks == 7  # 200 tokens in chunks of 32
    fidelity = autotune.evaluate("random:olmoe", plan, text=text_file, max_tokens=200, prompt_tokens=100,
                                 progress=False)
    assert fidelity.top1_agreement == 1.0 and fidelity.spill_rate > 0 and fidelity.prompts == 2
    about = autotune.describe_model("random:olmoe", text_file, max_tokens=300)
    shares = np.array(list(about["expert_shares"].values()))
    assert about["experts"] == 8 and about["tokens"] == 300 and np.allclose(shares.sum(axis=1), 1.0, atol=1e-3)
    loaded = runtime.load("random:olmoe", plan)
    with pytest.raises(NpumoeError, match="112 tokens make 4 chunk"):  # no held-out chunk: refused up front
        autotune.record_prompt_traces(loaded, "Experts overflow and spill. " * 4, tmp_path / "short.npz")
    assert not (tmp_path / "short.npz").exists()
    recorded = autotune.record_prompt_traces(loaded, "Experts overflow and spill. " * 6, tmp_path / "gen.npz")
    assert recorded["chunks"] == load_traces(tmp_path / "gen.npz").n_chunks == 6  # 168 tokens in chunks of 32
    assert recorded["heldout_chunks"] == 1
