"""Prefill expert path "dequant": dequant_experts (packed experts -> bf16) and the dense grouped GEMM behind
moe_grouped / moe_grouped_pair, vs independent oracles and the "fused" path.

Oracles: packing.unpack (bit-exact to ds4.quant.dequantize, tested in test_kernels_quant.py) rounded to bf16
for the dequant kernel (bit equality), gguf-free ds4.quant.dequantize + f32 matmuls and the ref twin for the
GEMMs. Without CUDA the kernels run under Triton's interpreter at tiny shapes; `cuda`-marked tests use Flash
widths. Tolerances (max abs error / max |reference|): bf16 GEMMs vs f32 oracles 1e-2 (as test_kernels_moe.py);
vs an f32 oracle on bf16-rounded x and weights, and vs the fused path (compiled only: the interpreter's f32 ->
bf16 cast truncates), 1e-5 (same bf16 operands, only the f32 summation order differs).
"""

from __future__ import annotations

import pytest
import torch
from _kernel_env import CUDA, DEVICE, generator, rel_err

from ds4.kernels import matmul, ref
from ds4.kernels.packing import pack, unpack
from ds4.quant import GGMLType, dequantize, random_blocks

QUANT = [GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS]
ALL = [*QUANT, GGMLType.F16, GGMLType.BF16, GGMLType.F32]
BF16_TOL, SAME_TOL = 1e-2, 1e-5
SMALL = matmul.DenseConfig(bm=32, bn=32, bk=64, warps=4, stages=1)  # interpreter-sized GEMM tile


def stack(qtype, shape, seed):
    """(packed weight, raw bytes) of a random expert stack."""
    raw = random_blocks(qtype, shape, std=0.05, generator=generator(seed))
    return pack(raw, qtype, shape), raw


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.fixture
def dequant_path(monkeypatch):
    """The "dequant" path with an interpreter-sized tile (CUDA: the default tile)."""
    monkeypatch.setattr(matmul, "PREFILL_MOE", "dequant")
    if not CUDA:
        monkeypatch.setattr(matmul, "GROUPED_DENSE", SMALL)
    yield
    matmul.release_scratch()


# ---------------------------------------------------------------------------------------------------------
# dequant_experts


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_dequant_experts_bit_exact(qtype):
    N, K = 20, 512  # 20 rows: a partial 16-row program tile
    w, _ = stack(qtype, (5, N, K), int(qtype) + 1)
    ids = torch.tensor([3, 0, 3, 4], dtype=torch.int32, device=DEVICE)
    got = matmul.dequant_experts(w, ids)
    want = unpack(w)[ids.long()].to(torch.bfloat16)
    assert got.shape == (4, N, K) and got.dtype == torch.bfloat16
    assert torch.equal(bits(got), bits(want))


def test_dequant_experts_short_rows_slice_and_skip():
    # F16 rows of 48: a 16-element k tile; out is a column slice of a larger buffer; expert 1 has no rows
    w, _ = stack(GGMLType.F16, (3, 8, 48), 3)
    buf = torch.full((3, 12, 48), 7.0, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.arange(3, dtype=torch.int32, device=DEVICE)
    offsets = torch.tensor([0, 4, 4, 9], dtype=torch.int32, device=DEVICE)
    matmul.dequant_experts(w, ids, buf[:, 2:10], offsets)
    want = unpack(w).to(torch.bfloat16)
    assert torch.equal(bits(buf[0, 2:10]), bits(want[0])) and torch.equal(bits(buf[2, 2:10]), bits(want[2]))
    assert (buf[1] == 7).all()  # skipped
    assert (buf[:, :2] == 7).all() and (buf[:, 10:] == 7).all()  # outside the slice: untouched


def test_dequant_experts_errors():
    w, _ = stack(GGMLType.IQ2_XXS, (2, 8, 256), 4)
    ids = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="out must be bf16"):
        matmul.dequant_experts(w, ids, torch.empty(2, 8, 256, device=DEVICE))
    with pytest.raises(ValueError, match="weight must have 3 dims"):
        matmul.dequant_experts(w.view(16, 256), ids)


# ---------------------------------------------------------------------------------------------------------
# moe_grouped / moe_grouped_pair on the "dequant" path


def test_group_tiles():
    offsets = torch.tensor([0, 5, 5, 21, 22, 40], dtype=torch.int32, device=DEVICE)  # tiles of 8: 1 0 2 1 3
    assert matmul.group_tiles(offsets, 8, 2).tolist() == [0, 1, 4, 7]
    assert matmul.group_tiles(offsets, 8, 5).tolist() == [0, 7]


def oracle(x: torch.Tensor, dense: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[e] .. offsets[e+1] of x times dense[e]^T in f32 (other rows 0)."""
    bounds = offsets.tolist()
    out = torch.zeros(x.shape[0], dense.shape[1], device=x.device)
    for e in range(dense.shape[0]):
        out[bounds[e] : bounds[e + 1]] = x[bounds[e] : bounds[e + 1]].float() @ dense[e].T
    return out


def bf16_oracle(x: torch.Tensor, w, offsets: torch.Tensor) -> torch.Tensor:
    """The same with x and the weights rounded to bf16 first (what the tensor cores multiply)."""
    return oracle(x.bfloat16().float(), unpack(w).bfloat16().float(), offsets)


@pytest.mark.parametrize("group_bytes", [1 << 30, 2 * 72 * 256 * 2 + 1])  # one group; groups of 2 (2, 2, 1)
@pytest.mark.parametrize("qtype", [GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_moe_grouped_dequant(qtype, group_bytes, dequant_path, monkeypatch):
    monkeypatch.setattr(matmul, "DEQUANT_BYTES", group_bytes)
    E, N, K, M = 5, 72, 256, 90  # expert 2 gets no rows; expert 3 two 32-row tiles; N: a partial column tile
    w, raw = stack(qtype, (E, N, K), 9)
    offsets = torch.tensor([0, 11, 12, 12, 70, 90], dtype=torch.int32, device=DEVICE)
    x = torch.randn(M, K, generator=generator(10), device=DEVICE)
    got = matmul.moe_grouped(x, w, offsets)
    assert got.shape == (M, N) and got.dtype == torch.float32
    assert rel_err(got, oracle(x, dequantize(raw, qtype, (E, N, K)), offsets)) < BF16_TOL
    assert rel_err(got, ref.moe_grouped(x, w, offsets)) < BF16_TOL
    assert rel_err(got, bf16_oracle(x, w, offsets)) < SAME_TOL
    if CUDA:  # (the interpreter's bf16 cast truncates: its fused path rounds the weights differently)
        monkeypatch.setattr(matmul, "PREFILL_MOE", "fused")
        assert rel_err(got, matmul.moe_grouped(x, w, offsets)) < SAME_TOL
    held = matmul._SCRATCH[x.device].numel() * 2
    assert held <= max(group_bytes, N * K * 2), held  # the scratch bound


@pytest.mark.parametrize("bm", [128, 32])
@pytest.mark.parametrize("qtype", [GGMLType.IQ2_XXS, GGMLType.Q2_K], ids=lambda t: t.name)
def test_moe_grouped_fused_path(qtype, bm, monkeypatch):
    """The "fused" kernel stays selectable (PREFILL_MOE) and right: 128-row tiles, or several 32-row ones."""
    monkeypatch.setattr(matmul, "PREFILL_MOE", "fused")
    monkeypatch.setattr(matmul, "GROUPED_BM", bm)
    E, N, K, M = 4, 40, 256, 60
    w, raw = stack(qtype, (E, N, K), 30)
    offsets = torch.tensor([0, 9, 9, 50, 60], dtype=torch.int32, device=DEVICE)
    x = torch.randn(M, K, generator=generator(31), device=DEVICE)
    got = matmul.moe_grouped(x, w, offsets)
    assert rel_err(got, oracle(x, dequantize(raw, qtype, (E, N, K)), offsets)) < BF16_TOL


def test_moe_grouped_rows_outside_offsets_are_zero(dequant_path):
    w, _ = stack(GGMLType.IQ2_XXS, (2, 32, 256), 5)
    offsets = torch.tensor([3, 10, 20], dtype=torch.int32, device=DEVICE)
    x = torch.randn(24, 256, generator=generator(6), device=DEVICE)
    got = matmul.moe_grouped(x, w, offsets)
    assert (got[:3] == 0).all() and (got[20:] == 0).all()
    assert rel_err(got, ref.moe_grouped(x, w, offsets)) < BF16_TOL
    empty = matmul.moe_grouped(x[:0], w, torch.zeros(3, dtype=torch.int32, device=DEVICE))
    assert empty.shape == (0, 32)


@pytest.mark.parametrize("path", ["dequant", "dequant-loop", "fused"])
def test_moe_grouped_pair(path, dequant_path, monkeypatch):
    monkeypatch.setattr(matmul, "PREFILL_MOE", path.split("-")[0])
    if path == "dequant-loop":  # waves 0: one program per column strides over the group's tiles (2, then 1)
        monkeypatch.setattr(matmul, "GROUPED_DENSE", matmul.DenseConfig(32, 32, 64, 4, 1, loop=True, waves=0))
    monkeypatch.setattr(matmul, "DEQUANT_BYTES", 3 * 80 * 256 * 2)  # groups of 3 experts: (3, 1)
    E, K, M = 4, 256, 50
    wg, _ = stack(GGMLType.IQ2_XXS, (E, 48, K), 11)
    wu, _ = stack(GGMLType.Q4_K, (E, 32, K), 12)  # another type and width: two dequant launches per group
    offsets = torch.tensor([0, 20, 21, 21, 50], dtype=torch.int32, device=DEVICE)
    x = torch.randn(M, K, generator=generator(13), device=DEVICE).bfloat16()
    g, u = matmul.moe_grouped_pair(x, wg, wu, offsets)
    assert g.shape == (M, 48) and u.shape == (M, 32)
    assert rel_err(g, ref.moe_grouped(x, wg, offsets)) < BF16_TOL
    assert rel_err(u, ref.moe_grouped(x, wu, offsets)) < BF16_TOL
    if path != "fused" or CUDA:
        assert rel_err(g, bf16_oracle(x, wg, offsets)) < SAME_TOL
        assert rel_err(u, bf16_oracle(x, wu, offsets)) < SAME_TOL


@pytest.mark.parametrize("clamp", [0.0, 0.5])
@pytest.mark.parametrize("path", ["dequant", "fused"])
def test_moe_swiglu_grouped(path, clamp, dequant_path, monkeypatch):
    monkeypatch.setattr(matmul, "PREFILL_MOE", path)
    monkeypatch.setattr(matmul, "DEQUANT_BYTES", 3 * 96 * 256 * 2)  # groups of 3 experts: (3, 1)
    E, F, K, M = 4, 48, 256, 50  # F = 48: a partial 32-column tile of 16 (gate, up) pairs
    wg, _ = stack(GGMLType.IQ2_XXS, (E, F, K), 17)
    wu, _ = stack(GGMLType.IQ2_XXS, (E, F, K), 18)
    offsets = torch.tensor([1, 20, 21, 21, 49], dtype=torch.int32, device=DEVICE)  # rows 0, 49: none
    x = torch.randn(M, K, generator=generator(19), device=DEVICE).bfloat16()
    rw = torch.rand(M, generator=generator(20), device=DEVICE)
    got = matmul.moe_swiglu_grouped(x, wg, wu, offsets, rw, clamp)
    assert got.shape == (M, F) and got.dtype == torch.float32
    g, u = ref.moe_grouped(x, wg, offsets), ref.moe_grouped(x, wu, offsets)
    assert float(g.abs().max()) > 2 * clamp  # the clamp matters
    assert rel_err(got, ref.swiglu_clamped(g, u, clamp) * rw[:, None]) < BF16_TOL
    if path != "fused" or CUDA:
        g, u = bf16_oracle(x, wg, offsets), bf16_oracle(x, wu, offsets)
        assert rel_err(got, ref.swiglu_clamped(g, u, clamp) * rw[:, None]) < SAME_TOL
    assert (got[0] == 0).all() and (got[49] == 0).all()
    got16 = matmul.moe_swiglu_grouped(x, wg, wu, offsets, rw, clamp, out_dtype=torch.bfloat16)
    assert got16.dtype == torch.bfloat16 and torch.equal(got16, got.bfloat16())  # one RNE rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_sum(dtype) -> None:
    """out[t] = sum_j rows[pos[t, j]] in order: bit-equal to the twin's sequential f32 sum, near the f64 sum;
    repeated and unused rows, a partial block of GATHER_SUM_BD."""
    N, D, T, k = 11, matmul.GATHER_SUM_BD + 476, 5, 3
    rows = (torch.randn(N, D, generator=generator(40), device=DEVICE) * 4).to(dtype)
    pos = torch.randint(0, N - 2, (T, k), generator=generator(41), device=DEVICE)
    pos[0] = torch.tensor([3, 3, 0])  # one row twice
    got = matmul.gather_sum(rows, pos)
    assert got.shape == (T, D) and got.dtype == torch.float32
    assert torch.equal(got, ref.gather_sum(rows, pos))
    want = rows.double()[pos].sum(1)
    assert rel_err(got, want) < 1e-6
    with pytest.raises(ValueError, match=r"rows \[N, D\] and pos \[T, k\]"):
        matmul.gather_sum(rows, pos[0])


def test_moe_grouped_pair_errors(dequant_path, monkeypatch):
    wg, _ = stack(GGMLType.IQ2_XXS, (4, 48, 256), 14)
    wd, _ = stack(GGMLType.Q2_K, (4, 256, 256), 15)
    wk, _ = stack(GGMLType.Q2_K, (3, 48, 256), 16)
    x = torch.zeros(8, 256, device=DEVICE)
    offsets = torch.tensor([0, 2, 4, 6, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="share experts"):
        matmul.moe_grouped_pair(x, wg, wk, offsets)
    with pytest.raises(ValueError, match="offsets must be"):
        matmul.moe_grouped_pair(x, wg, wd, offsets[:4])
    with pytest.raises(ValueError, match="x must be"):
        matmul.moe_grouped(x[:, :128], wg, offsets)
    with pytest.raises(ValueError, match="equal widths"):
        matmul.moe_swiglu_grouped(x, wg, wd, offsets, torch.ones(8, device=DEVICE), 0.0)
    monkeypatch.setattr(matmul, "PREFILL_MOE", "dequantize")
    with pytest.raises(ValueError, match="must be dequant or fused"):
        matmul.moe_grouped(x, wg, offsets)


# ---------------------------------------------------------------------------------------------------------
# the model's prefill experts (ds4.model.cuda.experts.routed_prefill) on the "dequant" path


@pytest.mark.parametrize("path", ["dequant", "fused"])
def test_routed_prefill(path, dequant_path, monkeypatch):
    """Oracle: per token, sum_j w_j down_j(swiglu(x)) with ds4.model.moe.swiglu (the CPU model's clamped
    SwiGLU) on dequantized f32 experts; the mid activation is rounded to bf16 as on the GPU path."""
    from ds4.model.cuda.experts import routed_prefill
    from ds4.model.moe import swiglu

    monkeypatch.setattr(matmul, "PREFILL_MOE", path)
    monkeypatch.setattr(matmul, "DEQUANT_BYTES", 2 * 512 * 256 * 2)  # groups of 2 experts
    E, F, D, T, k, clamp = 5, 256, 256, 7, 2, 0.4
    wg, rg = stack(GGMLType.IQ2_XXS, (E, F, D), 26)
    wu, ru = stack(GGMLType.IQ2_XXS, (E, F, D), 27)
    wd, rd = stack(GGMLType.Q2_K, (E, D, F), 28)
    gen = generator(29)
    x = torch.randn(T, D, generator=gen, device=DEVICE)
    ids = torch.stack([torch.randperm(E - 1, generator=gen, device=DEVICE)[:k] for _ in range(T)])  # 4: none
    weights = torch.rand(T, k, generator=gen, device=DEVICE)
    got = routed_prefill(x, ids, weights, wg, wu, wd, clamp, torch.bfloat16)
    dg, du, dd = (dequantize(r, t, s) for r, t, s in ((rg, wg.qtype, wg.shape), (ru, wu.qtype, wu.shape),
                                                     (rd, wd.qtype, wd.shape)))  # fmt: skip
    want = torch.zeros(T, D, device=DEVICE)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            mid = swiglu(x[t : t + 1], dg[e], du[e], clamp) * weights[t, j]
            want[t] += (mid.bfloat16().float() @ dd[e].T)[0]
    assert rel_err(got, want) < BF16_TOL


# ---------------------------------------------------------------------------------------------------------
# GPU: Flash widths (16 experts so the twins can dequantize whole stacks)


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("qtype", "shape"), [(GGMLType.IQ2_XXS, (16, 2048, 4096)), (GGMLType.Q2_K, (16, 4096, 2048))]
)
def test_prefill_flash_widths_cuda(qtype, shape, dequant_path, monkeypatch):
    assert CUDA
    w, _ = stack(qtype, shape, 21)
    ids = torch.tensor([15, 0, 7], dtype=torch.int32, device=DEVICE)
    want = unpack(w)[ids.long()].to(torch.bfloat16)
    assert torch.equal(bits(matmul.dequant_experts(w, ids)), bits(want))
    gen = generator(22)
    ids6 = torch.randint(0, 15, (1000, 6), generator=gen, device=DEVICE)  # expert 15 unused
    flat = ids6.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.zeros(17, dtype=torch.int32, device=DEVICE)
    offsets[1:] = torch.bincount(flat, minlength=16).cumsum(0)
    xs = torch.randn(1000, shape[2], generator=gen, device=DEVICE).bfloat16()[order // 6]
    monkeypatch.setattr(matmul, "DEQUANT_BYTES", 5 * shape[1] * shape[2] * 2)  # groups of 5 experts
    got = matmul.moe_grouped(xs, w, offsets)
    assert rel_err(got, ref.moe_grouped(xs, w, offsets)) < BF16_TOL
    assert rel_err(got, bf16_oracle(xs, w, offsets)) < SAME_TOL
    monkeypatch.setattr(matmul, "PREFILL_MOE", "fused")
    assert rel_err(got, matmul.moe_grouped(xs, w, offsets)) < SAME_TOL


@pytest.mark.cuda
def test_swiglu_flash_widths_cuda(dequant_path, monkeypatch):
    E, F, K = 16, 2048, 4096
    wg, _ = stack(GGMLType.IQ2_XXS, (E, F, K), 23)
    wu, _ = stack(GGMLType.IQ2_XXS, (E, F, K), 24)
    gen = generator(25)
    flat = torch.randint(0, E, (3000,), generator=gen, device=DEVICE)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device=DEVICE)
    offsets[1:] = torch.bincount(flat, minlength=E).cumsum(0)
    x = torch.randn(3000, K, generator=gen, device=DEVICE).bfloat16()
    rw = torch.rand(3000, generator=gen, device=DEVICE)
    monkeypatch.setattr(matmul, "DEQUANT_BYTES", 3 * 2 * F * K * 2)  # groups of 3 experts
    got = matmul.moe_swiglu_grouped(x, wg, wu, offsets, rw, 10.0)
    g, u = bf16_oracle(x, wg, offsets), bf16_oracle(x, wu, offsets)
    assert rel_err(got, ref.swiglu_clamped(g, u, 10.0) * rw[:, None]) < SAME_TOL
    monkeypatch.setattr(matmul, "PREFILL_MOE", "fused")
    assert rel_err(got, matmul.moe_swiglu_grouped(x, wg, wu, offsets, rw, 10.0)) < SAME_TOL
