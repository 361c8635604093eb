"""Dequantization of the ggml weight formats ds4 uses (model.md §3), in vectorized torch ops.

This is both the CPU path and the bit-exact reference that GPU kernels are checked against: every formula
keeps the float32 operation order of ggml / gguf-py (e.g. Q2_K is ``(d*sc)*q - dmin*m``, never a fused or
reordered form), so results equal ``gguf.quants.dequantize`` bit for bit on CPU and CUDA (eager ops, no FMA).

Shape legend: n = blocks in a chunk; B = bytes per block; K = elements per block.
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .tables import IQ2XXS_GRID, KSIGNS
from .types import BLOCK_GEOMETRY, GGMLType, type_name

# Output elements dequantized per step: bounds the temporaries (a few x this many floats), so huge expert
# tensors never need several times their size in scratch memory. GPUs get larger steps (fewer launches).
_CHUNK_ELEMS_CPU = 1 << 22
_CHUNK_ELEMS_GPU = 1 << 26

# Plain types: ggml type -> torch dtype of the stored values.
_PLAIN_DTYPES: dict[GGMLType, torch.dtype] = {
    GGMLType.F32: torch.float32,
    GGMLType.F16: torch.float16,
    GGMLType.BF16: torch.bfloat16,
    GGMLType.I32: torch.int32,
}


def as_qtype(qtype: Any) -> GGMLType:
    """Normalize an int / GGMLType / gguf.GGMLQuantizationType to GGMLType, or raise a ValueError."""
    try:
        return GGMLType(int(qtype))
    except (ValueError, TypeError):
        supported = ", ".join(f"{t.name}({int(t)})" for t in GGMLType)
        raise ValueError(f"unsupported ggml type {qtype!r}; supported: {supported}") from None


def as_byte_tensor(raw: Any) -> torch.Tensor:
    """View packed bytes as a flat uint8 tensor without copying when possible.

    Accepts a torch tensor or numpy array (np.memmap views included) of any dtype, or bytes-like objects; the
    bytes of a non-uint8 array are reinterpreted (GGUF readers return F32/F16 tensors as typed arrays).
    """
    if isinstance(raw, torch.Tensor):
        t = raw if raw.is_contiguous() else raw.contiguous()
        return t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)
    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(raw, dtype=np.uint8)
    if isinstance(raw, np.ndarray):
        arr = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        with warnings.catch_warnings():
            # Read-only memmaps: we never write through this view, so torch's warning does not apply.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            return torch.from_numpy(arr)
    raise TypeError(f"raw must be a torch.Tensor, numpy array or bytes-like, got {type(raw).__name__}")


# ---------------------------------------------------------------------------------------------------------
# Per-format block decoders: [n, B] uint8 -> [n, K] float32


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian f16 bytes -> [n] float32 (exact widening)."""
    return b.contiguous().view(torch.float16).reshape(-1).float()


@functools.cache
def _shifts(device: torch.device, values: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device).reshape(shape)


@functools.cache
def _iq2xxs_signed_grid(device: torch.device) -> torch.Tensor:
    """[256 * 128, 8] float32: row g*128 + s = IQ2XXS_GRID[g] magnitudes with KSIGNS[s] signs applied.

    Applying the ±1 inside the table is bit-identical to multiplying db*g by ±1 afterwards (sign of a product
    does not depend on grouping, RNE is symmetric), and saves one gather and one multiply per element.
    """
    grid = torch.tensor(IQ2XXS_GRID, dtype=torch.int64).view(torch.uint8).reshape(256, 1, 8).float()
    bits = torch.arange(8, dtype=torch.uint8)
    signs = (torch.tensor(KSIGNS, dtype=torch.uint8).reshape(128, 1) >> bits) & 1  # [128, 8]
    signed = grid * (1.0 - 2.0 * signs.float()).reshape(1, 128, 8)  # [256, 128, 8]
    return signed.reshape(256 * 128, 8).to(device)


def _dequant_q8_0(blk: torch.Tensor) -> torch.Tensor:
    # Block: f16 d | int8 q[32];  x = q * d
    d = _f16(blk[:, 0:2])  # [n]
    q = blk[:, 2:34].view(torch.int8).float()  # [n, 32]
    return q * d[:, None]


def _dequant_q2_k(blk: torch.Tensor) -> torch.Tensor:
    # Block: u8 scales[16] | u8 qs[64] | f16 d | f16 dmin;  x = (d*(sc&15)) * q - dmin*(sc>>4)
    n = blk.shape[0]
    sc = blk[:, 0:16]  # [n, 16] one byte per 16-element group
    d = _f16(blk[:, 80:82])
    dmin = _f16(blk[:, 82:84])
    dl = (d[:, None] * (sc & 15).float())[..., None]  # [n, 16, 1]
    ml = (dmin[:, None] * (sc >> 4).float())[..., None]  # [n, 16, 1]
    # [n, half=2, shift=4, 32 bytes] -> groups of 16 in output order (half, shift, byte 0..15 | 16..31)
    q = (blk[:, 16:80].reshape(n, 2, 1, 32) >> _shifts(blk.device, (0, 2, 4, 6), (1, 1, 4, 1))) & 3
    return (dl * q.reshape(n, 16, 16).float() - ml).reshape(n, 256)


def _dequant_q4_k(blk: torch.Tensor) -> torch.Tensor:
    # Block: f16 d | f16 dmin | u8 scales[12] (8 x 6-bit scale + 8 x 6-bit min) | u8 qs[128]
    n = blk.shape[0]
    d = _f16(blk[:, 0:2])
    dmin = _f16(blk[:, 2:4])
    lo, mid, hi = blk[:, 4:8], blk[:, 8:12], blk[:, 12:16]  # [n, 4] each
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=1)  # [n, 8] sub-block scales
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)  # [n, 8] sub-block mins
    dl = (d[:, None] * sc.float())[..., None]  # [n, 8, 1]
    ml = (dmin[:, None] * mn.float())[..., None]  # [n, 8, 1]
    # chunk c of 32 bytes: low nibbles -> sub-block 2c, high nibbles -> 2c+1
    q = (blk[:, 16:144].reshape(n, 4, 1, 32) >> _shifts(blk.device, (0, 4), (1, 1, 2, 1))) & 15
    return (dl * q.reshape(n, 8, 32).float() - ml).reshape(n, 256)


def _dequant_iq2_xxs(blk: torch.Tensor) -> torch.Tensor:
    # Block: f16 d | 8 sub-blocks x 8 bytes: 4 grid indices (a0), then a1 = 4 x 7-bit sign index | 4-bit scale
    n = blk.shape[0]
    d = _f16(blk[:, 0:2])  # [n]
    sub = blk[:, 2:66].reshape(n, 8, 8)  # [n, sub-block, byte]
    b = sub[..., 4:8].to(torch.int32)  # [n, 8, 4] bytes of a1 (little-endian)
    a1 = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)  # [n, 8]; bit 31 may wrap
    # (d * (0.5 + s)) * 0.25, in this order, as ggml does
    db = d[:, None] * (0.5 + (sub[..., 7] >> 4).float()) * 0.25  # [n, 8]
    shifts = torch.tensor([0, 7, 14, 21], dtype=torch.int32, device=blk.device)
    sign_idx = (a1[..., None] >> shifts) & 127  # [n, 8, 4]; masks bits < 28, so the wrap is harmless
    row = sub[..., 0:4].to(torch.int64) * 128 + sign_idx  # [n, 8, 4] rows of the signed grid
    vals = torch.index_select(_iq2xxs_signed_grid(blk.device), 0, row.reshape(-1))  # [n*32, 8]
    vals = vals.reshape(n, 8, 4, 8)  # (index_select: ~2x faster than advanced indexing on CPU)
    return (db[..., None, None] * vals).reshape(n, 256)


_BLOCK_DECODERS: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.Q8_0: _dequant_q8_0,
    GGMLType.Q2_K: _dequant_q2_k,
    GGMLType.Q4_K: _dequant_q4_k,
    GGMLType.IQ2_XXS: _dequant_iq2_xxs,
}


# ---------------------------------------------------------------------------------------------------------


def check_shape(qtype: GGMLType, shape: Sequence[int]) -> tuple[int, ...]:
    """Validate a logical tensor shape for qtype: ints >= 0, rows of whole blocks. Returns it as a tuple."""
    try:
        dims = tuple(operator.index(s) for s in shape)  # ints only: 1.5 must not become 1
    except (TypeError, ValueError):
        raise ValueError(f"{qtype.name}: shape must be a sequence of ints, got {shape!r}") from None
    if not dims or any(s < 0 for s in dims):
        raise ValueError(f"{qtype.name}: shape must have >= 1 non-negative dims, got {dims}")
    block_elems, _ = BLOCK_GEOMETRY[qtype]
    if dims[-1] % block_elems:
        raise ValueError(
            f"{qtype.name} tensor of shape {dims}: row length {dims[-1]} is not a multiple of the "
            f"block size {block_elems}"
        )
    return dims


def dequantize(raw: Any, qtype: Any, shape: Sequence[int]) -> torch.Tensor:
    """Decode packed ggml bytes to a new tensor of the logical ``shape`` (row-major, last dim = row length).

    raw: the tensor's bytes: uint8 torch tensor / numpy array / memmap view (any shape; other dtypes have
         their bytes reinterpreted). Read in chunks; the only full-size allocation is the result.
    qtype: ggml type id (int, GGMLType or gguf.GGMLQuantizationType).
    Returns float32 on raw's device (CPU for numpy), except I32 which returns int32 (passthrough). The result
    never shares memory with raw. Raises ValueError for unsupported types, bad shapes or a wrong byte count.
    """
    qt = as_qtype(qtype)
    dims = check_shape(qt, shape)
    data = as_byte_tensor(raw)
    numel = int(np.prod(dims, dtype=np.int64))
    block_elems, block_bytes = BLOCK_GEOMETRY[qt]
    n_blocks = numel // block_elems
    expected = n_blocks * block_bytes
    if data.numel() != expected:
        raise ValueError(
            f"{qt.name} tensor of shape {dims}: expected {expected} bytes "
            f"({n_blocks} blocks x {block_bytes}), got {data.numel()}"
        )
    out_dtype = torch.int32 if qt == GGMLType.I32 else torch.float32
    out = torch.empty(numel, dtype=out_dtype, device=data.device)
    chunk_elems = _CHUNK_ELEMS_GPU if data.device.type != "cpu" else _CHUNK_ELEMS_CPU
    step = max(1, chunk_elems // block_elems)  # blocks per chunk
    for b0 in range(0, n_blocks, step):
        b1 = min(n_blocks, b0 + step)
        chunk = data[b0 * block_bytes : b1 * block_bytes]
        out[b0 * block_elems : b1 * block_elems] = _decode_chunk(qt, chunk, b1 - b0)
    return out.reshape(dims)


def _decode_chunk(qt: GGMLType, chunk: torch.Tensor, n: int) -> torch.Tensor:
    """[n * B] uint8 -> [n * K] decoded values."""
    if qt in _PLAIN_DTYPES:
        dtype = _PLAIN_DTYPES[qt]
        size = dtype.itemsize
        if chunk.data_ptr() % size or chunk.storage_offset() % size:
            chunk = chunk.clone()  # unaligned view (e.g. odd file offset): reinterpreting needs alignment
        return chunk.view(dtype)
    _, block_bytes = BLOCK_GEOMETRY[qt]
    return _BLOCK_DECODERS[qt](chunk.reshape(n, block_bytes)).reshape(-1)


__all__ = ["as_byte_tensor", "as_qtype", "check_shape", "dequantize", "type_name"]
