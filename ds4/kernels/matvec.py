"""Fused dequant x matvec for decode (B = 1..64 activation rows) on packed weights (ds4.kernels.packing).

out[b, n] = sum_k x[b, k] * W[n, k], f32 accumulation, W dequantized tile by tile in registers (never in
memory). Two inner products:
  * x f32, or B <= 4: CUDA-core FMAs in f32 (bf16 x upcast, exact): f32-accurate, right when weight bytes
    bound the time; x f32 with B > 4 runs in chunks of 4 rows (each chunk dequantizes the tile again);
  * x bf16 and B > 4: tensor cores (tl.dot, bf16 x bf16 with the W tile rounded to bf16, f32 accumulation),
    so that the multiply cost does not grow with B. (tf32x3 for f32 x spills registers at these tile sizes.)
Split-K (partial sums in a [S, B, N] buffer, summed over S in split order) keeps >= ~1000 programs in flight
for short N; the sum runs inside the kernel (split_fixup, switch Q8_FIXUP) or as a torch sum after it.

The jit helper ``dot_rows`` is shared with moe.py and matmul.py: it adds x[rows] @ W[rows]^T for one tile of
weight rows over a range of k-tiles, for every supported qtype. Element order inside a ggml block is not k
order for Q2_K / Q4_K: the helper dequantizes in storage order and gathers the matching x columns instead.

Legend: B activation rows, N output rows, K row length, BB/BN rows per program, TK elements per k-tile.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ds4.quant.types import GGMLType

from . import ref
from .dispatch import PDL, pdl_wait, use_triton
from .intq import _dot4, dp4a_ok, quantize_q8k
from .packing import PLAIN_DTYPES, PackedWeight, iq2xxs_grid_i64

TARGET_PROGRAMS = 1024  # ~8 per SM on an H200 (132 SMs): enough loads in flight to reach peak bandwidth
# Weight rows per program at B = 1 (DECODE_ROWS / BB for BB rows of x). 16 keeps IQ2_XXS at ~100 registers a
# thread on sm_90 (193 at 32), so more programs fit per SM; bench --sweep times the alternatives.
DECODE_ROWS = 16
# Split-K of qmatvec / q8_mv1 summed inside the kernel (the last split of each tile adds the partials) instead
# of by a torch sum after it: one launch per call instead of two (a decode step at B = 1 made 268 sum
# launches, 0.73 ms on an H200). Read at every call (a CUDA graph keeps the choice made when it was
# captured). Env DS4_Q8_FIXUP=0: the torch sum (A/B on the GPU). Both are deterministic; they may differ in
# the last bits (the fixup adds the partials in split order, torch's reduction in an order of its own).
Q8_FIXUP = os.environ.get("DS4_Q8_FIXUP", "1") != "0"


# ---------------------------------------------------------------------------------------------------------
# Shared jit helpers


@triton.jit
def _acc_tile(acc, w, x_ptr, xrow, xmask, xcol, USE_DOT: tl.constexpr):
    """Add x[xrow, xcol] (x) w for a dequantized tile w [BN, SW] f32.

    USE_DOT (x bf16): acc [BB, BN] += x @ w^T on tensor cores. Else acc [BB, BN, SW] += x * w: per-lane
    partial sums, reduced once after the k loop (no cross-thread reduction inside the loop).
    """
    x = tl.load(x_ptr + xrow[:, None] + xcol[None, :], mask=xmask[:, None], other=0.0)  # [BB, SW]
    if USE_DOT:
        acc = tl.dot(x, tl.trans(w.to(tl.bfloat16)), acc)
    else:
        acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
    return acc


@triton.jit
def _split_bf16(x):
    """f32 x -> (hi, lo) bf16 with hi + lo = x to ~2^-16 relative (lo: the rounding error of hi, rounded)."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _tf32_hi(x):
    """f32 x with its low 13 mantissa bits cleared: exact in tf32, and x - hi exact in f32 (the split of
    hmatvec's tf32x2 mode and q8_rows)."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def iq2_group_words(w0, w1, r, gg, nb, QP: tl.constexpr):
    """(grid indices, sub-block words a1) [R, G] of groups gg [1, G] (8 elements each, numbered along the
    row) of rows r [R, 1] (int64), for iq2_group_values. Split layout: w0 qs (u8), w1 sg (int32). QP (the
    quad layout, packing.quad_pack): w0 / w1 the qp words as bytes / int32 halves, and a1 rebuilt with just
    what iq2_group_values reads: group t's sign index at bit 7 t, the sub-block's scale in the top nibble."""
    if QP:
        blk = gg // 32  # super-block; sub-block s, group t of it
        s = (gg // 4) % 8
        t = gg % 4
        h = r * (nb * 16) + blk * 16  # int32 halves: 16 a block, pair t's second word at 4 t + 2
        idx = tl.load(w0 + 4 * h + 16 * t + s)
        half = tl.load(w1 + h + 4 * t + 2 + s // 4)
        top = tl.load(w1 + h + 4 * (s // 2) + 2 + s % 2) & -268435456  # the scale nibble, in place (bit 28)
        a1 = (((half >> (7 * (s % 4))) & 127) << (7 * t)) | top
    else:
        idx = tl.load(w0 + r * (nb * 32) + gg)
        a1 = tl.load(w1 + r * (nb * 8) + gg // 4)
    return idx, a1


@triton.jit
def iq2_group_values(idx, a1, d, sub, w3, j):
    """IQ2_XXS groups of 8 values, f32 [R, G, 8] (exact: packing.unpack's operations): grid indices idx
    [R, G], sub-block words a1 [R, G] (4 x 7-bit sign indices | scale << 28), block scales d (broadcast to
    [R, G]), sub [1, G] the group's place in its sub-block, w3 the grid table, j = arange(8)."""
    db = d * (0.5 + ((a1 >> 28) & 15).to(tl.float32)) * 0.25
    s = (a1 >> (7 * sub)) & 127  # sign index; KSIGNS[s] = s | parity(s) << 7
    p = s ^ (s >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    signs = s | ((p & 1) << 7)
    grid = tl.load(w3 + idx.to(tl.int32))  # [R, G] int64: 8 magnitude bytes
    mag = ((grid[:, :, None] >> (8 * j)[None, None, :]) & 255).to(tl.float32)  # [R, G, 8]
    neg = ((signs[:, :, None] >> j[None, None, :]) & 1) != 0
    return db[:, :, None] * tl.where(neg, -mag, mag)


@triton.jit
def dot_rows(
    w0,
    w1,
    w2,
    w3,
    wrow,
    x_ptr,
    xrow,
    xmask,
    kt_lo,
    kt_hi,
    K,
    QT: tl.constexpr,
    BB: tl.constexpr,
    BN: tl.constexpr,
    TK: tl.constexpr,
    SW: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """[BB, BN] f32 = sum over k-tiles [kt_lo, kt_hi) of TK elements of x[xrow, k] * W[wrow, k].

    w0..w3: the packed arrays (plain: w; Q8_0: qs, d; Q2_K/Q4_K: qs, sc, dm; IQ2_XXS: qs, sg, d, grid table;
    QT 116, IQ2_XXS in the quad layout: qp as bytes, qp as int32, d, grid table: weight_args).
    wrow [BN] int64 weight rows (always valid: callers clamp), xrow [BB] int64 element offsets of x rows.
    SW: width of the dequantized sub-tiles (sub_width()).
    """
    if USE_DOT:
        acc = tl.zeros([BB, BN], dtype=tl.float32)
    else:
        acc = tl.zeros([BB, BN, SW], dtype=tl.float32)
    nb = K // 256  # super-blocks per row (K-quants)
    for kt in range(kt_lo, kt_hi):
        k0 = kt * TK
        if QT == 8:  # Q8_0: x = d * q, 32 per block; TK elements = TK/32 blocks
            blk = tl.arange(0, TK // 32)
            e = tl.arange(0, 32)
            q = tl.load(w0 + wrow[:, None, None] * K + k0 + blk[None, :, None] * 32 + e[None, None, :])
            d = tl.load(w1 + wrow[:, None] * (K // 32) + k0 // 32 + blk[None, :]).to(tl.float32)
            w = tl.reshape(q.to(tl.float32) * d[:, :, None], [BN, TK])
            acc = _acc_tile(acc, w, x_ptr, xrow, xmask, k0 + tl.arange(0, TK), USE_DOT)
        elif QT == 10:  # Q2_K: byte j of half h, shift 2t -> element 128h + 32t + j; scale 8h + 2t + j//16
            g = tl.arange(0, 4)  # 16-byte group: half g//2, byte-group g%2
            i = tl.arange(0, 16)
            q8 = tl.load(
                w0 + wrow[:, None, None] * (nb * 64) + kt * 64 + g[None, :, None] * 16 + i[None, None, :]
            )
            dmin = tl.load(w2 + wrow * (nb * 2) + kt * 2 + 1).to(tl.float32)
            d = tl.load(w2 + wrow * (nb * 2) + kt * 2).to(tl.float32)
            for t in tl.static_range(4):
                sc = tl.load(w1 + wrow[:, None] * (nb * 16) + kt * 16 + (g // 2)[None, :] * 8 + 2 * t + g % 2)
                dl = d[:, None] * (sc & 15).to(tl.float32)  # [BN, 4]
                ml = dmin[:, None] * (sc >> 4).to(tl.float32)
                q = ((q8 >> (2 * t)) & 3).to(tl.float32)  # [BN, 4, 16]
                w = tl.reshape(dl[:, :, None] * q - ml[:, :, None], [BN, 64])
                xcol = k0 + (g // 2)[:, None] * 128 + 32 * t + (g % 2)[:, None] * 16 + i[None, :]
                acc = _acc_tile(acc, w, x_ptr, xrow, xmask, tl.reshape(xcol, [64]), USE_DOT)
        elif QT == 12:  # Q4_K: chunk c byte j: low nibble -> 64c + j (sub-block 2c), high -> 64c + 32 + j
            c = tl.arange(0, 4)
            j = tl.arange(0, 32)
            q8 = tl.load(
                w0 + wrow[:, None, None] * (nb * 128) + kt * 128 + c[None, :, None] * 32 + j[None, None, :]
            )
            d = tl.load(w2 + wrow * (nb * 2) + kt * 2).to(tl.float32)
            dmin = tl.load(w2 + wrow * (nb * 2) + kt * 2 + 1).to(tl.float32)
            for h in tl.static_range(2):
                sc = tl.load(w1 + wrow[:, None] * (nb * 16) + kt * 16 + 2 * c[None, :] + h)  # [BN, 4]
                mn = tl.load(w1 + wrow[:, None] * (nb * 16) + kt * 16 + 8 + 2 * c[None, :] + h)
                dl = d[:, None] * sc.to(tl.float32)
                ml = dmin[:, None] * mn.to(tl.float32)
                q = ((q8 >> (4 * h)) & 15).to(tl.float32)  # [BN, 4, 32]
                w = tl.reshape(dl[:, :, None] * q - ml[:, :, None], [BN, 128])
                xcol = k0 + c[:, None] * 64 + 32 * h + j[None, :]
                acc = _acc_tile(acc, w, x_ptr, xrow, xmask, tl.reshape(xcol, [128]), USE_DOT)
        elif QT == 16 or QT == 116:  # IQ2_XXS (116: the quad layout): group g of 8 elements (32 per block),
            j = tl.arange(0, 8)  # k order; two halves of 16 groups (a [BN, 32, 8] tile at once spills
            d = tl.load(w2 + wrow * nb + kt).to(tl.float32)  # registers in the tensor-core path)
            for h in tl.static_range(2):
                g = h * 16 + tl.arange(0, 16)  # [BN, 16] grid indices, sub-block words:
                idx, a1 = iq2_group_words(w0, w1, wrow[:, None], kt * 32 + g[None, :], nb, QT == 116)
                vals = iq2_group_values(idx, a1, d[:, None], (g % 4)[None, :], w3, j)  # [BN, 16, 8]
                w = tl.reshape(vals, [BN, 128])
                acc = _acc_tile(acc, w, x_ptr, xrow, xmask, k0 + h * 128 + tl.arange(0, 128), USE_DOT)
        else:  # F32 / F16 / BF16
            col = tl.arange(0, TK)
            w = tl.load(w0 + wrow[:, None] * K + k0 + col[None, :]).to(tl.float32)
            acc = _acc_tile(acc, w, x_ptr, xrow, xmask, k0 + col, USE_DOT)
    if USE_DOT:
        out = acc
    else:
        out = tl.sum(acc, axis=2)
    return out


# ---------------------------------------------------------------------------------------------------------
# Host-side helpers shared by the op modules


def weight_args(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four pointer arguments of dot_rows for w (unused slots repeat the first array)."""
    d = w.data
    if w.qtype in PLAIN_DTYPES:
        return d["w"], d["w"], d["w"], d["w"]
    if w.qtype == GGMLType.Q8_0:
        return d["qs"], d["d"], d["qs"], d["qs"]
    if w.qtype in (GGMLType.Q2_K, GGMLType.Q4_K):
        return d["qs"], d["sc"], d["dm"], d["qs"]
    if w.quad:  # the quad layout (qtype_code 116): its words as bytes and as int32 halves
        qp = d["qp"]
        return qp.view(torch.uint8), qp.view(torch.int32), d["d"], iq2xxs_grid_i64(qp.device)
    return d["qs"], d["sg"], d["d"], iq2xxs_grid_i64(d["qs"].device)


def tile_k(w: PackedWeight) -> int:
    """Elements per k-tile: one super-block for K-quants, else the largest power of two <= 256 dividing K."""
    if w.qtype in (GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS):
        return 256
    for tk in (256, 128, 64, 32, 16):
        if w.K % tk == 0:
            return tk
    raise ValueError(f"{w.qtype.name} kernels need a row length that is a multiple of 16, got K={w.K}")


def sub_width(w: PackedWeight, tk: int) -> int:
    """Width of the tiles dot_rows dequantizes at once (its SW)."""
    return {GGMLType.Q2_K: 64, GGMLType.Q4_K: 128, GGMLType.IQ2_XXS: 128}.get(w.qtype, tk)


def prep_x(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    """Validate activations [rows, k]; returns a contiguous f32 or bf16 tensor."""
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"{what}: x must be [rows, {k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    return x.contiguous()


def check_weight(w: PackedWeight, ndim: int, what: str, device: torch.device) -> None:
    if len(w.shape) != ndim:
        raise ValueError(f"{what}: weight must have {ndim} dims, got shape {w.shape}")
    if w.device != device:
        raise ValueError(f"{what}: weight is on {w.device} but activations are on {device}")


# The kernels' QT of an IQ2_XXS weight in the quad layout (packing.to_quad); every other weight's is its
# GGMLType value (IQ2_XXS 16). The jit code spells it 116.
QT_IQ2_QUAD = 116


def qtype_code(w: PackedWeight) -> int:
    """QT of w for the kernels that take any format (dot_rows and the dequantization)."""
    return QT_IQ2_QUAD if w.quad else int(w.qtype)


# ---------------------------------------------------------------------------------------------------------
# Split-K sums inside the kernel (qmatvec, q8_mv1, hmatvec with HalfConfig.fixup)
# Each program stores its partial, then bumps its output tile's counter; the program that finds the count at
# S - 1 is the tile's last: it adds the S partials in split order 0..S-1 (deterministic: the same bits on
# every run, whatever order the programs ran in) into the output and sets the counter back to 0. The
# counters are one int32 buffer per device, zero between calls, allocated outside any CUDA-graph capture and
# never freed (a captured graph keeps using its buffer), so graph replays re-arm them themselves. Two calls in
# flight at once would share counters: calls on one lane's buffer must be ordered on one stream. The decode
# step runs two lanes (ds4.model.cuda.streams: the current stream and one side stream, `counter_lane`), each
# with its own buffer.


@triton.jit
def _split_fixup(part_ptr, sum_ptr, cnt_ptr, off, mask, B, N, n_split, BB: tl.constexpr, BN: tl.constexpr):
    """After a program stored its partial [BB, BN] at part_ptr[split] + off (partials [n_split, B, N]): the
    last of the tile's splits (counter cnt_ptr) writes the sum of all partials, in split order
    (deterministic), to sum_ptr + off."""
    tl.debug_barrier()  # all threads' partial stores precede the release below
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")  # gpu scope: publishes this partial, sees the others
    if done == n_split - 1:
        total = tl.zeros([BB, BN], dtype=tl.float32)
        for s in range(n_split):
            part = part_ptr + tl.cast(s, tl.int64) * B * N + off  # (cast: s is an int in the interpreter)
            total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")  # L2: other SMs' stores
        tl.store(sum_ptr + off, total, mask=mask)
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed")  # re-armed for the next call (kernel boundaries order it)


@triton.jit
def _store_partial(
    out_ptr, sum_ptr, cnt_ptr, y, b, bmask, n, B, N, tile, BB: tl.constexpr, BN: tl.constexpr,
    FIXUP: tl.constexpr,
):  # fmt: skip
    """Store this program's partial y [BB, BN] (x rows b, weight rows n) of split program_id(2) into the
    partials out [S, B, N]; FIXUP: the last split of the tile (counter cnt_ptr + tile) then writes their sum
    to sum_ptr [B, N] (_split_fixup)."""
    off = b[:, None].to(tl.int64) * N + n[None, :]  # [BB, BN]
    mask = bmask[:, None] & (n < N)[None, :]
    tl.store(out_ptr + tl.program_id(2).to(tl.int64) * B * N + off, y, mask=mask)
    if FIXUP:
        _split_fixup(out_ptr, sum_ptr, cnt_ptr + tile, off, mask, B, N, tl.num_programs(2), BB, BN)


_HALF_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}  # (device, lane) -> counters
_RETIRED_COUNTERS: list[torch.Tensor] = []  # outgrown buffers: graphs captured with them still write them
_LANE = [0]  # the stream lane of the calls being made (counter_lane)


@contextmanager
def counter_lane(lane: int):
    """Calls made inside use lane `lane`'s tile counters: for kernels enqueued on a second stream that runs
    concurrently with the first (lane 0)."""
    prev, _LANE[0] = _LANE[0], lane
    try:
        yield
    finally:
        _LANE[0] = prev


def _split_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The zeroed int32 tile counters (>= tiles) of the device and current lane, or None while a CUDA graph
    is being captured and they would have to be allocated (memory allocated in a capture belongs to it)."""
    key = (device, _LANE[0])
    cnt = _HALF_COUNTERS.get(key)
    if cnt is None or cnt.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if cnt is not None:
            _RETIRED_COUNTERS.append(cnt)
        cnt = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _HALF_COUNTERS[key] = cnt
    return cnt


def _fixup_output(
    device: torch.device, splits: int, tiles: int, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(output [shape] f32, tile counters) when a Q8_0 kernel should sum its split-K partials itself
    (Q8_FIXUP on, more than one split, counters at hand), else None: the caller sums with torch."""
    if not Q8_FIXUP or splits == 1:
        return None
    cnt = _split_counters(device, tiles)
    if cnt is None:
        return None
    return torch.empty(shape, dtype=torch.float32, device=device), cnt


@dataclass
class SplitOutputs:
    """The outputs of one split-K Q8_0 launch: partials [S, *shape]; when the kernel sums them itself
    (_fixup_output: fixup), the sum and the tile counters (else both alias the partials, unused)."""

    part: torch.Tensor
    total: torch.Tensor
    cnt: torch.Tensor
    fixup: bool

    def result(self) -> torch.Tensor:
        """The [*shape] sum: the kernel's, or the partials summed in split order."""
        if self.fixup:
            return self.total
        return self.part[0] if self.part.shape[0] == 1 else self.part.sum(0)


def split_outputs(device: torch.device, splits: int, tiles: int, shape: tuple[int, ...]) -> SplitOutputs:
    part = torch.empty(splits, *shape, dtype=torch.float32, device=device)
    fix = _fixup_output(device, splits, tiles, shape)
    total, cnt = fix or (part, part)
    return SplitOutputs(part, total, cnt, fix is not None)


# ---------------------------------------------------------------------------------------------------------
# qmatvec


@triton.jit
def _qmv_kernel(
    x_ptr,
    w0,
    w1,
    w2,
    w3,
    out_ptr,
    sum_ptr,
    cnt_ptr,
    B,
    N,
    K,
    stride_x,
    kt_per_split,
    QT: tl.constexpr,
    BB: tl.constexpr,
    BN: tl.constexpr,
    TK: tl.constexpr,
    SW: tl.constexpr,
    USE_DOT: tl.constexpr,
    FIXUP: tl.constexpr,
):
    """Partials out [S, B, N] of x [B, K] @ W^T, program (row tile, batch tile, split); FIXUP: the last split
    of each tile also writes the sum to sum_ptr [B, N] (counters cnt_ptr, one per (row, batch) tile)."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_s = tl.program_id(2)
    n = pid_n * BN + tl.arange(0, BN)
    wrow = tl.minimum(n, N - 1).to(tl.int64)
    b = pid_b * BB + tl.arange(0, BB)
    bmask = b < B
    kt_lo = pid_s * kt_per_split
    kt_hi = tl.minimum(kt_lo + kt_per_split, K // TK)
    acc = dot_rows(
        w0, w1, w2, w3, wrow, x_ptr, b.to(tl.int64) * stride_x, bmask, kt_lo, kt_hi, K, QT, BB, BN, TK, SW,
        USE_DOT,
    )  # fmt: skip
    tile = pid_n * tl.num_programs(1) + pid_b
    _store_partial(out_ptr, sum_ptr, cnt_ptr, acc, b, bmask, n, B, N, tile, BB, BN, FIXUP)


# ---------------------------------------------------------------------------------------------------------
# Q8_0 x one activation row (batch-1 decode, the bulk of the Q8_0 bytes): a dedicated kernel.
# A program owns BN weight rows and a range of k-tiles of TK elements; per tile it loads [BN, TK] int8 quants
# (contiguous per row: 16-byte loads), the [BN, TK/32] f16 scales and x[TK], sums each 32-element block
# first and scales once per block (fewer multiplies and registers than per-element dequant). Rows may come
# in groups of NG that each read their own x slice (qmatvec_grouped); plain matrices use NG = N.
# Split-K partials go to a [S, N] buffer summed in split order (deterministic): in the kernel (Q8_FIXUP) or by
# torch.


@dataclass(frozen=True)
class Q8Config:
    """Tile of the batch-1 Q8_0 kernel: BN rows per program, TK elements per k-tile, warps, pipeline stages
    of the k loop, and the number of programs split-K aims for. Two code variants (same products and
    sums; sm_90 k loop at the default tile, Triton 3.6's bundled ptxas, per thread and 32 weights):
      xdirect: x loaded straight into the weight tile's layout (each thread its own x elements, broadcast
        over the BN rows from L1) instead of one load redistributed through shared memory: 10 -> 2 barriers
        per k-tile, 136 -> 123 instructions, 61 -> 46 registers;
      magic: the int8 weights read as int32 words and turned into f32 by the 2^23 magic number (_i8x4_f32)
        instead of I2F, which sm_90 issues at 16 per SM per clock (a quarter of the integer pipe), x loaded
        directly as with xdirect (through shared memory its [TB, 8, 4] tile took 409 instructions): 32 I2F
        -> 0 at 170 instructions (integer ops 1.06 -> 2.34 per weight). By issue slots (1 warp instruction
        per clock per SM quarter, integer ops at 1/2, I2F at 1/8) 32 weights cost >= 8 clocks (I2F) now and
        ~5.3 so: the I2F bound alone is ~4.4 TB/s of Q8_0 bytes, so this pays only where I2F stalls bite;
      prefetch: a program's first k-tile of weights (at the decode tile often all it reads) is loaded before
        its pdl_wait(), so with dispatch.PDL_EARLY it streams while the previous kernel drains;
      int8: x quantized first (intq.quantize_q8k per 32 values, two int8 planes: ~2^-16 of each block's
        amax) and the weight words dotted with it by dp4a (_q8_int_kernel): per 32 weights 16 dp4a, 8 IMAD
        and one I2F instead of 32 I2F and 32 FMA, for one more (small) launch per matvec;
      flat: long-lived programs (about `flat` of them, one wave) that walk whole row tiles k-tile by
        k-tile with the next k-tile's loads issued before this one's math (_q8_flat_kernel): no split-K,
        no fixup, fewer program starts; the large matrices only (FLAT_MIN_TILES);
      tma: the weight tiles [bn, 256] by TMA bulk copies into a ring of `stages` shared-memory buffers
        (_q8_tma_kernel, sm_90): a program keeps stages - 1 k-tiles in flight at ~40 registers, where the
        register-tiled kernel holds one (the L2 prefetch measured the matvecs not DRAM-latency-bound in
        isolation, session 19; this tests whether more bytes in flight per SM pay); tk is 256 (a TMA box
        row holds at most 256 elements).
    tools/gpu/bench_q8.py --variants times them; --compile-only prints these counts."""

    bn: int = 8
    tk: int = 512
    warps: int = 4
    stages: int = 1
    target: int = 528
    xdirect: bool = False
    magic: bool = False
    prefetch: bool = False
    int8: bool = False
    # > 0: matrices of >= FLAT_MIN_TILES row tiles by _q8_flat_kernel with about this many programs
    flat: int = 0
    tma: bool = False


# tools/gpu/tune_decode.py times the alternatives: on an H200 (2026-11-29) this tile gave the lowest sum over
# a decode step's Q8_0 shapes (5.9 ms cold-L2 vs 14.4 ms for the general kernel; stages 3, 4/16/32 rows, 256
# or 1024-element tiles were 0-60 % slower).
# Env DS4_Q8_XDIRECT=0|1 / DS4_Q8_MAGIC=1: the code variants (Q8Config), for whole-model A/B runs. xdirect
# is on: bench_q8.py --variants on the H200 (2026-12-01) summed a decode step's Q8_0 matvecs to 4.042 ms vs
# 4.172 ms. prefetch is on (env DS4_Q8_PREFETCH=0: off): whole model 87.15 vs 86.47 tok/s without
# dispatch.PDL_EARLY, 88.96 vs 88.43 with it (tools/gpu/ab_decode.py, session 7); safe either way (static
# weights only before the wait). HalfConfig.prefetch measured 88.93 with both (no gain over the Q8_0 one
# alone): off.
# The int8 variant runs at 4 rows x 1024 per tile: bench_q8.py --variants (session 12) summed a step's Q8_0
# matvecs to 3.304 ms there vs 3.347 at the f32 kernel's 8 x 512 (default kernel 3.372); whole model at 4k
# ctx (ab_decode.py "q8 int8 bn4", session 13) 108.27 vs 105.50 tok/s, both rounds alike. Off: with it the
# batched-vs-alone check (tools/gpu/batch_check.py, whose batched rows take q8_rows) measured 2.08e-2 of the
# logit std at one (row, step) for B = 3, 8 and 16 (bar 2e-2; every argmax equal; 1.4e-2 without it).
# Session 19: 130.59 vs 133.05 tok/s at 4k (x0.982: the f32 path has gained since); and with q8_rows in int8
# too (the batched rows then dot the same x planes) the check still fails (B = 8 / 16: 2.02e-2 / 2.40e-2 at
# one row, medians ~5e-4), so those flips do not come from the two Q8_0 paths' numerics.
_Q8_INT8 = os.environ.get("DS4_Q8_INT8", "0") == "1"
Q8_INT8_TILE = {"bn": 4, "tk": 1024}  # the int8 variant's tile (tools replace Q8_MV1 with it)
# The TMA variant (Q8Config.tma) and its tile (sm_90 builds 40-64 registers, 9-29 KB of shared memory). H200,
# session 20: bench_q8.py --variants summed a decode step's Q8_0 matvecs to 4.167 ms at this tile vs 3.546
# by Q8_MV1 (32 rows 3.560, 8 rows 5.656, 3 / 6 stages 4.056 / 4.365; the same tile with plain loads 31.75);
# whole model at 4k ctx (ab_decode.py) 121.26 vs 132.86 tok/s (32 rows 129.99). Several k-tiles in flight
# per program do not pay: off. Env DS4_Q8_TMA=1: on, at this tile.
_Q8_TMA = os.environ.get("DS4_Q8_TMA", "0") == "1"
Q8_TMA_TILE = {"bn": 16, "tk": 256, "stages": 4}
_TILE = Q8_INT8_TILE if _Q8_INT8 else Q8_TMA_TILE if _Q8_TMA else {"bn": 8, "tk": 512, "stages": 1}
# Split-K aims at 528 programs (4 an SM), not 2112: H200, session 21, whole model at 4k ctx (ab_decode.py "q8
# target 528", the variants taking turns) 134.74 vs 132.06 tok/s over 4 rounds (x1.020, every round alike;
# x1.016 in a 2-round call before); 1056 132.32 vs 132.79 (x0.996). Against 528 as the default (3 rounds):
# 2112 x0.983, 792 x1.005, 396 x0.941, 264 x0.938. Fewer splits: fewer partial sums to add and fewer
# programs to start for the same bytes (q_a + kv 8 -> 3 splits, o_b 4 -> 2, o_a 3 -> 1); too few leave too
# few bytes in flight. 1024-element k-tiles on all but the head ("q8 tk1024 body"): 133.47 tok/s at 2112,
# 132.64 at 528 (vs 134.74 with 512): not taken. Env DS4_Q8_TARGET.
_Q8_TARGET = int(os.environ.get("DS4_Q8_TARGET", "528"))
Q8_MV1 = Q8Config(
    bn=_TILE["bn"],
    tk=_TILE["tk"],
    warps=4,
    stages=_TILE.get("stages", 1),
    target=_Q8_TARGET,
    xdirect=os.environ.get("DS4_Q8_XDIRECT", "1") == "1",
    magic=os.environ.get("DS4_Q8_MAGIC", "0") == "1",
    prefetch=os.environ.get("DS4_Q8_PREFETCH", "1") != "0",
    int8=_Q8_INT8,
    tma=_Q8_TMA and not _Q8_INT8,
)
# The tile of the Q8_0 matrices of at least Q8_HEAD_ROWS rows (Flash: the output head alone, 129,280 x 4,096,
# 563 MB; the next largest has 32,768 rows): the TMA kernel at 32 rows a program. bench_q8.py --variants
# (H200, session 20, cold L2): head 154.0 us (3.65 TB/s) vs 182.5 us (3.08 TB/s) by Q8_MV1, while the other
# shapes were 2-14 % slower with it (whole model at 4k ctx, "q8 tma bn32" everywhere: x0.978). None: Q8_MV1
# for every size. Whole model at 4k ctx (ab_decode.py "q8 head tma", session 20): 133.77 vs 133.40 tok/s
# (x1.003 in both rounds, ~the 28 us of a 7.5 ms step expected, below the tool's 1 % bar): off until more
# rounds confirm it; env DS4_Q8_HEAD_TMA=1: on.
Q8_HEAD_ROWS = 65536
Q8_HEAD_TILE = replace(Q8_MV1, tma=True, **{**Q8_TMA_TILE, "bn": 32})
Q8_HEAD: Q8Config | None = Q8_HEAD_TILE if os.environ.get("DS4_Q8_HEAD_TMA", "0") == "1" else None


@triton.jit
def _i8x4_f32(w):
    """int32 words w [R, G, 8] (4 int8 each, little-endian) -> their bytes as f32 [R, G, 8, 4], exact:
    (b + 128) is put in the mantissa of 2^23 and 2^23 + 128 subtracted (no I2F: see Q8Config.magic)."""
    u = w.to(tl.uint32, bitcast=True) ^ 0x80808080  # each byte b -> b + 128 (unsigned)
    sh = (tl.arange(0, 4) * 8).to(tl.uint32)
    b = ((u[:, :, :, None] >> sh[None, None, None, :]) & 0xFF) | 0x4B000000
    return b.to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _q8_tile(q, d, xv, XDIRECT: tl.constexpr, MAGIC: tl.constexpr):
    """[BN, TB] f32: one k-tile of _q8_mv1_kernel, quants q with block scales d [BN, TB] times x xv."""
    xv = xv.to(tl.float32)
    if not (XDIRECT or MAGIC):
        xv = xv[None]
    if MAGIC:
        y = tl.sum(tl.sum(_i8x4_f32(q) * xv, axis=3), axis=2)
    else:
        y = tl.sum(q.to(tl.float32) * xv, axis=2)
    return y * d.to(tl.float32)


@triton.jit
def _q8_program(dsc, N, K, NG, kt_per_split, BN: tl.constexpr, TK: tl.constexpr):
    """What a batch-1 Q8_0 program (row tile pid 0, split pid 1) works on: (rows n [BN], their clamped
    weight rows wrow, x group grp (int64: the program's rows all lie in one group, BN | NG), block offsets
    blk [TK/32], scale pointers dp [BN, TK/32] of k-tile 0, the split's k-tiles [kt_lo, kt_hi))."""
    pid_n = tl.program_id(0)
    n = pid_n * BN + tl.arange(0, BN)
    wrow = tl.minimum(n, N - 1).to(tl.int64)
    grp = ((pid_n * BN) // NG).to(tl.int64)
    blk = tl.arange(0, TK // 32)
    dp = dsc + wrow[:, None] * (K // 32) + blk[None, :]
    kt_lo = tl.program_id(1) * kt_per_split
    return n, wrow, grp, blk, dp, kt_lo, tl.minimum(kt_lo + kt_per_split, K // TK)


@triton.jit
def _q8_out(out_ptr, sum_ptr, cnt_ptr, acc, n, N, FIXUP: tl.constexpr):
    """Store a batch-1 Q8_0 program's partial (acc [BN, TB] summed over its blocks) for rows n [BN] at its
    split's row of out [S, N]; FIXUP: the tile's last split also writes the sum (_split_fixup)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    tl.store(out_ptr + pid_s.to(tl.int64) * N + n, tl.sum(acc, axis=1), mask=n < N)
    if FIXUP:  # as one batch row: tile [1, BN]
        off, mask = n[None, :], (n < N)[None, :]
        _split_fixup(out_ptr, sum_ptr, cnt_ptr + pid_n, off, mask, 1, N, tl.num_programs(1), 1, n.shape[0])


@triton.jit
def _q8_mv1_kernel(
    x_ptr,
    qs,
    dsc,
    out_ptr,
    sum_ptr,
    cnt_ptr,
    N,
    K,
    NG,
    kt_per_split,
    BN: tl.constexpr,
    TK: tl.constexpr,
    STAGES: tl.constexpr,
    FIXUP: tl.constexpr,
    XDIRECT: tl.constexpr,
    MAGIC: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Partials out [S, N], program (row tile, split); FIXUP: the last split of each row tile also writes
    the sum to sum_ptr [N] (counters cnt_ptr, one per row tile). XDIRECT / MAGIC / PREFETCH: Q8Config's
    xdirect / magic / prefetch (MAGIC: qs is the int32 view of the quants)."""
    TB: tl.constexpr = TK // 32  # blocks per k-tile
    n, wrow, grp, blk, dp, kt_lo, kt_hi = _q8_program(dsc, N, K, NG, kt_per_split, BN, TK)
    xbase = grp * K
    if MAGIC:  # [BN, TB, 8] words of 4 quants; x as [TB, 8, 4]
        e8 = tl.arange(0, 8)
        qp = qs + wrow[:, None, None] * (K // 4) + blk[None, :, None] * 8 + e8[None, None, :]
        xp = x_ptr + xbase + blk[:, None, None] * 32 + e8[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
        xp = tl.broadcast_to(xp[None], [BN, TB, 8, 4])  # x loaded directly (see Q8Config.magic)
        QK: tl.constexpr = TK // 4  # words per k-tile
    else:  # [BN, TB, 32] quants; x as [TB, 32]
        e = tl.arange(0, 32)
        qp = qs + wrow[:, None, None] * K + blk[None, :, None] * 32 + e[None, None, :]
        xp = x_ptr + xbase + blk[:, None] * 32 + e[None, :]
        if XDIRECT:
            xp = tl.broadcast_to(xp[None], [BN, TB, 32])
        QK: tl.constexpr = TK
    acc = tl.zeros([BN, TB], dtype=tl.float32)
    if PREFETCH:  # the first k-tile's weights before the wait: static (see dispatch.PDL_EARLY)
        q0 = tl.load(qp + kt_lo * QK)
        d0 = tl.load(dp + kt_lo * TB)
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    if PREFETCH:
        acc += _q8_tile(q0, d0, tl.load(xp + kt_lo * TK), XDIRECT, MAGIC)
        kt_lo += 1
    for kt in tl.range(kt_lo, kt_hi, num_stages=STAGES):
        acc += _q8_tile(tl.load(qp + kt * QK), tl.load(dp + kt * TB), tl.load(xp + kt * TK), XDIRECT, MAGIC)
    _q8_out(out_ptr, sum_ptr, cnt_ptr, acc, n, N, FIXUP)


@triton.jit
def _q8_tma_kernel(
    x_ptr,
    qs_desc,
    dsc,
    out_ptr,
    sum_ptr,
    cnt_ptr,
    N,
    K,
    NG,
    kt_per_split,
    BN: tl.constexpr,
    TK: tl.constexpr,
    STAGES: tl.constexpr,
    FIXUP: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """_q8_mv1_kernel with the quants read through qs_desc, a TMA descriptor of qs [N, K] with block [BN,
    TK] (Q8Config.tma): the k loop's copies go to a ring of STAGES shared buffers, STAGES - 1 ahead of the
    math (rows past N arrive as zeros). PREFETCH: the first k-tile copied before the wait (static weights)."""
    TB: tl.constexpr = TK // 32  # blocks per k-tile
    n, wrow, grp, blk, dp, kt_lo, kt_hi = _q8_program(dsc, N, K, NG, kt_per_split, BN, TK)
    r0 = tl.program_id(0) * BN  # the tile's first row, as the descriptor takes it
    xp = x_ptr + grp * K + blk[:, None] * 32 + tl.arange(0, 32)[None, :]  # [TB, 32]
    acc = tl.zeros([BN, TB], dtype=tl.float32)
    if PREFETCH:  # the first k-tile's weights before the wait: static (see dispatch.PDL_EARLY)
        q0 = qs_desc.load([r0, kt_lo * TK])
        d0 = tl.load(dp + kt_lo * TB)
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    if PREFETCH:
        acc += _q8_tile(tl.reshape(q0, (BN, TB, 32)), d0, tl.load(xp + kt_lo * TK), False, False)
        kt_lo += 1
    for kt in tl.range(kt_lo, kt_hi, num_stages=STAGES):
        q = tl.reshape(qs_desc.load([r0, kt * TK]), (BN, TB, 32))
        acc += _q8_tile(q, tl.load(dp + kt * TB), tl.load(xp + kt * TK), False, False)
    _q8_out(out_ptr, sum_ptr, cnt_ptr, acc, n, N, FIXUP)


TMA_TK = 256  # a TMA box row holds at most 256 elements


def tma_ok(t: torch.Tensor) -> bool:
    """Whether Q8Config.tma runs for t: CUDA sm_90+, or the interpreter (which emulates the copies)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9


def _q8_desc(qs: torch.Tensor, bn: int):
    """The TMA descriptor of Q8_0 quants qs [N, K] int8 (contiguous: 16-byte row strides) with block [bn,
    TMA_TK]: a host object the launcher encodes at each launch (a CUDA graph keeps the encoding)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(qs, list(qs.shape), [qs.shape[1], 1], [bn, TMA_TK])


@triton.jit
def _q8_int_tile(q, d, x1, x2, dx, DP4A: tl.constexpr):
    """[BN, TB] f32: one k-tile of _q8_int_kernel: weight words q [BN, TB, 8] (4 quants each) with block
    scales d [BN, TB] times x's plane words x1, x2 [BN, TB, 8] (v = 254 q1 + q2) with scales dx [TB]."""
    s = tl.sum(_dot4(q, x2, _dot4(q, x1, 0, DP4A) * 254, DP4A), axis=2)  # exact: |s| <= 32 * 127 * 32385
    return s.to(tl.float32) * (d.to(tl.float32) * dx[None, :])


@triton.jit
def _q8_int_kernel(
    xq_ptr,
    dx_ptr,
    qs,
    dsc,
    out_ptr,
    sum_ptr,
    cnt_ptr,
    N,
    K,
    NG,
    XPLANE,
    kt_per_split,
    BN: tl.constexpr,
    TK: tl.constexpr,
    STAGES: tl.constexpr,
    FIXUP: tl.constexpr,
    PREFETCH: tl.constexpr,
    DP4A: tl.constexpr,
):
    """_q8_mv1_kernel on quantized x (Q8Config.int8): xq_ptr the int32 words of x's planes [2, G, K/4] (XPLANE
    words apart), dx_ptr their scales [G, K/32], qs the int32 words of the quants [N, K/4]."""
    TB: tl.constexpr = TK // 32  # blocks per k-tile
    QK: tl.constexpr = TK // 4  # words per k-tile
    n, wrow, grp, blk, dp, kt_lo, kt_hi = _q8_program(dsc, N, K, NG, kt_per_split, BN, TK)
    e8 = tl.arange(0, 8)
    qp = qs + wrow[:, None, None] * (K // 4) + blk[None, :, None] * 8 + e8[None, None, :]  # [BN, TB, 8]
    xp = tl.broadcast_to((xq_ptr + grp * (K // 4) + blk[:, None] * 8 + e8[None, :])[None], [BN, TB, 8])
    dxp = dx_ptr + grp * (K // 32) + blk  # [TB]
    acc = tl.zeros([BN, TB], dtype=tl.float32)
    if PREFETCH:  # the first k-tile's weights before the wait: static (see dispatch.PDL_EARLY)
        q0 = tl.load(qp + kt_lo * QK)
        d0 = tl.load(dp + kt_lo * TB)
    pdl_wait()  # x's planes come from the quantization launch just before (dispatch.PDL)
    if PREFETCH:
        x1, x2 = tl.load(xp + kt_lo * QK), tl.load(xp + XPLANE + kt_lo * QK)
        acc += _q8_int_tile(q0, d0, x1, x2, tl.load(dxp + kt_lo * TB), DP4A)
        kt_lo += 1
    for kt in tl.range(kt_lo, kt_hi, num_stages=STAGES):
        x1, x2, dx = tl.load(xp + kt * QK), tl.load(xp + XPLANE + kt * QK), tl.load(dxp + kt * TB)
        acc += _q8_int_tile(tl.load(qp + kt * QK), tl.load(dp + kt * TB), x1, x2, dx, DP4A)
    _q8_out(out_ptr, sum_ptr, cnt_ptr, acc, n, N, FIXUP)


@triton.jit
def _q8_flat_row(it, n_kt, t_lo, BN: tl.constexpr, N):
    """(first row, k-tile) of flat iteration it of _q8_flat_kernel: row tile t_lo + it // n_kt (tiles are
    whole, BN | N; clamped only past the end), k-tile it % n_kt."""
    return tl.minimum((t_lo + it // n_kt) * BN, N - BN).to(tl.int64), it % n_kt


@triton.jit
def _q8_flat_kernel(
    x_ptr, qs, dsc, out_ptr, N, K, NG, tiles_per_prog, BN: tl.constexpr, TK: tl.constexpr,
):  # fmt: skip
    """out [N] of Q8Config.flat: program p owns row tiles p * tiles_per_prog .. (whole, BN | N) and walks
    them k-tile by k-tile; the next iteration's weights and x are loaded before this one's math (one
    k-tile in flight per thread beside the one in use), the first weights before pdl_wait (static)."""
    TB: tl.constexpr = TK // 32
    n_kt = K // TK
    t_lo = tl.program_id(0) * tiles_per_prog
    n_it = tl.maximum(tl.minimum(tiles_per_prog, N // BN - t_lo), 0) * n_kt
    rr = tl.arange(0, BN)
    blk = tl.arange(0, TB)
    e = tl.arange(0, 32)
    qp = qs + rr[:, None, None] * K + blk[None, :, None] * 32 + e[None, None, :]  # [BN, TB, 32], row 0
    dp = dsc + rr[:, None] * (K // 32) + blk[None, :]  # [BN, TB]
    xp = tl.broadcast_to((x_ptr + blk[:, None] * 32 + e[None, :])[None], [BN, TB, 32])  # XDIRECT's layout
    row, kt = _q8_flat_row(0, n_kt, t_lo, BN, N)
    q_n = tl.load(qp + row * K + kt * TK)
    d_n = tl.load(dp + row * (K // 32) + kt * TB)
    pdl_wait()  # x comes from the previous kernel (dispatch.PDL)
    x_n = tl.load(xp + (row // NG) * K + kt * TK)  # the tile's rows lie in one group (BN | NG)
    acc = tl.zeros([BN, TB], dtype=tl.float32)
    for it in range(0, n_it):
        q, d, xv = q_n, d_n, x_n
        row, kt = _q8_flat_row(tl.minimum(it + 1, n_it - 1), n_kt, t_lo, BN, N)
        q_n = tl.load(qp + row * K + kt * TK)
        d_n = tl.load(dp + row * (K // 32) + kt * TB)
        x_n = tl.load(xp + (row // NG) * K + kt * TK)
        acc += _q8_tile(q, d, xv, True, False)
        if it % n_kt == n_kt - 1:  # the tile's last k-tile: its row sums out
            n = (t_lo + it // n_kt) * BN + rr
            tl.store(out_ptr + n, tl.sum(acc, axis=1), mask=n < N)
            acc = tl.zeros([BN, TB], dtype=tl.float32)


# Row tiles from which Q8Config.flat takes _q8_flat_kernel (Flash at BN 8: q_b 4,096, o_a 1,024, the head
# 16,160; o_b, the shared expert's 512 and q_a + kv's 192 keep split-K). H200 (session 15, ab_decode.py at
# 4k ctx): 660 programs 107.33, 1,056 106.57 vs 111.65 tok/s: slower (sm_90: 96 registers for the tile in
# flight, 5 programs per SM, against the split-K kernel's 44 and many short programs), so flat stays 0.
# Restructured after that run so that tests/test_pdl_wiring.py can see its pre-wait loads reach only the
# weights (the same loads and math; sm_90 build now 128 registers; not re-timed).
FLAT_MIN_TILES = 1024


def _q8_tile_k(k: int, cap: int) -> int:
    for tk in (1024, 512, 256, 128, 64, 32):
        if tk <= cap and k % tk == 0:
            return tk
    raise ValueError(f"Q8_0 needs a row length that is a multiple of 32, got K={k}")


def q8_mv1(
    x: torch.Tensor, w: PackedWeight, rows_per_group: int, cfg: Q8Config | None = None
) -> torch.Tensor:
    """x [G*K] (G groups of K, contiguous) with Q8_0 rows W [N, K] -> [N] f32; row n reads x group
    n // rows_per_group (rows_per_group = N: a plain matvec). cfg: tile (default Q8_MV1). Split-K partials
    summed in the kernel when Q8_FIXUP is on, else by torch."""
    cfg = cfg or Q8_MV1
    N, K = w.rows, w.K
    if rows_per_group % cfg.bn and rows_per_group != N:
        raise ValueError(f"q8_mv1: {cfg.bn} rows per program must divide the group of {rows_per_group} rows")
    n_prog = triton.cdiv(N, cfg.bn)
    if cfg.flat and not cfg.int8 and N % cfg.bn == 0 and n_prog >= FLAT_MIN_TILES:
        out = torch.empty(N, dtype=torch.float32, device=x.device)
        per = triton.cdiv(n_prog, cfg.flat)
        _q8_flat_kernel[(triton.cdiv(n_prog, per),)](
            x, w.data["qs"], w.data["d"], out, N, K, rows_per_group, per, BN=cfg.bn,
            TK=_q8_tile_k(K, cfg.tk), num_warps=cfg.warps, launch_pdl=PDL,
        )  # fmt: skip
        return out
    tk, per, splits = q8_mv1_plan(N, K, cfg)
    o = split_outputs(x.device, splits, n_prog, (N,))  # partials [S, N]
    if cfg.int8:
        q, dx = quantize_q8k(x.view(-1, K), 2, 32)  # [2, G, K], [G, K/32]
        _q8_int_kernel[(n_prog, splits)](
            q.view(torch.int32), dx, w.data["qs"].view(torch.int32), w.data["d"], o.part, o.total, o.cnt,
            N, K, rows_per_group, q[0].numel() // 4, per, BN=cfg.bn, TK=tk, STAGES=cfg.stages,
            FIXUP=o.fixup, PREFETCH=cfg.prefetch, DP4A=dp4a_ok(x), num_warps=cfg.warps, launch_pdl=PDL,
        )  # fmt: skip
        return o.result()
    if cfg.tma and tk == TMA_TK and tma_ok(x):
        _q8_tma_kernel[(n_prog, splits)](
            x, _q8_desc(w.data["qs"].view(N, K), cfg.bn), w.data["d"], o.part, o.total, o.cnt, N, K,
            rows_per_group, per, BN=cfg.bn, TK=tk, STAGES=cfg.stages, FIXUP=o.fixup,
            PREFETCH=cfg.prefetch, num_warps=cfg.warps, launch_pdl=PDL,
        )  # fmt: skip
        return o.result()
    qs = w.data["qs"].view(torch.int32) if cfg.magic else w.data["qs"]
    _q8_mv1_kernel[(n_prog, splits)](
        x, qs, w.data["d"], o.part, o.total, o.cnt, N, K, rows_per_group, per,
        BN=cfg.bn, TK=tk, STAGES=cfg.stages, FIXUP=o.fixup, XDIRECT=cfg.xdirect, MAGIC=cfg.magic,
        PREFETCH=cfg.prefetch, num_warps=cfg.warps, launch_pdl=PDL,
    )  # fmt: skip
    return o.result()


def _q8_head_cfg(x: torch.Tensor, n: int) -> Q8Config | None:
    """Q8_HEAD for a matrix of n >= Q8_HEAD_ROWS rows where the TMA kernel runs, else None (Q8_MV1)."""
    return Q8_HEAD if Q8_HEAD is not None and n >= Q8_HEAD_ROWS and tma_ok(x) else None


def q8_mv1_plan(n: int, k: int, cfg: Q8Config) -> tuple[int, int, int]:
    """(TK, k-tiles per split, splits) of q8_mv1 for n rows of length k: enough splits that the row tiles
    times the splits reach cfg.target programs, as far as the k-tiles allow."""
    tk = TMA_TK if cfg.tma and k % TMA_TK == 0 else _q8_tile_k(k, cfg.tk)
    n_prog, n_kt = triton.cdiv(n, cfg.bn), k // tk
    splits = min(n_kt, max(1, triton.cdiv(cfg.target, n_prog)))
    per = triton.cdiv(n_kt, splits)
    return tk, per, triton.cdiv(n_kt, per)


def decode_tiles(b: int, x16: bool) -> tuple[int, int, bool]:
    """(BB, BN, use_dot) for a decode-sized batch b; x16: activations are bf16."""
    if b <= 4 or not x16:
        bb = 1 if b <= 1 else (2 if b == 2 else 4)
        return bb, max(4, DECODE_ROWS // bb), False
    bb = 16 if b <= 16 else 32 if b <= 32 else 64
    return bb, 32 if bb <= 32 else 16, True  # [64 x 32] tiles spill on sm_90 for IQ2_XXS


def split_k(n_programs: int, n_kt: int) -> tuple[int, int]:
    """(k-tiles per split, splits) so that n_programs * splits reaches TARGET_PROGRAMS when K allows; a split
    keeps >= 2 k-tiles (a program's fixed costs need some bytes to hide behind)."""
    want = max(1, min(n_kt // 2, -(-TARGET_PROGRAMS // max(1, n_programs))))
    per = -(-n_kt // want)
    return per, -(-n_kt // per)


def qmatvec(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [B, K] f32|bf16 @ W[N, K]^T -> [B, N] f32 (decode; B small). Triton on CUDA, else ref twin."""
    check_weight(w, 2, "qmatvec", x.device)
    x = prep_x(x, w.K, "qmatvec")
    if not use_triton(x):
        return ref.qmatvec(x, w)
    B, N = x.shape[0], w.N
    if B == 0 or N == 0:
        return torch.zeros(B, N, dtype=torch.float32, device=x.device)
    if B == 1 and w.qtype == GGMLType.Q8_0:
        return q8_mv1(x, w, N, _q8_head_cfg(x, N)).view(1, N)
    if _takes_q8_rows(B, x, w):
        return q8_rows(x, w, N)
    return _qmatvec_tiles(x, w)


# f32 activation rows from which Q8_0 takes q8_rows (tensor cores, f32-accurate) instead of the CUDA-core
# tiles, which run in chunks of 4 rows that each decode the weight tile again. Session 16 (batch_check.py, 8k,
# H200): from 3 rows instead of 9, the B = 4 step 20.30 -> 15.12 ms (x1.34), B = 8 33.48 -> 20.56 ms (x1.63;
# _qmv_kernel had taken 12.3 of its 34.5 ms). Session 17: from 2 rows, the B = 2 step 13.16 -> 11.61 ms
# (x1.134; batched vs alone at B = 2: 2.39e-4 of the logit std). Env DS4_Q8_ROWS_FROM.
Q8_ROWS_FROM = int(os.environ.get("DS4_Q8_ROWS_FROM", "2"))


def _takes_q8_rows(rows: int, x: torch.Tensor, w: PackedWeight) -> bool:
    return w.qtype == GGMLType.Q8_0 and x.dtype == torch.float32 and rows >= Q8_ROWS_FROM


@dataclass(frozen=True)
class TilePlan:
    """Launch of _qmv_kernel for qmatvec: BB x rows and BN weight rows per program (tensor cores if use_dot),
    TK elements per k-tile, k-tiles per split, and the grid (row tiles, batch tiles, splits)."""

    bb: int
    bn: int
    use_dot: bool
    tk: int
    per: int
    grid: tuple[int, int, int]


def qmatvec_plan(b: int, w: PackedWeight, x16: bool) -> TilePlan:
    """The general kernel's launch for b rows of x (x16: bf16) times w."""
    tk = tile_k(w)
    bb, bn, use_dot = decode_tiles(b, x16)
    n_tiles, b_tiles = triton.cdiv(w.N, bn), triton.cdiv(b, bb)
    per, splits = split_k(n_tiles * b_tiles, w.K // tk)
    return TilePlan(bb, bn, use_dot, tk, per, (n_tiles, b_tiles, splits))


def _qmatvec_tiles(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """The general kernel (any qtype, any B) behind qmatvec; x prepared, on a Triton device, B, N > 0."""
    B, N, K = x.shape[0], w.N, w.K
    p = qmatvec_plan(B, w, x.dtype == torch.bfloat16)
    splits = p.grid[2]
    o = split_outputs(x.device, splits, p.grid[0] * p.grid[1], (B, N))  # partials [S, B, N]
    _qmv_kernel[p.grid](
        x, *weight_args(w), o.part, o.total, o.cnt, B, N, K, x.stride(0), p.per,
        QT=qtype_code(w), BB=p.bb, BN=p.bn, TK=p.tk, SW=sub_width(w, p.tk), USE_DOT=p.use_dot,
        FIXUP=o.fixup, num_warps=4, launch_pdl=PDL,
    )  # fmt: skip
    return o.result()


# ---------------------------------------------------------------------------------------------------------
# Q8_0 x B activation rows on the tensor cores, f32-accurate (batched decode of many sessions, issue 8).
# bf16 tensor-core tiles round W's d * q products (19 significant bits) and x to bf16: ~4e-3 per product,
# which batched decode above 8 rows showed as ~3e-2 of the logit std from the first step (BENCHMARKS.md,
# session 4). Here every 32-block is one k-step: its quants q are integers (exact in tf32), x is split as
# hmatvec's tf32x2 splits it (hi = x's top 10 mantissa bits, exact in tf32; lo = x - hi, rounded to tf32 by
# the mma, 2^-11 of lo), the block's two dots [BN, 32] x [32, BB] sum exact products in f32 and the block
# scale d [BN] multiplies the block's sum once, as ref.qmatvec's exact dequantization does: ~2^-21 relative
# per product (f32 summation noise of a 4096-long dot is ~2^-18). W is the dot's A operand (M = BN rows), x^T
# the B operand (N = BB rows of x). Split-K with the in-kernel fixup, as the other Q8_0 kernels. Rows may come
# in groups of NG that each read their own x slice (qmatvec_grouped), as in q8_mv1.


@dataclass(frozen=True)
class Q8RowsConfig:
    """Tile of q8_rows: BN weight rows per program, warps, k-loop pipeline stages, programs split-K aims
    for. The x rows per program (BB) follow B: 16, 32 or 64."""

    bn: int = 64
    warps: int = 4
    stages: int = 3
    target: int = 1056
    mode: str = "tf32x2"  # Q8_ROWS_MODES
    blocks: int = 1  # 32-blocks per k iteration (rows_blocks): the bytes a pipeline stage fetches
    min_blocks: int = 4  # 32-blocks a split keeps at least: each split also writes an f32 [BB, BN] partial
    scales: str = "f16"  # Q8_ROWS_SCALES: which copy of the block scales the kernel reads
    maxnreg: int = 0  # a register cap for ptxas (0: none); the f32 scales build at 166 registers, not 127


# The products of a block: "tf32x2" (above: x as tf32 hi + lo, two tf32 MMAs, ~2^-21 per product), or the
# quants as bf16 (8-bit integers: exact) times x split into bf16 parts, each the rounding error of the ones
# before, rounded: "bf16x2" hi + lo (~2^-17 per product: 1e-5 of the output under the interpreter vs 3e-7),
# "bf16x3" hi + mid + lo (~2^-25). The H200 runs bf16 MMAs at twice the tf32 rate on half the operand bytes:
# 2 or 3 bf16 MMAs against 2 tf32 ones. H200 (tools/gpu/bench_q8.py --rows, session 8, per B = 32 decode
# step): tf32x2 9.20 ms, bf16x2 7.72 ms, bf16x3 8.40 ms (B = 16: 7.42 / 6.29 / 6.66; max error vs the f32
# twin 3.2e-6 / 3.6e-6 / 3.0e-6). "tf32x2" stays the default: with either bf16 mode the B = 16 batched-vs-
# alone check (tools/gpu/batch_check.py, 4-layer model, 4 steps) measured 2.6e-2 of the logit std (bar
# 2e-2; tf32x2 4.56e-3) although bf16x3's products are as exact as tf32x2's: some rounding point of the
# step (FP8 KV rows, the indexer's top-k) flips on the ~1e-6 difference. Not yet understood; env
# DS4_Q8_ROWS_MODE. "int8": x quantized per 32 values in two int8 planes first (intq.quantize_q8k, the
# integer batch-1 kernel's x: ~2^-16 of each block's amax) and each block's quants dotted with both planes
# on the int8 tensor cores (exact int32 sums), scaled by d_w d_x: the weight tile goes to the MMA as loaded
# (no int8 -> f32 conversion, half the operand bytes of tf32) — the math of ref.qmatvec_q8_0_int, so with
# Q8_MV1.int8 a batched step's block dots equal the single session's.
Q8_ROWS_MODES = ("tf32x2", "bf16x2", "bf16x3", "int8")

# The block scales q8_rows reads: "f16" the packed d [R, K/32] itself; "f32" an f32 copy in that layout,
# "f32t" an f32 copy block-major [K/32, R] (rows_scales_pack adds them to w.data: 1/8 of the weight bytes
# more). Why: a 2-byte load cannot be a cp.async (4 bytes at least), so Triton's pipeline loads the f16
# scales into registers and stores them to shared memory itself, and that store waits on the load (Nsight
# Compute, session 28: q8_rows at B = 32 latency-bound, the STS.U16 of loaded data the top stall line, 11.5 %
# of the samples). f32 scales go through cp.async like the quants and x; block-major they are also one
# contiguous run of BN a block instead of BN strided sectors. sm_90 (bench_q8.py --compile-only, BB 32, BN 64,
# 2 warps): the k loop's STS 1 -> 0, but 127 -> 166 / 168 registers (6 programs an SM instead of 8). H100
# (session 30): per B = 32 step of Q8_0 rows (bench_q8.py --rows) f32t 8.03 ms, f32 8.41, f16 8.59; whole
# 30-layer steps at 8k (batch_check.py "rows f32t", 3 rounds) x1.018 / x1.024 / x1.021 at B = 32 / 24 / 64
# (f32: x1.004-1.008); the batched-vs-alone check with it on passes. So f32t is the default (about 0.8 GB
# more for the whole model's copies); env DS4_Q8_ROWS_SCALES=f16 reads the packed scales again.
Q8_ROWS_SCALES = ("f16", "f32", "f32t")
_SCALE_KEYS = {"f32": "d32", "f32t": "d32t"}  # the data key of each copy (packing.SCALE_COPY_ROW_DIM)


def rows_scales_pack(w: PackedWeight, scales: str) -> None:
    """Adds the f32 copy of w's Q8_0 block scales that Q8RowsConfig(scales=...) reads (no-op for "f16" or
    when present). The model packs its matrices' copies at load (rows_scales_in_use), so that they are in
    its weight bytes and never allocated inside a graph capture."""
    key = _SCALE_KEYS.get(scales)
    if key is None or key in w.data:
        return
    d = w.data["d"].reshape(w.rows, w.K // 32).float()  # [R, K/32]
    w.data[key] = d.t().contiguous() if scales == "f32t" else d


ROWS_TILE_NAMES = ("Q8_ROWS", "Q8_ROWS_NARROW", "Q8_ROWS_WIDE")  # the q8_rows tiles rows_config picks from


def rows_tiles() -> dict[str, Q8RowsConfig]:
    """The q8_rows tiles in force by name (those set: the narrow and wide ones may be None)."""
    tiles = {name: globals()[name] for name in ROWS_TILE_NAMES}
    return {name: t for name, t in tiles.items() if t is not None}


def rows_scales_in_use() -> list[str]:
    """The scale copies the q8_rows tiles in force read (none where every tile reads the f16 scales)."""
    return sorted({t.scales for t in rows_tiles().values() if t.scales != "f16"})


def _rows_scales(w: PackedWeight, scales: str) -> tuple[torch.Tensor, int, int]:
    """(scales, row stride, block stride) of w for q8_rows, packing the copy first where missing (tests,
    tools); a copy may be a column slice of a merged matrix's (block-major), hence the strides."""
    if scales not in Q8_ROWS_SCALES:
        raise ValueError(f"q8_rows: scales must be one of {Q8_ROWS_SCALES}, got {scales!r}")
    if scales != "f16" and _SCALE_KEYS[scales] not in w.data:
        if w.data["d"].is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"q8_rows: scales {scales!r} need rows_scales_pack before a graph capture")
        rows_scales_pack(w, scales)
    d = w.data[_SCALE_KEYS.get(scales, "d")]
    d = d.reshape(w.rows, w.K // 32) if scales == "f16" else d
    return (d, d.stride(1), d.stride(0)) if scales == "f32t" else (d, d.stride(0), d.stride(1))


# Against the dense bf16 GEMM it replaces in batched decode (bench_q8.py --rows, session 8, tf32x2): 1.42x
# its time at B = 16, 1.69x at 32, 3.25x at 64, for f32-accurate products (the bf16 tiles: ~2e-3 off).
# sm_90 builds (bench_q8.py --compile-only, tf32x2): 65 / 96 / 150 registers at BB = 16 / 32 / 64, no
# spills, 10-28 KB of shared memory.
# Split-K at B rows writes and re-reads an f32 [BB, BN] partial per split (8 KB at BB 32, BN 64) next to the
# split's BN x 34 bytes per block of weights: at 4 blocks a split that is as many bytes as its weights.
# Env DS4_Q8_ROWS_TARGET / DS4_Q8_ROWS_MIN_BLOCKS / _STAGES / _BLOCKS for whole-model A/B runs
# (batch_check.py --variants). H200, session 13 (bench_q8.py --rows, per B = 32 step, default 9.2-9.3 ms):
# min_blocks 16 / 32 9.21 / 10.36, 5 stages 9.40, 2 / 4 blocks per iteration 9.28 / 10.13, target 528 9.42,
# BN 32 13.85 (but B = 64: 15.11 vs 19.05), mode int8 10.88; whole B = 32 steps within 0.2 % or slower.
# None of them is what bounds this kernel; the defaults stay. Session 19, mode int8 at the 2-warp default
# (mma.sync; sm_90 k loop 248 instructions vs tf32x2's 349): per B = 16 / 32 / 64 step 6.88 / 9.97 / 16.14
# ms vs 5.48 / 8.56 / 12.14 (faster on q_b 33.9 vs 40.2 us and the head 364 vs 462 at B = 32, slower on the
# grouped o_a 74.7 vs 42.9); whole B = 8 / 32 steps x0.916 / x0.967 (batch_check.py "rows int8"): off.
# Warps: at 4 (a warpgroup) Triton 3.6 lowers the block dots to wgmma, whose B operand (x^T) must sit in
# shared memory: per 32-block the x tile is read out of its pipeline buffer, split, written back twice
# (fenced) and each of the two wgmmas waited for (pendings 0) before the scale, a serial chain per block
# (sm_90 TTGIR; Nsight Compute, session 14: MIO and barrier stalls, 2x more shared wavefronts than L1
# requests). At 1 or 2 warps it lowers them to mma.sync (MMA v2): both operands in registers, the x split
# in registers, no fence and no wait (sm_90 k loop at BB 32, BN 64, 2 warps: 349 instructions, 64 HMMA, 9
# LDS, 127 registers; BN 32: 231, 80 registers). Same products: exact q times tf32 hi and lo. H200
# (session 15; bench_q8.py --rows, per decode step of Q8_0 rows): B = 16 / 32 / 64 at 2 warps 6.11 / 8.52 /
# 15.81 ms vs 7.55 / 9.25 / 19.02 at 4 (BN 32 at 2 warps: 6.42 / 12.64 / 14.01); whole B = 16 / 32 steps
# (batch_check.py --variants, two calls) x1.042 / x1.015 and x1.044 / x1.019. 2 warps is the default (env
# DS4_Q8_ROWS_WARPS=4: wgmma). DS4_Q8_ROWS_BN: the rows per program.
# Above 32 rows (BB 64) Q8_ROWS_WIDE: BN 128 at 8 warps, splits of >= 16 blocks (bench_q8.py --rows, B = 64
# per step: 12.21 ms vs 19.02 at 4 warps, 15.81 at 2; whole B = 64 step at 8k, batch_check.py --variants:
# 83.78 vs 86.82 ms, 763.9 vs 737.1 tok/s, x1.036; 4 warps 90.36). Env DS4_Q8_ROWS_WIDE=0: Q8_ROWS there too.
Q8_ROWS = Q8RowsConfig(
    target=int(os.environ.get("DS4_Q8_ROWS_TARGET", "1056")),
    min_blocks=int(os.environ.get("DS4_Q8_ROWS_MIN_BLOCKS", "4")),
    mode=os.environ.get("DS4_Q8_ROWS_MODE", "tf32x2"),
    stages=int(os.environ.get("DS4_Q8_ROWS_STAGES", "3")),
    blocks=int(os.environ.get("DS4_Q8_ROWS_BLOCKS", "1")),
    warps=int(os.environ.get("DS4_Q8_ROWS_WARPS", "2")),
    bn=int(os.environ.get("DS4_Q8_ROWS_BN", "64")),
    scales=os.environ.get("DS4_Q8_ROWS_SCALES", "f32t"),
)
Q8_ROWS_WIDE_TILE = {"bn": 128, "warps": 8, "min_blocks": 16}  # tools set Q8_ROWS_WIDE from it
_WIDE = os.environ.get("DS4_Q8_ROWS_WIDE", "1") == "1"
Q8_ROWS_WIDE: Q8RowsConfig | None = replace(Q8_ROWS, **Q8_ROWS_WIDE_TILE) if _WIDE else None
# Up to 16 rows (BB 16) Q8_ROWS_NARROW where set: BN 32 at 2 warps, 2,112 programs (bench_q8.py --rows, B = 16
# per step: 5.49 ms vs 6.11 at Q8_ROWS; B = 32 13.60: not there; whole B = 16 step 30.42 vs 30.95 ms, x1.017,
# session 15). Session 16: the batched-vs-alone check with it (batch_check.py, B = 1 / 3 / 8 / 16) gives the
# 2-warp default's figures (0 / 2.57e-4 / 7.60e-4 / 1.86e-2 of the logit std, every argmax equal), the B = 16
# step 30.99 -> 30.51 ms (x1.016): on. Env DS4_Q8_ROWS_NARROW=0: off.
Q8_ROWS_NARROW_TILE = {"bn": 32, "warps": 2, "target": 2112}
_NARROW = os.environ.get("DS4_Q8_ROWS_NARROW", "1") == "1"
Q8_ROWS_NARROW: Q8RowsConfig | None = replace(Q8_ROWS, **Q8_ROWS_NARROW_TILE) if _NARROW else None


def rows_config(b: int) -> Q8RowsConfig:
    """The q8_rows tile for b rows of x: Q8_ROWS, Q8_ROWS_WIDE above 32 rows and Q8_ROWS_NARROW up to 16
    (where set)."""
    if b > 32 and Q8_ROWS_WIDE is not None:
        return Q8_ROWS_WIDE
    return Q8_ROWS_NARROW if b <= 16 and Q8_ROWS_NARROW is not None else Q8_ROWS


@triton.jit
def _q8_rows_block(qp, dp, xp, bmask, kb, dxp, XPLANE, DKB, MODE: tl.constexpr):
    """[BN, BB] f32 products of 32-block kb (quant pointers qp [BN, 32], scales dp [BN] (DKB apart a block), x
    pointers xp [BB, 32] of rows bmask): the block's dots in MODE, times its scales. "int8": xp points into
    x's first int8 plane (the second XPLANE further), dxp [BB] to their scales: the int32 dot
    q . (254 x1 + x2) as two int8 MMAs, times d_w d_x."""
    d = tl.load(dp + kb * DKB).to(tl.float32)  # [BN]
    if MODE == "int8":
        q = tl.load(qp + kb * 32)  # [BN, 32] int8
        x1 = tl.load(xp + kb * 32, mask=bmask[:, None], other=0)  # [BB, 32] int8
        x2 = tl.load(xp + XPLANE + kb * 32, mask=bmask[:, None], other=0)
        # |q . v| <= 32 * 128 * 32385 < 2^31: exact in int32
        dot = tl.dot(q, tl.trans(x1), out_dtype=tl.int32) * 254
        dot = tl.dot(q, tl.trans(x2), dot, out_dtype=tl.int32)  # [BN, BB]
        out = (d[:, None] * tl.load(dxp + kb, mask=bmask, other=0.0)[None, :]) * dot.to(tl.float32)
    else:
        xv = tl.load(xp + kb * 32, mask=bmask[:, None], other=0.0)  # [BB, 32] f32
        if MODE == "bf16x2" or MODE == "bf16x3":
            q = tl.load(qp + kb * 32).to(tl.float32).to(tl.bfloat16)  # [BN, 32] 8-bit integers: exact
            hi, mid = _split_bf16(xv)
            if MODE == "bf16x3":
                mid, lo = _split_bf16(xv - hi.to(tl.float32))  # the remainder exact in f32, split again
                part = tl.dot(q, tl.trans(lo))
                part = tl.dot(q, tl.trans(mid), part)
            else:
                part = tl.dot(q, tl.trans(mid))
            part = tl.dot(q, tl.trans(hi), part)  # [BN, BB]; the small terms first
        else:
            q = tl.load(qp + kb * 32).to(tl.float32)  # [BN, 32] integers: exact in tf32
            hi = _tf32_hi(xv)
            part = tl.dot(q, tl.trans(hi), input_precision="tf32")
            part = tl.dot(q, tl.trans(xv - hi), part, input_precision="tf32")  # [BN, BB]
        out = part * d[:, None]
    return out


@triton.jit
def _q8_rows_kernel(
    x_ptr,
    dx_ptr,
    qs,
    dsc,
    out_ptr,
    sum_ptr,
    cnt_ptr,
    B,
    N,
    K,
    NG,
    stride_x,
    XPLANE,
    kb_per_split,
    DROW,
    DKB,
    BB: tl.constexpr,
    BN: tl.constexpr,
    STAGES: tl.constexpr,
    FIXUP: tl.constexpr,
    MODE: tl.constexpr,
    NB: tl.constexpr = 1,
):
    """Partials out [S, B, N] of x [B, G * K] (row n reads group n // NG) @ W^T, program (row tile, batch
    tile, split); FIXUP: the last split of each tile also writes the sum to sum_ptr [B, N]. MODE: the
    block products (Q8RowsConfig.mode); "int8": x_ptr the planes [2, B, G * K] int8 (XPLANE apart, rows
    stride_x = G * K), dx_ptr their scales [B, G * K / 32]. dsc: W's block scales, DROW apart a row and DKB
    a block (Q8RowsConfig.scales)."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_s = tl.program_id(2)
    n = pid_n * BN + tl.arange(0, BN)
    wrow = tl.minimum(n, N - 1).to(tl.int64)  # clamped: the loads need no mask, the store has one
    b = pid_b * BB + tl.arange(0, BB)
    bmask = b < B
    e = tl.arange(0, 32)
    xbase = ((pid_n * BN) // NG).to(tl.int64) * K  # the program's rows all lie in one group (BN | NG)
    qp = qs + wrow[:, None] * K + e[None, :]  # [BN, 32]
    dp = dsc + wrow * DROW  # [BN]
    xp = x_ptr + b[:, None].to(tl.int64) * stride_x + xbase + e[None, :]  # [BB, 32]
    dxp = dx_ptr + b.to(tl.int64) * (stride_x // 32) + xbase // 32  # [BB] (int8)
    kb_lo = pid_s * kb_per_split
    kb_hi = tl.minimum(kb_lo + kb_per_split, K // 32)
    acc = tl.zeros([BN, BB], dtype=tl.float32)
    for kb0 in tl.range(kb_lo, kb_hi, NB, num_stages=STAGES):
        for j in tl.static_range(NB):  # NB blocks per iteration: more bytes in flight per program
            acc += _q8_rows_block(qp, dp, xp, bmask, kb0 + j, dxp, XPLANE, DKB, MODE)
    tile = pid_n * tl.num_programs(1) + pid_b
    _store_partial(out_ptr, sum_ptr, cnt_ptr, tl.trans(acc), b, bmask, n, B, N, tile, BB, BN, FIXUP)


def q8_rows_plan(b: int, n: int, k: int, cfg: Q8RowsConfig) -> tuple[int, int, tuple[int, int, int]]:
    """(BB, 32-blocks per split, grid) of q8_rows for b rows of x times n Q8_0 rows of length k."""
    bb = 16 if b <= 16 else 32 if b <= 32 else 64
    tiles = triton.cdiv(n, cfg.bn) * triton.cdiv(b, bb)
    n_kb = k // 32
    want = max(1, min(n_kb // cfg.min_blocks, triton.cdiv(cfg.target, tiles)))  # >= min_blocks per split
    nb = rows_blocks(k, cfg)
    per = triton.cdiv(triton.cdiv(n_kb, want), nb) * nb  # whole iterations of nb blocks per split
    return bb, per, (triton.cdiv(n, cfg.bn), triton.cdiv(b, bb), triton.cdiv(n_kb, per))


def rows_blocks(k: int, cfg: Q8RowsConfig) -> int:
    """32-blocks per k iteration of q8_rows: cfg.blocks where it divides the row's blocks, else 1."""
    return cfg.blocks if (k // 32) % cfg.blocks == 0 else 1


def q8_rows(x: torch.Tensor, w: PackedWeight, rows_per_group: int, cfg: Q8RowsConfig | None = None):
    """x [B, G*K] f32 (G groups of K) with Q8_0 rows W [N, K] -> [B, N] f32, f32-accurate; row n reads x
    group n // rows_per_group (rows_per_group = N: a plain matmul). cfg: tile (default rows_config(B))."""
    B, N, K = x.shape[0], w.rows, w.K
    cfg = cfg or rows_config(B)
    if cfg.mode not in Q8_ROWS_MODES:
        raise ValueError(f"q8_rows: mode must be one of {Q8_ROWS_MODES}, got {cfg.mode!r}")
    if rows_per_group % cfg.bn and rows_per_group != N:
        raise ValueError(f"q8_rows: {cfg.bn} rows per program must divide the group of {rows_per_group} rows")
    dsc, drow, dkb = _rows_scales(w, cfg.scales)
    bb, per, grid = q8_rows_plan(B, N, K, cfg)
    o = split_outputs(x.device, grid[2], grid[0] * grid[1], (B, N))  # partials [S, B, N]
    xq, dx, stride, plane = x, x, x.stride(0), 0
    if cfg.mode == "int8":
        q, dx = quantize_q8k(x, 2, 32)  # [2, B, GK], [B, GK/32]
        xq, stride, plane = q, q.shape[2], q[0].numel()
    _q8_rows_kernel[grid](
        xq, dx, w.data["qs"], dsc, o.part, o.total, o.cnt, B, N, K, rows_per_group, stride, plane,
        per, drow, dkb, BB=bb, BN=cfg.bn, STAGES=cfg.stages, FIXUP=o.fixup, MODE=cfg.mode,
        NB=rows_blocks(K, cfg), num_warps=cfg.warps, launch_pdl=PDL,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and x.is_cuda else {}),  # the interpreter takes no cap
    )  # fmt: skip
    return o.result()


# ---------------------------------------------------------------------------------------------------------
# qmatvec_grouped: G independent matrices, each applied to its own slice of x (attention output a-projection)


@triton.jit
def _grouped_mv_kernel(
    x_ptr,
    w0,
    w1,
    w2,
    w3,
    out_ptr,
    G,
    N,
    K,
    QT: tl.constexpr,
    BN: tl.constexpr,
    TK: tl.constexpr,
    SW: tl.constexpr,
):
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)  # = b * G + group
    n = pid_n * BN + tl.arange(0, BN)
    wrow = (pair % G).to(tl.int64) * N + tl.minimum(n, N - 1)
    xrow = tl.zeros([1], dtype=tl.int64) + pair.to(tl.int64) * K
    xmask = tl.full([1], 1, tl.int1)
    y = dot_rows(w0, w1, w2, w3, wrow, x_ptr, xrow, xmask, 0, K // TK, K, QT, 1, BN, TK, SW, False)
    tl.store(out_ptr + pair.to(tl.int64) * N + n[None, :], y, mask=(n < N)[None, :])


def qmatvec_grouped(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [B, G, K] f32|bf16, W [G, N, K] -> [B, G, N] f32: out[b, g] = W[g] @ x[b, g] (decode)."""
    check_weight(w, 3, "qmatvec_grouped", x.device)
    G, N, K = w.shape
    if x.ndim != 3 or x.shape[1:] != (G, K):
        raise ValueError(f"qmatvec_grouped: x must be [B, {G}, {K}], got {tuple(x.shape)}")
    B = x.shape[0]
    x2 = prep_x(x.reshape(B * G, K), K, "qmatvec_grouped")
    if not use_triton(x2):
        return ref.qmatvec_grouped(x2.reshape(B, G, K), w)
    if B == 1 and w.qtype == GGMLType.Q8_0 and N > 0 and N % Q8_MV1.bn == 0:
        return q8_mv1(x2, w, N).view(1, G, N)
    if _takes_q8_rows(B, x2, w) and N > 0 and N % rows_config(B).bn == 0:
        return q8_rows(x2.view(B, G * K), w, N).view(B, G, N)
    out = torch.empty(B, G, N, dtype=torch.float32, device=x.device)
    if B == 0 or N == 0:
        return out
    bn = 16
    _grouped_mv_kernel[(triton.cdiv(N, bn), B * G)](
        x2,
        *weight_args(w),
        out,
        G,
        N,
        K,
        QT=qtype_code(w),
        BN=bn,
        TK=tile_k(w),
        SW=sub_width(w, tile_k(w)),
        num_warps=4,
        launch_pdl=PDL,
    )
    return out


# ---------------------------------------------------------------------------------------------------------
# hmatvec: x f32 [B, K] @ W[N, K]^T for float16 / bfloat16 matrices (the decode step's "side" matrices:
# compressor kv/gate, indexer proj and q_b, router), stored in the file's half precision, several of them
# concatenated along N when they share an input vector. Weight bytes bound the time: a program owns BN rows,
# loads [BN, TK] half tiles (contiguous rows: 16-byte loads) once for all its B rows, and accumulates in f32.
#   mode "fma"   : CUDA-core FMAs, per-lane partial sums [BB, BN, TK] ([BN, TK] at B = 1) reduced once after
#                  the k loop; exact f32 products. BB <= 4 rows per program (more would spill registers: a
#                  larger B re-reads W, from L2 since the row chunks of a weight tile are adjacent programs).
#   mode "ieee"  : tl.dot(W, x^T) with input_precision="ieee" (f32 FMAs, Triton's dot layout), BB = 8|16|32.
#   mode "tf32x2": two tf32 tensor-core dots: W (f16 / bf16) is exact in tf32, x = hi + lo where hi keeps
#                  x's top 10 mantissa bits (exact in tf32) and lo = x - hi (exact in f32, rounded to tf32
#                  by the mma): products off by <= ~2^-21 relative, near f32 summation noise.
#   mode "tf32x3": Triton's built-in 3-pass tf32 (one pass wasted, W has no low part); for comparison.
# Split-K partials go to a [S, B, N] buffer summed in fixed order (deterministic) when N / BN alone gives
# too few programs: by torch after the kernel, or (HalfConfig.fixup) inside it: each program stores its
# partial, bumps its tile's counter, and the last of the S sums the S partials in split order and re-arms
# the counter (per-device int32 counters, zero between calls; calls on one device must be stream-ordered).
# That saves the second launch (~2 us a call, ~100 calls a step). Constraint: K % HALF_K_ALIGN == 0 (the
# smallest k-tile; no masks in the k loop).
# Legend: B activation rows, N output rows, K row length, BB/BN rows per program, TK elements per k-tile.

HALF_DTYPES = (torch.float16, torch.bfloat16)
HALF_K_ALIGN = 64  # every row length must be a multiple of this (the smallest k-tile)
_HALF_MODES = {"fma": 0, "ieee": 1, "tf32x2": 2, "tf32x3": 3}  # kernel MODE codes; 4: "fma" with BB = 1
_FMA_FLAT = 4
HALF_FMA_MAX_BB = 4  # rows of x per program in mode "fma" (acc registers grow with BB * BN * TK)


@dataclass(frozen=True)
class HalfConfig:
    """Tile of hmatvec: BN weight rows per program, TK elements per k-tile (an upper bound: the largest power
    of two <= tk dividing K is used; in mode "fma" tk is divided by BB to keep the per-lane sums in
    registers), warps, pipeline stages of the k loop, programs split-K aims for, the inner product, and
    whether the split-K sum runs in the kernel (fixup) instead of a torch sum after it."""

    bn: int = 8
    tk: int = 512
    warps: int = 4
    stages: int = 2
    target: int = 1056
    mode: str = "fma"
    fixup: bool = False
    prefetch: bool = False  # the first k-tile of weights loaded before pdl_wait() (see Q8Config.prefetch)


# Defaults, NOT yet timed on a GPU: the lead tunes them with tools/gpu/bench_side.py (cold-L2 GB/s at Flash
# shapes). HMV_SMALL serves B <= HALF_SMALL_B (decode at one state), HMV_LARGE larger batches. sm_90 builds
# (bench_side.py --compile-only, Triton 3.6): HMV_SMALL 79 registers at B = 1 (k loop: 5 LDG.128, 32 FFMA),
# 56-64 at B = 2..4; HMV_LARGE 128 (B <= 8) to 242 (B = 32) registers; no spills. "ieee" is shared-memory
# bound (72-136 LDS per loop), "tf32x3" and tf32x2 with tk 256 spill at B = 32.
# H200, cold L2 (bench_side.py --quick, session 3): fma bn4 s3 without split-K was the best or near-best
# config at B = 1 and 8 on every decode shape (attention r4 [2624, 4096] 20.5 -> 13.1 us at B = 1, 43 -> 25 us
# at B = 8; router 21 -> 10.9 us); tf32x2 bn32 wins at B = 32.
HALF_SMALL_B = 8
# Env DS4_HALF_PREFETCH=1: HalfConfig.prefetch on both.
_HALF_PREFETCH = os.environ.get("DS4_HALF_PREFETCH", "0") == "1"
HMV_SMALL = HalfConfig(bn=4, tk=512, warps=4, stages=3, target=1, mode="fma", prefetch=_HALF_PREFETCH)
# HMV_LARGE.fixup (the split sum in the kernel, 105 torch sums fewer per B = 32 step): B = 16 step 38.41 vs
# 38.70 ms, B = 32 60.82 vs 60.84 (batch_check.py --variants "hmv fixup", session 13): noise; off.
HMV_LARGE = HalfConfig(bn=32, tk=128, warps=4, stages=2, target=1056, mode="tf32x2", prefetch=_HALF_PREFETCH)


@triton.jit
def _hmv_tile(acc, w, x_ptr, xp, bmask, pid_b, kt, K, col, TK: tl.constexpr, MODE: tl.constexpr):
    """acc plus k-tile kt of _hmv_kernel: weights w [BN, TK] (f16 / bf16) times the x rows of the program."""
    w = w.to(tl.float32)  # exact (f16 and bf16 are subsets of f32)
    if MODE == 4:  # one row of x: a plain 2-D tile, as q8_mv1
        acc += w * tl.load(x_ptr + pid_b.to(tl.int64) * K + kt * TK + col)[None, :]
    else:
        xv = tl.load(xp + kt * TK, mask=bmask[:, None], other=0.0)  # [BB, TK] f32
        if MODE == 0:
            acc += xv[:, None, :] * w[None, :, :]
        elif MODE == 1:  # W is the dot's A operand: M = BN (large), N = BB (mma n8 fits B = 8 unpadded)
            acc = tl.dot(w, tl.trans(xv), acc, input_precision="ieee")
        elif MODE == 2:
            hi = _tf32_hi(xv)
            acc = tl.dot(w, tl.trans(hi), acc, input_precision="tf32")
            acc = tl.dot(w, tl.trans(xv - hi), acc, input_precision="tf32")
        else:
            acc = tl.dot(w, tl.trans(xv), acc, input_precision="tf32x3")
    return acc


@triton.jit
def _hmv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    cnt_ptr,
    B,
    N,
    K,
    kt_per_split,
    BB: tl.constexpr,
    BN: tl.constexpr,
    TK: tl.constexpr,
    MODE: tl.constexpr,
    STAGES: tl.constexpr,
    FIXUP: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid_b = tl.program_id(0)  # fastest: the row chunks of one weight tile run together (L2 re-reads)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    n = pid_n * BN + tl.arange(0, BN)
    wrow = tl.minimum(n, N - 1).to(tl.int64)  # clamped: the loads need no mask, the store has one
    b = pid_b * BB + tl.arange(0, BB)
    bmask = b < B
    col = tl.arange(0, TK)
    wp = w_ptr + wrow[:, None] * K + col[None, :]  # [BN, TK]
    xp = x_ptr + b[:, None].to(tl.int64) * K + col[None, :]  # [BB, TK]
    kt_lo = pid_s * kt_per_split
    kt_hi = tl.minimum(kt_lo + kt_per_split, K // TK)
    if MODE == 4:
        acc = tl.zeros([BN, TK], dtype=tl.float32)
    elif MODE == 0:
        acc = tl.zeros([BB, BN, TK], dtype=tl.float32)
    else:
        acc = tl.zeros([BN, BB], dtype=tl.float32)
    if PREFETCH:  # the first k-tile of weights before the wait: static (see dispatch.PDL_EARLY)
        w0 = tl.load(wp + kt_lo * TK)
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    if PREFETCH:
        acc = _hmv_tile(acc, w0, x_ptr, xp, bmask, pid_b, kt_lo, K, col, TK, MODE)
        kt_lo += 1
    for kt in tl.range(kt_lo, kt_hi, num_stages=STAGES):
        acc = _hmv_tile(acc, tl.load(wp + kt * TK), x_ptr, xp, bmask, pid_b, kt, K, col, TK, MODE)
    if MODE == 4:
        y = tl.sum(acc, axis=1)[None, :]
    elif MODE == 0:
        y = tl.sum(acc, axis=2)
    else:
        y = tl.trans(acc)
    tile = pid_n * tl.num_programs(0) + pid_b  # this grid is (batch tile, row tile, split)
    _store_partial(out_ptr, sum_ptr, cnt_ptr, y, b, bmask, n, B, N, tile, BB, BN, FIXUP)


def _check_half(x: torch.Tensor, w: torch.Tensor) -> None:
    """One clear error per bad input of hmatvec."""
    if w.ndim != 2 or w.dtype not in HALF_DTYPES:
        raise ValueError(
            f"hmatvec: w must be a float16 or bfloat16 [N, K] matrix, got {w.dtype} {list(w.shape)}"
        )
    if not w.is_contiguous():
        raise ValueError(f"hmatvec: w must be contiguous (row-major [N, K]), got strides {w.stride()}")
    K = w.shape[1]
    if K % HALF_K_ALIGN:
        raise ValueError(f"hmatvec: K must be a multiple of {HALF_K_ALIGN}, got K={K}")
    if x.ndim != 2 or x.shape[1] != K:
        raise ValueError(f"hmatvec: x must be [B, {K}], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"hmatvec: x must be floating point, got {x.dtype}")
    if x.device != w.device:
        raise ValueError(f"hmatvec: w is on {w.device} but x is on {x.device}")


def _check_half_config(cfg: HalfConfig) -> None:
    if cfg.mode not in _HALF_MODES:
        raise ValueError(f"hmatvec: mode must be one of {sorted(_HALF_MODES)}, got {cfg.mode!r}")
    for what, v in (("bn", cfg.bn), ("tk", cfg.tk)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"hmatvec: HalfConfig.{what} must be a power of two, got {v}")


def _half_tile_k(k: int, cap: int) -> int:
    """The largest power of two in [HALF_K_ALIGN, cap] dividing k (cap below the minimum: the minimum)."""
    tk = HALF_K_ALIGN
    while tk * 2 <= cap and k % (tk * 2) == 0:
        tk *= 2
    return tk


def half_tiles(b: int, k: int, cfg: HalfConfig) -> tuple[int, int, int]:
    """(BB, TK, MODE) constexprs of _hmv_kernel for b rows of length k under cfg."""
    _check_half_config(cfg)
    if cfg.mode == "fma":
        bb = min(triton.next_power_of_2(b), HALF_FMA_MAX_BB)
        return bb, _half_tile_k(k, cfg.tk // bb), _FMA_FLAT if bb == 1 else _HALF_MODES["fma"]
    # Triton pads small dot tiles (sm_90: M, N >= 1, K >= 16); BB >= 8 keeps the padding modest
    return min(max(triton.next_power_of_2(b), 8), 32), _half_tile_k(k, cfg.tk), _HALF_MODES[cfg.mode]


def hmatvec(x: torch.Tensor, w: torch.Tensor, cfg: HalfConfig | None = None) -> torch.Tensor:
    """x [B, K] f32 (other float dtypes upcast) @ w[N, K]^T, w float16 | bfloat16 contiguous -> [B, N] f32.

    f32 accumulation: equal to x @ w.float().T up to summation order. K % HALF_K_ALIGN == 0. cfg: the tile
    (default HMV_SMALL for B <= HALF_SMALL_B, else HMV_LARGE). Triton on CUDA (or under the interpreter),
    else the torch twin.
    """
    _check_half(x, w)
    x = x.float().contiguous()
    if not use_triton(x):
        return ref.hmatvec(x, w)
    B, (N, K) = x.shape[0], w.shape
    if B == 0 or N == 0:
        return torch.zeros(B, N, dtype=torch.float32, device=x.device)
    cfg = cfg or (HMV_SMALL if B <= HALF_SMALL_B else HMV_LARGE)
    bb, tk, mode = half_tiles(B, K, cfg)
    n_prog, n_kt = triton.cdiv(N, cfg.bn) * triton.cdiv(B, bb), K // tk
    splits = min(n_kt, max(1, triton.cdiv(cfg.target, n_prog)))
    per = triton.cdiv(n_kt, splits)
    splits = triton.cdiv(n_kt, per)
    out = torch.empty(splits, B, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(B, bb), triton.cdiv(N, cfg.bn), splits)
    cnt = _split_counters(x.device, grid[0] * grid[1]) if cfg.fixup and splits > 1 else None
    total = torch.empty(B, N, dtype=torch.float32, device=x.device) if cnt is not None else out
    _hmv_kernel[grid](
        x, w, out, total, out if cnt is None else cnt, B, N, K, per,
        BB=bb, BN=cfg.bn, TK=tk, MODE=mode, STAGES=cfg.stages, FIXUP=cnt is not None,
        PREFETCH=cfg.prefetch, num_warps=cfg.warps, launch_pdl=PDL,
    )  # fmt: skip
    if cnt is not None:
        return total
    return out[0] if splits == 1 else out.sum(0)


__all__ = [
    "HMV_LARGE",
    "HMV_SMALL",
    "HalfConfig",
    "Q8Config",
    "Q8RowsConfig",
    "Q8_MV1",
    "Q8_ROWS",
    "Q8_ROWS_NARROW",
    "Q8_ROWS_NARROW_TILE",
    "Q8_ROWS_WIDE",
    "Q8_ROWS_WIDE_TILE",
    "dot_rows",
    "hmatvec",
    "q8_mv1",
    "q8_mv1_plan",
    "q8_rows",
    "q8_rows_plan",
    "rows_config",
    "rows_tiles",
    "qmatvec",
    "qmatvec_grouped",
    "qmatvec_plan",
    "use_triton",
]
