"""ggml tensor types used by ds4 GGUF files, with their block geometry (model.md §3)."""

from __future__ import annotations

from enum import IntEnum


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q8_0 = 8
    Q2_K = 10
    Q4_K = 12
    IQ2_XXS = 16
    I32 = 26
    BF16 = 30


# type -> (elements per block, bytes per block)
BLOCK_GEOMETRY: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q4_K: (256, 144),
    GGMLType.IQ2_XXS: (256, 66),
}


def type_name(qtype: int) -> str:
    try:
        return GGMLType(qtype).name
    except ValueError:
        return f"type#{qtype}"


def tensor_nbytes(qtype: int, n_elements: int) -> int:
    """Byte size of n_elements stored as qtype (whole blocks)."""
    block_elems, block_bytes = BLOCK_GEOMETRY[GGMLType(qtype)]
    return -(-n_elements // block_elems) * block_bytes


def row_nbytes(qtype: int, row_len: int) -> int:
    """Byte size of one row; row_len must be a whole number of blocks."""
    block_elems, block_bytes = BLOCK_GEOMETRY[GGMLType(qtype)]
    if row_len % block_elems:
        raise ValueError(f"{type_name(qtype)} rows need a multiple of {block_elems} elements, got {row_len}")
    return row_len // block_elems * block_bytes
