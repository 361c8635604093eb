"""Fused decode kernels (ds4/kernels/fused.py) against the CPU reference math (ds4.model.hc, norm, rope,
quantsim, moe) and their torch twins (ds4/kernels/ref.py).

Tiny shapes run under Triton's interpreter (via test_kernels_interpreted.py on CPU machines); the cuda-marked
tests run the Flash shapes compiled. Legend: B rows, S streams, d width, H heads, D head dim, R RoPE dims.

FP8 (kv rows): the kernel's f32 RMS sum runs in a different order than torch's, so a pre-quantization value
can move by an ulp or two; the comparison is bit-exact on every element except those whose reference value
lies within a few ulps of an E4M3 rounding midpoint (or whose block amax / 448 lies within a few ulps of a
power of two, which can move the block scale). Those are counted and must stay rare.
"""

from __future__ import annotations

import _kernel_env  # noqa: F401  (interpreter / GPU setup; skips this module in the plain CPU run)
import pytest
import torch
from _kernel_env import DEVICE

from ds4.kernels import fused, ref
from ds4.kernels import hc as hc_kernel
from ds4.model import hc, moe
from ds4.model.attention import fp8_nope
from ds4.model.norm import rms_norm
from ds4.model.quantsim import pow2_ceil
from ds4.model.rope import rope_inv_freq, rope_tail

EPS = 1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)  # inputs made on the CPU, then moved: same values everywhere


def _hc_inputs(B: int, S: int, d: int, fn_dtype: torch.dtype, seed: int):
    g = _gen(seed)
    M = (2 + S) * S
    X = torch.randn(B, S, d, generator=g) * 2
    fn = (torch.randn(M, S * d, generator=g) * (S * d) ** -0.5).to(fn_dtype)
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(M, generator=g) * 0.5
    return X, fn, scale, base


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.cpu().double(), want.cpu().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _check_hc_pre(
    B: int, S: int, d: int, fn_dtype: torch.dtype, with_norm: bool, seed: int, deferred: bool = False
) -> None:
    """deferred: the finish kernel leaves the combine logits, ds4.kernels.hc.sinkhorn normalises them; x and
    post must be bit-equal to the in-kernel Sinkhorn's."""
    X, fn, scale, base = _hc_inputs(B, S, d, fn_dtype, seed)
    norm = torch.rand(d, generator=_gen(seed + 1)) + 0.5 if with_norm else None
    dev = [t.to(DEVICE) if t is not None else None for t in (X, fn, scale, base, norm)]
    x, post, comb = fused.hc_pre_fused(*dev[:4], 20, EPS, EPS, dev[4])
    if deferred:
        x2, post2, logits = fused.hc_pre_fused(*dev[:4], 20, EPS, EPS, dev[4], sinkhorn=False)
        assert torch.equal(x2, x) and torch.equal(post2, post) and not torch.allclose(logits, comb)
        comb = hc_kernel.sinkhorn(logits, 20, EPS)
    w = hc.HCWeights(fn.double(), scale.double(), base.double())
    xr, pr, cr = hc.hc_pre(X.double(), w, iters=20, rms_eps=EPS, hc_eps=EPS)  # f64 oracle
    if with_norm:
        xr = rms_norm(xr, norm.double(), EPS)
    assert x.shape == (B, d) and post.shape == (B, S) and comb.shape == (B, S, S)
    assert _max_rel(x, xr) < 2e-5
    assert _max_rel(post, pr) < 2e-5
    assert float((comb.cpu().double() - cr).abs().max()) < 2e-5


@pytest.mark.parametrize("B,S,d", [(1, 4, 64), (3, 3, 40), (2, 1, 200), (3, 4, 200)])
@pytest.mark.parametrize("fn_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_norm", [False, True])
def test_hc_pre_fused(B: int, S: int, d: int, fn_dtype: torch.dtype, with_norm: bool) -> None:
    _check_hc_pre(B, S, d, fn_dtype, with_norm, seed=B * 10 + S)  # rows of <= HC_FINISH_BD: one pass


@pytest.mark.parametrize("B,S,d", [(1, 4, 128), (3, 4, 40), (2, 3, 200)])
def test_hc_pre_fused_sinkhorn_deferred(monkeypatch, B: int, S: int, d: int) -> None:
    """sinkhorn=False (the decode step's comb on a side stream): logits out, the Sinkhorn kernel after."""
    _check_hc_pre(B, S, d, torch.float32, True, seed=B + 3 * d, deferred=True)
    monkeypatch.setattr(fused, "HC_FINISH_BNS", 2)  # the partial sums in several chunks (NS = 4)
    _check_hc_pre(B, S, d, torch.float16, False, seed=B + 3 * d + 1, deferred=True)


@pytest.mark.parametrize("scalar", [True, False], ids=["scalar", "tile"])
@pytest.mark.parametrize("B,d", [(1, 64), (5, 300)])
def test_hc_pre_fused_finish4(monkeypatch, scalar: bool, B: int, d: int) -> None:
    """S = 4 (Flash): the finish with scalar logits (_hc_pre_finish4) and the tile form, vs the f64 oracle."""
    monkeypatch.setattr(fused, "HC_FINISH_SCALAR", scalar)
    _check_hc_pre(B, 4, d, torch.float32, True, seed=B + d)
    _check_hc_pre(B, 4, d, torch.float16, False, seed=B + d + 1)


@pytest.mark.parametrize(
    ("bd", "d"), [(32, 200), (16, 64), (2048, 1100)], ids=["2pass", "2pass-exact", "1pass"]
)
@pytest.mark.parametrize("with_norm", [False, True])
def test_hc_pre_fused_finish_tiles(monkeypatch, bd: int, d: int, with_norm: bool) -> None:
    """The finish kernel's two row walks: chunks of HC_FINISH_BD (re-read for the norm), one tile."""
    monkeypatch.setattr(fused, "HC_FINISH_BD", bd)
    _check_hc_pre(2, 4, d, torch.float32, with_norm, seed=d + bd)


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize(
    ("B", "d", "bd"), [(1, 512, 4096), (3, 768, 4096), (2, 512, 128)], ids=["1", "3", "2pass"]
)
def test_hc_pre_fused_quant_out(monkeypatch, terms: int, B: int, d: int, bd: int) -> None:
    """quant_out: x's Q8_K planes from the finish launch (one tile; d = 768: a padded tile of 1024) or after
    it (two passes), bit-equal to quantize_q8k of the x it returns (the routed experts' input); x itself
    unchanged by asking for them."""
    monkeypatch.setattr(fused, "HC_FINISH_BD", bd)
    X, fn, scale, base = _hc_inputs(B, 4, d, torch.float16, seed=d + B)
    X[:, :, :256] *= 1e3  # blocks of very different amax
    norm = torch.rand(d, generator=_gen(d)) + 0.5
    dev = [t.to(DEVICE) for t in (X, fn, scale, base, norm)]
    q = torch.full((terms, B, d), 99, dtype=torch.int8, device=DEVICE)
    dq = torch.full((B, d // 256), -1.0, device=DEVICE)
    x, _, _ = fused.hc_pre_fused(*dev[:4], 20, EPS, EPS, dev[4], sinkhorn=False, quant_out=(q, dq))
    plain, _, _ = fused.hc_pre_fused(*dev[:4], 20, EPS, EPS, dev[4], sinkhorn=False)
    assert torch.equal(x, plain)
    wq, wd = ref.quantize_q8k(x.cpu(), terms)
    assert torch.equal(q.cpu(), wq) and torch.equal(dq.cpu(), wd)
    assert int((wq[0] != 0).sum()) > B * d // 2  # the planes hold values
    with pytest.raises(ValueError, match="quant_out must be"):
        fused.hc_pre_fused(*dev[:4], 20, EPS, EPS, dev[4], quant_out=(q[:, :, :256], dq))


@pytest.mark.parametrize(("B", "S", "d"), [(70, 3, 200), (64, 4, 64)], ids=["partial-tiles", "exact"])
def test_hc_pre_fused_row_tiles(monkeypatch, B: int, S: int, d: int) -> None:
    """The prefill mixing projection (_hc_mix_rows, from HC_ROWS_MIN rows): partial row tiles and a partial
    last K split (70 rows = 3 tiles of 32; K = 600 in 2 splits of 320), f16 fn."""
    monkeypatch.setattr(fused, "HC_ROWS_MIN", 64)
    _check_hc_pre(B, S, d, torch.float16, True, seed=B + d)
    _check_hc_pre(B, S, d, torch.float32, False, seed=B + d + 1)


@pytest.mark.parametrize(("B", "S", "d", "parts"), [(1, 4, 256, 0), (2, 3, 200, 2), (3, 4, 128, 1)])
def test_hc_post_mix(monkeypatch, B: int, S: int, d: int, parts: int) -> None:
    """hc_post_mix: X' bit-equal to hc_post_fused's; the next site's partials as ref.mix_partials makes them
    (d = 200: a partial last block); hc_pre_fused from them = from X' itself (also past HC_ROWS_MIN rows,
    where hc_pre_fused would take the row-tile projection)."""
    monkeypatch.setattr(fused, "HC_ROWS_MIN", 2)
    g = _gen(B + d)
    f, X = torch.randn(B, d, generator=g), torch.randn(B, S, d, generator=g)
    post, comb = torch.rand(B, S, generator=g), torch.rand(B, S, S, generator=g)
    k = torch.randn(B, parts, d, generator=g) if parts else None
    _, fn, scale, base = _hc_inputs(B, S, d, torch.float16, seed=d)
    dev = [t.to(DEVICE) if t is not None else None for t in (f, X, post, comb, k, fn, scale, base)]
    out, (pmix, pss) = fused.hc_post_mix(*dev[:6])
    assert torch.equal(out, fused.hc_post_fused(*dev[:5]))
    want_mix, want_ss = ref.mix_partials(out.cpu(), fn, fused.HC_CHUNK, pmix.shape[2])
    assert _max_rel(pmix, want_mix) < 1e-5 and _max_rel(pss, want_ss) < 1e-5
    norm = (torch.rand(d, generator=g) + 0.5).to(DEVICE)
    got = fused.hc_pre_fused(out, *dev[5:], 20, EPS, EPS, norm, mix=(pmix, pss))
    want = fused.hc_pre_fused(out, *dev[5:], 20, EPS, EPS, norm)
    for a, b in zip(got, want, strict=True):
        assert _max_rel(a, b) < 1e-5


def test_hc_pre_twin_matches_reference() -> None:
    X, fn, scale, base = _hc_inputs(2, 4, 48, torch.float32, 7)
    got = ref.hc_pre_fused(X, fn, scale, base, 20, EPS, EPS)
    want = hc.hc_pre(X, hc.HCWeights(fn, scale, base), iters=20, rms_eps=EPS, hc_eps=EPS)
    for a, b in zip(got, want, strict=True):
        assert _max_rel(a, b) < 1e-5


def _head_inputs(B: int, S: int, d: int, fn_dtype: torch.dtype, seed: int):
    """The output head's HC weights (fn [S, S*d], one scale, base [S]) and norm, fresh random."""
    g = _gen(seed)
    X = torch.randn(B, S, d, generator=g) * 2
    fn = (torch.randn(S, S * d, generator=g) * (S * d) ** -0.5).to(fn_dtype)
    scale, base = torch.rand(1, generator=g) + 0.5, torch.randn(S, generator=g) * 0.5
    return X, fn, scale, base, torch.rand(d, generator=g) + 0.5


@pytest.mark.parametrize(
    ("B", "S", "d", "bd", "rows_min"),
    [(1, 4, 64, 4096, 64), (3, 3, 200, 4096, 64), (2, 4, 200, 32, 64), (70, 4, 64, 4096, 64)],
    ids=["1", "3-streams", "2pass", "row-tiles"],
)
@pytest.mark.parametrize("fn_dtype", [torch.float32, torch.float16])
def test_hc_head_fused(monkeypatch, B: int, S: int, d: int, bd: int, rows_min: int, fn_dtype) -> None:
    """The output head's collapse + output norm against the f64 model math (hc_head, then rms_norm): one
    tile, a chunked row (two passes), the row-tile mixing projection (70 rows); and its torch twin."""
    monkeypatch.setattr(fused, "HC_FINISH_BD", bd)
    monkeypatch.setattr(fused, "HC_ROWS_MIN", rows_min)
    X, fn, scale, base, norm = _head_inputs(B, S, d, fn_dtype, seed=B + S + d + bd)
    got = fused.hc_head_fused(*(t.to(DEVICE) for t in (X, fn, scale, base, norm)), EPS, EPS)
    w = hc.HCWeights(fn.double(), scale.double(), base.double())
    want = rms_norm(hc.hc_head(X.double(), w, rms_eps=EPS, hc_eps=EPS), norm.double(), EPS)
    assert got.shape == (B, d) and got.dtype == torch.float32
    assert _max_rel(got, want) < 2e-5
    assert _max_rel(ref.hc_head_fused(X, fn, scale, base, norm, EPS, EPS), want) < 2e-5
    # the head weights matter: another base moves the output (the test can fail)
    moved = fused.hc_head_fused(*(t.to(DEVICE) for t in (X, fn, scale, base + 1.0, norm)), EPS, EPS)
    assert _max_rel(moved, want) > 1e-3


@pytest.mark.parametrize("B,S,d", [(1, 4, 64), (3, 3, 1100)])
def test_hc_post_fused(B: int, S: int, d: int) -> None:
    g = _gen(d)
    f, X = torch.randn(B, d, generator=g), torch.randn(B, S, d, generator=g)
    post, comb = torch.rand(B, S, generator=g) * 2, torch.rand(B, S, S, generator=g)
    got = fused.hc_post_fused(*(t.to(DEVICE) for t in (f, X, post, comb)))
    want = hc.hc_post(f.double(), X.double(), post.double(), comb.double())
    assert got.shape == (B, S, d) and _max_rel(got, want) < 1e-6
    assert _max_rel(ref.hc_post_fused(f, X, post, comb), want) < 1e-6


@pytest.mark.parametrize("B,k,d", [(1, 6, 64), (3, 1, 1100), (2, 4, 200)])
def test_hc_post_fused_with_parts(B: int, k: int, d: int) -> None:
    """The routed experts' per-slot outputs folded in: the sublayer output is sum_j parts[:, j] + f."""
    g = _gen(d + k)
    f, X, parts = (
        torch.randn(B, d, generator=g),
        torch.randn(B, 4, d, generator=g),
        torch.randn(B, k, d, generator=g),
    )
    post, comb = torch.rand(B, 4, generator=g) * 2, torch.rand(B, 4, 4, generator=g)
    got = fused.hc_post_fused(*(t.to(DEVICE) for t in (f, X, post, comb, parts)))
    want = hc.hc_post(parts.double().sum(1) + f.double(), X.double(), post.double(), comb.double())
    assert _max_rel(got, want) < 1e-6
    assert _max_rel(ref.hc_post_fused(f, X, post, comb, parts), want) < 1e-6
    with pytest.raises(ValueError, match="parts must be"):
        fused.hc_post_fused(f, X, post, comb, parts[:, :, :-1])


def _positions(B: int, seed: int) -> torch.Tensor:
    return torch.cat([torch.tensor([0, 1, 65535]), torch.randint(0, 1 << 20, (B,), generator=_gen(seed))])[:B]


@pytest.mark.parametrize("B,H,D,R", [(3, 4, 192, 64), (2, 3, 200, 8)])
def test_q_norm_rope(B: int, H: int, D: int, R: int) -> None:
    q = torch.randn(B, H, D, generator=_gen(D)) * 3
    pos, inv = _positions(B, D), rope_inv_freq(R, 10000.0, orig_ctx=4096, factor=16.0)
    got = fused.q_norm_rope(q.to(DEVICE), pos.to(DEVICE), inv.to(DEVICE), EPS)
    want = rope_tail(rms_norm(q, None, EPS), pos, inv)
    # f32 angles pos * inv_freq are the same; cos/sin of large angles may differ by an ulp of the angle
    assert got.shape == (B, H, D) and _max_rel(got, want) < 2e-5
    assert _max_rel(ref.q_norm_rope(q, pos, inv, EPS), want) < 2e-5


def test_q_norm_rope_bf16_input() -> None:
    """Prefill feeds the bf16 GEMM output straight in: widened on load, the same as the f32 copy."""
    B, H, D, R = 3, 4, 192, 64
    q = (torch.randn(B, H, D, generator=_gen(9)) * 3).bfloat16()
    pos, inv = _positions(B, 9), rope_inv_freq(R, 10000.0)
    got = fused.q_norm_rope(q.to(DEVICE), pos.to(DEVICE), inv.to(DEVICE), EPS)
    assert got.dtype == torch.float32
    assert _max_rel(got, rope_tail(rms_norm(q.float(), None, EPS), pos, inv)) < 2e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,D,R", [(3, 4, 192, 64), (2, 3, 200, 8)])
def test_o_unrope(B: int, H: int, D: int, R: int, dtype: torch.dtype) -> None:
    """The inverse rotation of the tail, in the GEMM's dtype; the other dims only cast."""
    o = torch.randn(B, H, D, generator=_gen(D + 1)) * 3
    pos, inv = _positions(B, D + 1), rope_inv_freq(R, 10000.0, orig_ctx=4096, factor=16.0)
    got = fused.o_unrope(o.to(DEVICE), pos.to(DEVICE), inv.to(DEVICE), dtype).cpu()
    want = rope_tail(o, pos, inv, inverse=True)  # f32 angles pos * inv_freq, as the model rounds them
    assert got.shape == (B, H, D) and got.dtype == dtype
    assert torch.equal(got[..., :-R], o[..., :-R].to(dtype))
    tol = 2e-5 if dtype == torch.float32 else 2**-8  # one bf16 rounding of each value
    assert _max_rel(got[..., -R:], want[..., -R:]) < tol
    assert _max_rel(ref.o_unrope(o, pos, inv, dtype)[..., -R:], want[..., -R:]) < tol
    back = rope_tail(got.float(), pos, inv)  # rotating forward again restores o
    assert _max_rel(back, o.double()) < tol


def test_bf16_store_rounds_to_nearest_even() -> None:
    """A store of f32 values into a bf16 tensor rounds as torch does (RNE, carries into the exponent, NaN
    kept): compiled, and under the interpreter with ds4.kernels' fix (it truncated o_unrope's bf16 output)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _store(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < N), mask=i < N)

    x = torch.cat([torch.randn(500, generator=_gen(3)) * 10, torch.tensor([1.9973328, -0.1247706, 7.9934378,
                   float("nan"), float("inf"), 0.0, -0.0, 3.0e38])])  # fmt: skip
    out = torch.empty(x.numel(), dtype=torch.bfloat16, device=DEVICE)
    _store[(1,)](x.to(DEVICE), out, x.numel(), BLOCK=1024)
    want = x.bfloat16()
    got = out.cpu()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


def _midpoint_risk(y: torch.Tensor, block: int = 64, rel: float = 4e-6) -> torch.Tensor:
    """Mask [B, n] of reference pre-quantization values whose FP8 rounding an ulp-level change could flip."""
    yb = y.double().unflatten(-1, (-1, block))
    amax = yb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = pow2_ceil((amax / 448.0).float()).double()
    ratio = amax / 448.0 / scale  # in (0.5, 1]: near either end the scale itself may flip
    risky_block = (ratio > 1 - rel) | (ratio < 0.5 * (1 + rel))
    v = yb.abs() / scale
    _, e = torch.frexp(v)
    step = torch.exp2((torch.clamp(e - 1, min=-6) - 3).double())
    u = v / step
    risky = (u - u.floor() - 0.5).abs() <= rel * u + 1e-12
    return (risky | risky_block).flatten(-2)


@pytest.mark.parametrize("B,D,R", [(4, 192, 64), (2, 136, 8)])
def test_kv_norm_rope_fp8(B: int, D: int, R: int) -> None:
    g = _gen(B * D)
    # a wide dynamic range inside each 64-block exercises the E4M3 subnormals and every binade
    kv = torch.randn(B, D, generator=g) * torch.exp2(torch.rand(B, D, generator=g) * -14)
    weight = torch.rand(D, generator=g) + 0.5
    pos, inv = _positions(B, D), rope_inv_freq(R, 10000.0)
    got = fused.kv_norm_rope_fp8(*(t.to(DEVICE) for t in (kv, weight, pos, inv)), EPS).cpu()
    pre = rope_tail(rms_norm(kv, weight, EPS), pos, inv)  # reference pre-quantization values
    want = fp8_nope(pre, R)
    assert _max_rel(got[:, -R:], want[:, -R:]) < 2e-5
    risky = _midpoint_risk(pre[:, :-R])
    same = got[:, :-R] == want[:, :-R]
    assert bool((same | risky).all()), f"{int((~same & ~risky).sum())} FP8 values differ away from midpoints"
    assert int(risky.sum()) <= max(1, risky.numel() // 100), f"{int(risky.sum())} near-midpoint values"
    assert bool((ref.kv_norm_rope_fp8(kv, weight, pos, inv, EPS)[:, :-R] == want[:, :-R]).all())


def test_kv_norm_rope_fp8_into_rows() -> None:
    """out / rows: row b lands in out[rows[b]] (the raw KV ring), bit-equal to the plain call; other rows of
    out keep their contents; mismatched arguments are refused."""
    B, D, R = 3, 192, 64
    g = _gen(77)
    kv, weight = torch.randn(B, D, generator=g), torch.rand(D, generator=g) + 0.5
    pos, inv = _positions(B, 78), rope_inv_freq(R, 10000.0)
    dev = [t.to(DEVICE) for t in (kv, weight, pos, inv)]
    plain = fused.kv_norm_rope_fp8(*dev, EPS)
    ring = torch.full((7, D), 5.0, device=DEVICE)
    rows = torch.tensor([4, 0, 6], device=DEVICE)
    got = fused.kv_norm_rope_fp8(*dev, EPS, ring, rows)
    assert got is ring
    assert torch.equal(ring[rows], plain)
    keep = [1, 2, 3, 5]
    assert bool((ring[keep] == 5.0).all())
    with pytest.raises(ValueError, match="out and rows go together"):
        fused.kv_norm_rope_fp8(*dev, EPS, ring)
    with pytest.raises(ValueError, match="rows must be"):
        fused.kv_norm_rope_fp8(*dev, EPS, ring, rows[:2])


@pytest.mark.parametrize("B", [1, 3])
def test_qa_kv_norm_rope_fp8(B: int) -> None:
    """The q_a norm in the kv row's launch: qa and kv as column slices of one [B, Dq + D] buffer (the merged
    q_a + kv matvec's output); the ring rows bit-equal to kv_norm_rope_fp8 alone, qn within f32 rounding of
    rms_norm's float64 value."""
    Dq, D, R = 96, 192, 64
    g = _gen(90 + B)
    both = torch.randn(B, Dq + D, generator=g) * 3.0
    qw, kvw = torch.rand(Dq, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
    pos, inv = _positions(B, 91), rope_inv_freq(R, 10000.0)
    both_d, qw_d, kvw_d, pos_d, inv_d = (t.to(DEVICE) for t in (both, qw, kvw, pos, inv))
    qa, kv = both_d.split([Dq, D], dim=1)
    rows = torch.tensor([5, 1, 3][:B], device=DEVICE)
    ring = torch.full((6, D), 7.0, device=DEVICE)
    qn, out = fused.qa_kv_norm_rope_fp8(qa, qw_d, kv, kvw_d, pos_d, inv_d, EPS, ring, rows)
    assert out is ring and qn.shape == (B, Dq) and qn.dtype == torch.float32
    assert torch.equal(ring[rows], fused.kv_norm_rope_fp8(kv.contiguous(), kvw_d, pos_d, inv_d, EPS))
    want = rms_norm(both[:, :Dq].double(), qw.double(), EPS)
    assert _max_rel(qn.cpu(), want) < 1e-6
    twin, _ = ref.qa_kv_norm_rope_fp8(
        both[:, :Dq], qw, both[:, Dq:], kvw, pos, inv, EPS, ring.cpu(), rows.cpu()
    )
    assert _max_rel(twin, want) < 1e-6
    with pytest.raises(ValueError, match="qa_weight must have"):
        fused.qa_kv_norm_rope_fp8(qa, qw_d[1:], kv, kvw_d, pos_d, inv_d, EPS, ring, rows)


# (value after the scale, its E4M3 round-to-nearest-even result): ties go to the even mantissa, subnormals
# step 2^-9, the subnormal/normal and binade boundaries round up into the next binade, 448 is the top value.
FP8_TIES = [
    (1.0625, 1.0), (1.1875, 1.25), (2.0**-10, 0.0), (3 * 2.0**-10, 2.0**-8), (7.5 * 2.0**-9, 2.0**-6),
    (432.0, 448.0), (15.5, 16.0), (-1.0625, -1.0), (-3 * 2.0**-10, -(2.0**-8)), (0.0, 0.0),
    (2.0**-9, 2.0**-9), (1.0, 1.0), (440.0, 448.0), (0.3125, 0.3125), (0.34375, 0.34375), (0.359375, 0.375),
]  # fmt: skip


def test_kv_fp8_rounds_ties_to_even() -> None:
    """Exact midpoints reach the rounding step unchanged: RMS is exactly 64 (integer squares summing to
    128 * 64^2), so the row is scaled by 1/64, the amax 448 / 64 = 7 gives the block scale 1/64, and the
    weights carry the values to round. Expected results are the hand-written table above."""
    D, R = 128, 64
    vals = torch.tensor([v for v, _ in FP8_TIES])
    want = torch.tensor([r for _, r in FP8_TIES])
    x = torch.ones(D)
    x[0] = 448.0
    weight = torch.ones(D)
    weight[1 : 1 + len(FP8_TIES)] = vals
    rest = D * 64**2 - int(x[: D - R].square().sum())  # integer: squares of powers of two fill it exactly
    tail, bit = [], 0
    while rest:
        if rest >> bit & 1:
            tail += [2.0 ** (bit // 2)] * (1 if bit % 2 == 0 else 2)
            rest -= 1 << bit
        bit += 1
    assert len(tail) <= R
    x[D - R :] = 0.0
    x[D - R : D - R + len(tail)] = torch.tensor(tail)
    assert float(x.square().sum()) == D * 64**2
    pos, inv = torch.zeros(1, dtype=torch.long), rope_inv_freq(R, 10000.0)
    got = fused.kv_norm_rope_fp8(*(t.to(DEVICE) for t in (x[None], weight, pos, inv)), 0.0).cpu()[0]
    assert float(got[0]) == 7.0
    assert torch.equal(got[1 : 1 + len(FP8_TIES)] * 64, want), (got[1 : 1 + len(FP8_TIES)] * 64).tolist()
    assert torch.equal(got[: D - R], fp8_nope(rms_norm(x[None], weight, 0.0), R)[0, : D - R])


def _route_ref(logits: torch.Tensor, bias: torch.Tensor | None, k: int, scale: float):
    E = logits.shape[1]
    w = moe.MoEWeights(torch.eye(E, dtype=logits.dtype), bias, None, *([None] * 6))
    weights, ids = moe.route(w, logits, torch.zeros(logits.shape[0], dtype=torch.long), k, scale, True)
    return ids, weights


@pytest.mark.parametrize("B,E,k", [(5, 40, 6), (2, 256, 6), (3, 8, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_router_topk(B: int, E: int, k: int, with_bias: bool) -> None:
    g = _gen(E + k)
    logits = torch.randn(B, E, generator=g) * 4
    bias = torch.randn(E, generator=g) * 0.2 if with_bias else None
    ids, w = fused.router_topk(logits.to(DEVICE), bias.to(DEVICE) if with_bias else None, k, 2.5)
    want_ids, want_w = _route_ref(logits.double(), bias.double() if with_bias else None, k, 2.5)
    # rows whose k-th and (k+1)-th selection scores are within float noise have no well-defined top-k
    sel = torch.nn.functional.softplus(logits.double()).sqrt() + (bias.double() if with_bias else 0)
    top = sel.sort(-1, descending=True).values
    clear = (top[:, k - 1] - top[:, k]).abs() > 1e-5 if k < E else torch.ones(B, dtype=torch.bool)
    assert ids.dtype == torch.int32 and ids.shape == (B, k) and int(clear.sum()) >= B - 1
    assert torch.equal(ids.cpu().long()[clear], want_ids[clear])
    assert _max_rel(w[clear], want_w[clear]) < 1e-5
    tw_ids, tw_w = ref.router_topk(logits, bias, k, 2.5)
    assert torch.equal(tw_ids.long()[clear], want_ids[clear]) and _max_rel(tw_w[clear], want_w[clear]) < 1e-5


@pytest.mark.parametrize(("B", "E", "k", "V"), [(1, 16, 6, 50), (5, 256, 6, 300), (2, 8, 1, 9)])
@pytest.mark.parametrize("normalize", [True, False])
def test_router_hash(B: int, E: int, k: int, V: int, normalize: bool) -> None:
    """A hash layer's routing (ids from tid2eid[token]) against the model's moe.route in f64, and its twin."""
    g = _gen(E + V)
    logits = torch.randn(B, E, generator=g) * 4
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)])  # [V, k] long
    tokens = torch.randint(0, V, (B,), generator=g)
    ids, w = fused.router_hash(logits.to(DEVICE), tid2eid.to(DEVICE), tokens.to(DEVICE), 2.5, normalize)
    mw = moe.MoEWeights(torch.eye(E, dtype=torch.float64), None, tid2eid, *([None] * 6))
    want_w, want_ids = moe.route(mw, logits.double(), tokens, k, 2.5, normalize)
    assert ids.dtype == torch.int32 and ids.shape == (B, k) and w.shape == (B, k)
    assert torch.equal(ids.cpu().long(), want_ids)
    assert _max_rel(w, want_w) < 1e-5
    tw_ids, tw_w = ref.router_hash(logits, tid2eid, tokens, 2.5, normalize)
    assert torch.equal(tw_ids.long(), want_ids) and _max_rel(tw_w, want_w) < 1e-5


def test_router_ties_pick_lower_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, -1.0, 2.0, 0.0]])
    ids, w = fused.router_topk(logits.to(DEVICE), None, 4, 1.0)
    want_ids, want_w = _route_ref(logits.double(), None, 4, 1.0)
    assert ids.cpu().long().tolist() == want_ids.tolist() == [[1, 3, 4, 2]]
    assert _max_rel(w, want_w) < 1e-6


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match="fn must be"):
        fused.hc_pre_fused(
            torch.zeros(1, 4, 8), torch.zeros(24, 16), torch.ones(3), torch.zeros(24), 3, EPS, EPS
        )
    with pytest.raises(ValueError, match="k must be"):
        fused.router_topk(torch.zeros(1, 4), None, 5, 1.0)
    with pytest.raises(ValueError, match="fn must be"):
        fused.hc_head_fused(
            torch.zeros(1, 4, 8), torch.zeros(24, 32), torch.ones(1), torch.zeros(4), torch.ones(8), EPS, EPS
        )
    with pytest.raises(ValueError, match="tokens expected"):
        fused.router_hash(torch.zeros(2, 8), torch.zeros(5, 3, dtype=torch.long), torch.zeros(3), 1.0)
    with pytest.raises(ValueError, match="nope width"):
        fused.kv_norm_rope_fp8(
            torch.zeros(1, 100), torch.ones(100), torch.zeros(1), rope_inv_freq(8, 1e4), EPS
        )


def _joined(out):
    """hc_pre_branch's (xn, post, Branch) with the branch joined."""
    return out[0], out[1], out[2].join()


def test_decode_wiring_matches_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """ds4.model.cuda decode helpers give the same results through the kernels (TRITON_FUSED) as through
    their torch path: checks the wiring's argument plumbing (norm weight, pos, n_rot, ids dtype)."""
    from types import SimpleNamespace

    from ds4.model.cuda import fused as dec
    from ds4.model.cuda import layer

    S, d, H, D, R, E = 4, 64, 2, 192, 64, 16
    X, fn, scale, base = (t.to(DEVICE) for t in _hc_inputs(1, S, d, torch.float32, 3))
    g = _gen(5)
    norm, f, q, kv, kvw = (
        torch.randn(*s, generator=g).to(DEVICE) for s in ((d,), (1, d), (1, H, D), (1, D), (D,))
    )
    pos, inv = torch.tensor([77], device=DEVICE), rope_inv_freq(R, 10000.0).to(DEVICE)
    router = SimpleNamespace(
        gate_inp=torch.randn(E, d, generator=g).to(DEVICE),
        bias=torch.randn(E, generator=g).to(DEVICE),
        tid2eid=None,
    )
    # a hash layer (its ids from tid2eid[token]) and the output head's HC weights
    hashed = SimpleNamespace(
        gate_inp=router.gate_inp, bias=None, tid2eid=torch.randint(0, E, (9, 3), generator=g)
    )
    hashed.tid2eid, token = hashed.tid2eid.to(DEVICE), torch.tensor([4], device=DEVICE)
    head = hc.HCWeights(*(t.to(DEVICE) for t in _head_inputs(1, S, d, torch.float32, 8)[1:4]))
    calls = [
        lambda: dec.hc_pre_norm(X, fn, scale, base, norm, 20, EPS, EPS),
        lambda: _joined(dec.hc_pre_branch(X, fn, scale, base, norm, 20, EPS, EPS)),
        lambda: dec.hc_post(f, X, torch.rand(1, S, device=DEVICE), torch.rand(1, S, S, device=DEVICE)),
        lambda: dec.q_post(q, pos, inv, EPS),
        lambda: dec.o_post(q, pos, inv, torch.float32),
        lambda: dec.kv_post(kv, kvw, pos, inv, EPS, R),
        lambda: layer.route_decode(router, f, None, 3, 2.5, True),
        lambda: layer.route_decode(hashed, f, token, 3, 2.5, True),
        lambda: dec.head_norm(X, head, norm, EPS, EPS),
    ]
    for call in calls:
        torch.manual_seed(0)
        monkeypatch.setattr(dec, "TRITON_FUSED", True)
        monkeypatch.setattr(dec, "TAIL_FUSED", True)
        new = call()
        torch.manual_seed(0)
        monkeypatch.setattr(dec, "TRITON_FUSED", False)
        monkeypatch.setattr(dec, "TAIL_FUSED", False)
        old = call()
        new, old = (new, old) if isinstance(new, tuple) else ((new,), (old,))
        for a, b in zip(new, old, strict=True):
            assert a.shape == b.shape and _max_rel(a, b) < 2e-5


# ---------------------------------------------------------------------------------------------------------
# DeepSeek V4 Flash shapes, compiled (GPU only).


@pytest.mark.cuda
@pytest.mark.parametrize("B", [1, 4])
def test_flash_shapes_cuda(B: int) -> None:
    for fn_dtype in (torch.float32, torch.float16):
        _check_hc_pre(B, 4, 4096, fn_dtype, True, seed=B)
    test_hc_post_fused(B, 4, 4096)
    q = torch.randn(B, 64, 512, generator=_gen(B))
    pos, inv = _positions(B, B), rope_inv_freq(64, 160000.0, orig_ctx=65536, factor=16.0)
    got = fused.q_norm_rope(q.to(DEVICE), pos.to(DEVICE), inv.to(DEVICE), EPS)
    assert _max_rel(got, rope_tail(rms_norm(q, None, EPS), pos, inv)) < 2e-5
    test_o_unrope(B, 64, 512, 64, torch.bfloat16)
    test_kv_norm_rope_fp8(B, 512, 64)
    test_router_topk(B, 256, 6, True)
    test_router_hash(B, 256, 6, 129280, True)
    X, fn, scale, base, norm = _head_inputs(B, 4, 4096, torch.float32, seed=B)
    got = fused.hc_head_fused(*(t.to(DEVICE) for t in (X, fn, scale, base, norm)), EPS, EPS)
    w = hc.HCWeights(fn.double(), scale.double(), base.double())
    want = rms_norm(hc.hc_head(X.double(), w, rms_eps=EPS, hc_eps=EPS), norm.double(), EPS)
    assert _max_rel(got, want) < 2e-5
