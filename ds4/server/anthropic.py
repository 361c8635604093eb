"""Row 4: Anthropic Messages dialect, POST /v1/messages (product.md §4.6).

Deliberate difference from the snapshot: errors use Anthropic's own envelope
(`{"type":"error","error":{"type","message"}}`), which the official SDK and Claude Code parse.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ds4.chat import Message
from ds4.dsml import (
    ContentDelta,
    ReasoningDelta,
    ReasoningEnd,
    ToolArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    api_arguments,
    json_compact,
)
from ds4.server import sse
from ds4.server.openai import sampling_of
from ds4.server.protocol import (
    MODEL_ID,
    Done,
    Event,
    Finite,
    Request,
    Started,
    Usage,
    check_tool_results,
    effort_mode,
    resolve_mode,
    stop_list,
    text_of,
    thinking_flag,
)


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class Block(_Loose):
    type: str
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: Any = None


class AnthropicMessage(_Loose):
    role: str = "user"
    content: str | list[str | Block] | None = None


class AnthropicTool(_Loose):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class MessagesRequest(_Loose):
    model: str = MODEL_ID
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[str | dict[str, Any]] | None = None
    max_tokens: int | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: int | None = None
    stream: bool | None = False
    stop_sequences: list[str] | None = None
    thinking: bool | dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None


def _system_text(system: Any) -> str:
    """Parts joined by a newline (unless one already ends the previous part); `x-anthropic-` parts dropped."""
    parts = [system] if isinstance(system, str) else list(system or [])
    out = ""
    for p in parts:
        text = p if isinstance(p, str) else (p.get("text") if isinstance(p, dict) else None)
        if not isinstance(text, str) or text.startswith("x-anthropic-"):
            continue
        if out and not out.endswith("\n"):
            out += "\n"
        out += text
    return out


def _messages(body: MessagesRequest) -> list[Message]:
    out: list[Message] = []
    system = _system_text(body.system)
    if system:
        out.append(Message("system", system))
    for m in body.messages:
        blocks = [m.content] if isinstance(m.content, str) or m.content is None else m.content
        if m.role == "assistant":
            text, reasoning, calls = [], [], []
            for b in blocks:
                if isinstance(b, str) or b is None:
                    text.append(b or "")
                elif b.type == "text":
                    text.append(b.text or "")
                elif b.type == "thinking":
                    reasoning.append(b.thinking or "")
                elif b.type == "tool_use" and b.name:
                    args = json_compact(b.input if b.input is not None else {})
                    calls.append({"id": b.id or "", "name": b.name, "arguments": args})
            out.append(Message("assistant", "".join(text), "".join(reasoning) or None, calls))
            continue
        for b in blocks:  # user: one message per text block, one tool message per tool_result
            if isinstance(b, str) or b is None:
                out.append(Message(m.role, b or ""))
            elif b.type == "text":
                out.append(Message(m.role, b.text or ""))
            elif b.type == "tool_result":
                content = (
                    text_of(b.content, what="tool_result content") if not isinstance(b.content, dict) else ""
                )
                out.append(Message("tool", content, tool_call_id=b.tool_use_id))
    return out


def parse_messages(body: MessagesRequest, raw: dict[str, Any], default_mode: str = "high") -> Request:
    effort = effort_mode(body.reasoning_effort)
    if body.output_config and body.output_config.get("effort") is not None:
        effort = effort_mode(body.output_config.get("effort"))
    mode = resolve_mode(body.model, enabled=thinking_flag(body.thinking), effort=effort, default=default_mode)
    messages = _messages(body)
    check_tool_results(messages, dialect_label="Anthropic", what="tool_use_id", retry="messages")
    tools = raw.get("tools") or []
    if body.tool_choice and body.tool_choice.get("type") == "none":
        tools = []
    return Request(
        dialect="messages",
        model=body.model,
        messages=messages,
        tools=list(tools),
        mode=mode,
        sampling=sampling_of(body, mode, seed=False, min_p=False),
        max_tokens=None if body.max_tokens is None else max(0, body.max_tokens),
        stops=stop_list(body.stop_sequences, what="stop_sequences"),
        stream=bool(body.stream),
    )


STOP_REASON = {"tool_calls": "tool_use", "length": "max_tokens"}


def usage_json(u: Usage) -> dict[str, Any]:
    write = u.cache_write_tokens
    return {
        "input_tokens": max(0, u.prompt_tokens - u.cached_tokens - write),
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": write,
    }


def _input(arguments: str) -> Any:
    import json

    return json.loads(api_arguments(arguments))


def message_body(req: Request, rid: str, done: Done) -> dict[str, Any]:
    m = done.message
    content: list[dict[str, Any]] = []
    if m.reasoning:
        content.append({"type": "thinking", "thinking": m.reasoning, "signature": rid})
    if m.content:
        content.append({"type": "text", "text": m.content})
    for c in m.calls:
        content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)})
    if not content or all(b["type"] == "thinking" for b in content):
        content.append({"type": "text", "text": ""})
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": STOP_REASON.get(done.finish, "end_turn"),
        "stop_sequence": None,
        "usage": usage_json(done.usage),
    }


class MessagesStream:
    """Events -> Anthropic SSE events (§4.6 order); one open content block at a time."""

    def __init__(self, req: Request, rid: str) -> None:
        self.req, self.rid = req, rid
        self.index = -1
        self.open: str | None = None  # type of the open block
        self.sent_thinking = self.sent_text = False
        self.streamed_calls = 0

    def start(self) -> list[str]:
        return []

    def _open(self, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return [
            *out,
            sse.event(
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": block},
            ),
        ]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse.event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse.event(
            "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
        )

    def on(self, ev: Event) -> list[str]:
        if isinstance(ev, Started):
            u = usage_json(Usage(ev.prompt_tokens, 0, ev.cached_tokens))
            msg = {
                "id": self.rid,
                "type": "message",
                "role": "assistant",
                "model": self.req.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": u,
            }
            return [sse.event("message_start", {"type": "message_start", "message": msg})]
        out: list[str] = []
        if isinstance(ev, ReasoningDelta):
            if self.open != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
                self.sent_thinking = True
            out.append(self._delta({"type": "thinking_delta", "thinking": ev.text}))
        elif isinstance(ev, ReasoningEnd) and self.open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": self.rid}))
            out += self._close()
        elif isinstance(ev, ContentDelta):
            if self.open != "text":
                out += self._open({"type": "text", "text": ""})
                self.sent_text = True
            out.append(self._delta({"type": "text_delta", "text": ev.text}))
        elif isinstance(ev, ToolCallStart):
            self.streamed_calls += 1
            out += self._open({"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
        elif isinstance(ev, ToolArgsDelta) and self.open == "tool_use":
            out.append(self._delta({"type": "input_json_delta", "partial_json": ev.fragment}))
        elif isinstance(ev, ToolCallEnd):
            out += self._close()
        return out

    def finish(self, done: Done) -> list[str]:
        out = self._close()
        if self.streamed_calls == 0:
            for c in done.message.calls:
                out += self._open({"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
                out.append(
                    self._delta({"type": "input_json_delta", "partial_json": api_arguments(c.arguments)})
                )
                out += self._close()
        if not self.sent_text and not done.message.calls:
            out += self._open({"type": "text", "text": ""})
            out += self._close()
        delta = {"stop_reason": STOP_REASON.get(done.finish, "end_turn"), "stop_sequence": None}
        out.append(
            sse.event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": delta,
                    "usage": {"output_tokens": done.usage.completion_tokens},
                },
            )
        )
        out.append(sse.event("message_stop", {"type": "message_stop"}))
        return out

    def error(self, message: str) -> list[str]:
        return [sse.event("error", {"type": "error", "error": {"type": "api_error", "message": message}})]


def error_body(message: str, type_: str = "invalid_request_error", **extra: Any) -> dict[str, Any]:
    return {"type": "error", "error": {"type": type_, "message": message, **extra}}
