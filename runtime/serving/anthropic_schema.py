"""The Anthropic Messages API (`POST /v1/messages`): its request model (pydantic, strict), the message, the stream's
events and the error objects, as Anthropic's own API writes them.

A request's `system` and `messages` (text content blocks) become the same message list the chat endpoint builds,
so the same greedy request gives the same text on both. Tools, images and extended thinking are refused."""
from __future__ import annotations

import json
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runtime.serving.openai_schema import MAX_SEED, MAX_STOP_CHARS

MAX_STOP_SEQUENCES = 16
UNSUPPORTED = ("tools", "tool_choice", "thinking", "container", "mcp_servers")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


class TextBlock(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


def text_blocks_only(content: object) -> object:
    """Refuse, naming it, a content block this server does not take (image, tool_use, tool_result, document...),
    before pydantic would try the content as a string and say only that."""
    if isinstance(content, list):
        for i, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"content block {i} is of type {kind!r}, which this server does not support "
                                 "(text blocks only)")
    return content


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    _text_only = field_validator("content", mode="before")(text_blocks_only)

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class MessagesRequest(BaseModel):
    """POST /v1/messages. `max_tokens` is required, as in Anthropic's API; `seed` is ours (Anthropic has none)."""
    model_config = ConfigDict(strict=True, extra="allow")
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES)
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False

    _text_only = field_validator("system", mode="before")(text_blocks_only)

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, stops: list[str]) -> list[str]:
        if any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop sequence holds 1 to {MAX_STOP_CHARS} characters")
        return stops

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> "MessagesRequest":
        for name in UNSUPPORTED:
            if (self.model_extra or {}).get(name) not in (None, []):
                raise ValueError(f"{name} is not supported by this server")
        return self

    def chat_messages(self) -> list[dict]:
        """The conversation as the chat endpoint's message list (the system prompt first)."""
        system = self.system if isinstance(self.system, str) or self.system is None else \
            "".join(b.text for b in self.system)
        head = [{"role": "system", "content": system}] if system else []
        return head + [{"role": m.role, "content": m.text} for m in self.messages]


def stop_reason(finish: str, stop_sequence: str | None) -> str:
    """The engine's finish ("stop": the end of text or a stop sequence; "length") as Anthropic names it."""
    return "max_tokens" if finish == "length" else "stop_sequence" if stop_sequence is not None else "end_turn"


def error_object(status: int, message: str) -> dict:
    """Anthropic's error body, its type from the HTTP status."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def sse(event: dict) -> str:
    """One server-sent event, named by its type as Anthropic's stream does."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


class MessageReply:
    """The response objects of one Messages request: one id for the message or its stream."""

    def __init__(self, model: str) -> None:
        self.model, self.id = model, f"msg_{uuid.uuid4().hex}"

    def message(self, text: str | None, input_tokens: int, output_tokens: int = 0, finish: str | None = None,
                stop_sequence: str | None = None, **extra: object) -> dict:
        """The whole message (`text` None: the stream's opening one, with no content yet)."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [] if text is None else [{"type": "text", "text": text}],
                "stop_reason": stop_reason(finish, stop_sequence) if finish else None, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}, **extra}

    def opening(self, input_tokens: int) -> list[dict]:
        """The stream's first events: message_start, content_block_start, ping."""
        return [{"type": "message_start", "message": self.message(None, input_tokens)},
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                {"type": "ping"}]

    @staticmethod
    def delta(text: str) -> dict:
        return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}

    @staticmethod
    def closing(finish: str, stop_sequence: str | None, output_tokens: int, npumoe: dict) -> list[dict]:
        """The stream's last events: content_block_stop, message_delta (stop reason, usage), message_stop."""
        return [{"type": "content_block_stop", "index": 0},
                {"type": "message_delta", "delta": {"stop_reason": stop_reason(finish, stop_sequence),
                                                    "stop_sequence": stop_sequence},
                 "usage": {"output_tokens": output_tokens}, "npumoe": npumoe},
                {"type": "message_stop"}]
