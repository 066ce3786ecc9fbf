"""What differs between the five transformers MoE families in a decoder layer's dense functions: one table.

Read from transformers 5's modeling files (`models/<family>/modeling_<family>.py`):

| family | input norm | q/k norms | q/k/v biases | o bias | dense MLP layers | shared expert |
|---|---|---|---|---|---|---|
| qwen3_moe | RMSNorm | RMSNorm per head | `attention_bias` | `attention_bias` | `mlp_only_layers`, sparse step | no |
| qwen2_moe | RMSNorm | none | `qkv_bias` | none | `mlp_only_layers`, sparse step | yes, sigmoid gate `[H -> 1]` |
| mixtral | RMSNorm | none | none | none | none | no |
| olmoe | RMSNorm | RMSNorm over the whole projection | `attention_bias` | `attention_bias` | none | no |
| phimoe | LayerNorm (affine, with bias) | none | `attention_bias` | `attention_bias` | none | no |

Biases are taken from the modules as they are (a Linear's `bias` is None where the config turns it off). Olmoe's
`clip_qkv` clamps after the norms, in transformers' own attention code, on the function's outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.backends import DenseForm
from runtime.errors import NpumoeError


@dataclass(frozen=True)
class Family:
    norm: str  # "rms" | "layer"
    qk_norm: str | None  # None | "head" | "projection"
    shared_expert: bool


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family("rms", "head", False),
    "qwen2_moe": Family("rms", None, True),
    "mixtral": Family("rms", None, False),
    "olmoe": Family("rms", "projection", False),
    "phimoe": Family("layer", None, False),
}


def family(model: torch.nn.Module) -> Family:
    model_type = model.config.model_type
    if model_type not in FAMILIES:
        raise NpumoeError(f"dense functions: model type {model_type!r} is none of the families npumoe knows "
                          f"({', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def dense_mlp(decoder_layer: torch.nn.Module) -> torch.nn.Module | None:
    """A non-MoE layer's dense MLP (gate, up and down projections), else None."""
    mlp = getattr(decoder_layer, "mlp", None)
    return mlp if mlp is not None and hasattr(mlp, "gate_proj") and not hasattr(mlp, "experts") else None


def shared_expert(decoder_layer: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """An MoE layer's (shared expert, its gate), else None."""
    mlp = getattr(decoder_layer, "mlp", None)
    expert, gate = getattr(mlp, "shared_expert", None), getattr(mlp, "shared_expert_gate", None)
    return (expert, gate) if expert is not None and gate is not None else None


def _check(index: int, what: str, ok: bool) -> None:
    if not ok:
        raise NpumoeError(f"layer {index}: {what}, unlike the family table (runtime/dense/families.py): the "
                          "transformers version may have changed the model's code")


def attention_modules(model: torch.nn.Module, index: int) -> tuple[dict[str, torch.nn.Module], DenseForm]:
    """A decoder layer's attention projections by role, and their form, checked against the table."""
    fam, layer = family(model), model.model.layers[index]
    attn = layer.self_attn
    modules = {"norm": layer.input_layernorm, "q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj}
    _check(index, f"the input norm is {type(layer.input_layernorm).__name__}",
           isinstance(layer.input_layernorm, torch.nn.LayerNorm) == (fam.norm == "layer"))
    has_qk_norm = hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
    _check(index, "q/k norms are " + ("present" if has_qk_norm else "absent"), has_qk_norm == (fam.qk_norm is not None))
    if has_qk_norm:
        modules.update(q_norm=attn.q_norm, k_norm=attn.k_norm)
    return modules, DenseForm(norm=fam.norm, qk_norm=fam.qk_norm, head_dim=int(attn.head_dim))


def mlp_modules(model: torch.nn.Module, index: int) -> tuple[dict[str, torch.nn.Module], DenseForm] | None:
    """A layer's dense MLP, or its shared expert and gate, by role; None where the layer has neither."""
    layer = model.model.layers[index]
    dense, shared = dense_mlp(layer), shared_expert(layer)
    _check(index, "a shared expert is present", shared is None or family(model).shared_expert)
    if dense is not None:
        return {"mlp": dense}, DenseForm(act=str(model.config.hidden_act))
    if shared is not None:
        return {"mlp": shared[0], "gate": shared[1]}, DenseForm(shared_gate=True, act=str(model.config.hidden_act))
    return None
