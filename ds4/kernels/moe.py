"""Routed experts for decode / small batches: gathered-expert GEMVs on packed expert stacks (model.md §5.5).

Expert ids come from a device tensor and are read inside the kernels (no host sync: CUDA-graph capturable).
One program = one (row b, slot j) pair x one tile of output rows, so the B*k selected experts run in one
launch each for gate+up and for down; a pair reads its expert's rows only.

Router weight placement: ``moe_gate_up`` returns the *unweighted* clamped SwiGLU output and ``moe_down``
multiplies each pair's down projection by weights[b, j] before summing over j. By linearity this is
sum_j Wd[e_j] @ (w_j * mid_j), the formula of model.md §5.5 (weight applied before the down projection), up to
f32 rounding.

MoeConfig.int8 (the default; env DS4_MOE_INT8=0: the f32 kernels) selects the integer kernels for IQ2_XXS
gate/up and Q2_K down: x and mid quantized per 256 values to int8 planes, integer dots. MoeConfig.terms = 1
is the C original's Q8_K (model.md §14, ~1 % of the output scale off the f32 path); terms = 2 (default) adds
a second int8 plane holding the rounding residual (ref.quantize_q8k), ~250x smaller error for two dp4a
instead of one.

For larger batches (prefill), sort the pairs by expert with ``group_by_expert`` and use matmul.moe_grouped.

Legend: B rows, k experts per row, K model width (4096), F expert width (2048), E experts, D = down output.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ds4.quant.tables import KSIGNS
from ds4.quant.types import GGMLType

from . import ref
from .dispatch import PDL, pdl_wait
from .intq import _dot4, dp4a_ok, quantize_q8k  # noqa: F401 (quantize_q8k: re-exported, moe.quantize_q8k)
from .matvec import (
    _split_counters,
    _split_fixup,
    check_weight,
    dot_rows,
    prep_x,
    qtype_code,
    sub_width,
    tile_k,
    use_triton,
    weight_args,
)
from .packing import (
    PRMT_NEG,
    PRMT_POS,
    PackedWeight,
    iq2_sign_nibbles,
    iq2xxs_codes16,
    iq2xxs_grid_i64,
    iq2xxs_nibbles,
)

_PRMT_POS = tl.constexpr(PRMT_POS)  # readable inside the kernels
_PRMT_NEG = tl.constexpr(PRMT_NEG)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    g0,
    g1,
    g2,
    g3,
    u0,
    u1,
    u2,
    u3,
    ids_ptr,
    out_ptr,
    n_slots,
    F,
    K,
    stride_x,
    clamp,
    kt_per_split,
    QT: tl.constexpr,
    BN: tl.constexpr,
    TK: tl.constexpr,
    SW: tl.constexpr,
    CLAMP: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """SPLIT: write raw (g, u) partial sums of k-split program_id(2) to out [S, 2, pairs, F]; else the
    finished clamped SwiGLU to out [pairs, F]."""
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)  # = b * n_slots + j
    pid_s = tl.program_id(2)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    wrow = e * F + tl.minimum(n, F - 1)
    xrow = tl.zeros([1], dtype=tl.int64) + (pair // n_slots).to(tl.int64) * stride_x
    xmask = tl.full([1], 1, tl.int1)
    lo = pid_s * kt_per_split
    hi = tl.minimum(lo + kt_per_split, K // TK)
    g = dot_rows(g0, g1, g2, g3, wrow, x_ptr, xrow, xmask, lo, hi, K, QT, 1, BN, TK, SW, False)
    u = dot_rows(u0, u1, u2, u3, wrow, x_ptr, xrow, xmask, lo, hi, K, QT, 1, BN, TK, SW, False)
    if SPLIT:
        n_pairs = tl.num_programs(1)
        base = out_ptr + (pid_s.to(tl.int64) * 2 * n_pairs + pair) * F
        tl.store(base + n[None, :], g, mask=(n < F)[None, :])
        tl.store(base + n_pairs.to(tl.int64) * F + n[None, :], u, mask=(n < F)[None, :])
    else:
        tl.store(
            out_ptr + pair.to(tl.int64) * F + n[None, :], _swiglu(g, u, clamp, CLAMP), mask=(n < F)[None, :]
        )


@triton.jit
def _swiglu(g, u, clamp, CLAMP: tl.constexpr):
    if CLAMP:
        g = tl.minimum(g, clamp)  # the gate has no lower bound (§5.5)
        u = tl.minimum(tl.maximum(u, -clamp), clamp)
    return g / (1.0 + tl.exp(-g)) * u  # silu(g) * u


@triton.jit
def _store_gate_up(out_ptr, acc_g, acc_u, pair, pid_s, n, F, clamp, CLAMP: tl.constexpr, SPLIT: tl.constexpr):
    """The output of a gate/up program with [BN] sums: SPLIT, raw (g, u) partials of k-split pid_s to
    out [S, 2, pairs, F]; else the finished clamped SwiGLU to out [pairs, F]."""
    if SPLIT:
        n_pairs = tl.num_programs(1)
        base = out_ptr + (pid_s.to(tl.int64) * 2 * n_pairs + pair) * F
        tl.store(base + n, acc_g, mask=n < F)
        tl.store(base + n_pairs.to(tl.int64) * F + n, acc_u, mask=n < F)
    else:
        tl.store(out_ptr + pair.to(tl.int64) * F + n, _swiglu(acc_g, acc_u, clamp, CLAMP), mask=n < F)


@triton.jit
def _swiglu_sum_kernel(part_ptr, out_ptr, M, S, clamp, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    """part [S, 2, M] (g, u partials) -> out [M] = SwiGLU(sum_s g, sum_s u), summed in fixed order."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < M
    g = tl.zeros([BLOCK], dtype=tl.float32)
    u = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(S):
        g += tl.load(part_ptr + s * 2 * M + i, mask=m, other=0.0)
        u += tl.load(part_ptr + (s * 2 + 1) * M + i, mask=m, other=0.0)
    tl.store(out_ptr + i, _swiglu(g, u, clamp, CLAMP), mask=m)


@triton.jit
def _down_kernel(
    mid_ptr,
    w0,
    w1,
    w2,
    w3,
    ids_ptr,
    rw_ptr,
    out_ptr,
    D,
    F,
    kt_per_split,
    QT: tl.constexpr,
    BN: tl.constexpr,
    TK: tl.constexpr,
    SW: tl.constexpr,
):
    """out [S, pairs, D]: k-split program_id(2)'s share of weights[pair] * Wd[e] @ mid[pair]."""
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    pid_s = tl.program_id(2)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    rw = tl.load(rw_ptr + pair).to(tl.float32)
    n = pid_n * BN + tl.arange(0, BN)
    wrow = e * D + tl.minimum(n, D - 1)
    xrow = tl.zeros([1], dtype=tl.int64) + pair.to(tl.int64) * F
    xmask = tl.full([1], 1, tl.int1)
    lo = pid_s * kt_per_split
    hi = tl.minimum(lo + kt_per_split, F // TK)
    y = dot_rows(w0, w1, w2, w3, wrow, mid_ptr, xrow, xmask, lo, hi, F, QT, 1, BN, TK, SW, False)
    out = out_ptr + (pid_s.to(tl.int64) * tl.num_programs(1) + pair) * D
    tl.store(out + n[None, :], y * rw, mask=(n < D)[None, :])


# ---------------------------------------------------------------------------------------------------------
# Dedicated decode kernels for the release expert formats (IQ2_XXS gate/up, Q2_K down): a whole super-block
# of every matrix per step, each group of x products summed before scaling, 32-bit table words. The guess was
# that the general dot_rows path is latency-bound at B = 1; on the H200 these were SLOWER (gate+up 132 vs
# 89 us, down ~62 vs 39-62 us): the IQ2_XXS decode is instruction-bound (~30 ops per weight), so they are off
# by default (MoeConfig.fast) and kept, tested; the integer-dot (dp4a) versions follow (MoeConfig.int8).


@triton.jit
def _iq2_block(qs, sg, dd, tab32, wrow, kt, nb, xv):
    """[BN] f32: one IQ2_XXS super-block kt of rows wrow dotted with xv [32, 2, 4] (its 256 x values).

    Group g (8 elements) = grid row qs[g] (8 magnitude bytes = two int32 words) with sign pattern
    KSIGNS[s], s = 7 bits of the sub-block word a1 (g // 4) at 7 * (g % 4); scale d * (0.5 + a1 >> 28) / 4."""
    g = tl.arange(0, 32)
    h = tl.arange(0, 2)
    b = tl.arange(0, 4)
    idx = tl.load(qs + wrow[:, None] * (nb * 32) + kt * 32 + g[None, :]).to(tl.int32)  # [BN, 32]
    a1 = tl.load(sg + wrow[:, None] * (nb * 8) + kt * 8 + (g // 4)[None, :])  # [BN, 32] int32
    d = tl.load(dd + wrow * nb + kt).to(tl.float32)  # [BN]
    words = tl.load(tab32 + idx[:, :, None] * 2 + h[None, None, :])  # [BN, 32, 2] int32
    mag = ((words[:, :, :, None] >> (8 * b)[None, None, None, :]) & 255).to(tl.float32)  # [BN, 32, 2, 4]
    s = (a1 >> (7 * (g % 4))[None, :]) & 127
    p = s ^ (s >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    signs = s | ((p & 1) << 7)  # [BN, 32]: bit j negates element j of the group
    bit = (h[:, None] * 4 + b[None, :])[None, None, :, :]  # [1, 1, 2, 4]
    neg = ((signs[:, :, None, None] >> bit) & 1) != 0
    prod = tl.where(neg, -mag, mag) * xv[None, :, :, :]
    grp = tl.sum(tl.sum(prod, axis=3), axis=2)  # [BN, 32]
    db = (0.5 + ((a1 >> 28) & 15).to(tl.float32)) * 0.25
    return tl.sum(grp * db, axis=1) * d


@triton.jit
def _iq2_gate_up_kernel(
    x_ptr,
    gq,
    gs,
    gd,
    uq,
    us,
    ud,
    tab32,
    ids_ptr,
    out_ptr,
    n_slots,
    F,
    K,
    stride_x,
    clamp,
    kt_per_split,
    BN: tl.constexpr,
    CLAMP: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """IQ2_XXS gate and up of one (row, slot) pair in one loop; outputs as _gate_up_kernel."""
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    pid_s = tl.program_id(2)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    wrow = e * F + tl.minimum(n, F - 1)
    nb = K // 256
    xo = x_ptr + (pair // n_slots).to(tl.int64) * stride_x
    xcol = (
        tl.arange(0, 32)[:, None, None] * 8
        + tl.arange(0, 2)[None, :, None] * 4
        + tl.arange(0, 4)[None, None, :]
    )
    lo = pid_s * kt_per_split
    hi = tl.minimum(lo + kt_per_split, nb)
    acc_g = tl.zeros([BN], dtype=tl.float32)
    acc_u = tl.zeros([BN], dtype=tl.float32)
    for kt in range(lo, hi):
        xv = tl.load(xo + kt * 256 + xcol).to(tl.float32)  # [32, 2, 4]
        acc_g += _iq2_block(gq, gs, gd, tab32, wrow, kt, nb, xv)
        acc_u += _iq2_block(uq, us, ud, tab32, wrow, kt, nb, xv)
    _store_gate_up(out_ptr, acc_g, acc_u, pair, pid_s, n, F, clamp, CLAMP, SPLIT)


@triton.jit
def _q2k_down_kernel(
    mid_ptr,
    qs,
    sc,
    dm,
    ids_ptr,
    rw_ptr,
    out_ptr,
    D,
    F,
    kt_per_split,
    BN: tl.constexpr,
):
    """Q2_K down projection; output as _down_kernel. Per super-block: element 128 hh + 32 t + 16 gg + i is
    bits 2t of byte 32 hh + 16 gg + i, scale byte 8 hh + 2 t + gg; sum_i (dl q_i - ml) x_i is computed as
    dl * sum_i q_i x_i - ml * sum_i x_i."""
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    pid_s = tl.program_id(2)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    rw = tl.load(rw_ptr + pair).to(tl.float32)
    n = pid_n * BN + tl.arange(0, BN)
    wrow = e * D + tl.minimum(n, D - 1)
    nb = F // 256
    c = tl.arange(0, 4)  # 16-byte group c = 2 hh + gg
    t = tl.arange(0, 4)  # shift pair
    i = tl.arange(0, 16)
    # x column of (c, t, i): 128 (c // 2) + 32 t + 16 (c % 2) + i
    xcol = (
        (c // 2)[:, None, None] * 128 + t[None, :, None] * 32 + (c % 2)[:, None, None] * 16 + i[None, None, :]
    )
    sidx = (c // 2)[:, None] * 8 + 2 * t[None, :] + (c % 2)[:, None]  # [4c, 4t] scale byte
    xo = mid_ptr + pair.to(tl.int64) * F
    lo = pid_s * kt_per_split
    hi = tl.minimum(lo + kt_per_split, nb)
    acc = tl.zeros([BN], dtype=tl.float32)
    for kt in range(lo, hi):
        q8 = tl.load(
            qs + wrow[:, None, None] * (nb * 64) + kt * 64 + c[None, :, None] * 16 + i[None, None, :]
        )
        s8 = tl.load(sc + wrow[:, None, None] * (nb * 16) + kt * 16 + sidx[None, :, :])  # [BN, 4c, 4t]
        d = tl.load(dm + wrow * (nb * 2) + kt * 2).to(tl.float32)
        dmin = tl.load(dm + wrow * (nb * 2) + kt * 2 + 1).to(tl.float32)
        xv = tl.load(xo + kt * 256 + xcol).to(tl.float32)  # [4c, 4t, 16]
        q = ((q8[:, :, None, :] >> (2 * t)[None, None, :, None]) & 3).to(tl.float32)  # [BN, 4c, 4t, 16]
        qx = tl.sum(q * xv[None, :, :, :], axis=3)  # [BN, 4c, 4t]
        xs = tl.sum(xv, axis=2)  # [4c, 4t]
        part = (s8 & 15).to(tl.float32) * qx * d[:, None, None] - (s8 >> 4).to(tl.float32) * xs[None] * dmin[
            :, None, None
        ]
        acc += tl.sum(tl.sum(part, axis=2), axis=1)
    out = out_ptr + (pid_s.to(tl.int64) * tl.num_programs(1) + pair) * D
    tl.store(out + n, acc * rw, mask=n < D)


# ---------------------------------------------------------------------------------------------------------
# Q8_K integer path (MoeConfig.int8): the C original's routed-expert formulation (model.md §14). The input x
# and the mid activation are quantized per 256 values to TERMS int8 planes + one f32 scale (_q8k_quant_kernel,
# as ref.quantize_q8k: TERMS 1 is Q8_K, v = q1; TERMS 2 adds the residual plane, v = 254 q1 + q2); weights
# stay integers packed 4 to an int32 word and meet 4 int8 x values in one dp4a (PTX; DP4A=False: the same sum
# in plain int32 ops, which Triton's interpreter can run). TERMS 2 runs the same decoded weight words through
# a second dp4a on plane 2, accumulating onto 254 x the plane-1 sum: one extra dp4a per 4 weights plus one
# IMAD (IQ2_XXS: per group of 8; Q2_K: per word), no extra weight decoding. Exact integer sums per group (8
# IQ2_XXS / 16 Q2_K values, times the group's integer sub-scale; |.| < 2^31), scaled by d_w d_x in f32 and
# accumulated per lane; one reduction after the k loop. Same integers as ref.q8k_matvec_row (the twin, which
# sums whole blocks as integers first): the two differ by f32 rounding only.
#   IQ2_XXS: a group of 8 = grid row (magnitudes 8/25/43 as bytes: words lo, hi) + 8 sign bits (7 stored +
#            parity), looked up as a byte mask (_iq2_sign_masks) and applied to whole words (_negate_bytes),
#            so a group costs 2 table gathers (L1), 2 x (xor, and, add) and 2 dp4a.
#   Q2_K:    (word >> 2t) & 0x03030303 = 4 quants as bytes; per 16 values I += sc * sum q x, M += m * sum x.


@triton.jit
def _negate_bytes(w, m):
    """Negate the bytes of int32 word w where mask m has 0xFF (others 0x00): (w ^ m) + (m & 0x01010101) is a
    per-byte two's complement negation with no carry between bytes because every byte of w is >= 1 (grid
    magnitudes 8/25/43)."""
    return (w ^ m) + (m & 0x01010101)


@triton.jit
def _parity7(s):
    """The parity of sign indices s (int32 0..127), bit 7 of KSIGNS[s]: 0x6996 holds the parities of 0..15,
    s ^ s >> 4 folds bits 4-6 onto 0-2."""
    return (tl.full(s.shape, 0x6996, tl.int32) >> ((s ^ (s >> 4)) & 15)) & 1


@triton.jit
def _iq2_sign_bits(s):
    """Sign index s [..] int32 (7 stored bits) -> (bl, bh): int32 words with byte j = bit j of KSIGNS[s] (0 or
    1) for elements 0-3 / 4-7, computed instead of gathered: bit 7 is the parity of s (_parity7), and
    n * 0x204081 = n + n << 7 + n << 14 + n << 21 puts bit j of a nibble n at bit 8 j without carries."""
    par = _parity7(s)
    bl = ((s & 15) * 0x204081) & 0x01010101
    bh = (((s >> 4) | (par << 3)) * 0x204081) & 0x01010101
    return bl, bh


@triton.jit
def _iq2_load(qs, sg, dd, wrow, kt, nb):
    """The IQ2_XXS bytes of super-block kt of rows wrow [BN] (sg: the sub-block words as bytes): (grid indices
    [BN, 8, 4] int32 of group 4 sb + lg, sub-block words [BN, 8, 1] int32, scales [BN] f32).
    Layout (sm_90, Nsight Compute, session 14): Triton lays a tensor out by its loads' contiguity, ties broken
    by dimension order. Loaded as [BN, 8, 4] (4 contiguous bytes per group), a warp took 16 rows x 2 sub-
    blocks, 16 L1 tag requests per 128-byte load where 4 serve, and the L1 tag stage (~1 request per clock
    per SM) bounded the gate/up kernels. Here a row's 32 bytes load as one contiguous [BN, 32] run (a warp:
    4 rows x 32 bytes, 4 sectors); _signed_words_sb keeps the grid gathers in that layout."""
    return _iq2_unpack(*_iq2_raw(qs, sg, dd, wrow, kt, nb))


@triton.jit
def _iq2_raw(qs, sg, dd, wrow, kt, nb):
    """_iq2_load's loads alone, nothing computed on them: (grid index bytes [BN, 32] u8, sub-block word bytes
    [BN, 32] u8, scales [BN] f16), so that a caller can issue the next super-block's loads before it
    decodes this one (no instruction waits on them until _iq2_unpack)."""
    run = wrow[:, None] * (nb * 32) + kt * 32 + tl.arange(0, 32)[None, :]  # [BN, 32] byte offsets
    return tl.load(qs + run), tl.load(sg + run), tl.load(dd + wrow * nb + kt)


@triton.jit
def _iq2_unpack(q, s, d):
    """_iq2_raw's bytes -> _iq2_load's (idx [BN, 8, 4] int32, a1 [BN, 8, 1] int32, d [BN] f32)."""
    BN: tl.constexpr = q.shape[0]
    lg = tl.arange(0, 4)[None, None, :]
    idx = tl.reshape(q, (BN, 8, 4)).to(tl.int32)
    # the sub-block word from its 4 bytes, summed within a thread (lg is): an int32 [BN, 8, 1] load took a
    # layout of its own and shared-memory conversions (barriers) per block
    a1 = tl.sum(tl.reshape(s, (BN, 8, 4)).to(tl.int32) << (8 * lg), axis=2)[:, :, None]
    return idx, a1, d.to(tl.float32)


@triton.jit
def _x_load(xo, xplane, dx_ptr, kt, nb, xg, TERMS: tl.constexpr):
    """Quantized x of super-block kt: plane-1 words (elements 0-3, 4-7 of each group) [1, 8, 4], plane-2 words
    (TERMS 2; else plane 1 again) and the scale dx (dx_ptr: this row's scales)."""
    x8 = tl.load(xo + kt * 32 + xg)  # int64: elements 0-3 (low word), 4-7 (high word)
    xlo = x8.to(tl.int32)
    xhi = (x8 >> 32).to(tl.int32)
    if TERMS == 2:
        x8 = tl.load(xo + xplane + kt * 32 + xg)
        x2lo = x8.to(tl.int32)
        x2hi = (x8 >> 32).to(tl.int32)
    else:  # unused
        x2lo = xlo
        x2hi = xhi
    return xlo, xhi, x2lo, x2hi, tl.load(dx_ptr + kt)


@triton.jit
def _iq2_q8k_block(
    qs,
    sg,
    dd,
    tab64,
    ksm,
    wrow,
    kt,
    nb,
    xlo,
    xhi,
    x2lo,
    x2hi,
    dx,
    tab_r,
    ksm_r,
    TERMS: tl.constexpr,
    DP4A: tl.constexpr,
    SIGN_MATH: tl.constexpr,
    GATHER: tl.constexpr,
    LDS: tl.constexpr = False,
    GSUM: tl.constexpr = False,
    QP: tl.constexpr = False,
):
    """[BN, 8, 4] f32 = (d_w d_x) (2 ls + 1) sum_8 g v per group 4 sb + l of IQ2_XXS super-block kt of rows
    wrow, with the plane-1 words xlo, xhi [1, 8, 4] (elements 0-3 / 4-7 of each group), the plane-2 words
    x2lo, x2hi (TERMS 2; v = 254 q1 + q2) and scale dx of x. The caller accumulates these per lane and
    reduces once after its k loop (in-loop reductions cost barriers). GSUM: [BN, 8, 1] (see _iq2_q8k_dot).
    QP: the weights in the quad layout (sg: its words as int32 halves; qs unused), everything [BN, 4, 8]
    by (group, sub-block): _iq2_q8k_qp."""
    if QP:  # (if / else: Triton compiles the code after an early return inside a constexpr if too)
        out = _iq2_q8k_qp(sg, dd, tab64, ksm, wrow, kt, nb, xlo, xhi, x2lo, x2hi, dx, TERMS, DP4A,
                          SIGN_MATH, LDS)  # fmt: skip
    else:
        idx, a1, d = _iq2_load(qs, sg, dd, wrow, kt, nb)
        out = _iq2_q8k_dot(
            idx, a1, d, tab64, ksm, xlo, xhi, x2lo, x2hi, dx, tab_r, ksm_r, TERMS, DP4A, SIGN_MATH, GATHER,
            LDS, GSUM,
        )  # fmt: skip
    return out


@triton.jit
def _mag_bytes(a):
    """int32 a = 4 2-bit magnitude codes (bits 2j, 2j + 1: element j) -> int32 word whose byte j is element
    j's grid magnitude: the codes spread to bytes by shifted ORs (no carries), then 0 / 1 / 2 -> 8 / 25 / 43
    as 17 m + 8 + (m >> 1) per byte (at most 43: no carry between bytes)."""
    m = (a | (a << 6) | (a << 12) | (a << 18)) & 0x03030303
    return m * 17 + 0x08080808 + ((m >> 1) & 0x01010101)


@triton.jit
def _grid_words(tab, idx):
    """(lo, hi) int32 magnitude words (elements 0-3 / 4-7) of IQ2_XXS grid rows idx, from the table the
    launcher passed: 8-byte rows (int64, iq2xxs_grid_i64: one 8-byte L1 gather per group from 2 KB) or
    16-bit codes (int16, iq2xxs_codes16: a 2-byte gather from 512 B, ~4 of its 128-B lines per warp instead
    of ~14, then ~14 ALU ops; MoeConfig.grid16). The same words either way."""
    if tab.dtype.element_ty == tl.int16:
        code = tl.load(tab + idx).to(tl.int32)  # sign-extended: the masks below drop the top bits
        lo = _mag_bytes(code & 0xFF)
        hi = _mag_bytes((code >> 8) & 0xFF)
    else:
        row = tl.load(tab + idx)  # [..] int64 grid rows
        lo = row.to(tl.int32)  # bytes 0-3 (truncation)
        hi = (row >> 32).to(tl.int32)  # bytes 4-7
    return lo, hi


@triton.jit
def _prmt(a, b, sel, PTX: tl.constexpr):
    """PTX prmt.b32 (default mode) on int32 words: byte j of the result = byte (sel >> 4j) & 7 of the 8
    bytes b:a (0-3 from a). PTX False: the same in plain int32 ops (Triton's interpreter). Selector nibbles
    must be 0-7: PTX reads bit 3 as "replicate the byte's sign", which the emulation does not model and
    _prmt_words never sets (its nibbles are at most 2 | 4)."""
    if PTX:
        out = tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        out = sel * 0
        for j in tl.static_range(4):
            n = (sel >> (4 * j)) & 7
            byte = (tl.where(n < 4, a, b) >> (8 * (n & 3))) & 0xFF
            out = out | (byte << (8 * j))
    return out


@triton.jit
def _sign_nibbles(n):
    """4 sign bits n (int32 0..15) -> bit 4 j + 2 set where bit j of n is: n | n << 6 puts bits 0-1 / 2-3
    at bits 0-1 / 8-9, t | t << 3 each pair's second bit 3 up (the masks keep disjoint bits: no carries)."""
    t = (n | (n << 6)) & 0x0303
    return ((t | (t << 3)) & 0x1111) << 2


@triton.jit
def _sign_sel(si, PTX: tl.constexpr):
    """iq2_sign_nibbles[si] computed for sign indices si (int32 0..127): bit 4 j + 2 set where bit j of
    KSIGNS[si] is (bit 7: the parity of si). The 7 bits and the parity as four 2-bit fields, field k spread to
    nibble k (two shifted ORs), then one byte permute of the word whose byte f is the pattern of field value
    f (element 2k's sign at bit 2, element 2k + 1's at bit 6): byte k of the result holds nibbles 2k, 2k + 1.
    ~8 ALU ops a group instead of a shared-table lookup (the lookups bound the grouped gate/up's L1/TEX
    unit: session 27)."""
    par = _parity7(si)
    x = (si | (si << 4)) & 0x0F0F  # fields 0, 1 at bits 0-3, fields 2, 3 at bits 8-11
    x = ((x | (x << 2)) & 0x3333) | (par << 13)  # field k at bits 4k, 4k + 1; bit 7 of KSIGNS = parity
    return _prmt(tl.full(si.shape, 0x44400400, tl.int32), si * 0, x, PTX)


@triton.jit
def _spread_codes(c):
    """int32 c whose low 16 bits hold 8 2-bit codes (element j at bits 2j: iq2xxs_codes16; the sign-extended
    top bits are dropped) -> the nibble word of iq2xxs_nibbles (code j at bits 4j): elements 4-7 to bits
    16-23, then pairs to bytes, then each code to its nibble (disjoint masks: no carries)."""
    x = c & 0xFFFF
    x = (x | (x << 8)) & 0x00FF00FF
    x = (x | (x << 4)) & 0x0F0F0F0F
    return (x | (x << 2)) & 0x33333333


# Why PTX: Triton has no shared-memory array that lives across a kernel (tl.gather re-stores its table and
# puts two barriers at every call: GroupedConfig.smem), so the LDS mode declares one statically in PTX
# (ptxas places it beside Triton's dynamic shared memory) and reads it with ld.shared: a warp's 32 lookups
# cost the bank conflicts of one shared load instead of ~8 + ~4 L1 tag requests. Session 16: bit-identical
# but no faster (MoeConfig.lds / GroupedConfig.lds, off): since session 14's coalesced loads the gate/up
# loops are issue-bound, not L1-bound. Words 0-255: iq2xxs_nibbles, 256-383: iq2_sign_nibbles, rest zero
# (the array size in _lds_fill's PTX is this constant's value).
_LDS_WORDS = tl.constexpr(512)


@triton.jit
def _joined_tables(nib, snib):
    """[512] int32: the grid nibbles (nib [256]), the sign nibbles (snib [128]) from word 256, then zeros:
    the one table of _lds_fill and of the grouped kernel's joined tl.gather (GroupedConfig.smem 2)."""
    t = tl.arange(0, _LDS_WORDS)
    v = tl.load(nib + t, mask=t < 256, other=0)
    return v | tl.load(snib + (t - 256), mask=(t >= 256) & (t < 384), other=0)


@triton.jit
def _lds_fill(nib, snib, PTX: tl.constexpr, REP: tl.constexpr = 1):
    """Declare the kernel's static shared table (once: a scalar operand makes one asm statement a thread)
    and copy both tables into it, then a barrier. Call once, at the top of the kernel, before any _lds.
    PTX False (Triton's interpreter): nothing; _lds is then a global gather. REP > 1: _lds_fill_rep."""
    if PTX and REP > 1:
        _lds_fill_rep(nib, snib, REP)
    elif PTX:
        tl.inline_asm_elementwise(
            ".shared .align 16 .b32 ds4_iq2_tabs[512];\n\tmov.u32 $0, 0;", "=r,r", [tl.program_id(0)],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
        t = tl.arange(0, _LDS_WORDS)
        v = _joined_tables(nib, snib)
        tl.inline_asm_elementwise(
            "{ .reg .u32 a; mov.u32 a, ds4_iq2_tabs; mad.lo.u32 a, $1, 4, a; st.shared.b32 [a], $2;"
            " mov.u32 $0, 0; }", "=r,r,r", [t, v], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
        tl.debug_barrier()


# Replicated shared tables (GroupedConfig.lds_rep): word t of the 384 (grid nibbles, then sign nibbles)
# is held REP times, copy c at word t REP + c, and lane l reads copy l % REP, so a warp's 32 random lookups
# fall in distinct banks up to lanes l, l + 16 at REP 16 (2 wavefronts; one copy: ~3.5 on random words).
# Why by hand: Triton has no shared-memory table a kernel keeps across its loop (tl.gather re-stores it per
# call); the tables are 384 words, the static array 384 REP words (24 KB at REP 16).
@triton.jit
def _lds_fill_rep(nib, snib, REP: tl.constexpr):
    """_lds_fill for REP copies (8, 16; 32: the grid nibbles in 32 copies, the sign nibbles in 16 from word
    8192, 40 KB; 64: both in 32 copies, the sign nibbles from word 8192, 48 KB, no conflicts at all): each
    thread stores its word of every 128-word chunk once a copy."""
    if REP == 8:
        tl.inline_asm_elementwise(
            ".shared .align 16 .b32 ds4_iq2_tabs[3072];\n\tmov.u32 $0, 0;", "=r,r", [tl.program_id(0)],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    elif REP == 16:
        tl.inline_asm_elementwise(
            ".shared .align 16 .b32 ds4_iq2_tabs[6144];\n\tmov.u32 $0, 0;", "=r,r", [tl.program_id(0)],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    elif REP == 32:
        tl.inline_asm_elementwise(
            ".shared .align 16 .b32 ds4_iq2_tabs[10240];\n\tmov.u32 $0, 0;", "=r,r", [tl.program_id(0)],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.static_assert(REP == 64, "lds_rep: 8, 16 or 32 copies, or 64 (both tables in 32 copies)")
        tl.inline_asm_elementwise(
            ".shared .align 16 .b32 ds4_iq2_tabs[12288];\n\tmov.u32 $0, 0;", "=r,r", [tl.program_id(0)],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    G: tl.constexpr = 32 if REP == 64 else REP  # the grid nibbles' copies
    for j in tl.static_range(2):
        t = j * 128 + tl.arange(0, 128)
        _store_copies(t * G, t, tl.load(nib + t), G)
    s = tl.arange(0, 128)
    if REP == 32:
        _store_copies(8192 + s * 16, s, tl.load(snib + s), 16)
    elif REP == 64:
        _store_copies(8192 + s * 32, s, tl.load(snib + s), 32)
    else:
        _store_copies((256 + s) * REP, s, tl.load(snib + s), REP)
    tl.debug_barrier()


@triton.jit
def _store_copies(word0, t, v, N: tl.constexpr):
    """v into N consecutive shared words from word0, copy (t + r) % N at step r: a warp's consecutive t
    spread over the banks."""
    for r in tl.static_range(N):
        tl.inline_asm_elementwise(
            "{ .reg .u32 a; mov.u32 a, ds4_iq2_tabs; mad.lo.u32 a, $1, 4, a; st.shared.b32 [a], $2;"
            " mov.u32 $0, 0; }", "=r,r,r", [word0 + (t + r) % N, v], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def _lds_rep(i, SIGN: tl.constexpr, REP: tl.constexpr):
    """_lds from the replicated tables: word i's copy lane % copies. The lane's byte offset into the table
    is one pure asm of a constant operand, so LLVM computes it once per kernel (CSE, hoisted from the
    loop)."""
    i = i.to(tl.int32)
    zero = i * 0
    if (REP == 32 and not SIGN) or REP == 64:  # 32 copies: lane l's own bank
        off = _asm1(
            "{ .reg .u32 l; mov.u32 l, %laneid; mov.u32 $0, ds4_iq2_tabs; mad.lo.u32 $0, l, 4, $0;"
            " add.u32 $0, $0, $1; }", zero,
        )  # fmt: skip
        if SIGN:  # REP 64: the sign nibbles' 32 copies from word 8192 (the load's immediate)
            w = _asm2("{ .reg .u32 a; mad.lo.u32 a, $1, 128, $2; ld.shared.b32 $0, [a+32768]; }", i, off)
        else:
            w = _asm2("{ .reg .u32 a; mad.lo.u32 a, $1, 128, $2; ld.shared.b32 $0, [a]; }", i, off)
    elif REP == 8:
        off = _asm1(
            "{ .reg .u32 l; mov.u32 l, %laneid; and.b32 l, l, 7; mov.u32 $0, ds4_iq2_tabs;"
            " mad.lo.u32 $0, l, 4, $0; add.u32 $0, $0, $1; }", zero,
        )  # fmt: skip
        if SIGN:
            w = _asm2("{ .reg .u32 a; mad.lo.u32 a, $1, 32, $2; ld.shared.b32 $0, [a+8192]; }", i, off)
        else:
            w = _asm2("{ .reg .u32 a; mad.lo.u32 a, $1, 32, $2; ld.shared.b32 $0, [a]; }", i, off)
    else:  # 16 copies (REP 16, or REP 32's sign nibbles)
        off = _asm1(
            "{ .reg .u32 l; mov.u32 l, %laneid; and.b32 l, l, 15; mov.u32 $0, ds4_iq2_tabs;"
            " mad.lo.u32 $0, l, 4, $0; add.u32 $0, $0, $1; }", zero,
        )  # fmt: skip
        if SIGN and REP == 32:  # the sign nibbles from word 8192: the load's immediate
            w = _asm2("{ .reg .u32 a; mad.lo.u32 a, $1, 64, $2; ld.shared.b32 $0, [a+32768]; }", i, off)
        elif SIGN:  # from word 256 REP
            w = _asm2("{ .reg .u32 a; mad.lo.u32 a, $1, 64, $2; ld.shared.b32 $0, [a+16384]; }", i, off)
        else:
            w = _asm2("{ .reg .u32 a; mad.lo.u32 a, $1, 64, $2; ld.shared.b32 $0, [a]; }", i, off)
    return w


@triton.jit
def _asm1(asm: tl.constexpr, a):
    """Pure int32 inline asm of one int32 operand ($1) -> $0."""
    return tl.inline_asm_elementwise(asm, "=r,r", [a], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _asm2(asm: tl.constexpr, a, b):
    """Pure int32 inline asm of two int32 operands ($1, $2) -> $0."""
    return tl.inline_asm_elementwise(asm, "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _lds(nib, snib, i, SIGN: tl.constexpr, PTX: tl.constexpr, REP: tl.constexpr = 1):
    """Word i of the grid nibbles (SIGN False) or of the sign nibbles (SIGN True): ld.shared from the table
    _lds_fill put in shared memory (REP copies: _lds_rep); PTX False: a global gather from nib / snib."""
    if PTX and REP > 1:
        w = _lds_rep(i, SIGN, REP)
    elif PTX and SIGN:  # the sign nibbles' offset (word 256) as the load's immediate: no add per lookup
        w = tl.inline_asm_elementwise(
            "{ .reg .u32 a; mov.u32 a, ds4_iq2_tabs; mad.lo.u32 a, $1, 4, a; ld.shared.b32 $0, [a+1024]; }",
            "=r,r", [i.to(tl.int32)], dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    elif PTX:
        w = tl.inline_asm_elementwise(
            "{ .reg .u32 a; mov.u32 a, ds4_iq2_tabs; mad.lo.u32 a, $1, 4, a; ld.shared.b32 $0, [a]; }",
            "=r,r", [i.to(tl.int32)], dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        w = tl.load(snib + i) if SIGN else tl.load(nib + i)
    return w


@triton.jit
def _prmt_words(
    nib, snib, idx, si, SIGN_MATH: tl.constexpr, PTX: tl.constexpr, POS_REG: tl.constexpr,
    LDS: tl.constexpr = False,
):  # fmt: skip
    """(wlo, whi) signed grid bytes of IQ2_XXS groups (grid rows idx, sign indices si) by two byte
    permutes: nibble j of nib[idx] (iq2xxs_nibbles) is element j's magnitude code m (0 / 1 / 2), snib[si]
    (iq2_sign_nibbles) sets its bit 2 where KSIGNS[si] negates element j, so each selector nibble picks one
    of the bytes 8, 25, 43 (word a) or -8, -25, -43 (word b). Per group: two 4-byte gathers (1 KB and
    512 B tables), an OR, a shift, two PRMT, instead of an 8-byte gather, the sign math and the negation.
    SIGN_MATH: the sign nibbles computed from si (~16 ALU ops: bit 7 of KSIGNS[s] is the parity of s, as in
    _iq2_sign_bits) instead of the second gather. POS_REG: the positive bytes' word loaded (see below).
    nib as int16 (iq2xxs_codes16, MoeConfig.prmt with grid16): half the table's 128-byte lines per gather
    (the gathers bound the L1 tag stage: session 14), the nibbles spread by _spread_codes. H200 (session
    14): B = 1 gate/up 26.8 vs 26.5 us, whole model 112.07 vs 111.72 tok/s, grouped B = 32 525.5 vs 521.7
    us: no gain, off (env DS4_MOE_GRID16=1 with prmt on, DS4_MOE_GROUPED_GRID16=1). LDS: both tables read
    from the kernel's static shared copy (_lds, after the kernel's _lds_fill; LDS > 1: that many copies)."""
    if nib.dtype.element_ty == tl.int16:  # MoeConfig.prmt + grid16: 512 B of codes, spread (6 ALU ops)
        w = _spread_codes(tl.load(nib + idx).to(tl.int32))
    elif LDS:  # both tables from the kernel's static shared copy (_lds_fill)
        w = _lds(nib, snib, idx, False, PTX, LDS)
    else:
        w = tl.load(nib + idx)
    # bytes 8, 25, 43, 0. As a constant, ptxas copies it from a uniform register before every PRMT (whose
    # first source must be a vector register; sm_90: 16 instructions per k step of the grouped gate/up);
    # loaded (POS_REG: iq2xxs_nibbles' last word, the load hoisted out of the loop) it stays in a register,
    # which costs the grouped kernel registers (64 -> 96 at 4 pairs)
    if POS_REG:  # the nibble table's word 256 (the launcher refuses POS_REG with the 16-bit codes)
        a = tl.zeros_like(w) + tl.load(nib + 256)
    else:
        a = tl.full(w.shape, _PRMT_POS, tl.int32)
    if SIGN_MATH == 2:  # GroupedConfig.sign_prmt: the sign nibbles by one byte permute (_sign_sel)
        lo = w | _sign_sel(si, PTX)
        hi = lo >> 16
    elif SIGN_MATH:
        par = _parity7(si)
        lo = w | _sign_nibbles(si & 15)
        hi = (w >> 16) | _sign_nibbles(((si >> 4) & 7) | (par << 3))
    else:
        lo = w | (_lds(nib, snib, si, True, PTX, LDS) if LDS else tl.load(snib + si))
        hi = lo >> 16
    b = tl.full(lo.shape, _PRMT_NEG, tl.int32)  # bytes -8, -25, -43, 0: PRMT's immediate operand
    return _prmt(a, b, lo, PTX), _prmt(a, b, hi, PTX)


@triton.jit
def _negate_by_bits(lo, hi, si):
    """Magnitude words lo, hi negated bytewise where sign index si's pattern says, the byte masks computed
    in ALU ops (_iq2_sign_bits, ~12 per group: MoeConfig.sign_math) instead of gathered."""
    bl, bh = _iq2_sign_bits(si)
    return (lo ^ (bl * 255)) + bl, (hi ^ (bh * 255)) + bh  # = _negate_bytes(w, b * 255)


@triton.jit
def _signed_words(
    tab, ksm, idx, si, SIGN_MATH: tl.constexpr, PTX: tl.constexpr, POS_REG: tl.constexpr = False,
    LDS: tl.constexpr = False,
):  # fmt: skip
    """(wlo, whi) int32 signed grid bytes (elements 0-3 / 4-7) of IQ2_XXS groups with grid rows idx and sign
    indices si, from the launcher's tables (iq2_tables, whose dtypes pick the decode): nibbles and byte
    permutes (_prmt_words, PTX: as PTX; its sign nibbles computed with SIGN_MATH, else gathered from ksm),
    or magnitude words (_grid_words) negated by sign masks computed (SIGN_MATH) or gathered from ksm. The
    decode of the pair kernels and of the grouped ones."""
    if ksm.dtype.element_ty == tl.int32:  # MoeConfig.prmt: sign nibbles (grid nibbles or 16-bit codes)
        wlo, whi = _prmt_words(tab, ksm, idx, si, SIGN_MATH, PTX, POS_REG, LDS)
    else:
        lo, hi = _grid_words(tab, idx)
        if SIGN_MATH:
            wlo, whi = _negate_by_bits(lo, hi, si)
        else:
            m = tl.load(ksm + si)  # int64 byte masks of KSIGNS[sign index]
            wlo = _negate_bytes(lo, m.to(tl.int32))
            whi = _negate_bytes(hi, (m >> 32).to(tl.int32))
    return wlo, whi


@triton.jit
def _signed_words_sb(
    tab, ksm, idx, si, SIGN_MATH: tl.constexpr, PTX: tl.constexpr, POS_REG: tl.constexpr = False,
    LDS: tl.constexpr = False,
):  # fmt: skip
    """_signed_words of [BN, 8, 4] grid rows idx / sign indices si, gathered as [8, BN, 4] (sub-block first):
    a gather has no contiguity, so Triton lays it out by dimension order, and in this order its default
    layout is the one _iq2_load's contiguous runs take (see there): no conversion through shared memory."""
    wlo, whi = _signed_words(
        tab, ksm, tl.permute(idx, (1, 0, 2)), tl.permute(si, (1, 0, 2)), SIGN_MATH, PTX, POS_REG, LDS
    )
    return tl.permute(wlo, (1, 0, 2)), tl.permute(whi, (1, 0, 2))


@triton.jit
def _iq2_q8k_dot(
    idx,
    a1,
    d,
    tab64,
    ksm,
    xlo,
    xhi,
    x2lo,
    x2hi,
    dx,
    tab_r,
    ksm_r,
    TERMS: tl.constexpr,
    DP4A: tl.constexpr,
    SIGN_MATH: tl.constexpr,
    GATHER: tl.constexpr,
    LDS: tl.constexpr = False,
    GSUM: tl.constexpr = False,
):
    """_iq2_q8k_block on loaded weight bytes (_iq2_load: idx [BN, 8, 4], a1 [BN, 8, 1], d [BN]). GSUM
    (MoeConfig.gsum): [BN, 8, 1], each sub-block's 4 group sums added as integers before the one scaling."""
    lg = tl.arange(0, 4)[None, None, :]
    si = (a1 >> (7 * lg)) & 127  # [BN, 8, 4] sign indices
    if GATHER:  # the tables held in registers (tab_r [256], ksm_r [128]): tl.gather via shared memory
        row = tl.reshape(tl.gather(tab_r, tl.reshape(idx.to(tl.int32), (idx.numel,)), 0), idx.shape)
        lo = row.to(tl.int32)  # bytes 0-3 (truncation)
        hi = (row >> 32).to(tl.int32)  # bytes 4-7
        if SIGN_MATH:
            wlo, whi = _negate_by_bits(lo, hi, si)
        else:
            m = tl.reshape(tl.gather(ksm_r, tl.reshape(si, (si.numel,)), 0), si.shape)
            wlo = _negate_bytes(lo, m.to(tl.int32))
            whi = _negate_bytes(hi, (m >> 32).to(tl.int32))
    else:  # one L1 gather per group (two with gathered masks); signed grid bytes shared by both planes
        wlo, whi = _signed_words_sb(tab64, ksm, idx, si, SIGN_MATH, DP4A, False, LDS)
    dot = _dot4(whi, xhi, _dot4(wlo, xlo, 0, DP4A), DP4A)
    if TERMS == 2:
        dot = _dot4(whi, x2hi, _dot4(wlo, x2lo, dot * 254, DP4A), DP4A)
    # |dot (2 ls + 1)| <= 8 * 43 * 127 * 31 < 2^24 (TERMS 1: exact as f32), x 255 < 2^31 (TERMS 2)
    if GSUM:  # lg lies within a thread: 3 integer adds save 3 multiplies, I2Fs and FMAs; x 4 < 2^31 still
        dot = tl.sum(dot, axis=2, keep_dims=True)
    scaled = dot * (2 * ((a1 >> 28) & 15) + 1)
    return (d * dx)[:, None, None] * scaled.to(tl.float32)


@triton.jit
def _iq2_q8k_qp(
    q32, dd, tab64, ksm, wrow, kt, nb, xlo, xhi, x2lo, x2hi, dx, TERMS: tl.constexpr, DP4A: tl.constexpr,
    SIGN_MATH: tl.constexpr, LDS: tl.constexpr,
):  # fmt: skip
    """_iq2_q8k_block's sums from the quad layout (packing.quad_pack; q32: its words as int32 halves, 16 a
    block), [BN, 4, 8] by (group t, sub-block s): pair t's grid word holds sub-block s's grid index in byte
    s, its sign word sub-block s's sign index at bit 7 (s % 4) of half s // 4, and pair s // 2's sign word
    sub-block s's scale in the top nibble of half s % 2. x words alike ([1, 4, 8]: the launcher's xg).
    Every field is loaded as a [BN, 4, 8] int32 gather (repeats hit L1) with addresses whose contiguity
    Triton cannot see (the scales' tl.where): so all take the one layout and none is converted through
    shared memory. sm_90 (bench_moe.py --compile-only): 64 registers, 315 instructions a loop step, no
    barrier; a contiguous byte load of the grid indices or a [BN, 1, 8] scale row cost 4-8 barriers."""
    t = tl.arange(0, 4)[None, :, None]
    s = tl.arange(0, 8)[None, None, :]
    base = (wrow * (nb * 16) + kt * 16)[:, None, None]
    idx = (tl.load(q32 + base + 4 * t + s // 4) >> (8 * (s % 4))) & 255
    si = (tl.load(q32 + base + 4 * t + 2 + s // 4) >> (7 * (s % 4))) & 127
    ls = (tl.load(q32 + base + 4 * (s // 2) + tl.where(s % 2 == 1, 3, 2) + 0 * t) >> 28) & 15
    wlo, whi = _signed_words(tab64, ksm, idx, si, SIGN_MATH, DP4A, False, LDS)
    dot = _dot4(whi, xhi, _dot4(wlo, xlo, 0, DP4A), DP4A)
    if TERMS == 2:
        dot = _dot4(whi, x2hi, _dot4(wlo, x2lo, dot * 254, DP4A), DP4A)
    d = tl.load(dd + wrow * nb + kt).to(tl.float32)
    return (d * dx)[:, None, None] * (dot * (2 * ls + 1)).to(tl.float32)


@triton.jit
def _iq2_gate_up_step(
    acc_g, acc_u, gq, gs, gd, uq, us, ud, tab64, ksm, wrow, kt, nb, xo, xplane, xd, xg, tab_r, ksm_r,
    TERMS: tl.constexpr, DP4A: tl.constexpr, SIGN_MATH: tl.constexpr, GATHER: tl.constexpr, LDS: tl.constexpr,
    GSUM: tl.constexpr = False, QP: tl.constexpr = False,
):  # fmt: skip
    """One super-block step of _iq2_q8k_gate_up_kernel without PREFETCH: x's block kt, then gate's, then
    up's (the session-3 op order) -> the updated (acc_g, acc_u)."""
    xlo, xhi, x2lo, x2hi, dx = _x_load(xo, xplane, xd, kt, nb, xg, TERMS)
    acc_g += _iq2_q8k_block(
        gq, gs, gd, tab64, ksm, wrow, kt, nb, xlo, xhi, x2lo, x2hi, dx, tab_r, ksm_r, TERMS, DP4A,
        SIGN_MATH, GATHER, LDS, GSUM, QP,
    )  # fmt: skip
    acc_u += _iq2_q8k_block(
        uq, us, ud, tab64, ksm, wrow, kt, nb, xlo, xhi, x2lo, x2hi, dx, tab_r, ksm_r, TERMS, DP4A,
        SIGN_MATH, GATHER, LDS, GSUM, QP,
    )  # fmt: skip
    return acc_g, acc_u


@triton.jit
def _iq2_q8k_gate_up_kernel(
    xw_ptr,
    dx_ptr,
    gq,
    gs,
    gd,
    uq,
    us,
    ud,
    tab64,
    ksm,
    ids_ptr,
    out_ptr,
    n_slots,
    F,
    K,
    xplane,
    clamp,
    kt_per_split,
    BN: tl.constexpr,
    CLAMP: tl.constexpr,
    SPLIT: tl.constexpr,
    TERMS: tl.constexpr,
    DP4A: tl.constexpr,
    SIGN_MATH: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    GATHER: tl.constexpr = False,
    LDS: tl.constexpr = False,
    STAGES: tl.constexpr = 0,
    GSUM: tl.constexpr = False,
    QP: tl.constexpr = False,
):
    """Gate and up of one (row, slot) pair on the quantized input (xw [TERMS, B, K/8] int64: one group's 8
    int8 x per load, planes xplane = B K / 8 words apart; dx [B, K/256]); outputs as _gate_up_kernel.
    PREFETCH: software pipelining, block kt + 1's loads issued before block kt's math (whose layout
    conversions put barriers that the loads would otherwise wait behind); SIGN_MATH: sign masks computed,
    not gathered (_iq2_sign_bits); GATHER: table lookups by tl.gather from register copies (shared memory on
    the GPU) instead of global (L1) gathers; LDS: the nibble tables from a static shared copy (_lds_fill).
    QP: the stacks in the quad layout (gs / us their words as int32 halves, gq / uq unused; not with
    PREFETCH, GATHER or GSUM), the per-lane sums [BN, 4, 8] by (group, sub-block)."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    if LDS:
        _lds_fill(tab64, ksm, DP4A)
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    pid_s = tl.program_id(2)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    wrow = e * F + tl.minimum(n, F - 1)
    nb = K // 256
    b = (pair // n_slots).to(tl.int64)
    xo = xw_ptr + b * (K // 8)
    if QP:  # [1, 4, 8]: x word 4 s + t of group t of sub-block s
        xg = tl.arange(0, 4)[None, :, None] + tl.arange(0, 8)[None, None, :] * 4
    else:  # [1, 8, 4] group's 8 x bytes
        xg = tl.arange(0, 8)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    lo = pid_s * kt_per_split
    hi = tl.minimum(lo + kt_per_split, nb)
    G4: tl.constexpr = 1 if GSUM else 4  # per-lane partial sums [BN, 8, G4], reduced after the loop
    A1: tl.constexpr = 4 if QP else 8  # (QP: [BN, 4, 8])
    A2: tl.constexpr = 8 if QP else G4
    acc_g = tl.zeros([BN, A1, A2], dtype=tl.float32)
    tab_r = tl.load(tab64 + tl.arange(0, 256)) if GATHER else 0
    ksm_r = tl.load(ksm + tl.arange(0, 128)) if GATHER else 0
    acc_u = tl.zeros([BN, A1, A2], dtype=tl.float32)
    xd = dx_ptr + b * nb
    if PREFETCH:  # block lo's bytes now; each step loads block kt + 1 before it computes block kt
        kn = tl.minimum(lo, nb - 1)
        gi_n, ga_n, gd_n = _iq2_load(gq, gs, gd, wrow, kn, nb)
        ui_n, ua_n, ud_n = _iq2_load(uq, us, ud, wrow, kn, nb)
        xlo_n, xhi_n, x2lo_n, x2hi_n, dx_n = _x_load(xo, xplane, xd, kn, nb, xg, TERMS)
        for kt in range(lo, hi):
            gi, ga, gdd, ui, ua, udd = gi_n, ga_n, gd_n, ui_n, ua_n, ud_n
            xlo, xhi, x2lo, x2hi, dx = xlo_n, xhi_n, x2lo_n, x2hi_n, dx_n
            kn = tl.minimum(kt + 1, hi - 1)  # the last step reloads its own block (unused)
            gi_n, ga_n, gd_n = _iq2_load(gq, gs, gd, wrow, kn, nb)
            ui_n, ua_n, ud_n = _iq2_load(uq, us, ud, wrow, kn, nb)
            xlo_n, xhi_n, x2lo_n, x2hi_n, dx_n = _x_load(xo, xplane, xd, kn, nb, xg, TERMS)
            acc_g += _iq2_q8k_dot(
                gi, ga, gdd, tab64, ksm, xlo, xhi, x2lo, x2hi, dx, tab_r, ksm_r, TERMS, DP4A, SIGN_MATH,
                GATHER, LDS, GSUM,
            )  # fmt: skip
            acc_u += _iq2_q8k_dot(
                ui, ua, udd, tab64, ksm, xlo, xhi, x2lo, x2hi, dx, tab_r, ksm_r, TERMS, DP4A, SIGN_MATH,
                GATHER, LDS, GSUM,
            )  # fmt: skip
    elif STAGES:  # the loop's loads software-pipelined by Triton, STAGES - 1 blocks ahead (MoeConfig.stages)
        for kt in tl.range(lo, hi, num_stages=STAGES):
            acc_g, acc_u = _iq2_gate_up_step(
                acc_g, acc_u, gq, gs, gd, uq, us, ud, tab64, ksm, wrow, kt, nb, xo, xplane, xd, xg, tab_r,
                ksm_r, TERMS, DP4A, SIGN_MATH, GATHER, LDS, GSUM, QP,
            )  # fmt: skip
    else:  # the session-3 op order (the default's SASS unchanged): x, then gate's block, then up's
        for kt in range(lo, hi):
            acc_g, acc_u = _iq2_gate_up_step(
                acc_g, acc_u, gq, gs, gd, uq, us, ud, tab64, ksm, wrow, kt, nb, xo, xplane, xd, xg, tab_r,
                ksm_r, TERMS, DP4A, SIGN_MATH, GATHER, LDS, GSUM, QP,
            )  # fmt: skip
    GA: tl.constexpr = 1 if QP else 2  # the groups' axis first, as the split layout sums (same bits)
    acc_g = tl.sum(tl.sum(acc_g, axis=GA), axis=1) * 0.125
    acc_u = tl.sum(tl.sum(acc_u, axis=GA), axis=1) * 0.125
    _store_gate_up(out_ptr, acc_g, acc_u, pair, pid_s, n, F, clamp, CLAMP, SPLIT)


@triton.jit
def _split4(v):
    """[..., 4] -> 4 tensors [...]: the last dim's entries in the order 0, 2, 1, 3 (any fixed order serves:
    weights and activations are split alike). Free in registers when the last dim is within a thread."""
    even, odd = tl.split(tl.reshape(v, v.shape[:-1] + (2, 2)))
    a, b = tl.split(even)
    c, d = tl.split(odd)
    return a, b, c, d


@triton.jit
def _pick(t: tl.constexpr, a, b, c, d):
    """The t-th of a, b, c, d (t a compile-time constant)."""
    if t == 0:
        return a
    elif t == 1:
        return b
    elif t == 2:
        return c
    else:
        return d


@triton.jit
def _dot16x(q0, q1, q2, q3, x0, x1, x2, x3, DP4A: tl.constexpr):
    """The 4 quant words q0..q3 [BN, 4c] dotted with the 4 x words x0..x3 [1, 4c], one dp4a chain: [BN, 4c]
    int32 sums of 16 q v."""
    return _dot4(q3, x3, _dot4(q2, x2, _dot4(q1, x1, _dot4(q0, x0, 0, DP4A), DP4A), DP4A), DP4A)


@triton.jit
def _dot16(q0, q1, q2, q3, xo, DP4A: tl.constexpr):
    """_dot16x with the x words at xo [1, 4c, 4jj] (split as the quant words)."""
    x0, x1, x2, x3 = _split4(tl.load(xo))
    return _dot16x(q0, q1, q2, q3, x0, x1, x2, x3, DP4A)


@triton.jit
def _q2k_shift_sums(q0, q1, q2, q3, xt, ones, DP4A: tl.constexpr):
    """(sum_16 q v [BN, 4c], sum_16 v [1, 4c]) of one shift, the x words at xt loaded once for both."""
    x0, x1, x2, x3 = _split4(tl.load(xt))
    qv = _dot16x(q0, q1, q2, q3, x0, x1, x2, x3, DP4A)
    return qv, _dot16x(ones, ones, ones, ones, x0, x1, x2, x3, DP4A)


@triton.jit
def _q2k_block(qw, sc, wrow, kt, nb, BN: tl.constexpr):
    """Q2_K super-block kt of rows wrow [BN] in one layout: quant words w0..w3 [BN, 4c] (jj split as
    _split4) and scale bytes s0..s3 [BN, 4c] int32 of shifts t = 0..3 (index layout: _q2k_q8k_down_kernel).
    The scale bytes are read as their group half's 8 contiguous bytes and picked by c's parity: a
    [BN, 4c, 4t] load of the stride-2 bytes took a layout of its own, and the sums using them a
    shared-memory conversion per shift (barriers in every k step on sm_90).
    Layout (sm_90, Nsight Compute, session 14): Triton lays a tensor out by its loads' contiguity, ties
    broken by dimension order, so [BN, 4c, 4jj] word loads put 32 rows in a warp, one 16-byte quarter of a
    row per lane: 32 L1 tag requests per load where 16 serve. The words load as [BN, 16] runs (a warp: 8
    rows x 64 bytes) and the scale bytes as [4c, BN, 8] (c first), both the same lanes-to-(row, c) map."""
    c = tl.arange(0, 4)
    qrun = wrow[:, None] * (nb * 16) + kt * 16 + tl.arange(0, 16)[None, :]  # [BN, 16] quant words 4c + jj
    w0, w1, w2, w3 = _split4(tl.reshape(tl.load(qw + qrun), (BN, 4, 4)))
    hoff = ((c // 2) * 8)[:, None, None] + tl.arange(0, 8)[None, None, :]  # [4c, 1, 8] c's half's bytes
    sc8 = tl.permute(tl.load(sc + wrow[None, :, None] * (nb * 16) + kt * 16 + hoff), (1, 0, 2))  # [BN, 4c, 8]
    ev, od = tl.split(tl.reshape(sc8, (BN, 4, 4, 2)))  # [BN, 4c, 4t]: bytes 2t / 2t + 1 of c's half
    s0, s2, s1, s3 = _split4(tl.where((c % 2 == 1)[None, :, None], od, ev).to(tl.int32))
    return w0, w1, w2, w3, s0, s1, s2, s3


@triton.jit
def _q2k_scales(dm, wrow, kt, nb):
    """(d, dmin) [BN, 4c] f32 of Q2_K super-block kt of rows wrow, the same for every c, in _q2k_block's
    layout: loaded as [4c, BN, 2] (see _q2k_block), where [BN] loads took a layout of their own and a
    shared-memory conversion per k step at BN 128."""
    c = tl.arange(0, 4)[:, None, None]
    off = wrow[None, :, None] * (nb * 2) + kt * 2 + tl.arange(0, 2)[None, None, :] + c * 0  # [4c, BN, 2]
    d, dmin = tl.split(tl.permute(tl.load(dm + off), (1, 0, 2)).to(tl.float32))
    return d, dmin


@triton.jit
def _q2k_block_sums(
    xo, xplane, qw, sc, wrow, kt, nb, BN: tl.constexpr, TERMS: tl.constexpr, DP4A: tl.constexpr
):
    """(I, M) [BN, 4c] int32 of Q2_K super-block kt for one quantized x row (words at xo, planes xplane
    apart): I = sum_t sc sum_16 q v and M = sum_t m sum_16 v per 16-byte group c (index layout:
    _q2k_q8k_down_kernel), shift by shift in _q2k_block's layout: no layout conversions, so no barriers in
    the k loop. |I| <= 4 * 15 * 16 * 3 * 32385 < 2^31."""
    c = tl.arange(0, 4)
    xoff = tl.multiple_of((c // 2) * 32 + (c % 2) * 4, 4)[None, :, None] + tl.arange(0, 4)[None, None, :]
    w0, w1, w2, w3, s0, s1, s2, s3 = _q2k_block(qw, sc, wrow, kt, nb, BN)  # [BN, 4c] each
    ones = tl.full([1, 4], 0x01010101, tl.int32)
    ii = tl.zeros([BN, 4], dtype=tl.int32)
    mm = tl.zeros([BN, 4], dtype=tl.int32)
    for t in tl.static_range(4):
        q0 = (w0 >> (2 * t)) & 0x03030303
        q1 = (w1 >> (2 * t)) & 0x03030303
        q2 = (w2 >> (2 * t)) & 0x03030303
        q3 = (w3 >> (2 * t)) & 0x03030303
        xt = xo + kt * 64 + 8 * t + xoff
        v, xs = _q2k_shift_sums(q0, q1, q2, q3, xt, ones, DP4A)
        if TERMS == 2:  # the same quant words on the residual plane: v = 254 q1 + q2
            v2, xs2 = _q2k_shift_sums(q0, q1, q2, q3, xt + xplane, ones, DP4A)
            v = v * 254 + v2
            xs = xs * 254 + xs2
        s8 = _pick(t, s0, s1, s2, s3)
        ii += (s8 & 15) * v
        mm += (s8 >> 4) * xs
    return ii, mm


@triton.jit
def _q2k_load(xo, xplane, xd, qw, sc, dm, wrow, kt, nb, TERMS: tl.constexpr):
    """Super-block kt of the down kernel: x words of plane 1 and 2 [4c, 4t, 4jj] (plane 1 twice for TERMS 1),
    the x scale, quant words [BN, 4c, 4jj], scale bytes [BN, 4c, 4t] int32, d and dmin [BN] f32 (index
    layout: _q2k_q8k_down_kernel)."""
    c = tl.arange(0, 4)
    t = tl.arange(0, 4)
    jj = tl.arange(0, 4)
    xcol = (
        (c // 2)[:, None, None] * 32 + t[None, :, None] * 8 + (c % 2)[:, None, None] * 4 + jj[None, None, :]
    )
    sidx = (c // 2)[:, None] * 8 + 2 * t[None, :] + (c % 2)[:, None]  # [4c, 4t]
    qidx = c[:, None] * 4 + jj[None, :]  # [4c, 4jj]
    xw = tl.load(xo + kt * 64 + xcol)  # [4c, 4t, 4jj] int32: 4 int8 x each
    if TERMS == 2:
        xw2 = tl.load(xo + xplane + kt * 64 + xcol)
    else:  # unused
        xw2 = xw
    w = tl.load(qw + wrow[:, None, None] * (nb * 16) + kt * 16 + qidx[None, :, :])
    s8 = tl.load(sc + wrow[:, None, None] * (nb * 16) + kt * 16 + sidx[None, :, :]).to(tl.int32)
    d = tl.load(dm + wrow * (nb * 2) + kt * 2).to(tl.float32)
    dmin = tl.load(dm + wrow * (nb * 2) + kt * 2 + 1).to(tl.float32)
    return xw, xw2, tl.load(xd + kt), w, s8, d, dmin


@triton.jit
def _q2k_down_step(
    acc, xo, xplane, xd, qw, sc, dm, wrow, kt, nb, BN: tl.constexpr, TERMS: tl.constexpr, DP4A: tl.constexpr
):
    """acc [BN, 4] + super-block kt of _q2k_q8k_down_kernel without PREFETCH (integer sums, scaled once)."""
    ii, mm = _q2k_block_sums(xo, xplane, qw, sc, wrow, kt, nb, BN, TERMS, DP4A)
    dx = tl.load(xd + kt)
    d, dmin = _q2k_scales(dm, wrow, kt, nb)
    return acc + ((d * dx) * ii.to(tl.float32) - (dmin * dx) * mm.to(tl.float32))


@triton.jit
def _q2k_q8k_down_kernel(
    xw_ptr,
    dx_ptr,
    qw,
    sc,
    dm,
    ids_ptr,
    rw_ptr,
    out_ptr,
    D,
    F,
    E,
    xplane,
    kt_per_split,
    BN: tl.constexpr,
    TERMS: tl.constexpr,
    DP4A: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    FIXUP: tl.constexpr = False,
    sum_ptr=None,
    cnt_ptr=None,
    n_slots=1,
    order_ptr=None,
    ORDER: tl.constexpr = False,
    STAGES: tl.constexpr = 0,
):
    """Q2_K down projection of one pair on its quantized mid row (xw [TERMS, pairs, F/4] int32 words, planes
    xplane = pairs F / 4 words apart; dx [pairs, F/256]); output as _down_kernel. Quant word 4c + jj (c =
    16-byte group: half c // 2, byte group c % 2) shifted by 2t holds elements 128 (c // 2) + 32 t
    + 16 (c % 2) + 4 jj + 0..3, scale byte 8 (c // 2) + 2 t + c % 2. PREFETCH: as the gate/up kernel.
    FIXUP: partials go to out [S, k, B, D] instead, and the last of the S k programs of each (row, tile)
    (counters cnt_ptr [B, D tiles]) writes their sum, in (split, slot) order, to sum_ptr [B, D]. A pair
    whose expert id lies outside [0, E) (another rank's, under expert parallelism) reads nothing and
    contributes zeros. ORDER: program p computes pair order_ptr[p] (pairs sorted by expert: those sharing an
    expert run back to back, the second reading its weights from L2)."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    pid_n = tl.program_id(0)
    pair = tl.load(order_ptr + tl.program_id(1)) if ORDER else tl.program_id(1)
    pid_s = tl.program_id(2)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    live = (e >= 0) & (e < E)
    e = tl.minimum(tl.maximum(e, 0), E - 1)
    rw = tl.load(rw_ptr + pair).to(tl.float32)
    n = pid_n * BN + tl.arange(0, BN)
    wrow = e * D + tl.minimum(n, D - 1)
    nb = F // 256
    xo = xw_ptr + pair.to(tl.int64) * (F // 4)
    lo = pid_s * kt_per_split
    hi = tl.where(live, tl.minimum(lo + kt_per_split, nb), lo)
    xd = dx_ptr + pair.to(tl.int64) * nb
    if PREFETCH:  # block lo's bytes now; each step loads block kt + 1 before it computes block kt
        t = tl.arange(0, 4)
        ones = tl.full([4, 4, 4], 0x01010101, tl.int32)
        acc = tl.zeros([BN, 4, 4], dtype=tl.float32)  # per (row, group of 16) partial sums
        kn = tl.minimum(lo, nb - 1)
        xw_n, xw2_n, dx_n, w_n, s8_n, d_n, m_n = _q2k_load(xo, xplane, xd, qw, sc, dm, wrow, kn, nb, TERMS)
        for kt in range(lo, hi):
            xw, xw2, dx, w, s8, d, dmin = xw_n, xw2_n, dx_n, w_n, s8_n, d_n, m_n
            kn = tl.minimum(kt + 1, hi - 1)  # the last step reloads its own block (unused)
            xw_n, xw2_n, dx_n, w_n, s8_n, d_n, m_n = _q2k_load(
                xo, xplane, xd, qw, sc, dm, wrow, kn, nb, TERMS
            )
            q = (w[:, :, None, :] >> (2 * t)[None, None, :, None]) & 0x03030303  # [BN, 4c, 4t, 4jj]
            qv = _dot4(q, xw[None, :, :, :], 0, DP4A)  # [BN, 4c, 4t, 4jj] sums of 4 q x
            xv = _dot4(ones, xw, 0, DP4A)  # [4c, 4t, 4jj] sums of 4 x
            if TERMS == 2:  # the same quant words on the residual plane: v = 254 q1 + q2
                qv = _dot4(q, xw2[None, :, :, :], qv * 254, DP4A)
                xv = _dot4(ones, xw2, xv * 254, DP4A)
            qx = tl.sum(qv, axis=3)  # [BN, 4c, 4t] sum of 16 q v
            xs = tl.sum(xv, axis=2)  # [4c, 4t] sum of 16 v
            sv = ((s8 & 15) * qx).to(tl.float32)
            mv = ((s8 >> 4) * xs[None, :, :]).to(tl.float32)
            acc += (d[:, None, None] * dx) * sv - (dmin[:, None, None] * dx) * mv
    else:  # one [BN, 4c] pair of integer sums per super-block (_q2k_block_sums), scaled once
        acc = tl.zeros([BN, 4], dtype=tl.float32)  # per (row, 16-byte group) partial sums
        if STAGES:  # the loop's loads software-pipelined by Triton (MoeConfig.stages)
            for kt in tl.range(lo, hi, num_stages=STAGES):
                acc = _q2k_down_step(acc, xo, xplane, xd, qw, sc, dm, wrow, kt, nb, BN, TERMS, DP4A)
        else:
            for kt in range(lo, hi):
                acc = _q2k_down_step(acc, xo, xplane, xd, qw, sc, dm, wrow, kt, nb, BN, TERMS, DP4A)
        acc = acc[:, :, None]  # [BN, 4, 1]: reduced below as the prefetch path's [BN, 4, 4]
    acc = tl.sum(tl.sum(acc, axis=2), axis=1)
    if FIXUP:  # the k slots and S splits of row b are the "splits" of _split_fixup: [S k, B, D] partials
        B = tl.num_programs(1) // n_slots
        b = pair // n_slots
        slot = pid_s * n_slots + pair % n_slots
        off = b.to(tl.int64) * D + n[None, :]  # [1, BN]
        tl.store(out_ptr + slot.to(tl.int64) * B * D + off, (acc * rw)[None, :], mask=(n < D)[None, :])
        cnt = cnt_ptr + b * tl.num_programs(0) + pid_n
        _split_fixup(out_ptr, sum_ptr, cnt, off, (n < D)[None, :], B, D, tl.num_programs(2) * n_slots, 1, BN)
    else:
        out = out_ptr + (pid_s.to(tl.int64) * tl.num_programs(1) + pair) * D
        tl.store(out + n, acc * rw, mask=n < D)


# ---------------------------------------------------------------------------------------------------------
# B <= 4 analysis (session 4; tools/gpu/bench_moe.py --compile-only: Triton 3.6, sm_90 SASS of the k loop).
# Flash widths at B = 1: 6 pairs; gate+up 2 x 6 x 2048 x 4096 = 100.7 M IQ2_XXS weights (26 MB), down
# 6 x 4096 x 2048 = 50.3 M Q2_K weights (16.5 MB); H200: 132 SMs, 64 warps / SM, ~4 TB/s.
#   gate+up default (bn 16, 4 warps): 768 programs (5.8 / SM; 72 regs -> at most 7 resident, one wave of
#     23 of 64 warps), 33.8 KB per program (2.1 KB per k step). Loop: 4.02 SASS per weight per thread (ld
#     0.55, dp4a 0.50, int 2.28, fp 0.31; 8 BAR per step). Issue bound: 100.7 M x 4.02 / 32 = 12.7 M warp
#     instructions / (132 x 4 per clock) = 12 us at 1.98 GHz (int + dp4a at half rate: ~17 us), yet 43.9 us
#     measured: NOT instruction-bound (the plain-int32 form runs 2.1x the instructions for 1.37x the time;
#     one term, -15 % instructions, is 5 % faster). Per group of 8 weights a thread makes two divergent 8-byte
#     global gathers (grid row from a 2 KB table, sign mask from 1 KB): a warp's gather touches ~14 of 16 /
#     ~7.5 of 8 128-B lines, and the L1 tag stage takes about one line per clock, so with the two x loads
#     (~2 x 2) ~26 L1 clocks per 32 groups: 12.6 M groups / 32 x 26 / 132 SMs = 39 us at 1.98 GHz, the
#     measured time. Limit (an estimate, not profiled): L1 (LSU wavefront) throughput of the table gathers.
#     Variants: `gather` (both tables via tl.gather from register copies, i.e. shared memory: only bank
#     conflicts, ~3.5 wavefronts per 32 random 4-byte words, about half the L1 clocks; with sign_math the
#     loop's LDG halve), `sign_math` (no sign-mask lookup at all, +0.9 int op per weight).
#   down default (bn 64, 4 warps): 384 programs (2.9 / SM, 11.6 warps; 80 regs -> 6 resident), 43 KB per
#     program (5.4 KB per k step, 8 steps). Loop: 3.71 per weight (ld 0.23, no gathers): issue bound ~6 us,
#     bandwidth 4 us, measured 26 us. Limit: latency / too few bytes in flight: ~16 KB per SM vs the ~30 KB
#     that 4 TB/s x ~1 us loaded latency needs, and a program's loads wait for its previous step: the layout
#     conversions of the step's math put BARs in the loop, and ptxas does not hoist loads above them (an
#     unrolled 2-block step was compiled with block 2's LDGs after block 1's math). Plus the quantize and
#     k-slot sum launches. Variants: `prefetch` (block kt + 1's loads issued at the top of step kt: all
#     LDGs before the first BAR in the SASS; costs registers: 80 -> 127 for down bn 64, 72 -> 116 for
#     gate+up bn 16, so fewer resident programs; 8 warps halve that per thread), `fixup` (the k-slot sum in
#     the kernel: one launch less), k-splits, smaller tiles.
#   B = 4: 24 pairs, 4x the programs and the same per-program shape: gate+up stays gather-bound (the same
#     variants apply); down has 4x the programs, so prefetch matters less there.
# Expected (not measured): gate+up 44 -> ~20-25 us if the L1 estimate holds (then issue-bound), down 26 ->
# ~15-20 us; ~1 ms per token of the ~3 ms. tools/gpu/bench_moe.py --quick picks per B.
# Session 8 (sm_90 compile only; timed in session 9: B = 1 gate+up 37.7 -> 33.7 us, down 25.3 -> 21.4 us,
# bench_moe.py --quick, H200): both default loops are barrier-free now. gate+up: the
# sub-block words loaded as bytes in the grid indices' shape (_iq2_load; prmt 256 -> 245 instructions,
# 64 -> 56 registers, 8 -> 0 BAR; prefetch 116 -> 71 registers); down: one [BN, 4c] pair of integer sums
# per super-block, shift by shift in the quant words' layout (_q2k_block_sums; 475 -> 393 instructions,
# 80 -> 56 registers, 6 -> 0 BAR; equal to the old op order up to f32 rounding). The loads of step kt + 1
# no longer wait behind step kt's barriers.
# Session 14 (Nsight Compute on the H200, tools/gpu/ncu_probe.py): the gate/up kernels (B = 1 pairs, B = 32
# grouped) ran at 88 % of L1 throughput, the L1 tag stage taking ~1 request per clock per SM: per k step
# ~44 % of the requests were the weight loads (16 sectors per 128-byte warp load: a warp spanned 16 rows,
# 76 % of the sectors excess) and ~44 % the table gathers (~8 lines each); the down kernels' word loads were
# uncoalesced too (32 sectors where 16 serve). With the loads as contiguous runs (_iq2_load, _q2k_block,
# _q2k_scales; bench_moe.py --quick, B = 1, against session 9's run) gate+up 33.7 -> 26.5 us, down 21.4 ->
# 15.3 us per layer.


def iq2_tables(device: torch.device, grid16: bool = False, prmt: bool = False):
    """(grid table, sign table) of the int8 IQ2_XXS kernels; their dtypes select the decode (_grid_words,
    _prmt_words): int64 rows + int64 byte masks, int16 codes + masks (grid16), int32 nibbles + int32 sign
    nibbles (prmt), int16 codes + int32 sign nibbles (prmt and grid16)."""
    if prmt:
        return (iq2xxs_codes16(device) if grid16 else iq2xxs_nibbles(device)), iq2_sign_nibbles(device)
    return (iq2xxs_codes16(device) if grid16 else iq2xxs_grid_i64(device)), _iq2_sign_masks(device)


@functools.cache
def _iq2_sign_masks(device: torch.device) -> torch.Tensor:
    """[128] int64: byte j = 0xFF where bit j of KSIGNS[s] is set (the element is negative), else 0x00."""
    bits = (torch.tensor(KSIGNS, dtype=torch.int64)[:, None] >> torch.arange(8)) & 1  # [128, 8]
    return (bits * 0xFF).to(torch.uint8).view(torch.int64).reshape(128).to(device)


@functools.cache
def _iq2_table32(device: torch.device) -> torch.Tensor:
    """The IQ2_XXS grid as [512] int32 (low, high word of each 8-byte row)."""
    return iq2xxs_grid_i64(device).view(torch.int32).contiguous()


@dataclass(frozen=True)
class MoeConfig:
    """Decode launch shape (rows per program, k-splits = programs per row tile, warps) and kernel choice."""

    bn: int = 16
    splits: int = 1
    warps: int = 4
    fast: bool = False  # the dedicated IQ2_XXS gate/up and Q2_K down kernels where the format matches
    int8: bool = False  # the Q8_K integer kernels for IQ2_XXS gate/up and Q2_K down (wins over `fast`)
    dp4a: bool = True  # int8 kernels on CUDA: PTX dp4a (False: the plain int32 expression, for A/B)
    terms: int = 2  # int8 kernels: activation int8 planes (1: plain Q8_K, ~1 % error; 2: + residual plane)
    prefetch: bool = False  # int8 kernels: load super-block kt + 1 before computing kt (software pipelining)
    sign_math: bool = False  # int8 IQ2_XXS: sign masks (prmt: sign nibbles) computed, not an L1 gather
    gather: bool = False  # int8 IQ2_XXS: table lookups via tl.gather (shared memory) instead of L1 gathers
    fixup: bool = False  # int8 down: the sum over k slots / splits in the kernel (last program), no torch sum
    grid16: bool = False  # int8 IQ2_XXS: the grid as 16-bit codes (_grid_words; with prmt: _spread_codes)
    prmt: bool = False  # int8 IQ2_XXS: signed grid bytes by byte permutes from nibble tables (_prmt_words)
    lds: bool = False  # int8 IQ2_XXS, prmt: the nibble tables from a static shared copy (_lds_fill, PTX)
    # int8 kernels without prefetch: > 0 runs the super-block loop as tl.range(num_stages=stages), Triton
    # software-pipelining its loads through shared memory (stages - 1 blocks ahead, no registers held); 0:
    # the plain loop. H200, session 20 (bench_moe.py --latest, per layer): gate/up at 2-4 stages 126.8-141.9
    # vs 26.6 us at B = 1 (466-500 vs 87.7 at B = 4), down 20.1-20.3 vs 15.6 (44.8-46.3 vs 34.8); model at 4k
    # (ab_decode.py) 77.95 tok/s with both at 3 stages, 131.55 with down's alone, vs 132.95: stays 0
    stages: int = 0
    # int8 IQ2_XXS gate/up: each sub-block's 4 group dots summed as integers before its one scaling (2 ls + 1,
    # I2F, FMA) instead of scaling each group: sm_90 k loop 239 -> 218 instructions a step (int 150 -> 144,
    # fp 16 -> 4; with prefetch 259 -> 244; bench_moe.py --compile-only, session 20); closer to the integer
    # twin, which sums whole blocks first. H200, session 21: bench_moe.py --latest B = 1 gate/up 28.8 us (26.4
    # with prefetch) vs 27.0, B = 4 94.7 (87.5) vs 88.2; whole model at 4k (ab_decode.py "moe gsum" / "moe
    # gsum pf") 131.23 / 132.95 vs 132.91 tok/s: fewer instructions, no faster (the B = 1 loop waits on
    # loads, not issue): off (env DS4_MOE_GSUM=1)
    gsum: bool = False

    def __post_init__(self) -> None:
        if self.terms not in (1, 2):
            raise ValueError(f"MoeConfig.terms must be 1 or 2, got {self.terms}")
        if self.gather and (self.grid16 or self.prmt):
            raise ValueError("MoeConfig: gather excludes grid16 and prmt (one grid table)")
        if self.lds and not (self.prmt and not self.grid16 and not self.gather):
            raise ValueError("MoeConfig: lds needs the nibble tables (prmt, no grid16, no gather)")


# Defaults for the decode kernels at B = 1 (6 pairs); tools/gpu/tune_decode.py times the alternatives.
# Measured 2026-11-29 on an H200 (Flash widths, 6 of 256 experts, cold L2): general kernels, gate+up bn 8
# 89 us (bn 16: 115; k-splits 2-8 slower), down bn 32 39-62 us; the dedicated kernels (fast=True) 132 / 62 us.
# Default: the Q8_K integer kernels with two-term activations (env DS4_MOE_INT8=0: the f32 kernels above).
# H200, tools/gpu/bench_moe.py (session 3), us per layer call, Flash widths: B = 1 gate+up bn 16 43.9 (f32
# kernel 86.1), down bn 64 26.5 (35.0); B = 32 1,109 / 495 (2,375 / 846); two terms cost 3-7 % over one term
# and are ~250x closer to the f32 reference (3e-5 of the output scale vs ~1 %, which had failed the
# CUDA-vs-reference tolerance).
_INT8 = os.environ.get("DS4_MOE_INT8", "1") == "1"
# Session 4 (bench_moe.py --quick, H200): sign masks by ALU ops beat the table gather, gate+up B = 1 42.4 ->
# 39.1 us, B = 4 149.5 -> 137.8 us; down's prefetch / in-kernel fixup gained <= 1.8 us and stay off.
# Session 8 (tools/gpu/ab_decode.py, whole model at 4k ctx, H200): MoeConfig.prmt (nibble tables + byte
# permutes, bit-identical) 97.82 -> 99.74 tok/s: on (env DS4_MOE_PRMT=0: off); MoeConfig.grid16 (the 512-byte
# code table) 96.22: off (env DS4_MOE_GRID16=1 with DS4_MOE_PRMT=0; with prmt on: the permutes from the 16-bit
# codes, session 14, off). With prmt, sign_math means the sign nibbles computed instead of their 512-byte
# table gathered: session 9 (same A/B) 103.70 -> 104.53 tok/s (x1.008, within the spread of such runs): off;
# env DS4_MOE_SIGN_MATH (default: on without prmt, off with it). DOWN at 2 k-splits: bench_moe B = 1 21.4 ->
# 18.5 us, whole model 102.91 tok/s: off.
_GRID16 = os.environ.get("DS4_MOE_GRID16", "0") == "1"
_PRMT = os.environ.get("DS4_MOE_PRMT", "1") == "1"
_SIGN_MATH = os.environ.get("DS4_MOE_SIGN_MATH", "0" if _PRMT else "1") == "1"
# Session 16: MoeConfig.lds (the nibble tables in static shared memory, moe._lds_fill; bit-identical): B = 1
# gate/up 26.7 vs 26.7 us (bench_moe.py --latest), whole model 112.04 vs 111.15 tok/s at 4k (ab_decode.py, two
# rounds, x1.008: within the spread of such runs): off, env DS4_MOE_LDS=1.
_LDS = _PRMT and not _GRID16 and os.environ.get("DS4_MOE_LDS", "0") == "1"
_GSUM = os.environ.get("DS4_MOE_GSUM", "0") == "1"
_GATE_UP_INT8 = MoeConfig(
    bn=16, splits=1, int8=True, sign_math=_SIGN_MATH, grid16=_GRID16, prmt=_PRMT, lds=_LDS, gsum=_GSUM
)
GATE_UP = _GATE_UP_INT8 if _INT8 else MoeConfig(bn=8, splits=1)
DOWN = MoeConfig(bn=64, splits=1, int8=True) if _INT8 else MoeConfig(bn=32, splits=1)


def _splits(n_kt: int, want: int) -> tuple[int, int]:
    """(k-tiles per split, splits) for at most `want` splits of n_kt k-tiles."""
    per = triton.cdiv(n_kt, max(1, min(want, n_kt)))
    return per, triton.cdiv(n_kt, per)


def _check_ids(ids: torch.Tensor, b: int, device: torch.device, what: str) -> torch.Tensor:
    if ids.ndim != 2 or ids.shape[0] != b:
        raise ValueError(f"{what}: ids must be [{b}, k], got {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64) or ids.device != device:
        raise ValueError(f"{what}: ids must be int32/int64 on {device}, got {ids.dtype} on {ids.device}")
    return ids.to(torch.int32).contiguous()


def _int8(cfg: MoeConfig, w: PackedWeight, qtype: GGMLType) -> bool:
    return cfg.int8 and w.qtype == qtype


def _dp4a(t: torch.Tensor, cfg: MoeConfig) -> bool:
    """dp4a is inline PTX: CUDA only, never under the interpreter."""
    return dp4a_ok(t, cfg.dp4a)


def given_q8k(
    x: torch.Tensor, terms: int, xq: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(planes [terms, B, K], scales [B, K/256]) of x [B, K]: xq as given (checked), else quantize_q8k."""
    if xq is None:
        return quantize_q8k(x, terms)
    q, d = xq
    B, K = x.shape
    if tuple(q.shape) != (terms, B, K) or q.dtype != torch.int8 or tuple(d.shape) != (B, K // 256):
        raise ValueError(
            f"Q8_K planes must be int8 [{terms}, {B}, {K}] and [{B}, {K // 256}], got {q.dtype} "
            f"{tuple(q.shape)} and {tuple(d.shape)}"
        )
    return q, d


def _iq2_pair_args(wg: PackedWeight, wu: PackedWeight, cfg: MoeConfig) -> tuple[torch.Tensor, ...]:
    """The int8 gate/up kernel's weight arguments (gq, gs, gd, uq, us, ud): split stacks' grid bytes and
    sub-block words as bytes; quad stacks' words as int32 halves in both slots (QP reads the second)."""
    if wg.quad != wu.quad:
        raise ValueError("moe_gate_up: gate and up must share a layout (both quad or both split)")
    g, u = wg.data, wu.data
    if wg.quad:
        if cfg.prefetch or cfg.gather or cfg.gsum:
            raise ValueError("moe_gate_up: the quad layout's kernel has no prefetch, gather or gsum form")
        gw, uw = g["qp"].view(torch.int32), u["qp"].view(torch.int32)
        return gw, gw, g["d"], uw, uw, u["d"]
    gsb, usb = g["sg"].view(torch.uint8), u["sg"].view(torch.uint8)  # sub-block words read as bytes
    return g["qs"], gsb, g["d"], u["qs"], usb, u["d"]


def moe_gate_up(
    x: torch.Tensor,
    wg: PackedWeight,
    wu: PackedWeight,
    ids: torch.Tensor,
    clamp: float,
    cfg: MoeConfig | None = None,
    xq: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [B, K], gate/up stacks [E, F, K], ids [B, k] -> mid [B, k, F] f32 = silu(min(g, c)) * clamp(u, -c, c)
    with g = Wg[ids] @ x, u = Wu[ids] @ x (clamp <= 0: no clamp). Unweighted (see module doc). xq: x's Q8_K
    planes as quantize_q8k(x, cfg.terms) makes them (the HC finish launch's, fused.hc_pre_fused quant_out),
    for the int8 kernel: its quantization launch skipped."""
    check_weight(wg, 3, "moe_gate_up", x.device)
    check_weight(wu, 3, "moe_gate_up", x.device)
    if wg.qtype != wu.qtype or wg.shape != wu.shape:
        raise ValueError(f"moe_gate_up: gate {wg.qtype.name}{wg.shape} != up {wu.qtype.name}{wu.shape}")
    x = prep_x(x, wg.K, "moe_gate_up")
    ids = _check_ids(ids, x.shape[0], x.device, "moe_gate_up")
    cfg = cfg or GATE_UP
    int8 = _int8(cfg, wg, GGMLType.IQ2_XXS)
    if not use_triton(x):
        if int8:
            return ref.moe_gate_up_q8k(x, wg, wu, ids, clamp, cfg.terms)
        return ref.moe_gate_up(x, wg, wu, ids, clamp)
    B, k = ids.shape
    F, K = wg.N, wg.K
    out = torch.empty(B, k, F, dtype=torch.float32, device=x.device)
    if B * k == 0:
        return out
    tk = tile_k(wg)
    per, splits = _splits(K // tk, cfg.splits)
    part = out if splits == 1 else torch.empty(splits, 2, B * k, F, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(F, cfg.bn), B * k, splits)
    if int8:
        xq, dx = given_q8k(x, cfg.terms, xq)
        tab, ksm = iq2_tables(x.device, cfg.grid16, cfg.prmt)
        _iq2_q8k_gate_up_kernel[grid](
            xq.view(torch.int64), dx, *_iq2_pair_args(wg, wu, cfg), tab, ksm, ids, part,
            k, F, K, B * K // 8, float(clamp), per, BN=cfg.bn, CLAMP=clamp > 0, SPLIT=splits > 1,
            TERMS=cfg.terms, DP4A=_dp4a(x, cfg), SIGN_MATH=cfg.sign_math, PREFETCH=cfg.prefetch,
            GATHER=cfg.gather, LDS=cfg.lds, STAGES=cfg.stages, GSUM=cfg.gsum, QP=wg.quad, num_warps=cfg.warps,
            launch_pdl=PDL,
        )  # fmt: skip
    elif wg.qtype == GGMLType.IQ2_XXS and cfg.fast and not wg.quad:
        g, u = wg.data, wu.data
        _iq2_gate_up_kernel[grid](
            x, g["qs"], g["sg"], g["d"], u["qs"], u["sg"], u["d"], _iq2_table32(x.device), ids, part, k, F, K,
            x.stride(0), float(clamp), per, BN=cfg.bn, CLAMP=clamp > 0, SPLIT=splits > 1, num_warps=cfg.warps,
        )  # fmt: skip
    else:
        _gate_up_kernel[grid](
            x, *weight_args(wg), *weight_args(wu), ids, part, k, F, K, x.stride(0), float(clamp), per,
            QT=qtype_code(wg), BN=cfg.bn, TK=tk, SW=sub_width(wg, tk), CLAMP=clamp > 0, SPLIT=splits > 1,
            num_warps=cfg.warps,
        )  # fmt: skip
    if splits > 1:
        block = 1024
        _swiglu_sum_kernel[(triton.cdiv(B * k * F, block),)](
            part, out, B * k * F, splits, float(clamp), CLAMP=clamp > 0, BLOCK=block, num_warps=4
        )
    return out


def moe_down(
    mid: torch.Tensor,
    weights: torch.Tensor,
    wd: PackedWeight,
    ids: torch.Tensor,
    cfg: MoeConfig | None = None,
) -> torch.Tensor:
    """mid [B, k, F], router weights [B, k], down stack [E, D, F], ids [B, k] -> [B, D] f32
    = sum_j weights[b, j] * Wd[ids[b, j]] @ mid[b, j]."""
    check_weight(wd, 3, "moe_down", mid.device)
    if mid.ndim != 3 or mid.shape[2] != wd.K:
        raise ValueError(f"moe_down: mid must be [B, k, {wd.K}], got {tuple(mid.shape)}")
    B, k, F = mid.shape
    ids = _check_ids(ids, B, mid.device, "moe_down")
    if ids.shape[1] != k or weights.shape != (B, k):
        raise ValueError(
            f"moe_down: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be [{B}, {k}]"
        )
    cfg = cfg or DOWN
    int8 = _int8(cfg, wd, GGMLType.Q2_K)
    if not use_triton(mid):
        if int8:
            return ref.moe_down_q8k(mid, weights, wd, ids, cfg.terms)
        return ref.moe_down(mid, weights, wd, ids)
    D = wd.N
    mid = prep_x(mid.reshape(B * k, F), F, "moe_down")
    if B * k == 0:
        return torch.zeros(B, D, dtype=torch.float32, device=mid.device)
    tk = tile_k(wd)
    per, splits = _splits(F // tk, cfg.splits)
    part = torch.empty(splits, B, k, D, dtype=torch.float32, device=mid.device)
    grid = (triton.cdiv(D, cfg.bn), B * k, splits)
    rw = weights.float().contiguous()
    if int8:
        cnt = _split_counters(mid.device, B * grid[0]) if cfg.fixup else None
        if cnt is not None:  # part's memory read as [S, k, B, D]; the kernel sums it into out
            out = torch.empty(B, D, dtype=torch.float32, device=mid.device)
            fix = dict(FIXUP=True, sum_ptr=out, cnt_ptr=cnt, n_slots=k)
            _q2k_int8_launch(mid, rw, wd, ids, part, grid, per, cfg, **fix)
            return out
        _q2k_int8_launch(mid, rw, wd, ids, part, grid, per, cfg)
    elif wd.qtype == GGMLType.Q2_K and cfg.fast:
        w = wd.data
        _q2k_down_kernel[grid](
            mid, w["qs"], w["sc"], w["dm"], ids, rw, part, D, F, per, BN=cfg.bn, num_warps=cfg.warps
        )
    else:
        _down_kernel[grid](
            mid, *weight_args(wd), ids, rw, part, D, F, per,
            QT=qtype_code(wd), BN=cfg.bn, TK=tk, SW=sub_width(wd, tk), num_warps=cfg.warps,
        )  # fmt: skip
    if splits == 1 and k == 1:  # one term per row (the decode pairs as rows): nothing to sum, no launch
        return part.view(B, D)
    return part.sum((0, 2))  # fixed order over the splits and k slots: deterministic


def moe_down_slots(
    mid: torch.Tensor,
    weights: torch.Tensor,
    wd: PackedWeight,
    ids: torch.Tensor,
    cfg: MoeConfig,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """The int8 Q2_K pair kernel's per-slot terms [B, k, D] f32 = weights[b, j] * Wd[ids[b, j]] @ mid[b, j]
    in one k-split, zeros where ids[b, j] lies outside [0, E): the batched step's down projection
    (moe_grouped.GroupedConfig.pair_down). mid [B, k, F] f32 on a Triton device, wd a Q2_K stack; the
    caller (moe_grouped.moe_down_grouped) has checked the shapes. order [B k] int32 (a permutation of the
    flat pair indices, moe_grouped.ExpertRuns.order): the programs take the pairs in that order."""
    B, k, F = mid.shape
    part = torch.empty(B, k, wd.N, dtype=torch.float32, device=mid.device)
    grid = (triton.cdiv(wd.N, cfg.bn), B * k, 1)
    ids, rw = ids.to(torch.int32).contiguous(), weights.float().contiguous()
    by_order = dict(order_ptr=order, ORDER=order is not None)
    _q2k_int8_launch(mid.reshape(B * k, F), rw, wd, ids, part, grid, F // 256, cfg, **by_order)
    return part


def _q2k_int8_launch(mid, rw, wd: PackedWeight, ids, part, grid, per: int, cfg: MoeConfig, **extra) -> None:
    """The int8 Q2_K down kernel over the P flat pairs of mid [P, F] (ids, rw [P] int32 / f32 in pair order)
    into part, on grid (D tiles, P, k-splits of per super-blocks): moe_down's and moe_down_slots' launch
    (after mid's Q8_K quantization). extra: the kernel's FIXUP or ORDER arguments."""
    P, F = mid.shape
    xq, dx = quantize_q8k(mid, cfg.terms)
    w = wd.data
    _q2k_q8k_down_kernel[grid](
        xq.view(torch.int32), dx, w["qs"].view(torch.int32), w["sc"], w["dm"], ids, rw, part, wd.N, F,
        wd.shape[0], P * F // 4, per, BN=cfg.bn, TERMS=cfg.terms, DP4A=_dp4a(mid, cfg),
        PREFETCH=cfg.prefetch, STAGES=cfg.stages, num_warps=cfg.warps, launch_pdl=PDL, **extra,
    )  # fmt: skip


def group_by_expert(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (row, slot) pairs of ids [T, k] by expert, on ids' device without host syncs.

    Returns (order [T*k] int64: flat pair index b*k + j in expert order, stable; offsets [E+1] int32: pairs
    of expert e are order[offsets[e]:offsets[e+1]]). Rows to feed moe_grouped: x[order // k].
    """
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(n_experts + 1, dtype=torch.int32, device=ids.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return order, offsets


__all__ = [
    "DOWN",
    "GATE_UP",
    "MoeConfig",
    "group_by_expert",
    "moe_down",
    "moe_down_slots",
    "moe_gate_up",
    "quantize_q8k",
]
