"""Prefill GEMMs on packed weights: tensor-core tiles with the weight tile dequantized in registers.

qmatmul: x [M, K] @ W[N, K]^T -> [M, N] f32 with bf16 x bf16 MMAs (x rounded to bf16 if given f32, the W
tile rounded to bf16 in registers) and f32 accumulation: a bf16-accuracy path (~3e-3 relative). Non-expert
matrices may instead use cuBLAS on bf16 weight copies (cuda_plan.md); this is the no-copy option and the
expert path.

moe_grouped: rows of x_sorted grouped by expert (offsets [E+1] on the device, e.g. from moe.group_by_expert),
row r of group e times W[e]^T -> out[r]. A device-side tile table (one M-tile never spans two experts) sized
by a static bound (cdiv(M, BM) + min(E, M) tiles) keeps it free of host syncs; unused tiles exit at once.

Legend: M rows, N output rows, K row length, E experts, BM/BN program tile, TK elements per k-tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ref
from .matvec import _qmv_kernel, check_weight, dot_rows, prep_x, sub_width, tile_k, use_triton, weight_args
from .packing import PackedWeight

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
        x, *weight_args(w), out, M, N, K, x.stride(0), K // tk,
        QT=int(w.qtype), BB=BM, BN=BN, TK=tk, SW=sub_width(w, tk), USE_DOT=True,
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

    Rows outside offsets[0] .. offsets[E] are 0.
    """
    check_weight(w, 3, "moe_grouped", x_sorted.device)
    x = prep_x(x_sorted, w.K, "moe_grouped")
    n_exp = w.shape[0]
    if offsets.shape != (n_exp + 1,) or offsets.device != x.device:
        raise ValueError(
            f"moe_grouped: offsets must be [{n_exp + 1}] on {x.device}, got {tuple(offsets.shape)} on "
            f"{offsets.device}"
        )
    if not use_triton(x):
        return ref.moe_grouped(x, w, offsets)
    x = x.to(torch.bfloat16)
    M, N, K = x.shape[0], w.N, w.K
    out = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return out
    tile_e, tile_r0 = tile_table(offsets, M, GROUPED_BM)
    grid = (triton.cdiv(N, BN), tile_e.numel())
    _grouped_kernel[grid](
        x, *weight_args(w), out, tile_e, tile_r0, offsets.to(torch.int32), N, K, x.stride(0),
        BM=GROUPED_BM, QT=int(w.qtype), BN=BN, TK=tile_k(w), SW=sub_width(w, tile_k(w)),
        num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
    return out


__all__ = ["moe_grouped", "qmatmul", "tile_table"]
