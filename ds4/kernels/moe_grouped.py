"""Routed experts of a batched decode step grouped by expert: every selected expert's weight blocks decoded
once per step for all the (row, slot) pairs routed to it (issue 8; model.md §5.5, block formats §3).

moe.py's int8 kernels (MoeConfig.int8) run one program per (row, slot) PAIR and output tile, so B rows decode
B*k experts' blocks although fewer are distinct (B = 32, k = 6: 192 pairs, ~134.5 distinct of 256), and the
IQ2_XXS decode is instruction-bound. Here the pairs are sorted by expert on the device (moe.group_by_expert:
no host sync) and one program takes an (expert run, output-row tile): up to PT pairs of one expert, decoding
each super-block once and applying it to every pair's quantized activations (the same two-term Q8_K planes,
moe.quantize_q8k, and integer dots as the int8 kernels, so the results equal moe.moe_gate_up / moe_down up
to f32 rounding: gate/up sums the 4 groups of a sub-block as integers before scaling, one f32 multiply-add
per 32 weights instead of per 8; down sums a whole super-block as integers as ref.q8k_matvec_row does, with
the min term's activation sums per 16 values precomputed once per pair row (_group_sums), all in [BN, 4]
tensors: no per-pair reductions or layout conversions. sm_90 k-loop instructions at bn 32:
down 161 for one pair + ~130 per further pair (the pair kernel's structure: 271 + ~198); gate/up bn 16
228 + ~75, no barrier in the loop (moe.py's pair kernel: 257 per pair, 4 layout conversions per block).
H200 (tools/gpu/bench_moe_grouped.py, per layer, vs the pair kernels): B = 32 1,330 vs 1,605 us, B = 16
779 vs 816, B = 8 440 vs 421 (batch.MOE_GROUPED_MIN_ROWS = 16 from that; 2 since session 28).

Static grid for CUDA graphs: programs over (output tile, sorted pair position p); p leads a chunk when
(p - start of its expert's run) % PT == 0 and handles pairs p .. min(p + PT, end of run) - 1; other programs
store nothing. A run longer than PT is split over several programs (each decodes the expert's blocks).

Ids outside [0, E) (other ranks' experts under expert parallelism) contribute nothing: they are sorted into
a sentinel run E whose programs decode nothing and store zero mid / zero down output.

Per-pair down outputs [B k, D] are summed over the k slots in fixed order (no atomics: deterministic). Since
session 14 the down projection runs moe.py's pair kernel by default (GroupedConfig.pair_down: at 56
registers it outran the grouped one's 153 once both read coalesced rows); the grouped one stays as the
switch.

GroupedConfig.mma / mma_dn (sessions 26-28): both projections on the int8 tensor cores, one mma.sync per
sub-block of 16 rows x 4 pairs x 2 planes (see "Gate/up on the int8 tensor cores" below); correct. All
these kernels are bound by the L1/TEX unit (session 27's counters), so their loads decide: the gate/up with
16-byte loads (mma_ld128) and conflict-free tables (lds_rep 64) beats the dp4a kernel per layer at every
B timed (8-32, H100) and is the default since session 28; the down stays on the pair kernel.

Legend: B rows, k experts per row, P = B k pairs, K model width (4096), F expert width (2048), E experts,
D down output rows (= K), PT pairs per program, BN output rows per program, nb super-blocks per row,
NT threads a program (32 per warp; the mma kernels' [NT] tensors hold one value a lane).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ds4.quant.types import GGMLType

from . import packing, ref
from .dispatch import PDL, pdl_wait
from .intq import dp4a_ok
from .matvec import check_weight, prep_x, use_triton
from .moe import (
    _PRMT_NEG,
    _PRMT_POS,
    DOWN,
    GATE_UP,
    _dot4,
    _dot16,
    _iq2_raw,
    _iq2_unpack,
    _joined_tables,
    _lds_fill,
    _pick,
    _prmt,
    _q2k_block,
    _q2k_scales,
    _signed_words,
    _signed_words_sb,
    _split4,
    given_q8k,
    group_by_expert,
    iq2_tables,
    moe_down_slots,
    quantize_q8k,
)
from .packing import PackedWeight

MAX_PT = 4  # pairs per program are unrolled by hand (separate accumulators) up to this many


@triton.jit
def _iq2_decode(
    q, s, d, tab64, ksm, SIGN_MATH: tl.constexpr, PTX: tl.constexpr, POS_REG: tl.constexpr, nib_r, snib_r,
    SMEM: tl.constexpr, LDS: tl.constexpr,
):  # fmt: skip
    """An IQ2_XXS super-block of BN rows from its loaded bytes (moe._iq2_raw: q, s [BN, 32] u8, d [BN] f16),
    decoded once: (wlo, whi [BN, 8, 4] int32 signed grid bytes of group 4 sb + lg (elements 0-3 / 4-7),
    ls [BN, 8] int32 = 2 ls + 1 per sub-block, d [BN] f32), as moe.py's _iq2_q8k_block decodes them
    (moe._signed_words: tab64 / ksm the launcher's tables, SIGN_MATH the computed sign masks, PTX the byte
    permutes as PTX, POS_REG as GroupedConfig.pos_reg, LDS the static shared tables of GroupedConfig.lds:
    0 none, else lds_rep)."""
    idx, a1, d = _iq2_unpack(q, s, d)
    lg = tl.arange(0, 4)[None, None, :]
    si = (a1 >> (7 * lg)) & 127
    if SMEM:  # the tables as register copies, looked up by tl.gather (GroupedConfig.smem)
        wlo, whi = _prmt_smem(nib_r, snib_r, idx, si, PTX)
    else:
        wlo, whi = _signed_words_sb(tab64, ksm, idx, si, SIGN_MATH, PTX, POS_REG, LDS)
    a1w = tl.reshape(a1, (q.shape[0], 8))
    return wlo, whi, 2 * ((a1w >> 28) & 15) + 1, d


@triton.jit
def _prmt_smem(nib_r, snib_r, idx, si, PTX: tl.constexpr):
    """moe._prmt_words (grid nibbles, gathered sign nibbles) with both tables held in registers (nib_r
    [256], snib_r [128] int32) and looked up by tl.gather, which Triton lowers through shared memory on the
    GPU: a warp's 32 lookups then cost the bank conflicts of one shared load instead of the ~8 / ~4 L1 tag
    requests of a global gather from the 1 KB / 512 B tables (the L1 tag stage bounds the grouped gate/up:
    session 14). In the [8, BN, 4] order of moe._signed_words_sb. snib_r None (SMEM 2): nib_r is the joined
    [512] table."""
    ip, sp = tl.permute(idx, (1, 0, 2)), tl.permute(si, (1, 0, 2))
    if snib_r is None:  # SMEM 2: one table [512] (nibbles, then sign nibbles at 256), one joined lookup
        both = tl.join(ip, sp + 256)
        w, sn = tl.split(tl.reshape(tl.gather(nib_r, tl.reshape(both, (both.numel,)), 0), both.shape))
        lo = w | sn
    else:
        w = tl.reshape(tl.gather(nib_r, tl.reshape(ip, (ip.numel,)), 0), ip.shape)
        lo = w | tl.reshape(tl.gather(snib_r, tl.reshape(sp, (sp.numel,)), 0), sp.shape)
    hi = lo >> 16
    a = tl.full(lo.shape, _PRMT_POS, tl.int32)  # the permutes' source words, as in moe._prmt_words
    b = tl.full(lo.shape, _PRMT_NEG, tl.int32)
    return tl.permute(_prmt(a, b, lo, PTX), (1, 0, 2)), tl.permute(_prmt(a, b, hi, PTX), (1, 0, 2))


@triton.jit
def _dot_groups(wl, wh, x8, c, DP4A: tl.constexpr):
    """c + the integer dot of a sub-block's 4 groups (weight words wl, wh [BN, 8, 4]; x words x8 [1, 8, 4]
    int64): one dp4a chain, no per-group sums."""
    l0, l1, l2, l3 = _split4(wl)
    h0, h1, h2, h3 = _split4(wh)
    x0, x1, x2, x3 = _split4(x8)
    c = _dot4(h0, (x0 >> 32).to(tl.int32), _dot4(l0, x0.to(tl.int32), c, DP4A), DP4A)
    c = _dot4(h1, (x1 >> 32).to(tl.int32), _dot4(l1, x1.to(tl.int32), c, DP4A), DP4A)
    c = _dot4(h2, (x2 >> 32).to(tl.int32), _dot4(l2, x2.to(tl.int32), c, DP4A), DP4A)
    return _dot4(h3, (x3 >> 32).to(tl.int32), _dot4(l3, x3.to(tl.int32), c, DP4A), DP4A)


@triton.jit
def _iq2_pair(
    wlo,
    whi,
    ls,
    d,
    xw_ptr,
    dx_ptr,
    b,
    kt,
    nb,
    xrow,
    xplane,
    xg,
    TERMS: tl.constexpr,
    DP4A: tl.constexpr,
    CHAIN: tl.constexpr,
):
    """[BN, 8] f32 partials of one pair (x row b: xw words at b * xrow, int64 per group of 8) on a decoded
    IQ2_XXS super-block: (d_w d_x) sum_32 (2 ls + 1) g v per sub-block, the 4 groups of a sub-block summed as
    integers (moe._iq2_q8k_block scales each group in f32: same value up to f32 rounding; the twin sums whole
    blocks as integers): per group, then over the groups, or (CHAIN, GroupedConfig.chain) in one dp4a chain
    per plane. |sum| <= 32 * 43 * 32385 * 31 < 2^31."""
    xo = xw_ptr + b * xrow + kt * 32 + xg
    if CHAIN:
        dot = _dot_groups(wlo, whi, tl.load(xo), tl.zeros([wlo.shape[0], 8], dtype=tl.int32), DP4A)
        if TERMS == 2:  # residual plane: v = 254 q1 + q2, the same weight words
            dot = _dot_groups(wlo, whi, tl.load(xo + xplane), dot * 254, DP4A)
    else:
        x8 = tl.load(xo)  # [1, 8, 4] int64
        dot4 = _dot4(whi, (x8 >> 32).to(tl.int32), _dot4(wlo, x8.to(tl.int32), 0, DP4A), DP4A)
        if TERMS == 2:
            x8 = tl.load(xo + xplane)
            dot4 = _dot4(whi, (x8 >> 32).to(tl.int32), _dot4(wlo, x8.to(tl.int32), dot4 * 254, DP4A), DP4A)
        dot = tl.sum(dot4, axis=2)  # [BN, 8]
    dx = tl.load(dx_ptr + b * nb + kt)
    return (d * dx)[:, None] * (dot * ls).to(tl.float32)


@triton.jit
def _run_chunk(eid_ptr, offs_ptr, p, E, PT: tl.constexpr):
    """(expert e clamped into [0, E), pairs this program handles: 0 unless p leads a chunk, live: 1 if the
    expert is a real one, first sorted position p) of sorted position p."""
    e = tl.load(eid_ptr + p)
    start = tl.load(offs_ptr + e)
    end = tl.load(offs_ptr + e + 1)
    lead = (p - start) % PT == 0
    cnt = tl.where(lead, tl.minimum(end - p, PT), 0)
    return tl.minimum(e, E - 1).to(tl.int64), cnt, (e < E) & (cnt > 0)


@triton.jit
def _pair_index(order_ptr, p, i, n_pairs):
    """Flat pair index b * k + j of sorted position p + i (clamped to a valid position)."""
    return tl.load(order_ptr + tl.minimum(p + i, n_pairs - 1)).to(tl.int64)


@triton.jit
def _gu_store(out_ptr, pidx, g, u, n, F, clamp, ok, CLAMP: tl.constexpr):
    """mid row pidx [F] = clamped SwiGLU of the [BN, 8] partials g, u (where ok)."""
    _swiglu_store(out_ptr, pidx, tl.sum(g, axis=1), tl.sum(u, axis=1), n, F, clamp, ok, CLAMP)


@triton.jit
def _gate_up_grouped_kernel(
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
    order_ptr,
    eid_ptr,
    offs_ptr,
    out_ptr,
    n_slots,
    n_pairs,
    E,
    F,
    K,
    xplane,
    clamp,
    BN: tl.constexpr,
    PT: tl.constexpr,
    CLAMP: tl.constexpr,
    TERMS: tl.constexpr,
    DP4A: tl.constexpr,
    SIGN_MATH: tl.constexpr,
    CHAIN: tl.constexpr = False,
    POS_REG: tl.constexpr = False,
    SMEM: tl.constexpr = 0,
    LDS: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    """Gate and up of up to PT pairs of one expert (sorted positions p ..) on the quantized input (xw
    [TERMS, B, K/8] int64, planes xplane words apart; dx [B, K/256]) -> mid rows out [P, F] (flat pair
    index), the clamped SwiGLU; zeros for the sentinel expert. PREFETCH: GroupedConfig.prefetch."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    if LDS:
        _lds_fill(tab64, ksm, DP4A, LDS)
    pid_n = tl.program_id(0)
    p = tl.program_id(1)
    e, cnt, live = _run_chunk(eid_ptr, offs_ptr, p, E, PT)
    n = pid_n * BN + tl.arange(0, BN)
    wrow = e * F + tl.minimum(n, F - 1)
    nb = K // 256
    xrow = K // 8
    xg = tl.arange(0, 8)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # [1, 8, 4] group words
    p0 = _pair_index(order_ptr, p, 0, n_pairs)
    p1 = _pair_index(order_ptr, p, 1, n_pairs)
    p2 = _pair_index(order_ptr, p, 2, n_pairs)
    p3 = _pair_index(order_ptr, p, 3, n_pairs)
    b0, b1, b2, b3 = p0 // n_slots, p1 // n_slots, p2 // n_slots, p3 // n_slots
    g0 = tl.zeros([BN, 8], dtype=tl.float32)  # per-lane partials of pair i, reduced after the loop
    u0 = tl.zeros([BN, 8], dtype=tl.float32)
    g1 = tl.zeros([BN, 8], dtype=tl.float32)
    u1 = tl.zeros([BN, 8], dtype=tl.float32)
    g2 = tl.zeros([BN, 8], dtype=tl.float32)
    u2 = tl.zeros([BN, 8], dtype=tl.float32)
    g3 = tl.zeros([BN, 8], dtype=tl.float32)
    u3 = tl.zeros([BN, 8], dtype=tl.float32)
    nib_r, snib_r = tab64, ksm  # SMEM: register copies of the tables (GroupedConfig.smem)
    if SMEM == 1:
        nib_r = tl.load(tab64 + tl.arange(0, 256))
        snib_r = tl.load(ksm + tl.arange(0, 128))
    if SMEM == 2:  # one [512] table: the grid nibbles, the sign nibbles from 256, zeros
        nib_r = _joined_tables(tab64, ksm)
        snib_r = None
    if PREFETCH:  # super-block 0's bytes now; step kt loads kt + 1's before it decodes kt's
        gq_n, gs_n, gd_n = _iq2_raw(gq, gs, gd, wrow, 0, nb)
        uq_n, us_n, ud_n = _iq2_raw(uq, us, ud, wrow, 0, nb)
    for kt in range(0, tl.where(live, nb, 0)):
        if PREFETCH:
            gq_c, gs_c, gd_c, uq_c, us_c, ud_c = gq_n, gs_n, gd_n, uq_n, us_n, ud_n
            kn = tl.minimum(kt + 1, nb - 1)  # the last step reloads its own block (unused)
            gq_n, gs_n, gd_n = _iq2_raw(gq, gs, gd, wrow, kn, nb)
            uq_n, us_n, ud_n = _iq2_raw(uq, us, ud, wrow, kn, nb)
        else:
            gq_c, gs_c, gd_c = _iq2_raw(gq, gs, gd, wrow, kt, nb)
            uq_c, us_c, ud_c = _iq2_raw(uq, us, ud, wrow, kt, nb)
        wl, wh, ls, d = _iq2_decode(
            gq_c, gs_c, gd_c, tab64, ksm, SIGN_MATH, DP4A, POS_REG, nib_r, snib_r, SMEM, LDS
        )
        vl, vh, ms, c = _iq2_decode(
            uq_c, us_c, ud_c, tab64, ksm, SIGN_MATH, DP4A, POS_REG, nib_r, snib_r, SMEM, LDS
        )
        g0 += _iq2_pair(wl, wh, ls, d, xw_ptr, dx_ptr, b0, kt, nb, xrow, xplane, xg, TERMS, DP4A, CHAIN)
        u0 += _iq2_pair(vl, vh, ms, c, xw_ptr, dx_ptr, b0, kt, nb, xrow, xplane, xg, TERMS, DP4A, CHAIN)
        if PT > 1:
            if cnt > 1:
                g1 += _iq2_pair(
                    wl, wh, ls, d, xw_ptr, dx_ptr, b1, kt, nb, xrow, xplane, xg, TERMS, DP4A, CHAIN
                )
                u1 += _iq2_pair(
                    vl, vh, ms, c, xw_ptr, dx_ptr, b1, kt, nb, xrow, xplane, xg, TERMS, DP4A, CHAIN
                )
        if PT > 2:
            if cnt > 2:
                g2 += _iq2_pair(
                    wl, wh, ls, d, xw_ptr, dx_ptr, b2, kt, nb, xrow, xplane, xg, TERMS, DP4A, CHAIN
                )
                u2 += _iq2_pair(
                    vl, vh, ms, c, xw_ptr, dx_ptr, b2, kt, nb, xrow, xplane, xg, TERMS, DP4A, CHAIN
                )
        if PT > 3:
            if cnt > 3:
                g3 += _iq2_pair(
                    wl, wh, ls, d, xw_ptr, dx_ptr, b3, kt, nb, xrow, xplane, xg, TERMS, DP4A, CHAIN
                )
                u3 += _iq2_pair(
                    vl, vh, ms, c, xw_ptr, dx_ptr, b3, kt, nb, xrow, xplane, xg, TERMS, DP4A, CHAIN
                )
    _gu_store(out_ptr, p0, g0, u0, n, F, clamp, cnt > 0, CLAMP)
    if PT > 1:
        _gu_store(out_ptr, p1, g1, u1, n, F, clamp, cnt > 1, CLAMP)
    if PT > 2:
        _gu_store(out_ptr, p2, g2, u2, n, F, clamp, cnt > 2, CLAMP)
    if PT > 3:
        _gu_store(out_ptr, p3, g3, u3, n, F, clamp, cnt > 3, CLAMP)


# ---------------------------------------------------------------------------------------------------------
# Gate/up on the int8 tensor cores (GroupedConfig.mma)
#
# Why: at B = 32 an expert has ~1.5 pairs, so the dp4a kernel above spends 4 dp4a a group of 8 weights per
# pair (two words, two planes) besides the decode. One mma.sync.m16n8k32 (s8 x s8 -> s32) takes a whole
# IQ2_XXS sub-block (32 weights: one k step, so its scale applies after) of 16 rows against 8 columns:
# here 4 pairs x 2 activation planes, column 2 j + plane of pair j. Lane (gid = lane / 4, tid = lane % 4)
# of a warp holds, in the PTX fragment layout:
#   A: a0 / a2 = elements 0-3 / 4-7 of group tid of row gid (a1 / a3: row gid + 8), i.e. the decoded words
#      wlo / whi of one group each (the k order within the sub-block permuted alike on both sides:
#      group t at k 4t..4t+3 and 16+4t..16+4t+3);
#   B: b0 / b1 = elements 0-3 / 4-7 of group tid of column gid = plane gid % 2 of pair gid // 2;
#   C: c0, c1 = row gid, columns 2 tid, 2 tid + 1 = pair tid's planes 1, 2 (c2, c3: row gid + 8),
# so a lane combines its pair's exact sub-block sum 254 I1 + I2 locally, then scales it as _iq2_pair does.
# Every tensor of the kernel is [NT] (NT = 32 warps): one value a thread, lane = element % 32 (Triton's
# default layout of a 1-D tensor of the thread count; no layout conversion anywhere). Written by hand
# because the fragment layout is the point: tl.dot would want the decoded weights in its own operand
# layout (a shared-memory round trip per sub-block) and pads the pair dimension to 16.
# Session 26 (H100, tools/gpu/bench_moe_grouped.py --latest, per layer): correct (GPU tests), but slower
# than the dp4a kernels although its k loop issues ~2.7 instructions a weight against ~3.7 at B = 32:
# gate/up B = 8 / 16 / 32 208-222 / 346-401 / 548-608 us vs 150.6 / 279.9 / 501.4; down (_down_mma_kernel)
# 112-114 / 193-194 / 300-303 vs the pair kernel's 69.3 / 113.8 / 190.3; whole B = 16 / 32 steps (30
# layers, both on) x0.745 / x0.788. The loads are in the fragment layout: a lane reads 8 bytes of a row
# and its quad the same 8, a quarter of each 32-byte sector where the dp4a kernels load whole rows, so the
# likely bound is the L1 (as session 14 found for the gathers). Session 27 (Nsight Compute, H100, B = 32):
# the dp4a kernel and this one both at 92-94 % of the L1/TEX throughput (the table lookups' bank conflicts
# half their shared wavefronts); with mma_ld128 (16-byte loads: half the weight-load instructions) this
# kernel is the faster one: per layer B = 8 / 16 / 32 153.1 / 267.0 / 419.5 us vs 152.6 / 281.9 / 501.3
# (x1.195 at B = 32); whole 30-layer steps (batch_check.py, 8k) B = 16 / 32 x1.032 / x1.080 (30.68 vs
# 33.13 ms). Session 28: the batched-vs-alone check passed with it on (B = 1 / 3 / 16, as the dp4a kernel's
# did), and both nibble tables in 32 copies (lds_rep 64) took B = 8 / 16 / 32 to 135.6 / 235.7 / 373.0 us
# (16 copies 151.7 / 262.9 / 410.7; the dp4a kernel 150.4 / 278.0 / 497.2): the default since (CONFIG).


@triton.jit
def _mma_i8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, PTX: tl.constexpr):
    """(c0, c1, c2, c3) + mma.sync.m16n8k32 s8 -> s32 per lane of [NT] tensors (int32). PTX False (Triton's
    interpreter): the same sums gathered across the lanes as the fragments lay them out (lane = element %
    32)."""
    if PTX:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9},"
            " {$10, $11, $12, $13};", "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r",
            [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=False, pack=1,
        )  # fmt: skip
    else:
        W: tl.constexpr = a0.shape[0] // 32
        e0, e1 = _mma_rows(a0, a2, b0, b1, W)
        e2, e3 = _mma_rows(a1, a3, b0, b1, W)
        c0, c1, c2, c3 = c0 + e0, c1 + e1, c2 + e2, c3 + e3
    return c0, c1, c2, c3


@triton.jit
def _mma_rows(alo, ahi, b0, b1, W: tl.constexpr):
    """The interpreter's mma for one row half: lane (gid, tid) gets sum over tid' of the dot of row gid's
    words of lane (gid, tid') with column n's of lane (n, tid'), for n = 2 tid and 2 tid + 1."""
    al = tl.reshape(alo, (W, 8, 1, 4))  # [warp, gid, 1, tid']
    ah = tl.reshape(ahi, (W, 8, 1, 4))
    bl = tl.reshape(b0, (W, 1, 8, 4))  # [warp, 1, column n, tid']
    bh = tl.reshape(b1, (W, 1, 8, 4))
    s = tl.sum(_dot4(ah, bh, _dot4(al, bl, 0, False), False), axis=3)  # [W, 8 gid, 8 n]
    even, odd = tl.split(tl.reshape(s, (W, 8, 4, 2)))  # n = 2 tid, 2 tid + 1
    return tl.reshape(even, (W * 32,)), tl.reshape(odd, (W * 32,))


@triton.jit
def _mma_lanes(N, nb, NT: tl.constexpr):
    """(gid, tid, n, r0, r1) [NT] of the lanes (lane = element % 32) of a program's warp tiles of 16 of N
    rows: fragment group and thread in it, row n = gid of the warp's tile (n + 8 the other), the first
    super-block (of nb a row) of rows n and n + 8 within the expert, clamped to its last row."""
    lane = tl.arange(0, NT) % 32
    gid, tid = lane // 4, lane % 4
    n = tl.program_id(0) * NT // 2 + (tl.arange(0, NT) // 32) * 16 + gid  # NT / 2 = 16 rows a warp
    return gid, tid, n, tl.minimum(n, N - 1) * nb, tl.minimum(n + 8, N - 1) * nb


@triton.jit
def _mad_wide(a, b, c, PTX: tl.constexpr):
    """c + a b: int32 a, b, int64 c (PTX mad.wide.s32, one IMAD.WIDE; LLVM's sign-extended multiply and
    64-bit add take ~4 instructions)."""
    if PTX:
        out = tl.inline_asm_elementwise(
            "mad.wide.s32 $0, $1, $2, $3;", "=l,r,r,l", [a, b, c], dtype=tl.int64, is_pure=True, pack=1
        )
    else:
        out = c + a.to(tl.int64) * b.to(tl.int64)
    return out


@triton.jit
def _mma_sub(
    qa, qb, sa, sb, h: tl.constexpr, tid, xl, xh, acc0, acc1, tab64, ksm, PTX: tl.constexpr,
    LDS: tl.constexpr, SIGN_MATH: tl.constexpr = 0,
):  # fmt: skip
    """acc0 / acc1 ([NT] int64) + (2 ls + 1) (254 I1 + I2) of sub-block h of the int64 words qa, sa (grid
    bytes, sub-block words of row gid; qb, sb: row gid + 8; a word holds two sub-blocks) for the lane's pair
    tid: one mma, xl / xh the lane's B words. In int64 so that a super-block's 8 are summed exactly."""
    w0 = (sa >> (32 * h)).to(tl.int32)  # the sub-block word: 4 x 7 sign bits, the scale on top
    w1 = (sb >> (32 * h)).to(tl.int32)
    zero = tl.zeros_like(w0)
    sel = 0x4440 + tid  # byte tid of the grid word, then zeros: the grid index in one PRMT
    i0 = _prmt((qa >> (32 * h)).to(tl.int32), zero, sel, PTX)
    i1 = _prmt((qb >> (32 * h)).to(tl.int32), zero, sel, PTX)
    s0, s1 = (w0 >> (7 * tid)) & 127, (w1 >> (7 * tid)) & 127  # the lane's sign indices
    d0, d1 = _mma_dots(i0, i1, s0, s1, xl, xh, tab64, ksm, PTX, LDS, SIGN_MATH)
    # 2 ls + 1 = the top 5 bits | 1 (bit 27 is overwritten)
    acc0 = _mad_wide(d0, ((w0 >> 27) & 31) | 1, acc0, PTX)
    return acc0, _mad_wide(d1, ((w1 >> 27) & 31) | 1, acc1, PTX)


@triton.jit
def _mma_dots(
    i0, i1, s0, s1, xl, xh, tab64, ksm, PTX: tl.constexpr, LDS: tl.constexpr, SIGN_MATH: tl.constexpr
):  # fmt: skip
    """(254 I1 + I2 of row gid, of row gid + 8) of one sub-block for the lane's pair tid: the lane's group
    decoded from grid indices i0 / i1 and sign indices s0 / s1, one mma with the B words xl / xh. Shared by
    _mma_sub and _qp_sub (the two weight layouts); |254 I1 + I2| <= 32 * 43 * 32385 < 2^31."""
    lo0, hi0 = _signed_words(tab64, ksm, i0, s0, SIGN_MATH, PTX, True, LDS)
    lo1, hi1 = _signed_words(tab64, ksm, i1, s1, SIGN_MATH, PTX, True, LDS)
    zero = tl.zeros_like(i0)
    c0, c1, c2, c3 = _mma_i8(lo0, lo1, hi0, hi1, xl, xh, zero, zero, zero, zero, PTX)
    return c0 * 254 + c1, c2 * 254 + c3


@triton.jit
def _ld2(ptr, LD128: tl.constexpr):
    """(The int64 words at ptr and ptr + 1): one 16-byte load (LD128, GroupedConfig.mma_ld128: half the load
    instructions, 16 of a row's bytes a lane instead of 8), else two 8-byte loads."""
    if LD128:
        lo, hi = tl.inline_asm_elementwise(
            "ld.global.nc.v2.b64 {$0, $1}, [$2];", "=l,=l,l", [ptr], dtype=(tl.int64, tl.int64), is_pure=True,
            pack=1,
        )  # fmt: skip
    else:
        lo, hi = tl.load(ptr), tl.load(ptr + 1)
    return lo, hi


@triton.jit
def _mma_step(
    gq, gs, uq, us, w0, w1, tid, x, ga, gb, ua, ub, tab64, ksm, PTX: tl.constexpr, LDS: tl.constexpr,
    LD128: tl.constexpr, SIGN_MATH: tl.constexpr,
):  # fmt: skip
    """The gate / up sums ga, gb / ua, ub (rows gid / gid + 8) + one super-block (first words w0 / w1 of
    the grid bytes gq / uq and sub-block words gs / us) for the lane's pair tid, in the split layout: the
    quad loads a row's words whole; x: the lane's x word of sub-block 0 (sub-block s at x + 4 s)."""
    for jj in tl.static_range(2):  # words 2 jj, 2 jj + 1 (LD128: one 16-byte load for both)
        gqa, gqb = _ld2(gq + w0 + 2 * jj, LD128), _ld2(gq + w1 + 2 * jj, LD128)
        gsa, gsb = _ld2(gs + w0 + 2 * jj, LD128), _ld2(gs + w1 + 2 * jj, LD128)
        uqa, uqb = _ld2(uq + w0 + 2 * jj, LD128), _ld2(uq + w1 + 2 * jj, LD128)
        usa, usb = _ld2(us + w0 + 2 * jj, LD128), _ld2(us + w1 + 2 * jj, LD128)
        for j2 in tl.static_range(2):  # word 2 jj + j2 of each pair
            for h in tl.static_range(2):
                xw = tl.load(x + (4 * jj + 2 * j2 + h) * 4)
                xl, xh = xw.to(tl.int32), (xw >> 32).to(tl.int32)
                ga, gb = _mma_sub(
                    gqa[j2], gqb[j2], gsa[j2], gsb[j2], h, tid, xl, xh, ga, gb, tab64, ksm, PTX, LDS,
                    SIGN_MATH,
                )  # fmt: skip
                ua, ub = _mma_sub(
                    uqa[j2], uqb[j2], usa[j2], usb[j2], h, tid, xl, xh, ua, ub, tab64, ksm, PTX, LDS,
                    SIGN_MATH,
                )  # fmt: skip
    return ga, gb, ua, ub


@triton.jit
def _quad_or(v, PTX: tl.constexpr):
    """The OR of v over each quad of lanes (lanes 4 g .. 4 g + 3), in every lane of it: two butterfly
    shuffles. PTX False (the interpreter): the same as a sum over [NT / 4, 4] (callers' bits are disjoint)."""
    if PTX:
        for m in tl.static_range(2):
            v = v | tl.inline_asm_elementwise(
                f"shfl.sync.bfly.b32 $0, $1, {1 << m}, 0x1f, -1;", "=r,r", [v], dtype=tl.int32, is_pure=True,
                pack=1,
            )  # fmt: skip
    else:
        NT: tl.constexpr = v.shape[0]
        q = tl.sum(tl.reshape(v, (NT // 4, 4)), axis=1)
        v = tl.reshape(tl.broadcast_to(q[:, None], (NT // 4, 4)), (NT,))
    return v


@triton.jit
def _qp_step(
    gq, uq, w0, w1, tid, x, ga, gb, ua, ub, tab64, ksm, PTX: tl.constexpr, LDS: tl.constexpr,
    LD128: tl.constexpr, SIGN_MATH: tl.constexpr,
):  # fmt: skip
    """The gate / up sums ga, gb / ua, ub (rows gid / gid + 8) + one super-block (first quad-layout words
    w0 / w1 of gq / uq) for the lane's pair tid, from the quad layout (quad_pack): the lane's 16 bytes of
    a row hold its group tid of every sub-block (grid word: byte s; sign word: sub-block s's 7-bit index at
    7 (s % 4) of half s // 4, the scales of sub-blocks 2 tid / 2 tid + 1 in the halves' top nibbles), the
    other scales come from the quad (_qp_scales). x: the lane's 8 x words of the super-block, adjacent
    (quad_x), each loaded once for both matrices."""
    gqa, gva = _ld2(gq + (w0 + tid) * 2, LD128)
    gqb, gvb = _ld2(gq + (w1 + tid) * 2, LD128)
    uqa, uva = _ld2(uq + (w0 + tid) * 2, LD128)
    uqb, uvb = _ld2(uq + (w1 + tid) * 2, LD128)
    gsa, gsb = _qp_scales(gva, tid, PTX), _qp_scales(gvb, tid, PTX)  # nibble s: sub-block s's scale
    usa, usb = _qp_scales(uva, tid, PTX), _qp_scales(uvb, tid, PTX)
    for s2 in tl.static_range(4):
        xpair = _ld2(x + 2 * s2, LD128)  # words of sub-blocks 2 s2, 2 s2 + 1: one 16-byte load
        for h in tl.static_range(2):  # sub-block s = 2 s2 + h
            xl, xh = xpair[h].to(tl.int32), (xpair[h] >> 32).to(tl.int32)
            ga, gb = _qp_sub(
                gqa, gva, gsa, gqb, gvb, gsb, 2 * s2 + h, xl, xh, ga, gb, tab64, ksm, PTX, LDS, SIGN_MATH
            )
            ua, ub = _qp_sub(
                uqa, uva, usa, uqb, uvb, usb, 2 * s2 + h, xl, xh, ua, ub, tab64, ksm, PTX, LDS, SIGN_MATH
            )
    return ga, gb, ua, ub


@triton.jit
def _qp_sub(
    qa, va, sa, qb, vb, sb, s: tl.constexpr, xl, xh, acc0, acc1, tab64, ksm, PTX: tl.constexpr,
    LDS: tl.constexpr, SIGN_MATH: tl.constexpr,
):  # fmt: skip
    """acc0 / acc1 + (2 ls + 1) (254 I1 + I2) of sub-block s of rows gid / gid + 8 (quad-layout grid words
    qa / qb, sign words va / vb, scale nibbles sa / sb: _qp_step) for the lane's pair tid: one mma."""
    i0 = ((qa >> (32 * (s // 4))).to(tl.int32) >> (8 * (s % 4))) & 255
    i1 = ((qb >> (32 * (s // 4))).to(tl.int32) >> (8 * (s % 4))) & 255
    s0 = ((va >> (32 * (s // 4))).to(tl.int32) >> (7 * (s % 4))) & 127
    s1 = ((vb >> (32 * (s // 4))).to(tl.int32) >> (7 * (s % 4))) & 127
    d0, d1 = _mma_dots(i0, i1, s0, s1, xl, xh, tab64, ksm, PTX, LDS, SIGN_MATH)
    acc0 = _mad_wide(d0, ((sa >> (4 * s)) & 15) * 2 + 1, acc0, PTX)
    return acc0, _mad_wide(d1, ((sb >> (4 * s)) & 15) * 2 + 1, acc1, PTX)


@triton.jit
def _qp_scales(v, tid, PTX: tl.constexpr):
    """A row's 8 sub-block scales as the nibbles of one int32 (nibble s: sub-block s), gathered from the
    quad: lane t holds sub-blocks 2 t / 2 t + 1 in the top nibbles of its sign word's halves."""
    lo = (v.to(tl.int32) >> 28) & 15
    hi = ((v >> 32).to(tl.int32) >> 28) & 15
    return _quad_or((lo | (hi << 4)) << (8 * tid), PTX)


@triton.jit
def _gate_up_mma_kernel(
    xw_ptr, dx_ptr, gq, gs, gd, uq, us, ud, tab64, ksm, order_ptr, eid_ptr, offs_ptr, out_ptr, n_slots,
    n_pairs, E, F, K, xplane, clamp, WARPS: tl.constexpr, CLAMP: tl.constexpr, PTX: tl.constexpr,
    LDS: tl.constexpr, LD128: tl.constexpr = False, SIGN_MATH: tl.constexpr = 0, QP: tl.constexpr = False,
):  # fmt: skip
    """_gate_up_grouped_kernel's result on the int8 tensor cores: up to 4 pairs of one expert (sorted
    positions p ..), 16 rows a warp, two planes (xw [2, B, K/8] int64, xplane words apart; dx [B, K/256]);
    gq / uq grid bytes, gs / us sub-block words as int64 words [E F, K/32] -> mid rows out [P, F]. QP
    (GroupedConfig.quad_pack): gq / uq the quad layout's words [E F, K/32] (quad_pack), gs / us unused."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    NT: tl.constexpr = 32 * WARPS
    p = tl.program_id(1)
    e, cnt, live = _run_chunk(eid_ptr, offs_ptr, p, E, 4)
    if LDS:
        if live:  # only programs that decode fill the shared tables (~30 % lead no chunk at B = 32)
            _lds_fill(tab64, ksm, PTX, LDS)
    nb = K // 256
    gid, tid, n, r0, r1 = _mma_lanes(F, nb, NT)
    eb = e * F * nb  # the expert's first super-block: uniform base pointers
    QW: tl.constexpr = 8 if QP else 4  # gq / uq words a super-block (the quad layout: 8)
    gq, gs, uq, us = gq + eb * QW, gs + eb * 4, uq + eb * QW, us + eb * 4
    gd, ud = gd + eb, ud + eb
    bx = _pair_index(order_ptr, p, gid // 2, n_pairs) // n_slots  # the B column's row of x
    # its plane's group-tid word of sub-block 0 (QP: x in the quad order, a lane's 8 words of a super-block
    # adjacent: quad_x)
    xo = xw_ptr + (gid % 2) * xplane + bx * (K // 8) + (tid * 8 if QP else tid)
    pc = _pair_index(order_ptr, p, tid, n_pairs)  # the lane's C pair
    dxo = dx_ptr + (pc // n_slots) * nb
    g0 = tl.zeros([NT], dtype=tl.float32)
    g1, u0, u1 = g0, g0, g0
    for kt in range(0, tl.where(live, nb, 0)):
        ga = tl.zeros([NT], dtype=tl.int64)  # this super-block's exact sums (rows gid, gid + 8)
        gb, ua, ub = ga, ga, ga
        w0 = (r0 + kt) * 4
        w1 = (r1 + kt) * 4
        if QP:
            ga, gb, ua, ub = _qp_step(
                gq, uq, w0, w1, tid, xo + kt * 32, ga, gb, ua, ub, tab64, ksm, PTX, LDS, LD128, SIGN_MATH
            )
        else:
            ga, gb, ua, ub = _mma_step(
                gq, gs, uq, us, w0, w1, tid, xo + kt * 32, ga, gb, ua, ub, tab64, ksm, PTX, LDS, LD128,
                SIGN_MATH,
            )  # fmt: skip
        dx = tl.load(dxo + kt)
        g0 += (tl.load(gd + r0 + kt).to(tl.float32) * dx) * ga.to(tl.float32)
        g1 += (tl.load(gd + r1 + kt).to(tl.float32) * dx) * gb.to(tl.float32)
        u0 += (tl.load(ud + r0 + kt).to(tl.float32) * dx) * ua.to(tl.float32)
        u1 += (tl.load(ud + r1 + kt).to(tl.float32) * dx) * ub.to(tl.float32)
    ok = tid < cnt
    _swiglu_store(out_ptr, pc, g0, u0, n, F, clamp, ok, CLAMP)
    _swiglu_store(out_ptr, pc, g1, u1, n + 8, F, clamp, ok, CLAMP)


@triton.jit
def _swiglu_store(out_ptr, pidx, g, u, n, F, clamp, ok, CLAMP: tl.constexpr):
    """mid[pidx, n] = clamped SwiGLU of the gate / up sums g, u times 1/8 (the scale's 2 ls + 1 is 8 times
    IQ2_XXS's), where ok: the store of both gate/up kernels."""
    g = g * 0.125
    u = u * 0.125
    if CLAMP:
        g = tl.minimum(g, clamp)  # the gate has no lower bound (§5.5)
        u = tl.minimum(tl.maximum(u, -clamp), clamp)
    tl.store(out_ptr + pidx * F + n, g / (1.0 + tl.exp(-g)) * u, mask=(n < F) & ok)


@triton.jit
def _down_mma_kernel(
    xw_ptr, dx_ptr, qw, sc, dm, order_ptr, eid_ptr, offs_ptr, rw_ptr, out_ptr, n_pairs, E, D, F, xplane,
    WARPS: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """The Q2_K down projection on the int8 tensor cores (GroupedConfig.mma_dn): up to 4 pairs of one expert,
    16 rows a warp, two planes (xw [2, P, F/4] int32 words, xplane apart; dx [P, F/256]) -> out [P, D]
    (flat pair index) = weights[pair] * Wd[e] @ mid[pair]; qw [E D, F/16] quant words, sc [E D, F/64] scale
    words (4 group bytes each), dm [E D, F/256] (d, dmin) f16 pairs as int32.

    Lane tid owns quant words 4 tid .. 4 tid + 3 of a super-block (one 16-byte load; the quad reads a row's
    64 bytes whole): bytes l = 16 odd .. 16 odd + 15 of half h (h = tid / 2, odd = tid % 2), which at every
    shift t are the 16 elements 128 h + 32 t + l of one group g = 8 h + 2 t + odd. So one k32 step = (shift
    t, j): the lane's 8 elements l = 16 odd + 8 j .. + 7 (A words 4 tid + 2 j, + 1; its B words the x words
    of the same elements, one 8-byte load), all of one group: its scale byte sc <= 15 times the 2-bit quants
    q <= 3 fits a signed byte, so A = sc q and the integer sum I = sum sc q v of the super-block accumulates
    inside the mma; a second mma with A = the group's min m in every byte gives M = sum m sum_16 v. Then
    y += d dx I - dmin dx M per super-block (ref.q8k_matvec_row; |I| <= 256 * 45 * 32385 < 2^31).
    Session 26's form (a k step = one shift of one half, quant and x words loaded 4 bytes at a time in the
    fragment order) spent ~35 loads a lane and super-block; this one 15."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    NT: tl.constexpr = 32 * WARPS
    p = tl.program_id(1)
    e, cnt, live = _run_chunk(eid_ptr, offs_ptr, p, E, 4)
    nb = F // 256
    gid, tid, n, r0, r1 = _mma_lanes(D, nb, NT)
    eb = e * D * nb  # the expert's first super-block: uniform base pointers
    qw, sc, dm = qw + eb * 16, sc + eb * 4, dm + eb
    h, odd = tid // 2, tid % 2
    pb = _pair_index(order_ptr, p, gid // 2, n_pairs)  # the B column's pair: plane gid % 2
    xo = xw_ptr + (gid % 2) * xplane + pb * (F // 4) + 32 * h + 4 * odd  # x word of element 128 h + 16 odd
    pc = _pair_index(order_ptr, p, tid, n_pairs)  # the lane's C pair
    y0 = tl.zeros([NT], dtype=tl.float32)
    y1 = y0
    zero = tl.zeros([NT], dtype=tl.int32)
    for kt in range(0, tl.where(live, nb, 0)):
        qa = _ld4(qw + (r0 + kt) * 16 + 4 * tid, PTX)  # row gid's quant words 4 tid ..
        qb = _ld4(qw + (r1 + kt) * 16 + 4 * tid, PTX)  # row gid + 8's
        sa = _ld4(sc + (r0 + kt) * 4, PTX)  # the 16 scale bytes of each row
        sb = _ld4(sc + (r1 + kt) * 4, PTX)
        i0, i1, i2, i3 = zero, zero, zero, zero  # I of (row gid, row gid + 8) x (plane 1, plane 2)
        m0, m1, m2, m3 = zero, zero, zero, zero  # M likewise
        for t in tl.static_range(4):
            sca, mra = _q2k_group(sa, h, odd, t, zero, PTX)
            scb, mrb = _q2k_group(sb, h, odd, t, zero, PTX)
            for j in tl.static_range(2):
                b0, b1 = _ld2w(xo + kt * 64 + 8 * t + 2 * j, PTX)
                a0 = ((qa[2 * j] >> (2 * t)) & 0x03030303) * sca  # <= 45 a byte: no carries
                a2 = ((qa[2 * j + 1] >> (2 * t)) & 0x03030303) * sca
                a1 = ((qb[2 * j] >> (2 * t)) & 0x03030303) * scb
                a3 = ((qb[2 * j + 1] >> (2 * t)) & 0x03030303) * scb
                i0, i1, i2, i3 = _mma_i8(a0, a1, a2, a3, b0, b1, i0, i1, i2, i3, PTX)
                m0, m1, m2, m3 = _mma_i8(mra, mrb, mra, mrb, b0, b1, m0, m1, m2, m3, PTX)
        dx = tl.load(dx_ptr + pc * nb + kt)
        y0 = _q2k_mma_scale(y0, i0 * 254 + i1, m0 * 254 + m1, tl.load(dm + r0 + kt), dx)
        y1 = _q2k_mma_scale(y1, i2 * 254 + i3, m2 * 254 + m3, tl.load(dm + r1 + kt), dx)
    rw = tl.load(rw_ptr + pc).to(tl.float32)
    ok = tid < cnt
    tl.store(out_ptr + pc * D + n, y0 * rw, mask=(n < D) & ok)
    tl.store(out_ptr + pc * D + n + 8, y1 * rw, mask=(n + 8 < D) & ok)


@triton.jit
def _q2k_group(s4, h, odd, t: tl.constexpr, zero, PTX: tl.constexpr):
    """(scale sc, min m in all four bytes) [NT] int32 of the lane's group g = 8 h + 2 t + odd at shift t,
    from a row's 4 scale words s4 (byte g = scale | min << 4 in word g / 4 = 2 h + t / 2)."""
    w = tl.where(h == 0, s4[t // 2], s4[2 + t // 2])
    b = _prmt(w, zero, zero + (0x4440 + 2 * (t % 2)) + odd, PTX)  # byte 2 (t % 2) + odd of the word alone
    return b & 15, (b >> 4) * 0x01010101


@triton.jit
def _ld4(ptr, PTX: tl.constexpr):
    """(The int32 words at ptr .. ptr + 3): one 16-byte load (PTX; ptr 16-byte aligned), else four."""
    if PTX:
        w = tl.inline_asm_elementwise(
            "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        w = tl.load(ptr), tl.load(ptr + 1), tl.load(ptr + 2), tl.load(ptr + 3)
    return w


@triton.jit
def _ld2w(ptr, PTX: tl.constexpr):
    """(The int32 words at ptr, ptr + 1): one 8-byte load (PTX; ptr 8-byte aligned), else two."""
    if PTX:
        w = tl.inline_asm_elementwise(
            "ld.global.nc.v2.b32 {$0, $1}, [$2];", "=r,=r,l", [ptr], dtype=(tl.int32, tl.int32),
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        w = tl.load(ptr), tl.load(ptr + 1)
    return w


@triton.jit
def _q2k_mma_scale(y, ii, mm, dmw, dx):
    """y + d dx I - dmin dx M for one row (dmw: its (d, dmin) f16 pair as an int32 word)."""
    d = (dmw & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((dmw >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return y + (d * dx) * ii.to(tl.float32) - (dmin * dx) * mm.to(tl.float32)


@triton.jit
def _q2k_shift(q0, q1, q2, q3, s8, xo, xso, xplane, ii, mm, TERMS: tl.constexpr, DP4A: tl.constexpr):
    """One pair's integer sums of one 2-bit shift of a Q2_K super-block: (ii + sc sum_16 q v, mm + m sum_16 v)
    [BN, 4c] for the shifted quant words q0..q3 [BN, 4c], scale bytes s8 [BN, 4c], the pair's x words at xo
    ([1, 4c, 4jj]) and its precomputed group sums of v at xso ([1, 4c])."""
    v = _dot16(q0, q1, q2, q3, xo, DP4A)
    if TERMS == 2:  # the same quant words on the residual plane: v = 254 q1 + q2
        v = v * 254 + _dot16(q0, q1, q2, q3, xo + xplane, DP4A)
    return ii + (s8 & 15) * v, mm + (s8 >> 4) * tl.load(xso)


@triton.jit
def _dn_store(out_ptr, rw_ptr, pidx, acc, n, D, ok):
    """Down output row pidx [D] = weights[pidx] * the row sums of the [BN, 4] partials (where ok)."""
    rw = tl.load(rw_ptr + pidx).to(tl.float32)
    tl.store(out_ptr + pidx * D + n, tl.sum(acc, axis=1) * rw, mask=(n < D) & ok)


@triton.jit
def _down_grouped_kernel(
    xw_ptr,
    xs_ptr,
    dx_ptr,
    qw,
    sc,
    dm,
    order_ptr,
    eid_ptr,
    offs_ptr,
    rw_ptr,
    out_ptr,
    n_pairs,
    E,
    D,
    F,
    xplane,
    BN: tl.constexpr,
    PT: tl.constexpr,
    TERMS: tl.constexpr,
    DP4A: tl.constexpr,
):
    """Q2_K down projection of up to PT pairs of one expert on their quantized mid rows (xw [TERMS, P, F/4]
    int32 words, planes xplane words apart; xs [P, F/16] int32 sums of the 16 v of each group; dx [P, F/256])
    -> out [P, D] (flat pair index) = weights[pair] * Wd[e] @ mid[pair]; zeros for the sentinel expert.

    Quant word 4c + jj of a super-block (c = 16-byte group: half c // 2, byte group c % 2) shifted by 2t holds
    elements 128 (c // 2) + 32 t + 16 (c % 2) + 4 jj + 0..3: group 8 (c // 2) + 2 t + c % 2 of 16 elements,
    whose scale byte has the same index (moe._q2k_q8k_down_kernel). Per pair and super-block the integer sums
    I = sum sc sum q v and M = sum m sum v are exact (|.| <= 4 * 15 * 16 * 3 * 32385 < 2^31) and scaled once:
    y += d dx I - dmin dx M, as ref.q8k_matvec_row. Everything is [BN, 4c]: no per-pair reductions."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    pid_n = tl.program_id(0)
    p = tl.program_id(1)
    e, cnt, live = _run_chunk(eid_ptr, offs_ptr, p, E, PT)
    n = pid_n * BN + tl.arange(0, BN)
    wrow = e * D + tl.minimum(n, D - 1)
    nb = F // 256
    c = tl.arange(0, 4)
    jj = tl.arange(0, 4)
    cx = tl.multiple_of((c // 2) * 32 + (c % 2) * 4, 4)  # 4 contiguous x words per c: one 16-byte load
    xoff = (cx[:, None] + jj[None, :])[None, :, :]  # [1, 4c, 4jj] x word at t = 0
    xr = tl.multiple_of(F // 4, 64)  # x words per pair row
    soff = (c // 2) * 8 + c % 2  # [4c] scale byte / group at t = 0 (+ 2 t)
    p0 = _pair_index(order_ptr, p, 0, n_pairs)
    p1 = _pair_index(order_ptr, p, 1, n_pairs)
    p2 = _pair_index(order_ptr, p, 2, n_pairs)
    p3 = _pair_index(order_ptr, p, 3, n_pairs)
    x0 = xw_ptr + p0 * xr + xoff  # pair i's x words [1, 4c, 4jj] and group sums [1, 4c] at kt = t = 0
    x1 = xw_ptr + p1 * xr + xoff
    x2 = xw_ptr + p2 * xr + xoff
    x3 = xw_ptr + p3 * xr + xoff
    z0 = xs_ptr + p0 * (F // 16) + soff[None, :]
    z1 = xs_ptr + p1 * (F // 16) + soff[None, :]
    z2 = xs_ptr + p2 * (F // 16) + soff[None, :]
    z3 = xs_ptr + p3 * (F // 16) + soff[None, :]
    a0 = tl.zeros([BN, 4], dtype=tl.float32)  # per (row, 16-byte group) partials of pair i
    a1 = tl.zeros([BN, 4], dtype=tl.float32)
    a2 = tl.zeros([BN, 4], dtype=tl.float32)
    a3 = tl.zeros([BN, 4], dtype=tl.float32)
    for kt in range(0, tl.where(live, nb, 0)):
        # quant words and scale bytes [BN, 4c] in one layout (moe._q2k_block; sm_90 bn 64, 2 pairs: 491 ->
        # 468 loop instructions, 80 -> 72 registers, no barriers, against the stride-2 scale-byte load)
        w0, w1, w2, w3, s0, s1, s2, s3 = _q2k_block(qw, sc, wrow, kt, nb, BN)
        d, dmin = _q2k_scales(dm, wrow, kt, nb)
        kx = kt * 64  # x words / group sums of super-block kt
        kz = kt * 16
        i0 = tl.zeros([BN, 4], dtype=tl.int32)
        m0 = tl.zeros([BN, 4], dtype=tl.int32)
        i1, m1, i2, m2, i3, m3 = i0, m0, i0, m0, i0, m0
        for t in tl.static_range(4):
            s8 = _pick(t, s0, s1, s2, s3)
            q0 = (w0 >> (2 * t)) & 0x03030303
            q1 = (w1 >> (2 * t)) & 0x03030303
            q2 = (w2 >> (2 * t)) & 0x03030303
            q3 = (w3 >> (2 * t)) & 0x03030303
            ox, oz = kx + 8 * t, kz + 2 * t
            i0, m0 = _q2k_shift(q0, q1, q2, q3, s8, x0 + ox, z0 + oz, xplane, i0, m0, TERMS, DP4A)
            if PT > 1:
                if cnt > 1:
                    i1, m1 = _q2k_shift(q0, q1, q2, q3, s8, x1 + ox, z1 + oz, xplane, i1, m1, TERMS, DP4A)
            if PT > 2:
                if cnt > 2:
                    i2, m2 = _q2k_shift(q0, q1, q2, q3, s8, x2 + ox, z2 + oz, xplane, i2, m2, TERMS, DP4A)
            if PT > 3:
                if cnt > 3:
                    i3, m3 = _q2k_shift(q0, q1, q2, q3, s8, x3 + ox, z3 + oz, xplane, i3, m3, TERMS, DP4A)
        a0 = _q2k_scale(a0, i0, m0, d, dmin, dx_ptr, p0, kt, nb)
        if PT > 1:
            a1 = _q2k_scale(a1, i1, m1, d, dmin, dx_ptr, p1, kt, nb)
        if PT > 2:
            a2 = _q2k_scale(a2, i2, m2, d, dmin, dx_ptr, p2, kt, nb)
        if PT > 3:
            a3 = _q2k_scale(a3, i3, m3, d, dmin, dx_ptr, p3, kt, nb)
    _dn_store(out_ptr, rw_ptr, p0, a0, n, D, cnt > 0)
    if PT > 1:
        _dn_store(out_ptr, rw_ptr, p1, a1, n, D, cnt > 1)
    if PT > 2:
        _dn_store(out_ptr, rw_ptr, p2, a2, n, D, cnt > 2)
    if PT > 3:
        _dn_store(out_ptr, rw_ptr, p3, a3, n, D, cnt > 3)


@triton.jit
def _q2k_scale(acc, ii, mm, d, dmin, dx_ptr, pidx, kt, nb):
    """acc + d dx I - dmin dx M for one pair's integer sums of super-block kt (unused pairs: I = M = 0)."""
    dx = tl.load(dx_ptr + pidx * nb + kt)
    return acc + (d * dx) * ii.to(tl.float32) - (dmin * dx) * mm.to(tl.float32)


# ---------------------------------------------------------------------------------------------------------
# Host side


SMALL_ROWS = 16  # below this many rows of x the pair down kernel takes GroupedConfig.bn_pair_dn_small


@dataclass(frozen=True)
class GroupedConfig:
    """Launch shape of the grouped kernels: output rows per program (gate/up, down), pairs per program
    (1..MAX_PT; gate/up, down), warps; activation planes and dp4a as moe.MoeConfig."""

    bn_gu: int = 16
    bn_dn: int = 128
    pairs: int = 4
    pairs_dn: int = 2
    warps: int = 4
    terms: int = GATE_UP.terms
    dp4a: bool = True
    sign_math: bool = True  # gate/up: sign masks / nibbles computed, not gathered (moe.MoeConfig.sign_math)
    grid16: bool = False  # gate/up: the grid as 16-bit codes (as moe.MoeConfig.grid16; with prmt too)
    prmt: bool = False  # gate/up: nibble tables and byte permutes (as moe.MoeConfig.prmt)
    chain: bool = False  # gate/up: one dp4a chain per sub-block and plane (_iq2_pair)
    pos_reg: bool = False  # gate/up, prmt: the permutes' positive word loaded, not a constant (_prmt_words)
    pair_down: bool = False  # down by the pair kernel (moe.moe_down_slots at moe.DOWN's tile), not grouped
    sorted_down: bool = False  # pair_down: the pairs taken in expert order (ExpertRuns.order: L2 reuse)
    bn_pair_dn: int = 64  # pair_down: output rows per program of the pair kernel (moe.DOWN's is for B = 1)
    # pair_down: its rows per program below SMALL_ROWS rows of x (0: bn_pair_dn). Session 28 (H100, 30-layer
    # steps with the grouped experts from 2 rows): 64 there x1.010 / x1.014 / x1.012 at B = 2 / 4 / 8 over
    # 128. Session 30's batched-vs-alone check with it (and q8_rows's f32t scales) on, B = 1 / 3 / 8 / 16:
    # 0 / 4.39e-4 / 1.83e-2 (one near tie) / 1.84e-2 of the logit std, all ok: 64 in CONFIG (env
    # DS4_MOE_GROUPED_BN_PAIR_DN_SMALL=0 gives 128 back)
    bn_pair_dn_small: int = 0
    smem: int = 0  # gate/up, prmt: the tables looked up by tl.gather (shared memory, _prmt_smem): 1 two
    # lookups per group, 2 one joined lookup in a [512] table (half the table stores and barriers)
    lds: bool = False  # gate/up, prmt: the nibble tables from a static shared copy (moe._lds_fill, PTX)
    # gate/up, lds: copies of the shared tables, lane l reading copy l % lds_rep (moe._lds_fill_rep): 1, 8,
    # 16; 32: the grid nibbles in 32 copies (no bank conflicts), the sign nibbles in 16; 64: both in 32
    # copies (48 KB: no lookup conflicts at all; session 27's counters: half the wavefronts were conflicts)
    lds_rep: int = 1
    # gate/up: a register cap for ptxas (Triton's maxnreg; 0: none). sm_90 builds: lds_rep 16 at 64 registers
    # (80 uncapped: 6 programs an SM of the 8 that 25 KB of shared memory allows) without spills, k loop
    # 212 / 287 / 431 instructions at 1 / 2 / 4 pairs (209 / 265 / 434); lds_rep 32 at 64 (116) likewise
    maxnreg: int = 0
    # gate/up: super-block kt + 1's bytes loaded (kept raw, moe._iq2_raw) before kt is decoded, so a program
    # has two blocks' loads in flight instead of waiting on each (session 25, H100: no gain, off; see CONFIG)
    prefetch: bool = False
    # down by the pair kernel (pair_down): its MoeConfig.prefetch (moe._q2k_q8k_down_kernel)
    prefetch_dn: bool = False
    # gate/up on the int8 tensor cores (_gate_up_mma_kernel: 16 rows a warp, `warps` warps, up to 4 pairs a
    # program; two planes, the nibble tables with lds / lds_rep as set, sign nibbles gathered). Session 26:
    # slower; session 27: with mma_ld128 faster; session 28: on in CONFIG (see the kernel's comment)
    mma: bool = False
    # down on the int8 tensor cores (_down_mma_kernel: 16 rows a warp, `warps` warps, up to 4 pairs a program;
    # two planes), instead of the pair kernel (pair_down) or the grouped dp4a one. Session 26's form: slower
    # (L1/TEX-bound, 98.6 %); session 27 rebuilt it around 16-byte loads (15 loads a lane and super-block
    # instead of 35): correct (GPU test), but with the mma gate/up whole B = 16 / 32 steps x0.992 / x1.054
    # against that gate/up alone's x1.032 / x1.080: slower than the pair kernel still, off
    mma_dn: bool = False
    # gate/up, prmt: the sign nibbles computed by one byte permute (moe._sign_sel, ~8 ALU ops a group) instead
    # of looked up in the shared table: half the lookups, which bound the L1/TEX unit (session 27); untimed
    sign_prmt: bool = False
    # mma: the weight words two at a time (16-byte loads). Session 27 (H100, per layer): B = 32 419.5 vs 561.4
    # us with 8-byte loads and 501.3 for the dp4a kernel; whole steps x1.080 (see _gate_up_mma_kernel); on
    # in CONFIG since session 28
    mma_ld128: bool = False
    # mma: the weights in the quad layout (quad_pack; stacks packed with it first) and x alike (quad_x): lane
    # tid of a quad loads the 16 bytes of its own group (8 grid bytes, 8 sign indices, 2 scales) instead of
    # the quad loading the row's 64 bytes four times, and its 8 x words 16 bytes at a time (sm_90 k loop: 24
    # loads a lane and super-block -> 8, plus 8 shuffles for the scales; 152 -> 133 registers). Needs 16-byte
    # loads. Built in session 28 (aimed at the L1/TEX unit that bounds the kernel). True: the split stacks'
    # second copy in this layout (quad_pack_stack, for timing both); stacks in the quad layout alone
    # (packing.to_quad, QUAD_STACKS) are read this way whatever this says.
    quad_pack: bool = False
    # ptxas's register cap when the kernel reads the quad layout and maxnreg is 0: 128 gives 4 programs an
    # SM instead of 3 (sm_90: 133 registers uncapped). H100, session 31 (bench_moe_grouped.py, per layer):
    # B = 32 326.1 vs 353.9 us, B = 16 209.0 vs 223.8, B = 8 121.0 vs 129.6.
    qp_maxnreg: int = 128

    @property
    def sign_mode(self) -> int:
        """The kernels' SIGN_MATH: 0 the sign nibbles looked up, 1 computed by ALU ops, 2 by a permute."""
        return 2 if self.sign_prmt else int(self.sign_math)

    def __post_init__(self) -> None:
        for name in ("pairs", "pairs_dn"):
            if not 1 <= getattr(self, name) <= MAX_PT:
                raise ValueError(f"GroupedConfig.{name} must be in 1..{MAX_PT}, got {getattr(self, name)}")
        if self.terms not in (1, 2):
            raise ValueError(f"GroupedConfig.terms must be 1 or 2, got {self.terms}")
        if self.smem not in (0, 1, 2):
            raise ValueError(f"GroupedConfig.smem must be 0, 1 or 2, got {self.smem}")
        if self.smem and not (self.prmt and not self.grid16 and not self.sign_math):
            raise ValueError("GroupedConfig: smem needs the nibble tables (prmt, no grid16, no sign_math)")
        if self.lds and not (self.prmt and not self.grid16 and not self.smem):
            raise ValueError("GroupedConfig: lds needs the nibble tables (prmt; no grid16, smem)")
        if self.maxnreg < 0:
            raise ValueError(f"GroupedConfig.maxnreg must be >= 0 (0: no cap), got {self.maxnreg}")
        if self.lds_rep not in (1, 8, 16, 32, 64) or (self.lds_rep > 1 and not self.lds):
            raise ValueError(
                f"GroupedConfig.lds_rep must be 1, 8, 16, 32 or 64 (> 1 with lds), got {self.lds_rep}"
            )
        if self.lds_rep == 64 and not self.mma:  # the dp4a kernel's own shared memory on top of 48 KB
            raise ValueError("GroupedConfig: lds_rep 64 needs mma (48 KB static shared: a dp4a launch fails)")
        if self.grid16 and self.prmt and self.pos_reg:
            raise ValueError("GroupedConfig: pos_reg needs the nibble table (prmt without grid16)")
        if self.sign_prmt and not (self.prmt and not self.grid16 and not self.sign_math and not self.smem):
            raise ValueError(
                "GroupedConfig: sign_prmt needs the nibble tables (prmt; no grid16, sign_math, smem)"
            )
        if self.quad_pack and not (self.mma and self.mma_ld128):
            raise ValueError("GroupedConfig: quad_pack needs mma with 16-byte loads (mma_ld128)")
        if self.mma_dn and self.terms != 2:
            raise ValueError("GroupedConfig: mma_dn needs two planes (terms 2)")
        if self.mma and not (self.terms == 2 and self.prmt and not self.grid16 and not self.smem):
            raise ValueError(
                "GroupedConfig: mma needs two planes and the nibble tables (prmt; no grid16, smem)"
            )


# H200 (tools/gpu/bench_moe_grouped.py, session 8, per layer): gate/up bn 16, 4 pairs per program, sign
# masks computed (B = 16 534.7 -> 431.2 us, B = 32 902.9 -> 736.6 us; the pair kernel: 487.0 / 959.3); down
# bn 64, 2 pairs per program (B = 32 423.9 us at bn 32 / 4 pairs -> 414.9; pair kernel 494.8). The pair
# kernels' decode variants (session 7): prmt gate/up B = 32 736.7 -> 724.6 us, a whole B = 32 step
# (tools/gpu/batch_check.py, 8k) 71.37 -> 70.93 ms: on (bit-identical); grid16 763.2 us: off. prmt with
# computed sign nibbles (sign_math). Session 9 (barrier-free loads; same bench, per layer): prmt with
# computed sign nibbles B = 8 248.7 -> 225.9 us, B = 32 726.2 -> 665.7 us: on; down bn 128 / 2 pairs B = 8
# 113.2 -> 104.2 us, B = 32 343.7 -> 314.0 us (the pair kernel: 101.1 / 348.0): bn 128. chain / pos_reg
# (session 8, sm_90 k loop of gate/up bn 16, 4 pairs, prmt: 454 instructions / 64 registers; chain 410 / 72;
# both 389 / 96): session 9, B = 32 727.1 / 769.4 / 789.0 us against 726.2: no gain, off. Env
# DS4_MOE_GROUPED_PRMT=0, DS4_MOE_GROUPED_SIGN_MATH=0, DS4_MOE_GROUPED_GRID16=1 (with prmt on: prmt16),
# DS4_MOE_GROUPED_CHAIN=1, DS4_MOE_GROUPED_POS_REG=1.
# Session 14 (coalesced weight loads, moe._iq2_load / _q2k_block; same bench, per layer): gate/up with the
# sign nibbles gathered beats computing them, B = 8 / 16 / 32 160.5 / 291.7 / 521.9 us vs 174.2 / 313.3 /
# 540.9: sign_math off (env DS4_MOE_GROUPED_SIGN_MATH=1: on). The pair kernel's down (moe.DOWN, 56
# registers) beats the grouped one (bn 128 / 2 pairs, 153 registers, 18 % occupancy) at every B: 57.4 /
# 103.2 / 193.1 vs 79.5 / 134.0 / 232.5 us: pair_down on (env DS4_MOE_GROUPED_PAIR_DOWN=0: off).
# Session 16: the pair down kernel taking the pairs in expert order (sorted_down: a repeated expert's second
# pass reads its weights from L2; bit-identical), whole step (batch_check.py, 8k) B = 32 50.51 -> 49.86 ms
# (x1.013), B = 16 30.99 -> 31.12 (x0.996, within the spread): on (env DS4_MOE_GROUPED_SORTED_DOWN=0: off).
# Its tile (bn_pair_dn) at 128 rows instead of moe.DOWN's 64 (B = 1's): B = 16 / 32 / 64 steps x1.002 /
# x1.011 / x1.019 (x1.005 / x1.018 in a second call); bn 256, bn 128 at 8 warps: <= x1.003; bn 32: x0.91-0.93.
# The IQ2_XXS nibble tables in static shared memory (lds, moe._lds_fill; bit-identical): per layer B = 32
# 523.0 vs 524.3 us, step 50.51 vs 50.37 ms: off (env DS4_MOE_GROUPED_LDS=1). The k loop is issue-bound:
# ~454 instructions a thread per super-block step at 4 pairs (128 dp4a; sm_90, the launch's divisibility).
# Session 24 (sm_90 k loop at 1 / 2 / 4 pairs, tools/gpu/bench_moe_grouped.py's variants): the engine's
# 229 / 304 / 454; chain + pos_reg 201 / 269 / 376 (72-92 registers); lds + pos_reg (the sign table's offset
# now the shared load's immediate) 195 / 276 / 400; all three 183 / 246 / 362, and at bn 32 (two rows a
# thread) 319 / 423 / 616 for twice the weights. Env DS4_MOE_GROUPED_BN_GU / _PAIRS: the tile.
# Session 25 (H100 80GB HBM3; per layer: bench_moe_grouped.py --latest; steps: batch_check.py --layers 30,
# 8k ctx, 2 x 16 steps): session 24's variants all slower at B = 32 (per layer 544-562 vs 521 us; steps
# x0.964 / x0.977), and so is super-block kt + 1 loaded ahead (prefetch: 528 vs 520 us, step x1.000; the
# pair down kernel's prefetch 532 vs 193 us): neither issue nor loads in flight bound the k loop, the table
# lookups did (L1 gathers; one shared copy: bank conflicts). The shared tables in 16 copies (lds_rep 16,
# lane l reading copy l % 16: 2 wavefronts a warp's lookup where one copy takes ~3.5; 80 registers, 25 KB
# shared): per layer B = 8 / 16 / 32 151.6 / 281.2 / 509.1 vs 161.8 / 292.6 / 520.8 us, steps B = 16 / 32
# 20.52 / 33.37 vs 20.94 / 33.82 ms (x1.021 / x1.013; 3 rounds with the L1 gathers as the variant: x1.009 /
# x1.011): on (env DS4_MOE_GROUPED_LDS=0: the L1 gathers; DS4_MOE_GROUPED_LDS_REP=1: one shared copy). 8
# copies (4-way conflicts remain): B = 32 551.6 us, steps x0.981 / x0.976; 32 copies of the grid nibbles
# (116 registers): 568.9 us.
# Session 28: the mma gate/up with 16-byte loads and both tables in 32 copies (mma, mma_ld128, lds_rep 64;
# 48 KB static shared, which only the mma kernel can launch with) on, after session 27's check passed with
# it (see _gate_up_mma_kernel). Env DS4_MOE_GROUPED_MMA=0: the dp4a kernel at 16 copies;
# DS4_MOE_GROUPED_MMA_LD128=0: 8-byte loads; DS4_MOE_GROUPED_LDS_REP: the copies.
_PRMT = os.environ.get("DS4_MOE_GROUPED_PRMT", "1") == "1"
_LDS = _PRMT and os.environ.get("DS4_MOE_GROUPED_LDS", "1") == "1"
_MMA = _PRMT and os.environ.get("DS4_MOE_GROUPED_MMA", "1") == "1"
CONFIG = GroupedConfig(
    bn_gu=int(os.environ.get("DS4_MOE_GROUPED_BN_GU", "16")),
    pairs=int(os.environ.get("DS4_MOE_GROUPED_PAIRS", "4")),
    sign_math=os.environ.get("DS4_MOE_GROUPED_SIGN_MATH", "0") == "1",
    pair_down=os.environ.get("DS4_MOE_GROUPED_PAIR_DOWN", "1") == "1",
    sorted_down=os.environ.get("DS4_MOE_GROUPED_SORTED_DOWN", "1") == "1",
    bn_pair_dn=int(os.environ.get("DS4_MOE_GROUPED_BN_PAIR_DN", "128")),
    bn_pair_dn_small=int(os.environ.get("DS4_MOE_GROUPED_BN_PAIR_DN_SMALL", "64")),  # see the field
    grid16=os.environ.get("DS4_MOE_GROUPED_GRID16", "0") == "1",
    prmt=_PRMT,
    chain=os.environ.get("DS4_MOE_GROUPED_CHAIN", "0") == "1",
    pos_reg=os.environ.get("DS4_MOE_GROUPED_POS_REG", "0") == "1",
    smem=int(os.environ.get("DS4_MOE_GROUPED_SMEM", "0")),
    lds=_LDS,
    lds_rep=int(os.environ.get("DS4_MOE_GROUPED_LDS_REP", "64" if _MMA else "16")) if _LDS else 1,
    prefetch=os.environ.get("DS4_MOE_GROUPED_PREFETCH", "0") == "1",
    prefetch_dn=os.environ.get("DS4_MOE_GROUPED_PREFETCH_DN", "0") == "1",
    mma=_MMA,
    mma_dn=os.environ.get("DS4_MOE_GROUPED_MMA_DN", "0") == "1",
    mma_ld128=os.environ.get("DS4_MOE_GROUPED_MMA_LD128", "1") == "1",
)

# The routed gate / up stacks in the quad layout alone (packing.to_quad: qp replaces qs + sg, no byte more),
# made by the model at load when on: the mma gate/up reads it (QP), and so do the batch-1 pair kernel
# (moe._iq2_q8k_qp, the same bits) and the prefill's dequantization and dot_rows (QT 116); the dp4a gate/up
# refuses it. H100, session 31, the stacks held in both layouts: per layer (bench_moe_grouped.py) B = 32
# gate/up 353.9 us vs 377.1 (326.1 at 128 registers), B = 16 223.8 vs 238.1 (209.0); 20-layer steps at 8k
# (batch_check.py "grouped qp", uncapped) B = 16 / 32 x1.069 / x1.080. Env DS4_MOE_QUAD=1: on.
QUAD_STACKS = os.environ.get("DS4_MOE_QUAD", "0") == "1"

# The dp4a gate/up as the engine ran it in sessions 25-27 (the tools' baseline for it: bench_moe_grouped,
# batch_check's "grouped dp4a" and the variants built on it).
DP4A_FIELDS = {"mma": False, "mma_ld128": False, "lds": True, "lds_rep": 16}


@dataclass(frozen=True)
class ExpertRuns:
    """The P = B k (row, slot) pairs sorted by expert, on the device (no host sync, static shapes).

    order [P] int32: flat pair index b k + j in expert order (stable); eid [P] int32: expert of each sorted
    pair (E: none, an id outside [0, E)); offsets [E + 2] int32: run of expert e = sorted positions
    offsets[e] .. offsets[e + 1] - 1 (e = E: the sentinel run)."""

    order: torch.Tensor
    eid: torch.Tensor
    offsets: torch.Tensor
    n_experts: int
    k: int


# Pairs up to which expert_runs counts in one program (_expert_runs_kernel) instead of torch's sort: a
# decode step's B k pairs. The sort ran as a segmented radix sort of ~27 us per layer at B = 32 (H200
# profile, session 13: 1.2 ms of a 62 ms step, plus the count / cumsum / gather launches around it). With
# the kernel (batch_check.py --variants "runs sort" = 0 here): B = 32 step 62.63 -> 60.92 ms, B = 16 40.26 ->
# 38.69 ms. 1,024 pairs (B = 170 at k = 6): the kernel's [P, 32] compare tile stays at 128 values a thread
# (8 warps). Env DS4_RUNS_KERNEL_MAX.
RUNS_KERNEL_MAX = int(os.environ.get("DS4_RUNS_KERNEL_MAX", "1024"))


@triton.jit
def _expert_runs_kernel(ids_ptr, order_ptr, eid_ptr, offs_ptr, P, E, PP: tl.constexpr, EE: tl.constexpr):
    """One program, ids [P] -> the ExpertRuns arrays by counting: pair i's sorted position is the number of
    pairs j with (e_j, j) < (e_i, i) (a stable sort), offsets[e] the number with e_j < e (e <= E + 1); ids
    outside [0, E) count as the sentinel E. O(P^2) compares in [PP, BJ] tiles (P <= RUNS_KERNEL_MAX).
    """
    pdl_wait()  # the router's ids (dispatch.PDL)
    BJ: tl.constexpr = 32
    i = tl.arange(0, PP)
    ev = tl.arange(0, EE)
    raw = tl.load(ids_ptr + i, mask=i < P, other=0).to(tl.int64)
    ei = tl.where((raw >= 0) & (raw < E), raw, E).to(tl.int32)  # [PP]
    rank = tl.zeros([PP], dtype=tl.int32)
    below = tl.zeros([EE], dtype=tl.int32)  # pairs with e_j < e
    for j0 in range(0, P, BJ):
        j = j0 + tl.arange(0, BJ)
        rj = tl.load(ids_ptr + j, mask=j < P, other=0).to(tl.int64)
        ej = tl.where(j < P, tl.where((rj >= 0) & (rj < E), rj, E), E + 2).to(tl.int32)  # [BJ]; past P: never
        first = (ej[None, :] < ei[:, None]) | ((ej[None, :] == ei[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum(first.to(tl.int32), axis=1)
        below += tl.sum((ej[None, :] < ev[:, None]).to(tl.int32), axis=1)
    tl.store(order_ptr + rank, i, mask=i < P)
    tl.store(eid_ptr + rank, ei, mask=i < P)
    tl.store(offs_ptr + ev, below, mask=ev < E + 2)


def _runs_by_sort(e: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch twin of _expert_runs_kernel (and its path beyond RUNS_KERNEL_MAX pairs): a stable sort.
    e [B, k] int64 with the sentinel already mapped -> (order, eid, offsets) int32."""
    order, offsets = group_by_expert(e, n_experts + 1)
    return order.int(), e.reshape(-1).index_select(0, order).int(), offsets


def expert_runs(ids: torch.Tensor, n_experts: int) -> ExpertRuns:
    """ids [B, k] (int32/int64 on any device) -> ExpertRuns; ids outside [0, n_experts) go to the sentinel."""
    if ids.ndim != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_runs: ids must be [B, k] int32/int64, got {tuple(ids.shape)} {ids.dtype}")
    P = ids.numel()
    if use_triton(ids) and 0 < P <= RUNS_KERNEL_MAX:
        flat = ids.reshape(-1).contiguous()
        order = torch.empty(P, dtype=torch.int32, device=ids.device)
        eid = torch.empty(P, dtype=torch.int32, device=ids.device)
        offsets = torch.empty(n_experts + 2, dtype=torch.int32, device=ids.device)
        pp, ee = triton.next_power_of_2(P), triton.next_power_of_2(n_experts + 2)
        _expert_runs_kernel[(1,)](
            flat, order, eid, offsets, P, n_experts, PP=pp, EE=ee, num_warps=8 if pp * 32 > 8192 else 4,
            launch_pdl=PDL,
        )  # fmt: skip
        return ExpertRuns(order, eid, offsets, n_experts, ids.shape[1])
    e = ids.long()
    e = torch.where((e >= 0) & (e < n_experts), e, n_experts)
    return ExpertRuns(*_runs_by_sort(e, n_experts), n_experts, ids.shape[1])


def supports(wg: PackedWeight, wu: PackedWeight, wd: PackedWeight) -> bool:
    """The formats these kernels take: IQ2_XXS gate/up, Q2_K down (the release expert types)."""
    iq2 = GGMLType.IQ2_XXS
    return wg.qtype == iq2 and wu.qtype == iq2 and wd.qtype == GGMLType.Q2_K


def _dp4a(t: torch.Tensor, cfg: GroupedConfig) -> bool:
    return dp4a_ok(t, cfg.dp4a)


def _check_ids(ids: torch.Tensor, B: int, device: torch.device, what: str) -> None:
    if ids.ndim != 2 or ids.shape[0] != B or ids.device != device:
        raise ValueError(f"{what}: ids must be [{B}, k] on {device}, got {tuple(ids.shape)} on {ids.device}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: ids must be int32/int64, got {ids.dtype}")


def _valid(ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids clamped into [0, E), mask of the real ones) for the torch twins."""
    ok = (ids >= 0) & (ids < E)
    return torch.where(ok, ids, 0).to(torch.int32), ok


def quad_pack(w: PackedWeight, rows: int = 1 << 16) -> torch.Tensor:
    """[R, nb * 8] int64: a split IQ2_XXS stack's quad layout (packing.quad_pack, `rows` rows at a time)."""
    return packing.quad_pack(w.data["qs"], w.data["sg"], rows)


def quad_x(xq: torch.Tensor) -> torch.Tensor:
    """Q8_K planes [2, B, K] int8 with each super-block's 8-byte words in the quad order (GroupedConfig.
    quad_pack: lane t's words of sub-blocks 0..7 adjacent, word 8 t + s = word 4 s + t of the plain order)."""
    P, B, K = xq.shape
    w = xq.view(torch.int64).view(P, B, K // 256, 8, 4)  # [plane, row, super-block, s, t]
    return w.transpose(3, 4).contiguous().view(torch.int8).view(P, B, K)


def quad_pack_stack(w: PackedWeight) -> None:
    """Adds w.data["qp"] = quad_pack(w) beside the split layout (GroupedConfig.quad_pack reads it; for
    timing the two layouts on one model: twice the stack's bytes). Outside any CUDA-graph capture."""
    if not w.quad:
        w.data["qp"] = quad_pack(w)


def moe_gate_up_grouped(
    x: torch.Tensor,
    wg: PackedWeight,
    wu: PackedWeight,
    ids: torch.Tensor,
    clamp: float,
    cfg: GroupedConfig | None = None,
    runs: ExpertRuns | None = None,
    xq: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [B, K], IQ2_XXS gate/up stacks [E, F, K], ids [B, k] -> mid [B, k, F] f32, unweighted clamped
    SwiGLU (clamp <= 0: none), = moe.moe_gate_up with MoeConfig(int8=True) up to f32 summation order; pairs
    with ids outside [0, E) get zeros. runs: expert_runs(ids, E) if already computed; xq: as moe_gate_up's."""
    check_weight(wg, 3, "moe_gate_up_grouped", x.device)
    check_weight(wu, 3, "moe_gate_up_grouped", x.device)
    if wg.qtype != GGMLType.IQ2_XXS or wu.qtype != GGMLType.IQ2_XXS or wg.shape != wu.shape:
        raise ValueError(
            f"moe_gate_up_grouped: gate/up must be equal IQ2_XXS stacks, got {wg.qtype.name}{wg.shape} "
            f"and {wu.qtype.name}{wu.shape}"
        )
    x = prep_x(x, wg.K, "moe_gate_up_grouped")
    _check_ids(ids, x.shape[0], x.device, "moe_gate_up_grouped")
    cfg = cfg or CONFIG
    E, F, K = wg.shape
    B, k = ids.shape
    if not use_triton(x):
        safe, ok = _valid(ids, E)
        return ref.moe_gate_up_q8k(x, wg, wu, safe, clamp, cfg.terms) * ok[..., None]
    out = torch.empty(B, k, F, dtype=torch.float32, device=x.device)
    if B * k == 0:
        return out
    runs = runs or expert_runs(ids, E)
    xq, dx = given_q8k(x, cfg.terms, xq)
    g, u = wg.data, wu.data
    if cfg.mma:
        _gate_up_mma(xq, dx, g, u, runs, out, clamp, cfg, qp=cfg.quad_pack or wg.quad)
        return out
    if wg.quad or wu.quad:
        raise ValueError("moe_gate_up_grouped: stacks in the quad layout are read by the mma kernel only")
    gsb, usb = g["sg"].view(torch.uint8), u["sg"].view(torch.uint8)  # sub-block words read as bytes
    _gate_up_grouped_kernel[(triton.cdiv(F, cfg.bn_gu), B * k)](
        xq.view(torch.int64), dx, g["qs"], gsb, g["d"], u["qs"], usb, u["d"],
        *iq2_tables(x.device, cfg.grid16, cfg.prmt),
        runs.order, runs.eid, runs.offsets, out, k, B * k, E, F, K, B * K // 8, float(clamp),
        BN=cfg.bn_gu, PT=cfg.pairs, CLAMP=clamp > 0, TERMS=cfg.terms, DP4A=_dp4a(x, cfg),
        SIGN_MATH=cfg.sign_mode, CHAIN=cfg.chain, POS_REG=cfg.pos_reg, SMEM=cfg.smem,
        LDS=cfg.lds_rep if cfg.lds else 0, PREFETCH=cfg.prefetch, num_warps=cfg.warps, launch_pdl=PDL,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and x.is_cuda else {}),  # the interpreter takes no cap
    )  # fmt: skip
    return out


def _gate_up_mma(
    xq, dx, g: dict, u: dict, runs: ExpertRuns, out: torch.Tensor, clamp: float, cfg, qp: bool
) -> None:
    """_gate_up_mma_kernel's launch: planes xq [2, B, K] int8, scales dx, the gate / up stacks' packed data,
    out [B, k, F]; qp: read their quad-layout words (GroupedConfig.quad_pack, or quad stacks)."""
    B, k, F = out.shape
    K = xq.shape[2]
    ptx = xq.is_cuda
    if qp:
        if "qp" not in g or "qp" not in u:
            raise ValueError("moe_gate_up_grouped: quad_pack needs the stacks packed first (quad_pack_stack)")
        if not cfg.mma_ld128:
            raise ValueError("moe_gate_up_grouped: the quad layout is read with 16-byte loads (mma_ld128)")
        gq, uq, gs, us = g["qp"], u["qp"], g["qp"], u["qp"]  # (gs / us unused)
        xq = quad_x(xq)
    else:
        gq, uq = g["qs"].view(torch.int64), u["qs"].view(torch.int64)
        gs, us = g["sg"].view(torch.int64), u["sg"].view(torch.int64)
    cap = cfg.maxnreg or (cfg.qp_maxnreg if qp else 0)
    _gate_up_mma_kernel[(triton.cdiv(F, 16 * cfg.warps), B * k)](
        xq.view(torch.int64), dx, gq, gs, g["d"], uq, us, u["d"], *iq2_tables(xq.device, False, True),
        runs.order, runs.eid, runs.offsets, out, k, B * k, runs.n_experts, F, K, B * K // 8, float(clamp),
        WARPS=cfg.warps, CLAMP=clamp > 0, PTX=ptx, LDS=cfg.lds_rep if cfg.lds else 0,
        LD128=cfg.mma_ld128 and ptx, SIGN_MATH=cfg.sign_mode, QP=qp,
        num_warps=cfg.warps, launch_pdl=PDL, **({"maxnreg": cap} if cap and ptx else {}),
    )  # fmt: skip


def _down_mma(
    mid: torch.Tensor, weights: torch.Tensor, wd: PackedWeight, runs: ExpertRuns, cfg
) -> torch.Tensor:
    """_down_mma_kernel's launch: mid [P, F] f32 -> per-pair outputs [P, D] (all written)."""
    P, F = mid.shape
    D = wd.shape[1]
    xq, dx = quantize_q8k(mid, 2)
    part = torch.empty(P, D, dtype=torch.float32, device=mid.device)
    w = wd.data
    _down_mma_kernel[(triton.cdiv(D, 16 * cfg.warps), P)](
        xq.view(torch.int32), dx, w["qs"].view(torch.int32), w["sc"].view(torch.int32),
        w["dm"].view(torch.int32), runs.order, runs.eid, runs.offsets, weights.float().contiguous(), part, P,
        runs.n_experts, D, F, P * F // 4, WARPS=cfg.warps, PTX=mid.is_cuda, num_warps=cfg.warps,
        launch_pdl=PDL,
    )  # fmt: skip
    return part


def _group_sums(xq: torch.Tensor) -> torch.Tensor:
    """Quantized rows (planes xq int8 [T, R, F]) -> [R, F/16] int32 sums of the activation integers v
    (254 q1 + q2 for T = 2) per group of 16: the min term of Q2_K (sum_16 v), the same for all weight rows."""
    v = xq[0].to(torch.int32)
    if xq.shape[0] == 2:
        v = v * 254 + xq[1].to(torch.int32)
    return v.view(v.shape[0], -1, 16).sum(-1, dtype=torch.int32)


def moe_down_grouped(
    mid: torch.Tensor,
    weights: torch.Tensor,
    wd: PackedWeight,
    ids: torch.Tensor,
    cfg: GroupedConfig | None = None,
    runs: ExpertRuns | None = None,
    per_slot: bool = False,
) -> torch.Tensor:
    """mid [B, k, F], router weights [B, k], Q2_K down stack [E, D, F], ids [B, k] -> [B, D] f32
    = sum_j weights[b, j] * Wd[ids[b, j]] @ mid[b, j] (ids outside [0, E): nothing), = moe.moe_down with
    MoeConfig(int8=True) up to f32 summation order; summed over j in fixed order. per_slot: the [B, k, D]
    terms unsummed (expert parallel sums them over the ranks first: bit-exact to one GPU)."""
    check_weight(wd, 3, "moe_down_grouped", mid.device)
    if wd.qtype != GGMLType.Q2_K:
        raise ValueError(f"moe_down_grouped: down must be a Q2_K stack, got {wd.qtype.name}")
    if mid.ndim != 3 or mid.shape[2] != wd.K:
        raise ValueError(f"moe_down_grouped: mid must be [B, k, {wd.K}], got {tuple(mid.shape)}")
    B, k, F = mid.shape
    _check_ids(ids, B, mid.device, "moe_down_grouped")
    if ids.shape[1] != k or weights.shape != (B, k):
        raise ValueError(
            f"moe_down_grouped: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be [{B}, {k}]"
        )
    cfg = cfg or CONFIG
    E, D, _ = wd.shape
    if not use_triton(mid):
        safe, ok = _valid(ids, E)
        w_ok = weights * ok
        if not per_slot:
            return ref.moe_down_q8k(mid, w_ok, wd, safe, cfg.terms)
        # one slot at a time through the twin: [B, D] sums of one term each
        one = [
            ref.moe_down_q8k(mid[:, j, None], w_ok[:, j, None], wd, safe[:, j, None], cfg.terms)
            for j in range(k)
        ]
        return torch.stack(one, 1) if one else torch.zeros(B, 0, D, dtype=torch.float32, device=mid.device)
    if B * k == 0:
        part = torch.zeros(B, k, D, dtype=torch.float32, device=mid.device)
        return part if per_slot else part.sum(1)
    if cfg.mma_dn:
        part = _down_mma(
            prep_x(mid.reshape(B * k, F), F, "moe_down_grouped"),
            weights,
            wd,
            runs or expert_runs(ids, E),
            cfg,
        )
        return part.view(B, k, D) if per_slot else part.view(B, k, D).sum(1)
    if cfg.pair_down:
        mid = prep_x(mid.reshape(B * k, F), F, "moe_down_grouped").view(B, k, F)
        bn = cfg.bn_pair_dn_small if B < SMALL_ROWS and cfg.bn_pair_dn_small else cfg.bn_pair_dn
        pair = replace(DOWN, bn=bn, int8=True, terms=cfg.terms, dp4a=cfg.dp4a, prefetch=cfg.prefetch_dn)
        order = (runs or expert_runs(ids, E)).order if cfg.sorted_down else None
        part = moe_down_slots(mid, weights, wd, ids, pair, order)
        return part if per_slot else part.sum(1)
    runs = runs or expert_runs(ids, E)
    mid = prep_x(mid.reshape(B * k, F), F, "moe_down_grouped")
    xq, dx = quantize_q8k(mid, cfg.terms)
    xs = _group_sums(xq)
    part = torch.empty(B, k, D, dtype=torch.float32, device=mid.device)  # per-pair outputs, all written
    w = wd.data
    _down_grouped_kernel[(triton.cdiv(D, cfg.bn_dn), B * k)](
        xq.view(torch.int32), xs, dx, w["qs"].view(torch.int32), w["sc"], w["dm"], runs.order, runs.eid,
        runs.offsets, weights.float().contiguous(), part, B * k, E, D, F, B * k * F // 4,
        BN=cfg.bn_dn, PT=cfg.pairs_dn, TERMS=cfg.terms, DP4A=_dp4a(mid, cfg), num_warps=cfg.warps,
        launch_pdl=PDL,
    )  # fmt: skip
    return part if per_slot else part.sum(1)  # fixed order over the k slots: deterministic


def moe_routed_grouped(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    wg: PackedWeight,
    wu: PackedWeight,
    wd: PackedWeight,
    clamp: float,
    cfg: GroupedConfig | None = None,
    per_slot: bool = False,
    xq: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The routed experts of B rows, grouped by expert: x [B, K], ids/weights [B, k] -> [B, D] f32
    = sum_j weights[b, j] * down_e(swiglu(gate_e x_b, up_e x_b)), e = ids[b, j] (outside [0, E): nothing);
    per_slot: the [B, k, D] terms unsummed; xq: x's Q8_K planes (moe.moe_gate_up's). One device sort shared
    by both launches."""
    runs = expert_runs(ids, wg.shape[0]) if use_triton(x) else None
    mid = moe_gate_up_grouped(x, wg, wu, ids, clamp, cfg, runs, xq)
    return moe_down_grouped(mid, weights, wd, ids, cfg, runs, per_slot)


__all__ = [
    "CONFIG",
    "ExpertRuns",
    "GroupedConfig",
    "expert_runs",
    "quad_pack",
    "quad_pack_stack",
    "moe_down_grouped",
    "moe_gate_up_grouped",
    "moe_routed_grouped",
    "supports",
]
