"""Integer activations: x quantized to int8 planes per block (ref.quantize_q8k) and the dp4a dot.

The routed experts (moe, moe_grouped) quantize per 256 values (Q8_K, model.md §14); the Q8_0 decode matvec
(matvec.Q8Config.int8) per 32, one x scale per weight block. TERMS 1: v = q1, d = amax / 127; TERMS 2 adds
the residual plane: v = 254 q1 + q2, d = amax / 32258 (~2^-16 of the block's amax, near f32 accuracy for
two dp4a instead of one).

Legend: R rows, K row length, T planes (TERMS), BLOCK values per scale.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import ref
from .dispatch import PDL, pdl_wait, use_triton


def dp4a_ok(t: torch.Tensor, want: bool = True) -> bool:
    """Whether kernels on t's device may use dp4a: inline PTX, so CUDA only and never under the
    interpreter (the kernels then run _dot4's plain int32 twin)."""
    return want and t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _dot4(a, b, c, DP4A: tl.constexpr):
    """c + sum over the 4 bytes of int32 words a, b as signed int8 products (broadcasting, int32)."""
    if DP4A:
        out = tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        out = c + ((a << 24) >> 24) * ((b << 24) >> 24)  # << then arithmetic >>: sign-extended byte 0
        out += ((a << 16) >> 24) * ((b << 16) >> 24)
        out += ((a << 8) >> 24) * ((b << 8) >> 24)
        out += (a >> 24) * (b >> 24)
    return out


@triton.jit
def _rne_int(v):
    """Round-half-even of f32 |v| < 2^22 to int32 (1.5 * 2^23 added: the mantissa holds the integer)."""
    r = (v + 12582912.0).to(tl.int32, bitcast=True)
    return (r & 0x7FFFFF) - 0x400000


@triton.jit
def _mul_rn(a, b, PTX: tl.constexpr):
    """a * b rounded to f32 by itself: never contracted into an FMA with the add that follows it (PTX
    mul.rn.f32 on the GPU, which the compiler does not fuse; the interpreter's numpy never fuses)."""
    if PTX:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    return a * b


@triton.jit
def q8k_block(x, TINY: tl.constexpr, TERMS: tl.constexpr, PTX: tl.constexpr):
    """x [R, BLOCK] f32 -> (q1, q2 int32 [R, BLOCK], d f32 [R]): ref.quantize_q8k per row of BLOCK values,
    bit for bit in any kernel (products by _mul_rn, divisions correctly rounded as torch's); TERMS 1: q2 is
    zeros. PTX: on a GPU (dp4a_ok), else under the interpreter."""
    amax = tl.max(tl.abs(x), axis=1)
    big = amax >= TINY
    safe = tl.where(big, amax, 1.0)
    iscale = tl.where(big, tl.div_rn(127.0, safe), 0.0)  # correctly rounded, as torch
    q = tl.minimum(tl.maximum(_rne_int(_mul_rn(x, iscale[:, None], PTX)), -127), 127)
    if TERMS == 2:  # residual plane: x in units of amax / 32258, minus 254 q (exact: both near 254 q)
        d = tl.where(big, tl.div_rn(amax, 32258.0), 0.0)
        t = _mul_rn(x, tl.where(big, tl.div_rn(32258.0, safe), 0.0)[:, None], PTX) - (254 * q).to(tl.float32)
        q2 = tl.minimum(tl.maximum(_rne_int(t), -127), 127)
    else:
        d = tl.where(big, tl.div_rn(amax, 127.0), 0.0)
        q2 = q * 0
    return q, q2, d


@triton.jit
def _q8k_quant_kernel(
    x_ptr, q_ptr, d_ptr, K, stride_x, plane,
    TINY: tl.constexpr, TERMS: tl.constexpr, BLOCK: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """Block program_id(1) of row program_id(0): x [R, K] (f32|bf16) -> q int8 [TERMS, R, K] (planes `plane`
    = R * K apart), d f32 [R, K/BLOCK]; the math of ref.quantize_q8k (q8k_block; also run without FMA
    contraction)."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    r = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * stride_x + blk * BLOCK + i).to(tl.float32)
    q, q2, d = q8k_block(x[None, :], TINY, TERMS, PTX)
    tl.store(q_ptr + r * K + blk * BLOCK + i[None, :], q.to(tl.int8))
    if TERMS == 2:
        tl.store(q_ptr + plane + r * K + blk * BLOCK + i[None, :], q2.to(tl.int8))
    tl.store(d_ptr + r * (K // BLOCK) + blk + tl.arange(0, 1), d)


def quantize_q8k(x: torch.Tensor, terms: int = 2, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] f32|bf16, K a multiple of block (32 or 256) -> (q int8 [T, R, K], d f32 [R, K/block]) per
    block values, T = terms planes, exactly as ref.quantize_q8k (T 1: d = amax / 127, q = RNE(x * 127 /
    amax); T 2: plus the residual plane, d = amax / 32258). One launch, no host sync."""
    if block not in (32, 256):
        raise ValueError(f"quantize_q8k: block must be 32 or 256, got {block}")
    if x.ndim != 2 or x.shape[1] % block:
        shape = tuple(x.shape)
        raise ValueError(f"quantize_q8k: x must be [rows, K] with K a multiple of {block}, got {shape}")
    if terms not in (1, 2):
        raise ValueError(f"quantize_q8k: terms must be 1 or 2, got {terms}")
    if not use_triton(x):
        return ref.quantize_q8k(x, terms, block)
    x = (x if x.dtype in (torch.float32, torch.bfloat16) else x.float()).contiguous()
    R, K = x.shape
    q = torch.empty(terms, R, K, dtype=torch.int8, device=x.device)
    d = torch.empty(R, K // block, dtype=torch.float32, device=x.device)
    if R:
        # no FMA contraction: products must round to f32 before the additions that follow (as torch)
        _q8k_quant_kernel[(R, K // block)](
            x, q, d, K, x.stride(0), R * K,
            TINY=ref.Q8K_TINY, TERMS=terms, BLOCK=block, PTX=dp4a_ok(x), num_warps=2 if block == 256 else 1,
            enable_fp_fusion=False, launch_pdl=PDL,
        )  # fmt: skip
    return q, d
