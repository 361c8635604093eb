"""Pool-reading decode attention and indexer scores (ds4/kernels/attend.py) against f64 oracles.

Oracle of attend_decode: the decode path it replaces, in f64: keys and validity built the way
ds4.model.cuda.batch.attention_decode_batch builds them (raw ring of the row's slot, compressed rows gathered
by batch._gather_rows), then batch._attend. Oracle of indexer_scores: the einsum written out here in f64.
Tiny shapes run under Triton's interpreter (via test_kernels_interpreted.py on CPU machines); the cuda-marked
tests run Flash shapes compiled. Invisible rows (ring rows not yet written, compressed rows past the count,
top-k indices of such rows) hold huge values, so that any masking slip shows.

Legend: B rows, S pool slots, H heads, D head dim, W window, cap compressed rows, k top-k, P RoPE pairs.
"""

from __future__ import annotations

import _kernel_env  # noqa: F401  (interpreter / GPU setup; skips this module in the plain CPU run)
import pytest
import torch
from _kernel_env import DEVICE

from ds4.kernels import attend
from ds4.model.cuda import batch

HUGE = 2.0**66  # what invisible rows hold (finite: the f64 oracle multiplies them by exact zeros; bf16-exact)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)  # inputs made on the CPU, then moved: same values everywhere


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.cpu().double(), want.cpu().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _case(B, H, D, W, S, cap, k, ratio, P, positions, seed, *, comp=True, idx=True):
    """Random attend_decode inputs (CPU) with every invisible pool row set to HUGE. Row b uses slot b + 1
    (slot 0 is the scratch slot), except rows at position 0 beyond the first, which share slot 0 (padding)."""
    g = _gen(seed)
    pos = torch.tensor(positions, dtype=torch.long)
    slot = torch.tensor([0 if (p == 0 and b) else b + 1 for b, p in enumerate(positions)], dtype=torch.long)
    q = torch.randn(B, H, D, generator=g)
    raw = torch.randn(S, W, D, generator=g) * 2
    for b in range(B):  # ring rows not yet written
        if positions[b] < W - 1:
            raw[slot[b], positions[b] + 1 :] = HUGE
    c = ci = None
    if comp:
        c = torch.randn(S, cap, D, generator=g) * 2
        for b in range(B):
            c[slot[b], min(cap, (positions[b] + 1) // ratio) :] = HUGE
        if idx:  # distinct indices per row, often including invisible rows
            ci = torch.stack([torch.randperm(cap, generator=g)[:k] for _ in range(B)])
    sinks = torch.randn(H, generator=g)
    inv = 1.0 / (10000.0 ** (torch.arange(P, dtype=torch.float32) / P))
    return q, raw, slot, pos, c, ci, ratio if comp else 0, sinks, D**-0.5, inv


def _oracle(q, raw, slot, pos, comp, comp_idx, ratio, sinks, scale, inv):
    """attention_decode_batch's keys / validity and batch._attend, in f64 except the RoPE angles.

    inv stays f32, as the model holds it: the angle is then f32(pos) * inv rounded to f32 (long * f32 -> f32
    in rope_real), the official recipe (spec/model.md §4, RoPE). f64 angles differ from it by up to 4e-4 rad
    at pos 65535, i.e. ~2e-4 relative on the output: over the 1e-5 bound, and not what the model computes."""
    W = raw.shape[1]
    q, raw, sinks = q.double(), raw.double(), sinks.double()
    ring_pos = pos[:, None] - torch.remainder(pos[:, None] - torch.arange(W)[None, :], W)
    keys, valid = [raw.index_select(0, slot)], [ring_pos >= 0]
    if comp is not None:
        comp = comp.double()
        rows_valid = torch.arange(comp.shape[1])[None, :] < ((pos + 1) // ratio)[:, None]
        if comp_idx is None:
            keys.append(comp.index_select(0, slot))
            valid.append(rows_valid)
        else:
            keys.append(batch._gather_rows(comp, slot, comp_idx))
            valid.append(rows_valid.gather(1, comp_idx))
    return batch._attend(q, torch.cat(keys, 1), torch.cat(valid, 1), sinks, scale, pos, inv)


# attend.ATTEND_PREC "bf16x3" (split-bf16 tensor-core dots, ~2^-16 per product, the CUDA default): measured
# 2-5e-5 of the output scale on the tiny cases under the interpreter, 4-7e-6 at Flash shapes on the H200;
# bound 2e-4. The FMA dots ("ieee") stay within 1e-5.
BF16X3_TOL = 2e-4
TOL = {"ieee": 1e-5, "bf16x3": BF16X3_TOL}


def _run(args) -> torch.Tensor:
    dev = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    return attend.attend_decode(*dev)


# positions: below the window (ring partly empty), wrapped, no compressed row yet, many rows, long context
# (angles up to 1e6 rad: f32 angle rounding and the cos/sin of large arguments show)
TINY_POS = [(3, 30, 79), (0, 7, 8), (1, 2, 0), (200, 41, 5), (65535, 1048575, 40000)]


@pytest.mark.parametrize("positions", TINY_POS)
@pytest.mark.parametrize("mode", ["topk", "all", "none"])
@pytest.mark.parametrize("programs", [1, 264])  # one split of many blocks (running max) / a split per block
def test_attend_decode_tiny(positions, mode: str, programs: int, monkeypatch) -> None:
    monkeypatch.setattr(attend, "ATTEND_PROGRAMS", programs)
    monkeypatch.setattr(attend, "ATTEND_PREC", "ieee")  # bf16x3: test_attend_decode_bf16x3
    args = _case(3, 4, 64, 8, 5, 20 if mode != "all" else 52, 6, 4, 8, list(positions), seed=sum(positions),
                 comp=mode != "none", idx=mode == "topk")  # fmt: skip
    want = _oracle(*args)
    got = _run(args)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    assert _max_rel(got, want) < 1e-5
    assert _max_rel(attend.attend_decode_ref(*args), want) < 1e-5


@pytest.mark.parametrize("positions", TINY_POS)
@pytest.mark.parametrize("mode", ["topk", "all", "none"])
def test_attend_decode_bf16x3(positions, mode: str, monkeypatch) -> None:
    monkeypatch.setattr(attend, "ATTEND_PREC", "bf16x3")
    monkeypatch.setattr(attend, "ATTEND_PROGRAMS", 1)  # one split: the running max over many blocks
    args = _case(3, 4, 64, 8, 5, 20 if mode != "all" else 52, 6, 4, 8, list(positions), seed=sum(positions),
                 comp=mode != "none", idx=mode == "topk")  # fmt: skip
    got = _run(args)
    assert torch.isfinite(got).all()
    err = _max_rel(got, _oracle(*args))
    assert err < BF16X3_TOL
    assert err > 1e-7  # the split dots did run (the FMA dots land near 1e-7)


@pytest.mark.parametrize("positions", TINY_POS[:4])
def test_attend_decode_dense_key_block(positions, monkeypatch) -> None:
    """ATTEND_BN_DENSE: the layers reading every compressed row (no index) take their own keys per block;
    16 there and 32 elsewhere, both within the bf16x3 bound."""
    monkeypatch.setattr(attend, "ATTEND_PREC", "bf16x3")
    monkeypatch.setattr(attend, "ATTEND_BN", 32)
    monkeypatch.setattr(attend, "ATTEND_BN_DENSE", 16)
    assert (attend._key_block(dense=True), attend._key_block(dense=False)) == (16, 32)
    for mode in ("all", "topk"):
        args = _case(3, 4, 64, 8, 5, 52 if mode == "all" else 20, 6, 4, 8, list(positions),
                     seed=7 + sum(positions), comp=True, idx=mode == "topk")  # fmt: skip
        assert _max_rel(_run(args), _oracle(*args)) < BF16X3_TOL, mode


@pytest.mark.parametrize("positions", TINY_POS[:4])
@pytest.mark.parametrize("mode", ["topk", "all", "none"])
@pytest.mark.parametrize("programs", [1, 264])  # one split (merged alone) / many splits per head block
def test_attend_decode_fused_merge(positions, mode: str, programs: int, monkeypatch) -> None:
    """attend.FUSED_MERGE (the last split program merges) against the two-launch path: the same sums up to
    the order of the denominator's terms; run twice (the tile counters re-arm), then the counters are 0."""
    from ds4.kernels import matvec

    monkeypatch.setattr(attend, "ATTEND_PROGRAMS", programs)
    monkeypatch.setattr(attend, "ATTEND_PREC", "ieee")
    # 20 heads: a partial head block
    args = _case(3, 20, 64, 8, 5, 20 if mode != "all" else 52, 6, 4, 8, list(positions), seed=sum(positions),
                 comp=mode != "none", idx=mode == "topk")  # fmt: skip
    two = _run(args)
    monkeypatch.setattr(attend, "FUSED_MERGE", True)
    once, again = _run(args), _run(args)
    assert torch.equal(once, again)
    assert _max_rel(once, two) < 1e-6
    assert _max_rel(once, _oracle(*args)) < 1e-5
    cnt = matvec._split_counters(torch.device(DEVICE), 1)
    assert cnt is not None and not cnt.any()


@pytest.mark.parametrize("positions", TINY_POS[:4])
@pytest.mark.parametrize("ch", [4, 8])
def test_attend_decode_merge_chunks(positions, ch: int, monkeypatch) -> None:
    """attend.MERGE_CH: the merge reading several key splits a step (a split count not a multiple of it)
    gives the two-launch path's result up to f32 summation order, within the oracle's bound."""
    monkeypatch.setattr(attend, "ATTEND_PROGRAMS", 264)  # a split per key block: many splits
    monkeypatch.setattr(attend, "ATTEND_PREC", "ieee")
    args = _case(3, 4, 64, 8, 5, 100, 6, 4, 8, list(positions), seed=3 + sum(positions), comp=True, idx=False)
    assert attend._splits(3, 4, 8 + 100, attend._key_block(dense=True))[0] == 7  # 7 splits: a partial step
    one = _run(args)
    monkeypatch.setattr(attend, "MERGE_CH", ch)
    got = _run(args)
    assert _max_rel(got, one) < 1e-6
    assert _max_rel(got, _oracle(*args)) < 1e-5


@pytest.mark.parametrize("W,D,H,P", [(24, 32, 20, 4), (5, 48, 1, 24)])
def test_attend_decode_odd_shapes(W: int, D: int, H: int, P: int) -> None:
    """Window not a multiple of the key block, heads not of the head block, RoPE over the whole row."""
    args = _case(2, H, D, W, 3, 40, 9, 128 if W == 5 else 4, P, [W + 130, 2], seed=W)
    want = _oracle(*args)
    assert _max_rel(_run(args), want) < TOL[attend.ATTEND_PREC]


def test_attend_decode_masking_matters() -> None:
    """Sanity of the HUGE rows: the oracle without masks is wildly off, so the tests above can fail."""
    q, raw, slot, pos, comp, ci, ratio, sinks, scale, inv = _case(3, 4, 64, 8, 5, 20, 6, 4, 8, [3, 30, 79], 1)
    want = _oracle(q, raw, slot, pos, comp, ci, ratio, sinks, scale, inv)
    far = torch.full_like(pos, 10**6)  # everything visible
    unmasked = _oracle(q, raw, slot, far, comp, ci, ratio, sinks, scale, inv)
    assert not _max_rel(unmasked, want) < 1e-2


def test_attend_decode_padded_rows_finite() -> None:
    """Padded rows point at the scratch slot with position 0: finite output, like the oracle."""
    args = _case(4, 4, 64, 8, 3, 20, 6, 4, 8, [0, 0, 0, 0], seed=3)
    got = _run(args)
    assert torch.isfinite(got).all()
    assert _max_rel(got, _oracle(*args)) < TOL[attend.ATTEND_PREC]


def test_attend_decode_bad_input() -> None:
    q, raw, slot, pos, comp, ci, ratio, sinks, scale, inv = _case(3, 4, 64, 8, 5, 20, 6, 4, 8, [3, 30, 79], 1)
    with pytest.raises(ValueError, match="raw must be"):
        attend.attend_decode(q, raw[..., :32], slot, pos, comp, ci, ratio, sinks, scale, inv)
    with pytest.raises(ValueError, match="comp_idx given without comp"):
        attend.attend_decode(q, raw, slot, pos, None, ci, 0, sinks, scale, inv)
    with pytest.raises(ValueError, match="sinks must be"):
        attend.attend_decode(q, raw, slot, pos, comp, ci, ratio, sinks[:2], scale, inv)


# ---------------------------------------------------------------------------------------------------------
# indexer_scores


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # FP4 magnitudes (model.md §7)


def _qat_like(shape, g: torch.Generator) -> torch.Tensor:
    """Values on the indexer QAT grid: +-E2M1 magnitude x a power of two (what the model feeds the kernel)."""
    mag = E2M1[torch.randint(0, 8, shape, generator=g)]
    sign = torch.randint(0, 2, shape, generator=g) * 2.0 - 1.0
    return sign * mag * torch.exp2(torch.randint(-6, 3, shape, generator=g).float())


def _index_case(B, Hi, Di, S, cap, counts, seed, qat: bool = True):
    g = _gen(seed)
    qi = _qat_like((B, Hi, Di), g) if qat else torch.randn(B, Hi, Di, generator=g)
    wts = torch.randn(B, Hi, generator=g)
    rows = _qat_like((S, cap, Di), g) if qat else torch.randn(S, cap, Di, generator=g)
    slot = torch.arange(B) % S
    count = torch.tensor(counts, dtype=torch.long)
    for b in range(B):  # rows past the count: huge, must not leak into the visible scores
        rows[slot[b], min(cap, counts[b]) :] = HUGE
    return qi, wts, rows, slot, count


def _index_oracle(qi, wts, rows, slot, count, wscale: float = 1.0):
    per_head = torch.einsum("bhd,bcd->bhc", qi.double(), rows.double()[slot]).relu()
    score = (per_head * (wts.double() * wscale)[:, :, None]).sum(1)
    return score.masked_fill(torch.arange(rows.shape[1])[None, :] >= count[:, None], float("-inf"))


def _check_index(args, wscale: float = 1.0) -> None:
    want = _index_oracle(*args, wscale)
    got = attend.indexer_scores(*(a.to(DEVICE) for a in args), wscale).cpu()
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not torch.isnan(got).any()
    fin = torch.isfinite(want)
    if fin.any():
        assert _max_rel(got[fin], want[fin]) < 1e-5
    twin = attend.indexer_scores_ref(*args, wscale)
    assert torch.equal(torch.isinf(twin), torch.isinf(want))
    assert not fin.any() or _max_rel(twin[fin], want[fin]) < 1e-5


@pytest.mark.parametrize("counts", [(0, 5, 100), (70, 33, 1)])
def test_indexer_scores_tiny(counts) -> None:
    _check_index(_index_case(3, 4, 32, 2, 70, list(counts), seed=counts[1]))


def test_indexer_scores_odd_heads() -> None:
    _check_index(_index_case(2, 3, 20, 3, 45, [45, 17], seed=9))


def test_indexer_scores_weight_scale() -> None:
    """The head weights' constant scale applied in the kernel (the decode step's 1 / sqrt(Di Hi))."""
    _check_index(_index_case(2, 4, 32, 2, 40, [40, 23], seed=11), wscale=0.03125)
    _check_index(_index_case(2, 4, 32, 2, 40, [40, 23], seed=11), wscale=-3.0)  # sign flips the ReLU's sum


@pytest.mark.parametrize("bf16", [False, True])
def test_indexer_scores_any_values(bf16: bool, monkeypatch) -> None:
    """Off the QAT grid: f32 operands (INDEX_BF16 off) match the f64 oracle; bf16 operands match the oracle
    of bf16-rounded operands (and so the twin), not the raw one."""
    monkeypatch.setattr(attend, "INDEX_BF16", bf16)
    args = _index_case(2, 4, 32, 2, 40, [40, 23], seed=5, qat=False)
    if not bf16:
        _check_index(args)
        return
    qi, wts, rows, slot, count = args
    rounded = (qi.bfloat16().float(), wts, rows.bfloat16().float(), slot, count)
    got = attend.indexer_scores(*(a.to(DEVICE) for a in args)).cpu()
    fin = torch.isfinite(got)
    want = _index_oracle(*rounded)[fin]
    assert _max_rel(attend.indexer_scores_ref(*args)[fin], want) < 1e-5
    assert _max_rel(_index_oracle(*args)[fin], want) > 1e-4  # the rounding is real on these values
    # the GPU casts f32 -> bf16 to nearest even like torch; the interpreter truncates (one bf16 step)
    assert _max_rel(got[fin], want) < (1e-5 if DEVICE == "cuda" else 2e-2)


# ---------------------------------------------------------------------------------------------------------
# Flash shapes (compiled, GPU): H 64, D 512, W 128, P 32; top-k 512 of 16k rows, or 66 rows at ratio 128


def _flash_positions(B: int, seed: int, top: int) -> list[int]:
    g = _gen(seed)
    fixed = [top, 0, 5, 127, 128, 300]
    return (fixed + torch.randint(0, top + 1, (B,), generator=g).tolist())[:B]


@pytest.mark.cuda
@pytest.mark.parametrize("B", [1, 7, 32])
@pytest.mark.parametrize("mode", ["topk", "all", "none"])
@pytest.mark.parametrize("prec", ["ieee", "bf16x3", "bf16x3-fused"])
def test_attend_decode_flash(B: int, mode: str, prec: str, monkeypatch) -> None:
    monkeypatch.setattr(attend, "FUSED_MERGE", prec.endswith("-fused"))
    prec = prec.removesuffix("-fused")
    monkeypatch.setattr(attend, "ATTEND_PREC", prec)
    cap, ratio = (16384 if B < 8 else 4096, 4) if mode != "all" else (66, 128)  # 4096: host memory of B slots
    positions = _flash_positions(B, B, cap * ratio - 1)
    args = _case(B, 64, 512, 128, B + 1, cap, 512, ratio, 32, positions, seed=B,
                 comp=mode != "none", idx=mode == "topk")  # fmt: skip
    want = _oracle(*args)
    got = _run(args)
    assert torch.isfinite(got).all()
    assert _max_rel(got, want) < TOL[prec]


@pytest.mark.cuda
@pytest.mark.parametrize("B", [1, 32])
def test_indexer_scores_flash(B: int) -> None:
    counts = _flash_positions(B, B + 100, 16384)
    _check_index(_index_case(B, 64, 128, B + 1, 16384, counts, seed=B))
