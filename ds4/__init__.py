"""ds4: a DeepSeek V4 Flash inference engine for the ds4 GGUF files."""

from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import ds4` stays light (no torch) for the text/protocol layers; ds4.Engine loads the engine.
    if name in ("Engine", "Session"):
        from ds4 import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'ds4' has no attribute {name!r}")
