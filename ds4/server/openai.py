"""Row 4: OpenAI Chat Completions and legacy Completions dialects (product.md §4.4, §4.5).

Request models (pydantic: they validate and they document /openapi.json), the adapter to the neutral
`Request`, the JSON bodies and the SSE chunk projection.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ds4.chat import Message
from ds4.dsml import (
    ContentDelta,
    ReasoningDelta,
    ToolArgsDelta,
    ToolCallStart,
    ToolParseError,
    api_arguments,
    json_compact,
)
from ds4.server import sse
from ds4.server.protocol import (
    MODEL_ID,
    BadRequest,
    Done,
    Event,
    Finite,
    Request,
    Sampling,
    Started,
    TextDelta,
    Usage,
    effort_mode,
    resolve_mode,
    stop_list,
    text_of,
    thinking_flag,
)

Content = str | list[str | dict[str, Any]] | None


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCall(_Loose):
    name: str
    arguments: str | dict[str, Any] | list[Any] | int | float | bool | None = None


class ToolCallIn(_Loose):
    id: str | None = None
    type: str | None = None
    function: FunctionCall


class ChatMessage(_Loose):
    role: str = "user"
    content: Content = None
    reasoning_content: Content = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDef(_Loose):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Loose):
    type: str = "function"
    function: FunctionDef


class StreamOptions(_Loose):
    include_usage: bool | None = None


class _Common(_Loose):
    model: str = MODEL_ID
    max_tokens: int | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    min_p: Finite | None = None
    top_k: int | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    thinking: bool | dict[str, Any] | None = None
    reasoning_effort: str | None = None
    think: bool | None = None
    stop: str | list[str] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[Any]


# ---- request -> neutral Request ------------------------------------------------------------------


def sampling_of(body: Any, mode: str, *, seed: bool = True, min_p: bool = True) -> Sampling:
    """Client knobs, ignored in thinking mode (§4.3)."""
    s = Sampling()
    if mode != "none":
        return s
    if body.temperature is not None:
        s.temperature = body.temperature
    if body.top_p is not None:
        s.top_p = body.top_p
    if body.top_k is not None:
        s.top_k = body.top_k
    if min_p and getattr(body, "min_p", None) is not None:
        s.min_p = body.min_p
    if seed and getattr(body, "seed", None) is not None and body.seed > 0:
        s.seed = body.seed
    return s


def _mode(body: _Common, default: str) -> str:
    enabled = thinking_flag(body.thinking)
    if enabled is None and body.think is not None:
        enabled = body.think
    return resolve_mode(
        body.model, enabled=enabled, effort=effort_mode(body.reasoning_effort), default=default
    )


def _max_tokens(*values: int | None) -> int | None:
    for v in values:
        if v is not None:
            return max(0, v)
    return None


def active_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[dict[str, Any]]:
    """The schemas the prompt shows: none when tool_choice is "none" (§2.1)."""
    if tool_choice in (None, "auto", "none", "required") or isinstance(tool_choice, dict):
        if tool_choice == "none" or (isinstance(tool_choice, dict) and tool_choice.get("type") == "none"):
            return []
        return list(tools or [])
    raise BadRequest(f"tool_choice={tool_choice!r} not supported: expected auto, none or required")


def parse_chat(body: ChatRequest, raw: dict[str, Any], default_mode: str = "high") -> Request:
    mode = _mode(body, default_mode)
    messages = []
    for m in body.messages:
        calls = [
            {
                "id": c.id or "",
                "name": c.function.name,
                "arguments": c.function.arguments
                if isinstance(c.function.arguments, str)
                else json_compact(c.function.arguments if c.function.arguments is not None else {}),
            }
            for c in m.tool_calls or []
        ]
        reasoning = text_of(m.reasoning_content, what="reasoning_content") if m.reasoning_content else None
        messages.append(
            Message(
                role=m.role,
                content=text_of(m.content, what="content"),
                reasoning=reasoning,
                tool_calls=calls,
                tool_call_id=m.tool_call_id,
                name=m.name,
            )
        )
    return Request(
        dialect="chat",
        model=body.model,
        messages=messages,
        tools=active_tools(raw.get("tools"), body.tool_choice),
        mode=mode,
        sampling=sampling_of(body, mode),
        max_tokens=_max_tokens(body.max_completion_tokens, body.max_tokens),
        stops=stop_list(body.stop),
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )


def parse_completion(body: CompletionRequest, default_mode: str = "high") -> Request:
    prompt = body.prompt
    if isinstance(prompt, list):
        prompt = next((p for p in prompt if isinstance(p, str)), None)
        if prompt is None:
            raise BadRequest("missing prompt: expected a string or an array with a string")
    mode = _mode(body, default_mode)
    return Request(
        dialect="completions",
        model=body.model,
        prompt=prompt,
        mode=mode,
        sampling=sampling_of(body, mode),
        max_tokens=_max_tokens(body.max_tokens),
        stops=stop_list(body.stop),
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )


# ---- responses -------------------------------------------------------------------------------


def usage_json(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": u.cached_tokens,
            "cache_write_tokens": u.cache_write_tokens,
        },
    }


def tool_calls_json(done: Done) -> list[dict[str, Any]]:
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": api_arguments(c.arguments)},
        }
        for c in done.message.calls
    ]


def chat_body(req: Request, rid: str, created: int, done: Done) -> dict[str, Any]:
    m = done.message
    message: dict[str, Any] = {"role": "assistant", "content": m.content}
    if m.reasoning:
        message["reasoning_content"] = m.reasoning
    if m.calls:
        message["tool_calls"] = tool_calls_json(done)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": req.model,
        "choices": [{"index": 0, "message": message, "finish_reason": done.finish}],
        "usage": usage_json(done.usage),
    }


def completion_body(req: Request, rid: str, created: int, done: Done) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": req.model,
        "choices": [{"text": done.raw_text, "index": 0, "finish_reason": done.finish}],
        "usage": usage_json(done.usage),
    }


class ChatStream:
    """Events -> `chat.completion.chunk` SSE lines (§4.4 order)."""

    def __init__(self, req: Request, rid: str) -> None:
        self.req, self.rid, self.created = req, rid, int(time.time())
        self.streamed_calls = 0
        self.voided = False

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> str:
        return sse.data(
            {
                "id": self.rid,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.req.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
        )

    def start(self) -> list[str]:
        return [self._chunk({"role": "assistant"})]

    def on(self, ev: Event) -> list[str]:
        if isinstance(ev, ReasoningDelta):
            return [self._chunk({"reasoning_content": ev.text})]
        if isinstance(ev, ContentDelta):
            return [self._chunk({"content": ev.text})]
        if isinstance(ev, ToolCallStart):
            self.streamed_calls += 1
            call = {
                "index": ev.index,
                "id": ev.id,
                "type": "function",
                "function": {"name": ev.name, "arguments": ""},
            }
            return [self._chunk({"tool_calls": [call]})]
        if isinstance(ev, ToolArgsDelta):
            return [
                self._chunk({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.fragment}}]})
            ]
        if isinstance(ev, ToolParseError):
            self.voided = True
        return []

    def finish(self, done: Done) -> list[str]:
        out = []
        if done.message.calls and (self.streamed_calls == 0 or self.voided):
            calls = [dict(c, index=i) for i, c in enumerate(tool_calls_json(done))]
            out.append(self._chunk({"tool_calls": calls}))
        out.append(self._chunk({}, done.finish))
        if self.req.include_usage:
            out.append(
                sse.data(
                    {
                        "id": self.rid,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.req.model,
                        "choices": [],
                        "usage": usage_json(done.usage),
                    }
                )
            )
        return [*out, sse.DONE]

    def error(self, message: str) -> list[str]:
        return [sse.event("error", {"error": {"message": message, "type": "server_error"}})]


class CompletionStream:
    """Events -> `text_completion` SSE lines (§4.5)."""

    def __init__(self, req: Request, rid: str) -> None:
        self.req, self.rid, self.created = req, rid, int(time.time())

    def _chunk(self, text: str, finish: str | None = None) -> str:
        return sse.data(
            {
                "id": self.rid,
                "object": "text_completion",
                "created": self.created,
                "model": self.req.model,
                "choices": [{"text": text, "index": 0, "finish_reason": finish}],
            }
        )

    def start(self) -> list[str]:
        return []

    def on(self, ev: Event) -> list[str]:
        return [self._chunk(ev.text)] if isinstance(ev, TextDelta) else []

    def finish(self, done: Done) -> list[str]:
        out = [self._chunk("", done.finish)]
        if self.req.include_usage:
            out.append(
                sse.data(
                    {
                        "id": self.rid,
                        "object": "text_completion",
                        "created": self.created,
                        "model": self.req.model,
                        "choices": [],
                        "usage": usage_json(done.usage),
                    }
                )
            )
        return [*out, sse.DONE]

    def error(self, message: str) -> list[str]:
        return [sse.event("error", {"error": {"message": message, "type": "server_error"}})]


def error_body(message: str, type_: str = "invalid_request_error", **extra: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, **extra}}


__all__ = ["ChatRequest", "ChatStream", "CompletionRequest", "CompletionStream", "Started"]
