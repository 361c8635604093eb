"""RMSNorm, the one normalisation of the model (model.md §4)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) (* weight), over the last dim, in float32."""
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else weight * y
