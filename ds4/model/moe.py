"""FFN sublayer: sqrt-softplus router (hash or biased top-k) and clamped SwiGLU experts (model.md §5.5).

Legend: T tokens, d = n_embd, E routed experts, k = experts per token, F = expert hidden width.

Expert parallel (ds4.dist): with a process group of N > 1 processes, each computes only its contiguous
shard of the experts (every rank routes every token) and the routed sums are added with one all_reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds4 import dist


@dataclass
class MoEWeights:
    gate_inp: torch.Tensor  # [E, d] router
    bias: torch.Tensor | None  # [E] selection bias (absent in hash layers)
    tid2eid: torch.Tensor | None  # [V, k] int64 expert ids per token id (hash layers)
    gate_exps: torch.Tensor  # [E, F, d]
    up_exps: torch.Tensor  # [E, F, d]
    down_exps: torch.Tensor  # [E, d, F]
    gate_sh: torch.Tensor  # [F, d]
    up_sh: torch.Tensor  # [F, d]
    down_sh: torch.Tensor  # [d, F]


def route(
    w: MoEWeights,
    xf: torch.Tensor,
    tokens: torch.Tensor,
    k: int,
    scale: float,
    normalize: bool,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: (weights [T, k], expert ids [T, k]) for xf [T, d] and the input token ids [T]; linear: how
    xf @ gate_inp^T is computed (the device prefill passes its f32 tensor-core GEMM).

    prob = sqrt(softplus(logit)); hash layers take ids from tid2eid[token], the others the k largest
    prob + bias (ties -> lower expert id). Weights are the unbiased probs of the chosen experts,
    normalised by their sum, times `scale`.
    """
    probs = F.softplus(linear(xf, w.gate_inp)).sqrt()  # [T, E]
    if w.tid2eid is not None:
        ids = w.tid2eid[tokens]  # [T, k]
    else:
        biased = probs if w.bias is None else probs + w.bias
        ids = biased.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    weights = probs.gather(1, ids)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * scale, ids


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, clamp: float) -> torch.Tensor:
    """silu(min(gate.x, clamp)) * clamp(up.x, -clamp, clamp): [T, d] -> [T, F]. clamp <= 0: no clamp."""
    g, u = F.linear(x, gate), F.linear(x, up)
    if clamp > 0:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)  # asymmetric: the gate has no lower bound
    return F.silu(g) * u


def moe_forward(
    w: MoEWeights,
    xf: torch.Tensor,
    tokens: torch.Tensor,
    *,
    k: int,
    scale: float,
    normalize: bool,
    clamp: float,
) -> torch.Tensor:
    """Routed experts (router weight applied before the down projection) + the shared expert: [T, d].

    Under expert parallelism only this rank's experts [lo, hi) are computed here; the routed sum is then
    all_reduced over the ranks (the stacks may hold all E experts or only the hi - lo local ones).
    """
    weights, ids = route(w, xf, tokens, k, scale, normalize)
    lo, hi = dist.expert_range(w.gate_inp.shape[0])
    base = 0 if w.gate_exps.shape[0] == w.gate_inp.shape[0] else lo  # full stack, or local rows only
    y = torch.zeros_like(xf)
    for e in torch.unique(ids).tolist():  # ascending expert id, like the official loop
        if not lo <= e < hi:
            continue
        tok, slot = torch.where(ids == e)
        j = e - base
        mid = swiglu(xf[tok], w.gate_exps[j], w.up_exps[j], clamp) * weights[tok, slot, None]  # [t, F]
        y.index_add_(0, tok, F.linear(mid, w.down_exps[j]))
    dist.all_reduce_(y)
    return y + F.linear(swiglu(xf, w.gate_sh, w.up_sh, clamp), w.down_sh)
