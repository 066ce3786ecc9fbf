"""The torch form of the dense modules a plan places on a static backend, over mlx-lm's own weights: transformers'
module tree of the folder on the meta device (`meta_skeleton`), each module a placed function reads made of views of
the mlx-lm module at the same path (no copy; an mlx-lm `QuantizedLinear` becomes the torch spine's packed
`QuantizedLinear`). The static backends prepare their functions from it as on the torch spine (`DenseExecutor`); its
`slots` say which mlx-lm module each torch module stands for, so the spine splices the functions into mlx-lm's
model. Imports mlx."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.nn as nn
import torch

from runtime.cpu.quantized import PackedWeight, QuantizedLinear
from runtime.dense.families import attention_modules, mlp_modules
from runtime.loading.checkpoint_reader import meta_skeleton
from runtime.loading.model_config import read_config
from runtime.mlx.formats import check_format
from runtime.mlx.mlx_exact import torch_view
from runtime.plan import Plan


@dataclass(frozen=True)
class Slot:
    """Where an mlx-lm module sits (`parent.name`), and the module itself (what the spine's MLX rows compute on)."""
    parent: nn.Module
    name: str
    module: nn.Module


@dataclass
class DenseView:
    """The torch model the static backends prepare from, and the mlx-lm slot of each of its filled modules."""
    model: torch.nn.Module
    slots: dict[int, Slot]  # id(torch module) -> its mlx-lm slot


def _mlx_at(model: nn.Module, path: str) -> nn.Module:
    node = model
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else getattr(node, part)
    return node


def _filled(module: torch.nn.Module, mlx: nn.Module, where: str) -> torch.nn.Module:
    """`module` with its weights views of `mlx`'s, its children too; a packed mlx-lm linear as a `QuantizedLinear`."""
    if "scales" in mlx:
        check_format(where, mlx.bits, mlx.group_size, getattr(mlx, "mode", "affine"))
        packed = PackedWeight(*(torch_view(mlx[n]) for n in ("weight", "scales", "biases")), mlx.bits,
                              mlx.group_size)
        return QuantizedLinear(packed, torch_view(mlx["bias"]) if "bias" in mlx else None)
    for name, p in list(module.named_parameters(recurse=False)):
        setattr(module, name, torch.nn.Parameter(torch_view(mlx[name]).view(p.shape), requires_grad=False))
    for name, child in list(module.named_children()):
        if next(child.parameters(), None) is None:  # an activation: nothing to view
            continue
        setattr(module, name, _filled(child, getattr(mlx, name), f"{where}.{name}"))
    return module


def _placed_modules(model: torch.nn.Module, plan: Plan) -> list[torch.nn.Module]:
    """The torch modules the plan's dense functions read (each layer's, by role)."""
    out = []
    for dl in plan.dense.layers if plan.dense is not None else ():
        if dl.qkv is not None or dl.o_proj is not None:
            modules = attention_modules(model, dl.layer)[0]
            roles = [r for r in modules if r != "o"] if dl.qkv is not None else []
            out += [modules[r] for r in roles + (["o"] if dl.o_proj is not None else [])]
        if dl.mlp is not None and (mlp := mlp_modules(model, dl.layer)) is not None:
            out += list(mlp[0].values())
    return out


def dense_view(mlx_model: nn.Module, path: Path, plan: Plan) -> DenseView:
    """The torch view of the modules `plan` places on static backends, over `mlx_model`'s weights (module doc)."""
    model = meta_skeleton(path, read_config(path))
    names = {id(m): n for n, m in model.named_modules()}
    slots = {}
    for module in _placed_modules(model, plan):
        name = names[id(module)]
        parent, _, leaf = name.rpartition(".")
        mlx_parent = _mlx_at(mlx_model, parent)
        filled = _filled(module, getattr(mlx_parent, leaf), name)
        if filled is not module:
            setattr(model.get_submodule(parent), leaf, filled)
        slots[id(filled)] = Slot(mlx_parent, leaf, getattr(mlx_parent, leaf))
    return DenseView(model.eval(), slots)
