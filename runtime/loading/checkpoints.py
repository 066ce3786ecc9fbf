"""Checks on a model directory's checkpoint before transformers reads it: safetensors only (no pickle), files
whole, config and weights in agreement. Each failure is one NpumoeError naming the file."""
from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError  # transformers 5 checks config fields with it

from runtime.errors import NpumoeError
from runtime.loading.model_config import check_facts

PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth", "model.ckpt")
CONVERT_HINT = ("convert it once, where you trust the file, with: python -c \"from transformers import "
                "AutoModelForCausalLM as M; M.from_pretrained('{d}').save_pretrained('{d}-safetensors')\"")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit on its JSON header


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's .safetensors files; refuses a directory that holds only pickled weights (torch.load runs
    code from the file: npumoe never loads one) or no weights at all."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            return sorted({path / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise NpumoeError(f"{index}: not a safetensors index ({e.__class__.__name__}: {str(e)[:80]})") from None
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    pickled = [n for n in PICKLE_NAMES if (path / n).exists()]
    if pickled:
        raise NpumoeError(f"{path / pickled[0]}: a pickle checkpoint; npumoe loads safetensors only: "
                          + CONVERT_HINT.format(d=path))
    raise NpumoeError(f"{path}: no model.safetensors (or model.safetensors.index.json) beside config.json")


def safetensors_header(file: Path) -> dict:
    """The tensor table of a .safetensors file, after checking that the file holds every byte it names (a
    truncated download or a copy cut short fails here, in one line, instead of deep inside a load)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise NpumoeError(f"{file}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise NpumoeError(f"{file}: not a safetensors file, or truncated (header of {n} bytes, file of "
                                  f"{size})")
            header = json.loads(f.read(n))
    except OSError as e:
        raise NpumoeError(f"{file}: cannot read: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError):
        raise NpumoeError(f"{file}: not a safetensors file (its header is not JSON)") from None
    try:
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise NpumoeError(f"{file}: corrupt safetensors header (a tensor without data_offsets)") from None
    if 8 + n + end > size:
        raise NpumoeError(f"{file}: truncated safetensors file ({size} bytes; its header names {8 + n + end})")
    return header


def check_checkpoint(path: Path, config: dict) -> dict[Path, dict]:
    """Every safetensors file of the model directory `path` exists and is whole, and its `config` (config.json, read
    once by the caller) agrees with them (`check_config`); returns each file's tensor table."""
    headers = {}
    for file in safetensors_files(path):
        if not file.exists():
            raise NpumoeError(f"{file}: missing (named by {path / 'model.safetensors.index.json'})")
        headers[file] = safetensors_header(file)
    check_config(path, config, [k for header in headers.values() for k in header])
    return headers


# What transformers raises on a config.json it cannot build a model from (a value of another type, say): one line.
CONFIG_ERRORS = (OSError, ValueError, KeyError, RuntimeError, TypeError, AttributeError, IndexError, OverflowError,
                 ZeroDivisionError, StrictDataclassError)
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_config(path: Path, config: dict, tensor_names: list[str]) -> None:
    """`config` (path's config.json) holds the facts every format is checked for (`model_config.check_facts`) and
    the layer count of the weights (`tensor_names`: the checkpoint's tensors). Each failure names config.json and the
    field."""
    check_facts(config, str(path / "config.json"))
    stored = {int(m.group(1)) for k in tensor_names for m in [_LAYER_KEY.search(k)] if m}
    layers = config.get("num_hidden_layers")
    if stored and layers is not None and layers != max(stored) + 1:
        raise NpumoeError(f"{path}: config.json does not match the weights: num_hidden_layers {layers}, the "
                          f"safetensors files hold {max(stored) + 1} layers")


def check_finite(where: str, tensors: Iterable[tuple[str, object]]) -> None:
    """Weights that must hold numbers (`tensors`: name, torch tensor) do: a NaN or inf in a norm or a router makes
    every token's output one, with no error of its own (a file corrupt past its header)."""
    for name, tensor in tensors:
        if not bool(tensor.isfinite().all()):
            raise NpumoeError(f"{where}: {name} holds values that are not finite (NaN or inf): the checkpoint is "
                              "corrupt")


def check_tokenizer_files(path: Path) -> None:
    """Without its files transformers hands back an empty tokenizer that turns every text into no tokens."""
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise NpumoeError(f"{path}: no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}); copy them from the model's "
                          "release beside config.json")


def check_token_ids(model: object, ids: object) -> None:
    """Token ids past the embedding table (tokenizer files of another model) would fail deep inside the model."""
    rows = model.get_input_embeddings().num_embeddings
    top = int(ids.max())
    if top >= rows:
        name = getattr(model.config, "name_or_path", "") or "the model"
        raise NpumoeError(f"{name}: the tokenizer gave token id {top}, past the model's {rows}-row embedding: its "
                          "tokenizer files belong to another model")


def check_loading_info(path: Path, info: dict) -> None:
    """Weights the config asks for but the checkpoint lacks would be left randomly initialised: refuse."""
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise NpumoeError(f"{path}: config.json does not match the weights: {len(missing)} tensors missing from "
                          f"the safetensors files (first: {missing[0]})")


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers logs a multi-line load report before it raises on a mismatch; the one line is ours."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def load_error(path: Path, error: Exception) -> NpumoeError:
    """A transformers load failure as one line naming the checkpoint (a config that does not match its weights
    surfaces as a size mismatch here)."""
    first = (str(error).strip().splitlines() or [error.__class__.__name__])[0]
    if "mismatch" in str(error).lower():
        return NpumoeError(f"{path}: config.json does not match the weights in its safetensors files (tensor "
                           "shapes differ)")
    return NpumoeError(f"cannot load model from {path}: {first[:300]}")
