"""The two checks every kernel module's dispatcher makes (one place for all of ds4.kernels)."""

from __future__ import annotations

import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernels for tensors on CUDA, or anywhere under TRITON_INTERPRET=1 (tests)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def require(cond: bool, msg: str) -> None:
    """Bad input gets one clear ValueError naming what was wrong."""
    if not cond:
        raise ValueError(msg)
