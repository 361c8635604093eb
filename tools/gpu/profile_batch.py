"""Where a batched decode step's GPU time goes (issue 8): one eager step of B sessions of the full synthetic
Flash q2 under torch.profiler, kernels grouped by name, the top ones with calls, total time and share.

On the H200:   PYTHONPATH=. python tools/gpu/profile_batch.py [B] [ctx]     (about 1 minute; B 32, ctx 2048)

The step is run eagerly (no CUDA graph) so each kernel is seen; kernel times are what a graph replays, the
launch gaps are not (batch_check.py times the graph).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from ds4.bench import synthetic_model  # noqa: E402

TOP = 30


def main() -> int:
    B = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
    t0 = time.perf_counter()
    model = synthetic_model("q2", graphs=False)
    V = model.cfg.n_vocab
    pool = model.new_states(B, ctx + 16)
    with torch.inference_mode():
        model.forward(pool[0], [(i * 7919 + 13) % V for i in range(ctx)])
    for s in pool[1:]:
        s.copy_from(pool[0])
    torch.cuda.synchronize()
    print(f"built + prefilled {ctx} in {time.perf_counter() - t0:.1f} s; profiling B = {B}")
    kv = pool[0].pool
    inputs = torch.tensor(
        [[s.slot for s in pool], [(j * 104729 + 7) % V for j in range(B)], [s.n_tokens for s in pool]],
        dtype=torch.long,
        device="cuda",
    )
    with torch.inference_mode():
        for _ in range(2):  # warm-up: lazy tables, cuBLAS handles, Triton compiles
            model.decode_step_batch(kv, inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.decode_step_batch(kv, inputs)
            torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.key_averages():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue  # CPU-side ops; their kernels are listed on their own
        t = getattr(ev, "self_device_time_total", None)
        t = ev.self_cuda_time_total if t is None else t
        row = per[ev.key[:70]]
        row[0] += ev.count
        row[1] += t
    total = sum(t for _, t in per.values())
    n = sum(int(c) for c, _ in per.values())
    print(f"GPU time of one B={B} step: {total / 1e3:.2f} ms in {n} kernels")
    print(f"{'us':>9} {'share':>6} {'calls':>6}  kernel")
    for name, (calls, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:TOP]:
        print(f"{t:>9.0f} {100 * t / total:>5.1f}% {int(calls):>6}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
