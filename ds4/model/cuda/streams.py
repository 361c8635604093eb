"""Independent branches of the decode step run side by side: the current stream and up to three side streams
("lanes"; a CUDA graph captures each as a fork / join). Why: the step's kernels are 2-60 us each and most
of them leave the H200's bandwidth half used (the B = 1 routed experts read at ~0.7 TB/s), so the shared
expert next to the routed ones, the query projection (lane 1) and the compressor chain (lane 3) next to
the q_a / kv / indexer work, or the HC combine's Sinkhorn (lane 2) next to a whole sublayer, fill gaps
that one stream leaves idle. Same kernels on the same inputs either way: the results do not change.

Memory: a tensor made on the main stream and read on the side one stays referenced by the caller until the
join (so the allocator cannot hand its block to later main-stream work while the side stream still reads
it); a tensor made on the side stream is read on the main stream only after the join, and the next fork
waits for the main stream, so its block's reuse on the side stream comes after those reads. Kernels that
keep state across programs (the split-K tile counters of ds4.kernels.matvec) use the side lane's own copy.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch

from ds4 import dist

try:
    from ds4.kernels.matvec import counter_lane
except ImportError:  # pragma: no cover - no triton
    from contextlib import nullcontext as counter_lane

# Env DS4_STREAMS=0: every branch on the current stream (A/B timing, tools/gpu/ab_decode.py "1 stream").
CONCURRENT = os.environ.get("DS4_STREAMS", "1") != "0"

T = TypeVar("T")
_SIDE: dict[tuple[int, int], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, lane: int) -> torch.cuda.Stream:
    key = (device.index if device.index is not None else torch.cuda.current_device(), lane)
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device=key[0])
    return _SIDE[key]


class Branch:
    """`Branch(device, fn)` starts fn() on a side stream (after everything queued on the current one);
    `join()` makes the current stream wait for it and returns fn's result. Off CUDA, with CONCURRENT off or
    under expert parallelism (collectives keep one order per rank), fn runs at once on the current stream.
    lane: which side stream (1, 2, ...): branches open at the same time take different lanes, so that one's
    work does not queue behind the other's. fn (and so what it reads) is held until the join."""

    def __init__(self, device: torch.device, fn: Callable[[], T], lane: int = 1) -> None:
        self._side = None
        if CONCURRENT and device.type == "cuda" and not dist.active():
            main = torch.cuda.current_stream(device)
            self._side, self._fn = _side_stream(device, lane), fn
            self._side.wait_stream(main)
            with torch.cuda.stream(self._side), counter_lane(lane):  # split-K counters of its own
                self._out = fn()
        else:
            self._out = fn()

    @classmethod
    def ready(cls, value: T) -> Branch:
        """A branch with nothing left to run: join() returns value."""
        b = cls.__new__(cls)
        b._side, b._out = None, value
        return b

    def join(self) -> T:
        if self._side is not None:
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)
            self._side = self._fn = None
        return self._out
