"""Routed-expert kernels (moe_gate_up, moe_down, moe_grouped, group_by_expert) vs torch twins and the model.

Oracles: the ref twins (exactly dequantized weights, f32 math), ds4.model.moe.swiglu (the CPU model's clamped
SwiGLU, model.md §5.5) on ds4.quant.dequantize'd experts, and plain Python loops. Expert ids repeat within and
across rows. Without CUDA the kernels run under Triton's interpreter at tiny shapes; `cuda`-marked tests use
Flash widths. Tolerances (max abs error / max |reference|): f32 paths 1e-5; bf16 grouped GEMM 1e-2.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_env import CUDA, DEVICE, generator, rel_err

from ds4.kernels import matmul, matvec, moe, ref
from ds4.kernels.packing import pack
from ds4.model.moe import swiglu
from ds4.quant import GGMLType, dequantize, random_blocks

QUANT = [GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS]
TYPES = [*QUANT, GGMLType.F16]
F32_TOL, BF16_TOL = 1e-5, 1e-2
E = 5
# Row 0: two experts; row 1: the same expert twice; row 2: experts shared with row 0.
IDS = [[0, 4], [4, 4], [2, 0]]


def stack(qtype, shape, seed):
    """(packed weight, raw bytes) of a random expert stack."""
    raw = random_blocks(qtype, shape, std=0.05, generator=generator(seed))
    return pack(raw, qtype, shape), raw


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_moe_gate_up(qtype):
    F, K = 24, 256  # F: a partial output tile
    (wg, raw_g), (wu, raw_u) = stack(qtype, (E, F, K), 1), stack(qtype, (E, F, K), 2)
    ids = torch.tensor(IDS, dtype=torch.int32, device=DEVICE)
    x = torch.randn(3, K, generator=generator(3), device=DEVICE)
    got = moe.moe_gate_up(x, wg, wu, ids, 1.0)  # |g|, |u| ~ 0.8: the clamps are active
    assert got.shape == (3, 2, F) and got.dtype == torch.float32
    assert rel_err(got, ref.moe_gate_up(x, wg, wu, ids, 1.0)) < F32_TOL
    g_all, u_all = dequantize(raw_g, qtype, (E, F, K)), dequantize(raw_u, qtype, (E, F, K))
    for b, row in enumerate(IDS):
        for j, e in enumerate(row):
            want = swiglu(x[b : b + 1], g_all[e], u_all[e], 1.0)[0]
            assert rel_err(got[b, j], want) < F32_TOL, (b, j)


def test_moe_gate_up_no_clamp_bf16_input():
    wg, _ = stack(GGMLType.Q8_0, (E, 16, 256), 4)
    wu, _ = stack(GGMLType.Q8_0, (E, 16, 256), 5)
    ids = torch.tensor(IDS, dtype=torch.int64, device=DEVICE)
    x = (4 * torch.randn(3, 256, generator=generator(6), device=DEVICE)).bfloat16()  # |g|, |u| well over 1
    got = moe.moe_gate_up(x, wg, wu, ids, 0.0)
    assert rel_err(got, ref.moe_gate_up(x, wg, wu, ids, 0.0)) < F32_TOL  # bf16 x widened exactly
    assert got.abs().max() > 1.5  # unclamped values do exceed the 1.0 clamp of the other test


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_moe_down(qtype):
    D, F = 24, 256
    wd, raw = stack(qtype, (E, D, F), 7)
    ids = torch.tensor(IDS, dtype=torch.int32, device=DEVICE)
    gen = generator(8)
    mid = torch.randn(3, 2, F, generator=gen, device=DEVICE)
    weights = torch.rand(3, 2, generator=gen, device=DEVICE)
    got = moe.moe_down(mid, weights, wd, ids)
    assert got.shape == (3, D) and got.dtype == torch.float32
    assert rel_err(got, ref.moe_down(mid, weights, wd, ids)) < F32_TOL
    dense = dequantize(raw, qtype, (E, D, F))
    want = torch.stack(
        [sum(weights[b, j] * (dense[e] @ mid[b, j]) for j, e in enumerate(r)) for b, r in enumerate(IDS)]
    )
    assert rel_err(got, want) < F32_TOL


# Decode launch shapes: k-splits (3 super-blocks split 1, 2 or 3 ways), partial row tiles, and the general
# dot_rows kernels (the default) next to the dedicated IQ2_XXS / Q2_K ones (fast=True).
DECODE_CONFIGS = [
    moe.MoeConfig(16, 1, 4, True),
    moe.MoeConfig(8, 3, 4, True),
    moe.MoeConfig(32, 2, 4, True),
    moe.MoeConfig(8, 2),
    moe.MoeConfig(32, 3),
]


@pytest.mark.parametrize("qtype", [GGMLType.IQ2_XXS, GGMLType.Q2_K], ids=lambda t: t.name)
@pytest.mark.parametrize(
    "cfg", DECODE_CONFIGS, ids=lambda c: f"bn{c.bn}-s{c.splits}-{'fast' if c.fast else 'gen'}"
)
def test_moe_decode_configs(qtype, cfg):
    F, K = 24, 768
    (wg, _), (wu, _), (wd, _) = (
        stack(qtype, (E, F, K), 21),
        stack(qtype, (E, F, K), 22),
        stack(qtype, (E, F, K), 23),
    )
    ids = torch.tensor(IDS, dtype=torch.int32, device=DEVICE)
    gen = generator(24)
    x = torch.randn(3, K, generator=gen, device=DEVICE)
    got = moe.moe_gate_up(x, wg, wu, ids, 1.0, cfg)
    assert rel_err(got, ref.moe_gate_up(x, wg, wu, ids, 1.0)) < F32_TOL
    mid = torch.randn(3, 2, K, generator=gen, device=DEVICE)
    weights = torch.rand(3, 2, generator=gen, device=DEVICE)
    assert rel_err(moe.moe_down(mid, weights, wd, ids, cfg), ref.moe_down(mid, weights, wd, ids)) < F32_TOL


def test_moe_errors():
    wg, _ = stack(GGMLType.Q8_0, (E, 16, 256), 4)
    wq, _ = stack(GGMLType.Q4_K, (E, 16, 256), 4)
    x = torch.zeros(3, 256, device=DEVICE)
    with pytest.raises(ValueError, match="ids must be"):
        moe.moe_gate_up(x, wg, wg, torch.zeros(2, 2, dtype=torch.int32, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="gate Q8_0"):
        moe.moe_gate_up(x, wg, wq, torch.zeros(3, 2, dtype=torch.int32, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match=r"mid must be \[B, k, 256\]"):
        moe.moe_down(torch.zeros(3, 2, 128, device=DEVICE), torch.ones(3, 2), wg, torch.zeros(3, 2))


# ---------------------------------------------------------------------------------------------------------
# grouped (prefill) path


def test_group_by_expert():
    ids = torch.tensor([[3, 1], [1, 0], [3, 3], [0, 1]], device=DEVICE)
    order, offsets = moe.group_by_expert(ids, 5)
    flat = ids.reshape(-1).tolist()
    assert offsets.tolist() == [0, 2, 5, 5, 8, 8]
    assert [flat[i] for i in order.tolist()] == sorted(flat)
    assert order.tolist() == sorted(range(8), key=lambda i: (flat[i], i))  # stable


def test_tile_table():
    offsets = torch.tensor([0, 5, 5, 21, 22], dtype=torch.int32, device=DEVICE)  # expert 1 empty
    tile_e, tile_r0 = matmul.tile_table(offsets, 22, 8)
    want = [(0, 0), (2, 5), (2, 13), (3, 21)]
    got = [(e, r) for e, r in zip(tile_e.tolist(), tile_r0.tolist(), strict=True) if e >= 0]
    assert got == want
    assert len(tile_e) == 3 + 4 and tile_e.tolist()[len(want) :] == [-1] * 3


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_moe_grouped(qtype):
    N, K, M = 72, 256, 90  # expert 2 gets no rows; expert 3 spans two 64-row tiles
    w, raw = stack(qtype, (4, N, K), 9)
    offsets = torch.tensor([0, 11, 12, 12, 90], dtype=torch.int32, device=DEVICE)
    x = torch.randn(M, K, generator=generator(10), device=DEVICE)
    got = matmul.moe_grouped(x, w, offsets)
    assert got.shape == (M, N) and got.dtype == torch.float32
    dense = dequantize(raw, qtype, (4, N, K))
    bounds = offsets.tolist()
    want = torch.cat([x[bounds[e] : bounds[e + 1]] @ dense[e].T for e in range(4)])
    assert rel_err(got, want) < BF16_TOL
    assert rel_err(got, ref.moe_grouped(x, w, offsets)) < BF16_TOL


# ---------------------------------------------------------------------------------------------------------
# GPU: Flash widths (8 experts so the twins can dequantize whole stacks)


@pytest.mark.cuda
@pytest.mark.parametrize(("qgu", "qd"), [(GGMLType.IQ2_XXS, GGMLType.Q2_K), (GGMLType.Q4_K, GGMLType.Q4_K)])
def test_moe_flash_widths_cuda(qgu, qd):
    assert CUDA
    F, K = 2048, 4096
    wg, _ = stack(qgu, (8, F, K), 11)
    wu, _ = stack(qgu, (8, F, K), 12)
    wd, _ = stack(qd, (8, K, F), 13)
    gen = generator(14)
    for b in (1, 5, 32):
        ids = torch.randint(0, 8, (b, 6), generator=gen, device=DEVICE).int()
        x = torch.randn(b, K, generator=gen, device=DEVICE)
        mid = moe.moe_gate_up(x, wg, wu, ids, 10.0)
        assert rel_err(mid, ref.moe_gate_up(x, wg, wu, ids, 10.0)) < F32_TOL
        weights = torch.rand(b, 6, generator=gen, device=DEVICE)
        assert rel_err(moe.moe_down(mid, weights, wd, ids), ref.moe_down(mid, weights, wd, ids)) < F32_TOL
    ids = torch.randint(0, 8, (1000, 6), generator=gen, device=DEVICE)
    order, offsets = moe.group_by_expert(ids, 8)
    xs = torch.randn(1000, K, generator=gen, device=DEVICE).bfloat16()[order // 6]
    assert rel_err(matmul.moe_grouped(xs, wg, offsets), ref.moe_grouped(xs, wg, offsets)) < BF16_TOL


@pytest.mark.cuda
def test_decode_ops_capture_in_cuda_graph():
    """The decode ops read expert ids from device memory: capture once, change the ids in place, replay."""
    F, K = 512, 1024
    wg, _ = stack(GGMLType.IQ2_XXS, (8, F, K), 15)
    wu, _ = stack(GGMLType.IQ2_XXS, (8, F, K), 16)
    wd, _ = stack(GGMLType.Q2_K, (8, K, F), 17)
    wq, _ = stack(GGMLType.Q8_0, (1, 256, K), 18)
    gen = generator(19)
    x = torch.randn(2, K, generator=gen, device=DEVICE)
    ids = torch.randint(0, 8, (2, 6), generator=gen, device=DEVICE).int()
    weights = torch.rand(2, 6, generator=gen, device=DEVICE)

    def step():
        mid = moe.moe_gate_up(x, wg, wu, ids, 10.0)
        dense = matvec.qmatvec(x, _first(wq))
        return moe.moe_down(mid, weights, wd, ids), dense

    step()  # compile + load the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, dense = step()
    ids.copy_(torch.randint(0, 8, (2, 6), generator=gen, device=DEVICE).int())
    x.copy_(torch.randn(2, K, generator=gen, device=DEVICE))
    graph.replay()
    want = ref.moe_down(ref.moe_gate_up(x, wg, wu, ids, 10.0), weights, wd, ids)
    assert rel_err(out, want) < F32_TOL
    assert rel_err(dense, ref.qmatvec(x, _first(wq))) < F32_TOL


def _first(w):
    """Expert 0 of a 1-expert stack as a 2-D PackedWeight."""
    return w.view(*w.shape[1:])
