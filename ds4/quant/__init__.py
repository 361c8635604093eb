"""ggml weight formats: block geometry, dequantization (CPU path, GPU reference), packed-weight synthesis.

The torch-based parts load lazily, so that reading a GGUF's vocabulary (`--dump-tokens`, `--inspect`) does not
pay for importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .types import BLOCK_GEOMETRY, GGMLType, row_nbytes, tensor_nbytes, type_name

_LAZY = {
    "dequantize": "dequant",
    "quantize_q8_0": "synth",
    "random_blocks": "synth",
    "std_range": "synth",
    "to_bytes": "synth",
}

__all__ = ["BLOCK_GEOMETRY", "GGMLType", "row_nbytes", "tensor_nbytes", "type_name", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
