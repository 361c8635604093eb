"""On CPU machines: the quantized-kernel tests under Triton's interpreter, in a process of their own.

TRITON_INTERPRET must be set before any kernel module is imported, which cannot be guaranteed inside the
main test process (other tests import ds4.kernels for the CPU twins), so the kernel test modules skip
themselves there and run here in a fresh interpreter-mode pytest, one module at a time on a spare core from
the end of collection on (_interp_runner). On a GPU they run directly, compiled, and this test skips.
"""

from __future__ import annotations

import _interp_runner
import pytest
import torch

MODULES = [
    "test_kernels_quant.py",
    "test_kernels_moe.py",
    "test_kernels_moe_grouped.py",
    "test_kernels_fused.py",
    "test_kernels_side.py",
    "test_kernels_attend.py",
    "test_kernels_compress.py",
    "test_kernels_prefill.py",
    "test_kernels_attend_prefill.py",
    "test_kernels_indexer_prefill.py",
    "test_kernels_gemm.py",
    "test_kernels_topk.py",
    "test_kernels_prefetch.py",
    "test_kernels_chain_probe.py",
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU present: the kernel tests run compiled, directly")
@pytest.mark.parametrize("module", MODULES)
def test_kernels_under_interpreter(module: str) -> None:
    code, out = _interp_runner.result(module)  # started in the background at collection (_interp_runner)
    tail = out[-4000:]
    assert code == 0, tail
    assert " passed" in out and " failed" not in out, tail
