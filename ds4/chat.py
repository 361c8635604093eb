"""DeepSeek V4 chat template: messages + tools + thinking mode -> prompt text (product.md §1.3-§1.8).

Pure strings, no torch. The server renders a conversation to ONE string (`render_chat_prompt`) and then
tokenizes it with `Tokenizer.encode_chat` (specials live). The CLI builds token ids piece by piece with
plain BPE (`encode_chat_prompt`, `append_message_ids`), so specials inside user text stay ordinary text.

The server template follows the official encoder (`encoding_dsv4.py`, thinking_mode "thinking"/"chat",
drop_thinking=True), with these deliberate differences, each asserted by a test in tests/test_chat.py:

  D1 System/developer hoisting. Every system or developer message, wherever it sits, is hoisted into one
     system block right after BOS (joined by "\\n\\n"). Official renders system text in place and renders
     `developer` as a user turn. (OpenAI clients use `developer` as the new name of `system`, and
     mid-conversation system messages would otherwise move the cache-relevant prefix.)
  D2 Tools before client system text. The block is `tools_prompt_block(tools) + "\\n\\n" + system`, where
     official writes `system + "\\n\\n" + tools`. The schemas are stable across requests while client
     system text changes, so the KV prefix shared between requests is longer (product.md §1.5 step 3).
     The tools text itself is ds4.dsml's (raw client schema bytes, ds4's string-escaping rules).
  D3 Reasoning is kept whenever tools are involved: tools given, or any assistant message with tool
     calls, or any tool result. Official keeps it only when tools are given. Agent clients often drop
     `tools` on a follow-up request; dropping the reasoning would rewrite the middle of the prompt and
     throw away the KV cache of the whole tool loop.
  D4 `</tool_result>` inside a tool result is written `&lt;/tool_result>` (official: no escaping), so a
     tool output cannot close its own result block early.
  D5 Unknown roles (e.g. `ipython`) are skipped; official raises.
  D6 Assistant tool calls replay the exact sampled DSML when the tool memory knows every call id (§2.7);
     otherwise ds4.dsml's canonical rendering (compact JSON for non-string values; official json.dumps
     puts spaces after `,` and `:`).

Where the ds4 snapshot itself differed from the official encoder and no caching/compatibility reason
exists, we follow the official encoder: consecutive user/tool messages form ONE user turn whose parts are
joined with "\\n\\n" (snapshot: a new `<｜User｜>` per user message, tool results glued with no separator),
tool results are ordered by the preceding assistant's call order, and an assistant message that does not
follow a user turn still carries its kept reasoning + `</think>`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ds4.dsml import ToolCall, ToolMemory, render_assistant_tool_calls, tools_prompt_block
from ds4.tokenizer import ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER, Tokenizer

ThinkMode = Literal["none", "high", "max"]
THINK_MODES: tuple[str, ...] = ("none", "high", "max")

# §1.3: Think Max is a text prefix right after BOS, and only applies with a context of at least 384Ki.
THINK_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
    "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
THINK_MAX_MIN_CTX = 393216

# §1.7: the fixed system text of /v1/completions prompts.
COMPLETIONS_SYSTEM = "You are a helpful assistant"

SYSTEM_ROLES = ("system", "developer")
TOOL_ROLES = ("tool", "function")
USER_ROLES = ("user", *TOOL_ROLES)


@dataclass
class Message:
    """One chat message in the neutral (dialect-free) form the server adapters produce.

    `tool_calls` items may be given as ds4.dsml.ToolCall or as mappings `{id, name, arguments}` (arguments:
    JSON text); they are normalised to ToolCall. Roles: system, developer, user, assistant, tool/function.
    Adapters split an Anthropic user message into one `user` message per text block and one `tool` message
    (with tool_call_id) per tool_result block, in block order; the renderer joins them into one user turn
    exactly as the official encoder joins its content blocks.
    """

    role: str
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        self.content = self.content or ""
        self.tool_calls = [_as_tool_call(c) for c in self.tool_calls or ()]


def _as_tool_call(call: ToolCall | Mapping[str, Any]) -> ToolCall:
    if isinstance(call, ToolCall):
        return call
    if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
        raise ValueError(f"tool call must be a ToolCall or {{id, name, arguments}}, got {call!r:.80}")
    args = call.get("arguments", "{}")
    if not isinstance(args, str):
        raise ValueError(f"tool call arguments must be JSON text, got {type(args).__name__}")
    return ToolCall(name=call["name"], arguments=args, id=str(call.get("id") or ""))


def check_mode(mode: str) -> ThinkMode:
    if mode not in THINK_MODES:
        raise ValueError(f"thinking mode must be one of {', '.join(THINK_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def effective_mode(mode: str, ctx: int | None) -> ThinkMode:
    """Think Max silently becomes high below THINK_MAX_MIN_CTX (§1.3). ctx=None: the caller already gated."""
    mode = check_mode(mode)
    if mode == "max" and ctx is not None and ctx < THINK_MAX_MIN_CTX:
        return "high"
    return mode


def assistant_prefix(mode: str) -> str:
    """What ends every prompt: `<｜Assistant｜>` then `<think>` (high/max) or `</think>` (none)."""
    return ASSISTANT + (THINK_START if check_mode(mode) != "none" else THINK_END)


# --------------------------------------------------------------------------------------------
# Server renderer (§1.5) and live tail (§1.8)
# --------------------------------------------------------------------------------------------


def render_chat_prompt(
    messages: Sequence[Message],
    tools: Sequence[str | Mapping[str, Any]] | None = None,
    mode: str = "high",
    *,
    ctx: int | None = None,
    tool_memory: ToolMemory | None = None,
    stats: dict[str, int] | None = None,
) -> str:
    """The whole prompt text of a chat request.

    tools: the active tool schemas (raw JSON text or objects); pass None/[] when tool_choice is "none".
    ctx: applies the Think Max gate. tool_memory: enables exact DSML replay. stats, when given, counts
    rendered tool-call blocks under "replayed" and "canonical".
    """
    mode = effective_mode(mode, ctx)
    system = [tools_prompt_block(tools)] if tools else []
    system += [m.content for m in messages if m.role in SYSTEM_ROLES]
    head = BOS + (THINK_MAX_PREFIX if mode == "max" else "") + "\n\n".join(system)
    walker = _Walker(messages, mode, bool(tools), tool_memory, stats)
    return head + walker.render(0, keep_all_reasoning=False)


def render_live_tail(
    messages: Sequence[Message],
    start: int,
    mode: str = "high",
    *,
    ctx: int | None = None,
    tools: Sequence[str | Mapping[str, Any]] | None = None,
    tool_memory: ToolMemory | None = None,
) -> str:
    """The suffix that continues a live session whose last assistant turn (messages[start-1]) was generated
    in place: EOS (never evaluated during decode), then messages[start:] by the §1.5 rules with reasoning
    always kept, then the assistant prefix. System messages in the tail are not rendered (hoisted)."""
    if not 0 < start <= len(messages) or messages[start - 1].role != "assistant":
        raise ValueError(f"live tail must start right after an assistant message, got start={start}")
    walker = _Walker(messages, effective_mode(mode, ctx), bool(tools), tool_memory, None)
    return EOS + walker.render(start, keep_all_reasoning=True)


class _Walker:
    """Renders the turns of a conversation after the system block."""

    def __init__(
        self,
        messages: Sequence[Message],
        mode: ThinkMode,
        tools_active: bool,
        tool_memory: ToolMemory | None,
        stats: dict[str, int] | None,
    ) -> None:
        # System roles are hoisted; unknown roles are invisible (D5), as if they were not in the list.
        self.index_map = [i for i, m in enumerate(messages) if m.role in USER_ROLES or m.role == "assistant"]
        self.msgs = [messages[i] for i in self.index_map]
        self.think = mode != "none"
        tool_context = tools_active or any(m.role in TOOL_ROLES or m.tool_calls for m in messages)  # D3
        self.keep_reasoning = tool_context
        self.last_user = max((i for i, m in enumerate(self.msgs) if m.role in USER_ROLES), default=-1)
        self.memory, self.stats = tool_memory, stats

    def render(self, start: int, keep_all_reasoning: bool) -> str:
        """Turns of the messages whose original index is >= start."""
        out: list[str] = []
        call_order: dict[str, int] = {}  # id -> position in the latest assistant's tool calls
        i, n = 0, len(self.msgs)
        while i < n:
            m, emit = self.msgs[i], self.index_map[i] >= start
            if m.role in USER_ROLES:
                j = i
                while j < n and self.msgs[j].role in USER_ROLES:
                    j += 1
                if emit:
                    out.append(USER + self._user_turn(self.msgs[i:j], call_order))
                    if j == n or self.msgs[j].role == "assistant":
                        keep = keep_all_reasoning or self.keep_reasoning or j - 1 >= self.last_user
                        out.append(ASSISTANT + (THINK_START if self.think and keep else THINK_END))
                i = j
                continue
            if m.role == "assistant":
                if m.tool_calls:
                    call_order = {c.id: k for k, c in enumerate(m.tool_calls) if c.id}
                if emit:
                    keep = keep_all_reasoning or self.keep_reasoning or i > self.last_user
                    out.append(self._assistant(m, keep))
            i += 1
        return "".join(out)

    def _user_turn(self, run: Sequence[Message], call_order: dict[str, int]) -> str:
        """One `<｜User｜>` turn: user texts and tool results, joined by blank lines; the tool results take
        the order of the preceding assistant's calls (a stable sort, unknown ids first, as official)."""
        parts = list(run)
        tool_parts = [m for m in run if m.role in TOOL_ROLES]
        if len(tool_parts) > 1 and call_order:
            ordered = iter(sorted(tool_parts, key=lambda m: call_order.get(m.tool_call_id or "", 0)))
            parts = [next(ordered) if m.role in TOOL_ROLES else m for m in run]
        return "\n\n".join(_tool_result(m.content) if m.role in TOOL_ROLES else m.content for m in parts)

    def _assistant(self, m: Message, keep: bool) -> str:
        thinking = (m.reasoning or "") + THINK_END if self.think and keep else ""
        calls = ""
        if m.tool_calls:
            calls, replayed = render_assistant_tool_calls(m.tool_calls, self.memory)  # D6
            if self.stats is not None:
                key = "replayed" if replayed else "canonical"
                self.stats[key] = self.stats.get(key, 0) + 1
        return thinking + m.content + calls + EOS


def _tool_result(content: str) -> str:
    return "<tool_result>" + content.replace("</tool_result>", "&lt;/tool_result>") + "</tool_result>"  # D4


# --------------------------------------------------------------------------------------------
# /v1/completions (§1.7)
# --------------------------------------------------------------------------------------------


def render_completion_prompt(prompt: str, mode: str = "high", *, ctx: int | None = None) -> str:
    mode = effective_mode(mode, ctx)
    prefix = THINK_MAX_PREFIX if mode == "max" else ""
    return BOS + prefix + COMPLETIONS_SYSTEM + USER + prompt + assistant_prefix(mode)


# --------------------------------------------------------------------------------------------
# Engine-level encoding (§1.4): CLI one-shot, REPL transcript, eval, bench, test vectors
# --------------------------------------------------------------------------------------------


def chat_start_ids(
    tok: Tokenizer, system: str = "", mode: str = "high", *, ctx: int | None = None
) -> list[int]:
    """BOS, the Think-Max prefix (plain BPE) if max, then BPE(system): the start of a CLI transcript."""
    ids = [tok.bos_id]
    if effective_mode(mode, ctx) == "max":
        ids += tok.encode(THINK_MAX_PREFIX)
    return ids + tok.encode(system)


def assistant_prefix_ids(tok: Tokenizer, mode: str) -> list[int]:
    return [tok.assistant_id, tok.think_start_id if check_mode(mode) != "none" else tok.think_end_id]


def encode_chat_prompt(
    tok: Tokenizer, system: str, prompt: str, mode: str = "high", *, ctx: int | None = None
) -> list[int]:
    """BOS, [Think-Max], [system], User, prompt, Assistant, <think>|</think>; the texts are plain BPE."""
    mode = effective_mode(mode, ctx)
    return [
        *chat_start_ids(tok, system, mode),
        tok.user_id,
        *tok.encode(prompt),
        *assistant_prefix_ids(tok, mode),
    ]


def append_message_ids(tok: Tokenizer, ids: list[int], role: str, content: str) -> list[int]:
    """The REPL/agent incremental builder (ds4_chat_append_message); appends to `ids` and returns it."""
    if role in SYSTEM_ROLES:
        ids += tok.encode(content)
    elif role == "assistant":
        ids.append(tok.assistant_id)
        if not content.startswith((THINK_START, THINK_END)):
            ids.append(tok.think_end_id)
        ids += tok.encode(content)
    else:
        ids.append(tok.user_id)
        if role in TOOL_ROLES:
            ids += tok.encode("Tool: ")
        ids += tok.encode(content)
    return ids
