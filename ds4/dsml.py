"""Row 2: DSML tool calls (product.md §2), pure strings, no torch.

Contents, in file order:
  * JSON helpers: the §2.5 string escaping, compact serialization, raw top-level member splitting,
    `api_arguments` (the §2.5 API form of arguments).
  * `tools_prompt_block`: the verbatim tools section of the system block (§2.1).
  * `render_tool_calls`: canonical JSON -> DSML rendering (§2.7).
  * `DsmlStream` / `parse_message`: the streaming projection (§2.11) and the final parse (§2.3), which is
    the same push parser fed the whole text, so the streamed deltas always add up to the final parse.
  * `DsmlTracker`: greedy-for-structure classification of the generation position (§2.8).
  * `ToolMemory`: exact-replay memory, tool id -> sampled DSML block, LRU bounded (§2.7).

Deliberate differences from the snapshot (product.md §9 allows fixing quirks; each is tested):
  * String values decode only the one documented entity, `&lt;/<family>parameter>`, not all five XML
    entities: the tools prompt forbids entity escapes, the official encoder never decodes them, and the
    canonical renderer never produces them, so `render -> parse` is lossless (`&amp;` stays `&amp;`).
  * Non-string values are buffered until their closing tag, then minified and validated, so the streamed
    arguments equal the final `arguments` byte for byte. An invalid non-string value becomes a JSON string
    of its raw text instead of corrupting the arguments object.
  * A parameter tag without `string` no longer stops the stream (quirk 9.6): the stream waits for the
    first non-blank body byte to choose between loose nested recovery and a string value.
  * The block starts at the earliest start marker of any family (what a stream can see), not at the most
    preferred family found anywhere. In thinking mode the split is at the first `</think>` and reasoning
    that never closes stays reasoning (the #509 fix), so a `</think>` inside a tool argument is harmless.
  * Parse failure keeps the reasoning split and returns the text after `</think>` verbatim as content
    (separator whitespace, block and everything after it), with `error` set; never an exception.
"""

from __future__ import annotations

import codecs
import json
import re
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ds4.config import TOOL_MEMORY_MAX_BYTES, TOOL_MEMORY_MAX_IDS

DSML = "｜DSML｜"
WS = " \t\n\r\v\f"  # C isspace(): the whitespace the parser skips and trims
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# ---------------------------------------------------------------------------------------------
# JSON helpers (§2.5)
# ---------------------------------------------------------------------------------------------

_JSON_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_JSON_ESCAPE_RE = re.compile(r'[\x00-\x1f"\\]')


def json_quote(text: str) -> str:
    """A JSON string literal with the §2.5 escaping: `"` `\\` \\n \\r \\t, other controls as \\u00XX.

    Non-ASCII stays raw and `/` is not escaped (unlike `json.dumps`, which also writes \\b and \\f).
    """
    return '"' + _JSON_ESCAPE_RE.sub(lambda m: _JSON_ESCAPES.get(m[0], f"\\u{ord(m[0]):04x}"), text) + '"'


def json_compact(value: Any) -> str:
    """Compact JSON of a Python value (dict order kept, no spaces, §2.5 string escaping)."""
    if isinstance(value, str):
        return json_quote(value)
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"JSON cannot hold the float {value!r}")
        return json.dumps(value)
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{json_quote(str(k))}:{json_compact(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(json_compact(v) for v in value) + "]"
    raise TypeError(f"cannot serialize {type(value).__name__} to JSON")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_JSON_WS = " \t\n\r"


def _skip(text: str, i: int, chars: str = _JSON_WS) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def split_json_object(text: str) -> list[tuple[str, str]] | None:
    """The top-level members of a JSON object text as (key, raw value text), in text order.

    Raw values keep their exact bytes (numbers are not reformatted). Returns None when `text` is not
    exactly one valid JSON object.
    """
    try:
        i = _skip(text, 0)
        if i >= len(text) or text[i] != "{":
            return None
        members: list[tuple[str, str]] = []
        i = _skip(text, i + 1)
        if i < len(text) and text[i] == "}":
            return members if _skip(text, i + 1) == len(text) else None
        while True:
            key, i = _DECODER.raw_decode(text, i)
            i = _skip(text, i)
            if not isinstance(key, str) or i >= len(text) or text[i] != ":":
                return None
            start = _skip(text, i + 1)
            _, end = _DECODER.raw_decode(text, start)
            members.append((key, text[start:end]))
            i = _skip(text, end)
            if i < len(text) and text[i] == ",":
                i = _skip(text, i + 1)
                continue
            if i < len(text) and text[i] == "}":
                return members if _skip(text, i + 1) == len(text) else None
            return None
    except (ValueError, RecursionError):
        return None


def minify_json(raw: str) -> str:
    """`raw` with JSON whitespace outside string literals removed (no validation, no reformatting)."""
    out: list[str] = []
    in_str = escaped = False
    for ch in raw:
        if in_str:
            out.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch not in _JSON_WS:
            out.append(ch)
            in_str = ch == '"'
    return "".join(out)


def api_arguments(arguments: str) -> str:
    """The §2.5 API form of arguments: top-level members in their order, string values re-escaped,
    other values minified, no spaces; `{}` when `arguments` is not a JSON object."""
    members = split_json_object(arguments)
    if members is None:
        return "{}"
    parts = []
    for key, raw in members:
        value = json_quote(json.loads(raw)) if raw.startswith('"') else minify_json(raw)
        parts.append(f"{json_quote(key)}:{value}")
    return "{" + ",".join(parts) + "}"


def is_valid_json(text: str) -> bool:
    try:
        _DECODER.decode(text)
    except (ValueError, RecursionError):
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Tools prompt block (§2.1)
# ---------------------------------------------------------------------------------------------

TOOLS_PROMPT_INTRO = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user question. "
    f'You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:\n\n'
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    'String parameters should be specified as raw text and set `string="true"`. '
    "Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters "
    "with XML or HTML entity escapes. Only if a string value itself contains the exact closing parameter "
    f"tag `</{DSML}parameter>`, write that tag as `&lt;/{DSML}parameter>` inside the value. "
    "For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_PROMPT_OUTRO = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. "
    "Use the exact parameter names from the schemas."
)


def tool_schema_line(tool: str | Mapping[str, Any]) -> str:
    """One schema line. A `str` is the client's raw JSON bytes of the schema and is used verbatim
    (byte-exact prompts need the raw text; the dialect adapters extract it). A mapping is serialized
    compactly: the `function` value of an OpenAI tool, otherwise the whole object (Anthropic style)."""
    if isinstance(tool, str):
        return tool
    if not isinstance(tool, Mapping):
        raise TypeError(f"tool schema must be a JSON object or its raw text, got {type(tool).__name__}")
    inner = tool.get("function")
    return json_compact(inner if isinstance(inner, Mapping) else tool)


def tools_prompt_block(tools: Sequence[str | Mapping[str, Any]]) -> str:
    """The verbatim tools section (§2.1): intro, one schema line per tool joined by newlines, outro."""
    return TOOLS_PROMPT_INTRO + "\n".join(tool_schema_line(t) for t in tools) + TOOLS_PROMPT_OUTRO


# ---------------------------------------------------------------------------------------------
# Canonical JSON -> DSML rendering (§2.7)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One tool call. `arguments` is JSON text; the parser produces a compact object in emission order."""

    name: str
    arguments: str
    id: str = ""


_PARAM_CLOSE = f"</{DSML}parameter>"
_ATTR_ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}
_ATTR_ENTITIES = {"amp": "&", "lt": "<", "gt": ">", "quot": '"', "apos": "'"}
_ATTR_ENTITY_RE = re.compile(r"&(amp|lt|gt|quot|apos);")


def escape_attr(text: str) -> str:
    return "".join(_ATTR_ESCAPES.get(ch, ch) for ch in text)


def unescape_attr(text: str) -> str:
    return _ATTR_ENTITY_RE.sub(lambda m: _ATTR_ENTITIES[m[1]], text)


def _escape_string_value(text: str) -> str:
    """Raw text; only the exact closing parameter tag gets its `<` written as `&lt;`."""
    return text.replace(_PARAM_CLOSE, "&lt;" + _PARAM_CLOSE[1:])


def _escape_json_value(raw_json: str) -> str:
    return raw_json.replace(_PARAM_CLOSE, "\\u003c" + _PARAM_CLOSE[1:])


def _as_call(call: ToolCall | Mapping[str, Any]) -> ToolCall:
    """Accepts ToolCall, OpenAI `{id, function:{name, arguments}}`, internal `{name, arguments}` and
    Anthropic `{id, name, input}`. Non-string arguments are serialized compactly in their dict order."""
    if isinstance(call, ToolCall):
        return call
    if not isinstance(call, Mapping):
        raise TypeError(f"tool call must be a ToolCall or a JSON object, got {type(call).__name__}")
    fn = call.get("function")
    src = fn if isinstance(fn, Mapping) else call
    if not isinstance(src.get("name"), str):
        raise ValueError(f"tool call needs a string name, got {src.get('name')!r}")
    args = src.get("arguments", src.get("input", "{}"))
    if args is None:
        args = "{}"
    return ToolCall(
        src["name"], args if isinstance(args, str) else json_compact(args), str(call.get("id") or "")
    )


def _canonical_params(arguments: str) -> list[tuple[str, str, bool]]:
    """(key, rendered value, is_string) in the client's member order."""
    members = split_json_object(arguments)
    if members is None:
        return [("arguments", _escape_string_value(arguments), True)]
    params = []
    for key, raw in members:
        if raw.startswith('"'):
            params.append((key, _escape_string_value(json.loads(raw)), True))
        else:
            params.append((key, _escape_json_value(minify_json(raw)), False))
    return params


def render_tool_calls(calls: Iterable[ToolCall | Mapping[str, Any]]) -> str:
    """Canonical DSML block for `calls`, starting with the "\\n\\n" separator, no trailing newline."""
    out = [f"\n\n<{DSML}tool_calls>\n"]
    for call in map(_as_call, calls):
        out.append(f'<{DSML}invoke name="{escape_attr(call.name)}">\n')
        for key, value, is_str in _canonical_params(call.arguments):
            flag = "true" if is_str else "false"
            out.append(f'<{DSML}parameter name="{escape_attr(key)}" string="{flag}">{value}{_PARAM_CLOSE}\n')
        out.append(f"</{DSML}invoke>\n")
    out.append(f"</{DSML}tool_calls>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Tag families (§2.2)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """One tag family: canonical `<｜DSML｜…>`, short `<DSML｜…>` or plain XML `<…>`."""

    name: str
    lead: str  # between "<" (or "</") and the tag word

    @property
    def calls_open(self) -> str:
        return f"<{self.lead}tool_calls>"

    @property
    def calls_close(self) -> str:
        return f"</{self.lead}tool_calls>"

    @property
    def invoke_open(self) -> str:
        return f"<{self.lead}invoke"

    @property
    def invoke_close(self) -> str:
        return f"</{self.lead}invoke>"

    @property
    def param_open(self) -> str:
        return f"<{self.lead}parameter"

    @property
    def param_close(self) -> str:
        return f"</{self.lead}parameter>"

    @property
    def param_close_escaped(self) -> str:
        """The one entity form a string value may contain (decoded back to `param_close`)."""
        return "&lt;" + self.param_close[1:]


FAMILIES = (Family("dsml", DSML), Family("short", DSML[1:]), Family("xml", ""))
_START_MARKERS = tuple(f.calls_open for f in FAMILIES)


def new_tool_id(prefix: str = "call_", taken: Callable[[str], bool] | None = None, nbytes: int = 16) -> str:
    """`prefix` + 2*nbytes lowercase hex (`call_`/`toolu_` + 32; Responses items: `fc_`, nbytes=12),
    retried while `taken(id)` says it is in use (§2.4)."""
    while True:
        tool_id = prefix + secrets.token_hex(nbytes)
        if taken is None or not taken(tool_id):
            return tool_id


def _partial_suffix(text: str, tokens: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tokens`."""
    firsts = {t[0] for t in tokens}
    for i in range(max(0, len(text) - max(len(t) for t in tokens) + 1), len(text)):
        if text[i] in firsts:  # cheap filter: every candidate starts with a token's first char
            tail = text[i:]
            if any(len(t) > len(tail) and t.startswith(tail) for t in tokens):
                return len(text) - i
    return 0


def _earliest(text: str, tokens: Sequence[str], start: int = 0) -> tuple[int, str | None]:
    best, found = -1, None
    for tok in tokens:
        pos = text.find(tok, start)
        if pos >= 0 and (best < 0 or pos < best):
            best, found = pos, tok
    return best, found


# ---------------------------------------------------------------------------------------------
# Stream events (what the server layer maps to OpenAI / Anthropic / Responses chunks)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ReasoningEnd:
    """`</think>` was seen (Anthropic: signature_delta + content_block_stop)."""


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolArgsDelta:
    """A fragment of the call's arguments JSON; the fragments of one call add up to its `arguments`."""

    index: int
    fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


@dataclass(frozen=True)
class ToolBlockEnd:
    """The block closed and parsed; with tools active the caller stops decoding (finish=tool_calls)."""

    raw_dsml: str


@dataclass(frozen=True)
class ToolParseError:
    """The block is invalid (§2.10): every ToolCall* event so far is void. The block's text, from the
    separator whitespace on, follows as ContentDelta, and so does everything generated after it."""

    message: str


Event = (
    ReasoningDelta | ReasoningEnd | ContentDelta | ToolCallStart | ToolArgsDelta | ToolCallEnd
    | ToolBlockEnd | ToolParseError
)  # fmt: skip


@dataclass
class ParsedMessage:
    """The final parse of one generated message (§2.3)."""

    reasoning: str | None  # None when thinking is off
    content: str
    calls: list[ToolCall] = field(default_factory=list)
    raw_dsml: str | None = None  # exact sampled block (with its leading "\n\n") when calls parsed
    error: str | None = None  # why the block was rejected; its text is then part of `content`
    reasoning_closed: bool = False  # `</think>` seen (thinking mode)
    block_started: bool = False  # a start marker was seen after the reasoning


class _Phase(Enum):
    THINK_START = "think_start"  # maybe skip a leading <think>
    REASONING = "reasoning"
    CONTENT = "content"
    BLOCK = "block"  # between invokes
    INVOKE_TAG = "invoke_tag"  # inside `<invoke ...` up to '>'
    PARAMS = "params"  # between parameters of an invoke (or of a loose nested object)
    PARAM_TAG = "param_tag"
    PARAM_PEEK = "param_peek"  # `string` missing: nested object or string value?
    STRING_VALUE = "string_value"
    JSON_VALUE = "json_value"
    DONE = "done"  # block closed: the rest is discarded
    FAILED = "failed"  # block rejected: the rest is content


_BLOCK_PHASES = {
    _Phase.BLOCK, _Phase.INVOKE_TAG, _Phase.PARAMS, _Phase.PARAM_TAG, _Phase.PARAM_PEEK,
    _Phase.STRING_VALUE, _Phase.JSON_VALUE,
}  # fmt: skip
_MAX_TAG = 4096  # a tag's attribute text longer than this is junk, not a tag still arriving
_ATTR_RE = re.compile(r'([A-Za-z_][\w:-]*)\s*=\s*"([^"]*)"')
_WAIT = object()  # _match(): the buffer may still become one of the tokens


class DsmlStream:
    """Push parser over the raw generated text (§2.11), producing `Event`s; `finish()` then `message`.

    Feed `str` pieces, or `bytes` (an incomplete UTF-8 tail is held). Any split gives the same events'
    concatenations: reasoning, content and each call's arguments. Hold-back: a possible `</think>` prefix
    in reasoning; in content, trailing whitespace and a possible start-marker prefix; in a string value, a
    possible closing tag or escaped-closing-tag prefix; non-string values until their closing tag.
    """

    def __init__(
        self,
        *,
        thinking: bool,
        id_prefix: str = "call_",
        taken: Callable[[str], bool] | None = None,
    ) -> None:
        self.thinking = thinking
        self._id_prefix = id_prefix
        self._taken = taken
        self._phase = _Phase.THINK_START if thinking else _Phase.CONTENT
        self._buf = ""  # unconsumed text of the current phase
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._out: list[Event] = []
        self._finished = False
        # block state
        self._family: Family = FAMILIES[0]
        self._sep = ""  # whitespace trimmed before the marker (content again if the block fails)
        self._raw_lead = ""  # "\n\n" when the marker followed one
        self._block: list[str] = []  # consumed block text from the marker on
        self._first = True  # no member yet in the current invoke's object
        self._nested = False  # inside a loose nested object
        self._nested_first = True
        self._scan = 0  # JSON_VALUE: where the closing-tag search resumes
        self._tail = ""  # FAILED: last bytes, to see the closing marker across pieces
        # results
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[tuple[str, str, list[str]]] = []  # (id, name, fragments)
        self._ids: set[str] = set()
        self._raw_dsml: str | None = None
        self._error: str | None = None
        self.reasoning_closed = False
        self.block_started = False
        self.block_ended = False  # start marker then its end marker seen (§2.9 stop rule)
        self._handlers: dict[_Phase, tuple[Callable[[bool], bool], bool]] = {
            phase: (getattr(self, "_on_" + phase.value), phase in _BLOCK_PHASES) for phase in _Phase
        }

    # ---- public API ----

    def feed(self, piece: str | bytes) -> list[Event]:
        if self._finished:
            raise ValueError("DsmlStream.feed() after finish()")
        if isinstance(piece, bytes):
            self._buf += self._utf8.decode(piece)
        elif self._utf8.getstate()[0]:
            raise ValueError("DsmlStream.feed(str) while an incomplete UTF-8 byte sequence is pending")
        else:
            self._buf += piece
        self._run(final=False)
        return self._drain()

    def finish(self) -> list[Event]:
        """Flush held text; an open block fails as `unterminated tool call`."""
        if not self._finished:
            self._buf += self._utf8.decode(b"", final=True)
            self._run(final=True)
            self._finished = True
        return self._drain()

    @property
    def in_block(self) -> bool:
        """Inside a started, not yet closed, not failed block (continued checkpoints are suppressed)."""
        return self._phase in _BLOCK_PHASES

    @property
    def message(self) -> ParsedMessage:
        if not self._finished:
            raise ValueError("DsmlStream.message before finish()")
        calls = [ToolCall(name, "".join(frags), tool_id) for tool_id, name, frags in self._calls]
        return ParsedMessage(
            reasoning="".join(self._reasoning) if self.thinking else None,
            content="".join(self._content),
            calls=calls,
            raw_dsml=self._raw_dsml,
            error=self._error,
            reasoning_closed=self.reasoning_closed,
            block_started=self.block_started,
        )

    # ---- plumbing ----

    def _drain(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _emit(self, ev: Event) -> None:
        if isinstance(ev, ReasoningDelta | ContentDelta) and not ev.text:
            return
        if isinstance(ev, ToolArgsDelta) and not ev.fragment:
            return
        self._out.append(ev)
        if isinstance(ev, ReasoningDelta):
            self._reasoning.append(ev.text)
        elif isinstance(ev, ContentDelta):
            self._content.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            self._calls.append((ev.id, ev.name, []))
        elif isinstance(ev, ToolArgsDelta):
            self._calls[ev.index][2].append(ev.fragment)

    def _id_taken(self, tool_id: str) -> bool:
        return tool_id in self._ids or bool(self._taken and self._taken(tool_id))

    def _args(self, fragment: str) -> None:
        self._emit(ToolArgsDelta(len(self._calls) - 1, fragment))

    def _take(self, n: int) -> str:
        """Consume `n` chars of block text (they become part of raw_dsml)."""
        text, self._buf = self._buf[:n], self._buf[n:]
        self._block.append(text)
        return text

    def _run(self, final: bool) -> None:
        # Block handlers never flush: at the end a block still waiting for input is unterminated.
        while True:
            handler, in_block = self._handlers[self._phase]
            if not handler(final and not in_block):
                break
        if final and self.in_block:
            self._fail("unterminated tool call")
            self._run(final)

    # ---- reasoning and content ----

    def _on_think_start(self, final: bool) -> bool:
        if self._buf.startswith(THINK_OPEN):
            self._buf = self._buf[len(THINK_OPEN) :]
        elif THINK_OPEN.startswith(self._buf) and not final:
            return False
        self._phase = _Phase.REASONING
        return True

    def _on_reasoning(self, final: bool) -> bool:
        pos = self._buf.find(THINK_CLOSE)
        if pos >= 0:
            self._emit(ReasoningDelta(self._buf[:pos]))
            self._emit(ReasoningEnd())
            self.reasoning_closed = True
            self._buf = self._buf[pos + len(THINK_CLOSE) :]
            self._phase = _Phase.CONTENT
            return True
        keep = 0 if final else _partial_suffix(self._buf, (THINK_CLOSE,))
        self._emit(ReasoningDelta(self._buf[: len(self._buf) - keep]))
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _on_content(self, final: bool) -> bool:
        pos, marker = _earliest(self._buf, _START_MARKERS)
        if marker is not None:
            before = self._buf[:pos]
            text = before.rstrip(WS)
            self._emit(ContentDelta(text))
            self._sep = before[len(text) :]
            self._raw_lead = "\n\n" if self._sep.endswith("\n\n") else ""
            self._family = FAMILIES[_START_MARKERS.index(marker)]
            self._buf = self._buf[pos:]
            self._take(len(marker))
            self.block_started = True
            self._phase = _Phase.BLOCK
            return True
        keep = 0
        if not final:
            held = len(self._buf) - _partial_suffix(self._buf, _START_MARKERS)
            keep = len(self._buf) - len(self._buf[:held].rstrip(WS))
        self._emit(ContentDelta(self._buf[: len(self._buf) - keep]))
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    # ---- block structure ----

    def _match(self, tokens: Sequence[str], final: bool) -> Any:
        """Skip whitespace, then the token the buffer starts with, _WAIT, or None (no match)."""
        ws = len(self._buf) - len(self._buf.lstrip(WS))
        if ws:
            self._take(ws)
        for tok in tokens:
            if self._buf.startswith(tok):
                return tok
        if not final and any(tok.startswith(self._buf) for tok in tokens):
            return _WAIT
        return None

    def _open_tag(self, tag: str, final: bool) -> Any:
        """An opening tag word must be followed by whitespace or '>' (so `<invokes>` is not `<invoke`)."""
        if len(self._buf) == len(tag):
            return None if final else _WAIT
        return tag if self._buf[len(tag)] in WS + ">" else None

    def _on_block(self, final: bool) -> bool:
        fam = self._family
        tok = self._match((fam.calls_close, fam.invoke_open), final)
        if tok == fam.invoke_open:
            tok = self._open_tag(tok, final)
        if tok is _WAIT:
            return False
        if tok is None:
            return self._fail(f"expected {fam.invoke_open} or {fam.calls_close}")
        self._take(len(tok))
        if tok == fam.calls_close:
            self._raw_dsml = self._raw_lead + "".join(self._block)
            self.block_ended = True
            self._emit(ToolBlockEnd(self._raw_dsml))
            self._phase = _Phase.DONE
        else:
            self._phase = _Phase.INVOKE_TAG
        return True

    def _tag_attrs(self) -> dict[str, str] | None | Any:
        """Attributes up to the first '>', _WAIT, or None when no '>' comes within _MAX_TAG chars
        (a fixed position, so the outcome does not depend on how the text was split)."""
        gt = self._buf.find(">", 0, _MAX_TAG)
        if gt < 0:
            return None if len(self._buf) >= _MAX_TAG else _WAIT
        attrs: dict[str, str] = {}
        for key, value in _ATTR_RE.findall(self._take(gt + 1)):
            attrs.setdefault(key, unescape_attr(value))
        return attrs

    def _on_invoke_tag(self, final: bool) -> bool:
        attrs = self._tag_attrs()
        if attrs is _WAIT:
            return False
        if attrs is None:
            return self._fail(f"invoke tag not closed within {_MAX_TAG} characters")
        if "name" not in attrs:
            return self._fail("invoke tag without a name")
        tool_id = new_tool_id(self._id_prefix, self._id_taken)
        self._ids.add(tool_id)
        self._emit(ToolCallStart(len(self._calls), tool_id, attrs["name"]))
        self._args("{")
        self._first, self._nested = True, False
        self._phase = _Phase.PARAMS
        return True

    def _on_params(self, final: bool) -> bool:
        fam = self._family
        if self._nested:
            tok = self._match((fam.param_open, fam.param_close), final)
            if tok == fam.param_open:
                tok = self._open_tag(tok, final)
            if tok is _WAIT:
                return False
            if tok != fam.param_open:  # end of the loose object; its own closing tag is optional
                if tok == fam.param_close:
                    self._take(len(tok))
                self._args("}")
                self._nested = False
                return True
        else:
            tok = self._match((fam.invoke_close, fam.param_open), final)
            if tok == fam.param_open:
                tok = self._open_tag(tok, final)
            if tok is _WAIT:
                return False
            if tok is None:
                return self._fail(f"expected {fam.param_open} or {fam.invoke_close}")
            if tok == fam.invoke_close:
                self._take(len(tok))
                self._args("}")
                self._emit(ToolCallEnd(len(self._calls) - 1))
                self._phase = _Phase.BLOCK
                return True
        self._take(len(fam.param_open))
        self._phase = _Phase.PARAM_TAG
        return True

    def _on_param_tag(self, final: bool) -> bool:
        attrs = self._tag_attrs()
        if attrs is _WAIT:
            return False
        if attrs is None:
            return self._fail(f"parameter tag not closed within {_MAX_TAG} characters")
        if "name" not in attrs:
            return self._fail("parameter tag without a name")
        if self._nested:
            sep, self._nested_first = ("" if self._nested_first else ","), False
        else:
            sep, self._first = ("" if self._first else ","), False
        self._args(f"{sep}{json_quote(attrs['name'])}:")
        kind = attrs.get("string")
        if kind is None and not self._nested:
            self._phase = _Phase.PARAM_PEEK
        elif kind is None or kind.lower() == "true":
            self._args('"')
            self._phase = _Phase.STRING_VALUE
        else:
            self._scan = 0
            self._phase = _Phase.JSON_VALUE
        return True

    def _on_param_peek(self, final: bool) -> bool:
        """`string` missing: a body starting with a parameter tag is a loose nested object (§2.3)."""
        body = self._buf.lstrip(WS)
        opener = self._family.param_open
        if opener.startswith(body):  # blank, a partial tag, or the tag word still missing its next char
            return False
        if body.startswith(opener) and body[len(opener)] in WS + ">":
            self._take(len(self._buf) - len(body))
            self._args("{")
            self._nested, self._nested_first = True, True
            self._phase = _Phase.PARAMS
        else:
            self._args('"')
            self._phase = _Phase.STRING_VALUE
        return True

    def _on_string_value(self, final: bool) -> bool:
        fam = self._family
        pos = self._buf.find(fam.param_close)
        held = _partial_suffix(self._buf, (fam.param_close, fam.param_close_escaped))
        end = pos if pos >= 0 else len(self._buf) - held
        value = self._take(end)
        if value:
            self._args(json_quote(value.replace(fam.param_close_escaped, fam.param_close))[1:-1])
        if pos < 0:
            return False
        self._take(len(fam.param_close))
        self._args('"')
        self._phase = _Phase.PARAMS
        return True

    def _on_json_value(self, final: bool) -> bool:
        fam = self._family
        pos = self._buf.find(fam.param_close, self._scan)
        if pos < 0:
            self._scan = max(0, len(self._buf) - len(fam.param_close) + 1)
            return False
        raw = self._take(pos)
        self._take(len(fam.param_close))
        compact = minify_json(raw)
        if not is_valid_json(compact):
            compact = json_quote(raw.replace(fam.param_close_escaped, fam.param_close))
        self._args(compact)
        self._phase = _Phase.PARAMS
        return True

    # ---- after the block ----

    def _on_done(self, final: bool) -> bool:
        self._buf = ""  # text after the block is discarded (§2.3 step 5)
        return False

    def _on_failed(self, final: bool) -> bool:
        text, self._buf = self._buf, ""
        self._emit(ContentDelta(text))
        self._watch_close(text)
        return False

    def _watch_close(self, text: str) -> None:
        """Keep the §2.9 stop rule working after a failure: note the family's end marker."""
        close = self._family.calls_close
        window = self._tail + text
        if close in window:
            self.block_ended = True
        self._tail = window[-(len(close) - 1) :]

    def _fail(self, why: str) -> bool:
        """§2.10: void the calls; the block text so far becomes content, and so does what follows."""
        self._error = why
        self._emit(ToolParseError(why))
        self._calls.clear()
        self._tail = ""
        block = "".join(self._block)
        self._emit(ContentDelta(self._sep + block))
        self._watch_close(block)
        self._phase = _Phase.FAILED
        return True


def parse_message(
    text: str, *, thinking: bool, id_prefix: str = "call_", taken: Callable[[str], bool] | None = None
) -> ParsedMessage:
    """The final parse (§2.3) of a whole generated message; never raises on model output."""
    stream = DsmlStream(thinking=thinking, id_prefix=id_prefix, taken=taken)
    stream.feed(text)
    stream.finish()
    return stream.message


# ---------------------------------------------------------------------------------------------
# Greedy-for-structure tracker (§2.8)
# ---------------------------------------------------------------------------------------------


class TrackerState(Enum):
    OUTSIDE = "outside"  # no tool block yet, or it is closed
    STRUCTURAL = "structural"  # tags, between parameters, or a partial closing tag (>= 2 chars) pending
    STRING_BODY = "string_body"  # inside a string="true" value
    JSON_STRUCTURAL = "json_structural"  # inside a non-string value, outside a JSON string
    JSON_STRING = "json_string"  # inside a JSON string literal of a non-string value


class _Where(Enum):
    OUTSIDE = 0
    BETWEEN = 1  # structural text between tags
    TAG = 2  # inside `<...` up to '>'
    PEEK = 3  # after a parameter tag without `string`
    STRING = 4
    JSON = 5


_MAX_MARKER = max(len(m) for m in _START_MARKERS)


class DsmlTracker:
    """Forgiving classifier of the generation position; temperature is forced to 0 while structural.

    It never fails: unknown tags count as structure, and a string body ends at its closing tag only.
    It ignores thinking (the executability gate is the parser's job).
    """

    def __init__(self) -> None:
        self._where = _Where.OUTSIDE
        self._family = FAMILIES[0]
        self._win = ""  # recent text, to see markers and closing tags across pieces
        self._tag = ""
        self._in_str = self._escaped = False
        self.state = TrackerState.OUTSIDE

    @property
    def force_greedy(self) -> bool:
        return self.state in (TrackerState.STRUCTURAL, TrackerState.JSON_STRUCTURAL)

    def update(self, text_piece: str) -> TrackerState:
        rest = text_piece
        while rest:
            rest = self._step(rest)
        self.state = self._classify()
        return self.state

    def _classify(self) -> TrackerState:
        where = self._where
        if where == _Where.OUTSIDE:
            return TrackerState.OUTSIDE
        if where in (_Where.BETWEEN, _Where.TAG, _Where.PEEK):
            return TrackerState.STRUCTURAL
        if where == _Where.JSON and self._in_str:
            return TrackerState.JSON_STRING
        if _partial_suffix(self._win, (self._family.param_close,)) >= 2:
            return TrackerState.STRUCTURAL
        return TrackerState.STRING_BODY if where == _Where.STRING else TrackerState.JSON_STRUCTURAL

    def _step(self, text: str) -> str:
        """Consume a prefix of `text` in the current position; return the rest."""
        where = self._where
        if where == _Where.OUTSIDE:
            window = self._win + text
            pos, marker = _earliest(window, _START_MARKERS)
            if marker is None:
                self._win = window[-(_MAX_MARKER - 1) :]
                return ""
            self._family = FAMILIES[_START_MARKERS.index(marker)]
            return self._goto(_Where.BETWEEN, window[pos + len(marker) :])
        if where == _Where.BETWEEN:
            lt = text.find("<")
            return "" if lt < 0 else self._goto(_Where.TAG, text[lt:])
        if where == _Where.TAG:
            return self._tag_step(text)
        if where == _Where.PEEK:
            body = text.lstrip(WS)
            if not body:
                return ""
            return self._goto(_Where.TAG if body[0] == "<" else _Where.STRING, body)
        return self._value_step(text)

    def _goto(self, where: _Where, rest: str) -> str:
        self._where, self._win, self._tag = where, "", ""
        self._in_str = self._escaped = False
        return rest

    def _tag_step(self, text: str) -> str:
        room = _MAX_TAG - len(self._tag)  # a tag is at most _MAX_TAG chars, '>' included
        gt = text.find(">", 0, room)
        if gt < 0:
            if len(text) >= room:  # run-away tag: treat it as structural text
                return self._goto(_Where.BETWEEN, text[room:])
            self._tag += text
            return ""
        tag, rest = self._tag + text[: gt + 1], text[gt + 1 :]
        fam = self._family
        if tag == fam.calls_close:
            return self._goto(_Where.OUTSIDE, rest)
        if tag.startswith(fam.param_open) and tag[len(fam.param_open)] in WS + ">":
            kind = dict(_ATTR_RE.findall(tag)).get("string")
            if kind is None:
                return self._goto(_Where.PEEK, rest)
            return self._goto(_Where.STRING if kind.lower() == "true" else _Where.JSON, rest)
        return self._goto(_Where.BETWEEN, rest)

    def _value_step(self, text: str) -> str:
        close = self._family.param_close
        window = self._win + text
        pos = window.find(close)
        if pos >= 0:
            return self._goto(_Where.BETWEEN, window[pos + len(close) :])
        if self._where == _Where.JSON:
            for ch in text:
                if self._escaped:
                    self._escaped = False
                elif self._in_str and ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_str = not self._in_str
        self._win = window[-(len(close) - 1) :]
        return ""


# ---------------------------------------------------------------------------------------------
# Exact-replay memory (§2.7)
# ---------------------------------------------------------------------------------------------


class ToolMemory:
    """tool id -> the exact sampled DSML block (with its leading "\\n\\n"), least recently used first out.

    All ids of one block share one stored string. Bounded by id count and by bytes (ids plus distinct
    blocks, UTF-8). `entries()`/`load()` carry the map to and from the disk cache's KTM trailer.
    """

    def __init__(self, max_ids: int = TOOL_MEMORY_MAX_IDS, max_bytes: int = TOOL_MEMORY_MAX_BYTES) -> None:
        if max_ids < 1 or max_bytes < 1:
            raise ValueError(
                f"tool memory limits must be positive, got max_ids={max_ids} max_bytes={max_bytes}"
            )
        self.max_ids, self.max_bytes = max_ids, max_bytes
        self._ids: OrderedDict[str, str] = OrderedDict()  # oldest first
        self._blocks: dict[str, list[Any]] = {}  # block -> [shared block string, id count]
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, tool_id: object) -> bool:
        return tool_id in self._ids

    def remember(self, ids: Iterable[str], raw_dsml: str) -> None:
        for tool_id in ids:
            self._put(tool_id, raw_dsml)
        self._prune()

    def lookup(self, tool_id: str) -> str | None:
        block = self._ids.get(tool_id)
        if block is not None:
            self._ids.move_to_end(tool_id)
        return block

    def replay(self, ids: Sequence[str]) -> str | None:
        """The block to emit verbatim: only if every id is known and all map to the same block."""
        blocks = [self.lookup(i) for i in ids]
        if not blocks or any(b is None for b in blocks) or len(set(blocks)) != 1:
            return None
        return blocks[0]

    def new_id(self, prefix: str = "call_") -> str:
        return new_tool_id(prefix, self.__contains__)

    def entries(self) -> list[tuple[str, str]]:
        """(id, block) pairs, oldest first (so `load` restores the same LRU order)."""
        return list(self._ids.items())

    def entries_in(self, text: str) -> list[tuple[str, str]]:
        """The entries whose block occurs verbatim in `text` (what a KV file with that text stores)."""
        hits = {block: block in text for block in {e[0] for e in self._blocks.values()}}
        return [(i, b) for i, b in self._ids.items() if hits[b]]

    def load(self, entries: Iterable[tuple[str, str]]) -> None:
        for tool_id, block in entries:
            if not isinstance(tool_id, str) or not isinstance(block, str):
                raise TypeError(f"tool memory entry must be (str, str), got ({tool_id!r:.40}, {block!r:.40})")
            self._put(tool_id, block)
        self._prune()

    def _put(self, tool_id: str, block: str) -> None:
        if tool_id in self._ids:
            self._drop(tool_id)
        slot = self._blocks.get(block)
        if slot is None:
            slot = self._blocks[block] = [block, 0]
            self.nbytes += len(block.encode())
        slot[1] += 1
        self._ids[tool_id] = slot[0]
        self.nbytes += len(tool_id.encode())

    def _drop(self, tool_id: str) -> None:
        block = self._ids.pop(tool_id)
        self.nbytes -= len(tool_id.encode())
        slot = self._blocks[block]
        slot[1] -= 1
        if slot[1] == 0:
            del self._blocks[block]
            self.nbytes -= len(block.encode())

    def _prune(self) -> None:
        while self._ids and (len(self._ids) > self.max_ids or self.nbytes > self.max_bytes):
            self._drop(next(iter(self._ids)))


def render_assistant_tool_calls(
    calls: Sequence[ToolCall | Mapping[str, Any]], memory: ToolMemory | None
) -> tuple[str, bool]:
    """The DSML for a replayed assistant message: the exact sampled block when every call id maps to
    one remembered block, else the canonical rendering. Returns (text, replayed_exactly)."""
    parsed = [_as_call(c) for c in calls]
    if memory is not None and parsed and all(c.id for c in parsed):
        block = memory.replay([c.id for c in parsed])
        if block is not None:
            return block, True
    return render_tool_calls(parsed), False
