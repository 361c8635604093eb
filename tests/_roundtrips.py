"""Test helper: the model's simulated FP8 / FP4 round trips switched off (the identity) for one test."""

from __future__ import annotations

import torch


def round_trips_off(monkeypatch) -> dict[str, int]:
    """Replace the simulated FP8 / FP4 round trips by the identity in the reference and the device code (both
    its torch path and the kernel twins it runs on the CPU); returns call counts, to show each site is live.

    Why: they are steps (FP8 E4M3 keeps 3 mantissa bits, FP4 E2M1 1), so two float32 implementations whose
    inputs to them differ by one ulp (summation order, which depends on the SIMD width of torch's CPU kernels:
    AVX2 here, likely AVX-512 on the device host; tools/gpu/diag_t211.py checks) round some element to the
    neighbouring step (0.25 at |x| ~ 4), and the indexer top-k then picks other rows downstream. Measured
    with them on (same code; torch 2.11 and 2.13 alike): seed 3 gives 3.8e-5 on AVX2 and 9.97e-2 on the H200
    host; seed 4 gives 1.3e-1 on AVX2 and 1.9e-6 with ATEN_CPU_CAPABILITY=default. With them off, 16
    seed/prompt cases agree within 5e-6.
    """
    import ds4.kernels.ref as kernel_ref
    import ds4.model.attention as attention
    import ds4.model.quantsim as quantsim
    from ds4.kernels import attend
    from ds4.model.cuda import fused

    calls = {"fp8": 0, "fp4": 0}

    def identity(kind: str):
        def run(x: torch.Tensor, block: int = 0) -> torch.Tensor:
            calls[kind] += 1
            return x

        return run

    monkeypatch.setattr(quantsim, "fp4_e2m1_roundtrip", identity("fp4"))  # indexer_qat: Hadamard stays
    monkeypatch.setattr(attention, "fp8_e4m3_roundtrip", identity("fp8"))  # reference + device prefill
    monkeypatch.setattr(fused, "fp8_e4m3_roundtrip", identity("fp8"))  # device decode, torch path
    monkeypatch.setattr(kernel_ref, "_fp8_e4m3", identity("fp8"))  # device decode, fused-kernel twin
    # the decode indexer's bf16 operands are exact only on the FP4 grid, which is switched off here
    monkeypatch.setattr(attend, "INDEX_BF16", False)
    return calls
