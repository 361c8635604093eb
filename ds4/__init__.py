"""ds4: a DeepSeek V4 Flash inference engine for the ds4 GGUF files."""

from __future__ import annotations

__version__ = "0.1.0"
