"""ds4.kernels.prefetch: the L2 bulk prefetch of static weights. It changes no value, so these tests check
what can be seen: the bytes it requests (budget, 16-byte granules, the order of the tensors), that
nothing it is given changes, that views it cannot request are skipped, and (GPU) that a matvec after it
gives the same bits."""

from __future__ import annotations

import _kernel_env  # noqa: F401  (interpreter / GPU setup; skips this module in the plain CPU run)
import pytest
import torch
from _kernel_env import CUDA, DEVICE, generator

from ds4.kernels import prefetch


def _tensors():
    g = generator(5)
    a = torch.randint(-127, 128, (300, 64), generator=g, device=DEVICE, dtype=torch.int8)  # 19,200 bytes
    b = torch.randn(1000, generator=g, device=DEVICE).half()  # 2,000 bytes
    return a, b


def test_prefetch_requests_the_budget_in_order_and_changes_nothing() -> None:
    a, b = _tensors()
    keep = (a.clone(), b.clone())
    assert prefetch.prefetch_l2([a, b], 1 << 30) == 19200 + 2000
    assert prefetch.prefetch_l2([a, b], 20000) == 19200 + 800  # the budget ends inside b
    assert prefetch.prefetch_l2([a, b], 1000) == 992  # whole 16-byte granules only, a first
    assert prefetch.prefetch_l2([a, b], 0) == 0
    assert torch.equal(a, keep[0]) and torch.equal(b, keep[1])


def test_prefetch_skips_what_it_cannot_request() -> None:
    a, b = _tensors()
    assert prefetch.prefetch_l2([a[:, ::2]], 1 << 20) == 0  # strided
    assert prefetch.prefetch_l2([a.view(-1)[3:]], 1 << 20) == 0  # start not 16-byte aligned
    assert prefetch.prefetch_l2([a[:, ::2], b], 1 << 20) == 2000  # the next tensor still goes


@pytest.mark.skipif(not CUDA, reason="needs CUDA: GPU-only test, run on the device machine")
def test_matvec_after_prefetch_same_bits() -> None:
    from ds4.kernels.matvec import qmatvec
    from ds4.kernels.packing import pack
    from ds4.quant import GGMLType, random_blocks

    shape = (512, 1024)
    w = pack(random_blocks(GGMLType.Q8_0, shape, std=0.05, generator=generator(9)), GGMLType.Q8_0, shape)
    x = torch.randn(1, 1024, generator=generator(10), device=DEVICE)
    want = qmatvec(x, w)
    assert prefetch.prefetch_l2(list(w.data.values()), 1 << 30) > 512 * 1024
    assert torch.equal(qmatvec(x, w), want)
