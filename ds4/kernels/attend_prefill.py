"""Prefill attention of one chunk: each query over its raw window and its gathered compressed rows, in place.

Legend: T queries of the chunk, H heads, D = head_dim, N raw rows, W = window, C compressed rows, k
compressed rows listed per query (indexer top-k, or all C), BH heads per program, BN keys per inner block.

  attend_prefill(q, raw, raw_p0, p0, window, comp, comp_idx, comp_valid, sinks, scale, dtype=None, cfg=None)
      -> o [T, H, D] f32
      query t (position p0 + t) sees the raw rows at positions (p0 + t - window, p0 + t] that exist in raw
      (raw [N, D] holds positions raw_p0 .. raw_p0 + N - 1), plus the compressed rows comp[comp_idx[t, j]]
      where comp_valid[t, j] (comp_idx None: none); keys = values (one shared KV head); one sink logit per
      head only enlarges the softmax denominator. o is before the inverse RoPE (the caller applies it).

This is the contract of ds4.model.cuda.layer._sink_attention_chunk (with scale = D**-0.5 there): products in
`dtype` (bf16 at Flash size: bf16 operands, f32 accumulation, f32 softmax; f32: exact products), but with no
gathered [T, k, D] keys, no [T, H, n] scores and one launch: program (t, head block) runs an online softmax
over the window's rows, then over its compressed rows block by block through comp_idx, up to its last valid
entry. An entry of comp_idx that is invalid (comp_valid False) or out of 0..C-1 is never read (an
out-of-range valid entry is skipped, where the torch path would fail). Tiling: PrefillConfig (cfg), default
PREFILL_CFG, chosen from sm_90 builds (no register spills at D 512), not yet from timings.

In the model (ds4.model.cuda.layer.attention_prefill) the call is
  attend_prefill(q, raw, p0 - n_prev, p0, W, comp, idx, valid, w.sinks, D**-0.5, dtype=dtype)
in place of _sink_attention_chunk(q, raw, p0 - n_prev, positions, W, comp, idx, valid, w.sinks, dtype).

Dispatches to Triton on CUDA tensors (or under TRITON_INTERPRET=1) and to the torch twin
`attend_prefill_ref` elsewhere. Positions are host ints; comp_idx / comp_valid are read on the device.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .dispatch import require as _check
from .dispatch import use_triton as _use_triton

SCORE_BUDGET = 1 << 24  # elements of one query block's scores / gathered keys in the torch twin


class PrefillConfig(NamedTuple):
    """Tiling of the kernel (tune on the H200 with tools/gpu/bench_attend_prefill.py)."""

    bh: int  # heads per program (>= 16, the smallest dot; fewer heads are masked)
    bn: int  # keys per inner block
    warps: int
    stages: int  # software-pipeline stages of the key loops


# sm_90 builds at D 512 (bf16): bh32 bn32 w8 s2 199 regs, bh16 bn16 w4 s2 165 regs, no spills; bh16 bn32 w4
# and bh64 spill. bh32 halves the L2 reads of the gathered rows (4096 x 640 rows of 1 KB per head block).
PREFILL_CFG = PrefillConfig(bh=32, bn=32, warps=8, stages=2)
VALID_BLOCK = 128  # comp_valid entries per step of the pass that finds each query's last valid one
LOG2E = math.log2(math.e)


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
# Triton kernel: program (query t, head block), online softmax in base 2 (scores pre-scaled by log2 e).


@triton.jit
def _round_to(x, dt: tl.constexpr, RTNE_BY_HAND: tl.constexpr):
    """x f32 -> dt rounded to nearest even. The GPU's cast does that; Triton 3.6's interpreter truncates, so
    there (RTNE_BY_HAND, bf16 only) the rounding is done on the bits first (finite x)."""
    if RTNE_BY_HAND:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        x = u.to(tl.float32, bitcast=True)
    return x.to(dt)


@triton.jit
def _online_step(q, kv, vis, m_i, l_i, acc, qk_scale, PREC: tl.constexpr, RTNE_BY_HAND: tl.constexpr):
    """Fold one key block kv [BN, BD] (visible where vis [BN]) into the running max m_i / sum l_i [BH] and
    output acc [BH, BD]. Invisible keys were loaded as 0 and score -inf; a block with nothing visible so far
    uses 0 as its max (no inf - inf)."""
    s = tl.dot(q, tl.trans(kv), input_precision=PREC) * qk_scale  # [BH, BN] log2 units
    s = tl.where(vis[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pk = _round_to(p, kv.dtype, RTNE_BY_HAND)  # p rounded like the keys (as the model's torch path does)
    acc = acc * alpha[:, None] + tl.dot(pk, kv, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _comp_entries(idx_ptr, valid_ptr, t, j0, n_end, C, s_it, s_ik, s_vt, s_vk, BN: tl.constexpr):
    """(rows c [BN] i64, usable [BN]) of entries j0.. of query t: valid, before n_end, and inside comp."""
    j = j0 + tl.arange(0, BN)
    jm = j < n_end
    c = tl.load(idx_ptr + t * s_it + j * s_ik, mask=jm, other=0).to(tl.int64)
    ok = tl.load(valid_ptr + t * s_vt + j * s_vk, mask=jm, other=0) != 0
    return c, ok & jm & (c >= 0) & (c < C)


@triton.jit
def _prefill_kernel(
    q_ptr, raw_ptr, comp_ptr, idx_ptr, valid_ptr, sink_ptr, out_ptr,
    H, D, C, K, raw_off, window, qk_scale, s_it, s_ik, s_vt, s_vk,
    HAS_COMP: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
    BD: tl.constexpr, PREC: tl.constexpr, RTNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """Program (t, head block), head blocks of one query adjacent (they read the same rows, through L2).

    Query t is raw row raw_off + t; it sees raw rows max(0, that - window + 1) .. that, then the entries j
    of comp_idx[t] with comp_valid[t, j] and 0 <= comp_idx[t, j] < C. q is read in its own dtype and cast to
    the keys' (the products' precision). out[t, h] = acc / (l + e^(sink_h - m)) in base 2."""
    n_hb = tl.cdiv(H, BH)
    t32 = tl.program_id(0) // n_hb  # i32 loop bounds below (the software pipeliner wants them)
    t = t32.to(tl.int64)
    h = (tl.program_id(0) % n_hb) * BH + tl.arange(0, BH)
    hm = h < H
    d = tl.arange(0, BD)
    dm = d < D
    kdt = raw_ptr.dtype.element_ty
    q = tl.load(q_ptr + (t * H + h)[:, None] * D + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    q = _round_to(q.to(tl.float32), kdt, RTNE_BY_HAND)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BD], tl.float32)
    last = t32 + raw_off  # the query's own raw row
    for j0 in range(tl.maximum(last - window + 1, 0), last + 1, BN):
        j = j0 + tl.arange(0, BN)
        vis = j <= last
        kv = tl.load(raw_ptr + j[:, None] * D + d[None, :], mask=vis[:, None] & dm[None, :], other=0.0)
        m_i, l_i, acc = _online_step(q, kv, vis, m_i, l_i, acc, qk_scale, PREC, RTNE_BY_HAND)
    if HAS_COMP:
        # the loop stops after the last valid entry (the indexer lists invalid ones last; causal validity
        # over every row is a prefix): a bound, not a branch in the loop, so the loads stay pipelined
        n = tl.zeros([BV], tl.int32)
        for j0 in range(0, K, BV):
            j = j0 + tl.arange(0, BV)
            v = tl.load(valid_ptr + t * s_vt + j * s_vk, mask=j < K, other=0)
            n = tl.maximum(n, tl.where(v != 0, j + 1, 0))
        n_end = tl.max(n, axis=0)
        c, ok = _comp_entries(idx_ptr, valid_ptr, t, 0, n_end, C, s_it, s_ik, s_vt, s_vk, BN)
        for j0 in range(0, n_end, BN):
            # the next block's entries are read one step ahead: the row gather then depends on loop-carried
            # values only, which lets the software pipeliner turn it into asynchronous copies
            c_next, ok_next = _comp_entries(
                idx_ptr, valid_ptr, t, j0 + BN, n_end, C, s_it, s_ik, s_vt, s_vk, BN
            )
            kv = tl.load(comp_ptr + c[:, None] * D + d[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
            m_i, l_i, acc = _online_step(q, kv, ok, m_i, l_i, acc, qk_scale, PREC, RTNE_BY_HAND)
            c, ok = c_next, ok_next
    sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32) * 1.4426950408889634  # log2 units
    big = tl.maximum(m_i, sink)  # finite: the sink is
    w = tl.exp2(m_i - big)  # 0 when no key was visible
    o = acc * (w / (l_i * w + tl.exp2(sink - big)))[:, None]
    tl.store(out_ptr + (t * H + h)[:, None] * D + d[None, :], o, mask=hm[:, None] & dm[None, :])


def _prefill_triton(q, raw, raw_p0, p0, window, comp, comp_idx, comp_valid, sinks, scale, dtype, cfg):
    T, H, D = q.shape
    for name, v in (("bh", cfg.bh), ("bn", cfg.bn)):  # tl.dot's smallest tile on the GPU is 16
        ok = v >= 16 and v & (v - 1) == 0
        _check(ok, f"attend_prefill: cfg.{name} must be a power of two >= 16, got {v}")
    out = torch.empty(T, H, D, device=q.device, dtype=torch.float32)
    if T == 0:
        return out
    raw = raw.to(dtype).contiguous()  # small ([N, D], [C, D]): cast once, read many times
    has_comp = comp_idx is not None and comp_idx.shape[1] > 0 and comp.shape[0] > 0
    if has_comp:
        comp = comp.to(dtype).contiguous()
        valid = comp_valid.view(torch.uint8)  # strided views (e.g. a broadcast arange) are read as they are
        C, K = comp.shape[0], comp_idx.shape[1]
        strides = (*comp_idx.stride(), *valid.stride())
    else:
        comp, comp_idx, valid, C, K, strides = raw, raw, raw, 0, 0, (0, 0, 0, 0)
    BH = max(16, min(cfg.bh, triton.next_power_of_2(H)))
    _prefill_kernel[(T * triton.cdiv(H, BH),)](
        q.contiguous(), raw, comp, comp_idx, valid, sinks.float().contiguous(), out,
        H, D, C, K, p0 - raw_p0, window, float(scale) * LOG2E, *strides,
        HAS_COMP=has_comp, BV=VALID_BLOCK, BH=BH, BN=cfg.bn,
        BD=max(16, triton.next_power_of_2(D)), PREC="ieee" if dtype == torch.float32 else "tf32",
        RTNE_BY_HAND=dtype == torch.bfloat16 and not q.is_cuda,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out


# =========================================================================================================
# Dispatcher


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
    cfg: PrefillConfig | None = None,
) -> torch.Tensor:
    """q [T, H, D] at positions p0.. over raw [N, D] (positions raw_p0..) and comp [C, D] rows comp_idx [T, k]
    where comp_valid [T, k] (comp_idx None: no compressed rows), sinks [H] -> o [T, H, D] f32.

    dtype: the products' precision (None: q's dtype); bf16 -> bf16 operands with f32 accumulation.
    cfg: the kernel's tiling (None: PREFILL_CFG)."""
    _check_args(q, raw, raw_p0, p0, window, comp, comp_idx, comp_valid, sinks)
    dtype = dtype or q.dtype
    _check(
        dtype in (torch.float32, torch.bfloat16),
        f"attend_prefill: dtype must be float32 or bfloat16, got {dtype}",
    )
    if _use_triton(q):
        args = (q, raw, raw_p0, p0, window, comp, comp_idx, comp_valid, sinks, scale, dtype)
        return _prefill_triton(*args, cfg or PREFILL_CFG)
    return attend_prefill_ref(q, raw, raw_p0, p0, window, comp, comp_idx, comp_valid, sinks, scale, dtype)


__all__ = ["PREFILL_CFG", "PrefillConfig", "attend_prefill", "attend_prefill_ref"]
