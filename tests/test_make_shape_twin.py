"""scripts/make_shape_twin.py on shrunken configs: loadable without missing weights, decisive routing, bf16."""
import json

import pytest
import torch
import transformers
from helpers import shape_twin_script, tiny_twin

from runtime.loading.model_loader import checkpoint_dtype, load_model, model_spec, moe_layers
from runtime.loading.model_record import read_model_spec


@pytest.mark.parametrize("like", ["qwen3-30b-a3b", "phi-3.5-moe", "mixtral-8x7b", "olmoe-1b-7b"])
def test_twin_loads_whole_in_bf16(tmp_path, like):
    path = tiny_twin(tmp_path / "twin", like, layers=2)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert checkpoint_dtype(str(path)) == torch.bfloat16
    model, tok = load_model(str(path), "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.model_type == shape_twin_script().TWINS[like]["model_type"]
    assert len(moe_layers(model)) == 2
    assert 0.4 < float(moe_layers(model)[0].router.weight.detach().float().std()) < 0.6  # decisive routing
    assert len(tok.encode("def f(x): return x")) > 1
    assert read_model_spec(str(path)) == model_spec(model)
    # the published names mlx_lm.convert reads, beside transformers 5's own
    saved = json.loads((path / "config.json").read_text())
    assert saved["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert saved.get("num_experts", saved.get("num_local_experts")) == model_spec(model).num_experts


def test_twin_config_is_the_published_one_but_the_layers():
    twin = shape_twin_script()
    cfg = twin.twin_config("qwen3-30b-a3b", 2)
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size) == (2, 128, 768, 2048)
    assert twin.twin_config("phi-3.5-moe", 1).intermediate_size == 6400
