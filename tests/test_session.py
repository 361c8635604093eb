"""Engine + Session on the official-tiny oracle model: sync with prefix reuse / rebuild, eval, errors.

The oracle is the official DeepSeek V4 code (fixture `split` case: 150 prompt tokens, then 53 more as a
resumed chunk, then 2 decode steps), plus a fresh one-pass prefill of the same prompt.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import OFFICIAL_TINY

import ds4
from ds4.engine import ContextError
from ds4.errors import Ds4Error

TOL = 5e-3  # prefill-vs-decode / official-vs-ours tolerance on logits (fixture README)


@pytest.fixture(scope="module")
def engine(official_gguf):
    eng = ds4.Engine.open(official_gguf, backend="cpu")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def split_case():
    case = next(
        c for c in json.loads((OFFICIAL_TINY / "cases.json").read_text())["cases"] if c["id"] == "split"
    )
    with np.load(OFFICIAL_TINY / "logits.npz") as z:
        return case, torch.from_numpy(z[case["logits_key"]])


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_engine_surface(engine):
    cfg = engine.config
    assert cfg is engine.model_file.config
    assert (cfg.n_layer, cfg.head_dim, cfg.window) == (7, 128, 16)
    ids = engine.tokenizer.encode("Hello world")
    assert ids and engine.tokenizer.decode(ids) == "Hello world"


def test_extension_prefills_only_the_suffix(engine, split_case):
    case, want = split_case
    tokens = case["tokens"]
    a, b = case["chunks"]
    s = engine.session(ctx=512)
    assert s.sync(tokens[:a]) == a
    assert _maxdiff(s.logits, want[0]) < TOL
    assert s.sync(tokens[:b]) == b - a  # only the 53-token suffix runs
    assert s.last_prefill == b - a
    assert (s.stats.prefill_tokens, s.stats.reused_tokens, s.stats.rebuilds) == (b, a, 0)
    assert len(s) == b and s.state.n_tokens == b
    extended = s.logits.clone()
    assert _maxdiff(extended, want[1]) < TOL  # official: the 53 tokens one at a time

    fresh = engine.session(ctx=512)
    assert fresh.sync(tokens[:b]) == b
    assert _maxdiff(extended, fresh.logits) < TOL  # suffix pass == one-pass prefill of the whole prompt

    # same prompt again: nothing to do, logits untouched
    assert s.sync(tokens[:b]) == 0
    assert torch.equal(s.logits, extended)

    # decode continues on the extended session (the recorded argmax tokens)
    for i, tok in enumerate(tokens[b : b + case["decode_steps"]]):
        out = s.eval(tok)
        assert out is s.logits and out.dtype == torch.float32 and out.shape == (engine.config.n_vocab,)
        assert _maxdiff(out, want[2 + i]) < TOL
        assert int(out.argmax()) == case["steps"][2 + i]["argmax"]
    assert s.stats.decode_tokens == case["decode_steps"]


def test_non_prefix_prompt_rebuilds(engine, split_case):
    tokens = split_case[0]["tokens"][:60]
    s = engine.session(ctx=256)
    s.sync(tokens)
    other = list(tokens)
    other[30] = (other[30] + 1) % engine.config.n_vocab  # diverges in the middle
    assert s.sync(other) == len(other)
    assert s.stats.rebuilds == 1 and s.tokens == other
    fresh = engine.session(ctx=256)
    fresh.sync(other)
    assert torch.equal(s.logits, fresh.logits)  # rebuild is a plain fresh prefill

    # a prompt that is a strict prefix of what is held cannot rewind the KV: rebuild too
    assert s.sync(other[:40]) == 40
    assert s.stats.rebuilds == 2 and len(s) == 40 and s.state.n_tokens == 40
    fresh = engine.session(ctx=256)
    fresh.sync(other[:40])
    assert torch.equal(s.logits, fresh.logits)


def test_progress_callback(engine):
    calls = []
    s = engine.session(ctx=64)
    s.sync([0, 5, 6, 7], progress=lambda done, total: calls.append((done, total)))
    assert calls[0] == (0, 4) and calls[-1] == (4, 4)


def test_context_limits(engine):
    s = engine.session(ctx=8)
    with pytest.raises(ContextError, match=r"prompt exceeds context: 8 tokens, ctx 8"):
        s.sync(list(range(8)))
    s.sync(list(range(7)))  # shorter than ctx is fine
    s.eval(3)  # the 8th token fills the context
    with pytest.raises(ContextError, match=r"context is full: the session holds 8 of 8"):
        s.eval(3)
    assert len(s) == 8


def test_bad_input(engine):
    s = engine.session(ctx=16)
    with pytest.raises(ValueError, match="no tokens yet"):
        s.logits  # noqa: B018
    with pytest.raises(ValueError, match="at least one token"):
        s.sync([])
    with pytest.raises(ValueError, match=r"token id out of range: expected 0 <= id < 129280, got 129280"):
        s.sync([0, 129280])
    with pytest.raises(ValueError, match="token id out of range"):
        s.eval(-1)
    with pytest.raises(ContextError, match="at least 2"):
        engine.session(ctx=1)


def test_open_errors(tmp_path):
    with pytest.raises(Ds4Error, match="backend 'metal'"):
        ds4.Engine.open("x.gguf", backend="metal")
    with pytest.raises(Ds4Error):
        ds4.Engine.open(tmp_path / "missing.gguf")


def test_rewind_to_prompt_checkpoint(engine, split_case):
    """Turn 2 extends the turn-1 prompt, not its decoded tokens: rewind to the checkpoint, prefill more."""
    prompt = split_case[0]["tokens"][:50]
    s = engine.session(ctx=256)
    s.sync(prompt)
    ref = engine.session(ctx=256, checkpoint=False)
    ref.sync(prompt)
    for tok in (11, 12, 13):  # decoded answer, not part of the next prompt
        s.eval(tok)
    turn2 = prompt + [21, 22, 23, 24]
    assert s.sync(turn2) == 4
    assert (s.stats.checkpoint_hits, s.stats.rebuilds) == (1, 0)
    assert ref.sync(turn2) == 4  # uninterrupted extension of the same prompt
    assert torch.equal(s.logits, ref.logits)

    # without a checkpoint the same move rebuilds
    nock = engine.session(ctx=256, checkpoint=False)
    nock.sync(prompt)
    nock.eval(11)
    assert nock.sync(turn2) == len(turn2) and nock.stats.rebuilds == 1


class InPlaceState:
    """A CPU stand-in for a pooled device state: same object for life, everything in place (the device
    state contract: reset / copy_from / to_cpu / load_cpu, as ds4.model.cuda.state.DeviceKVState has)."""

    def __init__(self, model, ctx: int) -> None:
        self.model, self.ctx, self.inner = model, ctx, model.new_state(ctx)

    @property
    def layers(self):
        return self.inner.layers

    @property
    def n_tokens(self) -> int:
        return self.inner.n_tokens

    def reset(self) -> None:
        self.inner = self.model.new_state(self.ctx)

    def copy_from(self, other: InPlaceState) -> None:
        self.inner = other.inner.clone()

    def to_cpu(self):
        return self.inner.clone()

    def load_cpu(self, state) -> None:
        self.inner = state.clone()

    def clone(self):
        raise AssertionError("a pooled state is never cloned: the session copies into its own buffers")


def test_session_with_stepper_forward_and_pooled_states_works_in_place(engine) -> None:
    from ds4.engine.session import Session
    from ds4.engine.stepper import Stepper

    model = engine.model

    def fwd(state, tokens):  # the model sees the wrapped CPU state
        return model.forward(state.inner, tokens)

    class Ops:
        forward = staticmethod(fwd)

        @staticmethod
        def decode_batch(states, tokens):
            return model.decode_batch([s.inner for s in states], tokens)

    ctx, prompt = 64, list(range(5, 25))
    stepper = Stepper(Ops())
    try:
        live, cp = InPlaceState(model, ctx), InPlaceState(model, ctx)
        s = Session(engine, ctx, state=live, checkpoint_state=cp, forward=stepper.forward)
        ref = engine.session(ctx)
        for sess in (s, ref):
            sess.sync(prompt)
            sess.eval(7)
            sess.eval(8)
            sess.sync([*prompt, 30, 31])  # not an extension of prompt+7+8: rewinds to the prompt checkpoint
        assert s.stats.checkpoint_hits == ref.stats.checkpoint_hits == 1
        assert torch.equal(s.logits, ref.logits)
        blob = ref.snapshot()
        s.reset()
        assert s.tokens == [] and s.state is live and live.n_tokens == 0
        s.restore(blob)
        assert s.state is live and s.tokens == ref.tokens and torch.equal(s.logits, ref.logits)
        assert torch.equal(s.eval(9), ref.eval(9))
        assert s._checkpoint.state is cp  # the checkpoint lives in its preallocated buffer
    finally:
        stepper.stop()
