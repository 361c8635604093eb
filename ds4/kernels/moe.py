"""Routed experts for decode / small batches: gathered-expert GEMVs on packed expert stacks (model.md §5.5).

Expert ids come from a device tensor and are read inside the kernels (no host sync: CUDA-graph capturable).
One program = one (row b, slot j) pair x one tile of output rows, so the B*k selected experts run in one
launch each for gate+up and for down; a pair reads its expert's rows only.

Router weight placement: ``moe_gate_up`` returns the *unweighted* clamped SwiGLU output and ``moe_down``
multiplies each pair's down projection by weights[b, j] before summing over j. By linearity this is
sum_j Wd[e_j] @ (w_j * mid_j), the formula of model.md §5.5 (weight applied before the down projection), up to
f32 rounding.

For larger batches (prefill), sort the pairs by expert with ``group_by_expert`` and use matmul.moe_grouped.

Legend: B rows, k experts per row, K model width (4096), F expert width (2048), E experts, D = down output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ref
from .matvec import check_weight, dot_rows, prep_x, sub_width, tile_k, use_triton, weight_args
from .packing import PackedWeight

_BN = 16  # output rows per program: 16 x (B*k) programs keeps the GPU busy even at B = 1


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
    QT: tl.constexpr,
    BN: tl.constexpr,
    TK: tl.constexpr,
    SW: tl.constexpr,
    CLAMP: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)  # = b * n_slots + j
    e = tl.load(ids_ptr + pair).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    wrow = e * F + tl.minimum(n, F - 1)
    xrow = tl.zeros([1], dtype=tl.int64) + (pair // n_slots).to(tl.int64) * stride_x
    xmask = tl.full([1], 1, tl.int1)
    g = dot_rows(g0, g1, g2, g3, wrow, x_ptr, xrow, xmask, 0, K // TK, K, QT, 1, BN, TK, SW, False)
    u = dot_rows(u0, u1, u2, u3, wrow, x_ptr, xrow, xmask, 0, K // TK, K, QT, 1, BN, TK, SW, False)
    if CLAMP:
        g = tl.minimum(g, clamp)  # the gate has no lower bound (§5.5)
        u = tl.minimum(tl.maximum(u, -clamp), clamp)
    mid = g / (1.0 + tl.exp(-g)) * u  # silu(g) * u
    tl.store(out_ptr + pair.to(tl.int64) * F + n[None, :], mid, mask=(n < F)[None, :])


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
    QT: tl.constexpr,
    BN: tl.constexpr,
    TK: tl.constexpr,
    SW: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    rw = tl.load(rw_ptr + pair).to(tl.float32)
    n = pid_n * BN + tl.arange(0, BN)
    wrow = e * D + tl.minimum(n, D - 1)
    xrow = tl.zeros([1], dtype=tl.int64) + pair.to(tl.int64) * F
    xmask = tl.full([1], 1, tl.int1)
    y = dot_rows(w0, w1, w2, w3, wrow, mid_ptr, xrow, xmask, 0, F // TK, F, QT, 1, BN, TK, SW, False)
    tl.store(out_ptr + pair.to(tl.int64) * D + n[None, :], y * rw, mask=(n < D)[None, :])


def _check_ids(ids: torch.Tensor, b: int, device: torch.device, what: str) -> torch.Tensor:
    if ids.ndim != 2 or ids.shape[0] != b:
        raise ValueError(f"{what}: ids must be [{b}, k], got {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64) or ids.device != device:
        raise ValueError(f"{what}: ids must be int32/int64 on {device}, got {ids.dtype} on {ids.device}")
    return ids.to(torch.int32).contiguous()


def moe_gate_up(
    x: torch.Tensor, wg: PackedWeight, wu: PackedWeight, ids: torch.Tensor, clamp: float
) -> torch.Tensor:
    """x [B, K], gate/up stacks [E, F, K], ids [B, k] -> mid [B, k, F] f32 = silu(min(g, c)) * clamp(u, -c, c)
    with g = Wg[ids] @ x, u = Wu[ids] @ x (clamp <= 0: no clamp). Unweighted (see module doc)."""
    check_weight(wg, 3, "moe_gate_up", x.device)
    check_weight(wu, 3, "moe_gate_up", x.device)
    if wg.qtype != wu.qtype or wg.shape != wu.shape:
        raise ValueError(f"moe_gate_up: gate {wg.qtype.name}{wg.shape} != up {wu.qtype.name}{wu.shape}")
    x = prep_x(x, wg.K, "moe_gate_up")
    ids = _check_ids(ids, x.shape[0], x.device, "moe_gate_up")
    if not use_triton(x):
        return ref.moe_gate_up(x, wg, wu, ids, clamp)
    B, k = ids.shape
    F, K = wg.N, wg.K
    out = torch.empty(B, k, F, dtype=torch.float32, device=x.device)
    if B * k == 0:
        return out
    grid = (triton.cdiv(F, _BN), B * k)
    _gate_up_kernel[grid](
        x, *weight_args(wg), *weight_args(wu), ids, out, k, F, K, x.stride(0), float(clamp),
        QT=int(wg.qtype), BN=_BN, TK=tile_k(wg), SW=sub_width(wg, tile_k(wg)), CLAMP=clamp > 0, num_warps=4,
    )  # fmt: skip
    return out


def moe_down(mid: torch.Tensor, weights: torch.Tensor, wd: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
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
    if not use_triton(mid):
        return ref.moe_down(mid, weights, wd, ids)
    D = wd.N
    mid = prep_x(mid.reshape(B * k, F), F, "moe_down")
    part = torch.empty(B, k, D, dtype=torch.float32, device=mid.device)
    if B * k == 0:
        return part.sum(1)
    grid = (triton.cdiv(D, _BN), B * k)
    _down_kernel[grid](
        mid, *weight_args(wd), ids, weights.float().contiguous(), part, D, F,
        QT=int(wd.qtype), BN=_BN, TK=tile_k(wd), SW=sub_width(wd, tile_k(wd)), num_warps=4,
    )  # fmt: skip
    return part.sum(1)  # fixed order over the k slots: deterministic


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


__all__ = ["group_by_expert", "moe_down", "moe_gate_up"]
