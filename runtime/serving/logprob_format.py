"""Log-probabilities as OpenAI writes them: `choices[].logprobs` of /v1/completions ({tokens, token_logprobs,
top_logprobs, text_offset}) and of /v1/chat/completions ({content: [{token, logprob, bytes, top_logprobs}]}).

Each token is written as its own decoded text (a token that ends inside a multi-byte character reads U+FFFD, as
in OpenAI's); `text_offset` counts characters of those texts from the start of the choice's text. A completion's
`top_logprobs` holds the chosen token beside the `logprobs` most likely (OpenAI: up to logprobs + 1 entries)."""
from __future__ import annotations

from functools import lru_cache

from runtime.logprobs import TokenLogprob


class LogprobFormat:
    """One response's log-probabilities (a stream's chunks continue its text offsets)."""

    def __init__(self, tokenizer: object, chat: bool) -> None:
        self.chat, self.offset = chat, 0
        self.text = lru_cache(maxsize=4096)(lambda token: tokenizer.decode([token]))

    def __call__(self, entries: list[TokenLogprob]) -> dict:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _completion(self, entries: list[TokenLogprob]) -> dict:
        tokens = [self.text(e.token) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.top is None else
                                 {self.text(e.token): e.logprob} | {self.text(i): lp for i, lp in e.top}
                                 for e in entries], "text_offset": offsets}

    def _chat(self, entries: list[TokenLogprob]) -> dict:
        def item(token: int, logprob: float) -> dict:
            text = self.text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {"content": [item(e.token, e.logprob) | {"top_logprobs": [item(i, lp) for i, lp in e.top]}
                            for e in entries], "refusal": None}
