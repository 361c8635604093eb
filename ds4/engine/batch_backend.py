"""The scheduler's Backend over the CPU reference model (DS4Model): sessions are KV states plus the tokens
and logits they hold; decode steps of many sessions go through DS4Model.decode_batch (issue 8).

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


class ModelBackend:
    """ds4.engine.scheduler.Backend for a DS4Model on the CPU, every session of context `ctx`."""

    def __init__(self, model: DS4Model, ctx: int) -> None:
        self.model, self.ctx = model, ctx
        self.layout = snap.Layout.cpu(model.cfg, ctx)

    def new_session(self) -> BatchSession:
        return BatchSession(self.model.new_state(self.ctx))

    def reset(self, session: BatchSession) -> None:
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
        return snap.encode(self.layout, session.tokens, session.logits, session.state)

    def restore(self, session: BatchSession, blob: bytes) -> torch.Tensor | None:
        decoded = snap.decode(blob, self.layout)  # raises SnapshotError, session untouched
        state = self.model.new_state(self.ctx)
        snap.install(decoded, state)
        session.state, session.tokens = state, list(decoded.tokens)
        session.logits = decoded.logits if decoded.tokens else None
        return session.logits
