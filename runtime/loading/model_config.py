"""config.json, read once (`read_config`, the one reader) and asked: the facts every command takes from it, each
rule written here once (the dtype it is stored in, its context, its heads' width, whether MLX packed it)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime.errors import NpumoeError

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# auto: the checkpoint's own dtype, or float32 where this host emulates it (`compute_dtype.auto_dtype_for`)
DTYPE_CHOICES = ("auto", *DTYPES)


def read_config(path: Path) -> dict:
    """The model folder's config.json as a JSON object; each failure one line naming the file."""
    where = path / "config.json"
    try:
        config = json.loads(where.read_text(encoding="utf-8"))
    except OSError as e:
        raise NpumoeError(f"{where}: cannot read: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise NpumoeError(f"{where}: not valid JSON ({str(e)[:80]})") from None
    if not isinstance(config, dict):
        raise NpumoeError(f"{where}: a model config is a JSON object, got {type(config).__name__}")
    return config


def text_config(config: dict) -> dict:
    """The decoder's part of a config: a multimodal config keeps it under `text_config`."""
    return config.get("text_config") or config


def context_of(config: dict) -> int | None:
    """The longest sequence the model takes (`max_position_embeddings`); None where the config does not say."""
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return int(value) if value else None


def stored_dtype(config: dict) -> torch.dtype:
    """The dtype the weights are stored in: `dtype` (or older `torch_dtype`); unknown or absent: float32."""
    return DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), torch.float32)


def mlx_quantization(config: dict) -> dict | None:
    """mlx-lm's `quantization` table (group_size / bits, no quant_method) where MLX packed the folder, else None."""
    q = config.get("quantization")
    return q if isinstance(q, dict) and ("bits" in q or "group_size" in q) and "quant_method" not in q else None


def head_dim(config: dict) -> int:
    """The width of one attention head: `head_dim`, or the hidden size over the heads where the config says none."""
    return int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
