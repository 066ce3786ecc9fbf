"""The model a command works on, described once: its config.json read once, its checkpoint's tensor tables read
once, and from them its spec (shape, fingerprint), its context, the dtype it computes in and its module tree on the
meta device. Every stage of a search reads this record; the memory model and the whole-prefill model derive their
views of it (`autotune.costing.memory.model_size`, `autotune.costing.whole_prefill.decoder_shape`). The weights load
on `loaded()`, once."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.errors import NpumoeError
from runtime.loading.checkpoint_reader import meta_skeleton
from runtime.loading.compute_dtype import auto_dtype_for, resolved_dtype
from runtime.loading.gguf_reader import is_gguf_view
from runtime.loading.model_config import context_of, mlx_quantization, read_config
from runtime.loading.model_loader import (
    RANDOM_PREFIX,
    checkpoint_spec,
    load_model,
    model_dir,
    model_spec,
    open_checkpoint,
    stored_parameters,
)
from runtime.plan import ModelSpec


@dataclass(eq=False)
class ModelRecord:
    name: str
    dtype: str | torch.dtype  # as asked (`--dtype`)
    compute_dtype: torch.dtype  # what it computes in: `dtype`, auto resolved on this host once
    config: dict  # its config.json (a random model: its transformers config as a dict)
    spec: ModelSpec
    context: int | None  # the longest sequence it takes (None: its config does not say)
    skeleton: torch.nn.Module = field(repr=False)  # its module tree on the meta device (a random model: the model)
    mlx: dict | None = None  # an MLX folder's quantization table (its weights held packed)
    gguf: Path | None = None  # a GGUF file's description folder (`gguf_reader.gguf_view`; its weights held packed)
    _loaded: tuple[torch.nn.Module, object] | None = field(default=None, repr=False)

    def loaded(self) -> tuple[torch.nn.Module, object]:
        """(model in `compute_dtype`, tokenizer), loaded on first use and kept."""
        if self._loaded is None:
            self._loaded = load_model(self.name, self.compute_dtype)
        return self._loaded


def resolve_model(name: str, dtype: str | torch.dtype = "auto") -> ModelRecord:
    """`name` resolved once. A checkpoint is read from its config.json, its tensor tables and its router tensors
    (the weights load on `loaded()`); a `random:` model is built once, and that model is the one every stage uses."""
    if name.startswith(RANDOM_PREFIX):
        return _random_record(name, dtype)
    path = model_dir(name)
    config = read_config(path)
    headers, quantization = open_checkpoint(path, config)
    compute = resolved_dtype(dtype, lambda: auto_dtype_for(config, lambda: stored_parameters(headers))[0])
    skeleton = meta_skeleton(path, config)
    return ModelRecord(name, dtype, compute, config, checkpoint_spec(name, path, config, skeleton, quantization),
                       context_of(config), skeleton, mlx_quantization(config), path if is_gguf_view(path) else None)


def _random_record(name: str, dtype: str | torch.dtype) -> ModelRecord:
    model, tokenizer = load_model(name)  # float32: what its spec's fingerprint is of
    compute = resolved_dtype(dtype, lambda: torch.float32)
    record = ModelRecord(name, dtype, compute, model.config.to_dict(), model_spec(model),
                         int(model.config.max_position_embeddings), model)
    if compute == torch.float32:
        record._loaded = (model, tokenizer)
    return record


def read_model_spec(name: str) -> ModelSpec:
    """The same ModelSpec as `model_spec(load_model(name)[0])`, reading only config.json, the tensor tables and the
    router weights: what plan-template and search need, at a fraction of the memory."""
    return resolve_model(name, torch.float32).spec


def check_context(model: str, context: int | None, prompt_tokens: int, option: str = "--prompt-tokens") -> None:
    """The one rule for a prompt against the model's context, for every stage that prefills prompts (calibrate,
    search, run, evaluate): a prompt longer than the positions the model holds is refused up front (`generate` and
    the server keep `runtime.generation.max_new_tokens`, the same rule with room for the new tokens)."""
    if context and prompt_tokens > context:
        raise NpumoeError(f"{option} {prompt_tokens} is longer than {model}'s context of {context} tokens "
                          "(config.json max_position_embeddings); give at most that")
