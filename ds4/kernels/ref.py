"""Plain-torch twins of the Triton kernels: same signatures, f32 math on exactly dequantized weights.

They are the CPU path of the dispatchers and the oracles of tests/test_kernels_*.py. Each section belongs to
one kernel family.
"""

from __future__ import annotations

import torch

# =========================================================================================================
# Quantized weights: qmatvec / qmatmul (matvec.py, matmul.py) and gathered / grouped experts (moe.py)
# Legend: B (or M) activation rows, N output rows, K row length, E experts, k experts per row, F expert width.


def _unpack(w):  # lazy import: packing imports nothing from here, but keep this module light to import
    from .packing import unpack

    return unpack(w)


def qmatvec(x: torch.Tensor, w) -> torch.Tensor:
    """x [B, K] @ W[N, K]^T -> [B, N] f32."""
    return x.float() @ _unpack(w).T


def qmatvec_grouped(x: torch.Tensor, w) -> torch.Tensor:
    """x [B, G, K], W [G, N, K] -> [B, G, N] f32: out[b, g] = W[g] @ x[b, g]."""
    return torch.einsum("gnk,bgk->bgn", _unpack(w), x.float())


def qmatmul(x: torch.Tensor, w) -> torch.Tensor:
    """x [M, K] @ W[N, K]^T -> [M, N] f32."""
    return x.float() @ _unpack(w).T


def swiglu_clamped(g: torch.Tensor, u: torch.Tensor, clamp: float) -> torch.Tensor:
    """silu(min(g, c)) * clamp(u, -c, c) (model.md §5.5); clamp <= 0 means no clamp."""
    if clamp > 0:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    return torch.nn.functional.silu(g) * u


def moe_gate_up(x: torch.Tensor, wg, wu, ids: torch.Tensor, clamp: float) -> torch.Tensor:
    """x [B, K], W[E, F, K] gate/up, ids [B, k] -> mid [B, k, F] f32 (unweighted)."""
    g_all, u_all = _unpack(wg), _unpack(wu)  # [E, F, K]
    xf = x.float()
    ids = ids.long()
    g = torch.einsum("bjfk,bk->bjf", g_all[ids], xf) if ids.numel() else xf.new_zeros(*ids.shape, wg.N)
    u = torch.einsum("bjfk,bk->bjf", u_all[ids], xf) if ids.numel() else g
    return swiglu_clamped(g, u, clamp)


def moe_down(mid: torch.Tensor, weights: torch.Tensor, wd, ids: torch.Tensor) -> torch.Tensor:
    """mid [B, k, F], weights [B, k], Wd [E, D, F], ids [B, k] -> [B, D] = sum_j weights * Wd[ids] @ mid."""
    d_all = _unpack(wd)  # [E, D, F]
    y = torch.einsum("bjdf,bjf->bjd", d_all[ids.long()], mid.float())  # [B, k, D]
    return (y * weights.float()[..., None]).sum(1)


def moe_grouped(x_sorted: torch.Tensor, w, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[e]..offsets[e+1] of x_sorted [M, K] times W[e]^T -> [M, N] f32 (other rows: 0)."""
    w_all = _unpack(w)  # [E, N, K]
    out = x_sorted.new_zeros(x_sorted.shape[0], w.shape[-2], dtype=torch.float32)
    bounds = offsets.tolist()
    for e in range(len(bounds) - 1):
        if bounds[e + 1] > bounds[e]:
            out[bounds[e] : bounds[e + 1]] = x_sorted[bounds[e] : bounds[e + 1]].float() @ w_all[e].T
    return out


# =========================================================================================================
