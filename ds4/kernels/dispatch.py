"""The two checks every kernel module's dispatcher makes, and the decode kernels' launch mode (one place for
all of ds4.kernels)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernels for tensors on CUDA, or anywhere under TRITON_INTERPRET=1 (tests)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def require(cond: bool, msg: str) -> None:
    """Bad input gets one clear ValueError naming what was wrong."""
    if not cond:
        raise ValueError(msg)


# Programmatic dependent launch (sm_90) for the decode step's kernels: each is launched with launch_pdl=PDL
# and, as its first step, waits (griddepcontrol.wait, pdl_wait) until the kernel before it in the stream
# has finished and its writes are visible. The launch and the block scheduling of a kernel then overlap the
# previous kernel's drain, while nothing of it runs before its inputs exist (a decode step is ~1,400 launches
# of 2-20 us each). On by default where the GPU has it (sm_90 and later): on the H200 (tools/gpu/ab_decode.py,
# 2026-12-01, 4k ctx) the whole model decoded 84.68 tok/s with it vs 80.21 without. Env DS4_PDL=0 / 1 forces
# it. Never under Triton's interpreter (no PTX there). A test checks that every kernel launched with
# launch_pdl begins with pdl_wait() (tests/test_pdl_wiring.py).
def _pdl_default() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if "DS4_PDL" in os.environ:
        return os.environ["DS4_PDL"] == "1"
    try:
        return torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] >= 9
    except RuntimeError:  # a broken driver: no PDL, the kernels' own errors say the rest
        return False


PDL = _pdl_default()
_PDL = tl.constexpr(PDL)

# Early trigger: each kernel, once past its wait, lets the next kernel of the stream launch
# (griddepcontrol.launch_dependents) instead of at its own end. The next kernel's programs then take the
# SM slots that this one's programs free as they finish and run what precedes their pdl_wait() (the
# weight-streaming kernels' loads of their first weight tile: Q8Config.prefetch / HalfConfig.prefetch) while
# this one drains. Only static weights may be read before the wait (tests/test_pdl_wiring.py checks the
# source): the wait still holds everything else until this kernel has finished and its writes are visible.
# On by default: on the H200 (tools/gpu/ab_decode.py, session 7, 4k ctx, one process each) the whole model
# decoded 88.43 tok/s with it vs 86.47 without. Session 7's B = 8 batched-vs-alone check once measured
# 2.59e-2 of the logit std with it (bar 2e-2); session 8 re-ran it twice with it on: 1.07e-3 both times,
# equal to the figure without it, and test_cuda_backend's replay test (bit-identical repeats, batched and
# alone) passed with it. What made the earlier figure is not known (session 7 ran it with the FMA
# attention); it did not repeat. Env DS4_PDL_EARLY=0: off (a compile-time constant of every kernel: one
# value per process).
PDL_EARLY = PDL and os.environ.get("DS4_PDL_EARLY", "1") == "1"
_PDL_EARLY = tl.constexpr(PDL_EARLY)


@triton.jit
def pdl_wait():
    """The wait for the previous kernel of the stream (a no-op when not launched with launch_pdl); with
    PDL_EARLY, then the signal that the next kernel may launch."""
    if _PDL:
        tl.extra.cuda.gdc_wait()
        if _PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
