"""Sinkhorn normalisation of the HC combine logits in one kernel (model.md §5.3).

Legend: B rows (tokens), S = hc_mult streams, BS = S rounded up to a power of two.

The torch version (ds4.model.hc.sinkhorn, the twin of this kernel) is 2 * iters reductions and divisions
on a [B, S, S] tensor: ~80 launches of ~1 us for a decode token, per HC site (86 sites per token on Flash).
Here one program per row keeps its S x S matrix in registers for all iterations. Same operation order:
row softmax + eps, column normalisation, then (iters - 1) x (row, column) normalisations, each with + eps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4.model.hc import sinkhorn as sinkhorn_ref


@triton.jit
def sinkhorn_tile(x, r, m, S, iters, eps):
    """Row softmax + eps, then alternating column/row normalisation of a [BS, BS] tile whose live part is
    S x S (m its mask, r the row indices [BS, 1]); shared by this kernel and the fused HC-pre kernel."""
    xm = tl.where(m, x, float("-inf"))
    row_max = tl.max(xm, axis=1)[:, None]
    e = tl.where(m, tl.exp(xm - tl.where(r < S, row_max, 0.0)), 0.0)
    row_sum = tl.sum(e, axis=1)[:, None]
    p = tl.where(m, e / tl.where(row_sum > 0, row_sum, 1.0) + eps, 0.0)
    p = tl.where(m, p / (tl.sum(p, axis=0)[None, :] + eps), 0.0)
    for _ in range(iters - 1):
        p = tl.where(m, p / (tl.sum(p, axis=1)[:, None] + eps), 0.0)
        p = tl.where(m, p / (tl.sum(p, axis=0)[None, :] + eps), 0.0)
    return p


@triton.jit
def _sinkhorn_kernel(x_ptr, out_ptr, S, iters, eps, BS: tl.constexpr):
    b = tl.program_id(0)
    r = tl.arange(0, BS)[:, None]  # src (row)
    c = tl.arange(0, BS)[None, :]  # dst (column)
    m = (r < S) & (c < S)
    offs = b * S * S + r * S + c
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, sinkhorn_tile(x, r, m, S, iters, eps), mask=m)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[B, S, S] float32 -> near doubly-stochastic [B, S, S] (Triton on CUDA, else the torch reference)."""
    if logits.ndim != 3 or logits.shape[1] != logits.shape[2]:
        raise ValueError(f"sinkhorn: logits must be [B, S, S], got {tuple(logits.shape)}")
    if iters < 1:
        raise ValueError(f"sinkhorn: iters must be >= 1, got {iters}")
    import os

    if not (logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return sinkhorn_ref(logits, iters, eps)
    x = logits.float().contiguous()
    B, S = x.shape[0], x.shape[1]
    out = torch.empty_like(x)
    if B:
        _sinkhorn_kernel[(B,)](x, out, S, iters, float(eps), BS=triton.next_power_of_2(S), num_warps=1)
    return out


__all__ = ["sinkhorn"]
