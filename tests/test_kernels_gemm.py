"""gemm.linear_f32 (tf32x3 tensor cores) against an f64 matmul of the same f32 inputs.

Bar: 1e-5 of max |out| (the f32 reference itself is ~1e-7 off; one TF32 product, torch's TF32 mode, is
~1e-3 off, so the bar tells the three-product split from a plain TF32 dot). Tiny shapes with partial tiles
run under Triton's interpreter in CI; the Flash shapes run compiled on the GPU.
"""

from __future__ import annotations

import _kernel_env  # noqa: F401  (interpreter / GPU setup; skips this module in the plain CPU run)
import pytest
import torch
from _kernel_env import CUDA, DEVICE, rel_err

from ds4.kernels import gemm, ref

TOL = 1e-5


def _inputs(M: int, N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)  # made on the CPU: the same values on every device
    x = torch.randn(M, K, generator=g) * 3
    w = torch.randn(N, K, generator=g) * K**-0.5
    return x.to(DEVICE), w.to(DEVICE)


@pytest.mark.parametrize(("M", "N", "K"), [(150, 70, 100), (128, 64, 64), (3, 200, 40)])
def test_linear_f32_matches_f64(M: int, N: int, K: int) -> None:
    x, w = _inputs(M, N, K, seed=M + N + K)
    got = gemm.linear_f32(x, w)
    want = x.double() @ w.double().T
    assert got.shape == (M, N) and got.dtype == torch.float32
    assert rel_err(got, want) < TOL
    assert rel_err(ref.linear_f32(x, w), want) < TOL


def test_linear_f32_strided_rows() -> None:
    """A row-strided view (a slice of wider rows) is read in place, with its own stride."""
    x, w = _inputs(96, 80, 72, seed=5)
    wide = torch.cat([x, torch.full_like(x[:, :8], 1e30)], dim=1)[:, :72]
    assert wide.stride(0) == 80
    assert rel_err(gemm.linear_f32(wide, w), x.double() @ w.double().T) < TOL


def test_linear_f32_rejects_bad_input() -> None:
    x, w = _inputs(4, 8, 16, seed=1)
    with pytest.raises(ValueError, match="float32 only"):
        gemm.linear_f32(x.half(), w)
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        gemm.linear_f32(x, w[:, :8])


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="GPU only: Flash shapes")
@pytest.mark.parametrize("N", [64, 256, 512, 1024])
def test_linear_f32_flash_shapes(N: int) -> None:
    """A 4,096-token chunk times the f32 matrices' shapes (K = 4096): proj, router, kv, compressors."""
    x, w = _inputs(4096, N, 4096, seed=N)
    want = x.double() @ w.double().T
    assert rel_err(gemm.linear_f32(x, w), want) < TOL
    plain = torch.nn.functional.linear(x, w)
    assert rel_err(plain, want) < TOL  # the bar is one f32 GEMMs meet
