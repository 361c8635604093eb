"""ds4.engine.stepper with a fake model (no torch): decode ops of all active clients meet in ONE decode_batch,
prefill runs in budget-sized pieces between decode steps, errors go back to their own caller only, stop()
drains and joins. Gathering waits on clients' ops (a long gather_s), never on sleeps."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from ds4.engine.stepper import Stepper, StepperStopped

LONG = 30.0  # gather window: a step waits for every registered client, so ordering is deterministic


class State:
    def __init__(self, name: str, bad: bool = False) -> None:
        self.name, self.bad, self.seen = name, bad, []


class FakeModel:
    """Logits = (state name, tokens the state holds): each caller can check it got its own row."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[str, ...], int]] = []  # (kind, state names, tokens per state)
        self.lock = threading.Lock()

    def forward(self, state: State, tokens: Sequence[int]) -> tuple[str, int]:
        with self.lock:
            self.calls.append(("forward", (state.name,), len(tokens)))
        if state.bad:
            raise ValueError(f"bad state {state.name}")
        state.seen += list(tokens)
        return (state.name, len(state.seen))

    def decode_batch(self, states: Sequence[State], tokens: Sequence[int]) -> list[tuple[str, int]]:
        with self.lock:
            self.calls.append(("batch", tuple(s.name for s in states), 1))
        if any(s.bad for s in states):
            raise ValueError("bad state in batch")
        for s, t in zip(states, tokens, strict=True):
            s.seen.append(t)
        return [(s.name, len(s.seen)) for s in states]


def run_clients(stepper: Stepper, bodies: dict[str, object]) -> dict[str, object]:
    """Run each body(name) in its own registered client thread; returns name -> result or exception."""
    out: dict[str, object] = {}
    ready = threading.Barrier(len(bodies))

    def run(name: str, body) -> None:
        with stepper.client():
            ready.wait()  # all registered before anyone submits
            try:
                out[name] = body()
            except Exception as err:
                out[name] = err

    threads = [threading.Thread(target=run, args=(n, b)) for n, b in bodies.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_waiting_decode_ops_of_k_clients_run_as_one_batch() -> None:
    model = FakeModel()
    st = Stepper(model, gather_s=LONG)
    states = {f"s{i}": State(f"s{i}") for i in range(5)}
    try:
        out = run_clients(st, {n: (lambda s=s: st.forward(s, [7])) for n, s in states.items()})
    finally:
        st.stop()
    assert out == {n: (n, 1) for n in states}  # every caller got its own row
    assert [c[0] for c in model.calls] == ["batch"]
    assert sorted(model.calls[0][1]) == sorted(states)
    assert st.stats.last_batch == 5 and st.stats.batches == {5: 1}


def test_long_prefill_is_cut_into_budget_pieces_between_decode_steps() -> None:
    model = FakeModel()
    st = Stepper(model, prefill_budget=4, gather_s=LONG)
    a, b = State("a"), State("b")

    def decoder():
        return [st.forward(a, [1]) for _ in range(3)]

    try:
        out = run_clients(st, {"a": decoder, "b": lambda: st.forward(b, list(range(10)))})
    finally:
        st.stop()
    assert out["b"] == ("b", 10) and out["a"] == [("a", 1), ("a", 2), ("a", 3)]
    # one decode token and one piece of at most 4 prefill tokens per step: the stream never waits for all 10
    assert model.calls == [
        ("forward", ("a",), 1), ("forward", ("b",), 4),
        ("forward", ("a",), 1), ("forward", ("b",), 4),
        ("forward", ("a",), 1), ("forward", ("b",), 2),
    ]  # fmt: skip
    assert st.stats.prefill_tokens == 10 and st.stats.decode_tokens == 3


def test_prefill_budget_is_shared_by_the_ops_of_a_step() -> None:
    model = FakeModel()
    st = Stepper(model, prefill_budget=6, gather_s=LONG)
    states = [State(n) for n in "xyz"]
    try:
        out = run_clients(st, {s.name: (lambda s=s: st.forward(s, [1, 2, 3, 4])) for s in states})
    finally:
        st.stop()
    assert out == {s.name: (s.name, 4) for s in states}
    sizes = [c[2] for c in model.calls]
    assert sizes == [4, 4, 4]  # whole 4-token ops: one per step under a budget of 6
    assert st.stats.steps == 3


def test_a_failing_op_fails_only_its_caller_and_the_thread_lives_on() -> None:
    model = FakeModel()
    st = Stepper(model, gather_s=LONG)
    good, bad = State("good"), State("bad", bad=True)
    try:
        out = run_clients(
            st, {"good": lambda: st.forward(good, [1, 2, 3]), "bad": lambda: st.forward(bad, [1, 2])}
        )
        assert out["good"] == ("good", 3)
        assert isinstance(out["bad"], ValueError) and "bad state bad" in str(out["bad"])
        # a batch that raises fails its own members only; the next step works
        batch = run_clients(st, {"good": lambda: st.forward(good, [5]), "bad": lambda: st.forward(bad, [5])})
        assert all(isinstance(v, ValueError) for v in batch.values())
        assert st.alive and st.forward(good, [6]) == ("good", 4)
    finally:
        st.stop()


def test_stop_finishes_pending_ops_then_refuses_new_ones() -> None:
    model = FakeModel()
    gate, entered = threading.Event(), threading.Event()
    original = model.forward

    def slow_forward(state, tokens):
        entered.set()
        gate.wait(30)  # holds the model thread inside a step
        return original(state, tokens)

    model.forward = slow_forward  # type: ignore[method-assign]
    st = Stepper(model, prefill_budget=2, gather_s=0.0)
    s = State("s")
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(st.forward(s, [1, 2, 3, 4, 5])))
    t.start()
    assert entered.wait(30)  # the first piece is running
    stopper = threading.Thread(target=st.stop)
    stopper.start()
    gate.set()
    stopper.join(30)
    t.join(30)
    assert result == [("s", 5)]  # the op admitted before stop() ran to its end (3 pieces)
    assert not st.alive
    with pytest.raises(StepperStopped):
        st.forward(s, [1])


def test_empty_op_and_bad_budget_are_refused() -> None:
    with pytest.raises(ValueError, match="prefill_budget"):
        Stepper(FakeModel(), prefill_budget=0)
    st = Stepper(FakeModel())
    try:
        with pytest.raises(ValueError, match="at least one token"):
            st.forward(State("s"), [])
    finally:
        st.stop()


def test_call_and_fetch_run_on_the_model_thread() -> None:
    """call(fn) runs fn on the model thread (device state work never races a step) and returns its result or
    raises its error in the caller; fetch is applied there to every result (one host copy per batch)."""
    model = FakeModel()
    fetched: list[str] = []

    def fetch(result):
        fetched.append(threading.current_thread().name)
        return ("host", result)

    stepper = Stepper(model, gather_s=0.0, fetch=fetch, name="model-thread")
    try:
        assert stepper.call(lambda: threading.current_thread().name) == "model-thread"
        with pytest.raises(KeyError, match="boom"):
            stepper.call(lambda: {}["boom"])
        assert stepper.forward(State("a"), [1, 2, 3]) == ("host", ("a", 3))
        assert stepper.forward(State("b"), [7]) == ("host", ("b", 1))
        assert fetched == ["model-thread", "model-thread"]
    finally:
        stepper.stop()
    assert not stepper.alive
    # after stop: state work (e.g. the shutdown store's snapshots) runs in the caller, model calls are refused
    assert stepper.call(lambda: threading.current_thread().name) == threading.current_thread().name
    with pytest.raises(StepperStopped):
        stepper.forward(State("c"), [1])
