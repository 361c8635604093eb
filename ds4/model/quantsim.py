"""Simulated low-precision round trips that are part of the model (model.md §4, §14).

FP8 E4M3 on KV rows (nope dims, blocks of 64), FP4 E2M1 on indexer rows/queries (blocks of 32),
and the Hadamard-128 rotation before FP4. Scales are powers of two: 2^ceil(log2(amax / max_value)).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
FP4_MAX = 6.0
FP4_AMAX_FLOOR = 6.0 * torch.finfo(torch.float32).tiny  # 6 * FLT_MIN


def pow2_ceil(y: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(y)) for y > 0, exactly (from the binary exponent, no libm log2)."""
    mant, exp = torch.frexp(y)  # y = mant * 2^exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)  # exact powers of two keep their own exponent
    return torch.exp2(exp.to(torch.float32))


def fp8_e4m3_roundtrip(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Quantize-dequantize x [..., n] to FP8 E4M3 with one power-of-two scale per `block` values."""
    xb = x.unflatten(-1, (-1, block))  # [..., n/block, block]
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    scale = pow2_ceil(amax / FP8_MAX)
    q = (xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)  # RNE cast
    return (q * scale).flatten(-2)


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round |v| <= 6 to the nearest E2M1 value {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to even mantissa."""
    a = v.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))  # spacing of the binade of |v|
    return torch.copysign(torch.round(a / step) * step, v)  # torch.round is half-to-even


def fp4_e2m1_roundtrip(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Quantize-dequantize x [..., n] to FP4 E2M1 with one power-of-two scale per `block` values."""
    xb = x.unflatten(-1, (-1, block))  # [..., n/block, block]
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP4_AMAX_FLOOR)
    scale = pow2_ceil(amax / FP4_MAX)
    q = round_e2m1((xb / scale).clamp(-FP4_MAX, FP4_MAX))
    return (q * scale).flatten(-2)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """y = H_n x / sqrt(n) over the last dim, H_n the natural-order Sylvester matrix (n a power of 2)."""
    n = x.shape[-1]
    y = x
    h = 1
    while h < n:  # butterfly stage: pairs (i, i+h) inside blocks of 2h -> (a+b, a-b)
        y = y.unflatten(-1, (n // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return y * n**-0.5


def indexer_qat(x: torch.Tensor) -> torch.Tensor:
    """Indexer quantization-aware simulation of a row [..., Di]: Hadamard, then FP4 round trip."""
    return fp4_e2m1_roundtrip(hadamard(x))
