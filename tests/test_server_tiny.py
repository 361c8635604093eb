"""ds4-server with the real tiny model on CPU: the official SDKs parse every endpoint's output (stream and
not) with usage filled, and the disk KV cache turns a second server's cold prompt into a restore."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from ds4.kvstore import KVStore
from ds4.server.app import ServerOptions
from ds4.server.worker import Worker, WorkerOptions
from tests._server_util import LiveServer

CTX = 512
MSG = [{"role": "user", "content": "Say hi to everyone in the room, please"}]


@pytest.fixture(scope="module")
def engine():
    from ds4.engine import Engine

    with Engine.open("tiny") as e:
        yield e


def _server(engine, kv_dir) -> LiveServer:
    kv = KVStore(kv_dir, min_tokens=8, cold_max_tokens=4096, ctx=CTX)
    worker = Worker(engine.tokenizer, engine.session(CTX), options=WorkerOptions(ctx=CTX), kvstore=kv)
    return LiveServer(worker, ServerOptions(ctx=CTX))


def test_sdks_parse_every_endpoint(engine, tmp_path) -> None:
    with _server(engine, tmp_path) as srv:
        c = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="deepseek-v4-flash", messages=MSG, max_tokens=2)
        assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens == 2
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
        chunks = list(
            c.chat.completions.create(
                model="deepseek-v4-flash",
                messages=MSG,
                max_tokens=2,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage.completion_tokens == 2
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # same prompt: live prefix reused
        comp = c.completions.create(model="deepseek-chat", prompt="Hi", max_tokens=1)
        assert comp.usage.completion_tokens == 1 and isinstance(comp.choices[0].text, str)
        assert (
            len(list(c.completions.create(model="deepseek-chat", prompt="Hi", max_tokens=1, stream=True)))
            >= 1
        )
        resp = c.responses.create(model="deepseek-v4-flash", input="Say hi", max_output_tokens=2)
        assert resp.usage.output_tokens == 2 and resp.status == "incomplete"
        events = list(
            c.responses.create(model="deepseek-v4-flash", input="Say hi", max_output_tokens=2, stream=True)
        )
        assert events[-1].type == "response.incomplete" and events[-1].response.usage.input_tokens > 0
        a = anthropic.Anthropic(base_url=srv.base, api_key="x", max_retries=0, timeout=120)
        m = a.messages.create(model="deepseek-v4-flash", max_tokens=2, messages=MSG)
        assert m.usage.output_tokens == 2 and m.stop_reason in ("max_tokens", "end_turn", "tool_use")
        with a.messages.stream(model="deepseek-v4-flash", max_tokens=2, messages=MSG) as s:
            final = s.get_final_message()
        assert final.usage.output_tokens == 2


def test_disk_cache_restores_a_cold_prompt(engine, tmp_path) -> None:
    body = {"messages": MSG, "max_tokens": 1, "model": "deepseek-chat"}
    with _server(engine, tmp_path) as first, httpx.Client(base_url=first.base, timeout=120) as h:
        assert h.post("/v1/chat/completions", json=body).status_code == 200
    assert list(tmp_path.glob("*.kv")), "the cold prompt was not stored"
    with _server(engine, tmp_path) as second, httpx.Client(base_url=second.base, timeout=120) as h:
        r = h.post("/v1/chat/completions", json=body).json()
        assert second.worker.metrics.kv_disk_hits_total == 1
        assert second.worker.session.stats.prefill_tokens == 0  # restored, nothing re-prefilled
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == r["usage"]["prompt_tokens"]


def test_evicted_live_session_comes_back_from_disk(engine, tmp_path) -> None:
    """A then B then A: B's arrival stores A's live session (reason evict); A's return restores it."""
    kv = KVStore(tmp_path, min_tokens=8, cold_max_tokens=0, ctx=CTX)  # cold saves off: only evict stores
    worker = Worker(engine.tokenizer, engine.session(CTX), options=WorkerOptions(ctx=CTX), kvstore=kv)
    a = {"messages": MSG, "max_tokens": 0, "model": "deepseek-chat"}
    b = {"messages": [{"role": "user", "content": "A different question about the weather today"}],
         "max_tokens": 0, "model": "deepseek-chat"}  # fmt: skip
    with LiveServer(worker, ServerOptions(ctx=CTX)) as srv, httpx.Client(base_url=srv.base, timeout=120) as h:
        first = h.post("/v1/chat/completions", json=a).json()
        assert not list(tmp_path.glob("*.kv"))
        h.post("/v1/chat/completions", json=b)
        files = list(tmp_path.glob("*.kv"))
        assert len(files) == 1 and files[0].read_bytes()[5] == 3  # header byte 5: reason 3 = evict
        before = worker.session.stats.prefill_tokens
        again = h.post("/v1/chat/completions", json=a).json()
        assert worker.metrics.kv_disk_hits_total == 1
        assert worker.session.stats.prefill_tokens == before  # restored from disk, nothing prefilled
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"]
