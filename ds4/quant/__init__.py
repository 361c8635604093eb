"""ggml weight formats: block geometry, dequantization (CPU path, GPU reference), packed-weight synthesis."""

from .dequant import dequantize
from .synth import quantize_q8_0, random_blocks, std_range, to_bytes
from .types import BLOCK_GEOMETRY, GGMLType, row_nbytes, tensor_nbytes, type_name

__all__ = [
    "BLOCK_GEOMETRY",
    "GGMLType",
    "dequantize",
    "quantize_q8_0",
    "random_blocks",
    "row_nbytes",
    "std_range",
    "tensor_nbytes",
    "to_bytes",
    "type_name",
]
