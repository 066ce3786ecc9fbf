"""Where the builder takes expert weights from: a loaded model's fused experts modules, or the safetensors
checkpoint itself, a few experts at a time.

Both give, for (layer, experts), a fused experts module holding those experts and their indices in it, so the
builder converts and host-checks one function with only that function's weights in memory when it reads the
checkpoint (the model is never loaded whole).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Protocol, Sequence

import torch

from runtime.loading.checkpoint_reader import (
    SAFETENSORS_DTYPES,
    fits,
    meta_skeleton,
    read_tensor_into,
    tensor_index,
    tensor_sources,
)
from runtime.loading.checkpoints import check_checkpoint, safetensors_header
from runtime.loading.gguf_reader import is_gguf_view
from runtime.loading.model_loader import RANDOM_PREFIX, model_dir, moe_layers, resolve_dtype

_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


class ExpertWeights(Protocol):
    def experts(self, layer: int, experts: Sequence[int]) -> tuple[torch.nn.Module, tuple[int, ...]]:
        """A fused experts module (`gate_up_proj [E, 2F, H]`, `down_proj [E, H, F]`, `_apply_gate`) holding
        `experts` of MoE layer `layer`, and their indices in it, in the order asked."""
        ...


class ModuleExperts:
    """The experts modules of a loaded model (MoE layer index -> fused experts module)."""

    def __init__(self, layers: dict[int, torch.nn.Module]) -> None:
        self.layers = layers

    def experts(self, layer: int, experts: Sequence[int]) -> tuple[torch.nn.Module, tuple[int, ...]]:
        return self.layers[layer], tuple(experts)


class CheckpointExperts:
    """Experts read from a safetensors checkpoint on demand, through the loader's key mapping
    (`runtime.loading.checkpoint_reader.tensor_sources`: fused tensors, or per-expert keys under `mlp.experts.N` or
    `block_sparse_moe.experts.N`), into a module of just those experts in `dtype`. The model tree is built on
    the meta device; only the asked experts' rows are read (plain file reads, as the loader does)."""

    def __init__(self, skeleton: torch.nn.Module, dtype: torch.dtype,
                 sources: dict[tuple[int, str], list[str]], files: dict[str, Path]) -> None:
        self.dtype, self.sources, self.files = dtype, sources, files
        self.modules = {layer.index: layer.experts for layer in moe_layers(skeleton)}
        self.headers = {file: safetensors_header(file) for file in set(files.values())}

    @classmethod
    def open(cls, name: str, dtype: str | torch.dtype) -> CheckpointExperts | None:
        """The reader for model `name`, or None where its experts are not all in safetensors files with the
        shapes config.json gives (the caller then loads the model, whose loader reports what is wrong)."""
        if name.startswith(RANDOM_PREFIX):
            return None
        path = model_dir(name)
        if is_gguf_view(path):  # GGUF hook (issue 57): its experts are read with the model
            return None
        check_checkpoint(path)
        files = tensor_index(path)
        if not files:
            return None
        skeleton = meta_skeleton(path)
        names = {id(p): n for n, p in skeleton.named_parameters()}
        sources = {}
        for layer in moe_layers(skeleton):
            for leaf in _EXPERT_PARAMS:
                p = getattr(layer.experts, leaf)
                src = tensor_sources(names[id(p)], p.shape, files)
                if src is None:
                    return None
                sources[layer.index, leaf] = src
        reader = cls(skeleton, resolve_dtype(name, dtype), sources, files)
        for (layer, leaf), src in sources.items():
            entries = [reader._entry(k) for k in src]
            if any(e.get("dtype") not in SAFETENSORS_DTYPES for e in entries) or not fits(
                    getattr(reader.modules[layer], leaf).shape, [e["shape"] for e in entries]):
                return None
        return reader

    def _entry(self, key: str) -> dict:
        return self.headers[self.files[key]][key]

    def experts(self, layer: int, experts: Sequence[int]) -> tuple[torch.nn.Module, tuple[int, ...]]:
        module = copy.deepcopy(self.modules[layer])  # meta: the form (gate, flags) without weights
        with torch.no_grad():
            for leaf in _EXPERT_PARAMS:
                shape = getattr(module, leaf).shape
                dest = torch.empty((len(experts), *shape[1:]), dtype=self.dtype)
                for i, e in enumerate(experts):
                    self._read_expert(self.sources[layer, leaf], shape[0], e, dest[i])
                setattr(module, leaf, torch.nn.Parameter(dest, requires_grad=False))
        module.num_experts = len(experts)
        return module, tuple(range(len(experts)))

    def _read_expert(self, src: list[str], num_experts: int, expert: int, dest: torch.Tensor) -> None:
        """Expert `expert`'s rows: a slice of one fused stored tensor, or its per-expert tensors stacked along
        dim 0 of `dest` in the loader's order."""
        if len(src) == 1:  # fused [E, ...]: expert e is one contiguous byte range
            entry = self._entry(src[0])
            a, b = entry["data_offsets"]
            size = (b - a) // num_experts
            parts = [(src[0], dict(entry, shape=entry["shape"][1:],
                                   data_offsets=[a + expert * size, a + (expert + 1) * size]), dest)]
        else:
            per = len(src) // num_experts
            keys = src[expert * per:(expert + 1) * per]
            rows = self._entry(keys[0])["shape"][0]
            parts = [(k, self._entry(k), dest[j * rows:(j + 1) * rows]) for j, k in enumerate(keys)]
        for key, entry, part in parts:
            with open(self.files[key], "rb") as f:
                start = 8 + int.from_bytes(f.read(8), "little")
                read_tensor_into(f, start, entry, part)
