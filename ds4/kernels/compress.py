"""The compressor's decode step in one launch: B tokens into their frontiers, rows where a window ends.

Legend: B rows of the step, S pool slots, r = ratio, c = 2 if r == 4 (overlapping windows) else 1, h = row
width (head_dim for the attention compressor, indexer_dim for the indexer's), cap = row capacity,
n = c r pooling candidates, R = n_rot, P = R / 2 rotated pairs.

compress_decode(kv_new, score_new, ape, fk, fs, rows, slot, pos, norm, inv_freq, eps, n_rot, indexer) updates
fk / fs / rows IN PLACE, row b touching only pool slot slot[b] (the model.md §6 compressor, one token):
  1. the token (kv_new[b], score_new[b] + ape[pos % r]) goes to frontier row (r if c == 2 else 0) + pos % r;
  2. the window's candidates are pooled by a softmax over candidates per column (c == 2: the previous
     window's first half fk[:r, :h] and this window's second half fk[r:, h:]; else all r rows);
  3. RMSNorm(norm), RoPE at pos - (r - 1) on the last R dims, then the FP8 E4M3 round trip of the first
     h - R dims (64-blocks) or, for the indexer, Hadamard-h + FP4 E2M1 (32-blocks);
  4. if pos % r == r - 1 the row is stored at rows[slot, min(pos // r, cap - 1)] and the frontier shifts
     (c == 2: current window -> previous, current emptied; else emptied): kv 0, score EMPTY_SCORE.
The torch version (ds4.model.cuda.batch._compress_step) is ~20-25 tiny kernels per
call; here one program per row b does it all (graph-capturable: no host sync, no data-dependent shape).
Padded rows of a batch may share a scratch slot; the slots of the other rows must be distinct. The frontier
rows after a token's row must be empty (kv 0, score EMPTY_SCORE), as the model always keeps them: the
kernel reads rows up to the token's only (at r = 128 about half the frontier on average).

Exactness: the FP8/FP4 steps are exact given their inputs (power-of-two scales from the exponent bits,
correctly rounded divisions, RNE by the 2^23 trick, the Hadamard as the same butterfly); the pooled sums,
the RMS sum and cos/sin may differ from torch's by float32 ulps, which moves a quantized value by a step only
near a rounding midpoint (tests/test_kernels_compress.py counts those). The twin `ref.compress_decode` is
plain torch (ds4.model.quantsim for the indexer's QAT, as the reference model); it is the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ref
from .dispatch import PDL, pdl_wait
from .dispatch import require as _check
from .dispatch import use_triton as _use_triton
from .fused import _round_e4m3

EMPTY_SCORE = -1e30  # = ds4.model.state.EMPTY_SCORE: an empty frontier row's score (softmax weight 0)
_EMPTY = tl.constexpr(EMPTY_SCORE)  # the same, readable inside the kernel
FP8_BLOCK, FP4_BLOCK = 64, 32
FP4_AMAX_FLOOR = 6.0 * torch.finfo(torch.float32).tiny
TILE = 4096  # elements of one [rows, columns] tile (pooling: candidates x h; shift: frontier rows x c h)


# ---------------------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _pow2_ceil_scale(amax, div):
    """(2^ceil(log2(amax / div)), its exact inverse) for amax / div a normal float32 (amax / div rounded)."""
    sb = tl.div_rn(amax, div).to(tl.int32, bitcast=True)
    sexp = ((sb >> 23) & 0xFF) + ((sb & 0x7FFFFF) != 0).to(tl.int32)
    return (sexp << 23).to(tl.float32, bitcast=True), ((254 - sexp) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_nope_row(y, H: tl.constexpr, NROT: tl.constexpr, BH: tl.constexpr):
    """FP8 E4M3 round trip (64-blocks) of the first H - NROT values of a row y [BH]; the rest unchanged."""
    y3 = tl.reshape(y, (BH // 64, 64))
    blk = tl.arange(0, BH // 64)
    nope = (blk + 1) * 64 <= H - NROT  # [BH/64] whole blocks of nope dims
    amax = tl.maximum(tl.max(tl.abs(y3), axis=1), 1e-4)
    scale, inv = _pow2_ceil_scale(amax, 448.0)
    q = _round_e4m3(tl.minimum(tl.maximum(y3 * inv[:, None], -448.0), 448.0)) * scale[:, None]
    return tl.reshape(tl.where(nope[:, None], q, y3), (BH,))


@triton.jit
def _hadamard_fp4_row(y, H: tl.constexpr, LOG2H: tl.constexpr, hscale, fp4_floor):
    """Hadamard-H (natural-order butterfly, then * H^-1/2), then the FP4 E2M1 round trip (32-blocks) of y."""
    k = tl.arange(0, 2)[None, :, None]
    for st in tl.static_range(LOG2H):  # stage st: pairs (i, i + 2^st) in blocks of 2^(st+1) -> (a+b, a-b)
        y3 = tl.reshape(y, (H // (2 << st), 2, 1 << st))
        a = tl.sum(tl.where(k == 0, y3, 0.0), axis=1)[:, None, :]
        b = tl.sum(tl.where(k == 1, y3, 0.0), axis=1)[:, None, :]
        y = tl.reshape(tl.where(k == 0, a + b, a - b), (H,))
    y = y * hscale
    y2 = tl.reshape(y, (H // 32, 32))
    amax = tl.maximum(tl.max(tl.abs(y2), axis=1), fp4_floor)
    scale, inv = _pow2_ceil_scale(amax, 6.0)
    v = tl.minimum(tl.maximum(y2 * inv[:, None], -6.0), 6.0)
    a = tl.abs(v)
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))  # E2M1 spacing of |v|'s binade
    r = ((a * (1.0 / step) + 8388608.0) - 8388608.0) * step  # a / step exactly, RNE to an integer
    return tl.reshape(tl.where(v < 0, -r, r) * scale[:, None], (H,))


@triton.jit
def _compress_decode_kernel(
    kvn_ptr, scn_ptr, ape_ptr, fk_ptr, fs_ptr, rows_ptr, slot_ptr, pos_ptr, norm_ptr, inv_ptr,
    cap, skv, ssc, eps, hscale, fp4_floor,
    R: tl.constexpr, H: tl.constexpr, NROT: tl.constexpr, C: tl.constexpr, INDEXER: tl.constexpr,
    HAS_SLOT: tl.constexpr, LOG2H: tl.constexpr, CH: tl.constexpr, SH: tl.constexpr, BH: tl.constexpr,
    BW: tl.constexpr,
):  # fmt: skip
    """Program b: token b into frontier slot[b], the pooled row, the store of a finished window, the shift."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    b = tl.program_id(0)
    NC: tl.constexpr = C * R  # candidates = frontier rows
    W: tl.constexpr = C * H  # frontier width
    OFF: tl.constexpr = (C - 1) * H  # column of the current window's candidate half
    CUR: tl.constexpr = (C - 1) * R  # first frontier row of the current window
    p = tl.load(pos_ptr + b).to(tl.int64)
    if HAS_SLOT:
        s = tl.load(slot_ptr + b).to(tl.int64)
    else:
        s = p * 0  # the single state's slot 0
    m = p % R
    at = CUR + m  # frontier row of this token
    done = m == R - 1
    front = s * (NC * W)
    col = tl.arange(0, BH)
    cm = col < H
    # this token's candidate columns (substituted for row `at` below: it is only stored at the end)
    kn = tl.load(kvn_ptr + b * skv + OFF + col, mask=cm, other=0.0)
    sn = tl.load(scn_ptr + b * ssc + OFF + col, mask=cm, other=0.0)
    sn += tl.load(ape_ptr + m * W + OFF + col, mask=cm, other=0.0)

    # softmax pooling over the candidates per column, online over chunks of CH candidates. Only rows
    # 0..at are read: the rows after this token's are empty (kv 0, score EMPTY_SCORE, softmax weight exactly
    # 0) in every frontier the model keeps, and the CPU reference (compress_chunk) never reads them.
    mx = tl.full([BH], -1e38, tl.float32)  # below EMPTY_SCORE: finite, so masked columns never give NaN
    den = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH], tl.float32)
    n_read = (at + 1).to(tl.int32)
    for j0 in range(0, n_read, CH):
        j = j0 + tl.arange(0, CH)
        off = front + j[:, None] * W + (j >= R).to(tl.int32)[:, None] * OFF + col[None, :]
        msk = (j < n_read)[:, None] & cm[None, :]
        sc = tl.load(fs_ptr + off, mask=msk, other=float("-inf"))
        kv = tl.load(fk_ptr + off, mask=msk, other=0.0)
        sc = tl.where(j[:, None] == at, sn[None, :], sc)
        kv = tl.where(j[:, None] == at, kn[None, :], kv)
        mx_new = tl.maximum(mx, tl.max(sc, axis=0))
        alpha = tl.exp(mx - mx_new)
        e = tl.exp(sc - mx_new[None, :])
        den = den * alpha + tl.sum(e, axis=0)
        acc = acc * alpha + tl.sum(kv * e, axis=0)
        mx = mx_new
    pooled = tl.where(cm, acc / den, 0.0)  # [BH]

    # RMSNorm with weight, RoPE of the tail at the window's first position
    rs = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(pooled * pooled, axis=0), H * 1.0) + eps))
    y = pooled * rs * tl.load(norm_ptr + col, mask=cm, other=0.0)
    ya, yb = tl.split(tl.reshape(y, (BH // 2, 2)))  # adjacent pairs (2i, 2i + 1)
    i = tl.arange(0, BH // 2)
    jr = i - (H - NROT) // 2  # pair index inside the RoPE tail
    rot = (jr >= 0) & (i < H // 2)
    ang = (p - (R - 1)).to(tl.float32) * tl.load(inv_ptr + jr, mask=rot, other=0.0)
    cs = tl.cos(ang)
    sn_ = tl.sin(ang)
    ra = tl.where(rot, ya * cs - yb * sn_, ya)
    rb = tl.where(rot, ya * sn_ + yb * cs, yb)
    y = tl.reshape(tl.join(ra, rb), (BH,))
    if INDEXER:
        y = _hadamard_fp4_row(y, H, LOG2H, hscale, fp4_floor)
    else:
        y = _fp8_nope_row(y, H, NROT, BH)
    idx = tl.minimum(p // R, cap - 1)
    tl.store(rows_ptr + (s * cap + idx) * H + col, y, mask=cm & done)

    # frontier: the token's row, or (window done) the shift; one barrier orders the loads above first
    tl.debug_barrier()
    wc = tl.arange(0, BW)
    wm = wc < W
    kw = tl.load(kvn_ptr + b * skv + wc, mask=wm, other=0.0)
    sw = tl.load(scn_ptr + b * ssc + wc, mask=wm, other=0.0) + tl.load(
        ape_ptr + m * W + wc, mask=wm, other=0.0
    )
    tl.store(fk_ptr + front + at * W + wc, kw, mask=wm & (m != R - 1))
    tl.store(fs_ptr + front + at * W + wc, sw, mask=wm & (m != R - 1))
    if C == 2:  # previous window <- current window (its last row is this token)
        j = tl.arange(0, SH)
        for j0 in tl.static_range(0, R, SH):
            jj = j0 + j
            src = front + (R + jj)[:, None] * W + wc[None, :]
            dst = front + jj[:, None] * W + wc[None, :]
            msk = (jj < R)[:, None] & wm[None, :] & done
            last = (R + jj)[:, None] == at
            kv = tl.where(last, kw[None, :], tl.load(fk_ptr + src, mask=msk, other=0.0))
            sc = tl.where(last, sw[None, :], tl.load(fs_ptr + src, mask=msk, other=0.0))
            tl.store(fk_ptr + dst, kv, mask=msk)
            tl.store(fs_ptr + dst, sc, mask=msk)
        tl.debug_barrier()  # the loads of the current rows come before their emptying
    j = tl.arange(0, SH)
    for j0 in tl.static_range(0, R, SH):
        jj = j0 + j
        dst = front + (CUR + jj)[:, None] * W + wc[None, :]
        msk = (jj < R)[:, None] & wm[None, :] & done
        tl.store(fk_ptr + dst, tl.zeros([SH, BW], tl.float32), mask=msk)
        tl.store(fs_ptr + dst, tl.full([SH, BW], _EMPTY, tl.float32), mask=msk)


# ---------------------------------------------------------------------------------------------------------
# Dispatcher and twin


def _shapes(kv_new, score_new, ape, fk, fs, rows, slot, pos, norm, inv_freq, n_rot, indexer):
    """(B, S, r, c, h, cap) after checking every argument's shape against the others."""
    _check(
        fk.ndim == 3 and fs.shape == fk.shape,
        f"compress_decode: fk/fs must be [S, c r, c h], got {tuple(fk.shape)} and {tuple(fs.shape)}",
    )
    _check(rows.ndim == 3, f"compress_decode: rows must be [S, cap, h], got {tuple(rows.shape)}")
    S, cap, h = rows.shape
    _check(fk.shape[0] == S, f"compress_decode: fk has {fk.shape[0]} slots, rows {S}")
    c = fk.shape[2] // h
    _check(
        c in (1, 2) and fk.shape[2] == c * h and fk.shape[1] % c == 0,
        f"compress_decode: frontier {tuple(fk.shape[1:])} does not fit rows of width {h}",
    )
    r = fk.shape[1] // c
    _check((c == 2) == (r == 4), f"compress_decode: overlap (c = 2) iff ratio 4, got c = {c}, r = {r}")
    _check(
        kv_new.ndim == 2 and kv_new.shape[1] == c * h and score_new.shape == kv_new.shape,
        f"compress_decode: kv_new/score_new must be [B, {c * h}], got {tuple(kv_new.shape)} and "
        f"{tuple(score_new.shape)}",
    )
    B = kv_new.shape[0]
    _check(
        tuple(ape.shape) == (r, c * h), f"compress_decode: ape must be {(r, c * h)}, got {tuple(ape.shape)}"
    )
    _check(pos.numel() == B, f"compress_decode: pos must have {B} entries, got {pos.numel()}")
    _check(slot is not None or S == 1, f"compress_decode: slot=None needs one pool slot, got {S}")
    _check(slot is None or slot.numel() == B, f"compress_decode: slot must have {B} entries")
    _check(norm.numel() == h, f"compress_decode: norm must have {h} entries, got {norm.numel()}")
    _check(
        2 * inv_freq.numel() == n_rot and 0 < n_rot <= h,
        f"compress_decode: n_rot {n_rot} must be 2 * len(inv_freq) ({inv_freq.numel()}) and <= {h}",
    )
    if indexer:
        _check(
            h >= FP4_BLOCK and h & (h - 1) == 0,
            f"compress_decode: indexer rows need a power-of-two width >= {FP4_BLOCK} (Hadamard), got {h}",
        )
    else:
        _check(
            (h - n_rot) % FP8_BLOCK == 0,
            f"compress_decode: nope width {h - n_rot} is not a multiple of {FP8_BLOCK}",
        )
    return B, S, r, c, h, cap


def _rows_f32(t: torch.Tensor) -> torch.Tensor:
    """t [B, n] as float32 with unit column stride (its row stride is passed to the kernel)."""
    t = t.float()
    return t if t.stride(-1) == 1 else t.contiguous()


def compress_decode(
    kv_new: torch.Tensor,
    score_new: torch.Tensor,
    ape: torch.Tensor,
    fk: torch.Tensor,
    fs: torch.Tensor,
    rows: torch.Tensor,
    slot: torch.Tensor | None,
    pos: torch.Tensor,
    norm: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    n_rot: int,
    indexer: bool,
) -> None:
    """One token per row b into frontier slot[b] (fk/fs [S, c r, c h], rows [S, cap, h], all f32 and
    contiguous, updated in place); kv_new/score_new [B, c h] (score before ape), ape [r, c h], slot/pos [B]
    int (slot None: the one slot 0 of a single state), norm [h], inv_freq [R/2]."""
    B, S, r, c, h, cap = _shapes(
        kv_new, score_new, ape, fk, fs, rows, slot, pos, norm, inv_freq, n_rot, indexer
    )
    _check(
        all(t.dtype == torch.float32 and t.is_contiguous() for t in (fk, fs, rows)),
        "compress_decode: fk, fs and rows must be contiguous float32 (they are updated in place)",
    )
    if not _use_triton(fk):
        ref.compress_decode(
            kv_new, score_new, ape, fk, fs, rows, slot, pos, norm, inv_freq, eps, n_rot, indexer
        )
        return
    if B == 0:
        return
    kv_new, score_new = (_rows_f32(t) for t in (kv_new, score_new))  # column slices of a wider matvec ok
    f32 = [t.float().contiguous() for t in (ape, norm, inv_freq)]
    BH, BW = triton.next_power_of_2(h), triton.next_power_of_2(c * h)
    _compress_decode_kernel[(B,)](
        kv_new, score_new, f32[0], fk, fs, rows, slot.contiguous() if slot is not None else pos,
        pos.contiguous(), f32[1], f32[2], cap, kv_new.stride(0), score_new.stride(0), float(eps),
        float(h**-0.5), FP4_AMAX_FLOOR,
        R=r, H=h, NROT=n_rot, C=c, INDEXER=bool(indexer), HAS_SLOT=slot is not None,
        LOG2H=max(1, h.bit_length() - 1), CH=min(max(1, TILE // BH), triton.next_power_of_2(c * r)),
        SH=min(max(1, TILE // BW), triton.next_power_of_2(r)), BH=BH, BW=BW, num_warps=8 if h >= 512 else 4,
        launch_pdl=PDL,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# The indexer's query: the same RoPE + Hadamard + FP4 as its rows (model.md §7), one launch.


@triton.jit
def _indexer_q_kernel(
    q_ptr, out_ptr, pos_ptr, inv_ptr, Hi, hscale, fp4_floor,
    D: tl.constexpr, NROT: tl.constexpr, LOG2D: tl.constexpr,
):  # fmt: skip
    """Program row = b Hi + h: out[row] = indexer_qat(rope_tail(q[row], pos[b])) (D a power of two)."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, D)
    y = tl.load(q_ptr + row * D + col).to(tl.float32)
    ya, yb = tl.split(tl.reshape(y, (D // 2, 2)))  # adjacent pairs (2i, 2i + 1)
    jr = tl.arange(0, D // 2) - (D - NROT) // 2  # pair index inside the RoPE tail
    rot = jr >= 0
    ang = tl.load(pos_ptr + row // Hi).to(tl.float32) * tl.load(inv_ptr + jr, mask=rot, other=0.0)
    cs = tl.cos(ang)
    sn = tl.sin(ang)
    y = tl.reshape(tl.join(tl.where(rot, ya * cs - yb * sn, ya), tl.where(rot, ya * sn + yb * cs, yb)), (D,))
    tl.store(out_ptr + row * D + col, _hadamard_fp4_row(y, D, LOG2D, hscale, fp4_floor))


def indexer_q(qi: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """qi [B, Hi, Di] (any float dtype) -> indexer_qat(rope_tail(qi, pos, inv_freq)) [B, Hi, Di] f32: RoPE on
    the last 2 len(inv_freq) dims, Hadamard-Di, FP4 E2M1 round trip (32-blocks); pos [B] int; Di a power of
    two >= 32. Exact as compress_decode's rows: cos / sin may differ from torch's by an ulp."""
    _check(qi.ndim == 3, f"indexer_q: qi must be [B, Hi, Di], got {tuple(qi.shape)}")
    B, Hi, D = qi.shape
    R = 2 * inv_freq.numel()
    _check(D >= FP4_BLOCK and D & (D - 1) == 0, f"indexer_q: Di must be a power of two >= 32, got {D}")
    _check(0 < R <= D and pos.numel() == B, f"indexer_q: need 2 * len(inv_freq) in 1..{D} and pos [{B}]")
    if not _use_triton(qi):
        return ref.indexer_q(qi, pos, inv_freq)
    out = torch.empty(B, Hi, D, device=qi.device, dtype=torch.float32)
    if B * Hi:
        _indexer_q_kernel[(B * Hi,)](
            qi.contiguous(), out, pos.contiguous(), inv_freq.float().contiguous(), Hi, float(D**-0.5),
            FP4_AMAX_FLOOR, D=D, NROT=R, LOG2D=D.bit_length() - 1, num_warps=4, launch_pdl=PDL,
        )  # fmt: skip
    return out


__all__ = ["compress_decode", "indexer_q"]
