"""The builder's expert weights read from a safetensors checkpoint, a function at a time, give the same package
weights and host error as a loaded model's experts, and never load the model whole."""
import json

import coremltools as ct
import pytest
import torch
import transformers
from helpers import tiny_twin

import runtime.loading.model_loader
from autotune.cli import main
from autotune.searching.templates import template_plan
from runtime.coreml.ane import META_KEY
from runtime.coreml.converter import build_package, quiet_coremltools_import
from runtime.loading.expert_weights import CheckpointExperts, ModuleExperts
from runtime.loading.model_loader import load_model, model_spec, moe_layers
from runtime.loading.model_record import resolve_model
from runtime.plan import save_plan

quiet_coremltools_import()


def _fused_checkpoint(path):
    """A checkpoint storing the fused `[E, 2F, H]` / `[E, H, F]` experts as they are in the model."""
    from safetensors.torch import save_file

    model = load_model("random:qwen3_moe")[0].to(torch.bfloat16)
    model.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"),
              {"format": "pt"})
    return path


def _checkpoint(tmp_path, layout: str):
    if layout == "fused":
        return _fused_checkpoint(tmp_path / "fused")
    return tiny_twin(tmp_path / layout, layout, layers=2)  # per-expert keys: mlp.experts.N / block_sparse_moe


def _two_groups_per_layer(plan):
    """The template's first two groups of each layer, the other experts exact: what a function reads, without
    converting all 128 of Qwen's experts per layer twice."""
    layers = [lp.model_copy(update={"groups": lp.groups[:2],
                                    "cpu_exact": sorted(e for g in lp.groups[2:] for e in g.experts)})
              for lp in plan.layers]
    return plan.model_copy(update={"layers": layers})


@pytest.mark.parametrize("layout", ["qwen3-30b-a3b", "phi-3.5-moe", "fused"])
def test_checkpoint_experts_build_equals_loaded_model_build(tmp_path, layout, monkeypatch):
    path = _checkpoint(tmp_path, layout)
    model = load_model(str(path), "bfloat16")[0] if layout != "fused" else \
        load_model("random:qwen3_moe")[0].to(torch.bfloat16)
    plan = _two_groups_per_layer(template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=8))
    loaded = build_package(ModuleExperts({l.index: l.experts for l in moe_layers(model)}), plan,
                           tmp_path / "loaded.mlpackage", cache_dir=tmp_path / "c1")

    def refuse(*a, **k):
        pytest.fail("the checkpoint reader loaded the whole model")

    monkeypatch.setattr(runtime.loading.model_loader, "read_weights", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    source = CheckpointExperts.open(resolve_model(str(path), "bfloat16"))
    assert source is not None
    module, index = source.experts(1, (5, 2))
    assert index == (0, 1) and module.gate_up_proj.dtype == torch.bfloat16
    full = moe_layers(model)[1].experts
    assert torch.equal(module.gate_up_proj, full.gate_up_proj[[5, 2]])
    assert torch.equal(module.down_proj, full.down_proj[[5, 2]])
    read = build_package(source, plan, tmp_path / "read.mlpackage", cache_dir=tmp_path / "c2")

    assert [c.max_rel_error for c in read.checks] == [c.max_rel_error for c in loaded.checks]
    assert 0 < read.max_rel_error <= 1e-2
    meta = [json.loads(ct.utils.load_spec(str(tmp_path / f"{n}.mlpackage")).description.metadata
                       .userDefined[META_KEY]) for n in ("loaded", "read")]
    assert meta[0] == meta[1]  # the weights digests of every function included
    weights = [sorted((tmp_path / f"{n}.mlpackage").rglob("weight.bin")) for n in ("loaded", "read")]
    assert weights[0] and [w.read_bytes() for w in weights[0]] == [w.read_bytes() for w in weights[1]]


def test_cli_build_of_a_checkpoint_never_loads_the_model(tmp_path, monkeypatch, capsys):
    path = tiny_twin(tmp_path / "twin", "phi-3.5-moe", layers=1)
    plan = tmp_path / "plan.json"
    save_plan(template_plan(model_spec(load_model(str(path), "auto")[0]), "ample", backend="ane",
                            chunk_tokens=8), plan)
    monkeypatch.setattr("autotune.pipeline.load_model", lambda *a, **k: pytest.fail("build loaded the model"))
    assert main(["build", "--model", str(path), "--plan", str(plan), "--out", str(tmp_path / "p.mlpackage"),
                 "--no-progress", "--cache-dir", str(tmp_path / "cache")]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < report["max_rel_error"] <= 1e-2


def test_models_without_a_safetensors_checkpoint_are_loaded():
    assert CheckpointExperts.open(resolve_model("random:qwen3_moe")) is None
