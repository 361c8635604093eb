"""Synthesis of packed ggml weights: valid random blocks of a target std, Q8_0 quantization, plain-type bytes.

Device-agnostic torch: the synthetic-model writer runs it on CPU, GPU benchmarks run it on CUDA to build
full-size weights in GPU memory. Blocks are independent, so callers may generate a big tensor in row chunks.
(The one non-torch piece: on CPU, random bytes come from numpy's PCG64 seeded by the torch generator.)

Random blocks are random bytes (every bit pattern of quants, sub-scales, grid and sign indices is valid) with
the f16 super-block scales overwritten by finite values chosen to hit the requested std:
    d = a * u, u ~ U[0.5, 1.5] per block (scales vary, as in real files), dmin = c * d (c centers the values);
    E[x^2] = E[d^2] * K with K the mean square of a value at d = 1 over uniform random bytes, so a is set from
    std^2 = a^2 * E[u^2] * K. Unit constants K are derived below from the formats' value ranges.

Shape legend: n = blocks; B = bytes per block; K_blk = elements per block; R = rows (all dims but the last).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .dequant import as_qtype, check_shape
from .tables import IQ2XXS_GRID
from .types import BLOCK_GEOMETRY, GGMLType

_F16_MAX = 65504.0
# Smallest per-block d we produce: 2^-20 is an f16 subnormal of 16 steps of 2^-24 (<= 3% rounding of d).
_D_MIN = 2.0**-20
_U_LO, _U_HI = 0.5, 1.5
_U_MEAN_SQ = (_U_HI**3 - _U_LO**3) / (3 * (_U_HI - _U_LO))  # E[u^2] of U[0.5, 1.5] = 13/12


def _mean(lo: int, hi: int) -> float:
    """Mean of the uniform integer distribution on [lo, hi]."""
    return (lo + hi) / 2


def _mean_sq(lo: int, hi: int) -> float:
    """E[k^2] of the uniform integer distribution on [lo, hi]."""
    return sum(k * k for k in range(lo, hi + 1)) / (hi - lo + 1)


def _iq2xxs_grid_mean_sq() -> float:
    mags = [(entry >> (8 * j)) & 0xFF for entry in IQ2XXS_GRID for j in range(8)]
    return sum(g * g for g in mags) / len(mags)


@dataclass(frozen=True)
class _Recipe:
    """Where a block's f16 scales live and how random bytes map to values (see module docstring)."""

    d_offset: int
    dmin_offset: int | None  # None: no dmin field
    dmin_ratio: float  # c in dmin = c * d, chosen so E[x] = 0
    unit_mean_sq: float  # K: E[x^2] at d = 1


def _recipes() -> dict[GGMLType, _Recipe]:
    # Q8_0: x = d*q, q uniform int8 in [-128, 127].
    q8 = _Recipe(0, None, 0.0, _mean_sq(-128, 127))
    # Q2_K: x = d*s*q - dmin*m, s, m uniform 4-bit, q uniform 2-bit; c = E[s]E[q]/E[m] = 1.5.
    s2, q2 = (0, 15), (0, 3)
    c2 = _mean(*s2) * _mean(*q2) / _mean(*s2)
    k2 = _mean_sq(*s2) * _mean_sq(*q2) - 2 * c2 * _mean(*s2) ** 2 * _mean(*q2) + c2**2 * _mean_sq(*s2)
    # Q4_K: same shape with 6-bit s, m and 4-bit q; c = 7.5.
    s4, q4 = (0, 63), (0, 15)
    c4 = _mean(*s4) * _mean(*q4) / _mean(*s4)
    k4 = _mean_sq(*s4) * _mean_sq(*q4) - 2 * c4 * _mean(*s4) ** 2 * _mean(*q4) + c4**2 * _mean_sq(*s4)
    # IQ2_XXS: x = d * (0.5 + s) * 0.25 * (±g), s uniform 4-bit, g a grid magnitude; signs make E[x] = 0.
    kiq = 0.25**2 * (_mean_sq(0, 15) + _mean(0, 15) + 0.25) * _iq2xxs_grid_mean_sq()
    return {
        GGMLType.Q8_0: q8,
        GGMLType.Q2_K: _Recipe(80, 82, c2, k2),
        GGMLType.Q4_K: _Recipe(0, 2, c4, k4),
        GGMLType.IQ2_XXS: _Recipe(0, None, 0.0, kiq),
    }


_RECIPES = _recipes()
_PLAIN = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}


def std_range(qtype: object) -> tuple[float, float]:
    """The std values random_blocks accepts for qtype (keeps every f16 scale finite and not too coarse)."""
    qt = as_qtype(qtype)
    if qt in _PLAIN:
        return (0.0, _F16_MAX / 8 if qt == GGMLType.F16 else 1e30)
    if qt not in _RECIPES:
        raise ValueError(f"random_blocks does not support {qt.name}")
    r = _RECIPES[qt]
    unit = math.sqrt(_U_MEAN_SQ * r.unit_mean_sq)  # std at a = 1
    max_ratio = max(1.0, r.dmin_ratio)
    return (_D_MIN / _U_LO * unit, _F16_MAX / (_U_HI * max_ratio) * unit)


def random_bytes(
    n: int, *, generator: torch.Generator, device: torch.device | str | None = None
) -> torch.Tensor:
    """[n] uint8 of uniform random bytes on ``device`` (default: the generator's device), deterministic in the
    generator's state.

    Drawn 64 bits at a time. On CPU the words come from numpy's PCG64 seeded from ``generator``: ~3x the
    throughput of torch's serial CPU generator, which would otherwise bound synthetic-model writing.
    """
    dev = torch.device(device) if device is not None else generator.device
    n_words = (n + 7) // 8
    if dev.type == "cpu":
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        words = torch.from_numpy(np.random.PCG64(seed).random_raw(n_words).view(np.int64))
    else:
        words = torch.empty(n_words, dtype=torch.int64, device=dev)
        words.random_(-(2**63), None, generator=generator)  # full 64-bit range: every bit uniform
    return words.view(torch.uint8)[:n]


def random_blocks(
    qtype: object,
    shape: Sequence[int],
    *,
    std: float,
    generator: torch.Generator,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Valid random packed weights for a tensor of logical ``shape`` whose values have roughly ``std``.

    Returns uint8 [*shape[:-1], row_bytes] on ``device`` (default: the generator's device). Every f16 scale is
    finite; the value std is within a few percent of ``std`` in expectation (tests allow 2x). Supported:
    F32, F16, BF16 (bytes of normal(0, std) values), Q8_0, Q2_K, Q4_K, IQ2_XXS. Raises ValueError for other
    types, rows that are not whole blocks, or std outside std_range(qtype).
    """
    qt = as_qtype(qtype)
    dims = check_shape(qt, shape)
    lo, hi = std_range(qt)
    if not (math.isfinite(std) and lo <= std <= hi and std > 0):
        raise ValueError(f"random_blocks {qt.name}: std must be in [{lo:.3g}, {hi:.3g}] and > 0, got {std}")
    dev = torch.device(device) if device is not None else generator.device
    if dev.type != generator.device.type:
        raise ValueError(f"random_blocks: generator is on {generator.device} but device is {dev}")
    block_elems, block_bytes = BLOCK_GEOMETRY[qt]
    rows = dims[:-1]
    row_bytes = dims[-1] // block_elems * block_bytes
    if qt in _PLAIN:
        x = torch.randn(dims, generator=generator, device=dev).mul_(std)
        if qt == GGMLType.F16:
            x = x.clamp_(-_F16_MAX, _F16_MAX)  # a far tail sample must not become inf
        return to_bytes(x, qt)
    n = math.prod(dims) // block_elems
    blocks = random_bytes(n * block_bytes, generator=generator, device=dev).reshape(n, block_bytes)  # [n, B]
    r = _RECIPES[qt]
    a = std / math.sqrt(_U_MEAN_SQ * r.unit_mean_sq)
    u = torch.rand(n, generator=generator, device=dev) * (_U_HI - _U_LO) + _U_LO  # [n]
    d = a * u
    blocks[:, r.d_offset : r.d_offset + 2] = _f16_bytes(d)
    if r.dmin_offset is not None:
        blocks[:, r.dmin_offset : r.dmin_offset + 2] = _f16_bytes(d * r.dmin_ratio)
    return blocks.reshape(*rows, row_bytes)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[n] float -> [n, 2] little-endian f16 bytes."""
    return x.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """Quantize float values to Q8_0 with ggml's reference rule (bit-exact with gguf.quants.quantize).

    Per 32 values: d = amax / 127 (float32, stored as f16), id = 1/d (0 if d == 0), q = roundf(x * id) with
    ties away from zero. x: [..., K] finite floats, K a multiple of 32 -> uint8 [..., K / 32 * 34].
    """
    if x.ndim == 0 or x.shape[-1] % 32:
        raise ValueError(f"Q8_0 quantization needs rows of a multiple of 32 values, got {tuple(x.shape)}")
    if not torch.is_floating_point(x):
        raise ValueError(f"Q8_0 quantization needs a float tensor, got {x.dtype}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("Q8_0 quantization needs finite values (got NaN or Inf)")
    xb = x.float().reshape(-1, 32)  # [n, 32]
    d = xb.abs().amax(dim=1, keepdim=True) / 127  # [n, 1]
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = xb * inv
    t = torch.trunc(v)
    q = t + torch.sign(v) * ((v - t).abs() >= 0.5)  # roundf: ties away from zero (torch.round is half-even)
    out = torch.cat([_f16_bytes(d), q.to(torch.int8).view(torch.uint8)], dim=1)  # [n, 34]
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * 34)


def to_bytes(x: torch.Tensor, qtype: object) -> torch.Tensor:
    """Values -> bytes of a plain type (F32, F16, BF16: RNE rounding; I32): [..., K] -> [..., K * size]."""
    qt = as_qtype(qtype)
    dtypes = {**_PLAIN, GGMLType.I32: torch.int32}
    if qt not in dtypes:
        raise ValueError(f"to_bytes supports F32, F16, BF16, I32; got {qt.name} (use a quantizer)")
    y = x.to(dtypes[qt]).contiguous()
    shape = (*y.shape[:-1], -1) if y.ndim else (-1,)
    return y.view(torch.uint8).reshape(shape)


__all__ = ["quantize_q8_0", "random_blocks", "random_bytes", "std_range", "to_bytes"]
