"""The MLX spine's model: the folder the user has, loaded by mlx-lm's own classes (`mlx_lm.utils.load_model`), its
weights in MLX's memory once. An MLX folder loads as it is; a transformers folder (tiny-moe) through mlx-lm's
loader, which reads `rope_theta` at the top of config.json where transformers 5 writes it under `rope_parameters`:
given to mlx-lm from there, the folder untouched. Imports mlx: only the spine names it, lazily."""
from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from runtime.errors import NpumoeError
from runtime.loading.checkpoints import check_tokenizer_files
from runtime.loading.gguf_reader import is_gguf_path
from runtime.loading.model_config import read_config
from runtime.loading.model_loader import RANDOM_PREFIX, model_dir, open_checkpoint
from runtime.mlx.mlx_exact import device

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_FLOATS = (mx.float32, mx.bfloat16, mx.float16)


def folder_config(path: Path) -> dict:
    """What mlx-lm needs beside the folder's config.json: `rope_theta` from transformers 5's `rope_parameters`."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    rope = config.get("rope_parameters") or {}
    return {"rope_theta": rope["rope_theta"]} if "rope_theta" not in config and "rope_theta" in rope else {}


def compute_dtype(dtype: str) -> mx.Dtype | None:
    """The MLX dtype `--dtype` asks for; "auto": float32 on MLX's CPU device (its `gather_mm` takes float32 only),
    the checkpoint's own on a GPU (None: leave the weights as loaded)."""
    if dtype == "auto":
        return mx.float32 if device() == "cpu" else None
    if dtype not in DTYPES:
        raise NpumoeError(f"unknown dtype {dtype!r}; choose from auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def cast_floats(model: nn.Module, dtype: str) -> None:
    """The model's floating weights in `dtype` (`compute_dtype`; packed codes as stored), made: nothing lazy is left
    for another thread."""
    to = compute_dtype(dtype)
    if to is not None:
        model.update(tree_map(lambda a: a.astype(to) if a.dtype in _FLOATS else a, model.parameters()))
    mx.eval(model.parameters())


def load_mlx_model(name: str, dtype: str = "auto") -> tuple[nn.Module, object, Path]:
    """(mlx-lm's model, the folder's tokenizer, the folder) with its floating weights in `dtype` (`compute_dtype`);
    packed codes stay as stored."""
    if name.startswith(RANDOM_PREFIX):
        raise NpumoeError(f"--engine mlx loads a model folder through mlx-lm; {name} is made in torch: use "
                          "--engine torch")
    if is_gguf_path(name):  # our reader runs it, on the torch spine
        raise NpumoeError(f"--engine mlx loads a model folder through mlx-lm; {name} is a GGUF file, which mlx-lm "
                          "does not load here: use --engine torch")
    import transformers
    from mlx_lm.utils import load_model

    path = model_dir(name)
    open_checkpoint(path, read_config(path))  # its files whole and its config agreeing, as the torch spine checks
    check_tokenizer_files(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        model, _ = load_model(path, model_config=folder_config(path))
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:  # mlx-lm's own refusals: an unknown family,
        # weights or config fields it does not expect
        raise NpumoeError(f"--engine mlx: mlx-lm cannot load {path}: {str(e).splitlines()[0][:160]}") from None
    cast_floats(model, dtype)  # made here, on the loading thread
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer, path


def weight_bytes(model: nn.Module) -> int:
    """The bytes the model's weights hold in MLX's memory."""
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))
