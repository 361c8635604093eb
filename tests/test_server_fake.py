"""ds4-server end to end over real HTTP, with a scripted token source in place of the model.

The script goes through the real tokenizer, the worker's decode loop, the DSML streaming projection and
each dialect's wire format; clients are the official `openai` / `anthropic` SDKs and raw httpx.
"""

from __future__ import annotations

import json
import threading

import anthropic
import httpx
import openai
import pytest

from ds4.server.protocol import Request
from ds4.tokenizer import Tokenizer
from tests._server_util import fake_server

D = "｜DSML｜"
COMMAND = 'ls -la && echo "hi" 2>&1'
RAW_BLOCK = (
    f'\n\n<{D}tool_calls>\n<{D}invoke name="bash">\n'
    f'<{D}parameter name="command" string="true">{COMMAND}</{D}parameter>\n'
    f'<{D}parameter name="timeout" string="false">10</{D}parameter>\n'
    f"</{D}invoke>\n</{D}tool_calls>"
)
EXPECTED_ARGS = {"command": COMMAND, "timeout": 10}
REASONING = "I should list the files."
BASH_OPENAI = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}
BASH_ANTHROPIC = {"name": "bash", "description": "run a shell command", "input_schema": {"type": "object"}}
BASH_RESPONSES = {"type": "function", "name": "bash", "parameters": {"type": "object"}}


def script(req: Request) -> str:
    """Tool requests whose last message is not a tool result get a tool call; others an echo."""
    think = REASONING + "</think>" if req.thinking else ""
    last = req.messages[-1] if req.messages else None
    if req.tools and last is not None and last.role != "tool":
        return think + "Checking." + RAW_BLOCK
    said = last.content if last is not None else (req.prompt or "")
    return think + f"echo: {said}"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from ds4.tools.make_model import ensure_tiny_model

    return Tokenizer.from_gguf(ensure_tiny_model())


@pytest.fixture(scope="module")
def srv(tok: Tokenizer):
    with fake_server(tok, script, max_body_bytes=1 << 20) as server:
        yield server


def oai(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=30)


def claude(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base, api_key="x", max_retries=0, timeout=30)


# ---- SDK parsing, every endpoint ------------------------------------------------------------------


def test_openai_sdk_chat_and_completions(srv) -> None:
    c = oai(srv)
    r = c.chat.completions.create(model="deepseek-v4-flash", messages=[{"role": "user", "content": "hi"}])
    msg = r.choices[0].message
    assert msg.content == "echo: hi" and msg.model_extra["reasoning_content"] == REASONING
    assert (
        r.choices[0].finish_reason == "stop" and r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    )
    chunks = list(
        c.chat.completions.create(
            model="deepseek-chat",  # alias: thinking off
            messages=[{"role": "user", "content": "yo"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "echo: yo"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    comp = c.completions.create(model="deepseek-v4-flash", prompt="abc", max_tokens=50)
    assert comp.choices[0].text == f"{REASONING}</think>echo: abc" and comp.usage.total_tokens > 0
    streamed = list(c.completions.create(model="deepseek-v4-flash", prompt="abc", stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == comp.choices[0].text


def test_openai_sdk_responses(srv) -> None:
    c = oai(srv)
    r = c.responses.create(model="deepseek-v4-flash", input="hello", reasoning={"summary": "auto"})
    assert r.output_text == "echo: hello" and r.usage.input_tokens > 0
    assert r.output[0].type == "reasoning" and r.output[0].summary[0].text == REASONING
    events = list(c.responses.create(model="deepseek-v4-flash", input="hello", stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "echo: hello"
    assert events[-1].response.usage.output_tokens > 0


def test_anthropic_sdk_messages(srv) -> None:
    c = claude(srv)
    m = c.messages.create(
        model="deepseek-v4-flash",
        max_tokens=100,
        system="be brief",
        messages=[{"role": "user", "content": "hi"}],
    )
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == REASONING and m.content[1].text == "echo: hi"
    assert m.stop_reason == "end_turn" and m.usage.output_tokens > 0
    with c.messages.stream(
        model="deepseek-v4-flash", max_tokens=100, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        final = stream.get_final_message()
    assert final.content[1].text == "echo: hi" and final.usage.output_tokens == m.usage.output_tokens


def test_max_tokens_truncated_reasoning_stays_reasoning(srv) -> None:
    r = oai(srv).chat.completions.create(
        model="deepseek-v4-flash", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == "" and r.choices[0].message.model_extra["reasoning_content"]


def test_stop_sequence(srv) -> None:
    r = oai(srv).chat.completions.create(
        model="deepseek-chat", messages=[{"role": "user", "content": "abcdef"}], stop=["cd"]
    )
    assert r.choices[0].message.content == "echo: ab" and r.choices[0].finish_reason == "stop"


# ---- tool calls, every dialect, and exact replay with live prefix reuse ----------------------------


def _prefill(srv) -> int:
    return srv.session.stats.prefill_tokens


def test_chat_tool_call_stream_and_replay(srv) -> None:
    c = oai(srv)
    msgs = [{"role": "user", "content": "list files"}]
    chunks = list(
        c.chat.completions.create(model="deepseek-v4-flash", messages=msgs, tools=[BASH_OPENAI], stream=True)
    )
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    call_id = deltas[0].id
    args = "".join(d.function.arguments or "" for d in deltas)
    assert call_id.startswith("call_") and deltas[0].function.name == "bash"
    assert json.loads(args) == EXPECTED_ARGS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasoning = "".join(
        ch.choices[0].delta.model_extra.get("reasoning_content") or "" for ch in chunks if ch.choices
    )
    assert content == "Checking." and reasoning == REASONING and "DSML" not in content

    # the client replays the call with its keys reordered: the prompt must still carry the sampled bytes
    before = _prefill(srv)
    replay_args = json.dumps({"timeout": 10, "command": COMMAND})
    msgs += [
        {
            "role": "assistant",
            "content": content,
            "reasoning_content": reasoning,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": replay_args}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "a.txt"},
    ]
    r = c.chat.completions.create(model="deepseek-v4-flash", messages=msgs, tools=[BASH_OPENAI])
    assert (
        r.choices[0].message.content == "echo: <tool_result>a.txt</tool_result>"
        or "echo:" in r.choices[0].message.content
    )
    prompt = srv.source.last_request.prompt_text
    assert RAW_BLOCK + "<｜end▁of▁sentence｜>" in prompt
    assert srv.source.last_request.replay_stats == {"replayed": 1}
    suffix = "<｜end▁of▁sentence｜><｜User｜><tool_result>a.txt</tool_result><｜Assistant｜><think>"
    assert prompt.endswith(suffix)
    prefilled = _prefill(srv) - before
    assert prefilled <= len(srv.source.tok.encode_chat(suffix)) + 2, prefilled
    assert r.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - prefilled


def test_chat_tool_call_non_stream_sdk(srv) -> None:
    r = oai(srv).chat.completions.create(
        model="deepseek-v4-flash", messages=[{"role": "user", "content": "go"}], tools=[BASH_OPENAI]
    )
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.type == "function"
    assert call.function.name == "bash" and json.loads(call.function.arguments) == EXPECTED_ARGS
    assert call.function.arguments == json.dumps(EXPECTED_ARGS, separators=(",", ":"), ensure_ascii=False)


def test_anthropic_tool_use_stream_and_replay(srv) -> None:
    c = claude(srv)
    msgs = [{"role": "user", "content": "list files"}]
    partial, starts = [], []
    with c.messages.stream(
        model="deepseek-v4-flash", max_tokens=500, messages=msgs, tools=[BASH_ANTHROPIC]
    ) as s:
        for ev in s:
            if ev.type == "content_block_start":
                starts.append(ev.content_block.type)
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                partial.append(ev.delta.partial_json)
        final = s.get_final_message()
    assert starts == ["thinking", "text", "tool_use"] and final.stop_reason == "tool_use"
    use = final.content[-1]
    assert use.id.startswith("toolu_") and use.name == "bash" and use.input == EXPECTED_ARGS
    assert json.loads("".join(partial)) == EXPECTED_ARGS
    before = _prefill(srv)
    msgs += [
        {
            "role": "assistant",
            "content": [
                {
                    "type": "thinking",
                    "thinking": final.content[0].thinking,
                    "signature": final.content[0].signature,
                },
                {"type": "text", "text": final.content[1].text},
                {
                    "type": "tool_use",
                    "id": use.id,
                    "name": "bash",
                    "input": {"timeout": 10, "command": COMMAND},
                },
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "a.txt"}]},
    ]
    m = c.messages.create(model="deepseek-v4-flash", max_tokens=500, messages=msgs, tools=[BASH_ANTHROPIC])
    assert m.content[-1].text == "echo: a.txt"
    assert RAW_BLOCK in srv.source.last_request.prompt_text
    assert _prefill(srv) - before <= 30
    assert m.usage.cache_read_input_tokens > 0


def test_responses_function_call_stream_and_replay(srv) -> None:
    c = oai(srv)
    events = list(
        c.responses.create(
            model="deepseek-v4-flash",
            input="list files",
            tools=[BASH_RESPONSES],
            reasoning={"summary": "auto"},
            stream=True,
        )
    )
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    final = events[-1].response
    calls = [o for o in final.output if o.type == "function_call"]
    assert events[-1].type == "response.completed" and len(calls) == 1
    assert json.loads(deltas) == EXPECTED_ARGS and json.loads(calls[0].arguments) == EXPECTED_ARGS
    assert calls[0].call_id.startswith("call_") and calls[0].name == "bash"
    before = _prefill(srv)
    items = [o.model_dump(exclude_none=True) for o in final.output]
    items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "a.txt"})
    r = c.responses.create(
        model="deepseek-v4-flash",
        input=[{"role": "user", "content": "list files"}, *items],
        tools=[BASH_RESPONSES],
    )
    assert r.output_text == "echo: a.txt"
    assert RAW_BLOCK in srv.source.last_request.prompt_text
    assert _prefill(srv) - before <= 30


def test_thinking_visible_continues_on_the_live_kv(srv) -> None:
    """A tool-less thinking chat: the client replays the answer without its reasoning; the next turn
    still continues on the live KV (which holds the hidden reasoning) instead of re-prefilling."""
    c, tok = oai(srv), srv.source.tok
    msgs = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "first question"}]
    r = c.chat.completions.create(model="deepseek-v4-flash", messages=msgs)
    before = _prefill(srv)
    msgs += [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "second"},
    ]
    r2 = c.chat.completions.create(model="deepseek-v4-flash", messages=msgs)
    assert r2.choices[0].message.content == "echo: second"
    assert srv.source.last_job.stats["cache_source"] == "thinking-visible"
    suffix = "<｜end▁of▁sentence｜><｜User｜>second<｜Assistant｜><think>"
    assert _prefill(srv) - before == len(tok.encode_chat(suffix))


def test_responses_visible_continues_without_reasoning_replay(srv) -> None:
    c = oai(srv)
    r = c.responses.create(model="deepseek-v4-flash", input="list files", tools=[BASH_RESPONSES])
    assert [o.type for o in r.output] == ["message", "function_call"]  # reasoning not opted in
    call = r.output[1]
    before = _prefill(srv)
    items = [o.model_dump(exclude_none=True) for o in r.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "a.txt"})
    r2 = c.responses.create(
        model="deepseek-v4-flash",
        input=[{"role": "user", "content": "list files"}, *items],
        tools=[BASH_RESPONSES],
    )
    assert r2.output_text == "echo: a.txt"
    assert srv.source.last_job.stats["cache_source"] == "responses-visible"
    assert _prefill(srv) - before <= 30


def test_exact_replay_survives_restart_via_disk_tool_map(tok: Tokenizer, tmp_path) -> None:
    """A fresh server (empty tool memory) finds the sampled DSML of a replayed call id in a cache file's
    KTM trailer before rendering (§2.7)."""
    from ds4.kvstore import DSV4_HEAD, DSV4_MAGIC, KVStore

    kv = KVStore(tmp_path, min_tokens=1, ctx=4096)
    payload = DSV4_HEAD.pack(DSV4_MAGIC, 1, 4096, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0) + bytes(16)
    assert kv.store("an older session" + RAW_BLOCK, payload, tool_map=[("call_disk1", RAW_BLOCK)])
    with fake_server(tok, script, ctx=4096, kvstore=kv) as s, httpx.Client(base_url=s.base, timeout=30) as h:
        replay = {
            "id": "call_disk1",
            "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"timeout": 10, "command": COMMAND})},
        }
        msgs = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [replay]},
            {"role": "tool", "tool_call_id": "call_disk1", "content": "ok"},
        ]
        assert h.post("/v1/chat/completions", json={"messages": msgs}).status_code == 200
        assert RAW_BLOCK + "<｜end▁of▁sentence｜>" in s.source.last_request.prompt_text


def _oracle_greedy(prefix: str) -> bool:
    """Independent §2.8 rule for the scripted block: structure (tags, non-string values) is greedy; raw
    string values are sampled, except while a partial closing tag of >= 2 chars is pending."""
    start = prefix.find(f"<{D}tool_calls>")
    if start < 0:
        return False
    block = prefix[start:]
    close = f"</{D}parameter>"
    value_at = block.rfind('string="true">')
    if value_at >= 0 and block.find(close, value_at) < 0:
        body = block[value_at + len('string="true">') :]
        return any(body.endswith(close[:k]) for k in range(2, len(close)))
    return True


def test_greedy_for_structure_flags(srv) -> None:
    tok = srv.source.tok
    oai(srv).chat.completions.create(
        model="deepseek-v4-flash", messages=[{"role": "user", "content": "x"}], tools=[BASH_OPENAI]
    )
    ids = tok.encode_chat(REASONING + "</think>" + "Checking." + RAW_BLOCK)
    flags = srv.source.last_job.stats["greedy"]
    expected = [_oracle_greedy(tok.decode(ids[:n])) for n in range(len(flags))]
    assert flags == expected
    in_block = flags[flags.index(True) :]
    assert not all(in_block) and any(in_block)  # the command text is sampled, the tags are greedy


# ---- bad input --------------------------------------------------------------------------------------

GOOD = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20},
    "/v1/responses": {"input": "hi"},
}
BAD_BODIES = {
    "wrong types": {
        "/v1/chat/completions": {"messages": "hi"},
        "/v1/completions": {"prompt": 5, "stream": "x"},
        "/v1/messages": {"messages": [{"role": "user", "content": 7}]},
        "/v1/responses": {"input": 3},
    },
    "unknown model": {p: dict(b, model="gpt-17") for p, b in GOOD.items()},
    "empty messages": {
        "/v1/chat/completions": {"messages": []},
        "/v1/messages": {"messages": []},
        "/v1/responses": {"input": [{"type": "bogus"}]},
        "/v1/completions": {},
    },
    "invalid tool schema": {
        "/v1/chat/completions": dict(GOOD["/v1/chat/completions"], tools=[{"type": "function"}]),
        "/v1/messages": dict(GOOD["/v1/messages"], tools=[{"description": "no name"}]),
        "/v1/responses": dict(GOOD["/v1/responses"], tools="bash"),
        "/v1/completions": dict(GOOD["/v1/completions"], max_tokens="many"),
    },
    "bad effort": {p: dict(b, reasoning_effort="banana") for p, b in GOOD.items() if p != "/v1/responses"},
}


def _check_error(path: str, r: httpx.Response) -> None:
    assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
    body = r.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["message"]
    else:
        assert body["error"]["message"] and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", list(GOOD))
def test_bad_input_gets_4xx_in_dialect_shape(srv, path: str) -> None:
    with httpx.Client(base_url=srv.base, timeout=30) as h:
        raw = [b"{not json", b"[1,2]", b'{"messages": [\xff\xfe]}', b"\xff\xfe\xfd"]
        raw.append(json.dumps(dict(GOOD[path], temperature=float("nan"), model="deepseek-chat")).encode())
        lone = json.dumps(GOOD[path]).replace('"hi"', '"\\ud800"').encode()  # a lone surrogate escape
        assert b"ud800" in lone
        raw.append(lone)
        for body in raw:
            _check_error(path, h.post(path, content=body, headers={"content-type": "application/json"}))
        for cases in BAD_BODIES.values():
            if path in cases:
                r = h.post(path, json=cases[path])
                _check_error(path, r)
        _check_error(
            path, h.post(path, content=b"x" * (2 << 20), headers={"content-type": "application/json"})
        )
        assert h.post(path, json=GOOD[path]).status_code == 200  # still serving


def test_tool_result_for_an_unknown_call_is_a_400(srv) -> None:
    with httpx.Client(base_url=srv.base, timeout=30) as h:
        msgs = [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}
        ]
        r = h.post("/v1/messages", json={"messages": msgs, "max_tokens": 5})
        assert r.status_code == 400 and "tool_use_id toolu_x" in r.json()["error"]["message"]
        items = [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]
        r = h.post("/v1/responses", json={"input": items})
        assert r.status_code == 400 and "call_id call_x" in r.json()["error"]["message"]


def test_unknown_endpoint_and_models(srv) -> None:
    with httpx.Client(base_url=srv.base, timeout=30) as h:
        assert h.get("/v1/nope").status_code == 404 and h.get("/v1/nope").json()["error"]["message"]
        assert h.get("/v1/models/deepseek-v4-flash").json()["id"] == "deepseek-v4-flash"
        assert h.get("/v1/models/other").status_code == 404
        assert h.get("/health").json() == {"status": "ok"}
        names = {line.split()[0] for line in h.get("/metrics").text.splitlines() if not line.startswith("#")}
        assert {
            "ds4_requests_total",
            "ds4_prefill_tokens_total",
            "ds4_kv_disk_hits_total",
            "ds4_queue_depth",
        } <= names
        assert h.get("/openapi.json").json()["paths"]["/v1/chat/completions"]["post"]


def test_context_length_error(tok: Tokenizer) -> None:
    with fake_server(tok, script, ctx=64) as s, httpx.Client(base_url=s.base, timeout=30) as h:
        r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 100}]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["n_ctx"] == 64
        r = h.post(
            "/v1/messages", json={"messages": [{"role": "user", "content": "word " * 100}], "max_tokens": 5}
        )
        assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["n_ctx"] == 64


# ---- concurrency, disconnect, auth ----------------------------------------------------------------------


def test_16_concurrent_clients_get_their_own_output(srv) -> None:
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            c = oai(srv)
            msgs = [{"role": "user", "content": f"client number {i} says {'hey ' * i}"}]
            if i % 2:
                chunks = c.chat.completions.create(model="deepseek-chat", messages=msgs, stream=True)
                results[i] = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            else:
                r = c.chat.completions.create(model="deepseek-chat", messages=msgs)
                results[i] = r.choices[0].message.content
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == {i: f"echo: client number {i} says {'hey ' * i}" for i in range(16)}


LONG = " ".join(f"w{i}" for i in range(300))


def test_disconnect_mid_stream_stops_within_one_token(tok: Tokenizer) -> None:
    with fake_server(tok, lambda req: LONG) as s:
        held = threading.Event()

        def gate(job, n: int) -> None:
            if n == 5:
                held.set()
                job.cancel.wait(60)  # hold the decode loop until the server sees the client leave

        s.source.gate = gate
        before = s.session.stats.decode_tokens
        with httpx.Client(base_url=s.base, timeout=30) as h:
            body = {"messages": [{"role": "user", "content": "go"}], "stream": True, "model": "deepseek-chat"}
            with h.stream("POST", "/v1/chat/completions", json=body) as r:
                # keep a reference to the line iterator: a dropped one closes the connection at once
                lines = r.iter_lines()
                for line in lines:
                    if '"content"' in line:
                        break
                assert held.wait(60)  # the decode loop is held at token 5; now the client leaves
        job = s.worker.current_job
        assert job.finished.wait(60), "the worker did not finish the cancelled job"
        assert job.cancelled and s.worker.metrics.cancelled_total == 1, (job.stats, s.worker.metrics)
        # the token being sampled when the client left, and no more
        assert job.stats["emitted"] == 6, job.stats
        assert s.session.stats.decode_tokens - before <= 6, s.session.stats


def test_disconnect_during_prefill_stops_prefill(tok: Tokenizer) -> None:
    with fake_server(tok, lambda req: "x") as s:
        calls = []
        in_prefill = threading.Event()

        def sync_gate(tokens: list[int]) -> None:
            calls.append(len(tokens))
            if len(calls) == 2:  # hold the second chunk until the server sees the client leave
                in_prefill.set()
                s.worker.current_job.cancel.wait(60)

        s.session.sync_gate = sync_gate
        with httpx.Client(base_url=s.base, timeout=30) as h:
            body = {"messages": [{"role": "user", "content": LONG}], "stream": True, "model": "deepseek-chat"}
            with h.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()  # kept referenced: a dropped iterator closes the connection
                next(lines)  # headers + role chunk arrived
                assert in_prefill.wait(60), calls  # the worker is prefilling; now the client leaves
        job = s.worker.current_job
        assert job.finished.wait(60) and job.cancelled, job.stats
        assert len(calls) == 2, calls  # prefill stopped at the next chunk boundary
        assert s.session.stats.decode_tokens == 0


def test_api_key(tok: Tokenizer) -> None:
    with fake_server(tok, script, api_key="sekret") as s, httpx.Client(base_url=s.base, timeout=30) as h:
        body = GOOD["/v1/chat/completions"]
        assert h.post("/v1/chat/completions", json=body).status_code == 401
        assert (
            h.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code
            == 401
        )
        r = h.post("/v1/messages", json=GOOD["/v1/messages"], headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert (
            h.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sekret"}).status_code
            == 200
        )
        assert (
            h.post("/v1/messages", json=GOOD["/v1/messages"], headers={"x-api-key": "sekret"}).status_code
            == 200
        )
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="sekret", max_retries=0)
        assert c.models.list().data[0].id == "deepseek-v4-flash"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.base + "/v1", api_key="bad", max_retries=0).models.list()


def test_cors(tok: Tokenizer) -> None:
    with fake_server(tok, script, cors=True) as s, httpx.Client(base_url=s.base, timeout=30) as h:
        r = h.options("/v1/chat/completions")
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*"
        assert h.get("/v1/models").headers["access-control-allow-methods"] == "GET, POST, OPTIONS"


def test_worker_failure_is_contained(tok: Tokenizer) -> None:
    def boom(req: Request) -> str:
        if req.messages[-1].content == "boom":
            raise RuntimeError("model exploded")
        return "fine"

    with fake_server(tok, boom) as s, httpx.Client(base_url=s.base, timeout=30) as h:
        body = {"messages": [{"role": "user", "content": "boom"}], "model": "deepseek-chat"}
        r = h.post("/v1/chat/completions", json=body)
        assert r.status_code == 500 and "model exploded" in r.json()["error"]["message"]
        r = h.post("/v1/messages", json=dict(body, max_tokens=5, stream=True))
        assert r.status_code == 200 and "event: error" in r.text and '"api_error"' in r.text
        ok = h.post("/v1/chat/completions", json=dict(body, messages=[{"role": "user", "content": "hi"}]))
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"
