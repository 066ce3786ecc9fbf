"""A plan's dense functions as backend specs (`DenseSpec`): what the runtime prepares and the builder converts."""
from __future__ import annotations

import torch

from runtime.backends import DenseForm, DenseSpec
from runtime.dense.families import attention_modules, mlp_modules
from runtime.plan import DenseFunction, DenseLayer, Plan


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model computes its hidden states in, what a dense function's rows arrive in: its input
    embedding's output (a packed MLX embedding's `dtype`; else its weight's). Not a parameter of the function's own
    modules: an MLX QuantizedLinear without a bias has none, and its packed codes are integers."""
    embedding = model.get_input_embeddings()
    return getattr(embedding, "dtype", None) or embedding.weight.dtype


def static_rows(plan: Plan, placed: DenseFunction) -> int:
    """The rows of a full chunk a row-wise function's static shape takes (a split leaves the CPU the rest)."""
    return placed.rows or plan.chunk_tokens


def layer_specs(model: torch.nn.Module, plan: Plan, dl: DenseLayer) -> list[tuple[DenseSpec, DenseFunction]]:
    """The row-wise functions one dense entry places (`qkv`, `o_proj`, `mlp`), each with its placement."""
    index = dl.layer
    modules, form = attention_modules(model, index)
    out = []
    if dl.qkv is not None:
        splits = tuple(modules[r].out_features for r in ("q", "k", "v"))
        out.append((DenseSpec("qkv", index, static_rows(plan, dl.qkv), {r: m for r, m in modules.items() if r != "o"},
                              form, splits, dl.qkv.compression), dl.qkv))
    if dl.o_proj is not None:
        out.append((DenseSpec("o_proj", index, static_rows(plan, dl.o_proj), {"o": modules["o"]}, form,
                              (modules["o"].out_features,), dl.o_proj.compression), dl.o_proj))
    if dl.mlp is not None:
        mlp, mlp_form = mlp_modules(model, index)
        hidden = int(model.config.hidden_size)
        splits = (hidden, 1) if mlp_form.shared_gate else (hidden,)
        out.append((DenseSpec("mlp", index, static_rows(plan, dl.mlp), mlp, mlp_form, splits, dl.mlp.compression),
                    dl.mlp))
    return out


def attention_spec(model: torch.nn.Module, plan: Plan, layer: int, bucket: int) -> DenseSpec:
    """The weight-free attention core of a full chunk's queries (its first `attention_rows` where the plan splits
    it, one block of them where it runs in `attention_block`s) over `bucket` keys (the same for every layer)."""
    attn, cfg = model.model.layers[layer].self_attn, model.config
    dense = plan.dense
    rows = (dense.attention_block or dense.attention_rows) if dense else None
    rows = rows or plan.chunk_tokens
    return DenseSpec("attention", -1, rows, form=DenseForm(head_dim=int(attn.head_dim)), keys=bucket,
                     heads=int(cfg.num_attention_heads), kv_heads=int(cfg.num_key_value_heads),
                     scaling=float(attn.scaling))


def backend_specs(model: torch.nn.Module, plan: Plan, backend: str) -> list[DenseSpec]:
    """Every dense function the plan places on `backend`, in plan order; one attention core per bucket."""
    if plan.dense is None:
        return []
    specs, attention = [], None
    for dl in plan.dense.layers:
        specs += [spec for spec, placed in layer_specs(model, plan, dl) if placed.backend == backend]
        if dl.attention == backend and attention is None:
            attention = dl.layer
    if attention is not None:
        specs += [attention_spec(model, plan, attention, b) for b in plan.dense.attention_context_buckets]
    return specs
