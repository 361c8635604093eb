"""Test helper: a DS4Model built from a GGUF through the engine's own loader (ds4.gguf.open_model)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from ds4.gguf import open_model
from ds4.model import DS4Model


@lru_cache(maxsize=2)
def load_model(path: Path) -> DS4Model:
    mf = open_model(Path(path))
    return DS4Model(mf.config, mf.tensor, has=mf.has)
