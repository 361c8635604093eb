"""Schemathesis fuzz of every operation in /openapi.json against a live loopback server (scripted model).

Positive (schema-valid) and negative (schema-violating) cases; no response may be a 5xx and the server must
keep answering. CI runs a small budget; `DS4_FUZZ_EXAMPLES=400 pytest tests/test_server_fuzz.py` (per
operation and mode) is the big run.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from ds4.server.protocol import Request
from ds4.tokenizer import Tokenizer
from tests._server_util import fake_server

EXAMPLES = int(os.environ.get("DS4_FUZZ_EXAMPLES", "10"))
ROUNDS = int(os.environ.get("DS4_FUZZ_ROUNDS", "1"))  # independent seeds (short runs stay clear of a
# Hypothesis-internal span-bookkeeping assertion seen in one long mutation run)


def _script(req: Request) -> str:
    return "short answer</think>ok" if req.thinking else "ok"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from ds4.tools.make_model import ensure_tiny_model

    return Tokenizer.from_gguf(ensure_tiny_model())


def test_fuzz_openapi_no_5xx(tok: Tokenizer) -> None:
    statuses: Counter[int] = Counter()
    with fake_server(tok, _script, ctx=4096, max_tokens_limit=64) as srv:
        schema = schemathesis.openapi.from_url(srv.base + "/openapi.json")
        for result in schema.get_all_operations():
            op = result.ok()
            for mode, round_ in itertools.product(
                (GenerationMode.POSITIVE, GenerationMode.NEGATIVE), range(ROUNDS)
            ):

                @seed(1000 * round_ + 1)
                @settings(
                    max_examples=EXAMPLES,
                    deadline=None,
                    database=None,
                    suppress_health_check=list(HealthCheck),
                )
                @given(case=op.as_strategy(generation_mode=mode))
                def run(case) -> None:
                    resp = case.call(base_url=srv.base, timeout=30)
                    statuses[resp.status_code] += 1
                    assert resp.status_code < 500, (case.method, case.path, case.body, resp.text[:500])

                try:
                    run()
                except Unsatisfiable:  # nothing to violate (e.g. GET without parameters)
                    assert mode == GenerationMode.NEGATIVE
        with httpx.Client(base_url=srv.base, timeout=30) as h:  # still alive and serving
            r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
    total = sum(statuses.values())
    print(f"fuzz: {total} requests, statuses {dict(sorted(statuses.items()))}")
    assert total >= 4 * EXAMPLES * ROUNDS
