"""Plain-torch twins of the Triton kernels: same signatures, f32 math on exactly dequantized weights.

They are the CPU path of the dispatchers and the oracles of tests/test_kernels_*.py. Each section belongs to
one kernel family.
"""

from __future__ import annotations

import torch

# =========================================================================================================
# Quantized weights: qmatvec / qmatmul (matvec.py, matmul.py) and gathered / grouped experts (moe.py)
# Legend: B (or M) activation rows, N output rows, K row length, E experts, k experts per row, F expert width.


def _unpack(w):  # lazy import: packing imports nothing from here, but keep this module light to import
    from .packing import unpack

    return unpack(w)


def qmatvec(x: torch.Tensor, w) -> torch.Tensor:
    """x [B, K] @ W[N, K]^T -> [B, N] f32."""
    return x.float() @ _unpack(w).T


def qmatvec_grouped(x: torch.Tensor, w) -> torch.Tensor:
    """x [B, G, K], W [G, N, K] -> [B, G, N] f32: out[b, g] = W[g] @ x[b, g]."""
    return torch.einsum("gnk,bgk->bgn", _unpack(w), x.float())


def qmatmul(x: torch.Tensor, w) -> torch.Tensor:
    """x [M, K] @ W[N, K]^T -> [M, N] f32."""
    return x.float() @ _unpack(w).T


def swiglu_clamped(g: torch.Tensor, u: torch.Tensor, clamp: float) -> torch.Tensor:
    """silu(min(g, c)) * clamp(u, -c, c) (model.md §5.5); clamp <= 0 means no clamp."""
    if clamp > 0:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    return torch.nn.functional.silu(g) * u


def moe_gate_up(x: torch.Tensor, wg, wu, ids: torch.Tensor, clamp: float) -> torch.Tensor:
    """x [B, K], W[E, F, K] gate/up, ids [B, k] -> mid [B, k, F] f32 (unweighted)."""
    g_all, u_all = _unpack(wg), _unpack(wu)  # [E, F, K]
    xf = x.float()
    ids = ids.long()
    g = torch.einsum("bjfk,bk->bjf", g_all[ids], xf) if ids.numel() else xf.new_zeros(*ids.shape, wg.N)
    u = torch.einsum("bjfk,bk->bjf", u_all[ids], xf) if ids.numel() else g
    return swiglu_clamped(g, u, clamp)


def moe_down(mid: torch.Tensor, weights: torch.Tensor, wd, ids: torch.Tensor) -> torch.Tensor:
    """mid [B, k, F], weights [B, k], Wd [E, D, F], ids [B, k] -> [B, D] = sum_j weights * Wd[ids] @ mid."""
    d_all = _unpack(wd)  # [E, D, F]
    y = torch.einsum("bjdf,bjf->bjd", d_all[ids.long()], mid.float())  # [B, k, D]
    return (y * weights.float()[..., None]).sum(1)


def moe_grouped(x_sorted: torch.Tensor, w, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[e]..offsets[e+1] of x_sorted [M, K] times W[e]^T -> [M, N] f32 (other rows: 0)."""
    w_all = _unpack(w)  # [E, N, K]
    out = x_sorted.new_zeros(x_sorted.shape[0], w.shape[-2], dtype=torch.float32)
    bounds = offsets.tolist()
    for e in range(len(bounds) - 1):
        if bounds[e + 1] > bounds[e]:
            out[bounds[e] : bounds[e + 1]] = x_sorted[bounds[e] : bounds[e + 1]].float() @ w_all[e].T
    return out


# =========================================================================================================
# Fused decode ops (fused.py): HC pre/post, q/kv norm + RoPE (+ FP8), router top-k
# Legend: B rows, S streams, d = n_embd, M = (2 + S) * S mixing logits, H heads, D head dim, R RoPE dims,
# E experts. The math of ds4.model.hc / norm / rope / quantsim / moe, written out in plain f32 torch.


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def hc_pre_fused(X, fn, scale, base, iters: int, rms_eps: float, hc_eps: float, norm=None):
    """X [B, S, d] -> x [B, d] (RMS-normalised with `norm` if given), post [B, S], comb [B, S, S]."""
    B, S, d = X.shape
    flat = X.float().reshape(B, S * d)
    mix = (flat @ fn.float().T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)  # [B, M]
    pre = torch.sigmoid(mix[:, :S] * scale[0] + base[:S]) + hc_eps
    post = 2 * torch.sigmoid(mix[:, S : 2 * S] * scale[1] + base[S : 2 * S])
    c = (mix[:, 2 * S :] * scale[2] + base[2 * S :]).reshape(B, S, S).softmax(-1) + hc_eps
    c = c / (c.sum(1, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(2, keepdim=True) + hc_eps)
        c = c / (c.sum(1, keepdim=True) + hc_eps)
    x = (pre[:, :, None] * X.float()).sum(1)
    return (x if norm is None else _rms(x, rms_eps) * norm.float()), post, c


def hc_post_fused(f, X, post, comb):
    """X'[b, dst] = post[b, dst] * f[b] + sum_src comb[b, src, dst] * X[b, src]: [B, S, d] f32."""
    return post.float()[:, :, None] * f.float()[:, None, :] + torch.einsum(
        "bsd,bst->btd", X.float(), comb.float()
    )


def _rope(y: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate the adjacent pairs of the last 2 * len(inv_freq) dims of y [B, ..., D] by pos[b] * inv_freq."""
    R = 2 * inv_freq.numel()
    ang = (pos.float()[:, None] * inv_freq.float()[None, :]).reshape(-1, *([1] * (y.dim() - 2)), R // 2)
    a, b = y[..., -R::2], y[..., -R + 1 :: 2]
    out = y.clone()
    out[..., -R::2] = a * torch.cos(ang) - b * torch.sin(ang)
    out[..., -R + 1 :: 2] = a * torch.sin(ang) + b * torch.cos(ang)
    return out


def q_norm_rope(q, pos, inv_freq, eps: float):
    """q [B, H, D]: per-head RMSNorm (no weight), RoPE on the last R dims."""
    return _rope(_rms(q.float(), eps), pos, inv_freq)


def _fp8_e4m3(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    xb = x.reshape(*x.shape[:-1], -1, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    m, e = torch.frexp(amax / 448.0)
    scale = torch.ldexp(torch.ones_like(amax), torch.where(m == 0.5, e - 1, e))  # 2^ceil(log2(amax/448))
    q = (xb / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(x.shape)


def kv_norm_rope_fp8(kv, weight, pos, inv_freq, eps: float):
    """kv [B, D]: RMSNorm with weight, RoPE on the last R dims, FP8 E4M3 round trip of the first D - R."""
    R = 2 * inv_freq.numel()
    y = _rope(_rms(kv.float(), eps) * weight.float(), pos, inv_freq)
    return torch.cat([_fp8_e4m3(y[:, :-R]), y[:, -R:]], dim=-1)


def router_topk(logits, bias, k: int, scale: float, normalize: bool = True):
    """(ids [B, k] int32, weights [B, k]): top-k of sqrt(softplus) + bias, ties to the lower id."""
    prob = torch.nn.functional.softplus(logits.float()).sqrt()
    sel = prob if bias is None else prob + bias.float()
    ids = sel.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    w = prob.gather(1, ids)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return ids.to(torch.int32), w * scale
