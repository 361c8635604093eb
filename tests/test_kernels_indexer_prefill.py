"""Prefill indexer scores (ds4/kernels/indexer_prefill.py) against an f64 oracle and its torch twin, and the
model's prefill pick (ds4.model.cuda.layer._indexer_pick) with the kernel against its former torch code.

Tiny shapes run under Triton's interpreter (via test_kernels_interpreted.py on CPU machines); cuda-marked
tests run Flash shapes compiled. Legend: T tokens at positions p0.., Hi/Di indexer heads/dim, C compressed
rows, k top-k.

Inputs are made like the model's: queries and rows through the indexer QAT (quantsim.indexer_qat: Hadamard +
FP4 with power-of-two block scales), so the kernel's bf16 dot operands are exact and only the order of f32
sums differs from the twin. Elementwise check: |got - oracle| <= TOL * bound, with bound[t, c] = sum_h
|wts[t, h]| * sum_d |qi[t, h, d] rows[c, d]| (the scale of every partial sum) and TOL = 1e-5 (the worst case
of (Di + Hi) f32 roundings is ~1.1e-5; typical errors are far below: measured under the interpreter, max
|err| / bound 2.3e-8 and max |err| / max |score| 6e-8 at T 37, Hi 4 and 1.9e-8 / 9.8e-8 at T 64, Hi 16, Di
128, C 80, the twin's error alike). The masked entries must be exactly -inf in the same places.

The pick. Selected sets can only differ where two scores lie within rounding of each other at the top-k
boundary, so the test decides, per token and from the f64 oracle, whether its selection is determined: the
k-th largest oracle score theta has no other row within MARGIN of it, except rows tying it exactly at 0
(all heads' ReLUs zero: exactly 0 in every f32 order too; ties go to the lower row in both paths) or at
-inf. Tokens so determined must get the same (index, valid) set from the kernel path and the torch path; at
least 80 % of tokens must be determined (else the test proves nothing). With few heads (Hi = 4) many rows
score exactly 0, so exact ties at the boundary are exercised.
"""

from __future__ import annotations

import _kernel_env  # noqa: F401  (interpreter / GPU setup; skips this module in the plain CPU run)
import pytest
import torch
from _kernel_env import CUDA, DEVICE

from ds4.kernels import ref
from ds4.kernels.indexer_prefill import IndexerPrefillConfig, indexer_scores_prefill
from ds4.model.cuda import layer
from ds4.model.quantsim import indexer_qat

TOL = 1e-5  # of the elementwise bound (module docstring)
MARGIN = 1e-4  # of the token's largest bound: scores closer than this to the k-th one make it undecided
TINY = IndexerPrefillConfig(bt=16, bc=16, warps=1, stages=1)


def _inputs(T: int, Hi: int, Di: int, C: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qi [T, Hi, Di], wts [T, Hi], rows [C, Di]) with the model's magnitudes: QAT'd ~unit queries and
    rows (a spread of block scales), head weights ~N(0, 1) / sqrt(Di Hi) like the scaled projection."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-3, 3, (1, 1, Di // 32), generator=g).float()).repeat_interleave(32, -1)
    qi = indexer_qat(torch.randn(T, Hi, Di, generator=g) * spread)
    rows = indexer_qat(torch.randn(C, Di, generator=g) * spread[0])
    wts = torch.randn(T, Hi, generator=g) * (Di * Hi) ** -0.5
    return qi.to(DEVICE), wts.to(DEVICE), rows.to(DEVICE)


def _oracle(qi, wts, rows, p0: int, ratio: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(score [T, C] f64 with -inf where hidden, bound [T, C]): straight from the definition in f64."""
    q, w, k = qi.double(), wts.double(), rows.double()
    dots = torch.einsum("thd,cd->thc", q, k)  # [T, Hi, C]
    score = torch.einsum("thc,th->tc", dots.clamp_min(0), w)
    bound = torch.einsum("thc,th->tc", torch.einsum("thd,cd->thc", q.abs(), k.abs()), w.abs())
    T, C = score.shape
    counts = (p0 + torch.arange(T, device=qi.device) + 1) // ratio
    hidden = torch.arange(C, device=qi.device)[None, :] >= counts[:, None]
    return score.masked_fill(hidden, float("-inf")), bound


def _check_scores(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> float:
    """Same -inf pattern, finite entries within TOL * bound; returns max |err| / bound."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "masked entries differ"
    fin = torch.isfinite(want)
    assert torch.isfinite(got[fin]).all()
    err = (got[fin].double() - want[fin]).abs()
    b = bound[fin].clamp_min(1e-30)
    assert (err <= TOL * b).all(), f"max err / bound {float((err / b).max()):.3g} > {TOL}"
    return float((err / b).max()) if err.numel() else 0.0


def test_qat_values_are_exact_in_bf16() -> None:
    """The contract's premise: every FP4-QAT'd value (any block scale) survives a bf16 round trip."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g) * torch.exp2(torch.randint(-60, 60, (64, 1), generator=g).float())
    q = indexer_qat(x)
    assert torch.equal(q.to(torch.bfloat16).float(), q)


@pytest.mark.parametrize(
    "T, Hi, Di, C, p0",
    [
        (37, 4, 128, 45, 150),  # chunk at p0 > 0; T and C not multiples of the 16-tiles; masked upper part
        (20, 3, 32, 5, 0),  # first chunk (C = 20 // 4), a short head dim
        (16, 2, 64, 33, 120),  # every row visible to every token: no mask inside the tiles
        (80, 2, 64, 21, 4),  # tiles wholly past their tokens' rows are skipped; one with a single row is not
    ],
)
def test_kernel_matches_oracle_and_twin(T: int, Hi: int, Di: int, C: int, p0: int) -> None:
    qi, wts, rows = _inputs(T, Hi, Di, C, seed=T + C)
    want, bound = _oracle(qi, wts, rows, p0)
    got = indexer_scores_prefill(qi, wts, rows, p0, 4, cfg=TINY)
    twin = ref.indexer_scores_prefill(qi, wts, rows, p0, 4)
    _check_scores(got, want, bound)
    _check_scores(twin, want, bound)
    _check_scores(got, twin.double(), bound)


def test_precast_queries_give_the_same_scores() -> None:
    """IndexerPrefillConfig.precast (qi cast to bf16 by torch first): bit-identical scores, since the cast is
    exact for QAT'd values and the kernel's sums run in the same order."""
    qi, wts, rows = _inputs(37, 4, 128, 45, seed=5)
    plain = indexer_scores_prefill(qi, wts, rows, 150, 4, cfg=TINY)
    assert torch.equal(indexer_scores_prefill(qi, wts, rows, 150, 4, cfg=TINY._replace(precast=True)), plain)


def test_kernel_rejects_bad_shapes() -> None:
    qi, wts, rows = _inputs(16, 2, 64, 8, seed=0)
    with pytest.raises(ValueError, match=r"wts must be \[16, 2\]"):
        indexer_scores_prefill(qi, wts[:, :1], rows, 0)
    with pytest.raises(ValueError, match=r"rows must be \[C, 64\]"):
        indexer_scores_prefill(qi, wts, rows[:, :32], 0)
    with pytest.raises(ValueError, match="qi must be"):
        indexer_scores_prefill(qi[0], wts, rows, 0)
    with pytest.raises(ValueError, match="p0 must be"):
        indexer_scores_prefill(qi, wts, rows, -1)


def _decided(oracle: torch.Tensor, bound: torch.Tensor, k: int) -> torch.Tensor:
    """[T] bool: the token's top-k set is fixed whatever the f32 rounding (module docstring)."""
    theta = oracle.sort(dim=-1, descending=True).values[:, k - 1 : k]  # [T, 1] the k-th largest
    margin = MARGIN * bound.max(dim=-1, keepdim=True).values
    gap = (oracle - theta).abs()  # nan for -inf vs -inf: never "near"
    near = (gap > 0) & (gap <= margin)  # rows that rounding could move across theta
    exact = (theta == 0) | torch.isneginf(theta)  # ties that every f32 order computes exactly
    alone = (oracle == theta).sum(-1, keepdim=True) == 1
    return (~near.any(-1, keepdim=True) & (alone | exact)).squeeze(-1)


def _pick_inputs(T: int, Hi: int, Di: int, C: int, d: int, seed: int):
    """Weights and activations for layer._indexer_pick (on DEVICE: on a GPU the pick takes the kernel):
    its q_b / proj give the QAT'd queries and weights."""
    g = torch.Generator().manual_seed(seed)
    from types import SimpleNamespace

    w = SimpleNamespace(
        q_b=(torch.randn(Hi * Di, d, generator=g) * d**-0.5).to(DEVICE),
        proj=torch.randn(Hi, d, generator=g).to(DEVICE),
        compressor=SimpleNamespace(norm=torch.ones(Di, device=DEVICE)),
    )
    qn, xn = torch.randn(T, d, generator=g).to(DEVICE), torch.randn(T, d, generator=g).to(DEVICE)
    rows = indexer_qat(torch.randn(C, Di, generator=g)).to(DEVICE)
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))).to(DEVICE)  # 16 RoPE pairs
    return w, qn, xn, rows, inv_freq


# (24, 100, 8, 4): no exact ties at the boundary; (20, 6, 4, 4): early tokens see < k rows (-inf ties,
# invalid entries); (32, 120, 16, 2): two heads, ~1/4 of rows score exactly 0 -> ties at 0 on the boundary.
@pytest.mark.parametrize("T, p0, k, Hi", [(24, 100, 8, 4), (20, 6, 4, 4), (32, 120, 16, 2)])
def test_pick_kernel_equals_torch(T: int, p0: int, k: int, Hi: int, monkeypatch) -> None:
    """_indexer_pick with the kernel (sort and keys top-k) vs its torch code: same valid masks, same
    (index, valid) sets on every determined token; the two top-k methods give identical indices."""
    Di, d = 64, 32
    C = (p0 + T) // 4
    w, qn, xn, rows, inv_freq = _pick_inputs(T, Hi, Di, C, d, seed=T + p0)
    positions = torch.arange(p0, p0 + T, device=DEVICE)
    monkeypatch.setattr(layer, "SCORE_BUDGET", 7 * C)  # token blocks of 7 (kernel) / 7 // Hi (torch)
    picks = {}
    for mode, topk in (("torch", "sort"), ("kernel", "sort"), ("kernel", "keys")):
        monkeypatch.setattr(layer, "PREFILL_INDEXER", mode)
        monkeypatch.setattr(layer, "PREFILL_TOPK", topk)
        picks[mode, topk] = layer._indexer_pick(w, qn, xn, positions, rows, k, inv_freq, p0=p0)
    assert torch.equal(picks["kernel", "sort"][0], picks["kernel", "keys"][0])
    assert torch.equal(picks["kernel", "sort"][1], picks["kernel", "keys"][1])
    qi, wts = layer._indexer_query(w, qn, xn, positions, inv_freq)
    oracle, bound = _oracle(qi, wts, rows, p0)
    decided = _decided(oracle, bound, k)
    assert decided.float().mean() >= 0.8, f"only {int(decided.sum())} of {T} tokens determined"
    (i_t, v_t), (i_k, v_k) = picks["torch", "sort"], picks["kernel", "sort"]
    assert torch.equal(v_t.sum(-1), v_k.sum(-1))
    for t in torch.nonzero(decided).flatten().tolist():
        want = sorted(zip(i_t[t].tolist(), v_t[t].tolist(), strict=True))
        assert sorted(zip(i_k[t].tolist(), v_k[t].tolist(), strict=True)) == want, f"token {t}"


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="Flash shapes: GPU only")
def test_flash_shapes_against_twin() -> None:
    """T = 4096 chunk at p0 = 4096 (C = 2048 rows, the causal triangle in the last 1024), Hi 64, Di 128:
    kernel vs twin (both f32 sums of exact products): max |diff| / max |twin| <= 1e-5, same -inf mask, and
    the same top-512 sets on almost every token."""
    T, Hi, Di, p0 = 4096, 64, 128, 4096
    C = (p0 + T) // 4
    qi, wts, rows = _inputs(T, Hi, Di, C, seed=7)
    got = indexer_scores_prefill(qi, wts, rows, p0, 4)
    twin = ref.indexer_scores_prefill(qi, wts, rows, p0, 4)
    assert torch.equal(torch.isneginf(got), torch.isneginf(twin))
    fin = torch.isfinite(twin)
    rel = float((got[fin] - twin[fin]).abs().max() / twin[fin].abs().max())
    assert rel <= 1e-5, rel
    # top-512 sets: only near-ties at the 512th score can differ (score spacing there ~1e-3 of the range,
    # rounding ~1e-7 of it: ~0.5 tokens of 4096 expected), so at least 99.5 % of tokens must agree
    top_k, top_t = layer._top_rows(got, 512).sort(-1).values, layer._top_rows(twin, 512).sort(-1).values
    same = float((top_k == top_t).all(-1).float().mean())
    assert same >= 0.995, same
