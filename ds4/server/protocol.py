"""Row 4: the neutral request and event types shared by the dialect adapters and the worker (no torch).

A dialect adapter (openai.py, anthropic.py, responses.py) turns a validated body into one `Request`;
the worker answers with a stream of `Event`s: the ds4.dsml projection events (reasoning, content, tool
call start / argument fragments / end) plus the ones defined here (prompt accepted, prefill keepalive,
the final `Done`, or a `Failed`). Adapters turn events into their wire chunks.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from ds4.chat import Message
from ds4.config import DEFAULT_MIN_P, DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P
from ds4.dsml import (
    ContentDelta,
    ParsedMessage,
    ReasoningDelta,
    ReasoningEnd,
    ToolArgsDelta,
    ToolBlockEnd,
    ToolCallEnd,
    ToolCallStart,
    ToolParseError,
)

Finite = Annotated[float, Field(allow_inf_nan=False)]  # sampling knobs: NaN/inf are a 400
Dialect = Literal["chat", "completions", "messages", "responses"]
Finish = Literal["stop", "length", "tool_calls", "error"]

# Model aliases that only pick the thinking mode when no explicit control was given (§4.3).
MODEL_ID = "deepseek-v4-flash"
ALIAS_THINKING = {"deepseek-chat": False, "deepseek-reasoner": True}
EFFORT_HIGH = ("xhigh", "high", "medium", "low", "minimal")


class BadRequest(Exception):
    """A client error: HTTP `status` with one clear message (and extra error fields, e.g. context size)."""

    def __init__(self, message: str, status: int = 400, **extra: Any) -> None:
        super().__init__(message)
        self.message, self.status, self.extra = message, status, extra


@dataclass
class Sampling:
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    min_p: float = DEFAULT_MIN_P
    top_k: int = DEFAULT_TOP_K
    seed: int | None = None


@dataclass
class Request:
    """One generation request in dialect-free form. `prompt_text` is filled by `render` (handler side)."""

    dialect: Dialect
    model: str = MODEL_ID
    messages: list[Message] = field(default_factory=list)
    prompt: str | None = None  # /v1/completions raw prompt
    tools: list[str | Mapping[str, Any]] = field(default_factory=list)  # active schemas ([] if choice none)
    mode: str = "high"  # none | high | max (after the ctx gate)
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: int | None = None  # None: the server default
    stops: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    reasoning_summary: bool = False  # Responses: reasoning items opted in
    raw_json: bytes = b""
    # filled by the handler before queueing
    prompt_text: str = ""
    prompt_tokens: list[int] = field(default_factory=list)
    replay_stats: dict[str, int] = field(default_factory=dict)  # tool-call blocks: replayed / canonical

    @property
    def thinking(self) -> bool:
        return self.mode != "none"

    @property
    def id_prefix(self) -> str:
        return "toolu_" if self.dialect == "messages" else "call_"


# ---- events the worker emits (besides the ds4.dsml projection events) ------------------------


@dataclass(frozen=True)
class Started:
    """The prompt was synced: usage numbers known from here on."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Keepalive:
    """Nothing to send yet (long prefill); streaming handlers write an SSE comment."""


@dataclass(frozen=True)
class TextDelta:
    """Raw generated text (/v1/completions: no reasoning/DSML projection)."""

    text: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def cache_write_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)


@dataclass(frozen=True)
class Done:
    finish: Finish
    message: ParsedMessage
    usage: Usage
    raw_text: str  # the whole generated text (completions output; trace)


@dataclass(frozen=True)
class Failed:
    """The request failed in the worker (status 500 if nothing was sent yet; an SSE error event after)."""

    message: str
    status: int = 500


Event = (
    Started
    | Keepalive
    | TextDelta
    | Done
    | Failed
    | ReasoningDelta
    | ReasoningEnd
    | ContentDelta
    | ToolCallStart
    | ToolArgsDelta
    | ToolCallEnd
    | ToolBlockEnd
    | ToolParseError
)

_counter = itertools.count(1)
_counter_lock = threading.Lock()


def next_response_number() -> int:
    """The server-wide generation counter used in `chatcmpl-<n>` / `cmpl-<n>` ids (§4.4)."""
    with _counter_lock:
        return next(_counter)


# ---- thinking controls (§4.3), shared by every dialect ---------------------------------------


def effort_mode(effort: Any) -> str | None:
    """`reasoning_effort`-style value -> mode, None when absent/null; other strings are a 400."""
    if effort is None:
        return None
    if effort == "max":
        return "max"
    if effort == "none":
        return "none"
    if effort in EFFORT_HIGH:
        return "high"
    raise BadRequest(
        f"invalid reasoning effort {effort!r}: expected one of none, minimal, low, medium, high, xhigh, max"
    )


def thinking_flag(thinking: Any) -> bool | None:
    """`thinking`: a bool, or {type: enabled|disabled}; anything else is no control."""
    if isinstance(thinking, bool):
        return thinking
    if isinstance(thinking, Mapping):
        kind = thinking.get("type")
        if kind == "enabled":
            return True
        if kind == "disabled":
            return False
    return None


def resolve_mode(model: str, *, enabled: bool | None, effort: str | None, default: str = "high") -> str:
    """Combine the controls: disabled or effort none -> none; effort max -> max; else high. With no
    explicit control the model alias decides (deepseek-chat: none), else the server default (--nothink)."""
    if enabled is None and effort is None:
        if model not in ALIAS_THINKING:
            return default
        enabled = ALIAS_THINKING[model]
    if enabled is False or effort == "none":
        return "none"
    return "max" if effort == "max" else "high"


def text_of(content: Any, *, what: str) -> str:
    """A string, null, or an array of strings / {text} parts -> concatenated text (§4.4)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                out.append(part["text"])
        return "".join(out)
    raise BadRequest(f"{what} must be a string, null or an array of parts, got {type(content).__name__}")


def check_tool_results(messages: list[Message], *, dialect_label: str, what: str, retry: str) -> None:
    """Every tool result must answer a call replayed earlier in the same request (§4.6, §4.7): this
    server keeps no per-client conversation state, so a result for an unknown call cannot be placed."""
    seen: set[str] = set()
    for m in messages:
        seen.update(c.id for c in m.tool_calls if c.id)
        if m.role == "tool" and m.tool_call_id and m.tool_call_id not in seen:
            raise BadRequest(
                f"{dialect_label} continuation state is not available for {what} {m.tool_call_id}; "
                f"retry by replaying the full {retry} history"
            )


def stop_list(stop: Any, *, what: str = "stop") -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest(f"{what} must be a string or an array of strings")
    return [s for s in stop if s]
