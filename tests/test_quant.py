"""ds4.quant against the independent oracle gguf.quants (PyPI gguf): dequantization bit-exactness, tables,
Q8_0 quantization, random-block synthesis validity and std.

Comparison rule (assert_same_bits): shapes equal, NaN positions equal, every other value equal in its raw
float32 bits (so -0.0 != +0.0 and ±Inf must match). NaN payload/sign is not compared: random bytes encode
NaN/Inf scales, and the payload numpy or torch produce for Inf*0 or NaN*x is unspecified by IEEE 754.
"""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GQ
from gguf.quants import IQ2_XXS as GGUF_IQ2_XXS

import ds4.quant.dequant as dequant_mod
from ds4.quant import (
    BLOCK_GEOMETRY,
    GGMLType,
    dequantize,
    quantize_q8_0,
    random_blocks,
    std_range,
    tensor_nbytes,
    to_bytes,
)
from ds4.quant.tables import IQ2XXS_GRID, KSIGNS

FLOAT_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16]
BLOCK_TYPES = [GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS]
SYNTH_TYPES = FLOAT_TYPES + BLOCK_TYPES

# Where each block type keeps its f16 super-block scales: (d offset, dmin offset or None)
SCALE_OFFSETS = {
    GGMLType.Q8_0: (0, None),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q4_K: (0, 2),
    GGMLType.IQ2_XXS: (0, None),
}

# f16 bit patterns: ±0, min/max subnormal, min normal, ±1, ±max, ±Inf, NaNs
EXTREME_F16 = [
    0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x8400, 0x3C00,
    0xBC00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE00,
]  # fmt: skip


def gguf_dequant(raw: np.ndarray, qtype: GGMLType) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # inf*0 etc. in random/extreme blocks
        out = gguf.quants.dequantize(raw, GQ(int(qtype)))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def assert_same_bits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and tuple(ours.shape) == tuple(ref.shape)
    ours, ref = ours.cpu().reshape(-1), ref.reshape(-1)
    nan_o, nan_r = torch.isnan(ours), torch.isnan(ref)
    assert torch.equal(nan_o, nan_r), f"NaN positions differ at {torch.nonzero(nan_o != nan_r)[:5].tolist()}"
    bo, br = ours[~nan_r].view(torch.int32), ref[~nan_r].view(torch.int32)
    bad = torch.nonzero(bo != br).reshape(-1)
    assert bad.numel() == 0, (
        f"{bad.numel()} values differ, first: ours {ours[~nan_r][bad[:3]]} ref {ref[~nan_r][bad[:3]]}"
    )


def row_len(qtype: GGMLType, n_blocks: int) -> int:
    return BLOCK_GEOMETRY[qtype][0] * n_blocks if BLOCK_GEOMETRY[qtype][0] > 1 else 64 * n_blocks


def random_raw(rng: np.random.Generator, qtype: GGMLType, shape: tuple[int, ...]) -> np.ndarray:
    """Random bytes shaped like gguf's byte arrays: [*rows, row_bytes]."""
    block_elems, block_bytes = BLOCK_GEOMETRY[qtype]
    return rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block_elems * block_bytes), dtype=np.uint8)


def set_f16(raw: np.ndarray, offset: int, bits: np.ndarray) -> None:
    """Write f16 bit patterns [n] into the 2 bytes at offset of each block of raw [n, block_bytes]."""
    raw[:, offset : offset + 2] = bits.astype("<u2").view(np.uint8).reshape(-1, 2)


# ---------------------------------------------------------------------------------------------------------
# tables


def test_iq2xxs_tables_equal_gguf() -> None:
    GGUF_IQ2_XXS.init_grid()
    ref_grid = np.asarray(GGUF_IQ2_XXS.grid).reshape(256, 8).astype(np.uint8)
    ours = np.array(IQ2XXS_GRID, dtype="<u8").view(np.uint8).reshape(256, 8)  # byte j = element j
    np.testing.assert_array_equal(ours, ref_grid)
    assert bytes(KSIGNS) == bytes(GGUF_IQ2_XXS.ksigns)
    assert all(KSIGNS[i] == i + 128 * (bin(i).count("1") % 2) for i in range(128))  # model.md §3 definition


# ---------------------------------------------------------------------------------------------------------
# dequantize vs gguf.quants.dequantize


@pytest.mark.parametrize("qtype", FLOAT_TYPES + BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [(), (5,), (3, 4)], ids=["1d", "2d", "3d"])
def test_dequantize_random_bytes_bit_exact(qtype: GGMLType, rows: tuple[int, ...]) -> None:
    rng = np.random.default_rng(int(qtype) * 100 + len(rows))
    shape = (*rows, row_len(qtype, 3))
    raw = random_raw(rng, qtype, shape)
    ours = dequantize(raw, qtype, shape)
    assert_same_bits(ours, gguf_dequant(raw, qtype))
    # the same bytes given as a flat uint8 torch tensor, and qtype as gguf's enum / plain int
    assert_same_bits(dequantize(torch.from_numpy(raw.reshape(-1)), GQ(int(qtype)), shape), ours)
    assert_same_bits(dequantize(raw.tobytes(), int(qtype), list(shape)), ours)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantize_extreme_scales_bit_exact(qtype: GGMLType) -> None:
    rng = np.random.default_rng(7)
    d_off, dmin_off = SCALE_OFFSETS[qtype]
    pats = np.array(EXTREME_F16, dtype=np.uint16)
    if dmin_off is None:
        d_bits, dmin_bits = np.repeat(pats, 4), None  # 4 random payloads per scale
    else:
        d_bits, dmin_bits = np.repeat(pats, len(pats)), np.tile(pats, len(pats))  # every (d, dmin) pair
    block_elems, _ = BLOCK_GEOMETRY[qtype]
    n = len(d_bits)
    raw = random_raw(rng, qtype, (n, block_elems))  # [n, block_bytes]: one block per row
    set_f16(raw, d_off, d_bits)
    if dmin_bits is not None:
        set_f16(raw, dmin_off, dmin_bits)
    ref = gguf_dequant(raw, qtype)
    assert_same_bits(dequantize(raw, qtype, (n, block_elems)), ref)
    # the finite-scale rows really produce finite values, including max/min normal and subnormal d
    finite = np.isfinite(d_bits.view(np.float16)) & (
        np.isfinite(dmin_bits.view(np.float16)) if dmin_bits is not None else True
    )
    assert torch.isfinite(ref[torch.from_numpy(finite)]).all()


@pytest.mark.parametrize("qtype", [GGMLType.F16, GGMLType.BF16], ids=lambda t: t.name)
def test_dequantize_every_16bit_pattern(qtype: GGMLType) -> None:
    raw = np.arange(65536, dtype="<u2").view(np.uint8).reshape(256, 512)
    assert_same_bits(dequantize(raw, qtype, (256, 256)), gguf_dequant(raw, qtype))


def test_dequantize_f32_special_values_and_i32() -> None:
    vals = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -3.4e38, 1.5], dtype=np.float32)
    out = dequantize(vals, GGMLType.F32, (2, 4))  # typed arrays: their bytes are reinterpreted
    assert_same_bits(out, torch.from_numpy(vals.reshape(2, 4)))
    ints = np.array([[-(2**31), -1, 0, 2**31 - 1]], dtype=np.int32)
    got = dequantize(ints.view(np.uint8), GGMLType.I32, (1, 4))
    assert got.dtype == torch.int32 and torch.equal(got, torch.from_numpy(ints))


def test_dequantize_result_does_not_alias_input() -> None:
    raw = torch.arange(8, dtype=torch.float32).view(torch.uint8)
    out = dequantize(raw, GGMLType.F32, (8,))
    out += 1
    assert torch.equal(raw.view(torch.float32), torch.arange(8, dtype=torch.float32))


def test_dequantize_memmap_expert_slice(tmp_path) -> None:
    """A read-only memmap view of one expert of an [E, out, in] tensor, at an unaligned file offset."""
    qtype, shape = GGMLType.Q2_K, (4, 3, 512)
    rng = np.random.default_rng(3)
    raw = random_raw(rng, qtype, shape)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 3 + raw.tobytes())  # odd offset: views must not assume alignment
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=3, shape=(raw.size,))
    expert_bytes = raw.size // 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable" warning leaks to callers
        one = dequantize(mm[2 * expert_bytes : 3 * expert_bytes], qtype, shape[1:])
        full = dequantize(mm, qtype, shape)
    assert_same_bits(one, full[2])
    assert_same_bits(full, gguf_dequant(raw, qtype))
    f32 = np.memmap(path, dtype=np.uint8, mode="r", offset=1, shape=(64,))  # unaligned F32 view
    assert_same_bits(dequantize(f32, GGMLType.F32, (16,)), gguf_dequant(np.array(f32), GGMLType.F32))


@pytest.mark.parametrize("qtype", BLOCK_TYPES + [GGMLType.F16], ids=lambda t: t.name)
def test_dequantize_in_chunks(qtype: GGMLType, monkeypatch) -> None:
    """Many small chunks (with a ragged last one) give the same bits as gguf."""
    monkeypatch.setattr(dequant_mod, "_CHUNK_ELEMS_CPU", 3 * BLOCK_GEOMETRY[qtype][0])
    rng = np.random.default_rng(11)
    shape = (7, row_len(qtype, 2))
    raw = random_raw(rng, qtype, shape)
    assert_same_bits(dequantize(raw, qtype, shape), gguf_dequant(raw, qtype))


def test_dequantize_empty() -> None:
    out = dequantize(np.zeros(0, np.uint8), GGMLType.Q2_K, (0, 256))
    assert out.shape == (0, 256) and out.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------
# errors


def test_dequantize_wrong_byte_count_names_type_shape_and_sizes() -> None:
    with pytest.raises(ValueError) as e:
        dequantize(np.zeros(84 * 3 - 1, np.uint8), GGMLType.Q2_K, (3, 256))
    msg = str(e.value)
    assert "Q2_K" in msg and "(3, 256)" in msg and "252" in msg and "251" in msg
    assert tensor_nbytes(GGMLType.Q2_K, 3 * 256) == 252


def test_dequantize_row_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match=r"IQ2_XXS.*\(2, 128\).*256"):
        dequantize(np.zeros(66, np.uint8), GGMLType.IQ2_XXS, (2, 128))


@pytest.mark.parametrize(
    ("raw", "qtype", "shape", "pattern"),
    [
        (np.zeros(18, np.uint8), 2, (32,), "unsupported ggml type 2"),  # Q4_0
        (np.zeros(4, np.uint8), "F32", (1,), "unsupported ggml type"),
        (np.zeros(4, np.uint8), GGMLType.F32, (), "non-negative dims"),
        (np.zeros(4, np.uint8), GGMLType.F32, (-1, 1), "non-negative dims"),
        (np.zeros(4, np.uint8), GGMLType.F32, (1.5,), "F32"),
    ],
)
def test_dequantize_bad_arguments(raw, qtype, shape, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        dequantize(raw, qtype, shape)


def test_dequantize_bad_raw_type() -> None:
    with pytest.raises(TypeError, match="raw must be"):
        dequantize([0, 0, 0, 0], GGMLType.F32, (1,))


# ---------------------------------------------------------------------------------------------------------
# quantize_q8_0 / to_bytes vs gguf.quants.quantize


def q8_inputs() -> np.ndarray:
    rng = np.random.default_rng(5)
    blocks = [
        rng.standard_normal((40, 32)) * 0.02,
        rng.standard_normal((8, 32)) * 3e4,  # large: d near f16 max range
        rng.standard_normal((8, 32)) * 1e-6,  # tiny: d is an f16 subnormal or 0
        np.zeros((2, 32)),  # d = 0 -> id = 0
        rng.integers(-127, 128, (8, 32)) + 0.5 * rng.integers(0, 2, (8, 32)),  # exact .5 ties (d = 1)
    ]
    ties = blocks[-1]
    ties[:, 0] = 127.0  # amax = 127 so d = 1 and x * id = x exactly
    ties[:, 1:] = np.clip(ties[:, 1:], -126.5, 126.5)
    return np.concatenate(blocks).astype(np.float32).reshape(2, 3, 352)  # 66 blocks


def test_quantize_q8_0_bit_exact_vs_gguf() -> None:
    x = q8_inputs()
    ref = gguf.quants.quantize(x, GQ.Q8_0)
    ours = quantize_q8_0(torch.from_numpy(x))
    assert ours.dtype == torch.uint8 and tuple(ours.shape) == ref.shape == (2, 3, 374)
    np.testing.assert_array_equal(ours.numpy(), ref)
    # and the ties really exercised round-half-away (torch.round would give even values)
    half = torch.from_numpy(x).reshape(-1, 32)[-8:, 1:]
    assert bool(((half - half.trunc()).abs() == 0.5).any())


@pytest.mark.parametrize(
    ("x", "pattern"),
    [
        (torch.zeros(31), "multiple of 32"),
        (torch.tensor(1.0), "multiple of 32"),
        (torch.full((32,), float("nan")), "finite"),
        (torch.zeros(32, dtype=torch.int32), "float"),
    ],
)
def test_quantize_q8_0_errors(x, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        quantize_q8_0(x)


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_to_bytes_vs_gguf(qtype: GGMLType) -> None:
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((3, 64)) * np.logspace(-8, 4, 64)).astype(np.float32)
    ref = gguf.quants.quantize(x, GQ(int(qtype)))
    np.testing.assert_array_equal(to_bytes(torch.from_numpy(x), qtype).numpy(), ref.view(np.uint8))
    with pytest.raises(ValueError, match="to_bytes"):
        to_bytes(torch.from_numpy(x), GGMLType.Q8_0)


# ---------------------------------------------------------------------------------------------------------
# random_blocks: valid blocks, std, determinism


@pytest.mark.parametrize("qtype", SYNTH_TYPES, ids=lambda t: t.name)
def test_random_blocks_valid_and_hit_std(qtype: GGMLType) -> None:
    g = torch.Generator().manual_seed(int(qtype))
    lo, hi = std_range(qtype)
    stds = [0.02, 1.0, 30.0] + ([lo * 1.001, hi * 0.999] if qtype in BLOCK_TYPES else [])
    shape = (6, 5, row_len(qtype, 4))
    for std in stds:
        raw = random_blocks(qtype, shape, std=std, generator=g)
        block_elems, block_bytes = BLOCK_GEOMETRY[qtype]
        assert raw.dtype == torch.uint8 and tuple(raw.shape) == (6, 5, shape[-1] // block_elems * block_bytes)
        vals = gguf_dequant(raw.numpy(), qtype)  # the oracle decodes it
        assert torch.isfinite(vals).all(), f"{qtype.name} std={std}: non-finite values"
        got = float(vals.double().std())
        assert std / 2 <= got <= std * 2, f"{qtype.name}: asked std {std}, got {got}"
        assert abs(float(vals.double().mean())) < 0.2 * std
        if qtype in BLOCK_TYPES:  # the f16 scales themselves are finite and bounded
            d_off, dmin_off = SCALE_OFFSETS[qtype]
            blocks = raw.reshape(-1, block_bytes).numpy()
            for off in (d_off, dmin_off):
                if off is not None:
                    s = np.ascontiguousarray(blocks[:, off : off + 2]).view(np.float16)
                    assert np.isfinite(s).all() and (s > 0).all()


def test_random_blocks_deterministic_and_seed_dependent() -> None:
    def make(seed: int) -> torch.Tensor:
        return random_blocks(
            GGMLType.IQ2_XXS, (4, 512), std=0.02, generator=torch.Generator().manual_seed(seed)
        )

    assert torch.equal(make(1), make(1))
    assert not torch.equal(make(1), make(2))


@pytest.mark.parametrize(
    ("qtype", "shape", "std", "pattern"),
    [
        (GGMLType.Q4_K, (2, 128), 0.02, r"Q4_K.*\(2, 128\).*256"),
        (GGMLType.I32, (4,), 1.0, "does not support I32"),
        (GGMLType.Q8_0, (32,), 0.0, "std must be"),
        (GGMLType.Q8_0, (32,), float("nan"), "std must be"),
        (GGMLType.Q2_K, (256,), 1e9, "std must be"),
        (GGMLType.F16, (8,), 1e6, "std must be"),
    ],
)
def test_random_blocks_errors(qtype, shape, std, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        random_blocks(qtype, shape, std=std, generator=torch.Generator().manual_seed(0))


def test_random_blocks_generator_device_mismatch() -> None:
    with pytest.raises(ValueError, match="generator is on cpu"):
        random_blocks(GGMLType.Q8_0, (32,), std=1.0, generator=torch.Generator(), device="meta")


# ---------------------------------------------------------------------------------------------------------
# CUDA: same bits on the GPU


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", FLOAT_TYPES + BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantize_cuda_matches_gguf(qtype: GGMLType) -> None:
    rng = np.random.default_rng(21)
    shape = (64, row_len(qtype, 8))
    raw = random_raw(rng, qtype, shape)
    if qtype in SCALE_OFFSETS:  # a sprinkle of extreme scales too
        set_f16(raw.reshape(-1, BLOCK_GEOMETRY[qtype][1])[: len(EXTREME_F16)], 0, np.array(EXTREME_F16))
    ours = dequantize(torch.from_numpy(raw).cuda(), qtype, shape)
    assert ours.device.type == "cuda"
    assert_same_bits(ours, gguf_dequant(raw, qtype))


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", SYNTH_TYPES, ids=lambda t: t.name)
def test_random_blocks_cuda(qtype: GGMLType) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    raw = random_blocks(qtype, (256, row_len(qtype, 8)), std=0.02, generator=g)
    assert raw.device.type == "cuda"
    vals = gguf_dequant(raw.cpu().numpy(), qtype)
    assert torch.isfinite(vals).all() and 0.01 <= float(vals.std()) <= 0.04
