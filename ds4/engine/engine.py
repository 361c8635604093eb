"""Engine: a loaded model file + its config + tokenizer + the forward pass; hands out Sessions."""

from __future__ import annotations

import os
from pathlib import Path

from ds4.config import DEFAULT_CTX, TINY_MODEL_ALIAS, ModelConfig
from ds4.engine.session import Session
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

    def close(self) -> None:
        self.model_file.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
