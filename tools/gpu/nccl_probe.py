"""NCCL all-reduce probe for expert parallel decode: latency of the per-layer combine (one token's or a small
batch's routed output, f32 [B, 4096]) eagerly and replayed from a CUDA graph, and bus bandwidth at 64 MB.

Launch: torchrun --standalone --nproc-per-node 2 tools/gpu/nccl_probe.py  (NCCL_NVLS_ENABLE=0 is forced).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (device README)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from gpu_timing import median_us


def timed(fn, reps: int = 50) -> float:
    """Median microseconds of fn() over reps, CUDA events."""
    return median_us(fn, reps)


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    n = dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"init done: world {n}", flush=True)
    for rows in (1, 8, 32):
        x = torch.full((rows, 4096), float(rank + 1), device="cuda")
        dist.all_reduce(x)
        assert torch.all(x == n * (n + 1) / 2), "all_reduce gave a wrong sum"
        eager = timed(lambda x=x: dist.all_reduce(x))
        say(f"rows {rows}: sum right, eager {eager:.1f} us; capturing", flush=True)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(43):  # one decode step's worth of per-layer combines
                dist.all_reduce(x)
        graph = timed(g.replay, 20) / 43
        if rank == 0:
            print(f"all_reduce f32 [{rows}, 4096]: eager {eager:.1f} us, in a graph {graph:.1f} us per call")
    big = torch.ones(16 << 20, device="cuda")
    us = timed(lambda: dist.all_reduce(big), 10)
    if rank == 0:
        gbs = 2 * (n - 1) / n * big.numel() * 4 / us / 1e3
        print(f"all_reduce 64 MB: {us:.0f} us, bus {gbs:.0f} GB/s; world {n}, torch {torch.__version__}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
