"""The scheduler's Backend over a model with the batching contract (DS4Model on the CPU, CudaModel on a
device): sessions are KV states plus the tokens and logits they hold; decode steps of many sessions go
through model.decode_batch (issue 8).

Device states (CudaModel) are views of one preallocated KV pool (model.new_states(slots, ctx)), which
decode_batch and its CUDA graphs index by slot: such a session is never replaced, reset and restore work on
its buffers in place. CPU states are simply replaced. Logits stay where the model returns them.

Legend: B sessions of a decode step, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds4.engine import snapshot as snap
from ds4.model import DS4Model
from ds4.model.state import KVState


class BatchSession:
    """One timeline: its KV state, the tokens it holds and the logits after the last of them."""

    def __init__(self, state: KVState) -> None:
        self.state = state
        self.tokens: list[int] = []
        self.logits: torch.Tensor | None = None  # [V]


def _in_place(state) -> bool:
    return hasattr(state, "load_cpu")  # a device state (ds4.model.cuda.state.DeviceKVState)


class ModelBackend:
    """ds4.engine.scheduler.Backend for a DS4Model or CudaModel, every session of context `ctx`.

    slots: sessions to preallocate with model.new_states (required for a CudaModel: pass the scheduler's
    slot count; new_session hands them out and fails past that many)."""

    def __init__(self, model: DS4Model, ctx: int, slots: int | None = None) -> None:
        self.model, self.ctx = model, ctx
        self.layout = snap.Layout.cpu(model.cfg, ctx)
        self._free = list(model.new_states(slots, ctx)) if slots else []
        self._pooled = bool(slots)

    def new_session(self) -> BatchSession:
        if not self._pooled:
            return BatchSession(self.model.new_state(self.ctx))
        if not self._free:
            raise ValueError("every preallocated session is in use (ModelBackend(..., slots=N) made N)")
        return BatchSession(self._free.pop(0))

    def reset(self, session: BatchSession) -> None:
        if _in_place(session.state):
            session.state.reset()
        else:
            session.state = self.model.new_state(self.ctx)
        session.tokens, session.logits = [], None

    def prefill(self, session: BatchSession, tokens: Sequence[int]) -> torch.Tensor:
        try:
            logits = self.model.forward(session.state, tokens)  # [V]
        except BaseException:
            self.reset(session)  # a half-updated state is unusable
            raise
        session.tokens.extend(int(t) for t in tokens)
        session.logits = logits
        return logits

    def decode_batch(self, sessions: Sequence[BatchSession], tokens: Sequence[int]) -> list[torch.Tensor]:
        logits = self.model.decode_batch([s.state for s in sessions], tokens)  # [B, V]
        rows = list(logits.unbind(0))
        for s, t, row in zip(sessions, tokens, rows, strict=True):
            s.tokens.append(int(t))
            s.logits = row
        return rows

    def snapshot(self, session: BatchSession) -> bytes:
        """The DSV4 payload (model.md §11.3), the same format Session.snapshot writes."""
        state, logits = session.state, session.logits
        if _in_place(state):
            state = state.to_cpu()
            logits = None if logits is None else logits.float().cpu()
        return snap.encode(self.layout, session.tokens, logits, state)

    def restore(self, session: BatchSession, blob: bytes) -> torch.Tensor | None:
        decoded = snap.decode(blob, self.layout)  # raises SnapshotError, session untouched
        if _in_place(session.state):  # install into the CPU form, then upload into the live buffers
            dev = session.state
            dev.reset()
            cpu = dev.to_cpu()
            snap.install(decoded, cpu)
            dev.load_cpu(cpu)
            state = dev
        else:
            state = self.model.new_state(self.ctx)
            snap.install(decoded, state)
        session.state, session.tokens = state, list(decoded.tokens)
        session.logits = decoded.logits if decoded.tokens else None
        return session.logits
