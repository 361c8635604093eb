"""Continuous batching over N live sessions (issue 8): one batched decode step for every running stream per
`step()`, plus a bounded share of chunked prefill for new requests, so a long prompt never stalls the others.

Pure Python, no torch: the model sits behind `Backend` (ds4.engine.batch_backend adapts DS4Model; tests use
a fake), logits are opaque to the scheduler and go to the `sampler` callback, events go to `on_event`.

    sched = Scheduler(backend, sampler=lambda req, logits: ..., on_event=print, slots=8, prefill_budget=64)
    sched.submit(Request("a", prompt_ids, max_tokens=32, stop_tokens=frozenset({EOS})))
    while sched.step(): ...

Slots. Each of the N slots holds one backend session and the exact token list its KV holds. A request goes
to the idle slot whose tokens are the longest prefix of its prompt (the prefix index; only the suffix is
prefilled), else to an empty slot, else to the least recently used idle slot, which is evicted first
through the `evict(slot)` hook (the server saves it to the disk cache there) and rebuilt. With every slot
busy the request waits. An optional `restore(prompt)` hook may offer a saved state (a longer prefix than any
live slot) that the chosen slot restores instead of prefilling those tokens.

Per step: cancelled requests finish; waiting requests are admitted (FIFO); ONE backend.decode_batch feeds
the pending token of every decoding request (each gets exactly one new token per step); then prefill chunks
of at most `prefill_budget` tokens in total go to prefilling requests in arrival order. A request whose
prefill completes samples its first token from the prefill logits and decodes from the next step on.

Like ds4.engine.generate: a stop token ends the request without being emitted or evaluated, the last sampled
token is never evaluated, so a finished slot holds the prompt plus every generated token but the last.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, Literal, Protocol, TypeVar

S = TypeVar("S")  # a backend session
Logits = Any  # opaque next-token logits, only handed to the sampler

FinishReason = Literal["stop", "length", "cancelled", "error"]


class Backend(Protocol[S]):
    """What the scheduler needs from a model. Every method that feeds tokens appends them to the session."""

    def new_session(self) -> S: ...
    def reset(self, session: S) -> None: ...  # drop everything the session holds (it restarts at 0)
    def prefill(self, session: S, tokens: Sequence[int]) -> Logits: ...  # logits after the last token
    def decode_batch(self, sessions: Sequence[S], tokens: Sequence[int]) -> Sequence[Logits]: ...
    def snapshot(self, session: S) -> Any: ...  # an opaque saved state (for the evict hook)
    def restore(self, session: S, blob: Any) -> Logits: ...  # replace the session by a saved state


@dataclass
class Request:
    id: str
    prompt: list[int]
    max_tokens: int
    stop_tokens: frozenset[int] = frozenset()
    params: Any = None  # for the sampler (sampling params, rng, ...): the scheduler never reads it
    # After each emitted token: the generated ids so far -> True to stop there (e.g. a stop string matched).
    should_stop: Callable[[list[int]], bool] | None = None


@dataclass(frozen=True)
class Started:
    request_id: str
    slot: int
    reused_tokens: int  # prompt tokens the slot already held (or restored): not prefilled


@dataclass(frozen=True)
class Token:
    request_id: str
    token: int


@dataclass(frozen=True)
class Finished:
    request_id: str
    reason: FinishReason
    tokens: tuple[int, ...]  # generated ids (a stop token excluded)
    prompt_tokens: int
    prefilled_tokens: int
    error: str | None = None


Event = Started | Token | Finished


class _Phase(Enum):
    WAITING = "waiting"  # no slot yet
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class Slot(Generic[S]):
    index: int
    session: S
    tokens: list[int] = field(default_factory=list)  # exactly what the session's KV holds
    logits: Logits = None  # after the last held token (None when unknown)
    last_used: int = 0  # step counter of the latest use (LRU)
    busy: bool = False


@dataclass
class _Live:
    req: Request
    phase: _Phase = _Phase.WAITING
    slot: Slot | None = None
    fed: int = 0  # prompt tokens the slot holds so far
    prefilled: int = 0
    pending: int | None = None  # sampled, not yet evaluated
    generated: list[int] = field(default_factory=list)
    cancel: bool = False


class PrefixIndex:
    """Token trie over the idle slots' token lists: which slot holds the longest prefix of a prompt."""

    def __init__(self) -> None:
        self._root: dict[int, Any] = {}
        self._held: dict[int, list[int]] = {}  # slot index -> its tokens at insertion

    _ENDS = -1  # key of a node's set of slot indices ending there (token ids are >= 0)

    def add(self, slot: int, tokens: Sequence[int]) -> None:
        self.remove(slot)
        node = self._root
        for t in tokens:
            node = node.setdefault(t, {})
        node.setdefault(self._ENDS, set()).add(slot)
        self._held[slot] = list(tokens)

    def remove(self, slot: int) -> None:
        tokens = self._held.pop(slot, None)
        if tokens is None:
            return
        path = [self._root]
        for t in tokens:
            path.append(path[-1][t])
        path[-1][self._ENDS].discard(slot)
        for depth in range(len(tokens), 0, -1):  # prune nodes that lead nowhere any more
            node = path[depth]
            if node.get(self._ENDS) == set():
                del node[self._ENDS]
            if node:
                break
            del path[depth - 1][tokens[depth - 1]]

    def longest_prefix(self, prompt: Sequence[int]) -> tuple[int | None, int]:
        """(slot whose tokens are the longest non-empty prefix of prompt, that length) or (None, 0)."""
        best: tuple[int | None, int] = (None, 0)
        node = self._root
        for depth, t in enumerate(prompt, start=1):
            node = node.get(t)
            if node is None:
                break
            ends = node.get(self._ENDS)
            if ends:
                best = (min(ends), depth)
        return best

    def __contains__(self, slot: int) -> bool:
        return slot in self._held


class Scheduler(Generic[S]):
    def __init__(
        self,
        backend: Backend[S],
        *,
        sampler: Callable[[Request, Logits], int],
        on_event: Callable[[Event], None],
        slots: int,
        prefill_budget: int,
        ctx: int,
        evict: Callable[[Slot[S]], None] | None = None,
        restore: Callable[[list[int]], tuple[int, Any] | None] | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"need at least one slot, got {slots}")
        if prefill_budget < 1:
            raise ValueError(f"prefill budget must be at least 1 token per step, got {prefill_budget}")
        self.backend, self.sampler, self.on_event = backend, sampler, on_event
        self.prefill_budget, self.ctx = prefill_budget, ctx
        self.evict_hook, self.restore_hook = evict, restore
        self.slots: list[Slot[S]] = [Slot(i, backend.new_session()) for i in range(slots)]
        self.index = PrefixIndex()
        self._live: list[_Live] = []  # admitted or waiting, in arrival order
        self._inbox: list[_Live] = []  # submitted from any thread, taken at the next step
        self._cancels: set[str] = set()
        self._lock = threading.Lock()
        self._clock = 0
        self.evictions = 0

    # ---- API (thread-safe) ----------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        if req.max_tokens < 1:
            raise ValueError(f"request {req.id}: max_tokens must be at least 1, got {req.max_tokens}")
        with self._lock:
            self._inbox.append(_Live(req))

    def cancel(self, request_id: str) -> None:
        """Takes effect at the next step (a decode step in flight finishes first)."""
        with self._lock:
            self._cancels.add(request_id)

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._live or self._inbox)

    # ---- the step loop ----------------------------------------------------------------------------

    def step(self) -> bool:
        """One scheduling step; returns False when there was nothing to do."""
        with self._lock:
            self._live += self._inbox
            self._inbox, cancels, self._cancels = [], self._cancels, set()
        self._clock += 1
        for lv in list(self._live):
            if lv.req.id in cancels:
                self._finish(lv, "cancelled")
        self._admit()
        if not self._live:
            return False
        self._decode_step()
        self._prefill_step()
        return True

    def run(self, max_steps: int | None = None) -> int:
        """Step until idle (or max_steps); returns the number of steps run."""
        n = 0
        while (max_steps is None or n < max_steps) and self.step():
            n += 1
        return n

    # ---- admission ---------------------------------------------------------------------------------

    def _admit(self) -> None:
        for lv in [lv for lv in self._live if lv.phase is _Phase.WAITING]:
            prompt = lv.req.prompt
            if not prompt or len(prompt) >= self.ctx:
                self._finish(lv, "error", f"prompt of {len(prompt)} tokens: expected 1..{self.ctx - 1}")
                continue
            slot, held = self._pick_slot(prompt)
            if slot is None:
                return  # every slot is busy: this one and all later ones wait (FIFO)
            slot.busy, slot.last_used = True, self._clock
            self.index.remove(slot.index)
            lv.slot, lv.phase = slot, _Phase.PREFILL
            if held == 0 and slot.tokens:  # not an extension: rebuild
                self.backend.reset(slot.session)
                slot.tokens, slot.logits = [], None
            held = self._maybe_restore(slot, prompt, held)
            lv.fed = held
            if held == len(prompt) and slot.logits is None:  # nothing to sample from: feed the last again
                self.backend.reset(slot.session)
                slot.tokens, lv.fed, held = [], 0, 0
            self.on_event(Started(lv.req.id, slot.index, held))
            if lv.fed == len(prompt):
                self._start_decode(lv, slot.logits)

    def _pick_slot(self, prompt: list[int]) -> tuple[Slot[S] | None, int]:
        """(slot, prompt tokens it already holds): the longest live prefix, else an empty slot, else the
        LRU idle slot (evicted), else (None, 0)."""
        i, n = self.index.longest_prefix(prompt)
        if i is not None:
            return self.slots[i], n
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None, 0
        empty = [s for s in idle if not s.tokens]
        if empty:
            return empty[0], 0
        victim = min(idle, key=lambda s: (s.last_used, s.index))
        if self.evict_hook is not None:
            self.evict_hook(victim)
        self.evictions += 1
        return victim, 0

    def _maybe_restore(self, slot: Slot[S], prompt: list[int], held: int) -> int:
        if self.restore_hook is None:
            return held
        found = self.restore_hook(prompt)
        if found is None or not held < found[0] <= len(prompt):
            return held
        n, blob = found
        slot.logits = self.backend.restore(slot.session, blob)
        slot.tokens = list(prompt[:n])
        return n

    # ---- decode / prefill ---------------------------------------------------------------------------

    def _decode_step(self) -> None:
        batch = [lv for lv in self._live if lv.phase is _Phase.DECODE]
        if not batch:
            return
        sessions = [lv.slot.session for lv in batch]
        tokens = [lv.pending for lv in batch]
        try:
            logits = self.backend.decode_batch(sessions, tokens)
        except Exception as e:  # every session of the batch may be half-updated: drop them all
            for lv in batch:
                self._reset_slot(lv.slot)
                self._finish(lv, "error", f"decode failed: {e}")
            return
        for lv, tok, lg in zip(batch, tokens, logits, strict=True):
            lv.slot.tokens.append(tok)
            lv.slot.logits = lg
            lv.slot.last_used = self._clock
            self._sample(lv, lg)

    def _prefill_step(self) -> None:
        budget = self.prefill_budget
        for lv in [lv for lv in self._live if lv.phase is _Phase.PREFILL]:
            if budget == 0:
                return
            chunk = lv.req.prompt[lv.fed : lv.fed + budget]
            try:
                lg = self.backend.prefill(lv.slot.session, chunk)
            except Exception as e:
                self._reset_slot(lv.slot)
                self._finish(lv, "error", f"prefill failed: {e}")
                continue
            budget -= len(chunk)
            lv.fed += len(chunk)
            lv.prefilled += len(chunk)
            lv.slot.tokens.extend(chunk)
            lv.slot.logits = lg
            lv.slot.last_used = self._clock
            if lv.fed == len(lv.req.prompt):
                self._start_decode(lv, lg)

    def _start_decode(self, lv: _Live, logits: Logits) -> None:
        lv.phase = _Phase.DECODE
        self._sample(lv, logits)

    def _sample(self, lv: _Live, logits: Logits) -> None:
        req = lv.req
        tok = int(self.sampler(req, logits))
        if tok in req.stop_tokens:
            self._finish(lv, "stop")
            return
        lv.generated.append(tok)
        self.on_event(Token(req.id, tok))
        if req.should_stop is not None and req.should_stop(lv.generated):
            self._finish(lv, "stop")
        elif len(lv.generated) >= req.max_tokens or len(lv.slot.tokens) >= self.ctx:  # no room to feed it
            self._finish(lv, "length")
        else:
            lv.pending = tok

    # ---- bookkeeping ----------------------------------------------------------------------------

    def _reset_slot(self, slot: Slot[S]) -> None:
        try:
            self.backend.reset(slot.session)
        finally:
            slot.tokens, slot.logits = [], None

    def _finish(self, lv: _Live, reason: FinishReason, error: str | None = None) -> None:
        if lv not in self._live:
            return
        self._live.remove(lv)
        slot = lv.slot
        if slot is not None:
            slot.busy, slot.last_used = False, self._clock
            if slot.tokens:
                self.index.add(slot.index, slot.tokens)
        self.on_event(
            Finished(lv.req.id, reason, tuple(lv.generated), len(lv.req.prompt), lv.prefilled, error)
        )
