"""Row 3: Engine (loaded model), Session (KV state, sync/eval/snapshot) and sampling."""

from ds4.engine.engine import Engine
from ds4.engine.sampling import Rng, SamplingParams, sample
from ds4.engine.session import ContextError, Session
from ds4.engine.snapshot import SnapshotError

__all__ = ["ContextError", "Engine", "Rng", "SamplingParams", "Session", "SnapshotError", "sample"]
