"""ds4.engine.scheduler: routing by prefix, LRU eviction, bounded prefill per step, cancel, fairness (fake
backend), and 8 concurrent requests on the real CPU engine equal to each alone (tiny synthetic model)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

import pytest

from ds4.engine.scheduler import Finished, PrefixIndex, Request, Scheduler, Started, Token

# ---- a pure-Python fake model ------------------------------------------------------------------------


def fake_next(history: Sequence[int]) -> int:
    """The fake model's greedy next token after `history` (its "logits" are the history itself)."""
    return (sum((i + 1) * t for i, t in enumerate(history)) * 7 + len(history)) % 1000


class FakeSession:
    def __init__(self) -> None:
        self.tokens: list[int] = []


class FakeBackend:
    """Sessions are token lists; logits are the history tuple. Records every call for the tests."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []  # ("prefill", n tokens) / ("decode", batch size) / ...
        self.fail_prefill = False

    def new_session(self) -> FakeSession:
        return FakeSession()

    def reset(self, session: FakeSession) -> None:
        self.calls.append(("reset", len(session.tokens)))
        session.tokens = []

    def prefill(self, session: FakeSession, tokens: Sequence[int]) -> tuple[int, ...]:
        if self.fail_prefill:
            raise RuntimeError("boom")
        self.calls.append(("prefill", len(tokens)))
        session.tokens += list(tokens)
        return tuple(session.tokens)

    def decode_batch(self, sessions: Sequence[FakeSession], tokens: Sequence[int]) -> list[tuple[int, ...]]:
        assert len({id(s) for s in sessions}) == len(sessions)
        self.calls.append(("decode", len(sessions)))
        out = []
        for s, t in zip(sessions, tokens, strict=True):
            s.tokens.append(t)
            out.append(tuple(s.tokens))
        return out

    def snapshot(self, session: FakeSession) -> tuple[int, ...]:
        return tuple(session.tokens)

    def restore(self, session: FakeSession, blob: tuple[int, ...]) -> tuple[int, ...]:
        self.calls.append(("restore", len(blob)))
        session.tokens = list(blob)
        return tuple(blob)

    def drain(self) -> list[tuple[str, int]]:
        out, self.calls = self.calls, []
        return out


def alone(prompt: list[int], max_tokens: int, stop: frozenset[int] = frozenset()) -> list[int]:
    """The independent oracle: greedy generation of one request on its own."""
    hist, out = list(prompt), []
    while len(out) < max_tokens:
        t = fake_next(hist)
        if t in stop:
            break
        out.append(t)
        hist.append(t)
    return out


def make(slots: int = 4, budget: int = 16, ctx: int = 10_000, **kw):
    be = FakeBackend()
    events: list = []
    sched = Scheduler(
        be,
        sampler=lambda req, logits: fake_next(logits),
        on_event=events.append,
        slots=slots,
        prefill_budget=budget,
        ctx=ctx,
        **kw,
    )
    return sched, be, events


def finished(events: list) -> dict[str, Finished]:
    return {e.request_id: e for e in events if isinstance(e, Finished)}


def started(events: list) -> dict[str, Started]:
    return {e.request_id: e for e in events if isinstance(e, Started)}


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + 17 * i) % 997 for i in range(n)]


# ---- tests -----------------------------------------------------------------------------------------


def test_import_leaves_torch_out():
    code = "import sys, ds4.engine.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_concurrent_outputs_equal_each_alone():
    sched, _, events = make(slots=4, budget=7)
    reqs = [Request(f"r{i}", prompt(i, 3 + 9 * i), max_tokens=5 + i) for i in range(10)]  # > slots: queue
    for r in reqs:
        sched.submit(r)
    sched.run()
    fin = finished(events)
    for r in reqs:
        assert fin[r.id].reason == "length"
        assert list(fin[r.id].tokens) == alone(r.prompt, r.max_tokens)
        assert [e.token for e in events if isinstance(e, Token) and e.request_id == r.id] == list(
            fin[r.id].tokens
        )


def test_routing_by_longest_prefix():
    sched, be, events = make(slots=3)
    a, b = prompt(1, 10), prompt(2, 20)
    sched.submit(Request("a", a, max_tokens=4))
    sched.submit(Request("b", b, max_tokens=4))
    sched.run()
    slot_a = started(events)["a"].slot
    held_a = list(sched.slots[slot_a].tokens)
    assert held_a == a + list(finished(events)["a"].tokens[:-1])  # the last sampled token is never evaluated

    # Extends a's held tokens: same slot, only the new suffix is prefilled.
    cont = held_a + [5, 6, 7]
    be.drain()
    sched.submit(Request("c", cont, max_tokens=3))
    sched.run()
    st, fin = started(events)["c"], finished(events)["c"]
    assert (st.slot, st.reused_tokens, fin.prefilled_tokens) == (slot_a, len(held_a), 3)
    assert list(fin.tokens) == alone(cont, 3)
    assert ("reset", len(held_a)) not in be.drain()

    # Shares only a part of a's tokens: not an extension, so it goes to the empty third slot.
    sched.submit(Request("d", a[:5] + [1, 2], max_tokens=2))
    sched.run()
    assert started(events)["d"].slot not in (slot_a, started(events)["b"].slot)
    assert started(events)["d"].reused_tokens == 0


def test_prefix_index_picks_longest():
    idx = PrefixIndex()
    idx.add(0, [1, 2])
    idx.add(1, [1, 2, 3, 4])
    idx.add(2, [1, 2, 3, 9])
    assert idx.longest_prefix([1, 2, 3, 4, 5]) == (1, 4)
    assert idx.longest_prefix([1, 2, 3]) == (0, 2)
    assert idx.longest_prefix([7]) == (None, 0)
    idx.remove(1)
    assert idx.longest_prefix([1, 2, 3, 4, 5]) == (0, 2)
    idx.remove(0)
    idx.remove(2)
    assert idx.longest_prefix([1, 2, 3, 9]) == (None, 0) and idx._root == {}


def test_lru_eviction_order():
    evicted: list[list[int]] = []
    sched, _, events = make(slots=2, evict=lambda slot: evicted.append(list(slot.tokens)))
    sched.submit(Request("a", prompt(1, 6), max_tokens=2))
    sched.run()
    sched.submit(Request("b", prompt(2, 6), max_tokens=2))
    sched.run()
    held_a = list(sched.slots[started(events)["a"].slot].tokens)
    sched.submit(Request("a2", held_a + [3], max_tokens=2))  # touches a's slot: b is now least recent
    sched.run()
    held_b = list(sched.slots[started(events)["b"].slot].tokens)
    sched.submit(Request("c", prompt(3, 6), max_tokens=2))
    sched.run()
    assert evicted == [held_b]
    assert started(events)["c"].slot == started(events)["b"].slot
    sched.submit(Request("d", prompt(4, 6), max_tokens=2))  # now a's slot is the LRU one
    sched.run()
    assert len(evicted) == 2 and evicted[1][: len(held_a)] == held_a
    assert sched.evictions == 2
    assert all(f.reason == "length" for f in finished(events).values())


def test_33rd_request_evicts_an_idle_session():
    evicted: list[int] = []
    sched, _, events = make(slots=32, evict=lambda slot: evicted.append(slot.index))
    for i in range(32):
        sched.submit(Request(f"r{i}", prompt(i, 4), max_tokens=2))
    sched.run()
    assert all(s.tokens for s in sched.slots) and not evicted
    sched.submit(Request("r32", prompt(99, 4), max_tokens=3))
    sched.run()
    fin = finished(events)["r32"]
    assert fin.reason == "length" and list(fin.tokens) == alone(prompt(99, 4), 3)
    assert evicted == [started(events)["r0"].slot]  # the least recently used one


def test_long_prefill_never_blocks_decode():
    budget = 8
    sched, be, events = make(slots=4, budget=budget)
    sched.submit(Request("run", prompt(1, 4), max_tokens=50))
    sched.step()  # "run" prefills and samples its first token
    be.drain()
    sched.submit(Request("long", prompt(2, 100), max_tokens=2))
    steps = 0
    while "long" not in finished(events):
        n_tokens_before = sum(isinstance(e, Token) and e.request_id == "run" for e in events)
        sched.step()
        steps += 1
        calls = be.drain()
        assert sum(n for kind, n in calls if kind == "prefill") <= budget
        assert calls[0][0] == "decode"  # the running stream decodes first, every step
        assert sum(isinstance(e, Token) and e.request_id == "run" for e in events) == n_tokens_before + 1
    assert steps >= 100 // budget
    assert list(finished(events)["long"].tokens) == alone(prompt(2, 100), 2)


def test_prefill_share_split_in_arrival_order():
    sched, be, events = make(slots=4, budget=10)
    sched.submit(Request("x", prompt(1, 15), max_tokens=1))
    sched.submit(Request("y", prompt(2, 15), max_tokens=1))
    sched.step()
    assert be.drain() == [("prefill", 10)]  # x first, the whole budget
    sched.step()
    assert be.drain() == [("prefill", 5), ("prefill", 5)]  # x finishes, y gets the rest
    sched.step()
    assert be.drain() == [("prefill", 10)]
    assert set(finished(events)) == {"x", "y"}


def test_fairness_one_token_per_step_each():
    sched, _, events = make(slots=4, budget=100)
    for i in range(3):
        sched.submit(Request(f"r{i}", prompt(i, 5), max_tokens=20))
    sched.step()  # all three prefill and sample their first token
    for _ in range(10):
        before = len(events)
        sched.step()
        got = sorted(e.request_id for e in events[before:] if isinstance(e, Token))
        assert got == ["r0", "r1", "r2"]


def test_fifo_when_all_slots_busy():
    sched, _, events = make(slots=1)
    for i in range(3):
        sched.submit(Request(f"r{i}", prompt(i, 3), max_tokens=2))
    sched.run()
    order = [e.request_id for e in events if isinstance(e, Started)]
    assert order == ["r0", "r1", "r2"]
    assert all(list(finished(events)[f"r{i}"].tokens) == alone(prompt(i, 3), 2) for i in range(3))


def test_cancel_running_and_waiting():
    sched, _, events = make(slots=1)
    sched.submit(Request("a", prompt(1, 3), max_tokens=100))
    sched.submit(Request("b", prompt(2, 3), max_tokens=100))
    sched.step()
    sched.step()
    sched.cancel("b")  # still waiting for the only slot
    sched.step()
    assert finished(events)["b"].reason == "cancelled" and "b" not in started(events)
    n = len(finished(events).get("a", Finished("a", "stop", (), 0, 0)).tokens)
    assert n == 0  # a still running
    sched.cancel("a")
    sched.step()
    fin = finished(events)["a"]
    assert fin.reason == "cancelled" and list(fin.tokens) == alone(prompt(1, 3), len(fin.tokens))
    assert not sched.busy and not sched.step()


def test_stop_tokens_should_stop_and_limits():
    p = prompt(5, 4)
    ref = alone(p, 10)
    sched, _, events = make(slots=2, ctx=len(p) + 3)
    sched.submit(Request("stop", p, max_tokens=10, stop_tokens=frozenset({ref[2]})))
    sched.submit(Request("fn", p, max_tokens=10, should_stop=lambda toks: len(toks) == 2))
    sched.run()
    assert finished(events)["stop"].reason == "stop" and list(finished(events)["stop"].tokens) == ref[:2]
    assert finished(events)["fn"].reason == "stop" and list(finished(events)["fn"].tokens) == ref[:2]
    sched.submit(Request("ctx", p, max_tokens=10))  # ctx = prompt + 3: room for 3 tokens fed + 1 sampled
    sched.submit(Request("big", prompt(6, len(p) + 3), max_tokens=10))
    sched.run()
    assert finished(events)["ctx"].reason == "length" and len(finished(events)["ctx"].tokens) == 4
    assert finished(events)["big"].reason == "error" and "expected 1..6" in finished(events)["big"].error
    with pytest.raises(ValueError, match="max_tokens"):
        sched.submit(Request("zero", p, max_tokens=0))


def test_prefill_error_frees_the_slot():
    sched, be, events = make(slots=1)
    be.fail_prefill = True
    sched.submit(Request("a", prompt(1, 3), max_tokens=3))
    sched.run()
    assert finished(events)["a"].reason == "error" and "boom" in finished(events)["a"].error
    be.fail_prefill = False
    sched.submit(Request("b", prompt(1, 3), max_tokens=3))
    sched.run()
    assert list(finished(events)["b"].tokens) == alone(prompt(1, 3), 3)


def test_restore_hook_serves_a_saved_prefix():
    saved = prompt(7, 12)
    sched, be, events = make(
        slots=2, restore=lambda p: (len(saved), tuple(saved)) if p[: len(saved)] == saved else None
    )
    full = saved + [1, 2, 3]
    sched.submit(Request("a", full, max_tokens=4))
    sched.run()
    assert started(events)["a"].reused_tokens == len(saved)
    assert finished(events)["a"].prefilled_tokens == 3
    assert ("restore", len(saved)) in be.calls
    assert list(finished(events)["a"].tokens) == alone(full, 4)


# ---- the real CPU engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    from _gguf_model import load_model

    from ds4.tools.make_model import ensure_tiny_model

    return load_model(ensure_tiny_model())


def test_real_engine_8_concurrent_equal_each_alone(tiny_model):
    import numpy as np

    from ds4.engine.batch_backend import ModelBackend

    model, steps = tiny_model, 6
    rng = np.random.default_rng(11)
    lengths = [1, 5, 29, 33, 40, 70, 126, 131]  # window 32, ratio 128, indexer top-k 8
    prompts = [rng.integers(0, model.cfg.n_vocab, n).tolist() for n in lengths]
    ctx = max(lengths) + steps + 2

    want = []
    for p in prompts:  # each alone, through the single-session path
        st, out = model.new_state(ctx), []
        lg = model.forward(st, p)
        for _ in range(steps):
            out.append(int(lg.argmax()))
            lg = model.forward(st, [out[-1]])
        want.append(out)

    events: list = []
    backend = ModelBackend(model, ctx)
    sched = Scheduler(
        backend,
        sampler=lambda req, logits: int(logits.argmax()),
        on_event=events.append,
        slots=8,
        prefill_budget=48,
        ctx=ctx,
    )
    for i, p in enumerate(prompts):
        sched.submit(Request(f"r{i}", p, max_tokens=steps))
    sched.run()
    fin = finished(events)
    assert [list(fin[f"r{i}"].tokens) for i in range(8)] == want
    assert all(f.reason == "length" for f in fin.values())

    # A snapshot taken from a live slot restores into another session that decodes identically.
    s0 = sched.slots[started(events)["r7"].slot].session
    other = backend.new_session()
    backend.restore(other, backend.snapshot(s0))
    assert other.tokens == s0.tokens
    a, b = backend.decode_batch([s0, other], [3, 3])
    assert float((a - b).abs().max()) == 0.0


def test_prompt_equal_to_held_tokens_prefills_nothing():
    sched, be, events = make(slots=2)
    sched.submit(Request("a", prompt(3, 8), max_tokens=3))
    sched.run()
    held = list(sched.slots[started(events)["a"].slot].tokens)
    be.drain()
    sched.submit(Request("b", held, max_tokens=4))  # samples from the logits the slot already holds
    sched.run()
    fin = finished(events)["b"]
    assert (started(events)["b"].reused_tokens, fin.prefilled_tokens) == (len(held), 0)
    assert list(fin.tokens) == alone(held, 4)
    assert all(kind == "decode" for kind, _ in be.drain())
