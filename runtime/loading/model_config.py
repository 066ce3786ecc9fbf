"""config.json, read once (`read_config`, the one reader) and asked: the facts every command takes from it, each
rule written here once (the dtype it is stored in, its context, its heads' width, whether MLX packed it), and the
facts every format's record is checked for once, where it is made (`check_facts`)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime.errors import NpumoeError

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# auto: the checkpoint's own dtype, or float32 where this host emulates it (`compute_dtype.auto_dtype_for`)
DTYPE_CHOICES = ("auto", *DTYPES)
# sizes that must be positive integers where given: transformers takes others and fails later, deep inside, or (a
# layer count in the billions) builds for ever; a context of 0 is no context (not "not given")
CONFIG_SIZES = ("num_hidden_layers", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "num_experts", "num_local_experts", "num_experts_per_tok",
                "vocab_size", "max_position_embeddings")
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


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


def check_facts(config: dict, where: str, keys: dict[str, str] | None = None) -> None:
    """The facts of a model's config that every command relies on, checked once where its record is made, for
    every format (a folder's config.json, an MLX folder's, the config a GGUF file's metadata gives): its sizes
    positive integers (`CONFIG_SIZES`; the context too) and its top-k within its experts (a router cannot pick 32
    of 16: torch's topk and mlx-lm's argpartition fail deep inside the first forward). `keys` names each field as the
    file spells it (a GGUF file's metadata keys); each failure one line naming `where` and the field."""
    def named(field: str) -> str:
        return (keys or {}).get(field, field)

    for part in (config, text_config(config)):
        for name in CONFIG_SIZES:
            value = part.get(name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise NpumoeError(f"{where}: {named(name)} must be a positive integer, got {value!r}")
        counts = [name for name in EXPERT_COUNTS if isinstance(part.get(name), int)]
        top_k = part.get("num_experts_per_tok")
        if counts and isinstance(top_k, int) and top_k > part[counts[0]]:
            raise NpumoeError(f"{where}: {named('num_experts_per_tok')} {top_k} is more than the model's "
                              f"{part[counts[0]]} experts ({named(counts[0])}): a token cannot pick more experts "
                              "than there are")


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
