"""Shared setup of the quantized-kernel tests: Triton's interpreter on CPU machines, compiled kernels on GPUs.

Import this before anything from ds4.kernels. On a GPU the tests run compiled kernels; on a CPU machine
they run only in a process started with TRITON_INTERPRET=1 (see test_kernels_interpreted.py), where the
same tests run the Triton code on CPU tensors at tiny shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    # @triton.jit reads TRITON_INTERPRET when a kernel module is imported, so the interpreter cannot be
    # switched on reliably inside a process that may already have imported ds4.kernels: on CPU machines
    # these modules run in their own interpreter-mode process, started by test_kernels_interpreted.py.
    pytest.skip(
        "CPU machine: these run under the interpreter via test_kernels_interpreted.py",
        allow_module_level=True,
    )

from ds4.kernels import matmul, matvec, moe  # noqa: E402,F401

DEVICE = torch.device("cuda" if CUDA else "cpu")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (norm-wise; per-element relative errors mean little for dots)."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def generator(seed: int) -> torch.Generator:
    return torch.Generator(DEVICE).manual_seed(seed)
