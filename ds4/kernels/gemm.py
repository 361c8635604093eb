"""f32 GEMMs at f32 accuracy on tensor cores: prefill's projections kept in float32.

Legend: M activation rows, N output rows, K row length, BM/BN/BK program tile.

linear_f32(x [M, K] f32, w [N, K] f32) -> x @ w^T [M, N] f32. The weights that stay float32 on the device
(router, compressors, and the matrices below ds4.model.cuda.weights' size bound: q_a, kv, indexer proj) are
selection-critical or small, so prefill must not round them to bf16; cuBLAS multiplies them on the FMA units
(torch keeps TF32 off), which took 206 ms of an 8k prefill's 2.2 s on the H200 (session 9 profile). Triton's
"tf32x3" dot splits each operand into a TF32 high part and a TF32 remainder and sums three tensor-core
products (hi*hi + hi*lo + lo*hi): about f32 accuracy (~1e-6 relative here, test_kernels_gemm.py) at several
times the FMA rate. torch's own TF32 switch would keep only one product (~1e-3 relative).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ref
from .dispatch import require, use_triton

# Program tile: N is 64..1024 for these weights, M a prefill chunk. H200 (tools/gpu/bench_prefill_f32.py,
# session 9; M = 8192, K = 4096): this tile was the fastest of 6, N = 256 / 512 / 1024 303.7 / 531.3 /
# 1,048.5 us (65.5 TFLOP/s) against cuBLAS f32 442.7 / 740.4 / 1,431.2 us (48.0), 5-6e-7 off an f64 product.
# Session 10 (same bench, 10 tiles): 5 stages instead of 3 is faster at every N, 288.1 / 520.7 / 976.6 us vs
# 306.9 / 533.1 / 977.9 (70.4 TFLOP/s at N = 1024; cuBLAS f32 48.6).
BM, BN, BK = 128, 64, 32
WARPS, STAGES = 4, 5
GROUP_M = 8  # row tiles swept per column tile before moving on (L2 reuse of w)


@triton.jit
def _linear_f32_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, sx, sw, so,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Program (grouped tile order): out[rows, cols] = x[rows] . w[cols]^T over all of K."""
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    size_m = min(n_m - first_m, GROUP_M)
    pm = first_m + (pid % per_group) % size_m
    pn = (pid % per_group) // size_m
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    mm, nm = rm < M, rn < N
    xr = x_ptr + rm.to(tl.int64)[:, None] * sx
    wr = w_ptr + rn.to(tl.int64)[:, None] * sw
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        a = tl.load(xr + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        b = tl.load(wr + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision="tf32x3")
    out = out_ptr + rm.to(tl.int64)[:, None] * so + rn[None, :]
    tl.store(out, acc, mask=mm[:, None] & nm[None, :])


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] f32 @ w[N, K]^T -> [M, N] f32 (tf32x3 tensor cores on CUDA; F.linear elsewhere)."""
    require(x.ndim == 2 and w.ndim == 2 and x.shape[1] == w.shape[1], f"linear_f32: x [M, K] and w [N, K] "
            f"expected, got {tuple(x.shape)} and {tuple(w.shape)}")  # fmt: skip
    require(x.dtype == w.dtype == torch.float32, f"linear_f32: float32 only, got {x.dtype} and {w.dtype}")
    if not use_triton(x):
        return ref.linear_f32(x, w)
    M, K = x.shape
    N = w.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    out = torch.empty(M, N, device=x.device, dtype=torch.float32)
    if M and N:
        grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
        _linear_f32_kernel[grid](
            x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
            BM=BM, BN=BN, BK=BK, GROUP_M=GROUP_M, num_warps=WARPS, num_stages=STAGES,
        )  # fmt: skip
    return out
