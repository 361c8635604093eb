"""Model primitives against independent oracles: ml_dtypes FP8/FP4, explicit Sylvester matrix,
Sinkhorn properties, RoPE pair convention, YaRN ramp (model.md §4, §5.2)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from ds4.config import FLASH
from ds4.model.hc import HCWeights, hc_post, hc_pre, sinkhorn
from ds4.model.quantsim import fp4_e2m1_roundtrip, fp8_e4m3_roundtrip, hadamard, pow2_ceil
from ds4.model.rope import layer_inv_freq, rope_inv_freq, rope_tail, yarn_pair_range


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-6, rtol: float = 1e-6) -> None:
    """|got - want| <= atol + rtol * |want| elementwise (torch.testing imports slowly)."""
    got, want = got.double(), want.double()
    err = (got - want).abs() - (atol + rtol * want.abs())
    assert got.shape == want.shape and float(err.max()) <= 0, f"max excess {float(err.max()):.3e}"


def _blocks_with_midpoints(rng: np.random.Generator, grid: np.ndarray, top: float, n_blocks: int, block: int):
    """Blocks whose values sit on grid points and exact midpoints (the rounding ties), at random scales.

    Each block carries +-top so the block scale is exactly 2^e and v/scale lands on the intended points."""
    mids = (grid[1:] + grid[:-1]) / 2
    pts = np.concatenate([grid, mids, rng.uniform(0, top, 4 * len(grid))])
    x = rng.choice(pts, size=(n_blocks, block)) * rng.choice([-1.0, 1.0], size=(n_blocks, block))
    x[:, 0] = top
    e = rng.integers(-20, 20, size=(n_blocks, 1)).astype(np.float64)
    return (x * 2.0**e).astype(np.float32)


def _oracle(x: np.ndarray, block: int, top: float, floor: float, dtype) -> np.ndarray:
    """clamp(x / 2^ceil(log2(amax/top))) cast with ml_dtypes (RNE), back to f32, times the scale."""
    xb = x.reshape(-1, block).astype(np.float64)
    amax = np.maximum(np.abs(xb).max(1, keepdims=True), floor)
    scale = 2.0 ** np.ceil(np.log2(amax / top))
    q = np.clip(xb / scale, -top, top).astype(dtype).astype(np.float64)
    return (q * scale).astype(np.float32).reshape(x.shape)


def test_fp8_matches_ml_dtypes():
    rng = np.random.default_rng(0)
    grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)))
    grid = grid[np.isfinite(grid)]
    x = np.concatenate(
        [
            _blocks_with_midpoints(rng, grid, 448.0, 400, 64),
            (rng.standard_normal((400, 64)) * 10.0 ** rng.uniform(-6, 3, (400, 1))).astype(np.float32),
            np.zeros((1, 64), np.float32),  # amax floor 1e-4
        ]
    )
    x = x[: len(x) // 7 * 7].reshape(-1, 448)  # rows of 7 blocks, like a KV row's nope dims
    got = fp8_e4m3_roundtrip(torch.from_numpy(x), 64)
    want = _oracle(x, 64, 448.0, 1e-4, ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(got.numpy(), want)


def test_fp4_matches_ml_dtypes():
    rng = np.random.default_rng(1)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
    x = np.concatenate(
        [
            _blocks_with_midpoints(rng, grid, 6.0, 400, 32),
            (rng.standard_normal((400, 32)) * 10.0 ** rng.uniform(-6, 3, (400, 1))).astype(np.float32),
        ]
    )
    got = fp4_e2m1_roundtrip(torch.from_numpy(x), 32).numpy()
    floor = 6.0 * np.finfo(np.float32).tiny
    np.testing.assert_array_equal(got, _oracle(x, 32, 6.0, floor, ml_dtypes.float4_e2m1fn))


def test_fp4_tie_table():
    """Spec §4 ties: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (block scale 1 via the 6)."""
    v = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0] + [0.0] * 22)
    got = fp4_e2m1_roundtrip(v, 32)[:10].tolist()
    assert got == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0]


def test_pow2_ceil_exact():
    y = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0000001, 0.9999999, 2.0**-130, 448.0 / 448.0, 7e-38])
    want = [2.0 ** math.ceil(math.log2(float(v))) for v in y.double()]
    assert pow2_ceil(y).double().tolist() == want


def test_hadamard_vs_sylvester_matrix():
    h = np.array([[1.0]])
    while h.shape[0] < 128:
        h = np.block([[h, h], [h, -h]])
    x = np.random.default_rng(2).standard_normal((5, 128))
    got = hadamard(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, x @ h.T / math.sqrt(128), rtol=1e-12, atol=1e-12)
    # orthonormal: applying it twice is the identity
    np.testing.assert_allclose(hadamard(hadamard(torch.from_numpy(x))).numpy(), x, atol=1e-12)


def test_sinkhorn_properties():
    logits = torch.randn(64, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    c = sinkhorn(logits, 20, 1e-6)
    assert (c > 0).all()
    # The last pass normalises columns: sums are 1 up to the eps in the denominator.
    assert_close(c.sum(-2), torch.ones(64, 4, dtype=torch.float64), atol=1e-5, rtol=0)
    assert_close(
        c.sum(-1), torch.ones(64, 4, dtype=torch.float64), atol=3e-2, rtol=0
    )  # rows converge more slowly
    # One iteration = row softmax (+eps) then one column normalisation.
    one = sinkhorn(logits, 1, 1e-6)
    s = logits.softmax(-1) + 1e-6
    assert_close(one, s / (s.sum(-2, keepdim=True) + 1e-6))


def test_hc_pre_post_shapes_and_orientation():
    """post/comb ranges, and X'[dst] = post[dst] * f + sum_src C[src, dst] * X[src] (not transposed)."""
    torch.manual_seed(0)
    S, d, M = 4, 8, 24
    w = HCWeights(fn=torch.randn(M, S * d), scale=torch.rand(3) + 0.5, base=torch.randn(M))
    X = torch.randn(3, S, d)
    x, post, comb = hc_pre(X, w, iters=20, rms_eps=1e-6, hc_eps=1e-6)
    assert x.shape == (3, d) and post.shape == (3, S) and comb.shape == (3, S, S)
    assert ((post > 0) & (post < 2)).all()
    f = torch.randn(3, d)
    out = hc_post(f, X, post, comb)
    dst, t = 2, 1
    want = post[t, dst] * f[t] + sum(comb[t, src, dst] * X[t, src] for src in range(S))
    assert_close(out[t, dst], want)


def test_rope_adjacent_pairs_on_tail():
    """Pair j = dims (W-R+2j, W-R+2j+1) rotates by pos * base^(-2j/R); the head dims are untouched."""
    W, R, base = 128, 64, 10000.0
    inv = rope_inv_freq(R, base)
    pos = torch.tensor([0, 7, 300])
    x = torch.randn(3, W)
    y = rope_tail(x, pos, inv)
    assert torch.equal(y[:, : W - R], x[:, : W - R])
    for j in (0, 5, 31):
        theta = pos.double() * base ** (-2 * j / R)
        a, b = x[:, W - R + 2 * j].double(), x[:, W - R + 2 * j + 1].double()
        assert_close(y[:, W - R + 2 * j].double(), a * theta.cos() - b * theta.sin(), atol=1e-4, rtol=0)
        assert_close(y[:, W - R + 2 * j + 1].double(), a * theta.sin() + b * theta.cos(), atol=1e-4, rtol=0)
    assert_close(rope_tail(y, pos, inv, inverse=True), x, atol=1e-5, rtol=0)
    # per-head form [T, H, W] rotates every head at the token's position
    xh = torch.randn(3, 2, W)
    assert_close(rope_tail(xh, pos, inv)[:, 1], rope_tail(xh[:, 1], pos, inv))


def test_yarn_range_flash():
    assert yarn_pair_range(64, 160000.0, 65536, 32.0, 1.0) == (15, 25)


def test_yarn_frequencies_flash():
    """Pairs 0..15 keep base^(-2j/64), 25..31 are divided by 16, 16..24 blend with ramp 0.9 .. 0.1."""
    inv = layer_inv_freq(FLASH, 2).double()
    plain = 160000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    keep = torch.clamp(1 - (torch.arange(32, dtype=torch.float64) - 15) / 10, 0, 1)
    assert_close(inv, plain * keep + plain / 16 * (1 - keep), rtol=1e-6, atol=0)
    assert keep[16] == pytest.approx(0.9) and keep[24] == pytest.approx(0.1)
    # dense layers: plain base 10000, no YaRN
    assert_close(
        layer_inv_freq(FLASH, 0).double(),
        10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64),
        rtol=1e-6,
        atol=0,
    )
