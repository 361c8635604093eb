"""The fused Sinkhorn kernel (ds4/kernels/hc.py) against its torch twin ds4.model.hc.sinkhorn.

Runs under the Triton interpreter (in a subprocess, so TRITON_INTERPRET is set before triton is imported)
in CI, and natively on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CHECK = r"""
import torch
from ds4.kernels.hc import sinkhorn
from ds4.model.hc import sinkhorn as ref
dev = "{dev}"
for B, S, iters, scale in [(1, 4, 20, 1.0), (5, 4, 20, 3.0), (3, 3, 7, 0.5), (2, 1, 1, 1.0), (4, 8, 20, 2.0)]:
    g = torch.Generator().manual_seed(B * 100 + S)
    x = (torch.randn(B, S, S, generator=g) * scale).to(dev)
    got, want = sinkhorn(x, iters, 1e-6), ref(x.cpu().double(), iters, 1e-6)
    err = (got.cpu().double() - want).abs().max().item()
    assert err < 1e-5, (B, S, iters, err)
    assert torch.isfinite(got).all()
print("ok")
"""


def _run(dev: str, interpret: bool) -> None:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", CHECK.format(dev=dev)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_sinkhorn_kernel_interpreted():
    _run("cpu", interpret=True)


@pytest.mark.cuda
def test_sinkhorn_kernel_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    _run("cuda", interpret=False)
