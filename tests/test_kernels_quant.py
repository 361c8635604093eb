"""Packed weight layouts and the dense quantized kernels (qmatvec, qmatvec_grouped, qmatmul) vs torch twins.

Oracles: gguf.quants.dequantize (bit-exact unpack of the packed form) and the ref twins, which multiply
exactly dequantized weights in float32. Without CUDA the kernels run under Triton's interpreter at tiny
shapes; `cuda`-marked tests run Flash-sized shapes on the GPU.
Tolerances (max abs error / max |reference|): f32 paths 1e-5; bf16 tensor-core paths 1e-2.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from _kernel_env import CUDA, DEVICE, generator, rel_err

from ds4.kernels import intq, matmul, matvec, ref
from ds4.kernels.packing import SCALE_COPY_ROW_DIM, PackedWeight, pack, quad_unpack, to_quad, unpack
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


def test_quad_layout_holds_the_same_bytes():
    """packing.to_quad (the routed gate / up stacks' layout with moe_grouped.QUAD_STACKS): qp replaces qs +
    sg with no byte more, really reordered, quad_unpack gives qs and sg back, unpack reads it bit for bit;
    only IQ2_XXS has it."""
    w = packed(GGMLType.IQ2_XXS, (3, 8, 512), seed=21)
    q = to_quad(w)
    assert q.quad and not w.quad and set(q.data) == {"qp", "d"} and q.nbytes() == w.nbytes()
    per_block = torch.cat([w.data["qs"].view(24, 2, 32), w.data["sg"].view(torch.uint8).view(24, 2, 32)], 2)
    assert not torch.equal(q.data["qp"].view(torch.uint8).view(24, 2, 64), per_block)
    qs, sg = quad_unpack(q.data["qp"])
    assert torch.equal(qs, w.data["qs"]) and torch.equal(sg, w.data["sg"])
    assert torch.equal(unpack(q).view(torch.int32), unpack(w).view(torch.int32))
    assert to_quad(q) is q
    with pytest.raises(ValueError, match="quad layout is IQ2_XXS's"):
        to_quad(packed(GGMLType.Q2_K, (2, 8, 256), seed=22))


def test_quad_layout_kernels_change_no_bit():
    """The any-format kernels on a quad stack (QT 116: matvec.iq2_group_words): dot_rows' matvec and the
    prefill's expert dequantization give the split layout's bits."""
    w = packed(GGMLType.IQ2_XXS, (3, 16, 512), seed=23)
    q = to_quad(w)
    ids = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    want = matmul.dequant_experts(w, ids)
    assert torch.equal(matmul.dequant_experts(q, ids), want)
    assert torch.equal(want.float(), unpack(w)[ids.long()].bfloat16().float())
    flat, qflat = w.view(48, 512), q.view(48, 512)
    x = torch.randn(3, 512, generator=generator(23), device=DEVICE)
    assert torch.equal(matvec.qmatvec(x, qflat), matvec.qmatvec(x, flat))


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


Q8_TILES = [
    matvec.Q8Config(),
    matvec.Q8Config(16, 256, 4, 3, 8),
    matvec.Q8Config(8, 1024, 4, 1, 1),
    matvec.Q8Config(xdirect=True),
    matvec.Q8Config(magic=True),
    matvec.Q8Config(16, 256, 4, 3, 8, magic=True),
    matvec.Q8Config(xdirect=True, prefetch=True),  # first k-tile loaded before pdl_wait(), loop peeled
    matvec.Q8Config(16, 256, 4, 3, 8, prefetch=True),  # several k-tiles per split after the peeled one
    matvec.Q8Config(16, 256, 4, 1, 10**6, magic=True, prefetch=True),  # one k-tile per split: all peeled
    matvec.Q8Config(int8=True),
    matvec.Q8Config(int8=True, prefetch=True),
    matvec.Q8Config(16, 256, 4, 3, 8, int8=True, prefetch=True),
    matvec.Q8Config(16, 256, 4, 1, 10**6, int8=True, prefetch=True),
    matvec.Q8Config(xdirect=True, flat=1056),  # long-lived programs from FLAT_MIN_TILES row tiles
    matvec.Q8Config(xdirect=True, flat=100),  # several tiles per program
    matvec.Q8Config(16, 256, 4, 4, 8, tma=True),  # TMA copies into a 4-buffer ring, split-K
    matvec.Q8Config(16, 256, 4, 3, 8, prefetch=True, tma=True),  # the first k-tile copied before the wait
    matvec.Q8Config(8, 256, 4, 4, 10**6, prefetch=True, tma=True),  # one k-tile per split: all peeled
    matvec.Q8Config(32, 1024, 4, 2, 1, tma=True),  # no split; tk taken as 256 (a TMA box row)
    matvec.Q8_HEAD_TILE,  # the head's (Q8_HEAD when on)
]
# Q8Config.int8 against its twin ref.qmatvec_q8_0_int (the same integers, f32 rounding apart): F32_TOL;
# against the exact f32 product: x's rounding error is <= amax / 64516 per value of each 32-block
# (quantize_q8k terms 2), ~2e-5 of the output scale for Gaussian x: INT8_TOL
INT8_TOL = 1e-4


def _q8_id(c: matvec.Q8Config) -> str:
    return (
        f"bn{c.bn}-tk{c.tk}-s{c.stages}-t{c.target}"
        + "-xdirect" * c.xdirect
        + "-magic" * c.magic
        + "-pre" * c.prefetch
        + "-int8" * c.int8
        + f"-flat{c.flat}" * bool(c.flat)
        + "-tma" * c.tma
    )


def _assert_q8_mv1(got, x, w, rows, cfg, exact):
    """q8_mv1's output against the exact f32 product (and, for int8, against its integer twin)."""
    if cfg.int8:
        assert rel_err(got, ref.qmatvec_q8_0_int(x, w, rows)) < F32_TOL
        assert rel_err(got, exact) < INT8_TOL
    else:
        assert rel_err(got, exact) < F32_TOL


@triton.jit
def _i8x4_f32_kernel(w_ptr, out_ptr):
    """out [64 words x 4] = matvec._i8x4_f32 of the 64 int32 words at w_ptr, as a [8, 1, 8] tile."""
    r = tl.arange(0, 8)[:, None, None]
    c = tl.arange(0, 8)[None, None, :]
    f = matvec._i8x4_f32(tl.load(w_ptr + r * 8 + c))  # [8, 1, 8, 4]
    tl.store(out_ptr + (r * 8 + c)[:, :, :, None] * 4 + tl.arange(0, 4)[None, None, None, :], f)


def test_magic_int8_conversion_is_exact_for_every_byte():
    """Q8Config.magic's int8 -> f32 conversion against torch's, for all 256 values in every byte lane."""
    b = torch.arange(-128, 128, dtype=torch.int8, device=DEVICE)
    b = torch.stack([b, b.roll(1), b.roll(77), b.flip(0)], dim=1).reshape(-1)  # each value in each lane
    for words in b.view(torch.int32).split(64):  # 4 tiles of 64 words
        out = torch.empty(256, dtype=torch.float32, device=DEVICE)
        _i8x4_f32_kernel[(1,)](words.contiguous(), out)
        assert torch.equal(out, words.view(torch.int8).float())


@pytest.mark.parametrize("cfg", Q8_TILES, ids=_q8_id)
def test_q8_mv1_tiles(cfg):
    # plain: N = 20 (a partial row tile), K = 1024 (split-K unless the target is tiny); grouped: 3 x 32 rows
    w = packed(GGMLType.Q8_0, (20, 1024), seed=31)
    x = torch.randn(1024, generator=generator(31), device=DEVICE)
    _assert_q8_mv1(matvec.q8_mv1(x, w, 20, cfg), x, w, 20, cfg, ref.qmatvec(x[None], w)[0])
    wg = packed(GGMLType.Q8_0, (3, 32, 256), seed=32)
    xg = torch.randn(3 * 256, generator=generator(32), device=DEVICE)
    want = ref.qmatvec_grouped(xg.view(1, 3, 256), wg).reshape(-1)
    _assert_q8_mv1(matvec.q8_mv1(xg, wg, 32, cfg), xg, wg, 32, cfg, want)
    assert rel_err(matvec.qmatvec_grouped(xg.view(1, 3, 256), wg).reshape(-1), want) < F32_TOL
    with pytest.raises(ValueError, match="must divide the group of 20 rows"):
        matvec.q8_mv1(xg, packed(GGMLType.Q8_0, (3, 20, 256), seed=33), 20, matvec.Q8Config(bn=16))


@pytest.mark.parametrize(
    ("n", "k", "groups", "programs"), [(64, 1024, 1, 3), (32, 256, 3, 5), (40, 512, 1, 64)]
)
def test_q8_mv1_flat_programs(monkeypatch, n, k, groups, programs):
    """Q8Config.flat (_q8_flat_kernel, taken here from one row tile): programs owning several whole tiles
    (uneven counts, some programs past the end), groups of rows each reading their own x slice; within the
    f32 bound of the exact product."""
    monkeypatch.setattr(matvec, "FLAT_MIN_TILES", 1)
    cfg = matvec.Q8Config(xdirect=True, flat=programs)
    w = packed(GGMLType.Q8_0, (groups, n, k) if groups > 1 else (n, k), seed=36 + n)
    x = torch.randn(groups * k, generator=generator(36 + n), device=DEVICE)
    want = (
        ref.qmatvec_grouped(x.view(1, groups, k), w).reshape(-1) if groups > 1 else ref.qmatvec(x[None], w)[0]
    )
    assert rel_err(matvec.q8_mv1(x, w, n, cfg), want) < F32_TOL


def test_qmatvec_takes_q8_head_tile_for_the_widest_matrices(monkeypatch):
    """qmatvec at B = 1 runs Q8_0 matrices of >= Q8_HEAD_ROWS rows at Q8_HEAD (when set) and the others at
    Q8_MV1; both within the f32 bound of the exact product."""
    head = matvec.Q8_HEAD_TILE
    monkeypatch.setattr(matvec, "Q8_HEAD", head)
    monkeypatch.setattr(matvec, "Q8_HEAD_ROWS", 64)
    seen = []
    real = matvec.q8_mv1
    monkeypatch.setattr(matvec, "q8_mv1", lambda x, w, g, cfg=None: seen.append(cfg) or real(x, w, g, cfg))
    for n in (64, 32):
        w = packed(GGMLType.Q8_0, (n, 512), seed=40 + n)
        x = torch.randn(1, 512, generator=generator(40 + n), device=DEVICE)
        assert rel_err(matvec.qmatvec(x, w), ref.qmatvec(x, w)) < F32_TOL
    assert seen == [head, None]


def test_q8_0_int_twin_within_its_rounding_bound():
    """ref.qmatvec_q8_0_int (the integer Q8_0 path's twin) vs the exact product, row by row: the error is at
    most sum |w| times each block's x rounding bound (d_x / 2, +1 % of d_x for the residual's f32 rounding),
    and the bound is tight enough to fail a dropped plane (error ~ amax / 254 per value)."""
    w = packed(GGMLType.Q8_0, (2, 16, 256), seed=41)
    x = torch.randn(512, generator=generator(41), device=DEVICE) * torch.linspace(0.1, 10, 512, device=DEVICE)
    got, exact = ref.qmatvec_q8_0_int(x, w, 16), ref.qmatvec_grouped(x.view(1, 2, 256), w).reshape(-1)
    _, dx = ref.quantize_q8k(x.view(2, 256), 2, 32)  # [2, 8]
    wabs = unpack(w).abs().double().reshape(32, 8, 32).sum(-1)  # [32 rows, 8 blocks]
    bound = (wabs * dx.double().repeat_interleave(16, 0) * 0.51).sum(-1)  # [32]
    err = (got.double() - exact.double()).abs()
    assert torch.all(err <= bound + 1e-6 * exact.abs().max())
    assert err.max() > 0  # x really was rounded
    one = ref.quantize_q8k(x.view(2, 256), 1, 32)[0]
    assert not torch.equal(one[0], ref.quantize_q8k(x.view(2, 256), 2, 32)[0][1])  # planes differ


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_quantize_q8k_block32_kernel_equals_ref(dtype):
    """intq.quantize_q8k at block 32 (the integer Q8_0 path's x) bit-equal to ref.quantize_q8k, a zero
    block included; reconstruction within d / 2 (+1 % of d) of x."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(42)) * 3
    x[1, 32:64] = 0.0
    x = x.to(dtype)
    q, d = intq.quantize_q8k(x.to(DEVICE), 2, 32)
    qr, dr = ref.quantize_q8k(x, 2, 32)
    assert q.shape == (2, 3, 256) and d.shape == (3, 8)
    assert torch.equal(q.cpu(), qr) and torch.equal(d.cpu(), dr)
    assert d[1, 1] == 0 and not q[:, 1, 32:64].any()
    approx = ref.q8k_values(qr).double().reshape(3, 8, 32) * dr.double()[..., None]
    err = (x.double().reshape(3, 8, 32) - approx).abs().amax(-1)
    assert torch.all(err <= dr.double() * 0.51 + 1e-12)
    with pytest.raises(ValueError, match="multiple of 32"):
        intq.quantize_q8k(torch.zeros(1, 48, device=DEVICE), 2, 32)


# ---------------------------------------------------------------------------------------------------------
# q8_rows: Q8_0 x B rows on the tensor cores, f32-accurate (batched decode above 8 rows). The bound is the f32
# one: the bf16-rounded tiles it replaces are ~2e-3 off (BF16_TOL), so a lost x low part or a block scale
# applied to the wrong block fails it.
# q8_rows's block-product modes (matvec.Q8_ROWS_MODES): "bf16x3" within the f32 bound as "tf32x2"; "bf16x2"
# (x as bf16 hi + lo, ~2^-17 per product) measured 1e-5 under the interpreter: bound 4e-5, still 50x under
# the bf16 tiles' error.
BF16X2_TOL = 4e-5


def rows_tol(mode: str) -> float:
    return {"bf16x2": BF16X2_TOL, "int8": INT8_TOL}.get(mode, F32_TOL)


def _rows_int_twin(x: torch.Tensor, w, rows_per_group: int) -> torch.Tensor:
    """ref.qmatvec_q8_0_int row by row: the math of q8_rows's int8 mode."""
    return torch.stack([ref.qmatvec_q8_0_int(row, w, rows_per_group) for row in x])


@pytest.mark.parametrize(("b", "n", "k", "groups"), [(9, 64, 256, 1), (33, 128, 1024, 1), (12, 64, 256, 3)])
def test_q8_rows_int8_equals_its_twin(b, n, k, groups):
    """q8_rows mode "int8" (x in two int8 planes per 32, int8 MMAs) vs ref.qmatvec_q8_0_int: the same
    integer block dots, so only f32 summation order apart (1e-6); vs the exact product within INT8_TOL."""
    shape = (groups, n, k) if groups > 1 else (n, k)
    w = packed(GGMLType.Q8_0, shape, seed=80 + b)
    x = torch.randn(b, groups * k, generator=generator(80 + b), device=DEVICE) * 3.0
    got = matvec.q8_rows(x, w, n, matvec.Q8RowsConfig(mode="int8"))
    assert rel_err(got, _rows_int_twin(x, w, n)) < 1e-6
    exact = ref.qmatvec_grouped(x.view(b, groups, k), w).reshape(b, -1) if groups > 1 else ref.qmatvec(x, w)
    err = rel_err(got, exact)
    assert 1e-7 < err < INT8_TOL  # x really was quantized, and within its bound


@pytest.mark.parametrize(
    ("b", "n", "k"), [(3, 64, 256), (16, 70, 512), (33, 128, 1024), (64, 64, 256)], ids=str
)
def test_q8_rows_f32_accurate(b, n, k):
    w = packed(GGMLType.Q8_0, (n, k), seed=50 + b)
    x = torch.randn(b, k, generator=generator(50 + b), device=DEVICE) * 3.0
    want = ref.qmatvec(x, w)
    got = matvec.qmatvec(x, w)  # f32 rows >= Q8_ROWS_FROM: q8_rows, the default mode
    assert rel_err(got, want) < rows_tol(matvec.Q8_ROWS.mode)
    assert torch.equal(got, matvec.q8_rows(x, w, n))
    splits = matvec.q8_rows_plan(b, n, k, matvec.Q8_ROWS)[2][2]
    assert k < 1024 or splits > 1  # the long row runs split-K (the fixup sums it)
    bf16 = matvec.qmatvec(x.bfloat16(), w)  # the bf16 tiles: measurably worse (the point of q8_rows)
    assert rel_err(bf16, want) > 10 * rel_err(got, want)


@pytest.mark.parametrize("mode", matvec.Q8_ROWS_MODES)
@pytest.mark.parametrize(("b", "n", "k"), [(9, 64, 256), (33, 128, 1024)], ids=str)
def test_q8_rows_modes(mode, b, n, k):
    w = packed(GGMLType.Q8_0, (n, k), seed=70 + b)
    x = torch.randn(b, k, generator=generator(70 + b), device=DEVICE) * 3.0
    want = ref.qmatvec(x, w)
    err = rel_err(matvec.q8_rows(x, w, n, matvec.Q8RowsConfig(mode=mode)), want)
    assert err < rows_tol(mode)
    assert 50 * err < rel_err(matvec.qmatvec(x.bfloat16(), w), want)
    with pytest.raises(ValueError, match="mode must be one of"):
        matvec.q8_rows(x, w, n, matvec.Q8RowsConfig(mode="fp8"))


@pytest.mark.parametrize("scales", ["f32", "f32t"])
@pytest.mark.parametrize(
    ("mode", "b", "n", "k", "groups"),
    [("tf32x2", 9, 64, 256, 1), ("int8", 20, 64, 256, 3), ("tf32x2", 40, 128, 512, 1)],
    ids=str,
)
def test_q8_rows_scale_copies(scales, mode, b, n, k, groups):
    """Q8RowsConfig.scales: the f32 copies of the block scales (row- or block-major) hold the f16 scales
    exactly, so the products equal the f16 scales' bit for bit, grouped rows and split-K included; the copy
    is made once, beside d."""
    shape = (groups, n, k) if groups > 1 else (n, k)
    w = packed(GGMLType.Q8_0, shape, seed=60 + b)
    x = torch.randn(b, groups * k, generator=generator(60 + b), device=DEVICE) * 3.0
    base = matvec.Q8RowsConfig(mode=mode)
    want = matvec.q8_rows(x, w, n, base)
    got = matvec.q8_rows(x, w, n, replace(base, scales=scales))
    assert torch.equal(got, want)
    key = {"f32": "d32", "f32t": "d32t"}[scales]
    copy = w.data[key]
    assert copy.dtype == torch.float32 and copy.numel() == w.data["d"].numel()
    matvec.q8_rows(x, w, n, replace(base, scales=scales))
    assert w.data[key] is copy  # packed once
    with pytest.raises(ValueError, match="scales must be one of"):
        matvec.q8_rows(x, w, n, replace(base, scales="bf16"))


@pytest.mark.parametrize("scales", ["f32", "f32t"])
def test_q8_rows_scale_copy_of_a_row_slice(scales):
    """The rows 64..127 of a matrix as a matrix of their own (a merged matrix's part, as the model holds
    q_a + kv): its scale copy a slice of the whole one (block-major: a column slice, rows of the whole apart
    a block) reads the part's own scales, bit-equal to the part's f16 scales."""
    w = packed(GGMLType.Q8_0, (192, 256), seed=66)
    matvec.rows_scales_pack(w, scales)
    dims = {"d32": 0, "d32t": 1}
    part = PackedWeight(w.qtype, (64, 256), {k: v.narrow(dims.get(k, 0), 64, 64) for k, v in w.data.items()})
    x = torch.randn(12, 256, generator=generator(66), device=DEVICE)
    want = matvec.q8_rows(x, part, 64, matvec.Q8RowsConfig())
    assert torch.equal(matvec.q8_rows(x, part, 64, matvec.Q8RowsConfig(scales=scales)), want)
    assert dims == SCALE_COPY_ROW_DIM


@pytest.mark.parametrize("mode", ["tf32x2", "int8"])
@pytest.mark.parametrize(("blocks", "k"), [(2, 1024), (4, 1024), (8, 2048), (4, 96)], ids=str)
def test_q8_rows_blocks_per_iteration(mode, blocks, k):
    """Q8RowsConfig.blocks (32-blocks per k iteration) gives the one-block result up to split-K summation
    order; a row length it does not divide (3 blocks) falls back to one block per iteration."""
    w = packed(GGMLType.Q8_0, (64, k), seed=90 + blocks)
    x = torch.randn(20, k, generator=generator(90 + blocks), device=DEVICE) * 3.0
    cfg = matvec.Q8RowsConfig(mode=mode, blocks=blocks)
    assert matvec.rows_blocks(k, cfg) == (blocks if k // 32 % blocks == 0 else 1)
    per = matvec.q8_rows_plan(20, 64, k, cfg)[1]
    assert per % matvec.rows_blocks(k, cfg) == 0
    got = matvec.q8_rows(x, w, 64, cfg)
    one = matvec.q8_rows(x, w, 64, matvec.Q8RowsConfig(mode=mode))
    assert rel_err(got, one) < 1e-6
    assert rel_err(got, ref.qmatvec(x, w)) < rows_tol(mode)


@pytest.mark.parametrize(("min_blocks", "bn"), [(16, 64), (32, 32)], ids=str)
def test_q8_rows_min_blocks_per_split(min_blocks, bn):
    """Q8RowsConfig.min_blocks bounds the split-K depth (each split writes an f32 partial); the result stays
    within the f32 bound at BN 64 and 32."""
    w = packed(GGMLType.Q8_0, (128, 2048), seed=95)
    x = torch.randn(20, 2048, generator=generator(95), device=DEVICE)
    cfg = matvec.Q8RowsConfig(bn=bn, min_blocks=min_blocks, target=4096)
    per = matvec.q8_rows_plan(20, 128, 2048, cfg)[1]
    assert per >= min_blocks and matvec.q8_rows_plan(20, 128, 2048, matvec.Q8RowsConfig(target=4096))[1] < 16
    assert rel_err(matvec.q8_rows(x, w, 128, cfg), ref.qmatvec(x, w)) < F32_TOL


@pytest.mark.parametrize(("warps", "bn"), [(2, 64), (2, 32), (1, 32)], ids=str)
@pytest.mark.parametrize("b", [12, 33, 64])
def test_q8_rows_mma_sync_warps(warps, bn, b):
    """Q8RowsConfig.warps below a warpgroup (mma.sync on the GPU instead of wgmma): the same exact-q times
    tf32 hi / lo products, so within the f32 bound of the exact product, and close to the default tile."""
    w = packed(GGMLType.Q8_0, (128, 1024), seed=97 + b)
    x = torch.randn(b, 1024, generator=generator(97 + b), device=DEVICE) * 3.0
    got = matvec.q8_rows(x, w, 128, matvec.Q8RowsConfig(bn=bn, warps=warps))
    assert rel_err(got, ref.qmatvec(x, w)) < F32_TOL
    assert rel_err(got, matvec.q8_rows(x, w, 128)) < 1e-6


def test_q8_rows_wide_tile_above_32_rows(monkeypatch):
    """Q8_ROWS_WIDE (where set) serves only batches above 32 rows, Q8_ROWS_NARROW only up to 16, within the
    f32 bound."""
    wide = matvec.Q8RowsConfig(**matvec.Q8_ROWS_WIDE_TILE)
    narrow = matvec.Q8RowsConfig(**matvec.Q8_ROWS_NARROW_TILE)
    monkeypatch.setattr(matvec, "Q8_ROWS_WIDE", wide)
    monkeypatch.setattr(matvec, "Q8_ROWS_NARROW", narrow)
    assert matvec.rows_config(33) is wide and matvec.rows_config(32) is matvec.Q8_ROWS
    assert matvec.rows_config(16) is narrow and matvec.rows_config(17) is matvec.Q8_ROWS
    x16 = torch.randn(12, 1024, generator=generator(99), device=DEVICE)
    w16 = packed(GGMLType.Q8_0, (64, 1024), seed=99)
    assert rel_err(matvec.qmatvec(x16, w16), ref.qmatvec(x16, w16)) < F32_TOL
    w = packed(GGMLType.Q8_0, (128, 1024), seed=98)
    x = torch.randn(40, 1024, generator=generator(98), device=DEVICE)
    got = matvec.qmatvec(x, w)
    assert rel_err(got, ref.qmatvec(x, w)) < F32_TOL
    assert torch.equal(got, matvec.q8_rows(x, w, 128, wide))


def test_q8_rows_grouped_and_bad_tile():
    w = packed(GGMLType.Q8_0, (3, 64, 256), seed=60)
    x = torch.randn(12, 3, 256, generator=generator(60), device=DEVICE)
    assert rel_err(matvec.qmatvec_grouped(x, w), ref.qmatvec_grouped(x, w)) < F32_TOL
    with pytest.raises(ValueError, match="must divide the group of 40 rows"):
        matvec.q8_rows(x.reshape(12, -1)[:, :512], packed(GGMLType.Q8_0, (2, 40, 256), seed=61), 40)


# ---------------------------------------------------------------------------------------------------------
# Split-K summed inside the Q8_0 kernels (matvec.Q8_FIXUP): the last split of each output tile adds the
# partials in split order and re-arms its counter. Oracles: the twin (dequantize + f32 matmul) and the torch
# sum of the same partials (switch off). The two sums differ only in the order the S partials p_s are
# added: each order is within (S - 1) u sum_s |p_s| <= (S - 1) u (|x| @ |W|^T) of the exact sum (u = 2^-24,
# first order), so |fixup - torch sum| <= 2 S u (|x| @ |W|^T) elementwise (S, not S - 1: slack for the
# second-order terms and bf16 W tiles). A lost or doubled partial is ~|p_s|, far above that bound.

U32 = 2.0**-24
# (B, x dtype): q8_mv1 (B = 1), the CUDA-core B-row tiles (B = 3), the tensor-core tiles (bf16, B = 6)
FIXUP_CASES = [(1, torch.float32), (3, torch.float32), (6, torch.bfloat16)]


def fixup_case(b: int, dtype: torch.dtype, seed: int) -> tuple[PackedWeight, torch.Tensor]:
    """W [20, 1536] Q8_0 (a partial last row tile) and x [b, 1536]: every path splits K in 3."""
    w = packed(GGMLType.Q8_0, (20, 1536), seed=seed)
    return w, torch.randn(b, 1536, generator=generator(seed), device=DEVICE).to(dtype)


def launch_splits(w: PackedWeight, b: int, dtype: torch.dtype) -> int:
    if b == 1:
        return matvec.q8_mv1_plan(w.N, w.K, matvec.Q8_MV1)[2]
    return matvec.qmatvec_plan(b, w, dtype == torch.bfloat16).grid[2]


def counter_requests(monkeypatch) -> list[int]:
    """Records the tile counts the kernels ask counters for (one entry per call that runs the fixup)."""
    asked: list[int] = []
    real = matvec._split_counters

    def spy(device, tiles):
        asked.append(tiles)
        return real(device, tiles)

    monkeypatch.setattr(matvec, "_split_counters", spy)
    return asked


@pytest.mark.parametrize(("b", "dtype"), FIXUP_CASES, ids=["B1-mv1", "B3-tiles", "B6-bf16-dot"])
def test_q8_split_fixup_vs_twin_and_torch_sum(b, dtype, monkeypatch):
    w, x = fixup_case(b, dtype, seed=40 + b)
    splits = launch_splits(w, b, dtype)
    assert splits == 3  # else this case would not exercise the fixup
    asked = counter_requests(monkeypatch)
    monkeypatch.setattr(matvec, "Q8_FIXUP", True)
    on = matvec.qmatvec(x, w)
    assert len(asked) == 1  # the fixup ran
    monkeypatch.setattr(matvec, "Q8_FIXUP", False)  # read at call time
    off = matvec.qmatvec(x, w)
    assert len(asked) == 1  # the torch sum ran: no counters
    assert on.shape == off.shape == (b, 20) and on.dtype == torch.float32
    tol = BF16_TOL if dtype == torch.bfloat16 else F32_TOL
    assert rel_err(on, ref.qmatvec(x, w)) < tol
    bound = 2 * splits * U32 * (x.double().abs() @ unpack(w).double().abs().T)
    assert ((on.double() - off.double()).abs() <= bound).all(), float((on - off).abs().max())


@pytest.mark.parametrize("b", [1, 3])
def test_q8_split_fixup_rearms_counters(b, monkeypatch):
    # the last program of a tile sets its counter back to 0: else the next call's last split is misjudged and
    # its output never written. Calls in a row (other inputs between) repeat the same bits.
    monkeypatch.setattr(matvec, "Q8_FIXUP", True)
    w, x = fixup_case(b, torch.float32, seed=50 + b)
    x2 = torch.randn(x.shape, generator=generator(60 + b), device=DEVICE)
    first = matvec.qmatvec(x, w)
    counters = matvec._HALF_COUNTERS[(x.device, 0)]
    assert not counters.any()
    assert rel_err(matvec.qmatvec(x2, w), ref.qmatvec(x2, w)) < F32_TOL
    assert not counters.any()
    assert torch.equal(matvec.qmatvec(x, w), first)
    assert rel_err(first, ref.qmatvec(x, w)) < F32_TOL


def test_q8_split_fixup_not_used_for_one_split(monkeypatch):
    monkeypatch.setattr(matvec, "Q8_FIXUP", True)
    asked = counter_requests(monkeypatch)
    w, x = fixup_case(1, torch.float32, seed=70)
    one = matvec.Q8Config(bn=8, tk=512, target=1)  # 3 k-tiles, 3 programs >= target: no split
    assert matvec.q8_mv1_plan(w.N, w.K, one)[2] == 1
    assert rel_err(matvec.q8_mv1(x[0], w, 20, one), ref.qmatvec(x, w)[0]) < F32_TOL
    assert asked == []


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("n", "k", "b"),
    [(1536, 4096, 1), (4096, 8192, 1), (1536, 4096, 4)],
    ids=["qa_kv-B1", "o_b-B1", "qa_kv-B4"],  # at B = 4 only q_a+kv splits on the H200 (bench_q8 --list)
)
def test_q8_split_fixup_in_cuda_graph(n, k, b, monkeypatch):
    # Flash decode shapes inside a CUDA graph: each replay re-arms the counters itself (no host work between
    # replays), gives the eager call's bits on the same input, and matches the twin on a new input
    monkeypatch.setattr(matvec, "Q8_FIXUP", True)
    w = packed(GGMLType.Q8_0, (n, k), seed=n + k)
    x = torch.randn(b, k, generator=generator(b), device=DEVICE)
    assert launch_splits(w, b, torch.float32) > 1
    matvec.qmatvec(x, w)  # compile, allocate the counters: outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = matvec.qmatvec(x, w)
    for seed in (1, 2, 3):
        x.copy_(torch.randn(b, k, generator=generator(seed), device=DEVICE))
        graph.replay()
        assert torch.equal(y, matvec.qmatvec(x, w))
        assert rel_err(y, ref.qmatvec(x, w)) < F32_TOL
    assert not matvec._HALF_COUNTERS[(x.device, 0)].any()


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
@pytest.mark.parametrize("cfg", Q8_TILES, ids=_q8_id)
def test_q8_mv1_flash_shapes_cuda(cfg):
    """Every q8_mv1 tile / code variant at the q_b and head shapes (split-K with the fixup, 8 groups)."""
    assert CUDA
    for n, k, groups in ((32768, 1024, 1), (129280, 4096, 1), (1024, 4096, 8)):
        w = packed(GGMLType.Q8_0, (groups, n, k) if groups > 1 else (n, k), seed=24)
        x = torch.randn(groups * k, generator=generator(24), device=DEVICE)
        if groups > 1:
            want = ref.qmatvec_grouped(x.view(1, groups, k), w).reshape(-1)
        else:
            want = ref.qmatvec(x[None], w)[0]
        _assert_q8_mv1(matvec.q8_mv1(x, w, n, cfg), x, w, n, cfg, want)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", matvec.Q8_ROWS_MODES)
@pytest.mark.parametrize("b", [9, 16, 32, 64])
def test_q8_rows_flash_shapes_cuda(b, mode, monkeypatch):
    """q8_rows at q_a+kv / q_b / o_a (8 groups) / head widths, f32 bound (bf16x2: its own); the bf16 tiles
    fail that bound."""
    assert CUDA
    monkeypatch.setattr(matvec, "Q8_ROWS", matvec.Q8RowsConfig(mode=mode))
    tol = rows_tol(mode)
    for n, k, groups in ((1536, 4096, 1), (32768, 1024, 1), (1024, 4096, 8), (129280, 4096, 1)):
        w = packed(GGMLType.Q8_0, (groups, n, k) if groups > 1 else (n, k), seed=25)
        x = torch.randn(b, groups, k, generator=generator(25), device=DEVICE)
        if groups > 1:
            got, want = matvec.qmatvec_grouped(x, w), ref.qmatvec_grouped(x, w)
        else:
            got, want = matvec.qmatvec(x[:, 0], w), ref.qmatvec(x[:, 0], w)
        assert rel_err(got, want) < tol, (n, k, groups)


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", QUANT, ids=lambda t: t.name)
def test_qmatmul_prefill_cuda(qtype):
    w = packed(qtype, (1024, 4096), seed=22)
    x = torch.randn(2048 + 17, 4096, generator=generator(22), device=DEVICE).bfloat16()
    assert rel_err(matmul.qmatmul(x, w), ref.qmatmul(x, w)) < BF16_TOL
    wg = packed(GGMLType.Q8_0, (8, 1024, 4096), seed=23)
    xg = torch.randn(4, 8, 4096, generator=generator(23), device=DEVICE)
    assert rel_err(matvec.qmatvec_grouped(xg, wg), ref.qmatvec_grouped(xg, wg)) < F32_TOL
