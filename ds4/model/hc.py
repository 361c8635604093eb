"""Hyper-connections: HC streams mixed by Sinkhorn-normalised weights (model.md §5.2, §5.3, §5.6).

Legend: T tokens, S = hc_mult streams, d = n_embd, M = (2 + S) * S mixing logits.
The combine matrix C is indexed C[src, dst]: X'[dst] = post[dst] * f + sum_src C[src, dst] * X[src].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class HCWeights:
    fn: torch.Tensor  # [M, S*d]
    scale: torch.Tensor  # [3]: pre, post, comb
    base: torch.Tensor  # [M]


def _mix_logits(X: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """fn . RMSNorm_noweight(flatten(X)): [T, S, d] -> [T, rows of fn]."""
    flat = X.flatten(1)  # [T, S*d]
    rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return F.linear(flat, fn) * rsqrt


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[T, S, S] -> near doubly-stochastic: row softmax + eps, then column/row normalisation.

    One softmax, `iters` column passes and `iters - 1` row passes, each with +eps in the denominator.
    """
    c = logits.softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def hc_pre(
    X: torch.Tensor, w: HCWeights, *, iters: int, rms_eps: float, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse the streams for a sublayer. X [T, S, d] -> x [T, d], post [T, S], comb [T, S, S]."""
    S = X.shape[1]
    mix = _mix_logits(X, w.fn, rms_eps)  # [T, M]
    pre = torch.sigmoid(mix[:, :S] * w.scale[0] + w.base[:S]) + hc_eps
    post = 2 * torch.sigmoid(mix[:, S : 2 * S] * w.scale[1] + w.base[S : 2 * S])
    comb_logits = (mix[:, 2 * S :] * w.scale[2] + w.base[2 * S :]).unflatten(-1, (S, S))
    comb = sinkhorn(comb_logits, iters, hc_eps)
    x = (pre[:, :, None] * X).sum(1)  # weighted sum of the UNnormalised streams
    return x, post, comb


def hc_post(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, S, d] from sublayer output f [T, d]; replaces X (no separate residual add)."""
    return post[:, :, None] * f[:, None, :] + (comb[:, :, :, None] * X[:, :, None, :]).sum(1)


def hc_head(X: torch.Tensor, w: HCWeights, *, rms_eps: float, hc_eps: float) -> torch.Tensor:
    """Output-head collapse: sigmoid stream weights (+eps), single scale. [T, S, d] -> [T, d]."""
    mix = _mix_logits(X, w.fn, rms_eps)  # [T, S]
    pre = torch.sigmoid(mix * w.scale + w.base) + hc_eps
    return (pre[:, :, None] * X).sum(1)
