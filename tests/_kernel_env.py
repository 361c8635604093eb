"""Shared setup of the quantized-kernel tests: Triton's interpreter on CPU machines, compiled kernels on GPUs.

Import this before anything from ds4.kernels. Without CUDA it sets TRITON_INTERPRET=1 (read by @triton.jit
when a kernel module is imported), so the same tests run the Triton code on CPU tensors at tiny shapes.
"""

from __future__ import annotations

import importlib
import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import ds4.kernels  # noqa: E402

ds4.kernels._fix_triton_interpreter()  # idempotent; needed if ds4.kernels was imported before the env var

from ds4.kernels import matmul, matvec, moe  # noqa: E402

if not CUDA and not isinstance(matvec._qmv_kernel, InterpretedFunction):  # imported earlier, compiled: redo
    for _mod in (matvec, moe, matmul):
        importlib.reload(_mod)

DEVICE = torch.device("cuda" if CUDA else "cpu")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (norm-wise; per-element relative errors mean little for dots)."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def generator(seed: int) -> torch.Generator:
    return torch.Generator(DEVICE).manual_seed(seed)
