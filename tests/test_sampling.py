"""Sampling (model.md §13): the xorshift* RNG, greedy, and the three sampling paths.

Oracles are written here from the §13 text, independently of ds4/engine/sampling.py: a numpy uint64 RNG, the
intended distributions in float64, and a plain-Python walk that maps one uniform draw to a token.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ds4.config import DEFAULT_MIN_P, DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P
from ds4.engine.sampling import Rng, SamplingParams, greedy_token, sample

# ------------------------------------------------------------------ RNG


def _np_xorshift(seed: int, n: int) -> list[int]:
    """Independent xorshift* in numpy uint64 arithmetic (wraps mod 2^64 natively)."""
    with np.errstate(over="ignore"):
        x = np.uint64(seed if seed else 0x9E3779B97F4A7C15)
        out = []
        for _ in range(n):
            x ^= x >> np.uint64(12)
            x ^= x << np.uint64(25)
            x ^= x >> np.uint64(27)
            out.append(int(x * np.uint64(0x2545F4914F6CDD1D)))
    return out


def test_rng_first_value_by_hand():
    # seed 1: 1 ^ (1 >> 12) = 1; 1 ^ (1 << 25) = 0x2000001; 0x2000001 >> 27 = 0, so the state is 0x2000001.
    r = Rng(1)
    out = r.next_u64()
    assert r.state == 0x2000001
    assert out == (0x2000001 * 0x2545F4914F6CDD1D) % (1 << 64)
    # 0x2000001 * M = M + (M << 25) (mod 2^64)
    m = 0x2545F4914F6CDD1D
    assert out == (m + (m << 25)) & ((1 << 64) - 1)


@pytest.mark.parametrize("seed", [0, 1, 42, 0xDEADBEEFCAFEBABE, (1 << 64) - 1])
def test_rng_matches_independent_numpy(seed):
    r = Rng(seed)
    got = [r.next_u64() for _ in range(50)]
    assert got == _np_xorshift(seed, 50)


def test_rng_zero_state_is_golden_ratio():
    assert Rng(0).next_u64() == Rng(0x9E3779B97F4A7C15).next_u64()


def test_uniform_is_top_24_bits():
    r1, r2 = Rng(7), Rng(7)
    for _ in range(20):
        u = r1.uniform()
        assert u == (r2.next_u64() >> 40) / 2**24
        assert 0.0 <= u < 1.0


# ------------------------------------------------------------------ defaults, greedy


def test_defaults_come_from_config():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (
        DEFAULT_TEMPERATURE,
        DEFAULT_TOP_K,
        DEFAULT_TOP_P,
        DEFAULT_MIN_P,
    )
    assert (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_MIN_P, DEFAULT_TOP_K) == (1.0, 1.0, 0.05, 0)


def test_clamps():
    p = SamplingParams(top_p=1.5, min_p=-1.0, top_k=5000).normalized()
    assert (p.top_p, p.min_p, p.top_k) == (1.0, 0.0, 1024)
    assert SamplingParams(top_p=0.0).normalized().top_p == 1.0


class _CountingRng(Rng):
    def __init__(self, seed):
        super().__init__(seed)
        self.draws = 0

    def next_u64(self):
        self.draws += 1
        return super().next_u64()


def test_greedy_first_max_and_no_draw():
    logits = torch.tensor([0.0, 3.0, -1.0, 3.0, float("-inf")])
    rng = _CountingRng(5)
    assert sample(logits, SamplingParams(temperature=0.0), rng) == 1
    assert sample(logits, SamplingParams(temperature=-1.0, top_k=3), rng) == 1
    assert rng.draws == 0
    assert greedy_token(torch.tensor([float("nan"), 1.0, 2.0, 2.0])) == 2


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.95, min_p=0.0),
    ],
)
def test_one_draw_per_sampled_token(params):
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    rng = _CountingRng(9)
    for i in range(25):
        sample(logits, params, rng)
        assert rng.draws == i + 1


def test_same_seed_same_tokens():
    logits = torch.randn(129280, generator=torch.Generator().manual_seed(1)) * 3
    for params in [SamplingParams(seed=1234), SamplingParams(temperature=0.8, top_p=0.9, seed=99)]:
        a, b = params.make_rng(), params.make_rng()
        ta = [sample(logits, params, a) for _ in range(12)]
        tb = [sample(logits, params, b) for _ in range(12)]
        assert ta == tb
        assert len(set(ta)) > 1  # really sampling, not stuck on one token


def test_time_seed_when_seed_absent():
    a, b = SamplingParams(seed=None).make_rng(), SamplingParams(seed=0).make_rng()
    assert a.state != 0 and b.state != 0


# ------------------------------------------------------------------ the §13 oracle


def _oracle(logits: np.ndarray, t: float, top_k: int, top_p: float, min_p: float):
    """(ids, probs) in walk order, per the §13 text, in float64."""
    fin = [i for i in range(len(logits)) if math.isfinite(logits[i])]
    if top_k == 0 and top_p >= 1.0:  # full vocab, id order
        m = max(logits[i] for i in fin)
        p = {i: math.exp((logits[i] - m) / t) for i in fin}
        ids = [i for i in fin if p[i] >= min_p]
        w = np.array([p[i] for i in ids])
        return ids, w / w.sum()
    order = sorted(fin, key=lambda i: (-logits[i], i))  # descending; ties lower id first
    if top_k > 0:
        order = order[:top_k]
    m = logits[order[0]]
    e = np.array([math.exp((logits[i] - m) / t) for i in order])
    p = e / e.sum()
    kept, cum = [], 0.0
    for j in range(len(order)):
        if j > 0 and p[j] < p[0] * min_p:
            break
        kept.append(j)
        cum += p[j]
        if top_p < 1.0 and cum >= top_p:
            break
    w = p[kept]
    return [order[j] for j in kept], w / w.sum()


def _walk(ids, probs, u):
    r = u * float(probs.sum())
    for i, p in zip(ids, probs, strict=True):
        r -= p
        if r <= 0:
            return i
    return ids[-1]


# A fixed logit vector with ties, a -inf and a spread that makes min_p, top_p and top_k all bite.
LOGITS = np.array([1.0, 2.5, -0.5, 2.5, 0.3, float("-inf"), 1.7, -2.0, 0.9, 3.0, -4.0, 0.0], dtype=np.float32)

CASES = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05),  # default: full vocab + min_p
    dict(temperature=0.6, top_k=0, top_p=1.0, min_p=0.0),  # full vocab, temperature only
    dict(temperature=1.5, top_k=0, top_p=0.8, min_p=0.0),  # top_p sorted prefix
    dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.2),  # top_p + min_p
    dict(temperature=1.2, top_k=5, top_p=1.0, min_p=0.0),  # top_k
    dict(temperature=0.9, top_k=6, top_p=0.85, min_p=0.1),  # top_k + top_p + min_p
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_distribution_chi_square(case):
    from scipy.stats import chisquare

    ids, probs = _oracle(
        LOGITS.astype(np.float64), case["temperature"], case["top_k"], case["top_p"], case["min_p"]
    )
    params = SamplingParams(**case, seed=20261129)
    rng = params.make_rng()
    logits = torch.from_numpy(LOGITS)
    n = 4000
    counts = np.zeros(len(LOGITS))
    for _ in range(n):
        counts[sample(logits, params, rng)] += 1
    outside = [i for i in range(len(LOGITS)) if i not in ids]
    assert counts[outside].sum() == 0, f"sampled tokens outside the support {ids}"
    expected = probs * n
    stat, pval = chisquare(counts[ids], expected)
    # dof = len(ids) - 1 <= 10; p > 1e-3 <=> statistic below the 99.9% critical value (29.6 at 10 dof).
    assert pval > 1e-3, (case, counts[ids], expected, stat)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_walk_order_matches_oracle(case):
    """Same seed → the exact token the §13 walk gives for that uniform draw (id order vs sorted order)."""
    ids, probs = _oracle(
        LOGITS.astype(np.float64), case["temperature"], case["top_k"], case["top_p"], case["min_p"]
    )
    params = SamplingParams(**case)
    logits = torch.from_numpy(LOGITS)
    for seed in range(1, 400):
        u = (_np_xorshift(seed, 1)[0] >> 40) / 2**24
        want = _walk(ids, probs, u)
        got = sample(logits, params, Rng(seed))
        assert got == want, (seed, u)


def test_full_vocab_min_p_big_vocab():
    """Full-vocab path on a vocab-sized vector: never returns a token below min_p of the best."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(129280, generator=g) * 4
    params = SamplingParams(seed=5)
    rng = params.make_rng()
    best = float(logits.max())
    for _ in range(40):
        t = sample(logits, params, rng)
        assert math.exp(float(logits[t]) - best) >= 0.05 - 1e-6


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add contention on the shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
