"""The model a search is for, resolved once: its spec (shape, fingerprint), its sizes and its context, read by every
stage of the search, and the loaded model itself when a stage needs it (calibration, the fidelity gate)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from autotune.costing.memory import ModelSize, model_size
from autotune.costing.whole_prefill import DecoderShape
from runtime.errors import NpumoeError
from runtime.loading.model_loader import (
    RANDOM_PREFIX,
    context_length,
    load_model,
    model_dir,
    model_spec,
    read_model_spec,
    resolve_dtype,
)
from runtime.plan import ModelSpec


@dataclass
class ModelRecord:
    name: str
    dtype: str
    spec: ModelSpec
    size: ModelSize
    context: int | None  # the longest sequence it takes (None: its config does not say)
    shape: DecoderShape | None = None  # its decoder's shapes (what the whole prefill's prediction prices)
    _loaded: tuple[torch.nn.Module, object] | None = field(default=None, repr=False)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in (`--dtype`, auto resolved on this host)."""
        return resolve_dtype(self.name, self.dtype)

    def loaded(self) -> tuple[torch.nn.Module, object]:
        """(model in `dtype`, tokenizer), loaded on first use and kept."""
        if self._loaded is None:
            self._loaded = load_model(self.name, self.dtype)
        return self._loaded


def resolve_model(name: str, dtype: str = "auto") -> ModelRecord:
    """`name` resolved once. A checkpoint is read from its config and router tensors only (the weights load on
    `loaded()`); a `random:` model is built once, and that model is the one every stage uses."""
    if not name.startswith(RANDOM_PREFIX):
        config = json.loads((model_dir(name) / "config.json").read_text())
        return ModelRecord(name, dtype, read_model_spec(name), model_size(name, dtype), context_length(name),
                           DecoderShape.from_config(config.get("text_config", config)))
    model, tokenizer = load_model(name)  # float32: what its spec's fingerprint is of (`read_model_spec`)
    torch_dtype = resolve_dtype(name, dtype)
    size = ModelSize.of(model, torch.empty(0, dtype=torch_dtype).element_size())
    record = ModelRecord(name, dtype, model_spec(model), size, int(model.config.max_position_embeddings),
                         DecoderShape.from_config(model.config.to_dict()))
    if torch_dtype == torch.float32:
        record._loaded = (model, tokenizer)
    return record


def check_context(model: str, context: int | None, prompt_tokens: int, option: str = "--prompt-tokens") -> None:
    """The one rule for a prompt against the model's context, for every stage that prefills prompts (calibrate,
    search, run, evaluate): a prompt longer than the positions the model holds is refused up front (`generate` and
    the server keep `runtime.generation.max_new_tokens`, the same rule with room for the new tokens)."""
    if context and prompt_tokens > context:
        raise NpumoeError(f"{option} {prompt_tokens} is longer than {model}'s context of {context} tokens "
                          "(config.json max_position_embeddings); give at most that")
