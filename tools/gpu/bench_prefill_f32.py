"""Prefill's f32 pieces on the H200 (issue 5): gemm.linear_f32 tiles and the HC mixing of many rows.

On the H200:   PYTHONPATH=. python tools/gpu/bench_prefill_f32.py   (about 1 minute)

linear_f32 at an 8k chunk (M = 8192, K = 4096) for N = 256 (router), 512 (kv), 1024 (q_a, compressors) under
each tile (BM, BN, BK, warps, stages) against cuBLAS' f32 F.linear: us, TFLOP/s, error vs f64. HC pre
(fused.hc_pre_fused, X [8192, 4, 4096]) with the row tiles' dots at ieee / tf32x3, row tiles of 32 / 64,
and the per-row mixing: us and GB/s of X read.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gpu_timing import median_us  # noqa: E402

from ds4.kernels import fused, gemm  # noqa: E402

DEV = torch.device("cuda")
# session 9: 128x64x32 w4 s3 fastest of the first six (248 registers a thread at sm_90: one program per SM
# quarter); the last four: the same tile at 8 warps, smaller tiles, more stages
TILES = [(128, 64, 32, 4, 3), (128, 128, 32, 8, 3), (64, 128, 32, 4, 4), (128, 64, 64, 4, 3),
         (128, 128, 32, 4, 4), (256, 64, 32, 8, 3), (128, 64, 32, 8, 3), (64, 64, 32, 4, 3),
         (64, 64, 32, 4, 5), (128, 64, 32, 4, 5)]  # fmt: skip


def timed(fn) -> float:
    return median_us(fn, reps=7, warmup=1)


def linear() -> None:
    M, K = 8192, 4096
    x = torch.randn(M, K, device=DEV)
    for N in (256, 512, 1024):
        w = torch.randn(N, K, device=DEV) * K**-0.5
        want = x.double() @ w.double().T
        flop = 2 * M * N * K
        t = timed(lambda w=w: torch.nn.functional.linear(x, w))
        print(f"N {N:5d} cuBLAS f32        {t:8.1f} us {flop / t / 1e6:6.1f} TFLOP/s")
        for bm, bn, bk, wp, st in TILES:
            gemm.BM, gemm.BN, gemm.BK, gemm.WARPS, gemm.STAGES = bm, bn, bk, wp, st
            got = gemm.linear_f32(x, w)
            err = float((got.double() - want).abs().max() / want.abs().max())
            t = timed(lambda w=w: gemm.linear_f32(x, w))
            tile = f"{bm}x{bn}x{bk} w{wp} s{st}"
            print(f"N {N:5d} tile {tile} {t:8.1f} us {flop / t / 1e6:6.1f} TFLOP/s err {err:.1e}")


def hc() -> None:
    B, S, d = 8192, 4, 4096
    X = torch.randn(B, S, d, device=DEV)
    fn = torch.randn((2 + S) * S, S * d, device=DEV) * (S * d) ** -0.5
    scale, base = torch.rand(3, device=DEV) + 0.5, torch.randn(24, device=DEV)
    norm = torch.rand(d, device=DEV)
    args = (X, fn, scale, base, 20, 1e-6, 1e-6, norm)
    fused.HC_ROWS_MIN = 0
    want = fused.hc_pre_fused(*args)[0]
    cases = [("per row", 0, "ieee", 32, 4), ("rows ieee bt32", 64, "ieee", 32, 4)]
    cases += [(f"rows tf32x3 bt{bt} w{wp}", 64, "tf32x3", bt, wp) for bt, wp in ((32, 4), (64, 4), (64, 8),
                                                                                (128, 8))]  # fmt: skip
    cases += [(f"rows tf32x3 bt64 w4, finish w{fw}", 64, "tf32x3", 64, 4, fw) for fw in (4, 8)]
    for label, rows, prec, bt, wp, *fw in cases:
        fused.HC_ROWS_MIN, fused.HC_ROWS_PREC, fused.HC_ROWS_BT, fused.HC_ROWS_WARPS = rows, prec, bt, wp
        fused.HC_FINISH_ROWS_WARPS = fw[0] if fw else 0
        got = fused.hc_pre_fused(*args)[0]
        err = float((got - want).abs().max() / want.abs().max())
        t = timed(lambda: fused.hc_pre_fused(*args))
        gbs = X.numel() * 4 / t / 1e3
        print(f"hc_pre {label:<32} {t:8.1f} us {gbs:6.0f} GB/s of X  vs per row {err:.1e}")


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    linear()
    hc()
