"""Engine: a loaded model file + its config + tokenizer + the forward pass; hands out Sessions."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ds4.config import DEFAULT_CTX, TINY_MODEL_ALIAS, ModelConfig
from ds4.engine.session import ForwardFn, Session
from ds4.errors import Ds4Error
from ds4.gguf import ModelFile, open_model
from ds4.model import DS4Model
from ds4.tokenizer import Tokenizer

BACKENDS = ("cpu", "cuda")


def default_backend() -> str:
    """The backend used when none is named: "cuda" when a GPU is present, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


SMALL_MODEL_EMBD = 1024  # below this width the CPU forward is a stream of tiny ops


def _set_threads(threads: int | None, backend: str, cfg: ModelConfig) -> None:
    """Small models run one CPU thread: their matrices are too small to split, and extra threads only
    synchronise (tiny-model decode measured 13.8 tok/s on one thread, 2.2 on two, on a 2-core machine)."""
    if threads is None and backend == "cpu" and cfg.n_embd < SMALL_MODEL_EMBD:
        threads = 1
    if threads:
        import torch

        torch.set_num_threads(threads)


def cpu_state_nbytes(cfg: ModelConfig, ctx: int) -> int:
    """f32 bytes of a full CPU KVState at context ctx (ds4.model.state): per layer the raw window, the
    compressed rows (ctx // r + 2 rows reserved) and the compressor frontiers (kv + score), plus the indexer
    rows and frontier on ratio-4 layers."""
    D, Di, f32 = cfg.head_dim, cfg.indexer_dim, 4
    total = 0
    for r in cfg.compress_ratios[: cfg.n_layer]:
        rows = min(ctx, cfg.window) * D
        if r:
            c = 2 if r == 4 else 1
            rows += (ctx // r + 2) * D + 2 * (c * r) * (c * D)
        if r == 4:
            rows += (ctx // 4 + 2) * Di + 2 * (2 * 4) * (2 * Di)
        total += rows * f32
    return total


class Engine:
    def __init__(self, model_file: ModelFile, model: DS4Model, tokenizer: Tokenizer, backend: str) -> None:
        self.model_file = model_file
        self.model = model
        self.tokenizer = tokenizer
        self.backend = backend

    @property
    def config(self) -> ModelConfig:
        return self.model_file.config

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], backend: str | None = None, *, threads: int | None = None
    ) -> Engine:
        """Load a ds4 GGUF (or the cached tiny synthetic model for path "tiny"); backend None = default.

        `threads` sets torch's CPU threads; None = leave them, except for small models on the CPU backend.
        """
        backend = backend or default_backend()
        if backend not in BACKENDS:
            raise Ds4Error(
                f"unknown or unavailable backend {backend!r}: expected one of {', '.join(BACKENDS)}"
            )
        if str(path) == TINY_MODEL_ALIAS:
            from ds4.tools.make_model import ensure_tiny_model  # builds the file once, then cached

            path = ensure_tiny_model()
        if backend == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise Ds4Error("backend 'cuda' needs a CUDA GPU, and torch sees none")
        mf = open_model(Path(path))
        _set_threads(threads, backend, mf.config)
        try:
            if backend == "cuda":
                from ds4.model.cuda import CudaModel, gguf_source

                model = CudaModel(mf.config, gguf_source(mf), has=mf.has, device="cuda")
            else:
                model = DS4Model(mf.config, mf.tensor, has=mf.has)
            tokenizer = Tokenizer.from_gguf(mf)
        except BaseException:
            mf.close()
            raise
        return cls(mf, model, tokenizer, backend)

    def session(self, ctx: int = DEFAULT_CTX, *, checkpoint: bool = True) -> Session:
        """A new empty session; `checkpoint` keeps the post-prompt state so sync can rewind to it."""
        return Session(self, ctx, checkpoint=checkpoint)

    def sessions(
        self,
        n: int,
        ctx: int,
        *,
        checkpoint: bool = True,
        forward: ForwardFn | None = None,
        call: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> list[Session]:
        """n live sessions for the server. A device backend allocates all their states (and, with
        `checkpoint`, one checkpoint buffer each) at once from one pool (model.new_states), so nothing is
        allocated later; `forward` / `call` are the Stepper's (batched decode across the sessions, state
        work on the model thread)."""
        if n < 1:
            raise Ds4Error(f"need at least one session, got {n}")
        new_states = getattr(self.model, "new_states", None)
        states = list(new_states(n, ctx)) if new_states is not None else [None] * n
        pooled = states[0] is not None and hasattr(states[0], "copy_from")
        buffers = list(new_states(n, ctx)) if pooled and checkpoint else [None] * n
        return [
            Session(
                self, ctx, checkpoint=checkpoint, state=st, checkpoint_state=cp, forward=forward, call=call
            )
            for st, cp in zip(states, buffers, strict=True)
        ]

    @staticmethod
    def host_logits(logits: Any) -> Any:
        """Logits (a [V] row or a [B, V] batch, any device) as float32 host memory: the Stepper's fetch."""
        import torch

        return logits.to(device="cpu", dtype=torch.float32)

    def session_nbytes(self, ctx: int, *, checkpoint: bool = False) -> int:
        """Bytes of one session's KV state at context `ctx` (both states when its checkpoint has its own)."""
        if self.backend == "cuda":
            from ds4.model.cuda.state import session_nbytes

            return session_nbytes(self.config, ctx) * (2 if checkpoint else 1)
        return cpu_state_nbytes(self.config, ctx)  # CPU checkpoints are clones of a growing state

    def free_memory(self) -> int | None:
        """Bytes free for KV states now (after the weights): the GPU's free memory on cuda, the host's
        available memory on cpu; None when unknown."""
        if self.backend == "cuda":
            import torch

            return int(torch.cuda.mem_get_info()[0])
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def close(self) -> None:
        self.model_file.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
