"""ds4-server pieces without a model: thinking controls, stop scanning, SSE keepalive, trace, CLI flags."""

from __future__ import annotations

import threading

import httpx
import pytest

from ds4.server.main import build_parser, main
from ds4.server.protocol import BadRequest, effort_mode, resolve_mode, stop_list, text_of, thinking_flag
from ds4.server.worker import StopScanner
from ds4.tokenizer import Tokenizer
from tests._server_util import fake_server


@pytest.mark.parametrize(
    ("effort", "mode"),
    [("low", "high"), ("medium", "high"), ("high", "high"), ("xhigh", "high"), ("minimal", "high"),
     ("max", "max"), ("none", "none"), (None, None)],
)  # fmt: skip
def test_effort_mapping(effort, mode) -> None:
    assert effort_mode(effort) == mode


def test_bad_effort_is_a_400() -> None:
    with pytest.raises(BadRequest) as e:
        effort_mode("banana")
    assert e.value.status == 400 and "banana" in e.value.message


def test_thinking_controls_and_aliases() -> None:
    assert thinking_flag({"type": "disabled", "budget_tokens": 1024}) is False
    assert (
        thinking_flag(True) is True
        and thinking_flag({"type": "adaptive"}) is None
        and thinking_flag(None) is None
    )
    assert resolve_mode("deepseek-v4-flash", enabled=None, effort=None) == "high"
    assert resolve_mode("deepseek-chat", enabled=None, effort=None) == "none"
    assert resolve_mode("deepseek-chat", enabled=True, effort=None) == "high"  # explicit control wins
    assert resolve_mode("deepseek-reasoner", enabled=None, effort="max") == "max"
    assert resolve_mode("deepseek-v4-flash", enabled=True, effort="none") == "none"
    assert resolve_mode("deepseek-v4-flash", enabled=None, effort=None, default="none") == "none"  # --nothink
    assert resolve_mode("deepseek-reasoner", enabled=None, effort=None, default="none") == "high"
    assert resolve_mode("deepseek-v4-flash", enabled=None, effort="low", default="none") == "high"


def test_text_parts_and_stops() -> None:
    assert text_of(["a", {"type": "text", "text": "b"}, {"type": "image_url"}], what="content") == "ab"
    assert text_of(None, what="content") == ""
    assert stop_list(["", "x"]) == ["x"] and stop_list("y") == ["y"]
    with pytest.raises(BadRequest):
        stop_list([1])


def test_stop_scanner_holds_back_a_possible_match() -> None:
    s = StopScanner(["</END>"])
    assert s.feed("hello </") == "hel"  # "lo </" could still become "</END>"
    assert s.feed("EN") == "lo"  # only the last len("</END>") - 1 chars are held
    assert s.feed("D> tail") == " " and s.hit
    s = StopScanner(["ab", "zzzz"])
    out = s.feed("xxab")
    assert out == "xx" and s.hit


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from ds4.tools.make_model import ensure_tiny_model

    return Tokenizer.from_gguf(ensure_tiny_model())


def test_sse_keepalive_while_the_worker_is_busy(tok: Tokenizer) -> None:
    with fake_server(tok, lambda req: "hello", keepalive_s=0.05) as s:
        release = threading.Event()
        s.source.gate = lambda job, n: release.wait(20) if n == 0 else None
        body = {"messages": [{"role": "user", "content": "go"}], "stream": True, "model": "deepseek-chat"}
        with (
            httpx.Client(base_url=s.base, timeout=30) as h,
            h.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if line == ": keepalive":
                    release.set()
        assert ": keepalive" in lines and "data: [DONE]" in lines


def test_trace_file(tok: Tokenizer, tmp_path) -> None:
    with fake_server(tok, lambda req: "traced answer") as s:
        path = tmp_path / "trace.txt"
        s.worker.trace = path.open("w")
        with httpx.Client(base_url=s.base, timeout=30) as h:
            h.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "q"}], "model": "deepseek-chat"},
            )
        s.worker.trace.close()
    text = path.read_text()
    assert "===== request 1" in text and "--- rendered prompt ---" in text and "traced answer" in text
    assert "cache_source=none" in text and "tool_replay: mem=0 canonical=0" in text
    assert "===== end request 1 =====" in text


def test_flags() -> None:
    args = build_parser().parse_args([])
    assert (args.host, args.port, args.ctx, args.api_key, args.cors) == (
        "127.0.0.1",
        8000,
        32768,
        None,
        False,
    )
    assert args.kv_cache_min_tokens == 512 and args.tool_memory_max_ids == 100000 and not args.nothink
    args = build_parser().parse_args(
        ["-m", "tiny", "--api-key", "k", "--kv-disk-dir", "/tmp/x", "--trace", "t"]
    )
    assert (args.model, args.api_key, args.kv_disk_dir, args.trace) == ("tiny", "k", "/tmp/x", "t")
    with pytest.raises(SystemExit, match="IPv4"):
        main(["--host", "example.com"])
    assert main(["--ctx", "1"]) == 2


def test_nothink_server_default(tok: Tokenizer) -> None:
    with fake_server(tok, lambda req: "reasoned</think>answer" if req.thinking else "answer",
                     default_mode="none") as s, httpx.Client(base_url=s.base, timeout=30) as h:  # fmt: skip
        msgs = [{"role": "user", "content": "q"}]
        plain = h.post("/v1/chat/completions", json={"messages": msgs}).json()["choices"][0]["message"]
        assert plain == {"role": "assistant", "content": "answer"}
        asked = h.post("/v1/chat/completions", json={"messages": msgs, "reasoning_effort": "high"}).json()
        assert asked["choices"][0]["message"]["reasoning_content"] == "reasoned"
