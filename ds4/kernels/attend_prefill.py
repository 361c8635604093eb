"""Prefill attention of one chunk: each query over its raw window and its gathered compressed rows, in place.

Legend: T queries of the chunk, H heads, D = head_dim, N raw rows, W = window, C compressed rows, k
compressed rows listed per query (indexer top-k, or all C), BH heads per program, BN keys per inner block.

  attend_prefill(q, raw, raw_p0, p0, window, comp, comp_idx, comp_valid, sinks, scale, dtype=None)
      -> o [T, H, D] f32
      query t (position p0 + t) sees the raw rows at positions (p0 + t - window, p0 + t] that exist in raw
      (raw [N, D] holds positions raw_p0 .. raw_p0 + N - 1), plus the compressed rows comp[comp_idx[t, j]]
      where comp_valid[t, j] (comp_idx None: none); keys = values (one shared KV head); one sink logit per
      head only enlarges the softmax denominator. o is before the inverse RoPE (the caller applies it).

This is the contract of ds4.model.cuda.layer._sink_attention_chunk (with scale = D**-0.5 there): products in
`dtype` (bf16 at Flash size: bf16 operands, f32 accumulation, f32 softmax; f32: exact products), but with no
gathered [T, k, D] keys, no [T, H, n] scores and one launch: program (t, head block) runs an online softmax
over the window's rows, then over its compressed rows block by block through comp_idx. An entry of comp_idx
that is invalid (comp_valid False) or out of 0..C-1 is never read.

Dispatches to Triton on CUDA tensors (or under TRITON_INTERPRET=1) and to the torch twin
`attend_prefill_ref` elsewhere. Positions are host ints; comp_idx / comp_valid are read on the device.
"""

from __future__ import annotations

import os

import torch

SCORE_BUDGET = 1 << 24  # elements of one query block's scores / gathered keys in the torch twin


# =========================================================================================================
# Torch twin: the CPU path and a readable statement of the math (dense per query block).


def attend_prefill_ref(
    q: torch.Tensor,
    raw: torch.Tensor,
    raw_p0: int,
    p0: int,
    window: int,
    comp: torch.Tensor | None,
    comp_idx: torch.Tensor | None,
    comp_valid: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Torch twin of attend_prefill (same signature and result, up to the order of f32 sums)."""
    dtype = dtype or q.dtype
    T, H, D = q.shape
    N = raw.shape[0]
    k = 0 if comp_idx is None else comp_idx.shape[1]
    out = torch.empty(T, H, D, device=q.device, dtype=torch.float32)
    block = max(1, min(T, SCORE_BUDGET // (H * (window + k + 1) + k * D)))
    kp = raw_p0 + torch.arange(N, device=q.device)  # [N] positions of the raw rows
    for a in range(0, T, block):
        b = min(T, a + block)
        pos = p0 + torch.arange(a, b, device=q.device)  # [B]
        vis = (kp[None, :] <= pos[:, None]) & (kp[None, :] > pos[:, None] - window)  # [B, N]
        lo = max(0, p0 + a - window + 1 - raw_p0)  # the rows any query of the block may see
        hi = max(lo, min(N, p0 + b - raw_p0))
        keys = raw[lo:hi].to(dtype)[None].expand(b - a, -1, -1)  # [B, n, D]
        valid = vis[:, lo:hi]
        if k:
            idx = comp_idx[a:b]
            ok = comp_valid[a:b] & (idx >= 0) & (idx < comp.shape[0])  # [B, k]
            kc = comp[idx.clamp(0, comp.shape[0] - 1)].to(dtype)  # [B, k, D]
            keys = torch.cat([keys, kc.masked_fill(~ok[..., None], 0)], dim=1)
            valid = torch.cat([valid, ok], dim=1)
        keys = keys.float()  # exact products of the rounded operands, f32 sums (like the kernel's dots)
        s = torch.einsum("thd,tnd->thn", q[a:b].to(dtype).float(), keys) * scale  # [B, H, n]
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        s = torch.cat([s, sinks.float()[None, :, None].expand(b - a, H, 1)], dim=-1)
        p = s.softmax(-1)[..., :-1]  # the sink column only enlarges the denominator
        out[a:b] = torch.einsum("thn,tnd->thd", p.to(dtype).float(), keys)
    return out


# =========================================================================================================
# Dispatcher


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_args(q, raw, raw_p0, p0, window, comp, comp_idx, comp_valid, sinks) -> None:
    _check(q.ndim == 3, f"attend_prefill: q must be [T, H, D], got {tuple(q.shape)}")
    T, H, D = q.shape
    _check(
        raw.ndim == 2 and raw.shape[1] == D, f"attend_prefill: raw must be [N, {D}], got {tuple(raw.shape)}"
    )
    _check(tuple(sinks.shape) == (H,), f"attend_prefill: sinks must be [{H}], got {tuple(sinks.shape)}")
    _check(window > 0, f"attend_prefill: window must be > 0, got {window}")
    _check(raw_p0 <= p0, f"attend_prefill: raw_p0 ({raw_p0}) must be <= p0 ({p0})")
    _check(
        raw_p0 + raw.shape[0] >= p0 + T,
        f"attend_prefill: raw must reach the last query: raw_p0 + N = {raw_p0 + raw.shape[0]} < p0 + T = "
        f"{p0 + T}",
    )
    if comp_idx is None:
        return
    _check(comp is not None, "attend_prefill: comp_idx given without comp")
    _check(
        comp.ndim == 2 and comp.shape[1] == D,
        f"attend_prefill: comp must be [C, {D}], got {tuple(comp.shape)}",
    )
    _check(
        comp_idx.ndim == 2 and comp_idx.shape[0] == T,
        f"attend_prefill: comp_idx must be [{T}, k], got {tuple(comp_idx.shape)}",
    )
    _check(
        comp_valid is not None and tuple(comp_valid.shape) == tuple(comp_idx.shape),
        f"attend_prefill: comp_valid must be {tuple(comp_idx.shape)} like comp_idx, got "
        f"{None if comp_valid is None else tuple(comp_valid.shape)}",
    )


def attend_prefill(
    q: torch.Tensor,
    raw: torch.Tensor,
    raw_p0: int,
    p0: int,
    window: int,
    comp: torch.Tensor | None,
    comp_idx: torch.Tensor | None,
    comp_valid: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """q [T, H, D] at positions p0.. over raw [N, D] (positions raw_p0..) and comp [C, D] rows comp_idx [T, k]
    where comp_valid [T, k] (comp_idx None: no compressed rows), sinks [H] -> o [T, H, D] f32.

    dtype: the products' precision (None: q's dtype); bf16 -> bf16 operands with f32 accumulation."""
    _check_args(q, raw, raw_p0, p0, window, comp, comp_idx, comp_valid, sinks)
    return attend_prefill_ref(q, raw, raw_p0, p0, window, comp, comp_idx, comp_valid, sinks, scale, dtype)


__all__ = ["attend_prefill", "attend_prefill_ref"]
