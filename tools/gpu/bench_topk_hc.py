"""Session 11's two decode kernels timed against what they replace, and checked at full size (issue 5).

On the H200:   PYTHONPATH=. python3 tools/gpu/bench_topk_hc.py   (about 30 s)

* the indexer top-k (ds4.kernels.topk.top_rows, the radix select_rows and its several-programs-a-row form
  select_rows_wide, B = 1 / 32) vs the stable torch sort
  (ref.top_rows) at the decode widths of 4k / 8k / 64k / 1M context (n = ctx / 4 compressed rows, k = 512):
  median us per call and whether the indices are equal (tied, quantized scores as the FP4 indexer makes
  them, and -inf rows);
* the HC pre at Flash shape, B = 1 (mixing partials + finish): the S = 4 scalar finish vs the tile form.
Timed one call at a time between CUDA events (launch included): decode replays them in a graph.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gpu_timing import median_us  # noqa: E402

from ds4.kernels import fused, ref, topk  # noqa: E402


def bench_topk() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    print("top-k 512 of n (us per call): bitonic kernel, radix select (B = 1 / 32), "
          "wide select (B = 1 / 32), torch stable sort, equal")  # fmt: skip
    for ctx in (4096, 8192, 65536, 1 << 20):
        n = ctx // 4
        s = torch.round(torch.randn(32, n, device="cuda", generator=g) * 8) / 4
        s[:, n // 2 :] = float("-inf")  # rows past the position: invisible
        s1 = s[:1]
        got, want = topk.top_rows(s1, 512), ref.top_rows(s1, 512)
        same_set = torch.equal(topk.select_rows(s, 512), ref.top_rows(s, 512).sort(dim=-1).values)
        t_k = median_us(lambda s=s1: topk.top_rows(s, 512), 50, 5)
        t_r = median_us(lambda s=s1: topk.select_rows(s, 512), 50, 5)
        t_r32 = median_us(lambda s=s: topk.select_rows(s, 512), 50, 5)
        wide = torch.equal(topk.select_rows_wide(s, 512), ref.top_rows(s, 512).sort(dim=-1).values)
        t_w = median_us(lambda s=s1: topk.select_rows_wide(s, 512), 50, 5)
        t_w32 = median_us(lambda s=s: topk.select_rows_wide(s, 512), 50, 5)
        t_s = median_us(lambda s=s1: ref.top_rows(s, 512), 50, 5)
        print(f"  ctx {ctx:>8} n {n:>7}: {t_k:8.1f} {t_r:8.1f} / {t_r32:8.1f} {t_w:8.1f} / {t_w32:8.1f} "
              f"{t_s:8.1f}  equal={torch.equal(got, want)} select={same_set} wide={wide}")  # fmt: skip


def bench_hc() -> None:
    S, d, M = 4, 4096, 24
    X = torch.randn(1, S, d, device="cuda")
    fn = torch.randn(M, S * d, device="cuda") * (S * d) ** -0.5
    scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(M, device="cuda")
    norm = torch.rand(d, device="cuda")
    out = {}
    for scalar in (True, False):
        fused.HC_FINISH_SCALAR = scalar
        out[scalar] = fused.hc_pre_fused(X, fn, scale, base, 20, 1e-6, 1e-6, norm)
        t = median_us(lambda: fused.hc_pre_fused(X, fn, scale, base, 20, 1e-6, 1e-6, norm), 100, 10)
        print(f"hc_pre_fused B = 1 Flash, finish {'scalar' if scalar else 'tile'}: {t:.1f} us")
    fused.HC_FINISH_SCALAR = True
    diff = max(float((a - b).abs().max()) for a, b in zip(out[True], out[False], strict=True))
    print(f"  scalar vs tile max abs diff {diff:.2e}")


if __name__ == "__main__":
    bench_topk()
    bench_hc()
