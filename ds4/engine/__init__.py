"""Row 3: Engine (loaded model), Session (KV state, sync/eval/snapshot), sampling and the scheduler.

The exports load lazily so that torch-free submodules (ds4.engine.scheduler) import without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ContextError": "ds4.engine.session",
    "Engine": "ds4.engine.engine",
    "Rng": "ds4.engine.sampling",
    "SamplingParams": "ds4.engine.sampling",
    "Session": "ds4.engine.session",
    "SnapshotError": "ds4.engine.snapshot",
    "sample": "ds4.engine.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ds4.engine' has no attribute {name!r}")
