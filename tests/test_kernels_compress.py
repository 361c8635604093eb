"""The compressor decode kernel (ds4/kernels/compress.py) against the CPU reference compressor
(ds4.model.attention.compressed_rows: the chunk algorithm, run on one token) and the kernel's torch twin.

Tiny shapes run under Triton's interpreter (via test_kernels_interpreted.py on CPU machines); the cuda-marked
test runs the Flash shapes compiled. Legend: B rows, S pool slots, r ratio, c = 2 iff r == 4, h row width,
cap row capacity, R RoPE dims.

Frontier updates are copies (and the f32 score + ape add), so they must be bit-exact. Finished rows: the RoPE
tail is float (tolerance); the quantized part (FP8 nope dims, or FP4 after the Hadamard for the indexer) must
be bit-exact except where float32 summation order (pooling, RMS) moves a value across a rounding midpoint:
those are few, and each may differ by one quantization step only (the note in tests/test_kernels_fused.py).
"""

from __future__ import annotations

import _kernel_env  # noqa: F401  (interpreter / GPU setup; skips this module in the plain CPU run)
import pytest
import torch
from _kernel_env import DEVICE

from ds4.kernels import compress, ref
from ds4.model.attention import CompressorWeights, compressed_rows
from ds4.model.rope import rope_inv_freq
from ds4.model.state import EMPTY_SCORE

EPS = 1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)  # inputs made on the CPU, then moved: same values everywhere


def _frontiers(S: int, r: int, c: int, h: int, pos: torch.Tensor, slot: torch.Tensor, g) -> tuple:
    """Random frontiers [S, c r, c h] in the state the model keeps them: the current window's rows at and
    after each row's token slot are empty (kv 0, score EMPTY_SCORE); previous-window rows are full."""
    fk = torch.randn(S, c * r, c * h, generator=g)
    fs = torch.randn(S, c * r, c * h, generator=g) * 3
    for s in range(S):
        hits = (slot == s).nonzero().flatten().tolist()
        m = int(pos[hits[0]]) % r if hits else int(torch.randint(0, r, (1,), generator=g))
        cur = r if c == 2 else 0
        fk[s, cur + m :], fs[s, cur + m :] = 0.0, EMPTY_SCORE
    return fk, fs


def _case(r: int, h: int, n_rot: int, pos: list[int], slot: list[int], S: int, cap: int, seed: int):
    c = 2 if r == 4 else 1
    g = _gen(seed)
    B = len(pos)
    pos_t, slot_t = torch.tensor(pos), torch.tensor(slot)
    kv_new = torch.randn(B, c * h, generator=g)
    score_new = torch.randn(B, c * h, generator=g) * 2
    ape = torch.randn(r, c * h, generator=g)
    fk, fs = _frontiers(S, r, c, h, pos_t, slot_t, g)
    rows = torch.randn(S, cap, h, generator=g)
    norm = torch.rand(h, generator=g) + 0.5
    inv = rope_inv_freq(n_rot, 160000.0, orig_ctx=4096, factor=16.0)
    return kv_new, score_new, ape, fk, fs, rows, slot_t, pos_t, norm, inv


def _run(fn, args, n_rot: int, indexer: bool, device) -> list[torch.Tensor]:
    """fn on copies of the inputs on `device` -> the updated [fk, fs, rows] on the CPU."""
    kv_new, score_new, ape, fk, fs, rows, slot, pos, norm, inv = (t.clone().to(device) for t in args)
    both = torch.cat([score_new, kv_new], dim=1)  # column slices of one matvec output, as the model passes
    score_new, kv_new = both[:, : score_new.shape[1]], both[:, score_new.shape[1] :]
    fn(kv_new, score_new, ape, fk, fs, rows, slot, pos, norm, inv, EPS, n_rot, indexer)
    return [t.cpu() for t in (fk, fs, rows)]


def _reference(args, n_rot: int, indexer: bool) -> list[torch.Tensor]:
    """The CPU reference compressor (ds4.model.attention) fed each row's token alone, slot by slot; the
    projections are identities on xn = [kv_new | score_new] so they pass the inputs through exactly."""
    kv_new, score_new, ape, fk, fs, rows, slot, pos, norm, inv = (t.clone() for t in args)
    B, ch = kv_new.shape
    h = rows.shape[2]
    eye, zero = torch.eye(ch), torch.zeros(ch, ch)
    w = CompressorWeights(ape=ape, kv=torch.cat([eye, zero], 1), gate=torch.cat([zero, eye], 1), norm=norm)
    r = ape.shape[0]
    for b in range(B):
        s, p = int(slot[b]), int(pos[b])
        xn = torch.cat([kv_new[b], score_new[b]])[None]
        out = compressed_rows(w, xn, p, r, fk[s], fs[s], inv, EPS, indexer=indexer)  # frontier in place
        if out.shape[0]:
            rows[s, min(p // r, rows.shape[1] - 1)] = out[0, :h]
    return [fk, fs, rows]


def _step(values: torch.Tensor, block: int, top: float, levels: int) -> torch.Tensor:
    """One quantization step at each of `values` [..., n] (blocks of `block`, power-of-two scale from the
    block amax / top, `levels` mantissa bits): an upper bound on a midpoint flip's size."""
    vb = values.double().unflatten(-1, (-1, block))
    amax = vb.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / top)))
    _, e = torch.frexp(vb.abs() / scale)
    return (torch.exp2((e - 1 - levels).clamp_min(-9).double()) * scale * 2).flatten(-2)


def _check_rows(got: torch.Tensor, want: torch.Tensor, n_rot: int, indexer: bool, label: str) -> None:
    """Finished rows [n, h]: the quantized part exact but for rare one-step midpoint flips, the tail close."""
    if indexer:
        quant_got, quant_want = got, want
        step = _step(want, 32, 6.0, 1)
    else:
        assert torch.allclose(got[:, -n_rot:], want[:, -n_rot:], rtol=1e-5, atol=1e-5), label
        quant_got, quant_want = got[:, :-n_rot], want[:, :-n_rot]
        step = _step(quant_want, 64, 448.0, 3)
    diff = (quant_got.double() - quant_want.double()).abs()
    flips = diff > 0
    assert bool((diff[flips] <= step[flips] * 1.001).all()), f"{label}: a quantized value moved by > 1 step"
    assert int(flips.sum()) <= max(2, flips.numel() // 200), (
        f"{label}: {int(flips.sum())} quantized values differ"
    )


def _check_against(got: list[torch.Tensor], want: list[torch.Tensor], args, n_rot, indexer, label, skip=()):
    fk, fs, rows = got
    slots = [s for s in range(fk.shape[0]) if s not in skip]
    assert torch.equal(fk[slots], want[0][slots]), f"{label}: frontier kv"
    assert torch.equal(fs[slots], want[1][slots]), f"{label}: frontier scores"
    slot, pos = args[6], args[7]
    r = args[2].shape[0]
    done = [(int(s), min(int(p) // r, rows.shape[1] - 1)) for s, p in zip(slot, pos, strict=True)]
    done = [(s, i) for (s, i), p in zip(done, pos.tolist(), strict=True) if p % r == r - 1 and s not in skip]
    untouched = torch.ones(rows.shape[:2], dtype=torch.bool)
    for s, i in done:
        untouched[s, i] = False
    untouched[list(skip)] = False
    assert torch.equal(rows[untouched], want[2][untouched]), f"{label}: a row was written out of turn"
    if done:
        sel = tuple(zip(*done, strict=True))
        _check_rows(rows[sel], want[2][sel], n_rot, indexer, label)


# (r, h, n_rot, indexer): ratio 4 (overlapping windows) attention and indexer rows, non-overlap stand-ins
TINY = [
    (4, 128, 64, False),
    (4, 64, 64, True),
    (8, 128, 64, False),
    (16, 192, 64, False),
    (8, 32, 16, True),
    (32, 256, 64, False),  # 2 chunks of candidates (online softmax), 2 of the frontier shift
]


@pytest.mark.parametrize("r,h,n_rot,indexer", TINY)
def test_compress_decode_tiny(r: int, h: int, n_rot: int, indexer: bool) -> None:
    """B 3 distinct slots at mixed window phases (two complete a window, one at the capacity clamp) plus
    two padded rows on the scratch slot 4; slot 3 stays idle."""
    S, cap = 5, 6
    pos = [r - 1, 2 * r + 1, 100 * r + r - 1, 5, r - 1]  # slot 1: row clamped to cap - 1
    slot = [0, 2, 1, 4, 4]
    args = _case(r, h, n_rot, pos, slot, S, cap, seed=r * h + indexer)
    got = _run(compress.compress_decode, args, n_rot, indexer, DEVICE)
    twin = _run(ref.compress_decode, args, n_rot, indexer, "cpu")
    want = _reference(args, n_rot, indexer)
    label = f"r={r} h={h} indexer={indexer}"
    _check_against(got, want, args, n_rot, indexer, "kernel " + label, skip=(4,))
    _check_against(twin, want, args, n_rot, indexer, "twin " + label, skip=(4,))
    assert torch.equal(got[0][3], args[3][3]) and torch.equal(got[2][3], args[5][3]), "idle slot 3 changed"


@pytest.mark.parametrize("r,indexer", [(4, False), (4, True), (8, False)])
def test_compress_decode_sequence(r: int, indexer: bool) -> None:
    """A single state (S = 1, slot None) fed 3 windows' worth of consecutive tokens: the frontier shifts
    and the stored rows track the reference step by step."""
    h, n_rot, cap = (64 if indexer else 128), 64, 5
    args = list(_case(r, h, n_rot, [0], [0], 1, cap, seed=r + indexer))
    fk, fs = args[3], args[4]
    fk.zero_(), fs.fill_(EMPTY_SCORE)  # an empty timeline
    args[5].zero_()
    mine = [t.clone().to(DEVICE) for t in (fk, fs, args[5])]
    want = [t.clone() for t in (fk, fs, args[5])]
    c = 2 if r == 4 else 1
    g = _gen(99)
    for p in range(3 * r):
        kv_new, score_new = torch.randn(1, c * h, generator=g), torch.randn(1, c * h, generator=g) * 2
        pos = torch.tensor([p])
        step_args = (kv_new, score_new, args[2], *want, args[6], pos, args[8], args[9])
        dev = [t.to(DEVICE) for t in (kv_new, score_new, args[2])]
        compress.compress_decode(*dev, *mine, None, pos.to(DEVICE), args[8].to(DEVICE), args[9].to(DEVICE),
                                 EPS, n_rot, indexer)  # fmt: skip
        want = _reference(step_args, n_rot, indexer)
        got = [t.cpu() for t in mine]
        _check_against(got, want, step_args, n_rot, indexer, f"r={r} indexer={indexer} pos {p}")
        mine = [t.clone().to(DEVICE) for t in want]  # continue both from the reference state


def test_bad_shapes_raise() -> None:
    args = list(_case(4, 128, 64, [3], [0], 2, 4, seed=1))
    with pytest.raises(ValueError, match="ape must be"):
        compress.compress_decode(*args[:2], args[2][:3], *args[3:], EPS, 64, False)
    with pytest.raises(ValueError, match="kv_new/score_new"):
        compress.compress_decode(args[0][:, :100], *args[1:], EPS, 64, False)
    with pytest.raises(ValueError, match="slot=None"):
        compress.compress_decode(*args[:6], None, *args[7:], EPS, 64, False)
    with pytest.raises(ValueError, match="nope width"):
        compress.compress_decode(*args[:9], rope_inv_freq(48, 1e4), EPS, 48, False)
    with pytest.raises(ValueError, match="contiguous"):
        fk = args[3].transpose(1, 2).contiguous().transpose(1, 2)
        compress.compress_decode(*args[:3], fk, *args[4:], EPS, 64, False)


def test_indexer_top_rows_by_keys_equals_stable_sort() -> None:
    """The decode option DS4_INDEXER_TOPK (ds4.model.cuda.layer.top_rows_by_keys: torch.topk over unique
    keys) picks the same rows in the same order as the stable descending sort, on scores full of ties,
    -inf (invisible rows), -0.0 / +0.0, subnormals and huge values."""
    from ds4.model.cuda.layer import _top_rows, top_rows_by_keys

    g = _gen(5)
    for _ in range(50):
        n = int(torch.randint(20, 400, (1,), generator=g))
        s = torch.round(torch.randn(3, n, generator=g) * 3) / 2  # quantized: many ties
        s[torch.rand(3, n, generator=g) < 0.2] = float("-inf")
        s[torch.rand(3, n, generator=g) < 0.1] = -0.0
        s[:, :4] = torch.tensor([1e-40, -1e-40, 3.4e38, -3.4e38])
        k = int(torch.randint(1, n, (1,), generator=g))
        s = s.to(DEVICE)
        assert torch.equal(top_rows_by_keys(s, k), _top_rows(s, k))


# ---------------------------------------------------------------------------------------------------------
# DeepSeek V4 Flash shapes, compiled (GPU only).


@pytest.mark.cuda
@pytest.mark.parametrize("r,h,indexer", [(4, 512, False), (4, 128, True), (128, 512, False)])
def test_flash_shapes_cuda(r: int, h: int, indexer: bool) -> None:
    S, cap = 6, 40
    pos = [r - 1, 7 * r + 2, 37 * r + r - 1, 1000 * r + r - 1, 3, 9 * r - 1]
    slot = [0, 1, 2, 3, 5, 5]
    args = _case(r, h, 64, pos, slot, S, cap, seed=h + r)
    got = _run(compress.compress_decode, args, 64, indexer, DEVICE)
    want = _reference(args, 64, indexer)
    _check_against(got, want, args, 64, indexer, f"flash r={r} h={h}", skip=(5,))
    twin = _run(ref.compress_decode, args, 64, indexer, "cpu")
    _check_against(got, twin, args, 64, indexer, f"flash twin r={r} h={h}", skip=(5,))


def _fp4_steps(want: torch.Tensor) -> torch.Tensor:
    """The largest FP4 step of each value's 32-block: 2 * 2^ceil(log2(amax / 6)) (E2M1 spacing <= 2)."""
    from ds4.model.quantsim import pow2_ceil

    blocks = want.unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    return (2 * pow2_ceil(amax / 6.0)).expand_as(blocks).flatten(-2)


@pytest.mark.parametrize(("B", "Hi", "D", "R"), [(3, 4, 128, 64), (2, 3, 64, 16)])
def test_indexer_q(B: int, Hi: int, D: int, R: int) -> None:
    """compress.indexer_q = indexer_qat(rope_tail(qi)): bit-exact where the RoPE is the identity (pos 0);
    elsewhere cos / sin may differ by an ulp, which moves an FP4 value by at most one step, rarely."""
    from ds4.model.quantsim import indexer_qat
    from ds4.model.rope import rope_tail

    g = torch.Generator().manual_seed(D + R)
    scale = torch.exp2(torch.randint(-3, 4, (B, Hi, 1), generator=g).float())  # blocks of several binades
    qi = torch.randn(B, Hi, D, generator=g) * scale
    inv = rope_inv_freq(R, 10000.0, orig_ctx=4096, factor=16.0)
    zero = torch.zeros(B, dtype=torch.long)
    got0 = compress.indexer_q(qi.to(DEVICE), zero.to(DEVICE), inv.to(DEVICE)).cpu()
    assert got0.shape == (B, Hi, D) and torch.equal(got0, indexer_qat(qi))
    pos = torch.tensor([5, 65535, 4099])[:B]
    want = indexer_qat(rope_tail(qi, pos, inv))
    got = compress.indexer_q(qi.to(DEVICE), pos.to(DEVICE), inv.to(DEVICE)).cpu()
    off = got != want
    assert int(off.sum()) <= max(2, off.numel() // 100), f"{int(off.sum())} of {off.numel()} FP4 values moved"
    assert bool(((got - want).abs() <= _fp4_steps(want) + 1e-30).all())
    twin = ref.indexer_q(qi, pos, inv)
    assert int((twin != want).sum()) <= max(2, off.numel() // 100)
    got16 = compress.indexer_q(qi.bfloat16().to(DEVICE), zero.to(DEVICE), inv.to(DEVICE)).cpu()
    assert torch.equal(got16, indexer_qat(qi.bfloat16().float()))  # bf16 input: widened on load
    with pytest.raises(ValueError, match="power of two"):
        compress.indexer_q(qi[..., :48], pos, inv)
