"""Rotary embedding on the tail of a row, plain or YaRN (model.md §4, official f32 recipe).

Legend: T tokens, R = n_rot (RoPE dims, the last R of each row), P = R/2 rotated pairs.
Pairs are ADJACENT dims (2j, 2j+1) of the tail (GPT-J style), not the two halves.
"""

from __future__ import annotations

import math

import torch

from ds4.config import ModelConfig


def yarn_pair_range(
    n_rot: int, base: float, orig_ctx: int, beta_fast: float, beta_slow: float
) -> tuple[int, int]:
    """Pair indices (lo, hi) where the YaRN ramp starts/ends (15/25 for Flash).

    Pair j makes orig_ctx / (2*pi / inv_freq_j) turns over the original context; lo is the pair making
    beta_fast turns (rounded down), hi the one making beta_slow turns (rounded up).
    """

    def pair_with_turns(turns: float) -> float:
        return n_rot * math.log(orig_ctx / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo = math.floor(pair_with_turns(beta_fast))
    hi = math.ceil(pair_with_turns(beta_slow))
    return max(lo, 0), min(hi, n_rot - 1)


def rope_inv_freq(
    n_rot: int,
    base: float,
    *,
    orig_ctx: int = 0,
    factor: float = 1.0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """Per-pair inverse frequencies [P] in float32; YaRN blends the frequencies when orig_ctx > 0."""
    inv = 1.0 / (base ** (torch.arange(0, n_rot, 2, dtype=torch.float32) / n_rot))  # [P]
    if orig_ctx > 0:
        lo, hi = yarn_pair_range(n_rot, base, orig_ctx, beta_fast, beta_slow)
        span = hi - lo if hi != lo else 0.001
        ramp = ((torch.arange(n_rot // 2, dtype=torch.float32) - lo) / span).clamp(0, 1)  # 0 -> 1 over lo..hi
        keep = 1 - ramp  # 1: original (extrapolated) frequency, 0: interpolated (frequency / factor)
        inv = inv / factor * (1 - keep) + inv * keep
    return inv


def layer_inv_freq(cfg: ModelConfig, layer: int) -> torch.Tensor:
    """Dense layers: plain RoPE with rope_base. Compressed layers: compress_rope_base with YaRN."""
    if cfg.compress_ratios[layer] == 0:
        return rope_inv_freq(cfg.n_rot, cfg.rope_base)
    return rope_inv_freq(
        cfg.n_rot,
        cfg.compress_rope_base,
        orig_ctx=cfg.rope_orig_ctx,
        factor=cfg.rope_factor,
        beta_fast=cfg.yarn_beta_fast,
        beta_slow=cfg.yarn_beta_slow,
    )


def rope_tail(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *, inverse: bool = False):
    """Rotate the last R dims of x by the angle pos * inv_freq (inverse: by -angle).

    x: [T, W] or [T, heads, W]; positions: [T] int64; inv_freq: [P]. Returns a new tensor.
    """
    n_rot = 2 * inv_freq.numel()
    angles = positions[:, None] * inv_freq[None, :]  # [T, P], f32(pos) * inv rounded to f32
    cis = torch.polar(torch.ones_like(angles), angles)  # [T, P] complex64
    if inverse:
        cis = cis.conj()
    if x.dim() == 3:
        cis = cis[:, None, :]  # broadcast over heads
    tail = torch.view_as_complex(x[..., -n_rot:].float().contiguous().unflatten(-1, (-1, 2)))  # [..., P]
    out = x.clone()
    out[..., -n_rot:] = torch.view_as_real(tail * cis).flatten(-2)
    return out
