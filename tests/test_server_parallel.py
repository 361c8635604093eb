"""ds4-server with --parallel N (issue 8) on the real tiny model (CPU): concurrent greedy requests give
exactly what each gives alone on the single-session worker, with decode steps really batched; with every
session taken, a new conversation evicts the least recently used idle one to the disk cache and the evicted
one comes back from disk; the start-up KV budget is N x the bytes of one session's state."""

from __future__ import annotations

import logging
import threading

import httpx
import pytest

from ds4.kvstore import KVStore
from ds4.server.app import ServerOptions
from ds4.server.main import build_parser, build_worker, default_parallel
from ds4.server.worker import Worker, WorkerOptions
from tests._server_util import LiveServer

CTX = 256
WORDS = ["apples", "rivers", "the moon", "old trains", "green tea", "winter", "chess", "small dogs"]


@pytest.fixture(scope="module")
def engine():
    from ds4.engine import Engine

    with Engine.open("tiny") as e:
        yield e


def _parallel_server(engine, n: int, kv=None) -> tuple[LiveServer, object]:
    worker, stepper = build_worker(engine, CTX, parallel=n, options=WorkerOptions(ctx=CTX), kvstore=kv)
    return LiveServer(worker, ServerOptions(ctx=CTX)), stepper


def _complete(h: httpx.Client, word: str) -> str:
    body = {"model": "deepseek-chat", "prompt": f"Tell me about {word}", "max_tokens": 4, "temperature": 0}
    r = h.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_concurrent_greedy_requests_equal_each_alone(engine) -> None:
    # Reference: the plain single-session worker (model.forward per token, no stepper), one request at a time.
    alone_worker = Worker(engine.tokenizer, engine.session(CTX), options=WorkerOptions(ctx=CTX))
    with (
        LiveServer(alone_worker, ServerOptions(ctx=CTX)) as srv,
        httpx.Client(base_url=srv.base, timeout=300) as h,
    ):
        alone = {w: _complete(h, w) for w in WORDS}

    server, stepper = _parallel_server(engine, 8)
    together: dict[str, str] = {}
    go = threading.Barrier(len(WORDS))

    def client(word: str) -> None:
        with httpx.Client(base_url=server.base, timeout=300) as h:
            go.wait()
            together[word] = _complete(h, word)

    try:
        with server:
            threads = [threading.Thread(target=client, args=(w,)) for w in WORDS]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            metrics = httpx.get(server.base + "/metrics").text
    finally:
        stepper.stop()
    assert together == alone
    assert stepper.stats.max_batch > 1, stepper.stats  # decode steps of several streams ran as one batch
    assert f"ds4_decode_batch_max {stepper.stats.max_batch}" in metrics
    assert len({s for s in server.worker.sessions if s.tokens}) == len(WORDS)  # every stream had its own KV
    print(f"decode batches (size: steps): {dict(sorted(stepper.stats.batches.items()))}")


def _chat(h: httpx.Client, text: str) -> dict:
    body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": text}], "max_tokens": 0}
    r = h.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_third_conversation_evicts_the_lru_session_to_disk(engine, tmp_path) -> None:
    kv = KVStore(tmp_path, min_tokens=8, cold_max_tokens=0, ctx=CTX)  # cold saves off: only evict stores
    server, stepper = _parallel_server(engine, 2, kv)
    a, b, c = (f"Please write a short note about {w} for me" for w in ("apples", "rivers", "winter"))
    try:
        with server, httpx.Client(base_url=server.base, timeout=300) as h:
            worker = server.worker
            first_a = _chat(h, a)
            _chat(h, b)
            assert worker.live_sessions == 2 and not list(tmp_path.glob("*.kv"))
            _chat(h, c)  # both sessions hold a conversation: A's (least recently used) goes to disk
            files = list(tmp_path.glob("*.kv"))
            assert len(files) == 1 and files[0].read_bytes()[5] == 3  # header byte 5: reason 3 = evict
            assert worker.metrics.evictions_total == 1 and worker.live_sessions == 2
            prefilled = worker.metrics.prefill_tokens_total
            again = _chat(h, a)  # A is not live any more: B's session is evicted, A restored from disk
            assert worker.metrics.kv_disk_hits_total == 1 and worker.metrics.evictions_total == 2
            assert worker.metrics.prefill_tokens_total == prefilled  # restored, nothing re-prefilled
            n = first_a["usage"]["prompt_tokens"]
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n
            assert len(list(tmp_path.glob("*.kv"))) == 2  # B's timeline went to disk as well
    finally:
        stepper.stop()


def _state_bytes(state, window: int) -> int:
    """Bytes a CPU KVState holds at full context, from its own tensors (raw grows to the window)."""
    total = 0
    for kv in state.layers:
        total += min(CTX, window) * kv.raw.shape[1] * kv.raw.element_size()
        for buf in (kv._comp, kv._index):
            total += 0 if buf is None else buf._buf.nbytes
        for t in (kv.comp_kv, kv.comp_score, kv.index_kv, kv.index_score):
            total += 0 if t is None else t.nbytes
    return total


def _session_bytes(engine) -> int:
    state = engine.model.new_state(CTX)
    if hasattr(state, "nbytes"):  # device state: all preallocated, and each session has a checkpoint buffer
        return 2 * state.nbytes()
    return _state_bytes(state, engine.config.window)


def test_startup_reports_the_kv_budget_of_n_sessions(engine, caplog) -> None:
    per_session = _session_bytes(engine)
    with caplog.at_level(logging.INFO, logger="ds4.server"):
        worker, stepper = build_worker(engine, CTX, parallel=3, options=WorkerOptions(ctx=CTX))
    stepper.stop()
    assert worker.kv_budget.bytes_per_session == per_session
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv: ")]
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith(f"kv: 3 sessions x ctx {CTX} = {3 * per_session / 2**30:.3f} GiB")
    assert f"({per_session / 2**20:.1f} MiB each" in line  # then "+ N MiB scratch" on cuda
    assert "free after weights" in line
    assert len(worker.sessions) == 3


def test_default_parallel_and_flag() -> None:
    gib = 2**30
    assert default_parallel("cuda", 10 * gib, gib) == 9  # floor(0.9 * 10)
    assert default_parallel("cuda", 1000 * gib, gib) == 32  # capped
    assert default_parallel("cuda", gib // 2, gib) == 1  # at least one
    assert default_parallel("cpu", None, gib) == 4
    assert build_parser().parse_args(["--parallel", "3"]).parallel == 3
    assert build_parser().parse_args([]).parallel is None


def test_interleaved_conversations_each_continue_on_their_own_session() -> None:
    """Scripted model, 3 fake sessions: two thinking chats alternate turns; each turn 2 finds its own
    session through that session's visible-text binding (the client drops the hidden reasoning) and
    prefills only the new suffix."""
    from ds4.tokenizer import Tokenizer
    from ds4.tools.make_model import ensure_tiny_model
    from tests._server_util import FakeSession, ScriptSource

    tok = Tokenizer.from_gguf(ensure_tiny_model())
    source = ScriptSource(tok, lambda req: "hidden thoughts</think>echo: " + req.messages[-1].content)
    sessions = [FakeSession(4096) for _ in range(3)]
    worker = Worker(tok, sessions, source=source, options=WorkerOptions(ctx=4096))
    talks = {k: [{"role": "user", "content": f"question about {k}"}] for k in ("a", "b")}
    placed: dict[str, int] = {}
    with LiveServer(worker, ServerOptions(ctx=4096)) as srv, httpx.Client(base_url=srv.base, timeout=60) as h:

        def turn(k: str) -> dict:
            body = {"model": "deepseek-v4-flash", "messages": talks[k]}
            r = h.post("/v1/chat/completions", json=body).json()
            talks[k] += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]}]
            return r

        for k in ("a", "b"):
            turn(k)
            placed[k] = source.last_job.stats["session"]
        assert placed["a"] != placed["b"]
        for k in ("a", "b"):
            talks[k].append({"role": "user", "content": f"more on {k}"})
            before = sessions[placed[k]].stats.prefill_tokens
            r = turn(k)
            job = source.last_job
            assert job.stats["session"] == placed[k] and job.stats["cache_source"] == "thinking-visible"
            assert r["choices"][0]["message"]["content"] == f"echo: more on {k}"
            suffix = f"<｜end▁of▁sentence｜><｜User｜>more on {k}<｜Assistant｜><think>"
            assert sessions[placed[k]].stats.prefill_tokens - before == len(tok.encode_chat(suffix))
        assert worker.metrics.evictions_total == 0 and sessions[3 - sum(placed.values())].tokens == []


def test_with_every_session_busy_a_job_waits_for_one() -> None:
    """Scripted model, 2 fake sessions held mid-decode: a third request waits (queued, not failed) and is
    served on the session released first."""
    from ds4.tokenizer import Tokenizer
    from ds4.tools.make_model import ensure_tiny_model
    from tests._server_util import FakeSession, ScriptSource

    tok = Tokenizer.from_gguf(ensure_tiny_model())
    source = ScriptSource(tok, lambda req: "ok")
    held, release = threading.Semaphore(0), {w: threading.Event() for w in ("a", "b", "c")}

    def gate(job, n: int) -> None:
        if n == 0:
            held.release()
            release[job.request.prompt[-1]].wait(60)

    source.gate = gate
    worker = Worker(
        tok, [FakeSession(4096), FakeSession(4096)], source=source, options=WorkerOptions(ctx=4096)
    )
    out: dict[str, int] = {}
    with LiveServer(worker, ServerOptions(ctx=4096)) as srv:

        def ask(w: str) -> None:
            body = {"model": "deepseek-chat", "prompt": f"word {w}", "max_tokens": 4}
            out[w] = httpx.post(srv.base + "/v1/completions", json=body, timeout=60).status_code

        threads = {w: threading.Thread(target=ask, args=(w,)) for w in ("a", "b")}
        for t in threads.values():
            t.start()
        assert held.acquire(timeout=60) and held.acquire(timeout=60)  # a and b hold both sessions
        threads["c"] = threading.Thread(target=ask, args=("c",))
        threads["c"].start()
        while worker.queue_depth == 0 and threads["c"].is_alive():
            threading.Event().wait(0.01)  # c's handler is still tokenizing: wait until it is queued
        assert worker.busy_sessions == 2 and worker.queue_depth == 1
        release["b"].set()
        assert held.acquire(timeout=60)  # c got b's session
        assert worker.queue_depth == 0
        release["a"].set()
        release["c"].set()
        for t in threads.values():
            t.join(60)
    assert out == {"a": 200, "b": 200, "c": 200}


def test_shutdown_saves_the_live_sessions_after_the_model_thread_stopped(engine, tmp_path) -> None:
    """ds4-server's exit order: worker.stop(), stepper.stop(), then store_shutdown(): the snapshots run
    once the model thread is gone (Stepper.call then runs in the caller) and every live session is saved."""
    kv = KVStore(tmp_path, min_tokens=8, cold_max_tokens=0, ctx=CTX)  # cold saves off: only shutdown stores
    server, stepper = _parallel_server(engine, 2, kv)
    try:
        with server, httpx.Client(base_url=server.base, timeout=300) as h:
            for w in ("apples", "rivers"):
                _chat(h, f"Please write a short note about {w} for me")
    finally:
        stepper.stop()
    assert not stepper.alive and not list(tmp_path.glob("*.kv"))
    server.worker.store_shutdown()
    files = list(tmp_path.glob("*.kv"))
    assert len(files) == 2 and {f.read_bytes()[5] for f in files} == {4}  # header byte 5: reason 4 = shutdown
