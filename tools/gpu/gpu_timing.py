"""The GPU tools' timer: median microseconds of a call between two CUDA events."""

from __future__ import annotations

import statistics

import torch


def median_us(fn, reps: int, warmup: int = 0) -> float:
    """Median microseconds of fn() over reps calls, each between two CUDA events, after warmup calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)
