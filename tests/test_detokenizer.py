"""The streaming detokenizer: its pieces are the whole decode, multi-byte characters are never split, and the work
is linear in the output (decode calls and decoded characters counted over 2,000 generated tokens)."""
import dataclasses

import pytest

import runtime
from runtime.detokenizer import StreamingDetokenizer
from runtime.loading.model_loader import load_model

TEXT = "Grüße aus Zürich: 日本語のテキスト, emoji 🎉🚀 and plain ASCII.\n" * 20


class CountingTokenizer:
    """A tokenizer that counts its decode calls and the characters they return."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer, self.calls, self.chars = tokenizer, 0, 0

    def decode(self, ids, **kwargs) -> str:
        text = self.tokenizer.decode(ids, **kwargs)
        self.calls += 1
        self.chars += len(text)
        return text

    def __getattr__(self, name: str) -> object:
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("tiny-moe", "float32")[1]


def test_pieces_are_the_decode_and_no_character_is_split(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.splitlines()[0])  # byte-level: several tokens for some characters
    detokenizer = StreamingDetokenizer(tokenizer)
    pieces = [detokenizer.add(t) for t in ids] + [detokenizer.finish()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # some tokens end inside a character: held back


def test_a_trailing_incomplete_character_comes_out_at_the_finish(tokenizer):
    ids = tokenizer.encode("ab🎉", add_special_tokens=False)
    detokenizer = StreamingDetokenizer(tokenizer)
    pieces = [detokenizer.add(t) for t in ids[:-1]]
    assert "".join(pieces) == "ab" and detokenizer.finish() == tokenizer.decode(ids[:-1])[2:]


@pytest.mark.slow
def test_generating_2000_tokens_decodes_linearly():
    loaded = runtime.load("tiny-moe", dtype="float32")
    counting = CountingTokenizer(loaded.tokenizer)
    result = runtime.generate(dataclasses.replace(loaded, tokenizer=counting), "def fibonacci(n):", max_tokens=2000,
                              temp=1.0, seed=1)
    n, chars = result.generated_tokens, len(result.text)
    assert n == 2000 and result.text == loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    # two short windows per token; decoding the whole output each step would be ~n * chars / 2 characters
    assert counting.calls <= 2 * n + 2
    assert counting.chars <= 4 * chars, (counting.chars, chars)
