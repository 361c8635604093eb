"""Bounded loopback load test of a running ds4-server (issue 8): N concurrent streams, then one more request.

    ds4-server -m MODEL --parallel 33 -c 8192 &
    python tools/server_load.py --url http://127.0.0.1:8000 --streams 32 --prompt-words 6000 --max-tokens 256

Phase 1 starts `--streams` streaming /v1/completions requests at once (distinct prompts, greedy) and times
each: first token, last token, tokens. Aggregate decode = tokens after each stream's first token, summed,
over the window in which every stream was decoding (latest first token .. earliest end), so prefill and the
ragged tail do not count. Phase 2, while the streams still run (started once all of them decode), sends
one more request and reports its time to first token (TTFT under load). Prints one JSON line at the end;
also reads the server's /metrics decode batch gauges.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Stream:
    start: float = 0.0
    first: float | None = None  # time of the first streamed token
    end: float | None = None
    tokens: int = 0  # text chunks received (one per generated token for a raw completion)
    times: list[float] = field(default_factory=list)
    error: str | None = None


def run_stream(url: str, prompt: str, max_tokens: int, out: Stream, timeout: float) -> None:
    body = {"model": "deepseek-chat", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    out.start = time.perf_counter()
    try:
        with (
            httpx.Client(timeout=timeout) as h,
            h.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r,
        ):
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    out.first = out.first or now
                    out.tokens += 1
                    out.times.append(now)
    except httpx.HTTPError as err:
        out.error = f"{type(err).__name__}: {err}"
    out.end = time.perf_counter()


def prompt_of(i: int, words: int) -> str:
    filler = " ".join(f"w{(i * 7919 + k) % 1000}" for k in range(words))
    return f"Stream {i}. {filler}\nSummarize:"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=200, help="filler words per prompt (~tokens)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    a = p.parse_args()

    streams = [Stream() for _ in range(a.streams)]
    threads = [
        threading.Thread(
            target=run_stream, args=(a.url, prompt_of(i, a.prompt_words), a.max_tokens, s, a.timeout)
        )
        for i, s in enumerate(streams)
    ]
    for t in threads:
        t.start()
    # phase 2: once every stream decodes (or ended), one more request measures TTFT under load
    while any(s.first is None and s.end is None for s in streams):
        time.sleep(0.05)
    late = Stream()
    run_stream(a.url, prompt_of(a.streams, a.prompt_words), 8, late, a.timeout)
    for t in threads:
        t.join()

    ok = [s for s in streams if s.error is None and s.first is not None]
    errors = [s.error for s in streams if s.error is not None]
    lo = max((s.first for s in ok), default=0.0)
    hi = min((s.end for s in ok if s.end is not None), default=0.0)
    in_window = sum(sum(lo <= t <= hi for t in s.times) for s in ok)
    agg = in_window / (hi - lo) if hi > lo else 0.0
    ttft = sorted(s.first - s.start for s in ok)
    metrics = {}
    try:
        for line in httpx.get(a.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(("ds4_decode_batch", "ds4_kv_bytes", "ds4_sessions")):
                k, v = line.split()
                metrics[k] = float(v)
    except httpx.HTTPError:
        pass
    result = {
        "streams": a.streams,
        "ok": len(ok),
        "errors": errors[:3],
        "tokens": sum(s.tokens for s in ok),
        "aggregate_decode_tps": round(agg, 1),
        "decode_window_s": round(max(0.0, hi - lo), 3),
        "ttft_median_s": round(ttft[len(ttft) // 2], 3) if ttft else None,
        "ttft_max_s": round(ttft[-1], 3) if ttft else None,
        "ttft_under_load_s": round(late.first - late.start, 3) if late.first else None,
        "metrics": metrics,
    }
    print(
        f"{len(ok)}/{a.streams} streams, aggregate decode {agg:.1f} tok/s over {max(0.0, hi - lo):.2f} s; "
        f"TTFT median {result['ttft_median_s']} s; a new request while they stream: "
        f"{result['ttft_under_load_s']} s"
    )
    print(json.dumps(result))
    return 0 if not errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
