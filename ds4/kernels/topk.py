"""The decode indexer's top-k rows: the k largest of each row's scores, in the order of a stable descending
sort (ties to the lower index), by Triton's bitonic top-k over unique int64 keys.

Legend: B rows, n scores per row, k kept (a power of two), C keys per program (a power of two >= k).

torch's stable sort of every compressed row (the twin, ref.top_rows) was a 25 us radix sort per ratio-4 layer
at 8k context on the H200 (21 calls per token; session 11 profile), and torch.topk was slower still. Here
each score becomes a unique key (the float's order-preserving bits above 2^31 - 1 - index, so equal scores
rank the lower index first) and a program keeps the top k of C keys with tl.topk (sorted, descending). Rows
of more than C scores go in rounds: each chunk of C keeps its k best, until one chunk is left. No host sync,
shapes fixed by (B, n, k): a CUDA graph can capture it. Measured slower than the sort in the model (69 vs
25 us a call at 8k ctx, H200, session 11): off by default (ds4.model.cuda.layer.TOPK_KERNEL).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ref
from .dispatch import PDL, pdl_wait
from .dispatch import require as _check
from .dispatch import use_triton as _use_triton

TOPK_CHUNK = 4096  # keys per program: 16 int64 a thread at TOPK_WARPS = 8
TOPK_WARPS = 8


@triton.jit
def _pad():
    """Below every real key: -2^63."""
    return -9223372036854775807 - 1


@triton.jit
def _score_keys(score_ptr, i, valid):
    """Unique int64 keys of the scores at i (valid), as (score desc, index asc); _pad() elsewhere."""
    s = tl.load(score_ptr + i, mask=valid, other=0.0) + 0.0  # + 0.0: -0.0 -> +0.0 (the sort ties them)
    bits = s.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    key = (ordered << 32) | (0x7FFFFFFF - i.to(tl.int64))  # lower index -> larger key
    return tl.where(valid, key, _pad())


@triton.jit
def _topk_kernel(
    src_ptr, dst_ptr, n, stride_src, chunks,
    C: tl.constexpr, K: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
):  # fmt: skip
    """Program (b, chunk c): the K largest keys of row b's elements [c C, (c + 1) C) of n. FIRST: src is the
    f32 scores [B, stride_src], else keys [B, n] int64. LAST (one chunk): dst gets the K indices [B, K]
    int64, else keys [B, chunks, K]."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    i = c * C + tl.arange(0, C)
    valid = i < n
    if FIRST:
        keys = _score_keys(src_ptr + b.to(tl.int64) * stride_src, i, valid)
    else:
        keys = tl.load(src_ptr + b.to(tl.int64) * n + i, mask=valid, other=_pad())
    top = tl.topk(keys, K)  # [K] descending
    j = tl.arange(0, K)
    if LAST:
        tl.store(dst_ptr + b.to(tl.int64) * K + j, 0x7FFFFFFF - (top & 0xFFFFFFFF))
    else:
        tl.store(dst_ptr + (b.to(tl.int64) * chunks + c) * K + j, top)


def supports(n: int, k: int) -> bool:
    """Whether the kernel takes n scores per row and k kept: k a power of two, k <= n, within one chunk."""
    return 0 < k <= min(n, TOPK_CHUNK) and k & (k - 1) == 0 and n < (1 << 31)


def top_rows(score: torch.Tensor, k: int) -> torch.Tensor:
    """score [B, n] f32 (rows may be a column slice: unit stride in the last dim) -> [B, k] int64 indices
    of the k largest, in stable descending order (= ref.top_rows). Triton on CUDA when supports(n, k)."""
    _check(score.ndim == 2 and score.dtype == torch.float32, "top_rows: score must be [B, n] float32")
    B, n = score.shape
    _check(0 < k <= n, f"top_rows: need 0 < k <= n, got k={k}, n={n}")
    if not (_use_triton(score) and supports(n, k)) or B == 0:
        return ref.top_rows(score, k)
    if score.stride(1) != 1:
        score = score.contiguous()
    src, stride, first = score, score.stride(0), True
    while True:
        C = min(TOPK_CHUNK, max(k, triton.next_power_of_2(n)))
        chunks = triton.cdiv(n, C)
        last = chunks == 1
        dst = torch.empty((B, k) if last else (B, chunks, k), dtype=torch.int64, device=score.device)
        _topk_kernel[(B, chunks)](
            src, dst, n, stride, chunks, C=C, K=k, FIRST=first, LAST=last, num_warps=TOPK_WARPS,
            launch_pdl=PDL,
        )  # fmt: skip
        if last:
            return dst
        src, n, stride, first = dst, chunks * k, chunks * k, False


# ---------------------------------------------------------------------------------------------------------
# The top-k as a set, by radix select: the k-th largest score found 8 bits at a time (4 histogram passes over
# the row, each keeping the rows whose higher bits equal the chosen prefix), then one pass that writes the
# indices of every score above it and of the lowest-indexed equal ones, in index order. Why: the attention
# reads the selected rows as a set (visibility per row, one softmax over all), so the sort's order is not
# needed; a sort of every compressed row cost 22.5 us per ratio-4 layer at 4k ctx (H200, session 17 profile:
# torch's radixSortKVInPlace, 21 calls per token), a select is ~5 passes of one program per row. Rows longer
# than SELECT_CHUNK are streamed from memory in every pass, one chunk after another: H200 (bench_topk_hc.py,
# launch included) n = 1,024 / 2,048 60.3 / 51.8 us vs the sort's 74.8 / 62.6, n = 16,384 89.6 vs 71.7,
# n = 262,144 941 vs 82: the decode step takes it only for rows of up to layer.INDEXER_SELECT_MAX scores.
SELECT_CHUNK = 4096  # scores per pass step of a streamed row (16 a thread at SELECT_WARPS)
SELECT_WARPS = 8
# Rows of up to this many scores stay in registers (from 8,192 at 16 warps: 16 or 32 a thread; sm_90 build at
# 16,384: 128 registers and 328 bytes of stack). H200, session 18 (bench_topk_hc.py): n = 16,384 77.6 us vs
# 90.4 for the stable sort, but the whole model at 64k ctx with the decode step taking it (ab_decode.py
# "select 16k") 102.64 vs 102.74 tok/s with the sort: no gain, so layer.INDEXER_SELECT_MAX stays 4,096.
SELECT_REG_MAX = 16384


@triton.jit
def _sortable(s):
    """f32 -> uint32 in the same order, -0.0 as +0.0 (the sort ties them)."""
    u = (s + 0.0).to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _load_chunk(row_ptr, c0, n, C: tl.constexpr):
    """(indices i [C], valid [C], sortable bits [C]) of scores c0 .. c0 + C of the row."""
    i = c0 + tl.arange(0, C)
    valid = i < n
    return i, valid, _sortable(tl.load(row_ptr + i, mask=valid, other=float("-inf")))


@triton.jit
def _digit_hist(u, valid, prefix, pmask, SHIFT: tl.constexpr):
    """Histogram [256] of bits SHIFT .. SHIFT + 7 of the valid u whose bits above them equal prefix."""
    keep = valid & ((u & pmask) == prefix)
    return tl.histogram(((u >> SHIFT) & 0xFF).to(tl.int32), 256, mask=keep)


@triton.jit
def _pick_digit(hist, krem):
    """(d, n_above): the digit whose bin holds the krem-th largest of the histogram's values (counted from
    bin 255 down) and how many lie in the bins above it."""
    rev = tl.flip(hist, 0)  # rev[j] = hist[255 - j]
    j = tl.sum((tl.cumsum(rev, 0) < krem).to(tl.int32), 0)
    return 255 - j, tl.sum(tl.where(tl.arange(0, 256) < j, rev, 0), 0)


@triton.jit
def _select_kernel(score_ptr, out_ptr, n, stride, K, C: tl.constexpr, ONE: tl.constexpr):
    """Program b: out[b, :K] = the indices of row b's K largest scores (of n; ties to the lower index) in
    ascending index order. ONE (n <= C): the row is loaded once and kept in registers."""
    pdl_wait()  # the scores come from the previous kernel (dispatch.PDL)
    b = tl.program_id(0)
    row = score_ptr + b.to(tl.int64) * stride
    dst = out_ptr + b.to(tl.int64) * K
    if ONE:
        i, valid, u = _load_chunk(row, 0, n, C)
    prefix = tl.zeros([], tl.uint32)
    pmask = tl.zeros([], tl.uint32)
    krem = K  # how many of the rows matching prefix are still to be taken
    for p in tl.static_range(4):  # bits 31..24, 23..16, 15..8, 7..0
        if ONE:
            hist = _digit_hist(u, valid, prefix, pmask, 24 - 8 * p)
        else:
            hist = tl.zeros([256], tl.int32)
            for c0 in range(0, n, C):
                i, valid, u = _load_chunk(row, c0, n, C)
                hist += _digit_hist(u, valid, prefix, pmask, 24 - 8 * p)
        d, above = _pick_digit(hist, krem)
        krem -= above
        prefix |= d.to(tl.uint32) << (24 - 8 * p)
        pmask |= tl.full([], 0xFF, tl.uint32) << (24 - 8 * p)
    # prefix is now the K-th largest value; krem of the values equal to it are taken, the lowest-indexed
    if ONE:
        _select_write(dst, i, valid, u, prefix, krem, 0, 0)
    else:
        taken_eq = 0
        written = 0
        for c0 in range(0, n, C):
            i, valid, u = _load_chunk(row, c0, n, C)
            taken_eq, written = _select_write(dst, i, valid, u, prefix, krem, taken_eq, written)


@triton.jit
def _select_write(dst, i, valid, u, thr, krem, taken_eq, written):
    """Write the chunk's selected indices (u above thr, or equal to it within the first krem equal ones of
    the row) at dst[written ...]; returns the updated (equal ones seen, written)."""
    eq = valid & (u == thr)
    eq_rank = tl.cumsum(eq.to(tl.int32), 0) + taken_eq  # 1-based among the row's equal ones
    sel = (valid & (u > thr)) | (eq & (eq_rank <= krem))
    sel_i = sel.to(tl.int32)
    tl.store(dst + written + tl.cumsum(sel_i, 0) - 1, i.to(tl.int64), mask=sel)
    return taken_eq + tl.sum(eq.to(tl.int32), 0), written + tl.sum(sel_i, 0)


def select_rows(score: torch.Tensor, k: int) -> torch.Tensor:
    """score [B, n] f32 (rows may be a column slice: unit stride in the last dim) -> [B, k] int64: the
    indices of ref.top_rows(score, k) (the k largest, ties to the lower index) in ascending order."""
    _check(score.ndim == 2 and score.dtype == torch.float32, "select_rows: score must be [B, n] float32")
    B, n = score.shape
    _check(0 < k <= n < (1 << 31), f"select_rows: need 0 < k <= n < 2^31, got k={k}, n={n}")
    if not _use_triton(score) or B == 0:
        return ref.top_rows(score, k).sort(dim=-1).values
    if score.stride(1) != 1:
        score = score.contiguous()
    out = torch.empty(B, k, dtype=torch.int64, device=score.device)
    one = n <= SELECT_REG_MAX
    C = triton.next_power_of_2(n) if one else SELECT_CHUNK
    warps = SELECT_WARPS if C <= SELECT_CHUNK else 16  # 16 scores a thread up to C = SELECT_CHUNK
    _select_kernel[(B,)](score, out, n, score.stride(0), k, C=C, ONE=one, num_warps=warps, launch_pdl=PDL)
    return out


__all__ = ["select_rows", "top_rows", "supports"]
