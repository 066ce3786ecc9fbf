"""The backend protocol's expert FFN owns its gate (act(gate) * up) rather than calling transformers' private
`_apply_gate`: here it is checked against transformers' own, in every family the runtime runs."""
import pytest
import torch
from helpers import random_model

from runtime.backends.protocol import expert_ffn, gated_activation
from runtime.loading.model_loader import moe_layers

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "phimoe")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gate_is_transformers_gate(family):
    model, _ = random_model(f"random:{family}")
    experts = moe_layers(model)[0].experts
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(7, experts.gate_up_proj.shape[1], generator=gen) * 3
    assert torch.equal(gated_activation(experts, gate_up), experts._apply_gate(gate_up))  # transformers' gate
    x = torch.randn(5, experts.gate_up_proj.shape[2], generator=gen)
    expected = experts._apply_gate(x @ experts.gate_up_proj[2].T) @ experts.down_proj[2].T
    torch.testing.assert_close(expert_ffn(experts, 2, x), expected, rtol=1e-6, atol=1e-6)
