"""A session is a file: the same long prompt across a server restart is served from the disk KV cache.

Runs the real `ds4-server` twice (tiny synthetic model, CPU) on one --kv-disk-dir. The first process prefills
the whole prompt and saves a cold checkpoint; the second finds it on disk, restores it and prefills only the
suffix. Asserted through /metrics (tokens actually prefilled, disk hits); both times to first token printed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import BENCH_TEXT

PROMPT_TOKENS_MIN = 4096


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


class Server:
    def __init__(self, kv_dir: Path, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "ds4.server.main", "-m", "tiny", "--ctx", "8192", "-t", "1",
               "--port", str(self.port), "--kv-disk-dir", str(kv_dir)]  # fmt: skip
        self.log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300  # first use may build the tiny model
        while True:
            assert self.proc.poll() is None, f"server exited early: {log.read_text()[-2000:]}"
            try:
                if json.loads(_get(self.url + "/health")).get("status") == "ok":
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.2)  # readiness polling, not timing

    def complete(self, prompt: str) -> float:
        """Time to first token of a streamed greedy completion of one token."""
        body = json.dumps({"model": "deepseek-v4-flash", "prompt": prompt, "max_tokens": 1,
                           "temperature": 0, "stream": True}).encode()  # fmt: skip
        req = urllib.request.Request(self.url + "/v1/completions", body, {"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=600) as r:
            ttft = None
            for line in r:
                if ttft is None and line.startswith(b"data: {"):
                    ttft = time.monotonic() - t0
        assert ttft is not None, "no data event"
        return ttft

    def metrics(self) -> str:
        return _get(self.url + "/metrics")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()


@pytest.mark.slow
def test_long_prompt_restored_from_disk_after_restart(tmp_path: Path) -> None:
    if not BENCH_TEXT.exists():
        pytest.skip(f"bench text missing: {BENCH_TEXT}")
    from ds4.tokenizer import Tokenizer
    from ds4.tools.make_model import ensure_tiny_model

    tok = Tokenizer.from_gguf(ensure_tiny_model())
    text = BENCH_TEXT.read_text(encoding="utf-8")[:30000]
    prompt = tok.decode(tok.encode(text)[: PROMPT_TOKENS_MIN + 400])
    kv_dir, log = tmp_path / "kv", tmp_path / "server.log"

    first = Server(kv_dir, log)
    try:
        cold_ttft = first.complete(prompt)
        m1 = first.metrics()
    finally:
        first.stop()
    prompt_tokens = _metric(m1, "ds4_prompt_tokens_total")
    assert prompt_tokens >= PROMPT_TOKENS_MIN
    assert _metric(m1, "ds4_prefill_tokens_total") == prompt_tokens  # cold: everything prefilled
    files = sorted(kv_dir.glob("*.kv"))
    assert files, f"no checkpoint saved: {log.read_text()[-2000:]}"

    second = Server(kv_dir, log)
    try:
        warm_ttft = second.complete(prompt)
        m2 = second.metrics()
    finally:
        second.stop()
    prefilled = _metric(m2, "ds4_prefill_tokens_total")
    assert _metric(m2, "ds4_kv_disk_hits_total") == 1
    assert _metric(m2, "ds4_prompt_tokens_total") == prompt_tokens
    # the checkpoint is aligned down to 2048 tokens: only the tail after it is prefilled
    assert prefilled <= prompt_tokens - PROMPT_TOKENS_MIN + 64, prefilled
    print(
        f"\nprompt {prompt_tokens:.0f} tokens: cold TTFT {cold_ttft:.2f} s (prefilled {prompt_tokens:.0f}), "
        f"after restart TTFT {warm_ttft:.2f} s (prefilled {prefilled:.0f}, restored from {files[0].name})"
    )
    assert os.path.getsize(files[0]) > 0
