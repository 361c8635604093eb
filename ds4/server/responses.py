"""Row 4: OpenAI Responses dialect, POST /v1/responses (product.md §4.7; used by Codex CLI).

Deliberate difference from the snapshot: function-call arguments stream live
(`response.function_call_arguments.delta` per fragment), as the other dialects do.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from ds4.chat import Message
from ds4.dsml import (
    ContentDelta,
    ReasoningDelta,
    ReasoningEnd,
    ToolArgsDelta,
    ToolCall,
    ToolCallEnd,
    ToolCallStart,
    api_arguments,
    json_compact,
)
from ds4.server import sse
from ds4.server.openai import active_tools
from ds4.server.protocol import (
    MODEL_ID,
    BadRequest,
    Done,
    Event,
    Finite,
    Request,
    Sampling,
    Usage,
    check_tool_results,
    effort_mode,
    resolve_mode,
)

SUMMARY_OPT_IN = ("auto", "concise", "detailed")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_CALL_TYPES = {
    "function_call": None,
    "custom_tool_call": None,
    "local_shell_call": "local_shell",
    "web_search_call": "web_search_call",
    "tool_search_call": "tool_search",
    "image_generation_call": "image_generation_call",
}
_OUTPUT_TYPES = (
    "function_call_output",
    "custom_tool_call_output",
    "local_shell_call_output",
    "web_search_call_output",
    "tool_search_output",
    "tool_search_call_output",
    "image_generation_call_output",
)


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class Reasoning(_Loose):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Loose):
    input: str | list[dict[str, Any]]
    model: str = MODEL_ID
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = None
    max_tokens: int | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    stream: bool | None = False
    reasoning: Reasoning | None = None
    previous_response_id: str | None = None
    conversation: Any = None


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"message content must be a string or an array, got {type(content).__name__}")
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif (
            isinstance(part, dict)
            and part.get("type") in _TEXT_PARTS
            and isinstance(part.get("text"), str | None)
        ):
            out.append(part.get("text") or "")
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(f"unsupported message content part {kind!r}: only text parts are accepted")
    return "".join(out)


def _output_text(item: dict[str, Any]) -> str:
    body = next((item[k] for k in ("output", "result", "tools") if k in item), "")
    if isinstance(body, str):
        return body
    if isinstance(body, list) and all(isinstance(p, dict) and "text" in p for p in body):
        return "".join(str(p.get("text") or "") for p in body)
    return json_compact(body)


def _messages(body: ResponsesRequest) -> list[Message]:
    items = (
        [{"type": "message", "role": "user", "content": body.input}]
        if isinstance(body.input, str)
        else body.input
    )
    out: list[Message] = [Message("system", body.instructions)] if body.instructions else []
    reasoning: list[str] = []

    def assistant() -> Message:
        if out and out[-1].role == "assistant" and not reasoning:
            return out[-1]
        m = Message("assistant", "", "".join(reasoning) or None)
        reasoning.clear()
        out.append(m)
        return m

    for item in items:
        kind = item.get("type", "message")
        if item.get("status") not in (None, "completed"):
            raise BadRequest(
                f"input item of type {kind!r} has status {item.get('status')!r}: expected completed"
            )
        if kind == "message":
            role = item.get("role", "user")
            if not isinstance(role, str):
                raise BadRequest("message role must be a string")
            if role == "assistant":
                m = assistant()
                if m.content or m.tool_calls:
                    m = Message("assistant", "")
                    out.append(m)
                m.content += _text(item.get("content"))
            else:
                if reasoning:
                    assistant()
                out.append(Message(role, _text(item.get("content"))))
        elif kind == "reasoning":
            for key in ("summary", "content"):
                parts = item.get(key) or []
                if isinstance(parts, list):
                    reasoning.extend(str(p.get("text") or "") for p in parts if isinstance(p, dict))
        elif kind in _CALL_TYPES:
            name = _CALL_TYPES[kind] or item.get("name")
            if not isinstance(name, str) or not name:
                raise BadRequest(f"{kind} item needs a name")
            if item.get("namespace"):
                name = str(item["namespace"]) + name
            args = next((item[k] for k in ("arguments", "input", "action") if k in item), "{}")
            args = args if isinstance(args, str) else json_compact(args)
            call_id = item.get("call_id") or item.get("id") or ""
            m = assistant()
            m.tool_calls.append(ToolCall(name=name, arguments=args, id=str(call_id)))
        elif kind in _OUTPUT_TYPES:
            if reasoning:
                assistant()
            out.append(Message("tool", _output_text(item), tool_call_id=item.get("call_id")))
        elif kind in ("compaction", "context_compaction"):
            continue
        else:
            raise BadRequest(f"unsupported input item type {kind!r}")
    if reasoning:
        assistant()
    return out


def _schemas(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Function tools in the chat-schema shape `{name, description, parameters}` (client order kept)."""
    out = []
    for t in tools or []:
        if t.get("type", "function") in ("function", "custom") and isinstance(t.get("name"), str):
            out.append({k: v for k, v in t.items() if k != "type"})
    return out


def parse_responses(body: ResponsesRequest, raw: dict[str, Any], default_mode: str = "high") -> Request:
    for key in ("previous_response_id", "conversation"):
        if raw.get(key) is not None:
            raise BadRequest(f"{key} is not supported; replay full input instead")
    effort = effort_mode(body.reasoning.effort) if body.reasoning else None
    mode = resolve_mode(body.model, enabled=None, effort=effort, default=default_mode)
    sampling = Sampling()
    if mode == "none":
        sampling.temperature = body.temperature if body.temperature is not None else sampling.temperature
        sampling.top_p = body.top_p if body.top_p is not None else sampling.top_p
    limit = body.max_output_tokens if body.max_output_tokens is not None else body.max_tokens
    messages = _messages(body)
    check_tool_results(messages, dialect_label="Responses", what="call_id", retry="input")
    return Request(
        dialect="responses",
        model=body.model,
        messages=messages,
        tools=active_tools(_schemas(body.tools), body.tool_choice),
        mode=mode,
        sampling=sampling,
        max_tokens=None if limit is None else max(0, limit),
        stream=bool(body.stream),
        reasoning_summary=bool(body.reasoning and body.reasoning.summary in SUMMARY_OPT_IN),
    )


def _hex(n: int) -> str:
    return secrets.token_hex(n)


def usage_json(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": u.cached_tokens,
            "cache_write_tokens": u.cache_write_tokens,
        },
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _status(finish: str) -> str:
    return {"length": "incomplete", "error": "failed"}.get(finish, "completed")


class ResponsesStream:
    """Builds the output items while streaming; `body()` is the final response object (non-stream too)."""

    def __init__(self, req: Request, rid: str) -> None:
        self.req, self.rid, self.created = req, rid, int(time.time())
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.reasoning: dict[str, Any] | None = None
        self.message: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # stream call index -> item
        self.reasoning_text: list[str] = []
        self.text: list[str] = []
        self.reasoning_closed = False

    def _ev(self, type_: str, **fields: Any) -> str:
        obj = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse.data(obj)

    def _base(self, status: str) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.req.model,
            "output": [],
        }

    def start(self) -> list[str]:
        return [self._ev("response.created", response=self._base("in_progress"))]

    def _add(self, item: dict[str, Any]) -> str:
        self.items.append(item)
        return self._ev("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))

    def _close_reasoning(self, status: str = "completed") -> list[str]:
        r = self.reasoning
        if r is None or r["status"] != "in_progress":
            return []
        idx, text = self.items.index(r), "".join(self.reasoning_text)
        r["status"] = status
        r["summary"] = [{"type": "summary_text", "text": text}]
        return [
            self._ev(
                "response.reasoning_summary_text.done",
                item_id=r["id"],
                output_index=idx,
                summary_index=0,
                text=text,
            ),
            self._ev(
                "response.reasoning_summary_part.done",
                item_id=r["id"],
                output_index=idx,
                summary_index=0,
                part={"type": "summary_text", "text": text},
            ),
            self._ev("response.output_item.done", output_index=idx, item=r),
        ]

    def _close_message(self, status: str = "completed") -> list[str]:
        m = self.message
        if m is None or m["status"] != "in_progress":
            return []
        idx, text = self.items.index(m), "".join(self.text)
        part = {"type": "output_text", "text": text, "annotations": []}
        m["status"], m["content"] = status, [part]
        return [
            self._ev(
                "response.output_text.done", item_id=m["id"], output_index=idx, content_index=0, text=text
            ),
            self._ev(
                "response.content_part.done", item_id=m["id"], output_index=idx, content_index=0, part=part
            ),
            self._ev("response.output_item.done", output_index=idx, item=m),
        ]

    def _text(self, text: str) -> list[str]:
        out = self._close_reasoning()
        if self.message is None:
            self.message = {
                "id": "msg_" + _hex(12),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            out.append(self._add(self.message))
            out.append(
                self._ev(
                    "response.content_part.added",
                    item_id=self.message["id"],
                    output_index=len(self.items) - 1,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                )
            )
        self.text.append(text)
        idx = self.items.index(self.message)
        out.append(
            self._ev(
                "response.output_text.delta",
                item_id=self.message["id"],
                output_index=idx,
                content_index=0,
                delta=text,
            )
        )
        return out

    def on(self, ev: Event) -> list[str]:
        if isinstance(ev, ReasoningDelta):
            self.reasoning_text.append(ev.text)
            if not self.req.reasoning_summary:
                return []
            out = []
            if self.reasoning is None:
                self.reasoning = {
                    "id": "rs_" + _hex(12),
                    "type": "reasoning",
                    "status": "in_progress",
                    "summary": [],
                }
                out.append(self._add(self.reasoning))
                out.append(
                    self._ev(
                        "response.reasoning_summary_part.added",
                        item_id=self.reasoning["id"],
                        output_index=len(self.items) - 1,
                        summary_index=0,
                        part={"type": "summary_text", "text": ""},
                    )
                )
            idx = self.items.index(self.reasoning)
            out.append(
                self._ev(
                    "response.reasoning_summary_text.delta",
                    item_id=self.reasoning["id"],
                    output_index=idx,
                    summary_index=0,
                    delta=ev.text,
                )
            )
            return out
        if isinstance(ev, ReasoningEnd):
            self.reasoning_closed = True
            return self._close_reasoning()
        if isinstance(ev, ContentDelta):
            return self._text(ev.text)
        if isinstance(ev, ToolCallStart):
            out = self._close_reasoning() + self._close_message()
            item = {
                "id": "fc_" + _hex(12),
                "type": "function_call",
                "status": "in_progress",
                "name": ev.name,
                "call_id": ev.id,
                "arguments": "",
            }
            self.calls[ev.index] = item
            return [*out, self._add(item)]
        if isinstance(ev, ToolArgsDelta) and ev.index in self.calls:
            item = self.calls[ev.index]
            item["arguments"] += ev.fragment
            return [
                self._ev(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.items.index(item),
                    delta=ev.fragment,
                )
            ]
        if isinstance(ev, ToolCallEnd) and ev.index in self.calls:
            return self._close_call(self.calls[ev.index])
        return []

    def _close_call(self, item: dict[str, Any], arguments: str | None = None) -> list[str]:
        if item["status"] != "in_progress":
            return []
        idx = self.items.index(item)
        if arguments is not None:
            item["arguments"] = arguments
        item["status"] = "completed"
        return [
            self._ev(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=idx,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._ev("response.output_item.done", output_index=idx, item=item),
        ]

    def _apply(self, done: Done) -> list[str]:
        """Reconcile the streamed items with the final parse (authoritative for calls)."""
        status = "completed" if done.finish not in ("length", "error") else "incomplete"
        out = self._close_reasoning("completed" if self.reasoning_closed else "incomplete")
        m = done.message
        if m.error:  # tool-parse recovery: voided calls disappear, the raw text became content
            self.items = [i for i in self.items if i["type"] != "function_call"]
            self.calls = {}
            streamed = "".join(self.text)
            if m.content.startswith(streamed) and len(m.content) > len(streamed):
                out += self._text(m.content[len(streamed) :])
        out += self._close_message(status)
        by_id = {item["call_id"]: item for item in self.calls.values()}
        for c in m.calls:
            args = api_arguments(c.arguments)
            item = by_id.get(c.id)
            if item is None:
                item = {
                    "id": "fc_" + _hex(12),
                    "type": "function_call",
                    "status": "in_progress",
                    "name": c.name,
                    "call_id": c.id,
                    "arguments": "",
                }
                out.append(self._add(item))
                out.append(
                    self._ev(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self.items.index(item),
                        delta=args,
                    )
                )
            out += self._close_call(item, args)
        return out

    def body(self, done: Done) -> dict[str, Any]:
        resp = self._base(_status(done.finish))
        resp["output"] = [i for i in self.items if i["type"] != "reasoning" or self.req.reasoning_summary]
        if done.finish == "error":
            resp["error"] = {"code": "server_error", "message": "generation failed"}
        if done.finish == "length":
            resp["incomplete_details"] = {"reason": "max_tokens"}
        resp["usage"] = usage_json(done.usage)
        return resp

    def finish(self, done: Done) -> list[str]:
        out = self._apply(done)
        kind = {"length": "response.incomplete", "error": "response.failed"}.get(
            done.finish, "response.completed"
        )
        return [*out, self._ev(kind, response=self.body(done))]

    def error(self, message: str) -> list[str]:
        return [sse.event("error", {"error": {"message": message, "type": "server_error"}})]


def response_body(req: Request, rid: str, events: list[Event], done: Done) -> dict[str, Any]:
    """Non-streaming: replay the events through the stream builder and return the final object."""
    s = ResponsesStream(req, rid)
    for ev in events:
        s.on(ev)
    s._apply(done)
    return s.body(done)


def new_response_id() -> str:
    return "resp_" + _hex(12)


__all__ = ["ResponsesRequest", "ResponsesStream", "new_response_id", "parse_responses", "response_body"]
