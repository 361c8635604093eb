"""Does an L2 bulk prefetch (ds4.kernels.prefetch) make the next Q8_0 decode matvec faster, and how long does
the prefetch kernel itself take, by how it is spread over programs?

On the H200:  PYTHONPATH=. python3 tools/gpu/bench_prefetch.py     (< 60 s)

Per Flash shape (the Q8_0 matrices on the decode step's main chain), with L2 flushed before each sample by
writing a 256 MB buffer, CUDA events around the timed launch only, median of REPS:
  cold          the matvec alone (its weights from DRAM);
  slept         a 60 us spin kernel, then the matvec (control for the next rows: same launch pattern);
  pf CxP        prefetch with C KB requests, P a program, the spin, then the matvec (weights from L2 if the
                prefetch landed); and `kern` the prefetch kernel's own time (the stream's next kernel waits
                for it when both are on one stream);
  warm          the matvec right after the same matvec (L2 holds what fits of it).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ds4.config import FLASH  # noqa: E402
from ds4.kernels import matvec as mv  # noqa: E402
from ds4.kernels.prefetch import prefetch_l2  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_q8 import random_q8  # noqa: E402

C = FLASH
REPS = 15
SPIN = 120_000  # clock cycles of torch.cuda._sleep (~60 us at 1.98 GHz)
SHAPES = [  # (label, N, K): the main chain's matrices
    ("q_a+kv", C.q_lora_rank + C.head_dim, C.n_embd),
    ("q_b", C.n_head * C.head_dim, C.q_lora_rank),
    ("o_b", C.n_embd, C.o_groups * C.o_lora_rank),
]
SPREADS = [(64, 32), (16, 32), (4, 32), (64, 4), (256, 1)]  # (KB per request, requests per program)


def timed(before, launch) -> float:
    """us of launch() after before() (both on the current stream), the events around launch only."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before()
    a.record()
    launch()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3


def median(before, launch) -> float:
    timed(before, launch)  # compile / first touch
    return statistics.median(timed(before, launch) for _ in range(REPS))


def bench_shape(label: str, n: int, k: int, gen: torch.Generator, flush) -> str:
    """One table row: cold / slept / warm matvec us, then each spread's matvec-after-prefetch / kernel us."""
    w = random_q8(n, k, 1, gen)
    x = torch.randn(k, device="cuda", generator=gen)
    mb = sum(t.numel() * t.element_size() for t in w.data.values()) / 1e6

    def mat() -> None:
        mv.q8_mv1(x, w, n)

    def pref(kb: int, per: int):
        return lambda: prefetch_l2(list(w.data.values()), 1 << 30, kb << 10, per)

    cold = median(flush, mat)
    slept = median(lambda: (flush(), torch.cuda._sleep(SPIN)), mat)
    warm = median(mat, mat)
    cells = []
    for kb, per in SPREADS:
        after = median(lambda kb=kb, per=per: (flush(), pref(kb, per)(), torch.cuda._sleep(SPIN)), mat)
        kern = median(flush, pref(kb, per))
        cells.append(f"{kb}x{per}: {after:6.1f} / {kern:5.1f}")
    return f"{label:8} {mb:6.1f} {cold:7.1f} {slept:7.1f} {warm:7.1f}   " + "  ".join(cells)


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def flush() -> None:
        flush_buf.zero_()

    print(f"{'shape':8} {'MB':>6} {'cold':>7} {'slept':>7} {'warm':>7}   prefetch (matvec us / kernel us)")
    for label, n, k in SHAPES:
        print(bench_shape(label, n, k, gen, flush), flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
