"""Decode speed deep into the context, up to the model's 1M-token limit (issue 5's "largest context that fits,
with its decode speed"), without prefilling a million tokens: full-size synthetic Flash q2, a session
allocated for each context, its KV buffers filled with random rows (decode reads them as it would real
ones: the work depends on the position, not on the values) and its length set to that depth.

On the H200:  PYTHONPATH=. python3 tools/gpu/long_decode.py [ctx ...]     (default 65536 262144 1048576)
              PYTHONPATH=. DS4_PDL=0 python3 tools/gpu/long_decode.py --profile CTX   (one eager step's
              kernels at that depth, torch.profiler, the top 15 by CUDA time)

Per context: the session's KV bytes on the device, greedy decode tok/s through the CUDA graph (median of
REPS runs of N steps, after a capture run), and the peak GPU memory so far. `ds4-bench --decode-at` measures
the same in the benchmark's CSV format (session 19 ran this tool, before that option existed).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ds4 import bench  # noqa: E402

N, REPS, SLACK = 32, 3, 8  # steps per run, runs, positions kept free past the last step


def state_bytes(st) -> int:
    return sum(t.numel() * t.element_size() for layer in st.layers for t in layer.tensors())


def decode_at(m, ctx: int) -> str:
    """One line: ctx, KV GB, tok/s at depth ctx - N * (REPS + 1) - SLACK, peak GB."""
    st = m.new_state(ctx)
    depth = ctx - N * (REPS + 1) - SLACK
    bench.fill_random(st, depth, m.cfg.window)
    first = 1000
    m.decode_greedy(st, first, N)  # capture + compile at this context's bucket
    runs = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.decode_greedy(st, first, N)
        torch.cuda.synchronize()
        runs.append(N / (time.perf_counter() - t0))
    kv = state_bytes(st)
    del st
    torch.cuda.empty_cache()
    peak = torch.cuda.max_memory_allocated() / 2**30
    return f"{ctx:>9} {depth:>9} {kv / 1e9:8.2f} {statistics.median(runs):8.2f} {peak:8.1f}"


def profile_at(m, ctx: int) -> None:
    """The top kernels of one eager decode step at depth ctx - SLACK of a random-filled session."""
    from torch.profiler import ProfilerActivity, profile

    st = m.new_state(ctx)
    bench.fill_random(st, ctx - 2 * SLACK, m.cfg.window)
    m.graphs = False
    m.decode_greedy(st, 1000, 1)  # warm-up: compiles
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        m.decode_greedy(st, 1000, 1)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


def main() -> None:
    if sys.argv[1:2] == ["--profile"]:
        with torch.inference_mode():
            profile_at(bench.synthetic_model("q2"), int(sys.argv[2]))
        return
    ctxs = [int(a) for a in sys.argv[1:]] or [65536, 262144, 1048576]
    t0 = time.perf_counter()
    m = bench.synthetic_model("q2")
    weights = m.weight_bytes() / 1e9
    print(f"synthetic Flash q2 in {time.perf_counter() - t0:.1f} s, {weights:.1f} GB of weights; "
          f"{torch.cuda.get_device_name()}; free {torch.cuda.mem_get_info()[0] / 2**30:.1f} GiB")  # fmt: skip
    print(f"{'ctx':>9} {'depth':>9} {'KV GB':>8} {'tok/s':>8} {'peak GiB':>8}")
    with torch.inference_mode():
        for ctx in ctxs:
            print(decode_at(m, ctx), flush=True)


if __name__ == "__main__":
    main()
