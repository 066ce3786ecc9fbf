"""Turning a `--text` into the token ids a stage runs on."""
from __future__ import annotations

import torch

from runtime.errors import NpumoeError

from .texts import read_text


def encode_text(tokenizer: object, text_spec: str, max_tokens: int | None) -> torch.Tensor:
    """Token ids (1-D, long) of the named text, cut to `max_tokens` when given."""
    ids = tokenizer.encode(read_text(text_spec))
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) == 0:
        raise NpumoeError(f"--text {text_spec!r} holds no tokens")
    return torch.tensor(ids, dtype=torch.long)
