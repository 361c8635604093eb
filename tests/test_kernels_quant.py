"""Packed weight layouts and the dense quantized kernels (qmatvec, qmatvec_grouped, qmatmul) vs torch twins.

Oracles: gguf.quants.dequantize (bit-exact unpack of the packed form) and the ref twins, which multiply
exactly dequantized weights in float32. Without CUDA the kernels run under Triton's interpreter at tiny
shapes; `cuda`-marked tests run Flash-sized shapes on the GPU.
Tolerances (max abs error / max |reference|): f32 paths 1e-5; bf16 tensor-core paths 1e-2.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_env import CUDA, DEVICE, generator, rel_err

from ds4.kernels import matmul, matvec, ref
from ds4.kernels.packing import PackedWeight, pack, unpack
from ds4.quant import GGMLType, dequantize, random_blocks

QUANT = [GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS]
ALL = [*QUANT, GGMLType.F16, GGMLType.BF16, GGMLType.F32]
F32_TOL, BF16_TOL = 1e-5, 1e-2


def packed(qtype: GGMLType, shape: tuple[int, ...], seed: int) -> PackedWeight:
    raw = random_blocks(qtype, shape, std=0.05, generator=generator(seed))
    return pack(raw, qtype, shape)


# ---------------------------------------------------------------------------------------------------------
# packing


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_pack_unpack_bit_exact(qtype):
    gq = pytest.importorskip("gguf.quants")
    gguf = pytest.importorskip("gguf")
    shape = (3, 5, 512)  # an expert stack: rows of 2 super-blocks
    raw = random_blocks(qtype, shape, std=0.05, generator=torch.Generator().manual_seed(int(qtype)))
    pw = pack(raw, qtype, shape)
    got = unpack(pw)
    assert got.shape == shape and got.dtype == torch.float32
    oracle = gq.dequantize(raw.numpy(), gguf.GGMLQuantizationType(int(qtype))).reshape(shape)
    assert torch.equal(got.view(torch.int32), torch.from_numpy(oracle.astype("float32")).view(torch.int32))
    assert torch.equal(got.view(torch.int32), dequantize(raw, qtype, shape).view(torch.int32))


@pytest.mark.parametrize("qtype", QUANT, ids=lambda t: t.name)
def test_pack_layout_is_split_and_aligned(qtype):
    pw = packed(qtype, (2, 7, 256), seed=1)
    rows = 14
    for key, arr in pw.data.items():
        assert arr.shape[0] == rows and arr.is_contiguous(), key
        assert arr.shape[1] * arr.element_size() % 2 == 0, key
    raw_bytes = (
        14 * {GGMLType.Q8_0: 8 * 34, GGMLType.Q2_K: 84, GGMLType.Q4_K: 144, GGMLType.IQ2_XXS: 66}[qtype]
    )
    extra = 4 * rows if qtype == GGMLType.Q4_K else 0  # unpacked 6-bit scales
    assert pw.nbytes() == raw_bytes + extra
    assert pw.K == 256 and pw.N == 7 and pw.rows == rows


def test_pack_errors():
    raw = random_blocks(GGMLType.Q8_0, (4, 64), std=0.05, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="expected 272 bytes"):
        pack(raw[:, :-1], GGMLType.Q8_0, (4, 64))
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        pack(raw, GGMLType.Q4_K, (4, 100))
    with pytest.raises(ValueError, match="unsupported type I32"):
        pack(raw, GGMLType.I32, (68,))


# ---------------------------------------------------------------------------------------------------------
# qmatvec / qmatvec_grouped (decode)

MV_TYPES = [*QUANT, GGMLType.F16, GGMLType.F32]


@pytest.mark.parametrize("qtype", MV_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_qmatvec(qtype, dtype):
    # N = 20: partial output tiles; K = 512: split-K; B = 1, 3 (CUDA cores) and 7 (tensor cores if bf16)
    w = packed(qtype, (20, 512), seed=int(qtype))
    gen = generator(7)
    for b in (1, 3, 7):
        x = torch.randn(b, 512, generator=gen, device=DEVICE).to(dtype)
        got = matvec.qmatvec(x, w)
        assert got.shape == (b, 20) and got.dtype == torch.float32
        tol = BF16_TOL if (dtype == torch.bfloat16 and b > 4) else F32_TOL
        assert rel_err(got, ref.qmatvec(x, w)) < tol, (b, rel_err(got, ref.qmatvec(x, w)))


def test_qmatvec_three_way_split():
    # K = 768: 3 super-blocks -> 3 single-tile splits; and a matrix wide enough for several row tiles
    w = packed(GGMLType.Q4_K, (70, 768), seed=3)
    x = torch.randn(2, 768, generator=generator(3), device=DEVICE)
    assert rel_err(matvec.qmatvec(x, w), ref.qmatvec(x, w)) < F32_TOL


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.IQ2_XXS], ids=lambda t: t.name)
def test_qmatvec_grouped(qtype):
    w = packed(qtype, (3, 24, 256), seed=5)
    x = torch.randn(2, 3, 256, generator=generator(5), device=DEVICE)
    got = matvec.qmatvec_grouped(x, w)
    dense = unpack(w)  # [G, N, K]
    want = torch.stack([torch.stack([dense[g] @ x[b, g] for g in range(3)]) for b in range(2)])
    assert got.shape == (2, 3, 24)
    assert rel_err(got, want) < F32_TOL
    assert rel_err(got, ref.qmatvec_grouped(x, w)) < F32_TOL
    flat = w.view(72, 256)  # the same rows as one matrix: the grouped op keeps its diagonal blocks
    full = matvec.qmatvec(x.reshape(6, 256), flat).reshape(2, 3, 3, 24)
    assert rel_err(got, torch.diagonal(full, dim1=1, dim2=2).permute(0, 2, 1)) < F32_TOL
    with pytest.raises(ValueError, match="does not regroup"):
        w.view(4, 24, 256)


Q8_TILES = [matvec.Q8Config(), matvec.Q8Config(16, 256, 4, 3, 8), matvec.Q8Config(8, 1024, 4, 1, 1)]


@pytest.mark.parametrize("cfg", Q8_TILES, ids=lambda c: f"bn{c.bn}-tk{c.tk}-s{c.stages}-t{c.target}")
def test_q8_mv1_tiles(cfg):
    # plain: N = 20 (a partial row tile), K = 1024 (split-K unless the target is tiny); grouped: 3 x 32 rows
    w = packed(GGMLType.Q8_0, (20, 1024), seed=31)
    x = torch.randn(1024, generator=generator(31), device=DEVICE)
    assert rel_err(matvec.q8_mv1(x, w, 20, cfg), ref.qmatvec(x[None], w)[0]) < F32_TOL
    wg = packed(GGMLType.Q8_0, (3, 32, 256), seed=32)
    xg = torch.randn(3 * 256, generator=generator(32), device=DEVICE)
    want = ref.qmatvec_grouped(xg.view(1, 3, 256), wg).reshape(-1)
    assert rel_err(matvec.q8_mv1(xg, wg, 32, cfg), want) < F32_TOL
    assert rel_err(matvec.qmatvec_grouped(xg.view(1, 3, 256), wg).reshape(-1), want) < F32_TOL
    with pytest.raises(ValueError, match="must divide the group of 20 rows"):
        matvec.q8_mv1(xg, packed(GGMLType.Q8_0, (3, 20, 256), seed=33), 20, matvec.Q8Config(bn=16))


def test_dispatch_without_triton_uses_twin(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w = packed(GGMLType.Q8_0, (8, 64), seed=2).to("cpu")
    x = torch.randn(2, 64)
    assert torch.equal(matvec.qmatvec(x, w), ref.qmatvec(x, w))
    assert torch.equal(matmul.qmatmul(x, w), ref.qmatmul(x, w))


def test_qmatvec_errors():
    w = packed(GGMLType.Q8_0, (8, 64), seed=2)
    with pytest.raises(ValueError, match=r"x must be \[rows, 64\], got \(2, 32\)"):
        matvec.qmatvec(torch.zeros(2, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="weight must have 2 dims"):
        matvec.qmatvec(torch.zeros(2, 64, device=DEVICE), packed(GGMLType.Q8_0, (2, 8, 64), seed=2))


# ---------------------------------------------------------------------------------------------------------
# qmatmul (prefill, bf16 tensor cores)


@pytest.mark.parametrize("qtype", MV_TYPES, ids=lambda t: t.name)
def test_qmatmul(qtype):
    w = packed(qtype, (72, 256), seed=int(qtype) + 10)
    x = torch.randn(70, 256, generator=generator(11), device=DEVICE)  # 2 row tiles of 64, partial
    got = matmul.qmatmul(x, w)
    assert got.shape == (70, 72) and got.dtype == torch.float32
    assert rel_err(got, ref.qmatmul(x, w)) < BF16_TOL
    assert rel_err(matmul.qmatmul(x.bfloat16(), w), ref.qmatmul(x, w)) < BF16_TOL


# ---------------------------------------------------------------------------------------------------------
# GPU: Flash shapes


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("qtype", "k", "n"),
    [(GGMLType.Q8_0, 4096, 1024), (GGMLType.Q8_0, 1024, 32768), (GGMLType.F16, 4096, 256)],
    ids=["q_a", "q_b", "f16"],
)
def test_qmatvec_flash_shapes_cuda(qtype, k, n):
    assert CUDA
    w = packed(qtype, (n, k), seed=21)
    for b in (1, 3, 8, 32):
        x = torch.randn(b, k, generator=generator(b), device=DEVICE)
        assert rel_err(matvec.qmatvec(x, w), ref.qmatvec(x, w)) < F32_TOL
        xb = x.bfloat16()
        tol = BF16_TOL if b > 4 else F32_TOL
        assert rel_err(matvec.qmatvec(xb, w), ref.qmatvec(xb, w)) < tol


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", QUANT, ids=lambda t: t.name)
def test_qmatmul_prefill_cuda(qtype):
    w = packed(qtype, (1024, 4096), seed=22)
    x = torch.randn(2048 + 17, 4096, generator=generator(22), device=DEVICE).bfloat16()
    assert rel_err(matmul.qmatmul(x, w), ref.qmatmul(x, w)) < BF16_TOL
    wg = packed(GGMLType.Q8_0, (8, 1024, 4096), seed=23)
    xg = torch.randn(4, 8, 4096, generator=generator(23), device=DEVICE)
    assert rel_err(matvec.qmatvec_grouped(xg, wg), ref.qmatvec_grouped(xg, wg)) < F32_TOL
