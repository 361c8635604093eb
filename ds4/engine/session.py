"""Session: one timeline of a loaded model — tokens consumed, KV state, next-token logits (architecture.md).

`sync(prompt)` decides by itself whether to reuse (same tokens), extend (the held tokens are a prefix of the
prompt: prefill only the suffix) or rebuild (anything else: the KV cannot be rewound in general). CPU policy
(model.md §10.2): a fresh prompt is one layer-major pass; a suffix extension is one pass too (mathematically
equal to token-by-token decode). `eval(token)` is one decode step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ds4.engine import snapshot as snap
from ds4.errors import Ds4Error
from ds4.model.state import KVState

if TYPE_CHECKING:
    from ds4.engine.engine import Engine

ProgressFn = Callable[[int, int], None]  # (tokens prefilled so far, tokens to prefill)
ForwardFn = Callable[[Any, Sequence[int]], torch.Tensor]  # (state, tokens) -> logits, like model.forward


class ContextError(Ds4Error, ValueError):
    """A prompt or a decode step that does not fit the session's context."""


@dataclass
class SessionStats:
    prefill_tokens: int = 0  # tokens run through prefill by every sync so far
    reused_tokens: int = 0  # prompt tokens served from the held state instead of prefilled
    decode_tokens: int = 0  # tokens consumed by eval()
    rebuilds: int = 0  # syncs that had to discard the held state
    checkpoint_hits: int = 0  # syncs that rewound to the prompt checkpoint instead of rebuilding


@dataclass
class _Checkpoint:
    """The state right after the latest synced prompt (before any decode), for a cheap rewind."""

    tokens: list[int]
    state: KVState
    logits: torch.Tensor


class Session:
    """`state` / `checkpoint_state`: preallocated (pooled device) states this session works in, in place;
    `forward`: who runs the model (default engine.model.forward; the server passes a Stepper's forward so
    many sessions' decode steps are batched); `call`: who runs the session's other state work (reset, copy,
    snapshot, restore; default: the calling thread; the server passes Stepper.call so that all device work
    happens on the model thread)."""

    def __init__(
        self,
        engine: Engine,
        ctx: int,
        *,
        checkpoint: bool = True,
        state: Any = None,
        checkpoint_state: Any = None,
        forward: ForwardFn | None = None,
        call: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> None:
        if ctx <= 1:
            raise ContextError(f"context size must be at least 2 tokens, got {ctx}")
        self.engine = engine
        self.ctx = ctx
        self.layout = snap.Layout.cpu(engine.config, ctx)
        self.state = state if state is not None else engine.model.new_state(ctx)
        self._run_model: ForwardFn = forward if forward is not None else engine.model.forward
        self._call: Callable[[Callable[[], Any]], Any] = call if call is not None else (lambda fn: fn())
        # the checkpoint's own buffer: copy_from into it instead of a clone per prompt (no allocation later)
        self._checkpoint_buf = checkpoint_state if hasattr(checkpoint_state, "copy_from") else None
        self.tokens: list[int] = []
        self._logits: torch.Tensor | None = None  # [V] next-token logits once a token was consumed
        self.last_prefill = 0  # tokens prefilled by the latest sync
        self.stats = SessionStats()
        # A chat's next prompt usually extends the previous *prompt* but not the decoded tokens (history is
        # re-rendered, reasoning dropped): keeping the post-prompt state lets sync rewind there.
        self.keep_checkpoint = checkpoint
        self._checkpoint: _Checkpoint | None = None

    # ---- state -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def logits(self) -> torch.Tensor:
        """float32 [n_vocab] logits for the next token."""
        if self._logits is None:
            raise ValueError("session holds no tokens yet: sync() a prompt before reading logits")
        return self._logits

    def reset(self) -> None:
        """Drop the timeline (the prompt checkpoint stays: it is still a valid state to rewind to)."""
        if hasattr(self.state, "reset"):  # device state: in place, so its captured decode graph stays valid
            self._call(self.state.reset)
        else:
            self.state = self.engine.model.new_state(self.ctx)
        self.tokens = []
        self._logits = None

    # ---- prefill / decode ----------------------------------------------------------------------

    def sync(self, tokens: Sequence[int], progress: ProgressFn | None = None) -> int:
        """Make the session hold exactly `tokens`; returns how many tokens had to be prefilled."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("sync needs a prompt of at least one token, got none")
        if len(tokens) >= self.ctx:
            raise ContextError(
                f"prompt exceeds context: {len(tokens)} tokens, ctx {self.ctx} (a prompt must be shorter)"
            )
        self._check_ids(tokens)
        held = len(self.tokens)
        if held and tokens[:held] == self.tokens:
            suffix = tokens[held:]
        elif self._rewind_to_checkpoint(tokens):
            suffix = tokens[len(self.tokens) :]
        else:  # not an extension of anything we hold: start over
            if held:
                self.stats.rebuilds += 1
            self.reset()
            suffix = tokens
        self.stats.reused_tokens += len(tokens) - len(suffix)
        self.last_prefill = len(suffix)
        if suffix:
            self._forward(suffix, progress)
            self.stats.prefill_tokens += len(suffix)
        if self.keep_checkpoint and (self._checkpoint is None or self._checkpoint.tokens != tokens):
            self._checkpoint = _Checkpoint(list(tokens), self._checkpoint_copy(), self.logits.clone())
        return len(suffix)

    @property
    def checkpoint_tokens(self) -> tuple[int, ...]:
        """The prompt whose post-prefill state the session keeps: sync() rewinds to it by itself when a new
        prompt extends it (empty when there is none)."""
        return tuple(self._checkpoint.tokens) if self._checkpoint is not None else ()

    def _checkpoint_copy(self) -> Any:
        if self._checkpoint_buf is None:
            return self._call(self.state.clone)
        buf, state = self._checkpoint_buf, self.state
        self._call(lambda: buf.copy_from(state))
        return buf

    def _rewind_to_checkpoint(self, tokens: list[int]) -> bool:
        cp = self._checkpoint
        if cp is None or tokens[: len(cp.tokens)] != cp.tokens:
            return False
        if hasattr(self.state, "copy_from"):  # device state: copy into the live buffers (graph stays valid)
            state = self.state
            self._call(lambda: state.copy_from(cp.state))
        else:
            self.state = cp.state.clone()
        self.tokens, self._logits = list(cp.tokens), cp.logits.clone()
        self.stats.checkpoint_hits += 1
        return True

    def eval(self, token: int) -> torch.Tensor:
        """Consume one token (a decode step); returns the new next-token logits [n_vocab]."""
        if len(self.tokens) + 1 > self.ctx:
            raise ContextError(f"context is full: the session holds {len(self.tokens)} of {self.ctx} tokens")
        self._check_ids([int(token)])
        self._forward([int(token)], None)
        self.stats.decode_tokens += 1
        return self.logits

    def _forward(self, tokens: list[int], progress: ProgressFn | None) -> None:
        if progress is not None:
            progress(0, len(tokens))
        try:
            logits = self._run_model(self.state, tokens)
        except BaseException:
            self.reset()  # a half-updated KV state is unusable: fall back to an empty session
            raise
        self.tokens.extend(tokens)
        self._logits = logits.to(device="cpu", dtype=torch.float32).reshape(-1)  # device backends: one copy
        if progress is not None:
            progress(len(tokens), len(tokens))

    def _check_ids(self, tokens: list[int]) -> None:
        n_vocab = self.engine.config.n_vocab
        bad = [t for t in tokens if not 0 <= t < n_vocab]
        if bad:
            raise ValueError(f"token id out of range: expected 0 <= id < {n_vocab}, got {bad[0]}")

    # ---- snapshots -----------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The DSV4 payload (model.md §11.3) of this session."""
        state = self._call(self._cpu_state)  # on the model thread: never beside a step that writes it
        return snap.encode(self.layout, self.tokens, self._logits, state)

    def _cpu_state(self) -> KVState:
        return self.state.to_cpu() if hasattr(self.state, "to_cpu") else self.state  # device state: CPU form

    def restore(self, blob: bytes) -> None:
        """Replace the timeline by a payload; raises SnapshotError (state untouched) if it does not fit."""
        decoded = snap.decode(blob, self.layout)
        if hasattr(self.state, "load_cpu"):  # device state: install into its CPU form, upload in place
            cpu = self._call(self.state.to_cpu)
            snap.install(decoded, cpu)
            state = self.state
            self._call(lambda: state.load_cpu(cpu))
        else:
            state = self.engine.model.new_state(self.ctx)
            snap.install(decoded, state)
            self.state = state
        self.tokens = decoded.tokens
        self._logits = decoded.logits if decoded.tokens else None
