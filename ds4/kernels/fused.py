"""Fused decode-step kernels: the small element-wise / reduction chains of one token in one or two launches.

Legend: B rows (tokens), S = hc_mult streams, d = n_embd, K = S * d, M = (2 + S) * S HC mixing logits,
H heads, D = head_dim, R = n_rot (RoPE dims, the tail of each row), P = R / 2 adjacent pairs, E experts.

Each op mirrors CPU reference math (ds4.model.hc, norm, rope, quantsim, moe) and has a plain-torch twin in
ds4/kernels/ref.py (section "Fused decode ops"), which is also the CPU path of the dispatchers below:
  hc_pre_fused     RMSNorm(no weight) . fn projection . sigmoid pre/post . Sinkhorn . weighted stream sum
                   (+ optional sublayer RMSNorm), 2 launches (split-K partial dots, per row or, from
                   HC_ROWS_MIN rows, per row tile; then one program per row, which can also write x's
                   Q8_K planes for the routed experts: quant_out)
  hc_post_fused    X'[dst] = post[dst] * f + sum_src comb[src, dst] * X[src], 1 launch
  q_norm_rope      per-head RMSNorm(no weight) + RoPE on the tail, 1 launch
  o_unrope         the inverse RoPE of the attention output + the cast for its GEMM, 1 launch (prefill)
  kv_norm_rope_fp8 RMSNorm(weight) + RoPE + FP8 E4M3 round trip of the nope dims (64-blocks), 1 launch
                   (qa_kv_norm_rope_fp8: with the q_a RMSNorm of the same rows in that launch)
  router_topk      sqrt(softplus) probs, biased top-k (ties -> lower id), normalised weights, 1 launch
The FP8 path uses correctly rounded sqrt/division so that, given the same f32 pre-quantization values, the
round trip is bit-exact (power-of-two scale from the exponent bits, RNE by the 2^23 magic-number trick).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import ref
from .dispatch import PDL, pdl_wait
from .dispatch import require as _check
from .dispatch import use_triton as _use_triton
from .hc import sinkhorn_tile
from .intq import dp4a_ok, q8k_block, quantize_q8k

FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
FP8_BLOCK = 64
HC_CHUNK = 128  # K elements per program of the split-K mixing projection (128 programs at Flash shapes)
# The finish kernel (one program per row) takes rows of at most HC_FINISH_BD elements (Flash, d = 4096: with
# HC_FINISH_BD = 4096) in ONE pass, the stream sum held in registers for the sublayer norm; wider rows go in
# chunks of up to 1024 that are written, then re-read and normalised (a second pass behind a barrier: the
# H200 profile gave this kernel 12 us a call, 86 calls per token). HC_FINISH_WARPS warps (0: 16 for a
# one-pass tile of 4096 or more, the [S, 4096] tile at 32 floats a thread; else 4). One pass is the default:
# on the H200 (tools/gpu/ab_decode.py, 2026-12-01) the whole model decoded 80.22 vs 79.07 tok/s at 4k ctx
# with it (same in both rounds). sm_90 builds: bench_kernels.py --compile-only. Env DS4_HC_FINISH_BD /
# DS4_HC_FINISH_WARPS (1024 / 4: the old two-pass chunks), for whole-model A/B runs.
HC_FINISH_BD = int(os.environ.get("DS4_HC_FINISH_BD", "4096"))
HC_FINISH_WARPS = int(os.environ.get("DS4_HC_FINISH_WARPS", "0"))
# Rows (B) from which the mixing projection runs as row tiles (_hc_mix_rows: each program HC_ROWS_BT rows
# of one K split, fn's tile loaded once per tile; the per-row _hc_mix_partial reloads it for every row and
# took 145 ms of an 8k prefill's 2.2 s on the H200, session 9 profile). 0: never. Env DS4_HC_ROWS_MIN.
# The tile's dots: HC_ROWS_PREC "tf32x3" (three TF32 tensor-core products, about f32 accuracy: see
# ds4.kernels.gemm) or "ieee" (FMA). H200, hc_pre_fused at 8192 rows (tools/gpu/bench_prefill_f32.py, session
# 9; both launches, GB/s of X): per row 2,320 us (231 GB/s); row tiles ieee 32 rows 1,646; tf32x3 16 / 32 / 64
# rows 1,092 / 1,062 / 705 us (761 GB/s); all within 9e-7 of the per-row result.
HC_ROWS_MIN = int(os.environ.get("DS4_HC_ROWS_MIN", "64"))
HC_ROWS_BT = 64  # rows per program of _hc_mix_rows
HC_ROWS_WARPS = 4  # its warps (sm_90 build at 64 rows: 207 registers a thread)
# The finish kernel's warps from HC_ROWS_MIN rows (0: as HC_FINISH_WARPS). Prefill launches thousands of its
# one-row programs, so fewer warps each may fill the GPU better; at 8192 rows it took 76 ms of an 8k prefill
# with 16 (session 9 profile). H200, hc_pre_fused at 8192 rows (tools/gpu/bench_prefill_f32.py, session 10):
# finish at 8 warps 702.4 us, at 4 762.3, at the default 16 766.5.
HC_FINISH_ROWS_WARPS = int(os.environ.get("DS4_HC_FINISH_ROWS_WARPS", "8"))
# The finish for S = 4 streams (Flash) with its mixing logits as scalars (_hc_pre_finish4): every thread
# runs the 4 x 4 Sinkhorn on its own copy, so its 2 * iters normalisations need no cross-thread reduction
# (the tile form, sinkhorn_tile over a [4, 4] tensor spread over 16 warps, has a barrier in each of its ~40
# sums). Same operations in the same order up to the association of each 4-term sum. Measured slower: on
# the H200 (session 11, profile_regions.py 8192) 14.7 us a call vs 10.3 for the tile form, whole model at 4k
# ctx 98.33 vs 101.93 tok/s (ab_decode.py, both rounds alike): the 320 serial correctly rounded divisions per
# thread cost more than the barriers. Session 13: each normalisation divides once (a reciprocal, then four
# products: _div4), 4x fewer divisions on the serial chain: still slower, 102.87 vs 105.56 tok/s at 4k ctx
# (ab_decode.py "hc scalar", both rounds alike). Off; env DS4_HC_FINISH_SCALAR=1: on.
HC_FINISH_SCALAR = os.environ.get("DS4_HC_FINISH_SCALAR", "0") == "1"
# The finish kernel sums the mixing projection's K-split partials (HC_CHUNK wide: 128 of them at Flash's
# K = 16,384) in chunks of up to this many splits: each chunk is one round trip to L2 on the row's serial
# chain (sessions <= 16: 32, so 4 trips for each of pss, pre, post and comb). H200, session 17 (ab_decode.py,
# 4k ctx): 113.21 tok/s at 128 vs 109.78 at 32 (x1.031, both rounds alike). Env DS4_HC_FINISH_BNS.
HC_FINISH_BNS = int(os.environ.get("DS4_HC_FINISH_BNS", "128"))
HC_ROWS_BK = 64  # K elements per step of its loop
HC_ROWS_PROGRAMS = 1024  # K splits are chosen for about this many programs
HC_ROWS_PREC = os.environ.get("DS4_HC_ROWS_PREC", "tf32x3")
_Q8K_TINY = tl.constexpr(ref.Q8K_TINY)  # readable inside the kernels
# Warps of two one-program-a-row decode kernels on the step's critical path whose work is a few reductions
# over a short row: the router (256 logits, k rounds of max / argmin) and the kv row (512 values, 8 FP8
# blocks, the q_a row's 1,024). At 4 warps each reduction crosses warps through shared memory behind a
# barrier; at 1 a warp's shuffles do it, with more values a thread. H200, session 19 (ab_decode.py at 4k ctx,
# 2 rounds): router at 1 warp 131.13 vs 133.27 tok/s (x0.984), kv row at 1 / 2 warps 132.99 / 132.96
# (x0.998); B = 1 / 8 / 32 steps with both at 1 warp x1.003 / x0.995 / x0.999 (batch_check.py): 4 stays.
# tools/gpu/ab_decode.py "router w1" / "kv w1". Env DS4_ROUTER_WARPS / DS4_KV_ROW_WARPS.
ROUTER_WARPS = int(os.environ.get("DS4_ROUTER_WARPS", "4"))
KV_ROW_WARPS = int(os.environ.get("DS4_KV_ROW_WARPS", "4"))


# ---------------------------------------------------------------------------------------------------------
# Hyper-connection pre: two launches.


@triton.jit
def _hc_mix_partial(x_ptr, fn_ptr, pmix_ptr, pss_ptr, K, M, NS, BM: tl.constexpr, CHUNK: tl.constexpr):
    """Program (b, s): partial dots fn[:, chunk] . x[b, chunk] -> pmix[b, s, :M] and sum x^2 -> pss[b, s]."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    b = tl.program_id(0)
    s = tl.program_id(1)
    rows = tl.arange(0, BM)
    k = s * CHUNK + tl.arange(0, CHUNK)
    km = k < K
    x = tl.load(x_ptr + b * K + k, mask=km, other=0.0).to(tl.float32)
    w = tl.load(fn_ptr + rows[:, None] * K + k[None, :], mask=(rows[:, None] < M) & km[None, :], other=0.0)
    tl.store(pmix_ptr + (b * NS + s) * BM + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1))
    tl.store(pss_ptr + b * NS + s, tl.sum(x * x, axis=0))


@triton.jit
def _hc_mix_rows(
    x_ptr, fn_ptr, pmix_ptr, pss_ptr, B, K, M, NS, KS,
    BT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Program (row tile t, split s): for the BT rows b of tile t and ks = [s KS, (s + 1) KS) within K,
    pmix[b, s, :M] = fn[:, ks] . x[b, ks] and pss[b, s] = sum x[b, ks]^2 (dots at HC_ROWS_PREC)."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    s = tl.program_id(1)
    rm = rows < B
    m = tl.arange(0, BM)
    mm = m < M
    acc = tl.zeros([BT, BM], tl.float32)
    ss = tl.zeros([BT], tl.float32)
    xrow = x_ptr + rows.to(tl.int64)[:, None] * K
    for k0 in range(s * KS, s * KS + KS, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        x = tl.load(xrow + k[None, :], mask=rm[:, None] & km[None, :], other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + m[:, None] * K + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision=PREC)
        ss += tl.sum(x * x, axis=1)
    tl.store(pmix_ptr + (rows[:, None] * NS + s) * BM + m[None, :], acc, mask=rm[:, None])
    tl.store(pss_ptr + rows * NS + s, ss, mask=rm)


@triton.jit
def _sum_partials(pmix_ptr, b, NS, BM: tl.constexpr, offs, mask, BNS: tl.constexpr):
    """sum over the NS splits of pmix[b, :, offs] (offs any 1-D index vector)."""
    n = tl.arange(0, BNS)[:, None]
    acc = tl.zeros(offs.shape, tl.float32)
    for n0 in range(0, NS, BNS):
        ptrs = pmix_ptr + (b * NS + n0 + n) * BM + offs[None, :]
        acc += tl.sum(tl.load(ptrs, mask=((n0 + n) < NS) & mask[None, :], other=0.0), axis=0)
    return acc


@triton.jit
def _q8k_row(xv, q_ptr, dq_ptr, qplane, D, TERMS: tl.constexpr, PTX: tl.constexpr, BD: tl.constexpr):
    """A row xv [BD] (zeros past D) -> its Q8_K planes q_ptr[:D] (TERMS of them, qplane apart), scales
    dq_ptr[:D / 256] (intq.q8k_block: the bits of a quantize_q8k launch)."""
    NQ: tl.constexpr = BD // 256
    q1, q2, dq = q8k_block(tl.reshape(xv, (NQ, 256)), _Q8K_TINY, TERMS, PTX)
    off = tl.arange(0, NQ)[:, None] * 256 + tl.arange(0, 256)[None, :]
    tl.store(q_ptr + off, q1.to(tl.int8), mask=off < D)
    if TERMS == 2:
        tl.store(q_ptr + qplane + off, q2.to(tl.int8), mask=off < D)
    nq = tl.arange(0, NQ)
    tl.store(dq_ptr + nq, dq, mask=nq < D // 256)


@triton.jit
def _hc_post_comb(
    pmix_ptr, base_ptr, post_ptr, comb_ptr, b, rs, s1, s2, S, NS, iters, hc_eps,
    BM: tl.constexpr, BS: tl.constexpr, BNS: tl.constexpr, SINKHORN: tl.constexpr,
):  # fmt: skip
    """_hc_pre_finish's post [S] and comb [S, S] of row b (rs its RMS factor, s1 / s2 the post / comb
    scales): the combine logits normalised by Sinkhorn in registers, or left as logits (SINKHORN off)."""
    i = tl.arange(0, BS)
    im = i < S
    post_raw = _sum_partials(pmix_ptr, b, NS, BM, S + i, im, BNS) * rs
    post = 2.0 * tl.sigmoid(post_raw * s1 + tl.load(base_ptr + S + i, mask=im, other=0.0))
    tl.store(post_ptr + b * S + i, post, mask=im)
    # combine logits as a flat [BS*BS] vector (row-major r, c), reshaped to [BS, BS] for Sinkhorn
    f = tl.arange(0, BS * BS)
    fm = ((f // BS) < S) & ((f % BS) < S)
    foff = 2 * S + (f // BS) * S + (f % BS)
    logit = _sum_partials(pmix_ptr, b, NS, BM, foff, fm, BNS) * rs * s2
    logit = tl.reshape(logit + tl.load(base_ptr + foff, mask=fm, other=0.0), (BS, BS))
    r = tl.arange(0, BS)[:, None]
    c = tl.arange(0, BS)[None, :]
    m = (r < S) & (c < S)
    if SINKHORN:
        logit = sinkhorn_tile(logit, r, m, S, iters, hc_eps)
    tl.store(comb_ptr + b * S * S + r * S + c, logit, mask=m)


@triton.jit
def _hc_pre_finish(
    x_ptr, pmix_ptr, pss_ptr, scale_ptr, base_ptr, norm_ptr, out_ptr, post_ptr, comb_ptr,
    S, D, NS, iters, rms_eps, hc_eps,
    HAS_NORM: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, BNS: tl.constexpr,
    ONE_PASS: tl.constexpr, SINKHORN: tl.constexpr,
    q_ptr=None, dq_ptr=None, qplane=0, QUANT: tl.constexpr = 0, PTX: tl.constexpr = False,
    HEAD: tl.constexpr = False,
):  # fmt: skip
    """One program per row b: mixing logits -> pre, post, comb (Sinkhorn in registers), x = sum pre X.
    ONE_PASS (BD >= D): the row as one tile, see HC_FINISH_BD. SINKHORN off: comb_ptr gets the combine
    logits, for ds4.kernels.hc.sinkhorn (see hc_pre_fused). QUANT (ONE_PASS, D % 256 == 0): x's Q8_K
    planes (intq.q8k_block, QUANT terms, PTX as its) into q [QUANT, B, D] (qplane apart), dq [B, D/256].
    HEAD: the output head's collapse (hc_head_fused): S mixing logits and one scale, no post / comb."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    b = tl.program_id(0)
    K = S * D
    n = tl.arange(0, BNS)
    ss = tl.zeros([BNS], tl.float32)
    for n0 in range(0, NS, BNS):
        ss += tl.load(pss_ptr + b * NS + n0 + n, mask=(n0 + n) < NS, other=0.0)
    rs = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + rms_eps)
    i = tl.arange(0, BS)
    im = i < S
    s0 = tl.load(scale_ptr)
    if not HEAD:  # (the loads where they always were: the same build as before HEAD)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
    pre_raw = _sum_partials(pmix_ptr, b, NS, BM, i, im, BNS) * rs
    pre = tl.sigmoid(pre_raw * s0 + tl.load(base_ptr + i, mask=im, other=0.0)) + hc_eps
    if not HEAD:
        _hc_post_comb(pmix_ptr, base_ptr, post_ptr, comb_ptr, b, rs, s1, s2, S, NS, iters, hc_eps,
                      BM, BS, BNS, SINKHORN)  # fmt: skip
    # weighted sum of the unnormalised streams (+ the sublayer RMSNorm)
    dd = tl.arange(0, BD)
    if ONE_PASS:  # the whole row in one tile: the norm from registers
        dm = dd < D
        xs = tl.load(x_ptr + b * K + i[:, None] * D + dd[None, :], mask=im[:, None] & dm[None, :], other=0.0)
        xv = tl.sum(pre[:, None] * xs.to(tl.float32), axis=0)
        if HAS_NORM:
            rn = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / D + rms_eps)
            xv = xv * rn * tl.load(norm_ptr + dd, mask=dm, other=0.0).to(tl.float32)
        tl.store(out_ptr + b * D + dd, xv, mask=dm)
        if QUANT > 0:
            _q8k_row(xv, q_ptr + b * D, dq_ptr + b * (D // 256), qplane, D, QUANT, PTX, BD)
        return
    sq = tl.zeros([BD], tl.float32)  # chunks of BD: written, then (norm) re-read in a second pass
    for d0 in range(0, D, BD):
        dm = (d0 + dd) < D
        xs = tl.load(
            x_ptr + b * K + i[:, None] * D + d0 + dd[None, :], mask=im[:, None] & dm[None, :], other=0.0
        )
        xv = tl.sum(pre[:, None] * xs.to(tl.float32), axis=0)
        sq += xv * xv
        tl.store(out_ptr + b * D + d0 + dd, xv, mask=dm)
    if HAS_NORM:
        tl.debug_barrier()
        rn = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / D + rms_eps)
        for d0 in range(0, D, BD):
            dm = (d0 + dd) < D
            xv = tl.load(out_ptr + b * D + d0 + dd, mask=dm, other=0.0)
            w = tl.load(norm_ptr + d0 + dd, mask=dm, other=0.0).to(tl.float32)
            tl.store(out_ptr + b * D + d0 + dd, xv * rn * w, mask=dm)


@triton.jit
def _sum4(a, b, c, d):
    return (a + b) + (c + d)


@triton.jit
def _div4(a, b, c, d, s):
    """a, b, c, d / s as four products by one correctly rounded reciprocal: within 1.5 ulp of the
    quotients (the 4 x 4 Sinkhorn's 2 iters normalisations are serial: one division each, not four)."""
    r = 1.0 / s
    return a * r, b * r, c * r, d * r


@triton.jit
def _store4(ptr, a, b, c, d):
    tl.store(ptr, a)
    tl.store(ptr + 1, b)
    tl.store(ptr + 2, c)
    tl.store(ptr + 3, d)


@triton.jit
def _row_softmax4(mix_ptr, j, rs, scale, base_ptr, eps):
    """sinkhorn_tile's first step on one row, the mixing logits j .. j + 3 (see _mix): softmax + eps."""
    a, b = _mix(mix_ptr, j, rs, scale, base_ptr), _mix(mix_ptr, j + 1, rs, scale, base_ptr)
    c, d = _mix(mix_ptr, j + 2, rs, scale, base_ptr), _mix(mix_ptr, j + 3, rs, scale, base_ptr)
    m = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a, b, c, d = tl.exp(a - m), tl.exp(b - m), tl.exp(c - m), tl.exp(d - m)
    a, b, c, d = _div4(a, b, c, d, _sum4(a, b, c, d))
    return a + eps, b + eps, c + eps, d + eps


@triton.jit
def _mix(mix_ptr, j, rs, scale, base_ptr):
    """Mixing logit j of the row (mix_ptr: its BM sums) times rs * scale, plus its base."""
    return tl.load(mix_ptr + j) * rs * scale + tl.load(base_ptr + j)


@triton.jit
def _hc_pre_finish4(
    x_ptr, pmix_ptr, pss_ptr, mix_ptr, scale_ptr, base_ptr, norm_ptr, out_ptr, post_ptr, comb_ptr,
    D, NS, iters, rms_eps, hc_eps,
    HAS_NORM: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BNS: tl.constexpr,
):  # fmt: skip
    """_hc_pre_finish for S = 4 and one tile (BD >= D), the logits as scalars (see HC_FINISH_SCALAR):
    the row's BM mixing sums go through mix_ptr [B, BM] (stored, a barrier, read back as scalars)."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    b = tl.program_id(0)
    K = 4 * D
    n = tl.arange(0, BNS)
    ss = tl.zeros([BNS], tl.float32)
    for n0 in range(0, NS, BNS):
        ss += tl.load(pss_ptr + b * NS + n0 + n, mask=(n0 + n) < NS, other=0.0)
    rs = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + rms_eps)
    mi = tl.arange(0, BM)
    mrow = mix_ptr + b * BM
    tl.store(mrow + mi, _sum_partials(pmix_ptr, b, NS, BM, mi, mi < 24, BNS))
    tl.debug_barrier()  # the sums are read back below by every thread
    s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    p0 = tl.sigmoid(_mix(mrow, 0, rs, s0, base_ptr)) + hc_eps
    p1 = tl.sigmoid(_mix(mrow, 1, rs, s0, base_ptr)) + hc_eps
    p2 = tl.sigmoid(_mix(mrow, 2, rs, s0, base_ptr)) + hc_eps
    p3 = tl.sigmoid(_mix(mrow, 3, rs, s0, base_ptr)) + hc_eps
    for j in tl.static_range(4):
        tl.store(post_ptr + b * 4 + j, 2.0 * tl.sigmoid(_mix(mrow, 4 + j, rs, s1, base_ptr)))
    # comb[r][c] = a{r}{c}: row softmax + eps, column norm, then (iters - 1) x (row, column) norms
    a00, a01, a02, a03 = _row_softmax4(mrow, 8, rs, s2, base_ptr, hc_eps)
    a10, a11, a12, a13 = _row_softmax4(mrow, 12, rs, s2, base_ptr, hc_eps)
    a20, a21, a22, a23 = _row_softmax4(mrow, 16, rs, s2, base_ptr, hc_eps)
    a30, a31, a32, a33 = _row_softmax4(mrow, 20, rs, s2, base_ptr, hc_eps)
    for it in range(iters):
        if it > 0:
            a00, a01, a02, a03 = _div4(a00, a01, a02, a03, _sum4(a00, a01, a02, a03) + hc_eps)
            a10, a11, a12, a13 = _div4(a10, a11, a12, a13, _sum4(a10, a11, a12, a13) + hc_eps)
            a20, a21, a22, a23 = _div4(a20, a21, a22, a23, _sum4(a20, a21, a22, a23) + hc_eps)
            a30, a31, a32, a33 = _div4(a30, a31, a32, a33, _sum4(a30, a31, a32, a33) + hc_eps)
        a00, a10, a20, a30 = _div4(a00, a10, a20, a30, _sum4(a00, a10, a20, a30) + hc_eps)
        a01, a11, a21, a31 = _div4(a01, a11, a21, a31, _sum4(a01, a11, a21, a31) + hc_eps)
        a02, a12, a22, a32 = _div4(a02, a12, a22, a32, _sum4(a02, a12, a22, a32) + hc_eps)
        a03, a13, a23, a33 = _div4(a03, a13, a23, a33, _sum4(a03, a13, a23, a33) + hc_eps)
    cb = comb_ptr + b * 16
    _store4(cb, a00, a01, a02, a03)
    _store4(cb + 4, a10, a11, a12, a13)
    _store4(cb + 8, a20, a21, a22, a23)
    _store4(cb + 12, a30, a31, a32, a33)
    # weighted sum of the unnormalised streams (+ the sublayer RMSNorm), the row in one tile
    dd = tl.arange(0, BD)
    dm = dd < D
    xr = x_ptr + b * K + dd
    xv = p0 * tl.load(xr, mask=dm, other=0.0).to(tl.float32)
    xv += p1 * tl.load(xr + D, mask=dm, other=0.0).to(tl.float32)
    xv += p2 * tl.load(xr + 2 * D, mask=dm, other=0.0).to(tl.float32)
    xv += p3 * tl.load(xr + 3 * D, mask=dm, other=0.0).to(tl.float32)
    if HAS_NORM:
        rn = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / D + rms_eps)
        xv = xv * rn * tl.load(norm_ptr + dd, mask=dm, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * D + dd, xv, mask=dm)


def _mix_partials(X: torch.Tensor, fn: torch.Tensor, M: int, rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixing projection's K-split partials of X [B, S, d]: pmix [B, NS, BM] (fn . X over each split)
    and pss [B, NS] (sum X^2): by row tiles (_hc_mix_rows) when rows, else one program per (row, split)."""
    B, S, d = X.shape
    K, BM, NS = S * d, mix_width(M), triton.cdiv(S * d, HC_CHUNK)
    if rows:  # K splits of whole BK steps, for about HC_ROWS_PROGRAMS programs
        tiles = triton.cdiv(B, HC_ROWS_BT)
        want = max(1, min(K // (4 * HC_ROWS_BK), triton.cdiv(HC_ROWS_PROGRAMS, tiles)))
        KS = triton.cdiv(triton.cdiv(K, want), HC_ROWS_BK) * HC_ROWS_BK
        NS = triton.cdiv(K, KS)
    pmix = torch.empty(B, NS, BM, device=X.device, dtype=torch.float32)
    pss = torch.empty(B, NS, device=X.device, dtype=torch.float32)
    if B and rows:
        _hc_mix_rows[(tiles, NS)](
            X, fn.contiguous(), pmix, pss, B, K, M, NS, KS, BT=HC_ROWS_BT, BM=BM, BK=HC_ROWS_BK,
            PREC=HC_ROWS_PREC, num_warps=HC_ROWS_WARPS, launch_pdl=PDL,
        )  # fmt: skip
    elif B:
        _hc_mix_partial[(B, NS)](
            X, fn.contiguous(), pmix, pss, K, M, NS, BM=BM, CHUNK=HC_CHUNK, num_warps=4, launch_pdl=PDL
        )
    return pmix, pss


def mix_width(M: int) -> int:
    """BM: the mixing partials' row width for M mixing logits."""
    return max(16, triton.next_power_of_2(M))


def hc_pre_fused(
    X: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    iters: int,
    rms_eps: float,
    hc_eps: float,
    norm: torch.Tensor | None = None,
    sinkhorn: bool = True,
    mix: tuple[torch.Tensor, torch.Tensor] | None = None,
    quant_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """X [B, S, d], fn [M, S*d] (f16/f32), scale [3], base [M] -> x [B, d], post [B, S], comb [B, S, S].

    = ds4.model.hc.hc_pre; with `norm` [d], x is also RMS-normalised with that weight (the sublayer norm).
    sinkhorn off: the third output is the combine logits, and comb = ds4.kernels.hc.sinkhorn(them, iters,
    hc_eps) (so that its serial 2 * iters normalisations can run beside the sublayer: only hc_post reads
    comb). mix: the mixing projection's K-split partials of X (pmix [B, NS, BM], pss [B, NS]) as
    hc_post_mix made them with X: its launch here is skipped. quant_out (q int8 [T, B, d], dq f32 [B, d/256],
    d % 256 == 0): filled with x's Q8_K planes, as intq.quantize_q8k(x, T) would make them, by the finish
    launch where it holds the row in one tile (else by that launch after it).
    """
    _check(X.ndim == 3, f"hc_pre_fused: X must be [B, S, d], got {tuple(X.shape)}")
    B, S, d = X.shape
    M = (2 + S) * S
    _check(tuple(fn.shape) == (M, S * d), f"hc_pre_fused: fn must be {(M, S * d)}, got {tuple(fn.shape)}")
    _check(scale.numel() == 3 and base.numel() == M, f"hc_pre_fused: scale [3], base [{M}] expected")
    _check(iters >= 1, f"hc_pre_fused: iters must be >= 1, got {iters}")
    if quant_out is not None:
        q, dq = quant_out
        _check(
            d % 256 == 0
            and q.dtype == torch.int8
            and q.shape[1:] == (B, d)
            and q.is_contiguous()
            and tuple(dq.shape) == (B, d // 256)
            and dq.dtype == torch.float32,
            f"hc_pre_fused: quant_out must be int8 [T, {B}, {d}] and f32 [{B}, {d // 256}]",
        )
    if not _use_triton(X):
        x, post, comb = ref.hc_pre_fused(X, fn, scale, base, iters, rms_eps, hc_eps, norm, sinkhorn, mix)
        _quant_into(x, quant_out)
        return x, post, comb
    X = X.contiguous()
    rows = mix is None and 0 < HC_ROWS_MIN <= B
    if mix is None:
        pmix, pss = _mix_partials(X, fn, M, rows)
    else:
        pmix, pss = mix
        _check(pmix.shape[:2] == pss.shape and pmix.shape[0] == B, "hc_pre_fused: mix partials' shapes")
    BM, NS = pmix.shape[2], pss.shape[1]
    BD, warps, BNS = _finish_tile(d, NS, rows)
    x = torch.empty(B, d, device=X.device, dtype=torch.float32)
    post = torch.empty(B, S, device=X.device, dtype=torch.float32)
    comb = torch.empty(B, S, S, device=X.device, dtype=torch.float32)
    if B and S == 4 and BD >= d and HC_FINISH_SCALAR and sinkhorn:
        logits = torch.empty(B, BM, device=X.device, dtype=torch.float32)  # the row's mixing logits
        _hc_pre_finish4[(B,)](
            X, pmix, pss, logits, scale.float().contiguous(), base.float().contiguous(),
            norm if norm is not None else x, x, post, comb, d, NS, iters, float(rms_eps), float(hc_eps),
            HAS_NORM=norm is not None, BM=BM, BD=BD, BNS=BNS, launch_pdl=PDL, num_warps=warps,
        )  # fmt: skip
        _quant_into(x, quant_out)
    elif B:
        inline = quant_out is not None and BD >= d
        q, dq = quant_out if inline else (x, x)
        _hc_pre_finish[(B,)](
            X, pmix, pss, scale.float().contiguous(), base.float().contiguous(),
            norm if norm is not None else x, x, post, comb,
            S, d, NS, iters, float(rms_eps), float(hc_eps),
            HAS_NORM=norm is not None, BM=BM, BS=triton.next_power_of_2(S), BD=BD,
            BNS=BNS, ONE_PASS=BD >= d, SINKHORN=sinkhorn, q_ptr=q, dq_ptr=dq, qplane=B * d,
            QUANT=q.shape[0] if inline else 0, PTX=dp4a_ok(x), launch_pdl=PDL, num_warps=warps,
        )  # fmt: skip
        if not inline:
            _quant_into(x, quant_out)
    return x, post, comb


def _finish_tile(d: int, NS: int, rows: bool) -> tuple[int, int, int]:
    """(BD, warps, BNS) of the HC finish kernel for rows of d over NS mixing splits (HC_FINISH_*)."""
    BD = triton.next_power_of_2(d) if d <= HC_FINISH_BD else min(1024, HC_FINISH_BD)
    warps = (rows and HC_FINISH_ROWS_WARPS) or HC_FINISH_WARPS or (16 if BD >= 4096 else 4)
    return BD, warps, min(max(1, HC_FINISH_BNS), triton.next_power_of_2(NS))


def hc_head_fused(
    X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm: torch.Tensor,
    rms_eps: float, hc_eps: float,
) -> torch.Tensor:  # fmt: skip
    """The output head's HC collapse and output norm: X [B, S, d], fn [S, S*d], scale [1], base [S], norm [d]
    -> rms_norm(ds4.model.hc.hc_head(X), norm) [B, d] f32, in 2 launches (the mixing partials, then
    _hc_pre_finish's HEAD form) instead of ~18 torch kernels at the end of every decode step."""
    _check(X.ndim == 3, f"hc_head_fused: X must be [B, S, d], got {tuple(X.shape)}")
    B, S, d = X.shape
    _check(tuple(fn.shape) == (S, S * d), f"hc_head_fused: fn must be {(S, S * d)}, got {tuple(fn.shape)}")
    ok = scale.numel() == 1 and base.numel() == S and norm.numel() == d
    _check(ok, f"hc_head_fused: scale [1], base [{S}], norm [{d}] expected")
    if not _use_triton(X):
        return ref.hc_head_fused(X, fn, scale, base, norm, rms_eps, hc_eps)
    X = X.contiguous()
    rows = 0 < HC_ROWS_MIN <= B
    pmix, pss = _mix_partials(X, fn, S, rows)
    BD, warps, BNS = _finish_tile(d, pss.shape[1], rows)
    x = torch.empty(B, d, device=X.device, dtype=torch.float32)
    if B:
        _hc_pre_finish[(B,)](
            X, pmix, pss, scale.float().contiguous(), base.float().contiguous(), norm, x, x, x,
            S, d, pss.shape[1], 1, float(rms_eps), float(hc_eps),
            HAS_NORM=True, BM=pmix.shape[2], BS=triton.next_power_of_2(S), BD=BD, BNS=BNS, ONE_PASS=BD >= d,
            SINKHORN=False, HEAD=True, launch_pdl=PDL, num_warps=warps,
        )  # fmt: skip
    return x


def _quant_into(x: torch.Tensor, quant_out: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """quant_out's buffers (q [T, B, d], dq) := quantize_q8k(x, T), by a launch of its own (or nothing)."""
    if quant_out is not None and x.shape[0]:
        q, dq = quantize_q8k(x, quant_out[0].shape[0])
        quant_out[0].copy_(q)
        quant_out[1].copy_(dq)


# ---------------------------------------------------------------------------------------------------------
# Hyper-connection post: one launch.


@triton.jit
def _hc_post_kernel(
    f_ptr, parts_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, S, D, n_parts, fn_ptr, pmix_ptr, pss_ptr, M,
    BS: tl.constexpr, BD: tl.constexpr, PARTS: tl.constexpr, MIX: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    """Program (b, block of d): out[b, dst, :] = post[dst] * f + sum_src comb[src, dst] * X[src, :]; PARTS:
    f = sum_j parts[b, j, :] (j in order) + f[b, :]. MIX: also the next HC site's mixing partials of the
    block (_hc_mix_partial's, split s = dst * blocks + block: with BD = HC_CHUNK the same splits)."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    b = tl.program_id(0)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = dd < D
    i = tl.arange(0, BS)  # dst
    im = i < S
    acc = tl.zeros([BS, BD], tl.float32)
    for src in range(0, S):
        xs = tl.load(x_ptr + (b * S + src) * D + dd, mask=dm, other=0.0).to(tl.float32)
        cs = tl.load(comb_ptr + (b * S + src) * S + i, mask=im, other=0.0)  # comb[src, :]
        acc += cs[:, None] * xs[None, :]
    post = tl.load(post_ptr + b * S + i, mask=im, other=0.0)
    f = tl.load(f_ptr + b * D + dd, mask=dm, other=0.0).to(tl.float32)
    if PARTS:
        row = parts_ptr + b.to(tl.int64) * n_parts * D + dd
        psum = tl.load(row, mask=dm, other=0.0).to(tl.float32)
        for j in range(1, n_parts):
            psum += tl.load(row + j * D, mask=dm, other=0.0).to(tl.float32)
        f = psum + f
    out = post[:, None] * f[None, :] + acc
    tl.store(out_ptr + (b * S + i[:, None]) * D + dd[None, :], out, mask=im[:, None] & dm[None, :])
    if MIX:
        _post_mix(out, i, dd, dm, fn_ptr, pmix_ptr, pss_ptr, b, S, D, M, BM)


@triton.jit
def _post_mix(out, i, dd, dm, fn_ptr, pmix_ptr, pss_ptr, b, S, D, M, BM: tl.constexpr):
    """_hc_mix_partial's work on the X' block out [BS, BD] (streams i, columns dd) of program (b, block):
    per stream, fn[:, dst D + dd] . X'[dst, dd] -> pmix[b, s, :M] and sum X'^2 -> pss[b, s]."""
    m = tl.arange(0, BM)
    mm = m < M
    NS = S * tl.num_programs(1)
    for dst in range(0, S):
        xs = tl.sum(tl.where(i[:, None] == dst, out, 0.0), axis=0)  # [BD]: row dst of the block
        k = dst * D + dd
        w = tl.load(fn_ptr + m[:, None] * (S * D) + k[None, :], mask=mm[:, None] & dm[None, :], other=0.0)
        sp = b * NS + dst * tl.num_programs(1) + tl.program_id(1)
        tl.store(pmix_ptr + sp * BM + m, tl.sum(w.to(tl.float32) * xs[None, :], axis=1))
        tl.store(pss_ptr + sp, tl.sum(xs * xs, axis=0))


def hc_post_fused(
    f: torch.Tensor,
    X: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    parts: torch.Tensor | None = None,
) -> torch.Tensor:
    """f [B, d], X [B, S, d], post [B, S], comb [B, S, S] -> X' [B, S, d] f32 (= ds4.model.hc.hc_post).
    parts [B, k, d] (k >= 1): the sublayer output is sum_j parts[:, j] (in order) + f: the routed experts'
    per-slot outputs folded in here instead of a sum and an add of their own (two launches a layer)."""
    _check(X.ndim == 3, f"hc_post_fused: X must be [B, S, d], got {tuple(X.shape)}")
    B, S, d = X.shape
    _check(tuple(f.shape) == (B, d), f"hc_post_fused: f must be {(B, d)}, got {tuple(f.shape)}")
    _check(tuple(post.shape) == (B, S) and tuple(comb.shape) == (B, S, S), "hc_post_fused: post/comb shape")
    if parts is not None:
        _check(
            parts.ndim == 3 and parts.shape[0] == B and parts.shape[2] == d and parts.shape[1] >= 1,
            f"hc_post_fused: parts must be [{B}, k >= 1, {d}], got {tuple(parts.shape)}",
        )
    if not _use_triton(X):
        return ref.hc_post_fused(f, X, post, comb, parts)
    return _hc_post_launch(f, X, post, comb, parts, None)[0]


def hc_post_mix(
    f: torch.Tensor,
    X: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    parts: torch.Tensor | None,
    fn: torch.Tensor,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """hc_post_fused, and in the same launch the next HC site's mixing partials of X' (fn [M, S*d] that
    site's projection): (X', (pmix, pss)) for hc_pre_fused(..., mix=): one launch fewer per site boundary,
    X' not re-read for them. The splits are _hc_mix_partial's (HC_CHUNK wide)."""
    _, S, d = X.shape
    _check(fn.ndim == 2 and fn.shape[1] == S * d, f"hc_post_mix: fn must be [M, {S * d}]")
    if not _use_triton(X):
        out = ref.hc_post_fused(f, X, post, comb, parts)
        return out, ref.mix_partials(out, fn, HC_CHUNK, mix_width(fn.shape[0]))
    return _hc_post_launch(f, X, post, comb, parts, fn)


def _hc_post_launch(f, X, post, comb, parts, fn):
    """(X', (pmix, pss) or None): the _hc_post_kernel launch (MIX when fn is given)."""
    B, S, d = X.shape
    out = torch.empty(B, S, d, device=X.device, dtype=torch.float32)
    BD = min(512, triton.next_power_of_2(d)) if fn is None else HC_CHUNK
    f = f.contiguous()
    M = fn.shape[0] if fn is not None else 0
    blocks = triton.cdiv(d, BD)
    mix = None
    if fn is not None:
        mix = (
            torch.empty(B, S * blocks, mix_width(M), device=X.device, dtype=torch.float32),
            torch.empty(B, S * blocks, device=X.device, dtype=torch.float32),
        )
    if B:
        _hc_post_kernel[(B, blocks)](
            f, parts.contiguous() if parts is not None else f, X.contiguous(), post.float().contiguous(),
            comb.float().contiguous(), out, S, d, parts.shape[1] if parts is not None else 0,
            fn.contiguous() if fn is not None else f, *(mix or (out, out)), M,
            BS=triton.next_power_of_2(S), BD=BD, PARTS=parts is not None, MIX=fn is not None,
            BM=mix_width(max(M, 1)), num_warps=4, launch_pdl=PDL,
        )  # fmt: skip
    return out, mix


# ---------------------------------------------------------------------------------------------------------
# q / kv rows: RMSNorm + RoPE (+ FP8 E4M3 round trip of the kv nope dims). One launch each.


@triton.jit
def _rope_tail(
    src_ptr, dst_ptr, row_off, D, R, rs, w_ptr, pos, inv_ptr, HAS_W: tl.constexpr, BP: tl.constexpr,
    dst_off=None,
):  # fmt: skip
    """dst[tail] = RoPE(src[tail] * rs (* w)) on the adjacent pairs (2j, 2j+1) of the last R dims; the row at
    row_off in src, at dst_off (default row_off) in dst."""
    if dst_off is None:
        dst_off = row_off
    j = tl.arange(0, BP)
    jm = j < R // 2
    t0 = D - R + 2 * j
    a = tl.load(src_ptr + row_off + t0, mask=jm, other=0.0).to(tl.float32) * rs
    c = tl.load(src_ptr + row_off + t0 + 1, mask=jm, other=0.0).to(tl.float32) * rs
    if HAS_W:
        a = a * tl.load(w_ptr + t0, mask=jm, other=0.0).to(tl.float32)
        c = c * tl.load(w_ptr + t0 + 1, mask=jm, other=0.0).to(tl.float32)
    ang = pos * tl.load(inv_ptr + j, mask=jm, other=0.0)
    cs = tl.cos(ang)
    sn = tl.sin(ang)
    tl.store(dst_ptr + dst_off + t0, a * cs - c * sn, mask=jm)
    tl.store(dst_ptr + dst_off + t0 + 1, a * sn + c * cs, mask=jm)


@triton.jit
def _q_norm_rope_kernel(q_ptr, out_ptr, pos_ptr, inv_ptr, H, D, R, eps, BD: tl.constexpr, BP: tl.constexpr):
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    row = tl.program_id(0).to(tl.int64)  # b * H + h (64-bit: a prefill chunk's q passes 2^31 elements)
    d = tl.arange(0, BD)
    x = tl.load(q_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32)
    rs = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
    tl.store(out_ptr + row * D + d, x * rs, mask=d < D - R)
    pos = tl.load(pos_ptr + row // H).to(tl.float32)
    _rope_tail(q_ptr, out_ptr, row * D, D, R, rs, inv_ptr, pos, inv_ptr, HAS_W=False, BP=BP)


@triton.jit
def _o_unrope_kernel(o_ptr, out_ptr, pos_ptr, inv_ptr, H, D, R, BD: tl.constexpr, BP: tl.constexpr):
    """Program row = b H + h: out[row] = o[row] with its last R dims rotated by -pos[b] inv_freq (the angle
    negated exactly: cos even, sin odd), stored in out's dtype."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    tl.store(out_ptr + row * D + d, tl.load(o_ptr + row * D + d, mask=d < D - R, other=0.0), mask=d < D - R)
    pos = tl.load(pos_ptr + row // H).to(tl.float32)
    _rope_tail(o_ptr, out_ptr, row * D, D, R, 1.0, inv_ptr, -pos, inv_ptr, HAS_W=False, BP=BP)


@triton.jit
def _round_e4m3(v):
    """Round |v| <= 448 to the nearest FP8 E4M3 value, ties to even (v / step is exact: step is 2^e).
    Only exact operations: Triton's f32 `/` compiles to the approximate div.full.f32 on NVIDIA GPUs."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # binary exponent of |v|
    e = tl.maximum(e, -6) - 3  # 3 mantissa bits; below 2^-6 the subnormal spacing 2^-9
    step = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - e) << 23).to(tl.float32, bitcast=True)  # exact 1 / step (no approximate division)
    r = ((a * inv_step + 8388608.0) - 8388608.0) * step  # + 2^23 rounds to an integer, half to even
    return tl.where(v < 0, -r, r)


@triton.jit
def _inv_rms(x, n, eps):
    """1 / sqrt(mean(x^2) + eps) over the n values of the row x (zeros past n), correctly rounded steps."""
    return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(x * x, axis=0), n * 1.0) + eps))


@triton.jit
def _rms_row(x_ptr, w_ptr, out_ptr, DQ, eps, BDQ: tl.constexpr):
    """out[:DQ] = RMSNorm(x[:DQ]) * w (one row, f32)."""
    d = tl.arange(0, BDQ)
    m = d < DQ
    x = tl.load(x_ptr + d, mask=m, other=0.0).to(tl.float32)
    rs = _inv_rms(x, DQ, eps)
    tl.store(out_ptr + d, x * rs * tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32), mask=m)


@triton.jit
def _kv_norm_rope_fp8_kernel(
    kv_ptr, w_ptr, out_ptr, rows_ptr, pos_ptr, inv_ptr, D, R, eps, kv_stride,
    qa_ptr, qw_ptr, qn_ptr, DQ, qa_stride,
    BD: tl.constexpr, NB: tl.constexpr, QB: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr,
    BDQ: tl.constexpr = 0,
):  # fmt: skip
    """Program b: row b of kv (kv_stride apart) -> out row b, or (ROWS) out row rows[b]. BDQ > 0: also
    qn row b = RMSNorm(qa row b, qa_stride apart) * qw over DQ values (the q_a norm: qa_kv_norm_rope_fp8)."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    b = tl.program_id(0)
    if BDQ > 0:
        _rms_row(qa_ptr + b.to(tl.int64) * qa_stride, qw_ptr, qn_ptr + b.to(tl.int64) * DQ, DQ, eps, BDQ)
    dst = b * D
    if ROWS:
        dst = tl.load(rows_ptr + b).to(tl.int64) * D
    src = b.to(tl.int64) * kv_stride
    d = tl.arange(0, BD)
    x = tl.load(kv_ptr + src + d, mask=d < D, other=0.0).to(tl.float32)
    rs = _inv_rms(x, D, eps)
    idx = tl.arange(0, NB)[:, None] * QB + tl.arange(0, QB)[None, :]  # [NB, QB] nope blocks
    nm = idx < D - R
    y = tl.load(kv_ptr + src + idx, mask=nm, other=0.0).to(tl.float32) * rs
    y = y * tl.load(w_ptr + idx, mask=nm, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-4)  # [NB]
    sb = tl.div_rn(amax, 448.0).to(tl.int32, bitcast=True)
    sexp = ((sb >> 23) & 0xFF) + ((sb & 0x7FFFFF) != 0).to(tl.int32)  # 2^ceil(log2(amax / 448))
    scale = (sexp << 23).to(tl.float32, bitcast=True)[:, None]
    inv_scale = ((254 - sexp) << 23).to(tl.float32, bitcast=True)[:, None]  # exact 1 / scale
    q = _round_e4m3(tl.minimum(tl.maximum(y * inv_scale, -448.0), 448.0))
    tl.store(out_ptr + dst + idx, q * scale, mask=nm)
    pos = tl.load(pos_ptr + b).to(tl.float32)
    _rope_tail(kv_ptr, out_ptr, src, D, R, rs, w_ptr, pos, inv_ptr, HAS_W=True, BP=BP, dst_off=dst)


def _check_rope(name: str, D: int, pos: torch.Tensor, B: int, inv_freq: torch.Tensor) -> int:
    R = 2 * inv_freq.numel()
    _check(0 < R <= D, f"{name}: 2 * len(inv_freq) = {R} must be in 1..{D}")
    _check(pos.numel() == B, f"{name}: pos must have {B} entries, got {pos.numel()}")
    return R


def q_norm_rope(q: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, eps: float) -> torch.Tensor:
    """q [B, H, D] -> rope_tail(rms_norm(q, None, eps), pos, inv_freq) [B, H, D] f32; pos [B] int."""
    _check(q.ndim == 3, f"q_norm_rope: q must be [B, H, D], got {tuple(q.shape)}")
    B, H, D = q.shape
    R = _check_rope("q_norm_rope", D, pos, B, inv_freq)
    if not _use_triton(q):
        return ref.q_norm_rope(q, pos, inv_freq, eps)
    out = torch.empty(B, H, D, device=q.device, dtype=torch.float32)
    if B * H:
        _q_norm_rope_kernel[(B * H,)](
            q.contiguous(), out, pos.contiguous(), inv_freq.float().contiguous(), H, D, R, float(eps),
            BD=triton.next_power_of_2(D), BP=triton.next_power_of_2(R // 2), num_warps=4,
            launch_pdl=PDL,
        )  # fmt: skip
    return out


def o_unrope(o: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """o [B, H, D] f32 -> rope_tail(o, pos, inv_freq, inverse=True) [B, H, D] in `dtype` (the attention output
    de-rotated and rounded once for the output projection's GEMM); pos [B] int."""
    _check(o.ndim == 3, f"o_unrope: o must be [B, H, D], got {tuple(o.shape)}")
    B, H, D = o.shape
    R = _check_rope("o_unrope", D, pos, B, inv_freq)
    if not _use_triton(o):
        return ref.o_unrope(o, pos, inv_freq, dtype)
    out = torch.empty(B, H, D, device=o.device, dtype=dtype)
    if B * H:
        _o_unrope_kernel[(B * H,)](
            o.contiguous(), out, pos.contiguous(), inv_freq.float().contiguous(), H, D, R,
            BD=triton.next_power_of_2(D), BP=triton.next_power_of_2(R // 2), num_warps=4, launch_pdl=PDL,
        )  # fmt: skip
    return out


def kv_norm_rope_fp8(
    kv: torch.Tensor,
    weight: torch.Tensor,
    pos: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """kv [B, D] -> fp8_nope(rope_tail(rms_norm(kv, weight, eps), pos, inv_freq)) [B, D] f32.

    The first D - R dims get the FP8 E4M3 round trip (blocks of 64, power-of-two scales, RNE). out [M, D]
    f32 and rows [B] int64: row b is written to out[rows[b]] instead (the decode step's raw KV ring: no
    index_copy_ launch after it), and out is returned."""
    R = _check_kv(kv, weight, pos, inv_freq, out, rows)
    if not _use_triton(kv):
        return ref.kv_norm_rope_fp8(kv, weight, pos, inv_freq, eps, out, rows)
    dst = out if out is not None else torch.empty(kv.shape, device=kv.device, dtype=torch.float32)
    _kv_launch(kv, weight, pos, inv_freq, eps, R, dst, rows)
    return dst


def _check_kv(kv, weight, pos, inv_freq, out, rows) -> int:
    """kv_norm_rope_fp8's argument checks -> R."""
    _check(kv.ndim == 2, f"kv_norm_rope_fp8: kv must be [B, D], got {tuple(kv.shape)}")
    B, D = kv.shape
    R = _check_rope("kv_norm_rope_fp8", D, pos, B, inv_freq)
    _check((D - R) % FP8_BLOCK == 0, f"kv_norm_rope_fp8: nope width {D - R} not a multiple of {FP8_BLOCK}")
    _check(weight.numel() == D, f"kv_norm_rope_fp8: weight must have {D} entries, got {weight.numel()}")
    _check((out is None) == (rows is None), "kv_norm_rope_fp8: out and rows go together")
    if out is not None:
        _check(
            out.ndim == 2 and out.shape[1] == D and out.dtype == torch.float32 and out.is_contiguous(),
            f"kv_norm_rope_fp8: out must be a contiguous f32 [M, {D}], got {out.dtype} {tuple(out.shape)}",
        )
        _check(tuple(rows.shape) == (B,), f"kv_norm_rope_fp8: rows must be [{B}], got {tuple(rows.shape)}")
    return R


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x [B, n] with unit column stride as is (a column slice of a wider buffer), else a contiguous copy."""
    return x if x.stride(1) == 1 else x.contiguous()


def _kv_launch(kv, weight, pos, inv_freq, eps: float, R: int, dst, rows, qa=None, qa_weight=None, qn=None):
    """The _kv_norm_rope_fp8_kernel launch of kv_norm_rope_fp8 (qa, qa_weight, qn: qa_kv_norm_rope_fp8's)."""
    B, D = kv.shape
    kv = _rows_view(kv)
    if qa is None:
        qa, qa_weight, qn, DQ, BDQ = kv, weight, dst, 0, 0
    else:
        qa, DQ = _rows_view(qa), qa.shape[1]
        BDQ = triton.next_power_of_2(DQ)
    if B:
        _kv_norm_rope_fp8_kernel[(B,)](
            kv, weight.contiguous(), dst, rows.contiguous() if rows is not None else pos,
            pos.contiguous(), inv_freq.float().contiguous(), D, R, float(eps), kv.stride(0),
            qa, qa_weight.contiguous(), qn, DQ, qa.stride(0), BD=triton.next_power_of_2(D),
            NB=triton.next_power_of_2(max(1, (D - R) // FP8_BLOCK)), QB=FP8_BLOCK,
            BP=triton.next_power_of_2(R // 2), ROWS=rows is not None, BDQ=BDQ, num_warps=KV_ROW_WARPS,
            launch_pdl=PDL,
        )  # fmt: skip


def qa_kv_norm_rope_fp8(
    qa: torch.Tensor,
    qa_weight: torch.Tensor,
    kv: torch.Tensor,
    weight: torch.Tensor,
    pos: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qn [B, Dq] = rms_norm(qa, qa_weight, eps), kv_norm_rope_fp8(kv, weight, pos, inv_freq, eps, out,
    rows)) in one launch: the decode step's q_a norm rides on the kv row's kernel (one launch a layer fewer
    on the step's critical path). qa / kv may be column slices of one buffer (row stride kept)."""
    R = _check_kv(kv, weight, pos, inv_freq, out, rows)
    what = "qa_kv_norm_rope_fp8"
    _check(qa.ndim == 2 and qa.shape[0] == kv.shape[0], f"{what}: qa must be [B, Dq], got {tuple(qa.shape)}")
    _check(qa_weight.numel() == qa.shape[1], f"{what}: qa_weight must have {qa.shape[1]} entries")
    if not _use_triton(kv):
        return ref.qa_kv_norm_rope_fp8(qa, qa_weight, kv, weight, pos, inv_freq, eps, out, rows)
    qn = torch.empty(qa.shape, device=qa.device, dtype=torch.float32)
    _kv_launch(kv, weight, pos, inv_freq, eps, R, out, rows, qa, qa_weight, qn)
    return qn, out


def qk_norm_rope_fp8(q, kv, kv_weight, pos, inv_freq, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_norm_rope(q, ...), kv_norm_rope_fp8(kv, kv_weight, ...)): the attention rows of a decode step."""
    return q_norm_rope(q, pos, inv_freq, eps), kv_norm_rope_fp8(kv, kv_weight, pos, inv_freq, eps)


# ---------------------------------------------------------------------------------------------------------
# Router: sqrt(softplus) probabilities, biased top-k, normalised weights. One launch.


@triton.jit
def _sqrt_softplus(lg):
    """sqrt(softplus(lg)), the router's probabilities (torch softplus: linear past 20)."""
    ex = tl.exp(lg)
    u = 1.0 + ex
    log1p = tl.where(u == 1.0, ex, tl.log(u) * (ex / (u - 1.0)))  # accurate log1p(ex) (Goldberg's trick)
    return tl.sqrt_rn(tl.where(lg > 20.0, lg, log1p))


@triton.jit
def _router_kernel(
    logit_ptr, bias_ptr, ids_ptr, w_ptr, E, scale,
    HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr,
):  # fmt: skip
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    b = tl.program_id(0)
    e = tl.arange(0, BE)
    em = e < E
    prob = _sqrt_softplus(tl.load(logit_ptr + b * E + e, mask=em, other=0.0).to(tl.float32))
    sel = prob
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + e, mask=em, other=0.0).to(tl.float32)
    sel = tl.where(em, sel, float("-inf"))
    kk = tl.arange(0, BK)
    ids = tl.zeros([BK], tl.int32)
    wts = tl.zeros([BK], tl.float32)
    for j in tl.static_range(K):
        best = tl.max(sel, axis=0)
        pick = tl.min(tl.where(sel == best, e, BE), axis=0)  # ties -> the lower expert id
        pick = tl.minimum(pick, E - 1)  # NaN scores match nothing: keep the id in range for the gathers
        ids = tl.where(kk == j, pick, ids)
        wts = tl.where(kk == j, tl.sum(tl.where(e == pick, prob, 0.0), axis=0), wts)
        sel = tl.where(e == pick, float("-inf"), sel)
    _store_route(ids_ptr, w_ptr, b, ids, wts, scale, kk, K, NORMALIZE)


@triton.jit
def _store_route(ids_ptr, w_ptr, b, ids, wts, scale, kk, K: tl.constexpr, NORMALIZE: tl.constexpr):
    """Row b's ids [BK] and weights [BK] (normalised by their sum if NORMALIZE, times scale), first K."""
    if NORMALIZE:  # (wts is 0 past K)
        wts = wts / tl.sum(wts, axis=0)
    tl.store(ids_ptr + b * K + kk, ids, mask=kk < K)
    tl.store(w_ptr + b * K + kk, wts * scale, mask=kk < K)


@triton.jit
def _router_hash_kernel(
    logit_ptr, tid_ptr, tok_ptr, ids_ptr, w_ptr, E, V, scale,
    NORMALIZE: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """A hash layer's routing of row b: ids = tid2eid[token[b]] (tid [V, K]), weights = the sqrt(softplus)
    probabilities of those experts' logits (normalised, times scale). Out-of-range tokens / ids are clamped
    (the gathers stay in bounds; model tables never hold them)."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    b = tl.program_id(0)
    kk = tl.arange(0, BK)
    km = kk < K
    t = tl.minimum(tl.maximum(tl.load(tok_ptr + b).to(tl.int64), 0), V - 1)
    ids = tl.load(tid_ptr + t * K + kk, mask=km, other=0)
    ids = tl.minimum(tl.maximum(ids, 0), E - 1).to(tl.int32)
    prob = _sqrt_softplus(tl.load(logit_ptr + b * E + ids, mask=km, other=0.0).to(tl.float32))
    _store_route(ids_ptr, w_ptr, b, ids, tl.where(km, prob, 0.0), scale, kk, K, NORMALIZE)


def _route_out(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router kernels' outputs for logits [B, E]: ids [B, k] int32, weights [B, k] f32."""
    B = logits.shape[0]
    return (
        torch.empty(B, k, device=logits.device, dtype=torch.int32),
        torch.empty(B, k, device=logits.device, dtype=torch.float32),
    )


def router_topk(
    logits: torch.Tensor, bias: torch.Tensor | None, k: int, scale: float, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, E] -> (ids [B, k] int32, weights [B, k] f32) as ds4.model.moe.route (non-hash layers)."""
    _check(logits.ndim == 2, f"router_topk: logits must be [B, E], got {tuple(logits.shape)}")
    B, E = logits.shape
    _check(1 <= k <= E, f"router_topk: k must be in 1..{E}, got {k}")
    _check(bias is None or bias.numel() == E, f"router_topk: bias must have {E} entries")
    if not _use_triton(logits):
        return ref.router_topk(logits, bias, k, scale, normalize)
    ids, wts = _route_out(logits, k)
    if B:
        _router_kernel[(B,)](
            logits.contiguous(), bias.contiguous() if bias is not None else logits, ids, wts, E, float(scale),
            HAS_BIAS=bias is not None, NORMALIZE=normalize, K=k, BK=triton.next_power_of_2(k),
            BE=triton.next_power_of_2(E), num_warps=ROUTER_WARPS, launch_pdl=PDL,
        )  # fmt: skip
    return ids, wts


def router_hash(
    logits: torch.Tensor, tid2eid: torch.Tensor, tokens: torch.Tensor, scale: float, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """A hash layer's router (ds4.model.moe.route with tid2eid): logits [B, E], tid2eid [V, k] (integers),
    tokens [B] -> (ids [B, k] int32, weights [B, k] f32). One launch instead of ~8 torch kernels."""
    _check(logits.ndim == 2 and tid2eid.ndim == 2, "router_hash: logits [B, E] and tid2eid [V, k] expected")
    B, E = logits.shape
    V, k = tid2eid.shape
    _check(tokens.numel() == B, f"router_hash: {B} tokens expected, got {tokens.numel()}")
    if not _use_triton(logits):
        return ref.router_hash(logits, tid2eid, tokens, scale, normalize)
    ids, wts = _route_out(logits, k)
    if B:
        _router_hash_kernel[(B,)](
            logits.contiguous(), tid2eid.contiguous(), tokens.contiguous(), ids, wts, E, V, float(scale),
            NORMALIZE=normalize, K=k, BK=triton.next_power_of_2(k), num_warps=1, launch_pdl=PDL,
        )  # fmt: skip
    return ids, wts


__all__ = [
    "hc_head_fused",
    "hc_pre_fused",
    "hc_post_mix",
    "hc_post_fused",
    "q_norm_rope",
    "kv_norm_rope_fp8",
    "qa_kv_norm_rope_fp8",
    "qk_norm_rope_fp8",
    "router_hash",
    "router_topk",
]
