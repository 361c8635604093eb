"""DS4Model.decode_batch equals running each session alone (issue 8 groundwork).

8 sessions with different prompt lengths (crossing the raw window, ratio-4 / ratio-32 (official-tiny) or
ratio-128 (tiny synthetic) row boundaries and the indexer's top-k threshold) decode greedily together; the
oracle is the single-session `forward` path, token by token, on independent states.

With the model's FP8 / FP4 round trips on, the greedy tokens must agree; with them off (tests/_roundtrips.py),
the logits too, within float32 summation-order noise. The round trips are steps: the batched GEMMs sum in
another order than one row's (how depends on the CPU's SIMD width), an ulp moves an element across a step
and the logits by far more than noise downstream (this AMD EPYC / AVX-512 host, round trips on: 9.4e-3 on
the tiny synthetic model, 1.2e-4 on official-tiny; 0 tokens changed).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _gguf_model import load_model
from _roundtrips import round_trips_off

STEPS = 12
LOGIT_TOL = 1e-4


def _lengths(cfg) -> list[int]:
    ratios = [r for r in cfg.compress_ratios[: cfg.n_layer] if r]
    big = max(ratios)
    # 1 token, around the window, around the indexer's top-k threshold, just before a big-ratio boundary
    # (so the decode steps complete that window), and across it.
    return [1, cfg.window - 3, cfg.window + 5, 4 * cfg.indexer_topk + 2, big - 5, big + 1, big + 9, 7]


def _run_check(model, seed: int, logits_too: bool) -> None:
    cfg = model.cfg
    rng = np.random.default_rng(seed)
    lengths = _lengths(cfg)
    ctx = max(lengths) + STEPS + 4
    prompts = [rng.integers(0, cfg.n_vocab, n).tolist() for n in lengths]

    # Each alone: prefill, then greedy decode one token at a time through the single-session path.
    alone_tokens, alone_logits = [], []
    for p in prompts:
        st = model.new_state(ctx)
        lg = model.forward(st, p)
        toks, lgs = [], []
        for _ in range(STEPS):
            t = int(lg.argmax())
            toks.append(t)
            lg = model.forward(st, [t])
            lgs.append(lg)
        alone_tokens.append(toks)
        alone_logits.append(torch.stack(lgs))

    # Together: same prefills, then one decode_batch per step for all 8.
    states = [model.new_state(ctx) for _ in prompts]
    logits = torch.stack([model.forward(st, p) for st, p in zip(states, prompts, strict=True)])  # [B, V]
    got_tokens, got_logits = [[] for _ in prompts], []
    for _ in range(STEPS):
        nxt = logits.argmax(-1).tolist()
        for b, t in enumerate(nxt):
            got_tokens[b].append(t)
        logits = model.decode_batch(states, nxt)
        got_logits.append(logits)
    got = torch.stack(got_logits, dim=1)  # [B, STEPS, V]

    assert got_tokens == alone_tokens
    diff = float((got - torch.stack(alone_logits)).abs().max())
    print(f"batched vs alone: max |dlogit| {diff:.2e}")
    if logits_too:
        assert diff <= LOGIT_TOL, f"max |dlogit| {diff:.3e} > {LOGIT_TOL}"
    assert [s.n_tokens for s in states] == [n + STEPS for n in lengths]


@pytest.mark.parametrize("round_trips", [True, False], ids=["round-trips", "no-round-trips"])
def test_official_tiny_batch_equals_alone(official_gguf, monkeypatch, round_trips: bool):
    calls = None if round_trips else round_trips_off(monkeypatch)
    _run_check(load_model(official_gguf), seed=8, logits_too=not round_trips)
    assert calls is None or (calls["fp8"] > 0 and calls["fp4"] > 0), (
        f"a round trip site was not live: {calls}"
    )


@pytest.mark.parametrize("round_trips", [True, False], ids=["round-trips", "no-round-trips"])
def test_tiny_synthetic_batch_equals_alone(monkeypatch, round_trips: bool):
    from ds4.tools.make_model import ensure_tiny_model

    calls = None if round_trips else round_trips_off(monkeypatch)
    _run_check(load_model(ensure_tiny_model()), seed=9, logits_too=not round_trips)
    assert calls is None or (calls["fp8"] > 0 and calls["fp4"] > 0), (
        f"a round trip site was not live: {calls}"
    )


def test_decode_batch_rejects_bad_input(official_gguf):
    model = load_model(official_gguf)
    a, b = model.new_state(8), model.new_state(8)
    with pytest.raises(ValueError, match="one token per state"):
        model.decode_batch([a, b], [1])
    with pytest.raises(ValueError, match="same state twice"):
        model.decode_batch([a, a], [1, 2])
    with pytest.raises(ValueError, match="out of range"):
        model.decode_batch([a, b], [1, model.cfg.n_vocab])
    assert a.n_tokens == b.n_tokens == 0
