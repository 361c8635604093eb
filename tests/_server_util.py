"""Test doubles and a live-server fixture for the ds4-server tests.

`FakeSession` has the engine Session's sync/eval contract and counters (prefix reuse, rebuild) without a
model; `ScriptSource` is a TokenSource that emits a given text through the real tokenizer (then EOS), so the
decode loop (ds4.engine.generate), detokenizer, stop strings and DSML projection run for real. `LiveServer`
runs the real app on uvicorn on a free loopback port in a background thread.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from ds4.engine.session import ContextError, SessionStats
from ds4.server.app import ServerOptions, create_app
from ds4.server.protocol import Request
from ds4.server.worker import Job, Worker, WorkerOptions


class FakeSession:
    def __init__(self, ctx: int = 32768) -> None:
        self.ctx = ctx
        self.tokens: list[int] = []
        self.stats = SessionStats()
        self.logits = None
        self.sync_gate: Callable[[list[int]], None] | None = None  # runs before each sync (tests)

    def sync(self, tokens: Any, progress: Any = None) -> int:
        tokens = list(tokens)
        if self.sync_gate is not None:
            self.sync_gate(tokens)
        if len(tokens) >= self.ctx:
            raise ContextError(f"prompt exceeds context: {len(tokens)} >= {self.ctx}")
        held = len(self.tokens)
        if held and tokens[:held] == self.tokens:
            suffix = tokens[held:]
        else:
            if held:
                self.stats.rebuilds += 1
            suffix = tokens
        self.stats.reused_tokens += len(tokens) - len(suffix)
        self.stats.prefill_tokens += len(suffix)
        self.tokens = tokens
        return len(suffix)

    def eval(self, token: int) -> None:
        self.tokens.append(int(token))
        self.stats.decode_tokens += 1

    def snapshot(self) -> bytes:
        raise NotImplementedError("the fake session has no KV payload")


class ScriptSource:
    """Emits `script(request)` token by token (real tokenizer, specials live), then EOS.

    `gate(job, n)`, when set, runs before the n-th token (0-based) is returned: tests use it to hold the
    decode loop at a known point.
    """

    def __init__(self, tokenizer: Any, script: Callable[[Request], str]) -> None:
        self.tok, self.script = tokenizer, script
        self.gate: Callable[[Job, int], None] | None = None
        self.last_request: Request | None = None
        self.last_job: Job | None = None

    def start(self, job: Job) -> None:
        self.last_request, self.last_job = job.request, job
        job.stats["script"] = self.tok.encode_chat(self.script(job.request)) + [self.tok.eos_id]
        job.stats["emitted"] = 0

    def next_token(self, job: Job, logits: Any, params: Any, rng: Any, greedy: bool) -> int:
        n = job.stats["emitted"]
        if self.gate is not None:
            self.gate(job, n)
        script = job.stats["script"]
        job.stats["emitted"] = n + 1
        job.stats.setdefault("greedy", []).append(greedy)
        return script[n] if n < len(script) else self.tok.eos_id


class LiveServer:
    def __init__(self, worker: Worker, opt: ServerOptions) -> None:
        self.worker, self.opt = worker, opt
        # Bind here and hand the socket to uvicorn: no window in which another process takes the port.
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        app = create_app(worker, opt)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.worker.start()
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.worker.stop(10)
        self.sock.close()


def fake_server(
    tokenizer: Any, script: Callable[[Request], str], ctx: int = 32768, kvstore: Any = None, **opts: Any
) -> LiveServer:
    session = FakeSession(ctx)
    source = ScriptSource(tokenizer, script)
    options = WorkerOptions(ctx=ctx, prefill_chunk=64)
    worker = Worker(tokenizer, session, source=source, options=options, kvstore=kvstore)
    server = LiveServer(worker, ServerOptions(ctx=ctx, **opts))
    server.source, server.session = source, session  # type: ignore[attr-defined]
    return server
