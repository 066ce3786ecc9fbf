"""The HTTP face of the engine: FastAPI routes for the OpenAI API, the Anthropic Messages API (/v1/messages),
/health and /metrics.

Every refusal is an OpenAI error object (Anthropic's on /v1/messages) with a 4xx status: bad JSON and wrong
types (400), a missing or wrong key (401), an unknown model (404), a body past its bound (413), a full queue (429
with Retry-After). A client that
leaves, while it waits or while its stream runs, cancels its job: the worker stops at its next token.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from runtime.generation import DEFAULT_MAX_TOKENS
from runtime.serving import anthropic_schema as anthropic
from runtime.serving.engine import Engine, GenerationRequest, RequestError
from runtime.serving.engine_process import EngineProcess
from runtime.serving.logprob_format import LogprobFormat
from runtime.serving.metrics import HttpMetrics
from runtime.serving.openai_schema import ChatRequest, CompletionRequest, Reply, Sampling, error_object, usage
from runtime.serving.scheduler import Closed, Job, QueueFull

MAX_BODY_BYTES = 4 << 20  # a prompt as long as any context we serve, as JSON, with room to spare
DRAIN_BYTES = 64 << 20  # a refused body up to this size is read through so every client sees the 413
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the runtime's
DISCONNECT_POLL_S = 0.25  # how often a request that waits checks whether its client is still there
MESSAGES = "/v1/messages"
PATHS = ("/v1/models", "/v1/completions", "/v1/chat/completions", MESSAGES, "/health", "/metrics", "/openapi.json")
AnyEngine = Engine | EngineProcess  # the same methods, in this process or in its own
CLIENT_LEFT = 499  # the status recorded for a client that left before its answer (nginx's convention)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None, path: str = "") -> JSONResponse:
    """The refusal in the API of `path`: Anthropic's error object on /v1/messages, OpenAI's elsewhere."""
    body = anthropic.error_object(status, message) if path == MESSAGES else error_object(message, type_, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


class Guard:
    """ASGI middleware in front of every route: counts requests by endpoint and status, checks the API key (all
    but /health; `Authorization: Bearer K` or Anthropic's `x-api-key: K`) and bounds the body, before any
    parsing."""

    def __init__(self, app: object, metrics: HttpMetrics, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes
        self.key = api_key.encode() if api_key else None

    def _authorized(self, headers: dict) -> bool:
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), b"Bearer " + self.key)
        return hmac.compare_digest(headers.get(b"x-api-key", b""), self.key) or bearer

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [CLIENT_LEFT]

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal, receive = await self._check(scope, receive)
            if refusal is not None:
                return await refusal(scope, receive, counted)
            await self.app(scope, receive, counted)
        finally:
            path = scope["path"] if scope["path"] in PATHS else "other"
            self.metrics.requests.labels(path, str(status[0])).inc()

    async def _check(self, scope: dict, receive) -> tuple[Response | None, object]:
        headers, path = dict(scope["headers"]), scope["path"]
        if self.key and path != "/health" and not self._authorized(headers):
            return error_response(401, "a missing or wrong API key: send the header Authorization: Bearer <key> "
                                  "(or x-api-key: <key>)", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"}, path=path), receive
        too_big = error_response(413, f"the request body is past {self.max_body_bytes} bytes",
                                 code="request_too_large", path=path)
        declared = int(headers.get(b"content-length", b"0") or 0)
        if declared > self.max_body_bytes and (headers.get(b"expect", b"").lower() == b"100-continue"
                                               or declared > DRAIN_BYTES):
            return too_big, receive  # the client waits for our word before sending, or the body is past reading
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None, receive  # the client left; the route sees the disconnect
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                if more:
                    await _drain(receive, DRAIN_BYTES - len(body))
                return too_big, receive
        replayed = False

        async def replay() -> dict:  # the body once, then the client's own messages (its disconnect)
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return None, replay


async def _drain(receive, budget: int) -> None:
    """Read the rest of a refused body (up to `budget` bytes) and drop it: a client that sends its whole body
    before reading the answer (Python's urllib) would otherwise meet a closed socket (a broken pipe, a reset)
    instead of the 413."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        budget -= len(message.get("body", b""))


class Waiter:
    """A job's events for a route that answers once done; None once the client has left (checked at most every
    DISCONNECT_POLL_S, while events come and while none does)."""

    def __init__(self, job: Job, request: Request) -> None:
        self.job, self.request, self.checked = job, request, time.monotonic()

    async def next(self) -> object:
        get = asyncio.ensure_future(self.job.events.get())
        try:
            while True:
                done, _ = await asyncio.wait({get}, timeout=DISCONNECT_POLL_S)
                if time.monotonic() - self.checked >= DISCONNECT_POLL_S:
                    self.checked = time.monotonic()
                    if await self.request.is_disconnected():
                        return None
                if done:
                    return get.result()
        finally:
            get.cancel()


def parse(model: type[Sampling], body: bytes) -> Sampling:
    """The request body as `model` (JSON whatever the content type says); the first problem as a 400."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = [str(part) for part in first.get("loc", ())]
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        raise RequestError(400, f"{'.'.join(where) + ': ' if where else ''}{message}", where[0] if where else None,
                           first.get("type")) from None


def _usage(done: dict) -> dict:
    return usage(done["prompt_tokens"], done["completion_tokens"], done["cached_tokens"])


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def _stream(engine: AnyEngine, job: Job, prompt_tokens: int, reply: Reply,
                  include_usage: bool) -> AsyncIterator[str]:
    try:
        if reply.chat:
            yield _sse(reply.chunk(None))
        while (event := await job.events.get()) is not None:
            kind, value = event[:2]
            if kind == "text":
                yield _sse(reply.chunk(value, entries=event[2]))
            elif kind == "error":
                yield _sse(error_object(value.message, value.type, value.param, value.code))
                return
            elif kind == "done":
                yield _sse(reply.chunk(None, value["finish_reason"], value.get("unsent_logprobs"),
                                       npumoe=value["npumoe"]))
                if include_usage:
                    yield _sse(reply.usage_chunk(_usage(value), value["npumoe"]))
                yield _sse("[DONE]")
    finally:
        engine.cancel(job)  # a no-op once the job is done


def create_app(engine: AnyEngine, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The server's ASGI app over `engine` (in this process, or in its own). Its shutdown (after uvicorn's drain)
    stops the engine's worker."""
    http_metrics = HttpMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(engine.close, 10.0)

    app = FastAPI(title="npumoe", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.add_middleware(Guard, metrics=http_metrics, api_key=api_key, max_body_bytes=max_body_bytes)
    _add_error_handlers(app)
    app.include_router(_routes(engine, http_metrics))
    app.openapi = partial(_openapi, app.openapi)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal as an error object with its status (module docstring)."""

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, path=request.url.path)

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, exc: QueueFull) -> JSONResponse:
        return error_response(429, str(exc), "rate_limit_exceeded", code="queue_full",
                              headers={"Retry-After": str(exc.retry_after_s)}, path=request.url.path)

    @app.exception_handler(Closed)
    async def closed(request: Request, exc: Closed) -> JSONResponse:
        return error_response(503, "the server is shutting down", "server_error", code="shutting_down",
                              path=request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None,
                              path=request.url.path)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {exc}", "server_error", path=request.url.path)


def _routes(engine: AnyEngine, http_metrics: HttpMetrics) -> APIRouter:
    """The API's routes over `engine`: /health, /metrics, the OpenAI API and /v1/messages."""
    router, started = APIRouter(), int(time.time())

    @router.get("/health")
    async def health() -> dict:
        return engine.health()

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(http_metrics.render() + engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": engine.model_id, "object": "model", "created": started,
                                            "owned_by": "npumoe"}]}

    @router.post("/v1/completions", openapi_extra=_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = parse(CompletionRequest, await request.body())
        prompt = {"text": body.prompt} if isinstance(body.prompt, str) else {"ids": body.prompt}
        return await _respond_openai(engine, body, request, _reply(engine, False, body.logprobs),
                                     COMPLETION_MAX_TOKENS, {**prompt, "logprobs": body.logprobs, "echo": body.echo})

    @router.post("/v1/chat/completions", openapi_extra=_body(ChatRequest))
    async def chat(request: Request) -> Response:
        body = parse(ChatRequest, await request.body())
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await _respond_openai(engine, body, request, _reply(engine, True, logprobs), DEFAULT_MAX_TOKENS,
                                     {"messages": messages, "logprobs": logprobs})

    @router.post(MESSAGES, openapi_extra=_body(anthropic.MessagesRequest))
    async def messages(request: Request) -> Response:
        body = parse(anthropic.MessagesRequest, await request.body())
        job_request = GenerationRequest(body.max_tokens, body.temperature, body.top_p, body.seed,
                                        body.stop_sequences, messages=body.chat_messages())
        reply = anthropic.MessageReply(engine.model_id)

        def whole(done: dict) -> dict:
            return reply.message(done["text"], done["prompt_tokens"], done["completion_tokens"],
                                 done["finish_reason"], done["stop_sequence"], npumoe=done["npumoe"])
        stream = partial(_anthropic_stream, engine, reply=reply) if body.stream else None
        return await _respond(engine, body.model, request, job_request, whole, stream)

    return router


def _openapi(schema: Callable[[], dict]) -> dict:
    """FastAPI's schema with the request models' schemas, each with its own definitions, as components."""
    doc = schema()
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in (CompletionRequest, ChatRequest, anthropic.MessagesRequest):
        own = model.model_json_schema(ref_template=REF)
        components.update(own.pop("$defs", {}))
        components[model.__name__] = own
    return doc


REF = "#/components/schemas/{model}"


def _body(model: type) -> dict:
    """A route's request body in /openapi.json (the routes parse the body themselves, for OpenAI's errors)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": REF.format(model=model.__name__)}}}}}


def _reply(engine: AnyEngine, chat: bool, logprobs: int | None) -> Reply:
    fmt = LogprobFormat(engine.tokenizer, chat) if logprobs is not None else None
    return Reply(chat, engine.model_id, fmt)


async def _respond_openai(engine: AnyEngine, body: Sampling, request: Request, reply: Reply, default_max_tokens: int,
                          prompt: dict) -> Response:
    max_tokens = default_max_tokens if body.max_tokens is None else body.max_tokens
    job_request = GenerationRequest(max_tokens, body.temperature, body.top_p, body.seed, body.stop, **prompt)

    def whole(done: dict) -> dict:
        return reply.whole(done["text"], done["finish_reason"], _usage(done), done["npumoe"], done.get("logprobs"))
    stream = partial(_stream, engine, reply=reply, include_usage=body.include_usage) if body.stream else None
    return await _respond(engine, body.model, request, job_request, whole, stream)


async def _anthropic_stream(engine: AnyEngine, job: Job, input_tokens: int,
                            reply: anthropic.MessageReply) -> AsyncIterator[str]:
    """Anthropic's event sequence: message_start, content_block_start, ping, content_block_delta...,
    content_block_stop, message_delta, message_stop (an error event in place of the rest on a failure)."""
    try:
        for event in reply.opening(input_tokens):
            yield anthropic.sse(event)
        while (event := await job.events.get()) is not None:
            kind, value = event[:2]
            if kind == "text" and value:
                yield anthropic.sse(reply.delta(value))
            elif kind == "error":
                yield anthropic.sse(anthropic.error_object(value.status, value.message))
                return
            elif kind == "done":
                for closing in reply.closing(value["finish_reason"], value["stop_sequence"],
                                             value["completion_tokens"], value["npumoe"]):
                    yield anthropic.sse(closing)
    finally:
        engine.cancel(job)  # a no-op once the job is done


async def _respond(engine: AnyEngine, model: str, request: Request, job_request: GenerationRequest,
                   whole: Callable[[dict], dict],
                   stream: Callable[[Job, int], AsyncIterator[str]] | None) -> Response:
    """Queue the request and answer it: `whole(done figures)` as one JSON body, or `stream(job, prompt tokens)`
    as server-sent events once the job has its turn. A refusal (QueueFull, Closed, RequestError) is raised, by
    `submit` or as the job's first event, for the app's handlers to answer."""
    if model != engine.model_id:
        raise RequestError(404, f"the model {model!r} is not served here (this server serves "
                                f"{engine.model_id!r})", "model", "model_not_found")
    job = engine.submit(job_request, asyncio.get_running_loop())
    finished, waiter = False, Waiter(job, request)
    try:
        first = await waiter.next()  # ("start", prompt tokens) or ("error", ...) once the job has its turn
        if first is None:
            return Response(status_code=CLIENT_LEFT)
        if first[0] == "error":
            raise first[1]
        if stream is not None:
            finished = True  # the stream owns the job from here
            return StreamingResponse(stream(job, first[1]), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(engine.cancel, job))
        while (event := await waiter.next()) is not None:
            kind, value = event[:2]
            if kind == "error":
                raise value
            elif kind == "done":
                finished = True
                return JSONResponse(whole(value))
        return Response(status_code=CLIENT_LEFT)
    finally:
        if not finished:
            engine.cancel(job)
