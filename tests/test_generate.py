"""The generation API (ds4.engine.generate): events, stop strings, thinking split, UTF-8, limits, cancel.

Oracles: the official-tiny fixture (the official inference code's greedy continuation), the real
tokenizer's plain decode, and expected texts computed directly with str.find / str.partition.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

import pytest
import torch
from conftest import OFFICIAL_TINY
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4.engine import Engine
from ds4.engine.generate import (
    Finish,
    GenerateParams,
    Prefilled,
    ReasoningDelta,
    TextDelta,
    TextRouter,
    TokenEvent,
    generate,
)
from ds4.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def engine(official_gguf):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: extra threads only add contention
    with Engine.open(official_gguf) as eng:
        yield eng
    torch.set_num_threads(threads)


def official_case(case_id: str) -> dict:
    cases = json.loads((OFFICIAL_TINY / "cases.json").read_text())["cases"]
    return next(c for c in cases if c["id"] == case_id)


def split_events(events: Sequence[object]) -> tuple[str, str, list[int], Finish]:
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    tokens = [e.token for e in events if isinstance(e, TokenEvent)]
    assert isinstance(events[-1], Finish) and sum(isinstance(e, Finish) for e in events) == 1
    return reasoning, text, tokens, events[-1]


# ---- a scripted token source: a stand-in session whose logits pick the next scripted token ----------


class ScriptedSession:
    def __init__(self, engine: Engine, script: Sequence[int], ctx: int = 4096) -> None:
        self.engine = engine
        self.script = list(script)
        self.ctx = ctx
        self.pos = 0  # index of the next scripted token
        self.evals = 0

    @property
    def logits(self) -> torch.Tensor:
        x = torch.zeros(self.engine.config.n_vocab)
        x[self.script[self.pos]] = 10.0
        return x

    def sync(self, tokens: Sequence[int], progress=None) -> int:
        return len(tokens)

    def eval(self, token: int) -> torch.Tensor:
        assert token == self.script[self.pos]
        self.pos += 1
        self.evals += 1
        return self.logits


def run_script(engine, script, prompt=(0,), **kw) -> tuple[list[object], ScriptedSession]:
    sess = ScriptedSession(engine, script)
    params = GenerateParams(max_tokens=kw.pop("max_tokens", 1000), sampling=GREEDY, **kw)
    return list(generate(sess, list(prompt), params)), sess


class HeldSession:
    """A session that already holds its prompt (the server prefilled it): sync must not run."""

    def __init__(self, engine: Engine, prompt: Sequence[int], ctx: int = 4096) -> None:
        self.engine, self.ctx, self.tokens = engine, ctx, list(prompt)
        self.logits = torch.zeros(engine.config.n_vocab)

    def sync(self, tokens: Sequence[int], progress=None) -> int:
        raise AssertionError("a prefilled session must not be synced again")

    def eval(self, token: int) -> torch.Tensor:
        self.tokens.append(int(token))
        return self.logits


# ---- the text router on its own (pure strings) ----------------------------------------------------------


def expected_split(raw: str, stops: Sequence[str], thinking: bool) -> tuple[str, str]:
    cuts = [i for i in (raw.find(s) for s in stops if s) if i >= 0]
    cut = raw[: min(cuts)] if cuts else raw
    if not thinking:
        return "", cut
    if cut.startswith("<think>"):
        cut = cut[len("<think>") :]
    reasoning, sep, text = cut.partition("</think>")
    return reasoning, text


@settings(max_examples=300, deadline=None)
@given(
    raw=st.text(alphabet="ab</>thinkEND\n é", max_size=40),
    stops=st.lists(st.text(alphabet="ab</>END", min_size=1, max_size=5), max_size=3),
    thinking=st.booleans(),
    cuts=st.lists(st.integers(0, 40), max_size=12),
)
def test_router_any_split_matches_direct_computation(raw, stops, thinking, cuts):
    pieces, last = [], 0
    for c in sorted(set(min(c, len(raw)) for c in cuts)) + [len(raw)]:
        pieces.append(raw[last:c])
        last = c
    router = TextRouter(stops, thinking)
    want_reasoning, want_text = expected_split(raw, stops, thinking)
    got = {"reasoning": "", "text": ""}
    for piece in pieces:
        for kind, text in router.push(piece):
            got[kind] += text
        # never shows anything that the final answer will not contain (no partial stop string leaks)
        assert want_reasoning.startswith(got["reasoning"]) and want_text.startswith(got["text"])
        if router.stopped:
            break
    for kind, text in router.finish():
        got[kind] += text
    assert (got["reasoning"], got["text"]) == (want_reasoning, want_text)
    assert (router.reasoning, router.text) == (want_reasoning, want_text)


def test_router_holds_partial_stop_then_releases():
    router = TextRouter(["</END>"], thinking=False)
    assert router.push("hello </") == [("text", "hello ")]
    assert router.push("EN") == []
    assert router.push("x") == [("text", "</ENx")]
    assert router.push(" </END> tail") == [("text", " ")]
    assert router.stopped and router.stop_string == "</END>"


# ---- scripted generations (real tokenizer) --------------------------------------------------------------


def test_stop_string_across_token_boundaries(engine):
    tok = engine.tokenizer
    script = tok.encode("hello world, the end is near") + [tok.eos_id]
    stop = "o wor"
    assert all(stop not in tok.decode([t]) for t in script)  # the stop really spans tokens
    events, sess = run_script(engine, script, stop=(stop, "never"))
    reasoning, text, tokens, fin = split_events(events)
    assert (reasoning, text) == ("", "hell")
    assert fin.reason == "stop" and fin.stop_string == stop and not fin.eos
    assert tok.decode(tokens).startswith("hello wor")  # generation ended at the token completing the stop
    assert sess.evals == len(tokens) - 1  # the token that completed the stop was not evaluated


def test_reasoning_content_split_with_special_think_end(engine):
    tok = engine.tokenizer
    script = tok.encode("Let me think.") + [tok.think_end_id] + tok.encode("Answer: 42") + [tok.eos_id]
    events, _ = run_script(engine, script, prompt=[tok.bos_id, tok.think_start_id])
    reasoning, text, tokens, fin = split_events(events)
    assert (reasoning, text) == ("Let me think.", "Answer: 42")
    assert (fin.reasoning, fin.text, fin.reason, fin.eos) == (reasoning, text, "stop", True)
    assert tokens == script[:-1] and fin.usage.generated_tokens == len(script) - 1
    # every reasoning delta comes before the first text delta
    kinds = [type(e) for e in events if isinstance(e, (ReasoningDelta, TextDelta))]
    assert kinds == sorted(kinds, key=lambda k: k is TextDelta)


def test_no_thinking_prompt_keeps_think_tags_as_text(engine):
    tok = engine.tokenizer
    script = tok.encode("a</think>b") + [tok.eos_id]
    events, _ = run_script(engine, script, prompt=[tok.bos_id, tok.think_end_id])
    assert split_events(events)[:2] == ("", "a</think>b")


def test_unclosed_thinking_stays_reasoning_at_length(engine):
    tok = engine.tokenizer
    script = tok.encode("still thinking about it") + [tok.eos_id]
    events, _ = run_script(engine, script, prompt=[tok.think_start_id], max_tokens=3)
    reasoning, text, tokens, fin = split_events(events)
    assert fin.reason == "length" and len(tokens) == 3 and text == ""
    assert reasoning == tok.decode(script[:3])


def test_utf8_never_split(engine):
    tok = engine.tokenizer
    want = "Ünïcödé 🦜🪿𝔘𝔫𝔦 — 日本語 ꙮ"
    script = tok.encode(want) + [tok.eos_id]
    partial = [t for t in script[:-1] if not _valid_utf8(tok.token_bytes(t))]
    assert partial, "the text should contain tokens that hold part of a character"
    events, _ = run_script(engine, script)
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert "".join(deltas) == want and "\ufffd" not in "".join(deltas)
    pieces = [e.piece for e in events if isinstance(e, TokenEvent)]
    assert "".join(pieces) == want and "" in pieces  # a partial character's token shows nothing yet


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# ---- the real model (official-tiny) -------------------------------------------------------------------


def test_greedy_matches_official_continuation(engine):
    case = official_case("short")
    prompt, want = case["tokens"][: case["prompt_len"]], case["tokens"][case["prompt_len"] :]
    sess = engine.session(64)
    params = GenerateParams(max_tokens=len(want), sampling=GREEDY, stop_at_eos=False)
    events = list(generate(sess, prompt, params))
    reasoning, text, tokens, fin = split_events(events)
    assert tokens == want
    assert fin.reason == "length" and fin.usage.generated_tokens == len(want)
    assert text == engine.tokenizer.decode(want) and reasoning == ""
    assert len(sess) == len(prompt) + len(want) - 1  # the last token is not evaluated
    assert fin.usage.prompt_tokens == fin.usage.prefilled_tokens == len(prompt)
    assert fin.timing.prefill_tps > 0 and fin.timing.decode_tps > 0 and fin.timing.ttft_s is not None


def test_second_turn_reuses_the_held_prefix(engine):
    case = official_case("short")
    prompt = case["tokens"][: case["prompt_len"]]
    sess = engine.session(64)
    first = list(generate(sess, prompt, GenerateParams(max_tokens=3, sampling=GREEDY, stop_at_eos=False)))
    gen = list(first[-1].tokens)
    follow = prompt + gen + [engine.tokenizer.eos_id, engine.tokenizer.user_id]
    fin = list(generate(sess, follow, GenerateParams(max_tokens=1, sampling=GREEDY)))[-1]
    # the session held prompt + gen[:-1]; only gen[-1], EOS and User are new
    assert (fin.usage.reused_tokens, fin.usage.prefilled_tokens) == (len(prompt) + 2, 3)


def test_max_tokens_and_context_clamp(engine):
    prompt = official_case("short")["tokens"][:3]
    fin = list(generate(engine.session(64), prompt, GenerateParams(max_tokens=0)))[-1]
    assert fin.reason == "length" and fin.usage.generated_tokens == 0
    events = list(generate(engine.session(6), prompt, GenerateParams(max_tokens=100, stop_at_eos=False)))
    assert events[-1].reason == "length" and events[-1].usage.generated_tokens == 3  # ctx 6 - prompt 3


def test_cancel_within_one_token(engine):
    prompt = official_case("short")["tokens"][:3]
    sess = engine.session(64)
    cancel = threading.Event()
    events = []
    for ev in generate(sess, prompt, GenerateParams(max_tokens=50, sampling=GREEDY), cancel=cancel):
        events.append(ev)
        if isinstance(ev, TokenEvent):
            cancel.set()
    _, _, tokens, fin = split_events(events)
    assert fin.reason == "cancelled" and len(tokens) == 1
    assert sess.stats.decode_tokens == 1  # the first token was evaluated, nothing after the cancel

    sess2 = engine.session(64)
    fin = list(generate(sess2, prompt, GenerateParams(), cancel=lambda: True))[-1]
    assert fin.reason == "cancelled" and len(sess2) == 0 and fin.usage.prefilled_tokens == 0


def test_logits_hook_can_force_greedy_and_mask(engine):
    prompt = official_case("short")["tokens"][:3]
    want = official_case("short")["tokens"][3:5]
    calls = []

    def force_greedy(logits, params):
        calls.append(params.temperature)
        return logits, SamplingParams(temperature=0.0)

    params = GenerateParams(max_tokens=2, sampling=SamplingParams(temperature=1.0, seed=7))
    tokens = list(generate(engine.session(64), prompt, params, logits_hook=force_greedy))[-1].tokens
    assert list(tokens) == want and calls == [1.0, 1.0]

    def only_42(logits, params):
        masked = torch.full_like(logits, float("-inf"))
        masked[42] = 0.0
        return masked, params

    tokens = list(generate(engine.session(64), prompt, params, logits_hook=only_42))[-1].tokens
    assert list(tokens) == [42, 42]


def test_prompt_too_long_is_an_error_event(engine):
    events = list(generate(engine.session(4), [0, 1, 2, 3, 4], GenerateParams()))
    assert len(events) == 1 and events[0].reason == "error"
    assert "prompt exceeds context" in events[0].error and isinstance(events[0].exception, ValueError)


def test_seed_reproduces_sampled_tokens(engine):
    prompt = official_case("short")["tokens"][:3]

    def run(seed: int) -> tuple[int, ...]:
        params = GenerateParams(max_tokens=6, sampling=SamplingParams(temperature=1.0, min_p=0.0, seed=seed))
        return list(generate(engine.session(64), prompt, params))[-1].tokens

    assert run(1234) == run(1234)
    assert len({run(s) for s in (1, 2, 3)}) > 1  # different seeds do reach different continuations


# ---- the server's seams: a caller-side prefill, a token picker, evaluating the last token --------------


def test_prefilled_session_decodes_only_and_reports_the_callers_prefill(engine):
    tok = engine.tokenizer
    script = tok.encode("ok then") + [tok.eos_id]
    prompt = [tok.bos_id, 5, 6, 7]
    sess = HeldSession(engine, prompt)
    seen: list[float] = []

    def pick(logits, params, rng) -> int:  # ignores the logits: the script decides
        seen.append(params.temperature)
        return script[len(sess.tokens) - len(prompt)]

    params = GenerateParams(sampling=SamplingParams(temperature=0.7))
    events = list(generate(sess, prompt, params, prefilled=Prefilled(3, 0.25), next_token=pick))
    _, text, tokens, fin = split_events(events)
    assert (text, tokens, fin.reason, fin.eos) == ("ok then", script[:-1], "stop", True)
    assert sess.tokens == prompt + script[:-1] and seen == [0.7] * len(script)
    assert (fin.usage.prompt_tokens, fin.usage.prefilled_tokens, fin.usage.reused_tokens) == (4, 3, 1)
    assert fin.timing.prefill_s == 0.25 and fin.timing.ttft_s >= 0.25  # TTFT counts the caller's prefill


def test_eval_last_keeps_every_generated_token_in_the_session(engine):
    prompt = [engine.tokenizer.bos_id]
    for eval_last, held in ((False, 2), (True, 3)):
        sess = HeldSession(engine, prompt)
        params = GenerateParams(max_tokens=3, stop_at_eos=False)
        fin = list(
            generate(
                sess,
                prompt,
                params,
                prefilled=Prefilled(1, 0.0),
                next_token=lambda *a: 9,
                eval_last=eval_last,
            )
        )[-1]
        assert fin.reason == "length" and fin.tokens == (9, 9, 9) and sess.tokens == prompt + [9] * held


def test_prefilled_cancel_is_checked_before_the_first_token(engine):
    prompt = [engine.tokenizer.bos_id]
    sess = HeldSession(engine, prompt)
    fin = list(generate(sess, prompt, GenerateParams(), prefilled=Prefilled(1, 0.0), cancel=lambda: True))[-1]
    assert fin.reason == "cancelled" and fin.tokens == () and sess.tokens == prompt
