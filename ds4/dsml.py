"""Row 2: DSML tool calls (product.md §2), pure strings, no torch.

Contents, in file order:
  * JSON helpers: the §2.5 string escaping, compact serialization, raw top-level member splitting.
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
    return ToolCall(src["name"], args if isinstance(args, str) else json_compact(args), str(call.get("id") or ""))


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
