"""Routed-expert kernels (moe_gate_up, moe_down, moe_grouped, group_by_expert) vs torch twins and the model.

Oracles: the ref twins (exactly dequantized weights, f32 math), ds4.model.moe.swiglu (the CPU model's clamped
SwiGLU, model.md §5.5) on ds4.quant.dequantize'd experts, and plain Python loops. Expert ids repeat within and
across rows. Without CUDA the kernels run under Triton's interpreter at tiny shapes; `cuda`-marked tests use
Flash widths. Tolerances (max abs error / max |reference|): f32 paths 1e-5; bf16 grouped GEMM 1e-2.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from _kernel_env import CUDA, DEVICE, generator, rel_err

from ds4.kernels import matmul, matvec, moe, ref
from ds4.kernels.moe import _dot4, _iq2_sign_bits, _iq2_sign_masks, _negate_bytes
from ds4.kernels.packing import pack, to_quad
from ds4.model.moe import swiglu
from ds4.quant import GGMLType, dequantize, random_blocks
from ds4.quant.tables import IQ2XXS_GRID

QUANT = [GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS]
TYPES = [*QUANT, GGMLType.F16]
F32_TOL, BF16_TOL = 1e-5, 1e-2
E = 5
# Row 0: two experts; row 1: the same expert twice; row 2: experts shared with row 0.
IDS = [[0, 4], [4, 4], [2, 0]]


@pytest.fixture(autouse=True)
def f32_kernels_by_default(monkeypatch):
    """The f32 kernels as the module defaults: the tests below that rely on the defaults check them against
    the f32 reference at F32_TOL; the integer kernels (the engine's default since session 3) are tested
    with explicit configs (MoeConfig(int8=True, ...)) against their exact integer twin."""
    monkeypatch.setattr(moe, "GATE_UP", moe.MoeConfig(bn=8, splits=1))
    monkeypatch.setattr(moe, "DOWN", moe.MoeConfig(bn=32, splits=1))


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


@pytest.mark.parametrize("bm", [128, 32])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_moe_grouped(qtype, bm, monkeypatch):
    monkeypatch.setattr(matmul, "GROUPED_BM", bm)
    N, K, M = 72, 256, 90  # expert 2 gets no rows; expert 3: one 128-row tile, or three 32-row ones
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
@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
def test_decode_ops_capture_in_cuda_graph(int8, monkeypatch):
    """The decode ops read expert ids from device memory: capture once, change the ids in place, replay.
    int8: the integer kernels (their Q8_K quantization of x / mid captured too), against their twins."""
    if int8:
        monkeypatch.setattr(moe, "GATE_UP", moe.MoeConfig(bn=16, splits=1, int8=True))
        monkeypatch.setattr(moe, "DOWN", moe.MoeConfig(bn=64, splits=1, int8=True))
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
    if int8:
        want = ref.moe_down_q8k(ref.moe_gate_up_q8k(x, wg, wu, ids, 10.0), weights, wd, ids)
    else:
        want = ref.moe_down(ref.moe_gate_up(x, wg, wu, ids, 10.0), weights, wd, ids)
    assert rel_err(out, want) < F32_TOL
    assert rel_err(dense, ref.qmatvec(x, _first(wq))) < F32_TOL


def _first(w):
    """Expert 0 of a 1-expert stack as a 2-D PackedWeight."""
    return w.view(*w.shape[1:])


# ---------------------------------------------------------------------------------------------------------
# Integer path (MoeConfig.int8, terms 1 = Q8_K or 2 = Q8_K + residual plane): the twin against an
# independent numpy integer implementation (exact integer block sums) and against dequantize-then-f64 dots (a
# hard bound on the activation rounding error); the packed-word arithmetic exhaustively; the kernels
# (plain-int32 variant in the interpreter, dp4a on the GPU) vs the twin and vs the f32 reference.
#
# Tolerances. x_i is rounded to v_i d with |x_i - v_i d| <= d / 2 (terms 1: d = amax / 127 of x_i's
# 256-block; terms 2: d = amax / 32258, bound d / 2 plus <= 0.01 d of f32 rounding in the residual), so
# |y_int - y_exact| <= sum_i |w_i| d_blk(i) (1/2 + slack), plus f32 rounding (1e-6 of sum |w_i x_i|, 1e-6 of
# the separate scale and min terms for Q2_K). In norm terms that is ~ amax / (127 sqrt(12) std) ~ 0.7 % for
# Gaussian x with one term, 254x less with two; int8 kernels vs the f32 reference, max |diff| / max |ref|
# (SwiGLU included): < 3e-2 (terms 1), < 3e-4 (terms 2, measured ~1e-4 gate/up and ~5e-5 down at the
# interpreter shapes); int8 kernels vs the twin (same integers, f32 scaling in another order): F32_TOL.

INT8_TOL = {1: 3e-2, 2: 3e-4}
_KSIGNS_NP = np.array([i | ((bin(i).count("1") & 1) << 7) for i in range(128)], dtype=np.int64)  # model.md §3
_GRID_NP = np.array(IQ2XXS_GRID, dtype=np.uint64).view(np.uint8).reshape(256, 8).astype(np.int64)


def _np_quant(x: np.ndarray, terms: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy quantization of one row x [K] f32: (planes q int64 [T, K], d f32 [nb]); np.rint is half to even.
    Terms 2: the residual of plane 1 in units of amax / (127 * 254), from x scaled by 32258 / amax."""
    xb = x.astype(np.float32).reshape(-1, 256)
    amax = np.abs(xb).max(1)
    big = amax >= np.float32(1e-30)
    safe = np.where(big, amax, np.float32(1))
    full = np.float32(127 * 254 ** (terms - 1))
    d = np.where(big, amax / full, np.float32(0)).astype(np.float32)
    iscale = np.where(big, np.float32(127) / safe, np.float32(0)).astype(np.float32)
    q1 = np.clip(np.rint(xb * iscale[:, None]), -127, 127).astype(np.float32)
    planes = [q1]
    if terms == 2:
        iscale2 = np.where(big, full / safe, np.float32(0)).astype(np.float32)
        t = (xb * iscale2[:, None]).astype(np.float32) - np.float32(254) * q1
        planes.append(np.clip(np.rint(t), -127, 127))
    return np.stack(planes).astype(np.int64).reshape(terms, -1), d


def _np_values(q: np.ndarray) -> np.ndarray:
    """Planes [T, K] -> activation integers [K]: q1 (T 1) or 254 q1 + q2 (T 2)."""
    return q[0] if len(q) == 1 else 254 * q[0] + q[1]


def _np_f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float64)


def _np_int_dot(raw: np.ndarray, qtype, q: np.ndarray, dx: np.ndarray):
    """Raw ggml rows [N, row bytes] . integer row q [K] (scales dx [nb]) -> (block ints {name: [N, nb]},
    y [N] f64, |terms| [N] f64)."""
    N = raw.shape[0]
    if qtype == GGMLType.IQ2_XXS:
        blk = raw.reshape(N, -1, 66)
        nb = blk.shape[1]
        d = _np_f16(blk[..., 0:2])  # [N, nb]
        sub = blk[..., 2:].reshape(N, nb, 8, 8)
        a1 = np.ascontiguousarray(sub[..., 4:8]).view("<u4")[..., 0].astype(np.int64)  # [N, nb, 8]
        sidx = (a1[..., None] >> (7 * np.arange(4))) & 127  # [N, nb, 8, 4]
        neg = (_KSIGNS_NP[sidx][..., None] >> np.arange(8)) & 1
        v = _GRID_NP[sub[..., 0:4].astype(np.int64)] * (1 - 2 * neg)  # [N, nb, 8, 4, 8]
        isum = (v.reshape(N, nb, 8, 32) * q.reshape(nb, 8, 32)).sum(-1)
        S = ((2 * (a1 >> 28) + 1) * isum).sum(-1)  # [N, nb]
        y = (d * dx * S).sum(-1) * 0.125
        absum = (np.abs(v.reshape(N, nb, 8, 32)) * np.abs(q.reshape(nb, 8, 32))).sum(-1)
        terms = (d * dx * ((2 * (a1 >> 28) + 1) * absum).sum(-1)).sum(-1) * 0.125
        return {"S": S}, y, terms
    blk = raw.reshape(N, -1, 84)
    nb = blk.shape[1]
    sc, qs = blk[..., 0:16].astype(np.int64), blk[..., 16:80].astype(np.int64)
    d, dmin = _np_f16(blk[..., 80:82]), _np_f16(blk[..., 82:84])
    groups = []  # model.md §3 output order: half, shift, then bytes 0-15 / 16-31 of the half
    for h in range(2):
        for s in (0, 2, 4, 6):
            for part in range(2):
                groups.append((qs[..., 32 * h + 16 * part : 32 * h + 16 * part + 16] >> s) & 3)
    v = np.stack(groups, axis=2)  # [N, nb, 16, 16]
    qg = q.reshape(nb, 16, 16)
    isum, xs = (v * qg).sum(-1), qg.sum(-1)  # [N, nb, 16], [nb, 16]
    i_sum, m_sum = ((sc & 15) * isum).sum(-1), ((sc >> 4) * xs).sum(-1)
    y = (d * dx * i_sum - dmin * dx * m_sum).sum(-1)
    terms = (d * dx * np.abs(i_sum) + np.abs(dmin) * dx * ((sc >> 4) * np.abs(qg).sum(-1)).sum(-1)).sum(-1)
    return {"I": i_sum, "M": m_sum}, y, terms


def _test_row(K: int, seed: int) -> torch.Tensor:
    """[2, K] f32: Gaussian rows with an all-zero block, a huge outlier and exact .5 ties after scaling."""
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(seed))
    x[0, 256:512] = 0.0
    x[1, 0] = 50.0  # amax 50: the block's scale
    x[1, 1:5] = torch.tensor([50 * 0.5 / 127, 50 * 1.5 / 127, -50 * 2.5 / 127, 50 * 63.5 / 127])  # near ties
    return x


@pytest.mark.parametrize("terms", [1, 2])
def test_quantize_q8k_matches_numpy_and_kernel(terms):
    x = _test_row(1024, 30)
    q, d = ref.quantize_q8k(x, terms)
    assert q.shape == (terms, 2, 1024) and q.dtype == torch.int8 and d.shape == (2, 4)
    for r in range(2):
        qn, dn = _np_quant(x[r].numpy(), terms)
        assert np.array_equal(q[:, r].numpy(), qn) and np.array_equal(d[r].numpy(), dn)
    assert d[0, 1] == 0 and not q[:, 0, 256:512].any()
    assert int(q[0, 1, 0]) == 127 and q.abs().max() <= 127
    # reconstruction: |x - d v| <= d / 2, plus f32 rounding (terms 2: up to ~1 % of d in the residual)
    approx = ref.q8k_values(q).double().reshape(2, 4, 256) * d.double()[..., None]
    err = x.double().reshape(2, 4, 256) - approx
    assert torch.all(err.abs().amax(-1) <= d.double() * (0.5 + 1e-4 + 0.01 * (terms - 1)) + 1e-12)
    if terms == 2:
        assert q[1].abs().max() >= 120  # the residual plane uses its range
        assert int(q[0, 1, 0]) == 127 and int(q[1, 1, 0]) == 0  # amax itself is exact in plane 1
    qk, dk = moe.quantize_q8k(x.to(DEVICE), terms)  # Triton (interpreter / GPU): bit-identical
    assert torch.equal(qk.cpu(), q) and torch.equal(dk.cpu(), d)
    qb, db = moe.quantize_q8k(x.to(DEVICE).bfloat16(), terms)
    qr, dr = ref.quantize_q8k(x.bfloat16(), terms)
    assert torch.equal(qb.cpu(), qr) and torch.equal(db.cpu(), dr)


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("qtype", [GGMLType.IQ2_XXS, GGMLType.Q2_K], ids=lambda t: t.name)
def test_q8k_twin_vs_numpy_and_dequant(qtype, terms):
    N, K = 12, 1024
    raw = random_blocks(qtype, (N, K), std=0.05, generator=torch.Generator().manual_seed(31))
    w = pack(raw, qtype, (N, K))
    x = _test_row(K, 32)
    got = ref.qmatvec_q8k(x, w, terms)  # [2, N]
    dense = dequantize(raw, qtype, (N, K)).double()  # exact f32 values
    wi = ref.q8k_weight_ints(w)
    q, dx = ref.quantize_q8k(x, terms)
    for r in range(2):
        qn, dn = _np_quant(x[r].numpy(), terms)
        ints, y_np, abs_terms = _np_int_dot(raw.numpy(), qtype, _np_values(qn), dn.astype(np.float64))
        twin = ref.q8k_block_ints(wi, q[:, r])
        for name, val in ints.items():
            assert np.array_equal(twin[name].numpy(), val), name  # exact integers
        tol = 1e-6 * abs_terms + 1e-30
        assert np.all(np.abs(got[r].double().numpy() - y_np) <= tol)  # f32 scaling of the same ints
        # against the exact dot of the dequantized weights: the rounding bound (section comment)
        exact = dense @ x[r].double()
        half = 0.5 * (1 + 1e-4) if terms == 1 else 0.51
        bound = (dense.abs().reshape(N, -1, 256).sum(-1) * torch.from_numpy(dn).double()).sum(-1) * half
        diff = (got[r].double() - exact).abs()
        assert torch.all(diff <= bound + torch.from_numpy(tol)), (diff, bound)
        assert diff.max() > 0  # the test can see quantization


def _negate_bytes_torch(w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The word arithmetic of moe._negate_bytes on int64 holding uint32 words."""
    return ((w ^ m) + (m & 0x01010101)) & 0xFFFFFFFF


def _byte_mask(bits4: torch.Tensor) -> torch.Tensor:
    """4 sign bits -> uint32 (in int64) with 0xFF in byte j where bit j is set."""
    return sum(((bits4 >> j) & 1) * (0xFF << (8 * j)) for j in range(4))


def _all_signed_words() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (grid row, sign index): grid words lo, hi [256*128] (uint32 in int64) and their byte masks."""
    words = torch.tensor(IQ2XXS_GRID, dtype=torch.int64)
    lo, hi = words & 0xFFFFFFFF, words >> 32  # grid bytes are < 128: the u64 is a non-negative int64
    signs = torch.from_numpy(_KSIGNS_NP)
    lo, hi = lo.repeat_interleave(128), hi.repeat_interleave(128)
    s = signs.repeat(256)
    return lo, hi, _byte_mask(s & 15), _byte_mask(s >> 4)


def _want_signed_bytes() -> torch.Tensor:
    """[256*128, 8] int8: grid row bytes with KSIGNS applied, straight from the tables."""
    neg = (torch.from_numpy(_KSIGNS_NP)[:, None] >> torch.arange(8)) & 1  # [128, 8]
    vals = torch.from_numpy(_GRID_NP)[:, None, :] * (1 - 2 * neg)[None]  # [256, 128, 8]
    return vals.reshape(-1, 8).to(torch.int8)


def test_sign_bytes_word_arithmetic_exhaustive():
    lo, hi, m_lo, m_hi = _all_signed_words()
    got = torch.stack([_negate_bytes_torch(lo, m_lo), _negate_bytes_torch(hi, m_hi)], 1)  # [n, 2] uint32
    got = torch.where(got >= 2**31, got - 2**32, got).to(torch.int32)
    assert torch.equal(got.view(torch.int8).reshape(-1, 8), _want_signed_bytes())
    # the kernels' mask table: the same masks, one int64 (lo | hi << 32) per sign index
    table = _iq2_sign_masks(torch.device("cpu"))
    assert torch.equal(table, m_lo[:128] | (m_hi[:128] << 32))  # int64 shift wraps to the same bits


def test_q2k_byte_extract_exhaustive():
    """(word >> 2t) & 0x03030303 on int32 (arithmetic shift) = the 2-bit fields of each byte, for every byte
    value in every byte position (sign bit of the top byte included)."""
    v = torch.arange(256, dtype=torch.int64)
    filler = 0xA5
    for pos in range(4):
        word = torch.full_like(v, filler * 0x01010101) & ~(0xFF << (8 * pos)) | (v << (8 * pos))
        w32 = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
        for t in range(4):
            got = ((w32 >> (2 * t)) & 0x03030303).view(torch.int8).reshape(256, 4)
            want = (w32.view(torch.uint8).reshape(256, 4).long() >> (2 * t)) & 3
            assert torch.equal(got.long(), want)


@triton.jit
def _word_ops_kernel(
    w_ptr, m_ptr, a_ptr, b_ptr, signed_ptr, dot_ptr, BLOCK: tl.constexpr, DP4A: tl.constexpr
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(signed_ptr + i, _negate_bytes(tl.load(w_ptr + i), tl.load(m_ptr + i)))
    tl.store(dot_ptr + i, _dot4(tl.load(a_ptr + i), tl.load(b_ptr + i), 7, DP4A))


@pytest.mark.parametrize("dp4a", [False, pytest.param(True, marks=pytest.mark.cuda)], ids=["int32", "dp4a"])
def test_word_helpers_in_triton(dp4a):
    """moe._negate_bytes on every (grid row, sign pattern) and moe._dot4 on random and extreme words."""
    assert CUDA or not dp4a
    lo, hi, m_lo, m_hi = _all_signed_words()
    n = lo.numel() * 2  # 65536
    w = torch.stack([lo, hi], 1).reshape(-1)
    w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    s = torch.stack([m_lo, m_hi], 1).reshape(-1)
    s = torch.where(s >= 2**31, s - 2**32, s).to(torch.int32)
    gen = torch.Generator().manual_seed(33)
    a = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    b = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    extremes = torch.tensor([0x7F7F7F7F, -0x7F7F7F80, -1, 0, 0x01010101, -0x7EFEFEFF], dtype=torch.int32)
    a[: len(extremes) ** 2] = extremes.repeat_interleave(len(extremes))
    b[: len(extremes) ** 2] = extremes.repeat(len(extremes))
    signed = torch.empty(n, dtype=torch.int32, device=DEVICE)
    dot = torch.empty(n, dtype=torch.int32, device=DEVICE)
    block = 4096
    _word_ops_kernel[(n // block,)](
        w.to(DEVICE), s.to(DEVICE), a.to(DEVICE), b.to(DEVICE), signed, dot, BLOCK=block, DP4A=dp4a
    )
    assert torch.equal(signed.cpu().view(torch.int8).reshape(-1, 8), _want_signed_bytes())
    want = 7 + (a.view(torch.int8).reshape(n, 4).long() * b.view(torch.int8).reshape(n, 4).long()).sum(1)
    assert torch.equal(dot.cpu().long(), want)


# Two row tiles, one k-split / a partial row tile, two k-splits (the interpreter always runs the int32 form);
# two activation planes (the default; one plane: test_moe_int8_two_terms_vs_one_term).
INT8_CONFIGS = [moe.MoeConfig(8, 1, 4, int8=True), moe.MoeConfig(32, 2, 4, int8=True, dp4a=False)]


def _int8_case(F: int, K: int, seed: int):
    """(gate, up, down stacks, ids, x [3, K], mid [3, 2, K], router weights [3, 2]) for the int8 tests."""
    (wg, _), (wu, _), (wd, _) = (
        stack(GGMLType.IQ2_XXS, (E, F, K), seed),
        stack(GGMLType.IQ2_XXS, (E, F, K), seed + 1),
        stack(GGMLType.Q2_K, (E, F, K), seed + 2),
    )
    gen = generator(seed + 3)
    x = torch.randn(3, K, generator=gen, device=DEVICE)
    mid = torch.randn(3, 2, K, generator=gen, device=DEVICE)
    weights = torch.rand(3, 2, generator=gen, device=DEVICE)
    return wg, wu, wd, torch.tensor(IDS, dtype=torch.int32, device=DEVICE), x, mid, weights


@pytest.mark.parametrize(
    "cfg", INT8_CONFIGS, ids=lambda c: f"bn{c.bn}-s{c.splits}-{'dp4a' if c.dp4a else 'i32'}-t{c.terms}"
)
def test_moe_int8_kernels(cfg):
    wg, wu, wd, ids, x, mid, weights = _int8_case(16, 512, 34)  # tiny: the interpreter runs these on CPU
    got = moe.moe_gate_up(x, wg, wu, ids, 1.0, cfg)
    assert got.shape == (3, 2, 16) and got.dtype == torch.float32
    assert rel_err(got, ref.moe_gate_up_q8k(x, wg, wu, ids, 1.0, cfg.terms)) < F32_TOL
    assert 1e-6 < rel_err(got, ref.moe_gate_up(x, wg, wu, ids, 1.0)) < INT8_TOL[cfg.terms]
    got = moe.moe_down(mid, weights, wd, ids, cfg)
    assert got.shape == (3, 16) and got.dtype == torch.float32
    assert rel_err(got, ref.moe_down_q8k(mid, weights, wd, ids, cfg.terms)) < F32_TOL
    assert 1e-6 < rel_err(got, ref.moe_down(mid, weights, wd, ids)) < INT8_TOL[cfg.terms]


@pytest.mark.parametrize("terms", [1, 2])
def test_moe_gate_up_given_planes(terms):
    """xq (the HC finish's Q8_K planes of x): the kernel reads them instead of quantizing x, so planes from
    quantize_q8k change no bit and other planes change the result; wrong shapes are refused."""
    wg, wu, _, ids, x, _, _ = _int8_case(16, 512, 71)
    cfg = moe.MoeConfig(16, 1, 4, int8=True, terms=terms)
    want = moe.moe_gate_up(x, wg, wu, ids, 1.0, cfg)
    q, d = moe.quantize_q8k(x, terms)
    assert torch.equal(moe.moe_gate_up(x, wg, wu, ids, 1.0, cfg, xq=(q, d)), want)
    assert rel_err(moe.moe_gate_up(x, wg, wu, ids, 1.0, cfg, xq=(q, d * 2)), want) > 1e-3
    with pytest.raises(ValueError, match="Q8_K planes must be"):
        moe.moe_gate_up(x, wg, wu, ids, 1.0, cfg, xq=(q[:, :2], d))


@triton.jit
def _sign_bits_kernel(s_ptr, lo_ptr, hi_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    bl, bh = _iq2_sign_bits(tl.load(s_ptr + i))
    tl.store(lo_ptr + i, bl)
    tl.store(hi_ptr + i, bh)


def test_iq2_sign_bits_exhaustive():
    """moe._iq2_sign_bits (the computed sign masks of MoeConfig.sign_math) on all 128 sign indices = the
    KSIGNS table of model.md §3 (numpy popcount parity), as 0/1 bytes: x 255 they are the gathered masks."""
    s = torch.arange(128, dtype=torch.int32, device=DEVICE)
    lo, hi = torch.empty_like(s), torch.empty_like(s)
    _sign_bits_kernel[(1,)](s, lo, hi, BLOCK=128)
    bits = (torch.from_numpy(_KSIGNS_NP)[:, None] >> torch.arange(8)) & 1  # [128, 8]
    got = torch.cat([lo.cpu().view(torch.int8).reshape(128, 4), hi.cpu().view(torch.int8).reshape(128, 4)], 1)
    assert torch.equal(got.long(), bits)
    table = _iq2_sign_masks(torch.device("cpu")).view(torch.uint8).reshape(128, 8)
    assert torch.equal(table.long(), bits * 255)


# Session-4 B <= 4 variants: table lookups by tl.gather (grid; sign masks computed in the first, gathered in
# the second), prefetch of the next super-block (2 blocks here: two steps, or one per k-split in the
# second), the down's k-slot and split sum in the kernel (second), each against the exact integer twin.
VARIANT_CONFIGS = [
    moe.MoeConfig(16, 1, 4, int8=True, sign_math=True, prefetch=True, gather=True),
    moe.MoeConfig(16, 2, 4, int8=True, prefetch=True, terms=1, gather=True, fixup=True),
    moe.MoeConfig(16, 1, 4, int8=True, prmt=True, stages=3),  # session 19: the loop pipelined by Triton
    moe.MoeConfig(16, 1, 4, int8=True, prmt=True, gsum=True),  # session 20: group sums added before scaling
    moe.MoeConfig(16, 2, 4, int8=True, prefetch=True, sign_math=True, terms=1, gsum=True),
]


@pytest.mark.parametrize(
    "cfg",
    VARIANT_CONFIGS,
    ids=lambda c: (
        f"s{c.splits}-pf{int(c.prefetch)}-{'math' if c.sign_math else 'masks'}-t{c.terms}"
        + f"-st{c.stages}" * bool(c.stages)
        + "-gsum" * c.gsum
    ),
)
def test_moe_int8_variants(cfg):
    wg, wu, wd, ids, x, mid, weights = _int8_case(16, 512, 54)
    got = moe.moe_gate_up(x, wg, wu, ids, 1.0, cfg)
    assert rel_err(got, ref.moe_gate_up_q8k(x, wg, wu, ids, 1.0, cfg.terms)) < F32_TOL
    want = ref.moe_down_q8k(mid, weights, wd, ids, cfg.terms)
    for _ in range(2):  # fixup: the counters re-armed by the first call
        assert rel_err(moe.moe_down(mid, weights, wd, ids, cfg), want) < F32_TOL


@triton.jit
def _grid_words_kernel(tab_ptr, lo_ptr, hi_ptr):
    i = tl.arange(0, 256)
    lo, hi = moe._grid_words(tab_ptr, i)
    tl.store(lo_ptr + i, lo)
    tl.store(hi_ptr + i, hi)


def test_grid16_codes_expand_to_every_grid_row():
    """moe._grid_words on the 16-bit code table (MoeConfig.grid16) = the 8-byte grid rows, all 256."""
    from ds4.kernels.packing import iq2xxs_codes16, iq2xxs_grid_i64

    dev = torch.device(DEVICE)
    out = {}
    for name, tab in (("rows", iq2xxs_grid_i64(dev)), ("codes", iq2xxs_codes16(dev))):
        lo, hi = (torch.empty(256, dtype=torch.int32, device=DEVICE) for _ in range(2))
        _grid_words_kernel[(1,)](tab, lo, hi)
        out[name] = torch.stack([lo, hi], 1).cpu()
    assert torch.equal(out["codes"], out["rows"])
    assert torch.equal(out["rows"].view(torch.int64).reshape(-1), iq2xxs_grid_i64(torch.device("cpu")))


@triton.jit
def _spread_kernel(tab_ptr, out_ptr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, moe._spread_codes(tl.load(tab_ptr + i).to(tl.int32)))


def test_spread_codes_give_the_nibble_table():
    """moe._spread_codes on the 16-bit code table (MoeConfig.prmt with grid16) = iq2xxs_nibbles, all 256
    rows (the codes' sign-extended int16 rows included)."""
    from ds4.kernels.packing import iq2xxs_codes16, iq2xxs_nibbles

    dev = torch.device(DEVICE)
    out = torch.empty(256, dtype=torch.int32, device=DEVICE)
    _spread_kernel[(1,)](iq2xxs_codes16(dev), out)
    assert bool((iq2xxs_codes16(dev) < 0).any())  # the sign extension is exercised
    assert torch.equal(out.cpu(), iq2xxs_nibbles(torch.device("cpu"))[:256])


_DECODE_VARIANTS = {
    "grid16": {"grid16": True},
    "prmt": {"prmt": True},
    "prmt16": {"prmt": True, "grid16": True},
    "prmt_lds": {"prmt": True, "lds": True},
}


@pytest.mark.parametrize("sign_math", [False, True], ids=["masks", "math"])
@pytest.mark.parametrize("variant", list(_DECODE_VARIANTS))
def test_moe_decode_variants_change_no_bit(sign_math, variant):
    """The gate/up pair kernel with the 16-bit code table (grid16), the nibble tables and byte permutes
    (prmt), the nibble tables from the kernel's static shared copy (prmt_lds), or the permutes from the
    16-bit codes (prmt16) decodes the same signed grid words: equal to the 8-byte-row table bit for bit."""
    wg, wu, _, ids, x, _, _ = _int8_case(16, 512, 64)
    cfg = moe.MoeConfig(16, 1, 4, int8=True, sign_math=sign_math)
    want = moe.moe_gate_up(x, wg, wu, ids, 1.0, cfg)
    got = moe.moe_gate_up(x, wg, wu, ids, 1.0, replace(cfg, **_DECODE_VARIANTS[variant]))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="gather excludes"):
        moe.MoeConfig(int8=True, gather=True, **_DECODE_VARIANTS[variant])


@pytest.mark.parametrize("sign_math", [False, True], ids=["masks", "math"])
def test_quad_layout_pair_kernels(sign_math):
    """The batch-1 gate/up kernels on stacks in the quad layout (packing.to_quad, moe_grouped.QUAD_STACKS):
    the int8 kernel reads it by (group, sub-block) (moe._iq2_q8k_qp) and sums its lanes in the split
    layout's order, so under the interpreter it gives the split layout's bits (on the GPU the compiler may
    order the lanes' sums otherwise: within 1e-6); the f32 path (dot_rows) alike, and the dedicated f32
    kernel (MoeConfig.fast) hands quad stacks to dot_rows (at F32_TOL). Mixed layouts and the kernel forms
    without a quad reader are refused."""
    wg, wu, _, ids, x, _, _ = _int8_case(16, 512, 64)
    qg, qu = to_quad(wg), to_quad(wu)
    cfg = moe.MoeConfig(16, 1, 4, int8=True, sign_math=sign_math, prmt=True)
    for c in (cfg, moe.MoeConfig(bn=8, splits=1)):
        want = moe.moe_gate_up(x, wg, wu, ids, 1.0, c)
        got = moe.moe_gate_up(x, qg, qu, ids, 1.0, c)
        assert rel_err(got, want) < 1e-6 if CUDA else torch.equal(got, want)
    fast = moe.MoeConfig(bn=8, splits=1, fast=True)
    want = ref.moe_gate_up(x, wg, wu, ids, 1.0)
    assert rel_err(moe.moe_gate_up(x, qg, qu, ids, 1.0, fast), want) < F32_TOL
    with pytest.raises(ValueError, match="share a layout"):
        moe.moe_gate_up(x, qg, wu, ids, 1.0, cfg)
    with pytest.raises(ValueError, match="no prefetch, gather or gsum form"):
        moe.moe_gate_up(x, qg, qu, ids, 1.0, replace(cfg, prefetch=True))


@pytest.mark.cuda
@pytest.mark.parametrize("variant", list(_DECODE_VARIANTS))
def test_moe_decode_variants_capture(variant):
    """The variants' tables are built once per device, before a graph capture (a host-to-device copy inside
    one fails): a captured gate/up call with the variant replays to its eager result."""
    assert CUDA
    wg, wu, _, ids, x, _, _ = _int8_case(16, 512, 66)
    cfg = moe.MoeConfig(16, 1, 4, int8=True, **_DECODE_VARIANTS[variant])
    want = moe.moe_gate_up(x, wg, wu, ids, 1.0, cfg)  # eager: builds the tables
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = moe.moe_gate_up(x, wg, wu, ids, 1.0, cfg)
    graph.replay()
    assert torch.equal(got, want)


def _prmt_ref(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 default mode: byte j = byte (sel >> 4j) & 7 of b:a (bytes 0-3 from a)."""
    src = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    return sum(((src >> (8 * ((sel >> (4 * j)) & 7))) & 0xFF) << (8 * j) for j in range(4))


@triton.jit
def _prmt_kernel(a_ptr, b_ptr, s_ptr, out_ptr, BLOCK: tl.constexpr, PTX: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, moe._prmt(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(s_ptr + i), PTX))


@triton.jit
def _prmt_words_kernel(
    nib,
    snib,
    idx_ptr,
    si_ptr,
    lo_ptr,
    hi_ptr,
    BLOCK: tl.constexpr,
    MATH: tl.constexpr,
    PTX: tl.constexpr,
    POS_REG: tl.constexpr,
    LDS: tl.constexpr,
):
    if LDS:
        moe._lds_fill(nib, snib, PTX)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo, hi = moe._prmt_words(nib, snib, tl.load(idx_ptr + i), tl.load(si_ptr + i), MATH, PTX, POS_REG, LDS)
    tl.store(lo_ptr + i, lo)
    tl.store(hi_ptr + i, hi)


@pytest.mark.parametrize("ptx", [False, pytest.param(True, marks=pytest.mark.cuda)], ids=["int32", "ptx"])
def test_prmt_and_signed_words_exhaustive(ptx):
    """moe._prmt against the PTX definition on random words, and moe._prmt_words (MoeConfig.prmt) on every
    (grid row, sign pattern) = the grid bytes with KSIGNS applied, straight from the tables: sign nibbles
    gathered and computed (MoeConfig.sign_math), the positive word a constant and loaded (POS_REG), the
    tables read from the kernel's static shared copy (LDS, MoeConfig.lds; ld.shared under PTX)."""
    from ds4.kernels.packing import iq2_sign_nibbles, iq2xxs_nibbles

    assert CUDA or not ptx
    gen = torch.Generator().manual_seed(71)
    a, b, sel = (torch.randint(-(2**31), 2**31, (256,), generator=gen, dtype=torch.int64) for _ in range(3))
    sel &= 0x77777777  # selector nibbles 0-7: bit 3 (PTX's sign replication) is outside moe._prmt's domain
    out = torch.empty(256, dtype=torch.int32, device=DEVICE)
    args = [t.to(torch.int32).to(DEVICE) for t in (a, b, sel)]
    _prmt_kernel[(1,)](*args, out, BLOCK=256, PTX=ptx)
    want = [_prmt_ref(int(x), int(y), int(z)) for x, y, z in zip(a, b, sel, strict=True)]
    assert [v & 0xFFFFFFFF for v in out.cpu().tolist()] == want
    dev = torch.device(DEVICE)
    idx = torch.arange(256, dtype=torch.int32).repeat_interleave(128).to(DEVICE)  # row g, sign s at g*128 + s
    si = torch.arange(128, dtype=torch.int32).repeat(256).to(DEVICE)
    lo, hi = (torch.empty(256 * 128, dtype=torch.int32, device=DEVICE) for _ in range(2))
    nib, snib = iq2xxs_nibbles(dev), iq2_sign_nibbles(dev)
    for math, preg, lds in ((False, False, False), (True, False, False), (False, True, False), (0, 0, 1)):
        _prmt_words_kernel[(32,)](
            nib, snib, idx, si, lo, hi, BLOCK=1024, MATH=math, PTX=ptx, POS_REG=preg, LDS=bool(lds)
        )  # fmt: skip
        got = torch.stack([lo, hi], 1).cpu().view(torch.int8).reshape(-1, 8)
        assert torch.equal(got, _want_signed_bytes()), (math, preg, lds)
        lo.zero_(), hi.zero_()


def test_moe_int8_two_terms_vs_one_term():
    """The residual plane is what makes the int8 kernels accurate: against the f32 reference (exactly
    dequantized weights), two terms pass INT8_TOL[2] and one term misses it by > 10x, on the same inputs
    (interpreter, measured: gate/up 3.1e-2 vs 7.6e-5, down 5.3e-3 vs 2.9e-5). Both at their twins' values."""
    wg, wu, wd, ids, x, mid, weights = _int8_case(16, 512, 44)
    want_gu, want_d = ref.moe_gate_up(x, wg, wu, ids, 1.0), ref.moe_down(mid, weights, wd, ids)
    err = {}
    for terms in (1, 2):
        cfg = moe.MoeConfig(8, 1, 4, int8=True, terms=terms)
        gu, dn = moe.moe_gate_up(x, wg, wu, ids, 1.0, cfg), moe.moe_down(mid, weights, wd, ids, cfg)
        assert rel_err(gu, ref.moe_gate_up_q8k(x, wg, wu, ids, 1.0, terms)) < F32_TOL
        assert rel_err(dn, ref.moe_down_q8k(mid, weights, wd, ids, terms)) < F32_TOL
        err[terms] = (rel_err(gu, want_gu), rel_err(dn, want_d))
    print(f"int8 vs f32 reference (gate/up, down): one term {err[1]}, two terms {err[2]}")
    for op in range(2):  # gate/up, down
        assert err[2][op] < INT8_TOL[2], err
        assert err[1][op] > 10 * INT8_TOL[2] and err[1][op] > 10 * err[2][op], err


def test_moe_config_terms():
    with pytest.raises(ValueError, match="terms must be 1 or 2, got 3"):
        moe.MoeConfig(terms=3)
    with pytest.raises(ValueError, match="terms must be 1 or 2, got 0"):
        moe.quantize_q8k(torch.zeros(1, 256, device=DEVICE), 0)
    assert moe.MoeConfig().terms == 2


@pytest.mark.cuda
def test_moe_int8_flash_widths_cuda():
    """Flash widths on the GPU, one and two activation planes: dp4a and plain-int32 variants agree, both at
    the twin's values; CUDA graph capture of the (two-term) int8 path (x / mid quantization included) with
    expert ids changed in place."""
    assert CUDA
    F, K = 2048, 4096
    wg, _ = stack(GGMLType.IQ2_XXS, (8, F, K), 40)
    wu, _ = stack(GGMLType.IQ2_XXS, (8, F, K), 41)
    wd, _ = stack(GGMLType.Q2_K, (8, K, F), 42)
    gen = generator(43)
    for b in (1, 5, 32):
        ids = torch.randint(0, 8, (b, 6), generator=gen, device=DEVICE).int()
        x = torch.randn(b, K, generator=gen, device=DEVICE)
        weights = torch.rand(b, 6, generator=gen, device=DEVICE)
        for terms in (1, 2):
            outs = []
            for dp4a in (True, False):
                cfg_gu = moe.MoeConfig(8, 1, 4, int8=True, dp4a=dp4a, terms=terms)
                cfg_d = moe.MoeConfig(32, 1, 4, int8=True, dp4a=dp4a, terms=terms)
                mid = moe.moe_gate_up(x, wg, wu, ids, 10.0, cfg_gu)
                outs.append((mid, moe.moe_down(mid, weights, wd, ids, cfg_d)))
            # same integers, same f32 code: equal up to the compiler's FMA choices
            assert rel_err(outs[0][0], outs[1][0]) < 1e-6 and rel_err(outs[0][1], outs[1][1]) < 1e-6
            mid, y = outs[0]
            assert rel_err(mid, ref.moe_gate_up_q8k(x, wg, wu, ids, 10.0, terms)) < F32_TOL
            assert rel_err(mid, ref.moe_gate_up(x, wg, wu, ids, 10.0)) < INT8_TOL[terms]
            assert rel_err(y, ref.moe_down_q8k(mid, weights, wd, ids, terms)) < F32_TOL
            assert rel_err(y, ref.moe_down(mid, weights, wd, ids)) < INT8_TOL[terms]
    cfg_gu, cfg_d = moe.MoeConfig(8, 1, 4, int8=True), moe.MoeConfig(32, 1, 4, int8=True)

    def step():
        return moe.moe_down(moe.moe_gate_up(x, wg, wu, ids, 10.0, cfg_gu), weights, wd, ids, cfg_d)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    ids.copy_(torch.randint(0, 8, ids.shape, generator=gen, device=DEVICE).int())
    x.copy_(torch.randn(x.shape, generator=gen, device=DEVICE))
    graph.replay()
    want = ref.moe_down_q8k(ref.moe_gate_up_q8k(x, wg, wu, ids, 10.0), weights, wd, ids)
    assert rel_err(out, want) < F32_TOL


@pytest.mark.cuda
def test_moe_int8_variants_flash_widths_cuda():
    """The session-4 variants (prefetch, sign_math, gather, k-splits, small tiles) at Flash widths on the GPU,
    B = 1 and 4, each at its integer twin (gate/up with the clamp active, down with router weights)."""
    assert CUDA
    F, K = 2048, 4096
    wg, _ = stack(GGMLType.IQ2_XXS, (8, F, K), 60)
    wu, _ = stack(GGMLType.IQ2_XXS, (8, F, K), 61)
    wd, _ = stack(GGMLType.Q2_K, (8, K, F), 62)
    gen = generator(63)
    configs = [
        moe.MoeConfig(16, 1, 4, int8=True, prefetch=True),
        moe.MoeConfig(16, 1, 4, int8=True, sign_math=True),
        moe.MoeConfig(16, 1, 4, int8=True, gather=True),
        moe.MoeConfig(16, 1, 4, int8=True, gather=True, sign_math=True, prefetch=True),
        moe.MoeConfig(8, 1, 4, int8=True, prefetch=True, sign_math=True),
        moe.MoeConfig(32, 2, 8, int8=True, prefetch=True, gather=True),
        moe.MoeConfig(64, 2, 4, int8=True, prefetch=True, terms=1),
        moe.MoeConfig(64, 1, 4, int8=True, fixup=True),
        moe.MoeConfig(32, 2, 4, int8=True, fixup=True, prefetch=True, terms=1),
        moe.MoeConfig(16, 1, 4, int8=True, prmt=True, stages=3),  # the loops pipelined by Triton
        moe.MoeConfig(64, 1, 4, int8=True, prmt=True, stages=4),
        moe.MoeConfig(16, 1, 4, int8=True, prmt=True, gsum=True),  # group sums before the scaling
        moe.MoeConfig(16, 1, 4, int8=True, prmt=True, prefetch=True, gsum=True, terms=1),
    ]
    for b in (1, 4):
        ids = torch.randint(0, 8, (b, 6), generator=gen, device=DEVICE).int()
        x = torch.randn(b, K, generator=gen, device=DEVICE)
        mid = torch.randn(b, 6, F, generator=gen, device=DEVICE)
        weights = torch.rand(b, 6, generator=gen, device=DEVICE)
        for terms in (1, 2):
            want_gu = ref.moe_gate_up_q8k(x, wg, wu, ids, 10.0, terms)
            want_d = ref.moe_down_q8k(mid, weights, wd, ids, terms)
            for cfg in (c for c in configs if c.terms == terms):
                got = moe.moe_gate_up(x, wg, wu, ids, 10.0, cfg)
                assert rel_err(got, want_gu) < F32_TOL, (b, cfg)
                assert rel_err(moe.moe_down(mid, weights, wd, ids, cfg), want_d) < F32_TOL, (b, cfg)
