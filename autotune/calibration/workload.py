"""Turning a `--text` into the token ids a stage runs on: the one tokenisation every command uses."""
from __future__ import annotations

import torch

from autotune.calibration.texts import iter_text
from runtime.errors import NpumoeError


def encode(tokenizer: object, text: str) -> list[int]:
    """Token ids of `text` without special tokens (works for HF tokenizers and the random models' stand-in)."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def encode_text(tokenizer: object, text_spec: str, max_tokens: int | None) -> torch.Tensor:
    """Token ids (1-D, long) of the named text, cut to `max_tokens` when given. The text is read and tokenised
    piece by piece (whole lines) and reading stops once `max_tokens` are there, so a large file costs no more
    memory or time than the part of it that is used."""
    ids: list[int] = []
    for piece in iter_text(text_spec):
        ids += encode(tokenizer, piece)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) == 0:
        raise NpumoeError(f"--text {text_spec!r} holds no tokens")
    return torch.tensor(ids, dtype=torch.long)
