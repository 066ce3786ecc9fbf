"""Streaming detokenisation, linear in the output length (after mlx-lm's streaming detokenizers and TGI's).

Each new token decodes only a short window: the tokens since the last piece went out, after the few tokens before
them (their context: a byte-level BPE or SentencePiece token's text depends on its neighbours). The window's text
past its context is the new piece. A piece whose bytes end inside a multi-byte character (U+FFFD at its end) is
held back until the tokens that finish it arrive. Decoding the whole output again at every step would be quadratic.
"""
from __future__ import annotations

from collections.abc import Sequence

INCOMPLETE = "\ufffd"  # what a tokenizer decodes a trailing incomplete UTF-8 sequence to


class StreamingDetokenizer:
    """Feed token ids one at a time with `add`; each returns the text they add (possibly ""); `finish` returns
    what was held back. The pieces joined are `tokenizer.decode(all tokens, skip_special_tokens=True)`."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.context = 0  # where the window starts: the tokens before `shown` that give it its context
        self.shown = 0  # tokens whose text has gone out

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _tail(self) -> str:
        before = self._decode(self.tokens[self.context:self.shown]) if self.shown > self.context else ""
        window = self._decode(self.tokens[self.context:])
        return window[len(before):] if len(window) > len(before) else ""

    def add(self, token: int) -> str:
        self.tokens.append(token)
        piece = self._tail()
        if piece.endswith(INCOMPLETE):
            return ""
        self.context, self.shown = self.shown, len(self.tokens)
        return piece

    def finish(self) -> str:
        """The text held back at the end (a last incomplete character, as the tokenizer renders it)."""
        piece = self._tail()
        self.context = self.shown = len(self.tokens)
        return piece
