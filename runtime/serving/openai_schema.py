"""The OpenAI API's request models (pydantic, strict: a wrong type is an error, never coerced) and the response,
chunk and error objects the server writes.

Fields the server does not implement are refused when set to anything but their default (a client that asks for
penalties or tools learns it gets none); other unknown fields are ignored, as OpenAI's own server ignores them.
Log-probabilities are served: `logprobs` (0-5) and `echo` on completions, `logprobs` and `top_logprobs` (0-20) on
chat."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runtime.logprobs import TokenLogprob
from runtime.serving.logprob_format import LogprobFormat

MAX_STOP_SEQUENCES = 4  # OpenAI's bound
MAX_STOP_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 5  # OpenAI's bounds: alternatives per token on completions, on chat
MAX_TOP_LOGPROBS = 20

# field: its default; set to anything else, the request is refused (the server does not implement it)
UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
               "frequency_penalty": (None, 0, 0.0), "tools": (None, []), "tool_choice": (None, "none"),
               "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"})}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class Sampling(BaseModel):
    """What both endpoints take besides the prompt."""
    model_config = ConfigDict(strict=True, extra="allow")
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = Field(None, validate_default=True)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        if any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop sequence holds 1 to {MAX_STOP_CHARS} characters")
        return stops

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> "Sampling":
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise ValueError(f"{name} is not supported by this server")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(Sampling):
    """POST /v1/completions: `prompt` is text or token ids (one prompt: a list of one is taken as that prompt).
    `echo`: the prompt comes back before the completion, with its tokens' log-probabilities when `logprobs` is
    set; `max_tokens` 0 then scores the prompt alone."""
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @model_validator(mode="after")
    def _zero_needs_echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it is for echo (scoring the prompt)")
        return self

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request, got {len(prompt)}")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list) and min(prompt) < 0:
            raise ValueError("token ids are non-negative")
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(Sampling):
    """POST /v1/chat/completions. `max_completion_tokens` is the newer name of `max_tokens`."""
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _one_max(self) -> "ChatRequest":
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


def error_object(message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Reply:
    """The response objects of one request: one id and creation time for the whole response or stream.
    `logprobs`: how its log-probabilities are written (None: not asked for; `logprobs: null` in each choice)."""

    def __init__(self, chat: bool, model: str, logprobs: LogprobFormat | None = None) -> None:
        self.chat, self.model, self.logprobs = chat, model, logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict], **extra: object) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        return self.logprobs(entries or []) if self.logprobs is not None and entries is not None else None

    def whole(self, text: str, finish_reason: str, use: dict, npumoe: dict,
              entries: list[TokenLogprob] | None = None) -> dict:
        """The non-streaming response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self._logprobs(entries), "finish_reason": finish_reason}
            return self._object("chat.completion", [choice], usage=use, npumoe=npumoe)
        choice = {"index": 0, "text": text, "logprobs": self._logprobs(entries), "finish_reason": finish_reason}
        return self._object("text_completion", [choice], usage=use, npumoe=npumoe)

    def chunk(self, text: str | None, finish_reason: str | None = None, entries: list[TokenLogprob] | None = None,
              **extra: object) -> dict:
        """A streamed chunk: `text` (None: the chat's opening role delta), or the last one with its finish
        reason; `entries`: its tokens' log-probabilities."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if text is None and finish_reason is None else \
                {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(entries), "finish_reason": finish_reason}
            return self._object("chat.completion.chunk", [choice], **extra)
        choice = {"index": 0, "text": text or "", "logprobs": self._logprobs(entries), "finish_reason": finish_reason}
        return self._object("text_completion", [choice], **extra)

    def usage_chunk(self, use: dict, npumoe: dict) -> dict:
        """`stream_options.include_usage`: a last chunk with no choices and the request's usage."""
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=use,
                            npumoe=npumoe)
