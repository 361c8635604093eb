"""Prefill of an 8k prompt on the full synthetic Flash q2 with the grouped expert GEMM's M-tile at 64 and at
128 rows (ds4.kernels.matmul.GROUPED_BM): tok/s of each and the difference of the last logits.

On the H200:   PYTHONPATH=. python tools/gpu/prefill_bm.py [tokens]      (about 1.5 minutes)

Why: a 4,096-token chunk routes ~96 rows to each expert, so 64-row tiles dequantize most experts' weights
twice; 128-row tiles once (the dequantization, not the MMA, bounds this kernel).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ds4.bench import synthetic_model  # noqa: E402
from ds4.kernels import matmul  # noqa: E402


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    model = synthetic_model("q2")
    V = model.cfg.n_vocab
    prompt = torch.randint(2, V, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    results = {}
    for bm in (64, 128):
        matmul.GROUPED_BM = bm
        with torch.inference_mode():
            model.forward(model.new_state(4200), prompt[:4100])  # warm-up: compiles this tile's variant
            st = model.new_state(n + 8)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = model.forward(st, prompt)
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        results[bm] = logits.float().cpu()
        print(f"BM {bm:>3}: prefill of {n} tokens {dt:.2f} s = {n / dt:.0f} tok/s", flush=True)
        del st
    a, b = results[64], results[128]
    print(f"last logits BM 64 vs 128: max |d| / std = {float((a - b).abs().max() / a.std()):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
