"""runtime/coreml/dense_programs.py: the dense functions as Core ML programs. Each family's functions pass the lint
and the host check against cpu-static; ane-sim computes what the program computes; a build holds one attention core
per (chunk, bucket) shape, not one per layer."""
import json

import numpy as np
import pytest
import torch
from helpers import mil_program, random_model

from autotune.cli import main
from autotune.searching.templates import template_plan
from runtime.coreml.converter import quiet_coremltools_import
from runtime.coreml.dense_doctor import PROBE_ATTENTION
from runtime.coreml.dense_programs import (
    OUTPUT,
    check_dense_function,
    dense_program,
    dense_weights,
    sample_inputs,
)
from runtime.coreml.dense_sim import decompressed_matrix, dense_fp16
from runtime.coreml.mil_eval import evaluate_function, max_rel_error
from runtime.coreml.mil_lint import lint_program
from runtime.dense.specs import backend_specs
from runtime.loading.model_loader import model_spec

quiet_coremltools_import()
FAMILY_MODELS = ["random:qwen3_moe", "random:qwen2_moe", "random:mixtral", "random:olmoe", "random:phimoe"]


def _specs(name: str, context: int = 64):
    model, _ = random_model(name)
    plan = template_plan(model_spec(model), "ample", "drop", "cpu-static", chunk_tokens=32, dense="ane",
                         context_tokens=context)
    return backend_specs(model, plan, "ane")


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_every_dense_program_lints_and_matches_cpu_static_and_ane_sim(name):
    specs = _specs(name)
    kinds = {s.kind for s in specs}
    assert kinds == {"qkv", "o_proj", "attention"} | ({"mlp"} if name.endswith("qwen2_moe") else set())
    for spec in [s for s in specs if s.layer in (0, -1)]:
        prog = dense_program(spec, dense_weights(spec))
        assert lint_program(prog) == []
        assert check_dense_function(prog.functions["main"], spec).max_rel_error < 2e-3  # fp16 vs float32
        feed, allowed = sample_inputs(spec)
        mil = evaluate_function(prog.functions["main"], feed)[OUTPUT]
        fn = dense_fp16(spec)
        if spec.kind == "attention":
            sim = fn(*(torch.from_numpy(feed[n].astype(np.float32)) for n in ("q", "k", "v")), allowed)
        else:
            sim = fn(torch.from_numpy(feed["x"].astype(np.float32)))
        assert max_rel_error(sim.numpy(), mil) < 5e-4, spec.name  # ane-sim: the program's numerics


def test_attention_cores_are_weight_free_and_one_per_bucket():
    specs = _specs("random:olmoe", context=128)
    cores = [s for s in specs if s.kind == "attention"]
    assert [s.keys for s in cores] == [32, 64, 96, 128] and all(s.layer == -1 for s in cores)
    assert all(dense_weights(s) == {} for s in cores)
    assert len({s.name for s in specs}) == len(specs)


def test_the_doctors_attention_core_builds_lints_and_checks_on_the_host():
    """`autotune doctor` predicts this function on the ANE (macOS); here its program is linted and evaluated."""
    prog = dense_program(PROBE_ATTENTION, {})
    assert lint_program(prog) == []
    assert check_dense_function(prog.functions["main"], PROBE_ATTENTION).max_rel_error < 2e-3


def test_the_lint_refuses_a_five_axis_tensor():
    prog = mil_program(lambda mb, x: mb.reshape(x=x, shape=[2, 2, 2, 2, 8]), shape=(8, 16))
    assert any("5 axes" in str(issue) for issue in lint_program(prog))


def test_a_compressed_matrix_is_close_and_not_the_original():
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float16)
    q = decompressed_matrix(w, "int8")
    err = np.abs(q.astype(np.float32) - w.astype(np.float32)).max() / np.abs(w).max()
    assert 0 < err < 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("block", [None, 64])
def test_build_holds_one_attention_core_per_shape(tmp_path, capsys, block):
    """Unblocked: one core per (chunk, bucket); in causal blocks of 64 queries: one per (block, bucket), the
    blocks' buckets at every 64 keys."""
    model, _ = random_model("random:qwen2_moe")
    chunk = 128 if block else 32
    plan = template_plan(model_spec(model), "ample", "drop", "ane", chunk_tokens=chunk, dense="ane",
                         context_tokens=2 * chunk).to_json()
    if block:
        plan["dense"].update(attention_block=block, attention_context_buckets=[64, 128, 192, 256])
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = tmp_path / "p.mlpackage"
    assert main(["build", "--model", "random:qwen2_moe", "--plan", str(tmp_path / "plan.json"), "--out", str(out),
                 "--no-progress", "--cache-dir", str(tmp_path / "cache")]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    layers = model.config.num_hidden_layers
    cores = 4 if block else 2  # buckets 32 and 64 (unblocked); 64 .. 256 (blocks), shared by the 4 layers
    assert r["attention_functions"] == cores
    assert r["dense_functions"] == 3 * layers + cores  # qkv, o_proj and the shared expert per layer
    names = r["packages"][0]["functions"]
    attention = sorted(n for n in names if n.startswith("attention_"))
    assert attention == (["attention_q64_k128", "attention_q64_k192", "attention_q64_k256", "attention_q64_k64"]
                         if block else ["attention_q32_k32", "attention_q32_k64"])
    assert len(names) == r["functions"] + r["dense_functions"]
    assert r["max_rel_error"] < r["tolerance"]


def test_the_attention_cores_grouped_queries_are_size_checked():
    """Qwen3-30B-A3B's heads (32 over 4 key/value heads) at 16,384 unblocked rows: every input axis is within the
    ANE's 65,536, but the queries grouped per key/value head inside the core, [4, 8 x 16,384, bucket], are not."""
    from runtime.backends import DenseForm, DenseSpec
    from runtime.coreml.dense_programs import check_dense_limits
    from runtime.errors import NpumoeError

    def core(rows: int) -> DenseSpec:
        return DenseSpec("attention", -1, rows, form=DenseForm(head_dim=128), keys=16384, heads=32, kv_heads=4)

    with pytest.raises(NpumoeError, match="attention_q16384_k16384: an axis of 131,072 is past"):
        check_dense_limits([core(16384)], 1e9)
    check_dense_limits([core(8192)], 1e9)  # 65,536 grouped rows: at the limit, within it
