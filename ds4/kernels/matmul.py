"""Prefill GEMMs on packed weights: tensor-core tiles with the weight tile dequantized in registers.

qmatmul: x [M, K] @ W[N, K]^T -> [M, N] f32 with bf16 x bf16 MMAs (x rounded to bf16 if given f32, the W
tile rounded to bf16 in registers) and f32 accumulation: a bf16-accuracy path (~3e-3 relative). Non-expert
matrices may instead use cuBLAS on bf16 weight copies (cuda_plan.md); this is the no-copy option and the
expert path.

moe_grouped: rows of x_sorted grouped by expert (offsets [E+1] on the device, e.g. from moe.group_by_expert),
row r of group e times W[e]^T -> out[r]. A device-side tile table (one M-tile never spans two experts) sized
by a static bound (cdiv(M, BM) + min(E, M) tiles) keeps it free of host syncs; unused tiles exit at once.
Two implementations (PREFILL_MOE, env DS4_PREFILL_MOE):
  * "dequant" (default): the experts are dequantized by a standalone kernel (dequant_experts) into a reused
    bf16 scratch, a group of experts at a time (at most DEQUANT_BYTES), then a plain bf16 x bf16 grouped GEMM
    reads that dense scratch. The dequantization runs at high occupancy with wide stores (memory bound),
    instead of inside the GEMM's k loop where register pressure and the lack of overlap with the MMAs made it
    the bottleneck (H200, 4k-token chunk: ~190 G weights/s). moe_grouped_pair fuses two stacks that share x
    (gate and up: one scratch [n, Ng + Nu, K], one GEMM); moe_swiglu_grouped also applies the SwiGLU and the
    router weights in that GEMM's epilogue (gate and up rows interleaved in the scratch).
  * "fused": the weight tile is dequantized in registers inside the GEMM (_grouped_kernel; no scratch).
Both round the weights and x to bf16 and accumulate in f32: equal up to the summation order.

Legend: M rows, N output rows, K row length, E experts, BM/BN program tile, TK elements per k-tile.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ds4.quant.types import GGMLType

from . import ref
from .dispatch import require as _check
from .matvec import (
    _qmv_kernel,
    check_weight,
    dot_rows,
    iq2_group_values,
    iq2_group_words,
    prep_x,
    qtype_code,
    sub_width,
    tile_k,
    use_triton,
    weight_args,
)
from .packing import PLAIN_DTYPES, PackedWeight

# Program tile: 64 x 64 with the dequantized [BN, 256] weight tile in registers needs ~220 registers a thread
# at 4 warps (offline sm_90 compile), so 8 warps. tools/gpu/bench_kernels.py times it.
BM, BN, WARPS, STAGES = 64, 64, 8, 2
# moe_grouped's M-tile: a 4,096-token prefill chunk routes ~96 rows to each expert, so 64-row tiles decode
# most experts' weight tiles twice, 128-row tiles once; the on-the-fly dequantization, not the MMA, bounds
# this kernel. H200, synthetic Flash q2, 8k prompt (tools/gpu/prefill_bm.py): 1,049 tok/s at 64, 1,272 at 128.
GROUPED_BM = 128


def qmatmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] bf16 (f32 is rounded to bf16) @ W[N, K]^T -> [M, N] f32 (prefill). Triton on CUDA, else the
    ref twin (which keeps f32 x exact)."""
    check_weight(w, 2, "qmatmul", x.device)
    x = prep_x(x, w.K, "qmatmul")
    if not use_triton(x):
        return ref.qmatmul(x, w)
    x = x.to(torch.bfloat16)
    M, N, K = x.shape[0], w.N, w.K
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return out.zero_()
    tk = tile_k(w)
    grid = (triton.cdiv(N, BN), triton.cdiv(M, BM), 1)
    _qmv_kernel[grid](
        x, *weight_args(w), out, out, out, M, N, K, x.stride(0), K // tk,  # (one split: no sum, no counters)
        QT=qtype_code(w), BB=BM, BN=BN, TK=tk, SW=sub_width(w, tk), USE_DOT=True, FIXUP=False,
        num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
    return out


@triton.jit
def _grouped_kernel(
    x_ptr,
    w0,
    w1,
    w2,
    w3,
    out_ptr,
    tile_e,
    tile_r0,
    offsets,
    N,
    K,
    stride_x,
    BM: tl.constexpr,
    QT: tl.constexpr,
    BN: tl.constexpr,
    TK: tl.constexpr,
    SW: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    e = tl.load(tile_e + pid_t)
    if e < 0:  # past the last used tile
        return
    r0 = tl.load(tile_r0 + pid_t)
    r_end = tl.load(offsets + e + 1)
    rows = r0 + tl.arange(0, BM)
    rmask = rows < r_end
    n = pid_n * BN + tl.arange(0, BN)
    wrow = e.to(tl.int64) * N + tl.minimum(n, N - 1)
    acc = dot_rows(w0, w1, w2, w3, wrow, x_ptr, rows.to(tl.int64) * stride_x, rmask, 0, K // TK, K,
                   QT, BM, BN, TK, SW, True)  # fmt: skip
    out = out_ptr + rows[:, None].to(tl.int64) * N + n[None, :]
    tl.store(out, acc, mask=rmask[:, None] & (n < N)[None, :])


def tile_table(offsets: torch.Tensor, m: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert [T] int32, first row [T] int32) of each M-tile (-1: unused); T = cdiv(m, bm) + min(E, m).

    Device ops only (no host sync). Tiles of expert e cover rows offsets[e] .. offsets[e+1] in steps of bm.
    """
    n_exp = offsets.numel() - 1
    off = offsets.long()
    tiles = (off[1:] - off[:-1] + bm - 1) // bm  # [E]
    ends = torch.cumsum(tiles, 0)  # [E] inclusive tile count
    t = torch.arange(triton.cdiv(m, bm) + min(n_exp, m), device=offsets.device)
    e = torch.searchsorted(ends, t, right=True)  # [T] expert owning tile t (n_exp if unused)
    ec = e.clamp(max=n_exp - 1)
    row0 = off[ec] + (t - (ends - tiles)[ec]) * bm
    return torch.where(e < n_exp, ec, -1).int(), row0.int()


def moe_grouped(x_sorted: torch.Tensor, w: PackedWeight, offsets: torch.Tensor) -> torch.Tensor:
    """x_sorted [M, K] bf16 (rows grouped by expert; f32 is rounded to bf16), stack W [E, N, K], offsets [E+1]
    int32 -> [M, N] f32.

    Rows outside offsets[0] .. offsets[E] are 0. PREFILL_MOE picks the implementation (module docstring).
    """
    x = _check_grouped(x_sorted, [w], offsets, "moe_grouped")
    if not use_triton(x):
        return ref.moe_grouped(x, w, offsets)
    if PREFILL_MOE == "fused":
        return _moe_grouped_fused(x.to(torch.bfloat16), w, offsets)
    return _grouped_dense(x.to(torch.bfloat16), [w], offsets)[0]


def moe_grouped_pair(
    x_sorted: torch.Tensor, wa: PackedWeight, wb: PackedWeight, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(moe_grouped(x_sorted, wa, offsets), moe_grouped(x_sorted, wb, offsets)) for two stacks of the same
    experts and row length (gate and up): [M, Na] and [M, Nb] f32.

    The "dequant" path dequantizes both into one scratch [n, Na + Nb, K] and runs one GEMM (x read once); the
    results are column views of one [M, Na + Nb] tensor.
    """
    x = _check_grouped(x_sorted, [wa, wb], offsets, "moe_grouped_pair")
    if not use_triton(x):
        return ref.moe_grouped(x, wa, offsets), ref.moe_grouped(x, wb, offsets)
    x = x.to(torch.bfloat16)
    if PREFILL_MOE == "fused":
        return _moe_grouped_fused(x, wa, offsets), _moe_grouped_fused(x, wb, offsets)
    ya, yb = _grouped_dense(x, [wa, wb], offsets)
    return ya, yb


def moe_swiglu_grouped(
    x_sorted: torch.Tensor,
    gate: PackedWeight,
    up: PackedWeight,
    offsets: torch.Tensor,
    row_weights: torch.Tensor,
    clamp: float,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """mid [M, F] = silu(min(g, c)) * clamp(u, -c, c) * row_weights[:, None] with g, u = the grouped
    products of x_sorted [M, K] with gate, up [E, F, K] (clamp c <= 0: no clamp; model.md §5.5), computed in
    f32 and stored in out_dtype (bf16: rounded once, for the down GEMM, without an f32 copy in between).

    "dequant" path: gate and up rows interleaved in one scratch, one GEMM whose epilogue applies the SwiGLU
    and the router weight (no [M, 2F] intermediate). "fused" path and CPU: moe_grouped_pair, then torch.
    """
    x = _check_grouped(x_sorted, [gate, up], offsets, "moe_swiglu_grouped")
    if gate.N != up.N or row_weights.shape != (x.shape[0],):
        raise ValueError(
            f"moe_swiglu_grouped: gate and up must have equal widths and row_weights [{x.shape[0]}], got "
            f"{gate.shape}, {up.shape}, {tuple(row_weights.shape)}"
        )
    rw = row_weights.float().contiguous()
    if not use_triton(x) or PREFILL_MOE == "fused":
        g, u = moe_grouped_pair(x, gate, up, offsets)
        return (ref.swiglu_clamped(g, u, clamp) * rw[:, None]).to(out_dtype)
    out = torch.zeros(x.shape[0], gate.N, dtype=out_dtype, device=x.device)
    _dense_groups(x.to(torch.bfloat16), [gate, up], offsets, out, rw, float(clamp))
    return out


@triton.jit
def _gather_sum_kernel(rows_ptr, pos_ptr, out_ptr, D, K: tl.constexpr, BD: tl.constexpr):
    """Program (t, block of D): out[t] = rows[pos[t, 0]] + rows[pos[t, 1]] + ... (f32, j in order)."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = d < D
    acc = tl.zeros([BD], tl.float32)
    for j in tl.static_range(K):
        p = tl.load(pos_ptr + t * K + j).to(tl.int64)
        acc += tl.load(rows_ptr + p * D + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + d, acc, mask=dm)


GATHER_SUM_BD = 1024  # row elements per program of gather_sum


def gather_sum(rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """out [T, D] f32, out[t] = sum_j rows[pos[t, j]] over j = 0 .. k-1 in order; rows [N, D] (f32 or bf16),
    pos [T, k] int row indices. The routed experts' outputs (in expert order) summed per token without the
    [T, k, D] per-slot copy."""
    _check(rows.ndim == 2 and pos.ndim == 2, f"gather_sum: rows [N, D] and pos [T, k] expected, got "
           f"{tuple(rows.shape)} and {tuple(pos.shape)}")  # fmt: skip
    if not use_triton(rows):
        return ref.gather_sum(rows, pos)
    T, k = pos.shape
    D = rows.shape[1]
    out = torch.empty(T, D, dtype=torch.float32, device=rows.device)
    if T and D:
        grid = (T, triton.cdiv(D, GATHER_SUM_BD))
        _gather_sum_kernel[grid](rows.contiguous(), pos.contiguous(), out, D, K=k, BD=GATHER_SUM_BD)
    return out


def _check_grouped(x_sorted: torch.Tensor, ws: list[PackedWeight], offsets: torch.Tensor, what: str):
    """Validated activations (contiguous f32 | bf16) for the grouped GEMMs; one clear error otherwise."""
    if PREFILL_MOE not in ("dequant", "fused"):
        raise ValueError(
            f"{what}: PREFILL_MOE (env DS4_PREFILL_MOE) must be dequant or fused, got {PREFILL_MOE!r}"
        )
    for w in ws:
        check_weight(w, 3, what, x_sorted.device)
    w0 = ws[0]
    for w in ws[1:]:
        if w.shape[0] != w0.shape[0] or w.K != w0.K:
            raise ValueError(f"{what}: stacks must share experts and row length, got {w0.shape}, {w.shape}")
    x = prep_x(x_sorted, w0.K, what)
    n_exp = w0.shape[0]
    if offsets.shape != (n_exp + 1,) or offsets.device != x.device:
        raise ValueError(
            f"{what}: offsets must be [{n_exp + 1}] on {x.device}, got {tuple(offsets.shape)} on "
            f"{offsets.device}"
        )
    return x


def _moe_grouped_fused(x: torch.Tensor, w: PackedWeight, offsets: torch.Tensor) -> torch.Tensor:
    """The "fused" path: x bf16 [M, K] prepared, on a Triton device."""
    M, N, K = x.shape[0], w.N, w.K
    out = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return out
    tile_e, tile_r0 = tile_table(offsets, M, GROUPED_BM)
    grid = (triton.cdiv(N, BN), tile_e.numel())
    _grouped_kernel[grid](
        x, *weight_args(w), out, tile_e, tile_r0, offsets.to(torch.int32), N, K, x.stride(0),
        BM=GROUPED_BM, QT=qtype_code(w), BN=BN, TK=tile_k(w), SW=sub_width(w, tile_k(w)),
        num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------------
# The "dequant" path: dequant_experts (packed experts -> dense bf16 scratch) + a bf16 grouped GEMM on it.

# "dequant" | "fused": the implementation of moe_grouped, moe_grouped_pair, moe_swiglu_grouped (read at each
# call, so tests and benches may set it; the environment sets the default).
PREFILL_MOE = os.environ.get("DS4_PREFILL_MOE", "dequant")
# Bound of the dequantized-expert scratch, allocated lazily on first use, then kept (one per device) and
# reused by every call: 1 GiB holds 32 Flash experts' gate+up ([4096, 4096] bf16) or 64 experts' down.
# The server's KV budget must leave this much device memory free (release_scratch() frees it). Env
# DS4_DEQUANT_MIB sets it (a group holds at least one expert whatever the bound).
DEQUANT_BYTES = int(os.environ.get("DS4_DEQUANT_MIB", "1024")) << 20
_SCRATCH: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class DenseConfig:
    """Tile of the bf16 grouped GEMM: BM rows (one expert) x BN outputs per program, BK per k step."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    warps: int = 8
    stages: int = 3
    loop: bool = False  # programs stride over the M-tiles (waves per SM of them) instead of one tile each
    waves: int = 4


# H200 (tools/gpu/bench_prefill_moe.py, session 3): this tile was the fastest of 9 for both shapes, 240
# TFLOP/s gate+up (32 experts, 3,067 rows), 218 TFLOP/s down (64 experts, 6,124 rows).
GROUPED_DENSE = DenseConfig()
# Dequantization program: DEQ_ROWS weight rows x DEQ_TK elements (a multiple of the format's block). H200:
# 4 x 1024 was the fastest of 6 tiles, IQ2_XXS 3.63 TB/s of bf16 written (16 x 256: 2.10), Q2_K 3.62 (3.29).
DEQ_ROWS, DEQ_TK, DEQ_WARPS = 4, 1024, 4
# Elements per dequantized group (one scale / one grid word) of each format; plain types use 16.
_GROUP = {GGMLType.IQ2_XXS: 8, GGMLType.Q2_K: 16, GGMLType.Q4_K: 32, GGMLType.Q8_0: 32}


@triton.jit
def _dequant_groups(w0, w1, w2, w3, wrow, gg, K, QT: tl.constexpr, W: tl.constexpr):
    """f32 [BR, G, W] values of rows wrow [BR] (int64), elements k = gg[g] * W + j in k order (exact f32:
    the same operations as packing.unpack, all products exact). gg [G]: group indices along the row."""
    j = tl.arange(0, W)
    r = wrow[:, None]
    if QT == 16 or QT == 116:  # IQ2_XXS (116: the quad layout): group = 8 values of one grid word; 4
        idx, a1 = iq2_group_words(w0, w1, r, gg[None, :], K // 256, QT == 116)  # groups a sub-block
        d = tl.load(w2 + r * (K // 256) + (gg // 32)[None, :]).to(tl.float32)
        val = iq2_group_values(idx, a1, d, (gg % 4)[None, :], w3, j)
    elif QT == 10:  # Q2_K: group gl = 8h + 2t + s of a block: bytes 32h + 16s + j, shift 2t; scale byte gl
        blk = gg // 16
        gl = gg % 16
        qoff = blk * 64 + (gl // 8) * 32 + (gl % 2) * 16
        q8 = tl.load(w0 + r[:, :, None] * (K // 4) + qoff[None, :, None] + j[None, None, :])
        q = ((q8.to(tl.int32) >> (2 * ((gl // 2) % 4))[None, :, None]) & 3).to(tl.float32)
        sc = tl.load(w1 + r * (K // 16) + gg[None, :])
        d = tl.load(w2 + r * (K // 128) + (2 * blk)[None, :]).to(tl.float32)
        dmin = tl.load(w2 + r * (K // 128) + (2 * blk + 1)[None, :]).to(tl.float32)
        dl = d * (sc & 15).to(tl.float32)
        ml = dmin * (sc >> 4).to(tl.float32)
        val = dl[:, :, None] * q - ml[:, :, None]
    elif QT == 12:  # Q4_K: group gl = 2c + h of a block: bytes 32c + j, nibble h; scale gl, min 8 + gl
        blk = gg // 8
        gl = gg % 8
        qoff = blk * 128 + (gl // 2) * 32
        q8 = tl.load(w0 + r[:, :, None] * (K // 2) + qoff[None, :, None] + j[None, None, :])
        q = ((q8.to(tl.int32) >> (4 * (gl % 2))[None, :, None]) & 15).to(tl.float32)
        sc = tl.load(w1 + r * (K // 16) + (blk * 16 + gl)[None, :])
        mn = tl.load(w1 + r * (K // 16) + (blk * 16 + 8 + gl)[None, :])
        d = tl.load(w2 + r * (K // 128) + (2 * blk)[None, :]).to(tl.float32)
        dmin = tl.load(w2 + r * (K // 128) + (2 * blk + 1)[None, :]).to(tl.float32)
        dl = d * sc.to(tl.float32)
        ml = dmin * mn.to(tl.float32)
        val = dl[:, :, None] * q - ml[:, :, None]
    elif QT == 8:  # Q8_0: group = one block of 32
        q = tl.load(w0 + r[:, :, None] * K + (gg * 32)[None, :, None] + j[None, None, :]).to(tl.float32)
        d = tl.load(w1 + r * (K // 32) + gg[None, :]).to(tl.float32)
        val = q * d[:, :, None]
    else:  # F32 / F16 / BF16
        val = tl.load(w0 + r[:, :, None] * K + (gg * W)[None, :, None] + j[None, None, :]).to(tl.float32)
    return val


@triton.jit
def _dequant_kernel(
    w0,
    w1,
    w2,
    w3,
    out_ptr,
    ids,
    offsets,
    N,
    K,
    stride_oe,
    stride_on,
    QT: tl.constexpr,
    BR: tl.constexpr,
    G: tl.constexpr,
    W: tl.constexpr,
    SKIP: tl.constexpr,
    SOFT_RNE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    sel = tl.program_id(2)
    e = tl.load(ids + sel)
    if SKIP:  # experts without rows: nothing to dequantize
        if tl.load(offsets + e + 1) == tl.load(offsets + e):
            return
    n = pid_n * BR + tl.arange(0, BR)
    wrow = e.to(tl.int64) * N + tl.minimum(n, N - 1)  # clamped: loads need no mask, the store has one
    gg = pid_k * G + tl.arange(0, G)
    val = _dequant_groups(w0, w1, w2, w3, wrow, gg, K, QT, W)  # [BR, G, W]
    col = (gg * W)[None, :, None] + tl.arange(0, W)[None, None, :]
    out = out_ptr + sel.to(tl.int64) * stride_oe + n[:, None, None].to(tl.int64) * stride_on + col
    if SOFT_RNE:  # interpreter: its f32 -> bf16 cast truncates; round to nearest even on the bits (finite)
        u = val.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        tl.store(out, u.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=(n < N)[:, None, None])
    else:  # the hardware conversion rounds to nearest even
        tl.store(out, val.to(tl.bfloat16), mask=(n < N)[:, None, None])


def dequant_experts(
    w: PackedWeight,
    ids: torch.Tensor,
    out: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Experts ids [n] (int32, device) of a stack W [E, N, K] -> bf16 [n, N, K], bit-equal to
    unpack(W)[ids].to(bfloat16).

    out: where to write, a [n, N, K] bf16 view whose rows are contiguous (e.g. a slice of a larger scratch
    [n, N', K], or every other row of it). offsets [E+1] (optional): experts with offsets[e+1] == offsets[e]
    are skipped (their slices of out are left as they were). Triton only (CUDA or the interpreter).
    """
    check_weight(w, 3, "dequant_experts", ids.device)
    n_sel, N, K = ids.numel(), w.N, w.K
    if out is None:
        out = torch.empty(n_sel, N, K, dtype=torch.bfloat16, device=ids.device)
    if out.shape != (n_sel, N, K) or out.dtype != torch.bfloat16 or out.stride(2) != 1:
        raise ValueError(
            f"dequant_experts: out must be bf16 [{n_sel}, {N}, {K}] with contiguous rows, got {out.dtype} "
            f"{tuple(out.shape)} strides {out.stride()}"
        )
    if n_sel == 0 or N == 0:
        return out
    grp = _GROUP.get(w.qtype, 16)
    tk = _deq_tile_k(w, grp)
    skip = offsets is not None
    grid = (triton.cdiv(N, DEQ_ROWS), K // tk, n_sel)
    _dequant_kernel[grid](
        *weight_args(w), out, ids.to(torch.int32), offsets.to(torch.int32) if skip else ids, N, K,
        out.stride(0), out.stride(1), QT=qtype_code(w), BR=DEQ_ROWS, G=tk // grp, W=grp, SKIP=skip,
        SOFT_RNE=os.environ.get("TRITON_INTERPRET") == "1", num_warps=DEQ_WARPS,
    )  # fmt: skip
    return out


def _deq_tile_k(w: PackedWeight, grp: int) -> int:
    """Elements per dequant program along k: DEQ_TK, or the largest power of two below it dividing K (at least
    one group; K-quants: one 256-element block)."""
    tk = max(DEQ_TK, 256) if w.qtype in (GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS) else DEQ_TK
    while tk > grp and w.K % tk:
        tk //= 2
    if w.K % tk or (w.qtype not in PLAIN_DTYPES and w.qtype != GGMLType.Q8_0 and tk % 256):
        raise ValueError(f"dequant_experts: {w.qtype.name} row length {w.K} is not a multiple of {tk}")
    return tk


@triton.jit
def _dense_tile(x_ptr, w_ptr, out_ptr, t, tile_e, tile_r0, offsets, e_lo, n0, N, K, stride_x, stride_we,
                stride_o, rw_ptr, clamp, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                EPI: tl.constexpr):  # fmt: skip
    """acc = x[rows of M-tile t] @ Wd[e - e_lo, n0 : n0 + BN]^T (f32 accumulation), then the epilogue:
    EPI 0: out[rows, n] = acc. EPI 1 (scratch rows interleaved gate, up): out[rows, n0/2 + j] =
    silu(min(g, c)) * clamp(u, -c, c) * rw[rows] with g, u = acc[:, 2j], acc[:, 2j+1]; clamp c <= 0: none."""
    e = tl.load(tile_e + t)
    r0 = tl.load(tile_r0 + t)
    r_end = tl.load(offsets + e + 1)
    rows = r0 + tl.arange(0, BM)
    rmask = rows < r_end
    n = n0 + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    xp = x_ptr + rows[:, None].to(tl.int64) * stride_x + kk[None, :]  # [BM, BK]
    wrow = (e - e_lo).to(tl.int64) * stride_we + tl.minimum(n, N - 1).to(tl.int64) * K
    wp = w_ptr + wrow[None, :] + kk[:, None]  # [BK, BN]: the W^T tile
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for _ in range(0, K // BK):
        a = tl.load(xp, mask=rmask[:, None], other=0.0)
        b = tl.load(wp)
        acc = tl.dot(a, b, acc)
        xp += BK
        wp += BK
    orow = out_ptr + rows[:, None].to(tl.int64) * stride_o
    if EPI == 1:
        g, u = tl.split(tl.reshape(acc, [BM, BN // 2, 2]))  # [BM, BN/2] each
        if clamp > 0:
            g = tl.minimum(g, clamp)
            u = tl.minimum(tl.maximum(u, -clamp), clamp)
        rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
        mid = g / (1.0 + tl.exp(-g)) * u * rw[:, None]
        f = n0 // 2 + tl.arange(0, BN // 2)
        tl.store(orow + f[None, :], mid, mask=rmask[:, None] & (f < N // 2)[None, :])
    else:
        tl.store(orow + n[None, :], acc, mask=rmask[:, None] & (n < N)[None, :])


@triton.jit
def _grouped_dense_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    tile_e,
    tile_r0,
    offsets,
    group_tiles,
    g,
    e_lo,
    N,
    K,
    stride_x,
    stride_we,
    stride_o,
    rw_ptr,
    clamp,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    LOOP: tl.constexpr,
    EPI: tl.constexpr,
):
    """out[rows, :] = x[rows] @ Wd[e - e_lo]^T (EPI: _dense_tile) for the M-tiles group_tiles[g] ..
    group_tiles[g+1] of the tile table (the experts of group g, from e_lo); Wd the dense bf16 scratch
    [n, N, K] (row stride K, expert stride stride_we). Axis 1 counts from the group's first tile: one tile
    per program, the programs past the group's last tile exit at once (the grid is a static bound: no host
    sync); LOOP: fewer programs stride over the group's tiles (no idle programs, but more registers: 152 vs
    104 at 128 x 128 x 64, 8 warps)."""
    n0 = tl.program_id(0) * BN
    t_lo = tl.load(group_tiles + g)
    t_hi = tl.load(group_tiles + g + 1)
    if LOOP:
        for t in range(t_lo + tl.program_id(1), t_hi, tl.num_programs(1)):
            _dense_tile(x_ptr, w_ptr, out_ptr, t, tile_e, tile_r0, offsets, e_lo, n0, N, K, stride_x,
                        stride_we, stride_o, rw_ptr, clamp, BM, BN, BK, EPI)  # fmt: skip
    else:
        t = t_lo + tl.program_id(1)
        if t < t_hi:
            _dense_tile(x_ptr, w_ptr, out_ptr, t, tile_e, tile_r0, offsets, e_lo, n0, N, K, stride_x,
                        stride_we, stride_o, rw_ptr, clamp, BM, BN, BK, EPI)  # fmt: skip


def group_tiles(offsets: torch.Tensor, bm: int, per: int) -> torch.Tensor:
    """int32 [G+1]: the first tile_table index of each group of `per` experts, then the end (device ops)."""
    off = offsets.long()
    tiles = (off[1:] - off[:-1] + bm - 1) // bm  # [E]
    ends = torch.cat([tiles.new_zeros(1), torch.cumsum(tiles, 0)])  # [E+1]
    n_exp = tiles.numel()
    n_groups = -(-n_exp // per)
    edges = (torch.arange(n_groups + 1, device=offsets.device) * per).clamp_(max=n_exp)  # (no host copy)
    return ends[edges].int()


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _scratch(device: torch.device, numel: int) -> torch.Tensor:
    """A reused flat bf16 buffer of at least numel elements on device (grown on demand, never shrunk)."""
    buf = _SCRATCH.get(device)
    if buf is None or buf.numel() < numel:
        _SCRATCH.pop(device, None)  # free the old one first
        buf = _SCRATCH[device] = torch.empty(numel, dtype=torch.bfloat16, device=device)
    return buf


def release_scratch() -> None:
    """Free the dequant scratch of every device (the next "dequant" call allocates it again)."""
    _SCRATCH.clear()


def scratch_experts(n_exp: int, rows: int, k: int) -> int:
    """Experts per group of the "dequant" path: [rows, k] bf16 matrices that fit DEQUANT_BYTES (>= 1)."""
    return max(1, min(n_exp, DEQUANT_BYTES // (rows * k * 2)))


def _grouped_dense(x: torch.Tensor, ws: list[PackedWeight], offsets: torch.Tensor) -> list[torch.Tensor]:
    """x bf16 [M, K] (prepared, Triton device), stacks sharing E and K -> [M, N_i] f32 each (column views).

    Per group of experts: dequantize every stack into its column slice of the scratch [n, sum N_i, K], then
    one GEMM over the group's M-tiles. The host loop depends on shapes only (no host sync).
    """
    widths = [w.N for w in ws]
    out = torch.zeros(x.shape[0], sum(widths), dtype=torch.float32, device=x.device)
    _dense_groups(x, ws, offsets, out, None, 0.0)
    return [out[:, c - n : c] for n, c in zip(widths, _cumsum(widths), strict=True)]


def _dense_groups(
    x, ws: list[PackedWeight], offsets, out: torch.Tensor, rw: torch.Tensor | None, clamp: float
):
    """The group loop of the "dequant" path into out [M, sum N_i] f32; rw [M] given: two stacks (gate, up)
    interleaved row by row in the scratch and the SwiGLU epilogue, out [M, N_0]."""
    M, K, n_exp = x.shape[0], ws[0].K, ws[0].shape[0]
    nt = sum(w.N for w in ws)
    if M == 0 or nt == 0:
        return
    cfg = GROUPED_DENSE  # read at each call: tests and the bench swap it
    if K % cfg.bk:
        raise ValueError(f"moe_grouped: row length {K} must be a multiple of {cfg.bk} (GROUPED_DENSE.bk)")
    per = scratch_experts(n_exp, nt, K)
    buf = _scratch(x.device, per * nt * K).narrow(0, 0, per * nt * K).view(per, nt, K)
    offsets = offsets.to(torch.int32)
    ids = torch.arange(n_exp, dtype=torch.int32, device=x.device)
    tile_e, tile_r0 = tile_table(offsets, M, cfg.bm)
    bounds = group_tiles(offsets, cfg.bm, per)
    n_col = triton.cdiv(nt, cfg.bn)
    n_prog = tile_e.numel()  # static bound of a group's tiles
    if cfg.loop:
        n_prog = max(1, min(n_prog, triton.cdiv(cfg.waves * _sm_count(x.device), n_col)))
    for g, e0 in enumerate(range(0, n_exp, per)):
        n = min(per, n_exp - e0)
        if rw is None:  # stack i -> its rows of the scratch
            for w, c in zip(ws, _cumsum([w.N for w in ws]), strict=True):
                dequant_experts(w, ids[e0 : e0 + n], buf[:n, c - w.N : c], offsets)
        else:  # gate -> even rows, up -> odd rows
            for i, w in enumerate(ws):
                dequant_experts(w, ids[e0 : e0 + n], buf[:n, i::2], offsets)
        _grouped_dense_kernel[(n_col, n_prog)](
            x, buf, out, tile_e, tile_r0, offsets, bounds, g, e0, nt, K, x.stride(0), nt * K, out.stride(0),
            out if rw is None else rw, clamp, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, LOOP=cfg.loop,
            EPI=0 if rw is None else 1, num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip


def _cumsum(xs: list[int]) -> list[int]:
    total, out = 0, []
    for v in xs:
        total += v
        out.append(total)
    return out


__all__ = [
    "DEQUANT_BYTES",
    "GROUPED_DENSE",
    "PREFILL_MOE",
    "DenseConfig",
    "dequant_experts",
    "gather_sum",
    "group_tiles",
    "moe_grouped",
    "moe_grouped_pair",
    "moe_swiglu_grouped",
    "qmatmul",
    "release_scratch",
    "scratch_experts",
    "tile_table",
]
