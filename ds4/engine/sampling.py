"""Token sampling over next-token logits (model.md §13).

Pure functions over a float logits tensor [V] and an explicit RNG object, so a caller (CLI, server worker)
owns the RNG per request and a seed reproduces the same tokens. Three paths, as ds4 has them:

* temperature <= 0: greedy, the first index of the maximum logit (no RNG draw);
* top_k == 0 and top_p == 1 (the default): the full-vocabulary walk in token-id order with min_p;
* top_k == 0 and top_p < 1: a sorted prefix (min_p and top_p truncation) over all finite logits;
* top_k > 0: the k largest finite logits, then the same min_p/top_p prefix truncation.

Every non-greedy token costs exactly one RNG draw.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from ds4.config import DEFAULT_MIN_P, DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, MAX_TOP_K

_MASK64 = (1 << 64) - 1
_ZERO_STATE = 0x9E3779B97F4A7C15  # replaces a zero state (xorshift has a fixed point at 0)
_MULT = 0x2545F4914F6CDD1D


class Rng:
    """64-bit xorshift* generator; the state is the user seed (§13)."""

    def __init__(self, seed: int) -> None:
        self.state = int(seed) & _MASK64

    def next_u64(self) -> int:
        x = self.state or _ZERO_STATE
        x ^= x >> 12
        x ^= (x << 25) & _MASK64
        x ^= x >> 27
        self.state = x
        return (x * _MULT) & _MASK64

    def uniform(self) -> float:
        """U in [0, 1) with 24 bits: bits 40..63 of the output over 2^24."""
        return ((self.next_u64() >> 40) & 0xFFFFFF) / float(1 << 24)


def time_seed() -> int:
    """A non-zero seed from the clock and the pid (seed 0 / absent means 'time-based', §13)."""
    seed = (time.time_ns() ^ (os.getpid() << 32) ^ time.perf_counter_ns()) & _MASK64
    return seed or 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    min_p: float = DEFAULT_MIN_P
    seed: int | None = None  # None or 0: time-based

    def normalized(self) -> SamplingParams:
        """Apply ds4's clamps: top_p outside (0, 1] -> 1, min_p < 0 -> 0, top_k in [0, 1024]."""
        top_p = self.top_p if 0.0 < self.top_p <= 1.0 else 1.0
        min_p = max(self.min_p, 0.0)
        top_k = min(max(int(self.top_k), 0), MAX_TOP_K)
        return SamplingParams(self.temperature, top_k, top_p, min_p, self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def make_rng(self) -> Rng:
        return Rng(self.seed if self.seed else time_seed())


def greedy_token(logits: torch.Tensor) -> int:
    """First index of the maximum logit (NaN never wins)."""
    x = torch.nan_to_num(logits.detach().float(), nan=float("-inf"))
    return int(torch.argmax(x).item())


def sample(logits: torch.Tensor, params: SamplingParams, rng: Rng) -> int:
    """One token id from logits [V] under params; draws from rng exactly once unless greedy."""
    p = params.normalized()
    if p.greedy:
        return greedy_token(logits)
    x = logits.detach().to("cpu", torch.float32).reshape(-1)
    if p.top_k > 0:
        return _sample_top_k(x, p, rng)
    if p.top_p < 1.0:
        return _sample_top_p(x, p, rng)
    return _sample_full_vocab(x, p, rng)


def _first_reaching(cum: torch.Tensor, r: float) -> int:
    """Index of the first cumulative sum >= r (the walk 'r -= p_i; stop at r <= 0'), or -1 if none."""
    j = int(torch.searchsorted(cum, torch.tensor([r], dtype=cum.dtype), side="left").item())
    return j if j < cum.numel() else -1


def _sample_full_vocab(x: torch.Tensor, p: SamplingParams, rng: Rng) -> int:
    # V = vocab; walk in token-id order over the kept tokens.
    finite = torch.isfinite(x)
    if not bool(finite.any()):
        return greedy_token(x)
    m = x[finite].max()
    prob = torch.exp((x - m) / p.temperature)  # [V], best token = 1
    keep = finite & (prob >= p.min_p)  # min_p relative to the best token
    ids = keep.nonzero().reshape(-1)  # [n_keep] ascending ids
    cum = torch.cumsum(prob[ids].double(), 0)  # [n_keep]
    u = rng.uniform()
    j = _first_reaching(cum, u * float(cum[-1]))
    return int(ids[j]) if j >= 0 else greedy_token(x)


def _prefix(prob: torch.Tensor, p: SamplingParams) -> int:
    """Length of the kept prefix of descending probabilities prob [n] (sum-normalised).

    Keep while prob >= prob[0] * min_p (the first is always kept); stop after the token at which the
    cumulative probability reaches top_p.
    """
    below = (prob < prob[0] * p.min_p).nonzero()
    n = int(below[0]) if below.numel() else prob.numel()
    n = max(n, 1)
    if p.top_p < 1.0:
        cum = torch.cumsum(prob[:n].double(), 0)
        reach = (cum >= p.top_p).nonzero()
        if reach.numel():
            n = int(reach[0]) + 1
    return n


def _walk_prefix(ids: torch.Tensor, prob: torch.Tensor, n: int, rng: Rng) -> int:
    cum = torch.cumsum(prob[:n].double(), 0)  # [n]
    u = rng.uniform()
    j = _first_reaching(cum, u * float(cum[-1]))
    return int(ids[j if j >= 0 else n - 1])  # fallback: the last kept candidate


def _sorted_desc(x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, values) sorted by value descending; equal values keep the lower id first."""
    vals, order = torch.sort(x[ids], descending=True, stable=True)
    return ids[order], vals


def _sample_top_p(x: torch.Tensor, p: SamplingParams, rng: Rng) -> int:
    finite = torch.isfinite(x)
    if not bool(finite.any()):
        return greedy_token(x)
    m = x[finite].max()
    e = torch.exp((x - m) / p.temperature)  # [V]; non-finite logits give 0 or nan
    total = e[finite].double().sum()  # the full sum over all finite logits
    # Tokens below min_p of the best end the prefix anyway: drop them before the (costly) sort.
    cand = (finite & (e >= p.min_p)).nonzero().reshape(-1)
    ids, vals = _sorted_desc(x, cand)
    prob = (torch.exp((vals - m) / p.temperature).double() / total).float()
    return _walk_prefix(ids, prob, _prefix(prob, p), rng)


def _sample_top_k(x: torch.Tensor, p: SamplingParams, rng: Rng) -> int:
    finite = torch.isfinite(x)
    n_finite = int(finite.sum())
    if n_finite == 0:
        return greedy_token(x)
    k = min(p.top_k, n_finite)
    xf = torch.where(finite, x, torch.full_like(x, float("-inf")))
    kth = torch.topk(xf, k).values[-1]  # every one of the k largest is >= kth (ties included)
    ids, vals = _sorted_desc(x, (finite & (x >= kth)).nonzero().reshape(-1))
    ids, vals = ids[:k], vals[:k]
    prob = torch.exp((vals - vals[0]) / p.temperature)
    prob = prob / prob.double().sum().float()  # normalised over the k kept only
    return _walk_prefix(ids, prob, _prefix(prob, p), rng)
