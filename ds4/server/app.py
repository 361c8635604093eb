"""Row 4: the HTTP application (FastAPI on uvicorn): routing, validation, auth, CORS, SSE, metrics.

Handlers never touch the engine: they validate (pydantic models, which also document /openapi.json),
adapt the body to a neutral Request, render and tokenize the prompt (off the event loop), submit a Job to
the worker and turn its events into the dialect's JSON body or SSE stream. A streaming response sends a
`: keepalive` comment whenever nothing else was sent for `keepalive_s` (wall clock, prefill and decode);
a client that goes away sets the job's cancel flag, which the worker checks between prefill chunks and
before every token.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ds4.chat import render_chat_prompt, render_completion_prompt
from ds4.config import DEFAULT_CTX, SERVER_DEFAULT_MAX_TOKENS, SERVER_KEEPALIVE_S, SERVER_MAX_BODY_BYTES
from ds4.server import anthropic, openai, responses, sse
from ds4.server.protocol import (
    ALIAS_THINKING,
    MODEL_ID,
    BadRequest,
    Done,
    Event,
    Failed,
    Request,
    next_response_number,
)
from ds4.server.worker import Job, Worker

log = logging.getLogger("ds4.server")

MODEL_CREATED = 1767225600
SUPPORTED_PARAMETERS = [
    "tools",
    "tool_choice",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "stream",
    "reasoning_effort",
]


@dataclass
class ServerOptions:
    ctx: int = DEFAULT_CTX
    default_max_tokens: int = SERVER_DEFAULT_MAX_TOKENS
    max_tokens_limit: int | None = None  # a client max_tokens above this is clamped
    api_key: str | None = None
    cors: bool = False
    max_body_bytes: int = SERVER_MAX_BODY_BYTES
    keepalive_s: float = SERVER_KEEPALIVE_S
    exact_replay: bool = True
    model_id: str = MODEL_ID
    default_mode: str = "high"  # thinking mode of requests without a thinking control (--nothink: none)


def _is_anthropic(path: str) -> bool:
    return path.rstrip("/").endswith("/v1/messages")


def error_response(path: str, status: int, message: str, **extra: Any) -> JSONResponse:
    if _is_anthropic(path):
        body = anthropic.error_body(
            message, "invalid_request_error" if status < 500 else "api_error", **extra
        )
    else:
        body = openai.error_body(
            message, "invalid_request_error" if status < 500 else "server_error", **extra
        )
    return JSONResponse(body, status_code=status)


# ---------------------------------------------------------------------------------------------
# ASGI guard: body size, API key, CORS (runs before routing, so it also covers 404s)
# ---------------------------------------------------------------------------------------------

CORS_HEADERS = [
    (b"access-control-allow-origin", b"*"),
    (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
    (b"access-control-allow-headers", b"*"),
]


class _BodyTooLarge(Exception):
    pass


class Guard:
    def __init__(self, app: Any, opt: ServerOptions) -> None:
        self.app, self.opt = app, opt

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
    ) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}

        async def send_cors(message: dict[str, Any]) -> None:
            if self.opt.cors and message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), *CORS_HEADERS])
            await send(message)

        async def reply(resp: Response) -> None:
            await resp(scope, receive, send_cors)

        if scope["method"] == "OPTIONS":
            return await reply(Response(status_code=204))
        if self.opt.api_key and not self._authorized(headers) and path not in ("/health",):
            resp = error_response(
                path, 401, "invalid or missing API key: send Authorization: Bearer KEY or x-api-key"
            )
            return await reply(resp)
        limit = self.opt.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await reply(
                error_response(path, 413, f"request body is {length} bytes, the limit is {limit}")
            )
        seen = 0

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send_cors)
        except _BodyTooLarge:
            await reply(error_response(path, 413, f"request body exceeds the limit of {limit} bytes"))

    def _authorized(self, headers: dict[str, str]) -> bool:
        key = self.opt.api_key
        auth = headers.get("authorization", "")
        return auth == f"Bearer {key}" or headers.get("x-api-key") == key


# ---------------------------------------------------------------------------------------------
# The application
# ---------------------------------------------------------------------------------------------


def create_app(worker: Worker, opt: ServerOptions) -> Any:
    app = FastAPI(title="ds4-server", version="0.1.0", docs_url=None, redoc_url=None)
    tok = worker.tok

    @app.exception_handler(BadRequest)
    async def _bad(request: HttpRequest, exc: BadRequest) -> JSONResponse:
        return error_response(request.url.path, exc.status, exc.message, **exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, 400, _validation_message(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: HttpRequest, exc: HTTPException) -> JSONResponse:
        message = "unknown endpoint" if exc.status_code in (404, 405) else str(exc.detail)
        return error_response(request.url.path, 404 if exc.status_code == 405 else exc.status_code, message)

    @app.exception_handler(Exception)
    async def _crash(request: HttpRequest, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}")

    def model_json() -> dict[str, Any]:
        return {
            "id": opt.model_id,
            "object": "model",
            "created": MODEL_CREATED,
            "owned_by": "ds4",
            "name": "DeepSeek V4 Flash",
            "context_length": opt.ctx,
            "top_provider": {
                "context_length": opt.ctx,
                "max_completion_tokens": min(opt.default_max_tokens, opt.ctx),
                "is_moderated": False,
            },
            "supported_parameters": SUPPORTED_PARAMETERS,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_json()]}

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id not in _known_models(opt):
            raise BadRequest(
                f"model {model_id!r} does not exist: this server serves {opt.model_id!r}", status=404
            )
        return dict(model_json(), id=model_id)

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = worker.alive
        return JSONResponse({"status": "ok" if alive else "unavailable"}, status_code=200 if alive else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        return metrics_text(worker)

    @app.post("/v1/chat/completions")
    @_guarded
    async def chat(body: openai.ChatRequest, request: HttpRequest) -> Response:
        raw = await _raw(request)
        req = openai.parse_chat(body, raw, opt.default_mode)
        rid = f"chatcmpl-{next_response_number()}"
        return await _run(
            request,
            req,
            raw,
            lambda: openai.ChatStream(req, rid),
            lambda done, _: openai.chat_body(req, rid, int(time.time()), done),
        )

    @app.post("/v1/completions")
    @_guarded
    async def completions(body: openai.CompletionRequest, request: HttpRequest) -> Response:
        raw = await _raw(request)
        req = openai.parse_completion(body, opt.default_mode)
        rid = f"cmpl-{next_response_number()}"
        return await _run(
            request,
            req,
            raw,
            lambda: openai.CompletionStream(req, rid),
            lambda done, _: openai.completion_body(req, rid, int(time.time()), done),
        )

    @app.post("/v1/messages")
    @_guarded
    async def messages(body: anthropic.MessagesRequest, request: HttpRequest) -> Response:
        raw = await _raw(request)
        req = anthropic.parse_messages(body, raw, opt.default_mode)
        rid = f"chatcmpl-{next_response_number()}"
        return await _run(
            request,
            req,
            raw,
            lambda: anthropic.MessagesStream(req, rid),
            lambda done, _: anthropic.message_body(req, rid, done),
        )

    @app.post("/v1/responses")
    @_guarded
    async def responses_endpoint(body: responses.ResponsesRequest, request: HttpRequest) -> Response:
        raw = await _raw(request)
        req = responses.parse_responses(body, raw, opt.default_mode)
        rid = responses.new_response_id()
        return await _run(
            request,
            req,
            raw,
            lambda: responses.ResponsesStream(req, rid),
            lambda done, events: responses.response_body(req, rid, events, done),
        )

    async def _raw(request: HttpRequest) -> dict[str, Any]:
        raw = json.loads(await request.body())
        if not isinstance(raw, dict):
            raise BadRequest("invalid JSON request: the body must be a JSON object")
        try:
            json.dumps(raw, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise BadRequest(
                "invalid JSON request: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff)"
            ) from None
        return raw

    def _prepare(req: Request) -> None:
        """Render + tokenize (a worker-pool thread, not the event loop)."""
        if req.dialect == "completions":
            req.prompt_text = render_completion_prompt(req.prompt or "", req.mode, ctx=opt.ctx)
        else:
            ids = [c.id for m in req.messages for c in m.tool_calls] + [
                m.tool_call_id or "" for m in req.messages
            ]
            worker.seed_tool_memory(ids)
            with worker.memory_lock:
                memory = worker.memory if opt.exact_replay else None
                req.prompt_text = render_chat_prompt(
                    req.messages,
                    req.tools or None,
                    req.mode,
                    ctx=opt.ctx,
                    tool_memory=memory,
                    stats=req.replay_stats,
                )
        req.prompt_tokens = tok.encode_chat(req.prompt_text)

    async def _run(
        request: HttpRequest,
        req: Request,
        raw: dict[str, Any],
        make_stream: Callable[[], Any],
        make_body: Callable[[Done, list[Event]], dict[str, Any]],
    ) -> Response:
        if req.model not in _known_models(opt):
            raise BadRequest(
                f"model {req.model!r} does not exist: this server serves {opt.model_id!r}", status=404
            )
        if req.max_tokens is not None and opt.max_tokens_limit is not None:
            req.max_tokens = min(req.max_tokens, opt.max_tokens_limit)
        req.raw_json = json.dumps(raw, ensure_ascii=False).encode()
        try:
            await run_in_threadpool(_prepare, req)
        except ValueError as err:
            raise BadRequest(f"invalid request: {err}") from None
        n = len(req.prompt_tokens)
        if n >= opt.ctx:
            param = {"chat": "messages", "completions": "prompt", "responses": "input"}.get(
                req.dialect, "messages"
            )
            raise BadRequest(
                f"Prompt has {n} tokens, but the configured context size is {opt.ctx} tokens",
                **({} if req.dialect == "messages" else {"param": param, "code": "context_length_exceeded"}),
                n_prompt_tokens=n,
                n_ctx=opt.ctx,
            )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(ev: Event) -> None:  # worker thread -> this request's event loop
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the loop is closed (shutdown): nobody listens any more
                job.cancel.set()

        job = Job(req, emit=emit)
        try:
            worker.submit(job)
        except RuntimeError:
            raise BadRequest("server shutting down", status=503) from None
        if req.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(
                _stream(job, events, make_stream()), media_type="text/event-stream", headers=headers
            )
        return await _collect(request, job, events, make_body)

    async def _stream(job: Job, events: asyncio.Queue[Event], s: Any) -> AsyncIterator[str]:
        try:
            for chunk in s.start():
                yield chunk
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), opt.keepalive_s)
                except TimeoutError:
                    yield sse.KEEPALIVE
                    continue
                if isinstance(ev, Done):
                    for chunk in s.finish(ev):
                        yield chunk
                    return
                if isinstance(ev, Failed):
                    for chunk in s.error(ev.message):
                        yield chunk
                    return
                for chunk in s.on(ev):
                    yield chunk
        finally:
            job.cancel.set()  # the client went away (or we are done): stop generating for it

    async def _collect(
        request: HttpRequest,
        job: Job,
        events: asyncio.Queue[Event],
        make_body: Callable[[Done, list[Event]], dict[str, Any]],
    ) -> Response:
        seen: list[Event] = []
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), 0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        job.cancel.set()
                        return Response(status_code=499)
                    continue
                if isinstance(ev, Done):
                    return JSONResponse(make_body(ev, seen))
                if isinstance(ev, Failed):
                    return error_response(request.url.path, ev.status, ev.message)
                seen.append(ev)
        finally:
            job.cancel.set()

    return Guard(app, opt)


def _guarded(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """An unexpected error becomes a 500 JSON body in the dialect's shape (Starlette's own last-resort
    handler re-raises, which drops the connection)."""

    @functools.wraps(endpoint)
    async def inner(*args: Any, **kwargs: Any) -> Any:
        try:
            return await endpoint(*args, **kwargs)
        except (BadRequest, HTTPException, RequestValidationError):
            raise
        except Exception as err:
            log.exception("unhandled error")
            return error_response(kwargs["request"].url.path, 500, f"internal error: {type(err).__name__}")

    return inner


def _known_models(opt: ServerOptions) -> set[str]:
    return {opt.model_id, MODEL_ID, *ALIAS_THINKING}


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ())[1:]) or "body"
        if err.get("type") == "json_invalid":
            return "invalid JSON request: the body is not valid JSON"
        if loc == "body" and isinstance(err.get("input"), bytes | str):
            return "invalid JSON request: expected a JSON object body (Content-Type: application/json)"
        got = err.get("input")
        got_text = f" (got {type(got).__name__})" if "input" in err and not isinstance(got, dict) else ""
        parts.append(f"{loc}: {err.get('msg', 'invalid')}{got_text}")
    return "invalid request: " + "; ".join(parts)


def metrics_text(worker: Worker) -> str:
    m = worker.metrics
    rows = [
        ("ds4_requests_total", "counter", "generation requests served", m.requests_total),
        ("ds4_prompt_tokens_total", "counter", "effective prompt tokens", m.prompt_tokens_total),
        (
            "ds4_prefill_tokens_total",
            "counter",
            "tokens actually run through prefill",
            m.prefill_tokens_total,
        ),
        ("ds4_generated_tokens_total", "counter", "tokens generated", m.generated_tokens_total),
        ("ds4_kv_disk_hits_total", "counter", "disk KV cache hits", m.kv_disk_hits_total),
        ("ds4_kv_disk_misses_total", "counter", "disk KV cache misses", m.kv_disk_misses_total),
        (
            "ds4_cancelled_total",
            "counter",
            "generations stopped because the client went away",
            m.cancelled_total,
        ),
        ("ds4_queue_depth", "gauge", "jobs waiting for the worker", worker.queue_depth),
        ("ds4_prefill_tokens_per_second", "gauge", "prefill speed of the latest request", m.prefill_tps),
        ("ds4_decode_tokens_per_second", "gauge", "decode speed of the latest request", m.decode_tps),
        ("ds4_sessions", "gauge", "live session slots (--parallel)", len(worker.slots)),
        ("ds4_live_sessions", "gauge", "sessions holding a KV timeline", worker.live_sessions),
        ("ds4_busy_sessions", "gauge", "sessions serving a request now", worker.busy_sessions),
        ("ds4_evictions_total", "counter", "idle sessions taken over by another timeline", m.evictions_total),
    ]
    stats = getattr(worker.stepper, "stats", None)
    if stats is not None:
        rows += [
            ("ds4_decode_batch_last", "gauge", "decode tokens in the latest batched step", stats.last_batch),
            ("ds4_decode_batch_max", "gauge", "largest batched decode step so far", stats.max_batch),
            ("ds4_decode_steps_total", "counter", "batched decode steps", stats.decode_steps),
            ("ds4_decode_step_tokens_total", "counter", "tokens of decode steps", stats.decode_tokens),
        ]
    if worker.kv_budget is not None:
        b = worker.kv_budget
        rows += [
            ("ds4_kv_bytes_per_session", "gauge", "KV state bytes of one session", b.bytes_per_session),
            ("ds4_kv_bytes_total", "gauge", "KV bytes of all sessions", b.sessions * b.bytes_per_session),
        ]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(out) + "\n"
