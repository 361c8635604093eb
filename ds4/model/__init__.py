"""Row 2: one forward pass of DeepSeek V4 (plain PyTorch reference). No I/O, no policy."""

from ds4.model.model import DS4Model
from ds4.model.state import KVState, LayerKV

__all__ = ["DS4Model", "KVState", "LayerKV"]
