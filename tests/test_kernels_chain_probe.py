"""The probe kernel of tools/gpu/bench_chain.py (a chain of Q8_0 matvecs: one launch a stage, or one
persistent launch with a grid barrier between stages, each with or without the next stage's first weights
loaded before the wait) against the float64 product chain. On a GPU the barrier joins one program per SM;
under the interpreter (programs run one after another) a single program."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from _kernel_env import CUDA, DEVICE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "gpu"))
import bench_chain  # noqa: E402

WAYS = {"tuned", "launch", "launch+pre", "tiles", "persist", "persist+pre"} | {
    f"tiles {k}" for k in bench_chain.TILES
}


def test_chain_probe_ways_match_the_float64_chain():
    n, stages = (1024, 4) if CUDA else (64, 3)
    programs = torch.cuda.get_device_properties(DEVICE).multi_processor_count if CUDA else 1
    chain = bench_chain.Chain(n, stages, DEVICE, torch.Generator(DEVICE).manual_seed(5))
    errs = bench_chain.check(chain, programs)
    assert set(errs) == WAYS
    for way, (err, give_ups) in errs.items():
        assert err < 1e-4 and give_ups == 0, (way, err, give_ups)
