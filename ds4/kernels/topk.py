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

import os

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
    the top bin down) and how many lie in the bins above it."""
    NB: tl.constexpr = hist.shape[0]
    rev = tl.flip(hist, 0)  # rev[j] = hist[NB - 1 - j]
    j = tl.sum((tl.cumsum(rev, 0) < krem).to(tl.int32), 0)
    d = j * -1 + (NB - 1)  # the tensor first: constexpr - tensor stays a constexpr under the interpreter
    return d, tl.sum(tl.where(tl.arange(0, NB) < j, rev, 0), 0)


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


# ---------------------------------------------------------------------------------------------------------
# The same set for long rows, by several programs a row (select_rows_wide). Why: past SELECT_REG_MAX the
# one-program select streams the row from memory in every pass (n = 262,144: 941 us a call), so the decode
# step sorted those rows instead: torch's stable sort, ~10 launches a ratio-4 layer at 64k ctx (4 radix
# passes + 6 memsets, 40 us of kernels; H200, session 19 profile) and ~45 us at 1M. Here G <= WIDE_PROGRAMS
# programs a row each hold a chunk of C scores in registers and the passes are launches: a pass a digit
# (WIDE_DIGITS: 4 of 8 bits; each program histograms its chunk's scores that match the prefix so far; the
# next launch sums the G histograms and picks the digit), a counting pass (how many of each chunk lie above
# the threshold or equal it), and the write (each chunk's offset from the counts of the chunks before it):
# 6 launches, no atomics, no memsets, the same indices in the same (ascending) order as select_rows.
# H200, session 20 (11 / 11 / 10-bit digits, 5 launches), whole model: faster than the sort at 16,420
# scores (64k ctx, x1.037), slower at 32,770 and more (128k-1M ctx; 32 programs a row lost less, still
# lost): layer.INDEXER_WIDE_MAX keeps it to the rows where it won. Alone (tools/gpu/bench_topk_hc.py,
# eager: host launch costs of 5 launches included) 250-366 us a call up to 64k ctx, so time it in the
# graph-replayed step. Session 21, 11-bit digits: in that step at 64k ctx (tools/gpu/graph_timeline.py) its
# 5 launches added ~1.3 ms of the 8.6 ms (the 3 histogram passes ~1.1); shorter chunks (more programs a
# row: ab_decode.py "wide c1024" / "c512" / "c256") 115.84 / 113.34 / 107.22 vs 115.20 tok/s: not the
# chunk size but the bins (WIDE_DIGITS below).
WIDE_PROGRAMS = int(os.environ.get("DS4_WIDE_PROGRAMS", "16"))  # chunks a row at most (env: for A/B runs)
WIDE_MIN_CHUNK = 2048  # scores a program at least
WIDE_MAX = 1 << 18  # scores a row at most (262,144: a 1M-token context's ratio-4 rows); longer rows: the sort
# The digits of the passes, most significant first, as (shift, width): they tile bits 31..0. Session 20's
# 11 / 11 / 10 (5 launches) or 8-bit digits (4 passes + count + write: 6 launches): every program of a row
# sums all G histograms of the pass before it, so a pass's cost grows with its bins (session 21's chunk
# sizes at 64k ctx fit ~7 us a 2048-bin histogram pass + ~2 us a merge; 256 bins: sm_90 800 vs 2,176
# instructions a thread at C = 2,048, 8x less to merge). The same set either way (tests, and the whole-model
# bit check on the GPU). H200, session 21, whole model at 64k ctx (ab_decode.py, 2 rounds alike): 8-bit
# 127.91 vs 115.00 tok/s (x1.112); at 1,024-score chunks too 128.87 (x1.121 of the 11-bit; under the 1 %
# bar over 8-bit alone: chunks stay 2,048). On; env DS4_WIDE_DIGITS=11: the 11-bit digits.
WIDE_DIGITS_8 = ((24, 8), (16, 8), (8, 8), (0, 8))
WIDE_DIGITS_11 = ((21, 11), (10, 11), (0, 10))
WIDE_DIGITS = WIDE_DIGITS_11 if os.environ.get("DS4_WIDE_DIGITS", "8") == "11" else WIDE_DIGITS_8


@triton.jit
def _wide_chunk(score_ptr, stride, n, C: tl.constexpr):
    """(indices, valid, sortable bits) of this program's chunk of its row (program (g, b))."""
    g = tl.program_id(0)
    b = tl.program_id(1)
    return _load_chunk(score_ptr + b.to(tl.int64) * stride, g * C, n, C)


@triton.jit
def _wide_state(state_ptr, hist_ptr, G, K, BINS: tl.constexpr, SHIFT: tl.constexpr, WIDTH: tl.constexpr):
    """(prefix, pmask, krem) after the pass whose G histograms [G, BINS] of row b are at hist_ptr (bits SHIFT
    .. SHIFT + WIDTH - 1), from the state before it (state_ptr: prefix, pmask, krem of row b; the start when
    that pass was the first, its digit the top one)."""
    b = tl.program_id(1)
    if SHIFT + WIDTH == 32:
        prefix = tl.zeros([], tl.uint32)
        pmask = tl.zeros([], tl.uint32)
        krem = K
    else:
        prefix = tl.load(state_ptr + b * 3).to(tl.uint32, bitcast=True)
        pmask = tl.load(state_ptr + b * 3 + 1).to(tl.uint32, bitcast=True)
        krem = tl.load(state_ptr + b * 3 + 2)
    bins = tl.arange(0, BINS)
    hist = tl.zeros([BINS], tl.int32)
    row = hist_ptr + b.to(tl.int64) * G * BINS
    for q in range(G):
        hist += tl.load(row + q * BINS + bins)
    d, above = _pick_digit(hist, krem)
    krem -= above
    prefix |= d.to(tl.uint32) << SHIFT
    pmask |= tl.full([], (1 << WIDTH) - 1, tl.uint32) << SHIFT
    return prefix, pmask, krem


@triton.jit
def _wide_store_state(state_ptr, prefix, pmask, krem):
    """Program (0, b) records row b's state for the next launch (every program computed the same)."""
    b = tl.program_id(1)
    if tl.program_id(0) == 0:
        tl.store(state_ptr + b * 3, prefix.to(tl.int32, bitcast=True))
        tl.store(state_ptr + b * 3 + 1, pmask.to(tl.int32, bitcast=True))
        tl.store(state_ptr + b * 3 + 2, krem)


@triton.jit
def _wide_hist_kernel(
    score_ptr, stride, n, K, G, hist_in, state_in, hist_out, state_out,
    C: tl.constexpr, BINS: tl.constexpr, PREV: tl.constexpr, PREV_WIDTH: tl.constexpr, SHIFT: tl.constexpr,
    WIDTH: tl.constexpr,
):  # fmt: skip
    """Pass of bits SHIFT .. SHIFT + WIDTH - 1: program (g, b) histograms its chunk's scores whose higher bits
    equal row b's prefix into hist_out[b, g]; PREV (>= 0: the previous pass's shift, PREV_WIDTH its width):
    first the prefix from that pass (hist_in, state_in), recorded in state_out."""
    pdl_wait()  # the scores / histograms come from the kernel before (dispatch.PDL)
    prefix = tl.zeros([], tl.uint32)
    pmask = tl.zeros([], tl.uint32)
    if PREV >= 0:
        prefix, pmask, krem = _wide_state(state_in, hist_in, G, K, BINS, PREV, PREV_WIDTH)
        _wide_store_state(state_out, prefix, pmask, krem)
    i, valid, u = _wide_chunk(score_ptr, stride, n, C)
    keep = valid & ((u & pmask) == prefix)
    hist = tl.histogram(((u >> SHIFT) & ((1 << WIDTH) - 1)).to(tl.int32), BINS, mask=keep)
    b = tl.program_id(1)
    tl.store(hist_out + (b.to(tl.int64) * G + tl.program_id(0)) * BINS + tl.arange(0, BINS), hist)


@triton.jit
def _wide_count_kernel(
    score_ptr, stride, n, K, G, hist_in, state_in, cnt_ptr, state_out,
    C: tl.constexpr, BINS: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    """The last digit (bits 0 .. WIDTH - 1): row b's threshold (the K-th largest) and how many equal ones to
    take (state_out); program (g, b) counts its chunk's scores above / equal to it into cnt[b, g, 0 / 1]."""
    pdl_wait()
    thr, pmask, krem = _wide_state(state_in, hist_in, G, K, BINS, 0, WIDTH)
    _wide_store_state(state_out, thr, pmask, krem)
    i, valid, u = _wide_chunk(score_ptr, stride, n, C)
    at = cnt_ptr + (tl.program_id(1).to(tl.int64) * G + tl.program_id(0)) * 2
    tl.store(at, tl.sum((valid & (u > thr)).to(tl.int32), 0))
    tl.store(at + 1, tl.sum((valid & (u == thr)).to(tl.int32), 0))


@triton.jit
def _wide_write_kernel(
    score_ptr, stride, n, K, G, cnt_ptr, state_in, out_ptr, C: tl.constexpr, GP: tl.constexpr
):
    """Program (g, b) writes its chunk's selected indices at out[b, offset ...], offset = what the chunks
    before it select: their scores above the threshold and their share of the first krem equal ones."""
    pdl_wait()
    g = tl.program_id(0)
    b = tl.program_id(1)
    thr = tl.load(state_in + b * 3).to(tl.uint32, bitcast=True)
    krem = tl.load(state_in + b * 3 + 2)
    q = tl.arange(0, GP)
    before = q < g
    cnt = cnt_ptr + b.to(tl.int64) * G * 2 + q * 2
    gt = tl.load(cnt, mask=before, other=0)
    eq = tl.load(cnt + 1, mask=before, other=0)
    eq_before = tl.cumsum(eq, 0) - eq  # equal ones in the chunks before chunk q
    taken = tl.minimum(tl.maximum(krem - eq_before, 0), eq)  # chunk q's share of them
    i, valid, u = _wide_chunk(score_ptr, stride, n, C)
    dst = out_ptr + b.to(tl.int64) * K + tl.sum(gt + taken, 0)
    _select_write(dst, i, valid, u, thr, krem, tl.sum(eq, 0), 0)


def wide_plan(n: int) -> tuple[int, int]:
    """(C scores a program, G programs a row) of select_rows_wide for rows of n scores."""
    C = max(WIDE_MIN_CHUNK, triton.next_power_of_2(triton.cdiv(n, WIDE_PROGRAMS)))
    return C, triton.cdiv(n, C)


def select_rows_wide(score: torch.Tensor, k: int) -> torch.Tensor:
    """select_rows (the indices of the k largest, ties to the lower index, ascending) for long rows, by
    several programs a row: score [B, n] f32 (unit stride in the last dim) -> [B, k] int64."""
    _check(score.ndim == 2 and score.dtype == torch.float32, "select_rows_wide: score must be [B, n] float32")
    B, n = score.shape
    _check(0 < k <= n <= WIDE_MAX, f"select_rows_wide: need 0 < k <= n <= {WIDE_MAX}, got k={k}, n={n}")
    if not _use_triton(score) or B == 0:
        return ref.top_rows(score, k).sort(dim=-1).values
    if score.stride(1) != 1:
        score = score.contiguous()
    C, G = wide_plan(n)
    digits = _digits(WIDE_DIGITS)
    D, BINS, dev = len(digits), 1 << max(w for _, w in digits), score.device
    hist = torch.empty(2, B, G, BINS, dtype=torch.int32, device=dev)  # passes alternate between the two
    state = torch.empty(D, B, 3, dtype=torch.int32, device=dev)  # after each digit
    cnt = torch.empty(B, G, 2, dtype=torch.int32, device=dev)
    out = torch.empty(B, k, dtype=torch.int64, device=dev)
    launch = dict(num_warps=8 if C <= 4096 else 16, launch_pdl=PDL)  # a dict() call: test_pdl_wiring sees it
    args = (score, score.stride(0), n, k, G)
    for p, (shift, width) in enumerate(digits):
        prev, prev_width = digits[p - 1] if p else (-1, 0)
        _wide_hist_kernel[(G, B)](
            *args, hist[(p + 1) % 2], state[max(p - 2, 0)], hist[p % 2], state[max(p - 1, 0)],
            C=C, BINS=BINS, PREV=prev, PREV_WIDTH=prev_width, SHIFT=shift, WIDTH=width, **launch,
        )  # fmt: skip
    _wide_count_kernel[(G, B)](  # D >= 3 (_digits: at most 11 bits a digit)
        *args, hist[(D - 1) % 2], state[D - 2], cnt, state[D - 1],
        C=C, BINS=BINS, WIDTH=digits[-1][1], **launch,
    )  # fmt: skip
    gp = triton.next_power_of_2(G)
    _wide_write_kernel[(G, B)](*args, cnt, state[D - 1], out, C=C, GP=gp, **launch)
    return out


def _digits(digits: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """digits, checked: (shift, width) pairs, most significant first, tiling bits 31..0 (the last at 0)."""
    top = 32
    for shift, width in digits:
        _check(0 < width <= 11 and shift + width == top, f"wide select digits must tile bits 31..0: {digits}")
        top = shift
    _check(top == 0, f"wide select digits must end at bit 0: {digits}")
    return digits


__all__ = ["select_rows", "select_rows_wide", "top_rows", "supports"]
