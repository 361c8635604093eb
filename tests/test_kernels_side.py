"""hmatvec (x f32 @ float16 / bfloat16 side matrices, ds4.kernels.matvec) vs its torch twin and a f64 oracle.

The oracle multiplies the matrices' exact values in float64 (f16 and bf16 are subsets of f64); kernel and
twin accumulate in f32, so both must agree with it to f32 summation noise. Without CUDA the kernel runs under
Triton's interpreter at tiny shapes (via test_kernels_interpreted.py); `cuda`-marked tests run Flash shapes.
Tolerance (max |got - oracle| / max |oracle|): 1e-5 (measured ~1e-7 at K = 192..320).
"""

from __future__ import annotations

import pytest
import torch
from _kernel_env import CUDA, DEVICE, generator, rel_err

from ds4.kernels import matvec, ref
from ds4.kernels.matvec import HalfConfig

HALF = [torch.float16, torch.bfloat16]
TOL = 1e-5


def half_matrix(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(n, k, generator=generator(seed), device=DEVICE) * 0.05).to(dtype)


def activations(b: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(b, k, generator=generator(seed), device=DEVICE)


def oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


def assert_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = oracle(x, w)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert rel_err(got, want) < TOL, rel_err(got, want)
    assert rel_err(got, ref.hmatvec(x, w)) < TOL


@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
@pytest.mark.parametrize("b", [1, 3, 8])
def test_hmatvec_default_tiles(dtype, b):
    # N = 70: a partial row tile; K = 192 = 3 x 64: not a power of two, three k-tiles of the minimum size
    # (split-K); B = 1, 3: mode "fma" (HMV_SMALL), B = 8: HMV_LARGE
    w = half_matrix(70, 192, dtype, seed=b)
    x = activations(b, 192, seed=100 + b)
    assert_close(matvec.hmatvec(x, w), x, w)
    assert rel_err(ref.hmatvec(x, w), oracle(x, w)) < TOL


TILES = [
    HalfConfig(bn=8, tk=512, mode="fma", target=1),  # no split-K
    HalfConfig(bn=16, tk=64, mode="fma", target=10**6),  # one k-tile per split
    HalfConfig(bn=16, tk=128, mode="ieee", target=64),
    HalfConfig(bn=32, tk=128, mode="tf32x2", stages=1),
    HalfConfig(bn=16, tk=256, mode="tf32x3", target=1),
    HalfConfig(bn=32, tk=64, mode="fma", target=10**6, fixup=True),  # split-K summed in the kernel
    HalfConfig(bn=32, tk=128, mode="tf32x2", target=10**6, fixup=True),
    HalfConfig(bn=4, tk=64, mode="fma", stages=3, target=1, prefetch=True),  # first k-tile before the wait
    HalfConfig(bn=32, tk=64, mode="tf32x2", target=10**6, fixup=True, prefetch=True),  # all of a split
]


def tile_id(c: HalfConfig) -> str:
    return f"{c.mode}-bn{c.bn}-tk{c.tk}-t{c.target}" + "-fixup" * c.fixup + "-pre" * c.prefetch


@pytest.mark.parametrize(
    ("cfg", "dtype"),
    [(c, HALF[i % 2]) for i, c in enumerate(TILES)],  # each tile once, the weight dtypes alternating
    ids=lambda v: tile_id(v) if isinstance(v, HalfConfig) else str(v).removeprefix("torch."),
)
def test_hmatvec_tiles(cfg, dtype):
    # K = 320 = 5 x 64 (the tile falls back to 64); B = 1 (the flat "fma" path; dot tiles padded to 8 rows),
    # 5 (2 row chunks in "fma") and 33 (2 in the dot modes; 9 for "fma": 3 chunks, interpreter time)
    w = half_matrix(70, 320, dtype, seed=7)
    for b in (1, 5, 9 if cfg.mode == "fma" else 33):
        x = activations(b, 320, seed=200 + b)
        assert_close(matvec.hmatvec(x, w, cfg), x, w)


def test_hmatvec_fixup_rearms_counters_and_is_deterministic():
    # the in-kernel split-K sum: per-tile counters must be back at 0 after every call (else the next call's
    # last program is misjudged) and the sum runs in split order (bitwise repeatable)
    cfg = HalfConfig(bn=16, tk=64, mode="fma", target=10**6, fixup=True)
    w = half_matrix(40, 256, torch.bfloat16, seed=9)  # 3 row tiles x 4 splits
    x = activations(3, 256, seed=9)
    first = matvec.hmatvec(x, w, cfg)
    assert_close(first, x, w)
    counters = matvec._HALF_COUNTERS[(x.device, 0)]
    assert counters.numel() >= 3 and not counters.any()
    assert torch.equal(matvec.hmatvec(x, w, cfg), first)
    assert not counters.any()


def test_counter_lanes_have_their_own_buffers():
    # two streams in flight at once (ds4.model.cuda.streams) must not share tile counters: a call inside
    # counter_lane(1) bumps and re-arms lane 1's buffer, never lane 0's
    cfg = HalfConfig(bn=16, tk=64, mode="fma", target=10**6, fixup=True)
    w = half_matrix(40, 256, torch.bfloat16, seed=10)
    x = activations(2, 256, seed=10)
    want = matvec.hmatvec(x, w, cfg)
    lane0 = matvec._HALF_COUNTERS[(x.device, 0)]
    with matvec.counter_lane(1):
        got = matvec.hmatvec(x, w, cfg)
    lane1 = matvec._HALF_COUNTERS[(x.device, 1)]
    assert lane1.data_ptr() != lane0.data_ptr()
    assert matvec._LANE[0] == 0 and not lane1.any() and not lane0.any()
    assert torch.equal(got, want)


def test_hmatvec_concatenated_side_matrices():
    # the wiring's use: several matrices that share x stored as one [sum N, K] matrix, one call, split after
    parts = [half_matrix(n, 128, torch.float16, seed=n) for n in (24, 24, 8, 8, 4)]
    cat = torch.cat(parts)
    x = activations(2, 128, seed=5)
    ys = matvec.hmatvec(x, cat).split([p.shape[0] for p in parts], dim=1)
    for y, p in zip(ys, parts, strict=True):
        assert rel_err(y, oracle(x, p)) < TOL
    tail = cat[48:]  # a contiguous row slice (storage offset) is a valid weight too
    assert_close(matvec.hmatvec(x, tail), x, tail)


def test_hmatvec_inputs_upcast_and_empty():
    w = half_matrix(10, 64, torch.bfloat16, seed=3)
    xb = activations(3, 128, seed=3)[:, ::2].bfloat16()  # strided, bf16: upcast exactly, made contiguous
    assert_close(matvec.hmatvec(xb, w), xb.float(), w)
    assert matvec.hmatvec(torch.zeros(0, 64, device=DEVICE), w).shape == (0, 10)
    assert matvec.hmatvec(xb, w[:0]).shape == (3, 0)


def test_hmatvec_dispatch_without_triton_uses_twin(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w = torch.randn(6, 64).half()
    x = torch.randn(2, 64)
    assert torch.equal(matvec.hmatvec(x, w), ref.hmatvec(x, w))


def test_hmatvec_errors():
    w = half_matrix(8, 128, torch.float16, seed=1)
    x = activations(2, 128, seed=1)
    with pytest.raises(ValueError, match="K must be a multiple of 64, got K=100"):
        matvec.hmatvec(x[:, :100], w[:, :100].contiguous())
    with pytest.raises(ValueError, match=r"float16 or bfloat16 \[N, K\] matrix, got torch.float32"):
        matvec.hmatvec(x, w.float())
    with pytest.raises(ValueError, match="must be contiguous"):
        matvec.hmatvec(x[:, :64], half_matrix(64, 8, torch.float16, seed=2).T)
    with pytest.raises(ValueError, match=r"x must be \[B, 128\], got \(2, 64\)"):
        matvec.hmatvec(x[:, :64], w)
    with pytest.raises(ValueError, match="x must be floating point, got torch.int64"):
        matvec.hmatvec(x.long(), w)
    with pytest.raises(ValueError, match="mode must be one of"):
        matvec.hmatvec(x, w, HalfConfig(mode="tf32"))
    with pytest.raises(ValueError, match=r"HalfConfig.bn must be a power of two, got 12"):
        matvec.hmatvec(x, w, HalfConfig(bn=12))


# ---------------------------------------------------------------------------------------------------------
# GPU: Flash shapes (attention input of a ratio-4 layer: compressor kv + gate 2 x 1024, indexer compressor
# kv + gate 2 x 256, indexer proj 64; ratio-128 layer: 2 x 512; router 256; indexer q_b 8192 x 1024)

FLASH_SHAPES = [(2624, 4096), (1024, 4096), (256, 4096), (64, 4096), (8192, 1024)]


@pytest.mark.cuda
@pytest.mark.parametrize(("n", "k"), FLASH_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", HALF, ids=["f16", "bf16"])
def test_hmatvec_flash_shapes_cuda(n, k, dtype):
    assert CUDA
    w = half_matrix(n, k, dtype, seed=n)
    for b in (1, 3, 8, 32):
        x = activations(b, k, seed=b)
        assert_close(matvec.hmatvec(x, w), x, w)


CUDA_TILES = [
    matvec.HMV_SMALL,
    matvec.HMV_LARGE,
    HalfConfig(bn=8, tk=512, mode="fma", stages=1, fixup=True),
    HalfConfig(bn=4, tk=512, mode="fma", stages=3, target=1),
    HalfConfig(bn=32, tk=128, mode="tf32x2", fixup=True),
    HalfConfig(bn=64, tk=128, mode="tf32x2", fixup=True),  # wgmma at B = 32
    HalfConfig(bn=16, tk=128, mode="ieee"),
    HalfConfig(bn=32, tk=128, mode="tf32x3"),
]


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", CUDA_TILES, ids=tile_id)
@pytest.mark.parametrize(("n", "k"), [(2624, 4096), (256, 4096)], ids=["attn", "router"])
def test_hmatvec_tiles_flash_cuda(cfg, n, k):
    # accuracy, and bitwise repeatability over 20 calls: split-K sums run in a fixed order (a race in the
    # in-kernel fixup would show as a changed or wrong result)
    assert CUDA
    w = half_matrix(n, k, torch.float16, seed=11)
    for b in (1, 8, 32):
        x = activations(b, k, seed=b)
        first = matvec.hmatvec(x, w, cfg)
        assert_close(first, x, w)
        for _ in range(20):
            assert torch.equal(matvec.hmatvec(x, w, cfg), first)
