"""Stepper: ONE model thread runs every model call of many live sessions, batching decode steps (issue 8).

Job threads (one per server request) call `stepper.forward(state, tokens)` exactly where a Session would call
`model.forward`: the call blocks until the model thread has run it and returns its logits (or re-raises its
error in the caller's thread). The model thread works in steps:

  1. gather: wait (at most `gather_s`) until every registered client has an op pending, so the decode
     tokens of all running streams meet in one step (clients register around a job: `with stepper.client():`);
  2. all pending single-token ops go into ONE `model.decode_batch(states, tokens)` (a lone one goes through
     `model.forward`, the batch-1 path);
  3. multi-token (prefill) ops run in arrival order within `prefill_budget` tokens per step; a longer op is
     cut into budget-sized pieces run in successive steps, so running streams never stall behind a whole
     long prompt. Pieces are cut from each op's own start, independent of what else shares the step, so a
     prompt is evaluated by the same forward calls whatever the load (identical numerics).

Torch-free: `model` is anything with `forward(state, tokens) -> logits` and `decode_batch(states, tokens) ->
rows` (row b is the logits of states[b]); states and logits are opaque. Tests use a fake model.

Everything that touches device state runs on the model thread: `call(fn)` runs fn there (sessions reset,
copy, snapshot and restore their states through it), and `fetch` (e.g. a copy of device logits to the host)
is applied there to every result before it is handed back. A CUDA graph captured by the model thread then
never meets another thread's device work, and the job threads only ever see host logits.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

DEFAULT_PREFILL_BUDGET = 2048  # tokens of prefill per step (the GPU prefill chunk)
DEFAULT_GATHER_S = 0.003  # longest wait for the other clients' decode tokens before a step runs


class ModelOps(Protocol):
    def forward(self, state: Any, tokens: Sequence[int]) -> Any: ...
    def decode_batch(self, states: Sequence[Any], tokens: Sequence[int]) -> Sequence[Any]: ...


class StepperStopped(RuntimeError):
    """forward() after stop(): the model thread no longer takes work."""


@dataclass(eq=False)  # identity: ops are found in the pending list by `is`, never by value
class _Op:
    state: Any
    tokens: list[int]
    fn: Callable[[], Any] | None = None  # a call(fn) op: run fn, no tokens
    done: threading.Event = field(default_factory=threading.Event)
    fed: int = 0  # tokens of a prefill op already run (earlier pieces)
    result: Any = None
    error: BaseException | None = None

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


@dataclass
class StepperStats:
    steps: int = 0
    decode_steps: int = 0  # steps that ran at least one decode token
    decode_tokens: int = 0
    prefill_tokens: int = 0
    last_batch: int = 0  # decode tokens of the latest decode step
    max_batch: int = 0
    batches: Counter[int] = field(default_factory=Counter)  # decode batch size -> steps


class Stepper:
    def __init__(
        self,
        model: ModelOps,
        *,
        prefill_budget: int = DEFAULT_PREFILL_BUDGET,
        gather_s: float = DEFAULT_GATHER_S,
        name: str = "ds4-model",
        fetch: Callable[[Any], Any] | None = None,
    ) -> None:
        if prefill_budget < 1:
            raise ValueError(f"prefill_budget must be at least 1 token, got {prefill_budget}")
        self.model = model
        self.prefill_budget = prefill_budget
        self.gather_s = max(0.0, gather_s)
        self.fetch = fetch if fetch is not None else (lambda result: result)
        self.stats = StepperStats()
        self._cond = threading.Condition()
        self._ops: list[_Op] = []  # pending, arrival order
        self._clients = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- job-thread side -------------------------------------------------------------------------

    def forward(self, state: Any, tokens: Sequence[int]) -> Any:
        """Run `tokens` on `state` in the model thread; blocks; the op's error is raised here."""
        op = _Op(state, [int(t) for t in tokens])
        if not op.tokens:
            raise ValueError("forward needs at least one token, got none")
        return self._submit(op)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the model thread (before the next step's model calls); blocks; returns its result.
        Once the model thread has ended (after stop()), fn runs in the caller: nothing else touches the
        model then (e.g. the server saving its sessions on shutdown)."""
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return fn()
        return self._submit(_Op(None, [], fn))

    def _submit(self, op: _Op) -> Any:
        with self._cond:
            if self._stopping:
                raise StepperStopped("the model thread is stopped: no more model calls")
            self._ops.append(op)
            self._cond.notify_all()
        op.done.wait()
        if op.error is not None:
            raise op.error
        return op.result

    @contextmanager
    def client(self) -> Iterator[None]:
        """Mark the calling job as active for the duration: steps wait (briefly) for its next op."""
        with self._cond:
            self._clients += 1
        try:
            yield
        finally:
            with self._cond:
                self._clients -= 1
                self._cond.notify_all()

    @property
    def active_clients(self) -> int:
        return self._clients

    def stop(self, timeout: float | None = 30.0) -> None:
        """Refuse new ops, finish the pending ones, join the model thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- model-thread side -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            ops = self._gather()
            if ops is None:
                return
            try:
                self._step(ops)
            except BaseException as err:  # never leave a caller waiting, never die on one bad step
                left = [op for op in ops if not op.done.is_set()]
                self._retire(left, [None] * len(left), err)

    def _gather(self) -> list[_Op] | None:
        """The ops of the next step (None: stopped and drained)."""
        with self._cond:
            while not self._ops:
                if self._stopping:
                    return None
                self._cond.wait()
            deadline = time.monotonic() + self.gather_s
            while len(self._ops) < self._clients and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return list(self._ops)

    def _step(self, ops: list[_Op]) -> None:
        for op in ops:
            if op.fn is not None:
                self._call(op)
        decode = [op for op in ops if len(op.tokens) == 1]
        prefill = [op for op in ops if len(op.tokens) > 1]
        self.stats.steps += 1
        if decode:
            self._decode(decode)
        budget = self.prefill_budget
        for op in prefill:
            piece = op.tokens[op.fed : op.fed + self.prefill_budget]
            if len(piece) > budget:
                break  # the next step takes it: the budget holds whole pieces only
            budget -= len(piece)
            self._prefill_piece(op, piece)
            if budget <= 0:
                break

    def _call(self, op: _Op) -> None:
        try:
            result = op.fn()
        except BaseException as err:
            self._retire([op], [None], err)
            return
        self._retire([op], [result], None)

    def _decode(self, ops: list[_Op]) -> None:
        B = len(ops)
        try:
            if B == 1:
                rows = [self.fetch(self.model.forward(ops[0].state, ops[0].tokens))]
            else:
                out = self.model.decode_batch([op.state for op in ops], [op.tokens[0] for op in ops])
                rows = list(self.fetch(out))  # one host copy of the whole batch, then its rows
        except BaseException as err:
            # Every op of the batch fails: a batch that raised may have touched any of its states.
            self._retire(ops, [None] * B, err)
            return
        st = self.stats
        st.decode_steps += 1
        st.decode_tokens += B
        st.last_batch, st.max_batch = B, max(st.max_batch, B)
        st.batches[B] += 1
        self._retire(ops, list(rows), None)

    def _prefill_piece(self, op: _Op, piece: list[int]) -> None:
        try:
            logits = self.model.forward(op.state, piece)
            if op.fed + len(piece) >= len(op.tokens):
                logits = self.fetch(logits)
        except BaseException as err:
            self._retire([op], [None], err)
            return
        op.fed += len(piece)
        self.stats.prefill_tokens += len(piece)
        if op.fed >= len(op.tokens):
            self._retire([op], [logits], None)

    def _retire(self, ops: list[_Op], results: list[Any], err: BaseException | None) -> None:
        with self._cond:
            for op in ops:
                if op in self._ops:
                    self._ops.remove(op)
        for op, res in zip(ops, results, strict=True):
            op.finish(res, err)


__all__ = [
    "DEFAULT_GATHER_S",
    "DEFAULT_PREFILL_BUDGET",
    "ModelOps",
    "Stepper",
    "StepperStats",
    "StepperStopped",
]
