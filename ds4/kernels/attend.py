"""Decode attention and indexer scores reading the KV pool buffers in place (no gathered / concatenated keys).

Legend: B rows of the step, S pool slots, H heads, D = head_dim, W = window (raw ring rows), cap =
compressed-row capacity, k = indexer top-k, n = W + k (or W + cap) keys of a row, P = RoPE pairs (n_rot = 2P,
the tail of each row), Hi/Di indexer heads/dim, NS key splits.

  attend_decode(q, raw, slot, pos, comp, comp_idx, ratio, sinks, scale, inv_freq) -> o [B, H, D]
      row b attends over the W ring rows raw[slot[b]] (ring row j holds position pos - ((pos - j) mod W),
      visible iff >= 0) and the compressed rows comp[slot[b], comp_idx[b]] (or all cap rows when comp_idx is
      None; row c visible iff c < (pos + 1) // ratio), keys = values (one shared KV head), softmax with one
      sink logit per head that only enlarges the denominator; the output is de-rotated (inverse RoPE at pos).
      2 launches (flash-decoding): programs (row, key split, head block) keep a running max / sum / output
      over their keys; one program per (row, head) merges the splits (log-sum-exp), adds the sink, de-rotates.
  indexer_scores(qi, wts, rows, slot, count) -> [B, cap]
      score[b, c] = sum_h relu(qi[b, h] . rows[slot[b], c]) * wts[b, h], -inf for c >= count[b]. 1 launch;
      blocks past count[b] read nothing.

Each dispatches to Triton on CUDA tensors (or under TRITON_INTERPRET=1) and to its torch twin
(`attend_decode_ref`, `indexer_scores_ref`) elsewhere. f32 throughout with exact products (tl.dot with
input_precision "ieee", i.e. FMA, never TF32); slot / pos / indices are read on the device (no host sync,
CUDA-graph capturable); the launch grids depend only on shapes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .dispatch import PDL, pdl_wait
from .dispatch import require as _check
from .dispatch import use_triton as _use_triton
from .matvec import _split_bf16, _split_counters

# Tiling (to be tuned on the H200): heads per program, keys per inner block, splits aimed at this many
# programs in all (about two per SM), rows per indexer program and per inner dot.
ATTEND_BH = 16
ATTEND_BN = 32  # bf16x3 at B = 32, 8k (bench_attend.py, H200): ratio-4 layer 154 us vs 231 at 16; B = 1 equal
ATTEND_BN_FMA = 16  # the FMA dots ("ieee"): at 32 keys they spill (808 B per thread on sm_90)
# bf16x3 keys per block where every compressed row is read (no index: the ratio-128 layers): bench_attend.py
# (session 8, B = 32, 8k) timed such a layer at 103.1 us with 16 keys vs 143.5 with 32 (ratio-4: 231.6 vs
# 156.7), B = 1 launch-bound there; in the model (session 9, B = 32 step at 8k, batch_check.py) 63.98 ms
# with 16 vs 63.17 with 32: ATTEND_BN. Env DS4_ATTEND_BN_DENSE.
ATTEND_BN_DENSE = int(os.environ.get("DS4_ATTEND_BN_DENSE", str(ATTEND_BN)))
ATTEND_PROGRAMS = 264
ATTEND_WARPS = 8
# Warps of the merge of the key splits (one program a (row, head): NS partials of a 512-wide row). H200,
# session 19 (ab_decode.py at 4k ctx): 2 warps 133.51 vs 133.27 tok/s (x1.002, noise): 4 stays;
# tools/gpu/ab_decode.py "merge w2". Env DS4_ATTEND_MERGE_WARPS.
MERGE_WARPS = int(os.environ.get("DS4_ATTEND_MERGE_WARPS", "4"))
# Key splits the merge reads per step (a power of two): at 1 each split's partials are a serial L2 round
# trip of their own (B = 1 at 4k: 20 splits, two passes, ~40 trips; the H200 profile gives the merge 5.6 us
# a call, 43 a token, on the step's critical path). Session 18 built the chunked reads (CPU tests: the same
# sums up to f32 order); H200, session 19 (ab_decode.py at 4k ctx, 2 rounds): 4 / 8 splits a step 134.58 /
# 133.56 vs 133.27 tok/s (x1.010 / x1.002); B = 1 / 8 / 32 steps at 8k with 8: x1.010 / x0.992 / x0.990
# (batch_check.py). Within noise at B = 1 and slower batched: 1 stays. tools/gpu/ab_decode.py "merge ch4" /
# "merge ch8". Env DS4_ATTEND_MERGE_CH.
MERGE_CH = int(os.environ.get("DS4_ATTEND_MERGE_CH", "1"))
INDEX_BC = 64
INDEX_BCI = 16
INDEX_WARPS = 8
# Precision of the in-kernel dots: "ieee" (exact f32 products, FMA on sm_90). "tf32x3" (tensor cores, about
# f32 accurate) compiles but spills kilobytes per thread at these tiles: it would need its own tiling.
DOT_PRECISION = "ieee"
# The indexer's query and rows are FP4-QAT'd (model.md §7: E2M1 values times power-of-two block scales, at
# most two significant bits), so they are exact in bf16 and their bf16 products exact in f32: the indexer dot
# runs on the tensor cores at no cost in accuracy (the FMA "ieee" dot took ~42 us per call at 8k context on
# the H200). Other inputs get bf16-rounded operands, in the twin as in the kernel. Env DS4_INDEX_BF16=0: f32.
INDEX_BF16 = os.environ.get("DS4_INDEX_BF16", "1") != "0"
# Precision of attend_decode's two dots (scores q.k, output p.v): DOT_PRECISION, or "bf16x3": on the tensor
# cores with each f32 operand split into bf16 hi + lo parts, a.b ~ a_hi.b_hi + a_hi.b_lo + a_lo.b_hi with f32
# accumulation (relative error ~2^-16 per product instead of 2^-24; the keys' 448 FP8-simulated dims are
# exact in bf16, so there their lo part is zero). The FMA dot is the bound of the kernel: on the H200 a
# B = 32 step at 8k spent 25.9 ms of 99.6 in it (profile_batch.py, no PDL; 254 registers, one program per SM).
# Default on CUDA: bench_attend.py, ratio-4 layer at 8k, B = 32 1,005 -> 231 us (154 at ATTEND_BN 32), B = 1
# 77.7 -> 63.3 us, error vs the f32 twin 4-7e-6 of the output scale; whole model 88.71 -> 96.39 tok/s at B = 1
# (ab_decode.py), a B = 32 step 98.34 -> 80.55 ms (batch_check.py); the official cases pass with it. Env
# DS4_ATTEND_PREC=ieee: the FMA dots.
ATTEND_PREC = os.environ.get("DS4_ATTEND_PREC", "bf16x3")
# The merge of the key splits done by the last split program of each (row, head block) (an atomic counter
# per tile, as the Q8_0 kernels' split-K fixup) instead of a second launch: one launch less per layer (the
# merge kernel took 0.32 ms of a B = 1 step's kernel time, ~7 us a call). Slower on the H200: whole model
# 93.90 -> 79.93 tok/s at 4k (ab_decode.py, session 8), so off; env DS4_ATTEND_FUSED_MERGE=1: on.
FUSED_MERGE = os.environ.get("DS4_ATTEND_FUSED_MERGE", "0") == "1"

# =========================================================================================================
# Torch twins: the CPU path and the tests' oracles. They build exactly what attention_decode_batch built
# before (gathered keys + validity, then a dense softmax), in plain f32 torch.


def _rope_inverse(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Inverse RoPE of x [B, H, D] at pos [B] on the GPT-J adjacent pairs of the last 2P dims."""
    R = 2 * inv_freq.numel()
    ang = pos.float()[:, None] * inv_freq.float()[None, :]  # [B, P]
    c, s = torch.cos(ang)[:, None, :], -torch.sin(ang)[:, None, :]  # [B, 1, P]
    tail = x[..., -R:].unflatten(-1, (-1, 2))
    a, b = tail[..., 0], tail[..., 1]
    rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    return torch.cat([x[..., :-R], rot], dim=-1)


def _decode_keys(raw, slot, pos, comp, comp_idx, ratio: int):
    """(keys [B, n, D], valid [B, n]) of each row: its W ring rows, then its compressed rows."""
    W = raw.shape[1]
    ar = torch.arange(W, device=pos.device)
    ring_pos = pos[:, None] - torch.remainder(pos[:, None] - ar[None, :], W)  # [B, W] position per ring row
    keys, valid = [raw.index_select(0, slot)], [ring_pos >= 0]
    if comp is not None:
        cap = comp.shape[1]
        rows_valid = torch.arange(cap, device=pos.device)[None, :] < ((pos + 1) // ratio)[:, None]  # [B, cap]
        if comp_idx is None:
            keys.append(comp.index_select(0, slot))  # [B, cap, D]
            valid.append(rows_valid)
        else:
            flat = (slot[:, None] * cap + comp_idx).reshape(-1)  # [B k]
            keys.append(comp.reshape(-1, comp.shape[2]).index_select(0, flat).view(*comp_idx.shape, -1))
            valid.append(rows_valid.gather(1, comp_idx))
    return torch.cat(keys, dim=1).float(), torch.cat(valid, dim=1)


def attend_decode_ref(q, raw, slot, pos, comp, comp_idx, ratio: int, sinks, scale: float, inv_freq):
    """Torch twin of attend_decode (same signature and result)."""
    keys, valid = _decode_keys(raw, slot, pos, comp, comp_idx, ratio)
    B, H, _ = q.shape
    s = torch.bmm(q.float(), keys.transpose(1, 2)) * scale  # [B, H, n]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    s = torch.cat([s, sinks.float()[None, :, None].expand(B, H, 1)], dim=2)
    p = s.softmax(-1)[..., :-1]
    # invisible keys may hold anything (stale or scratch rows): zero them so that 0 * inf cannot occur
    o = torch.bmm(p, keys.masked_fill(~valid[:, :, None], 0.0))
    return _rope_inverse(o, pos, inv_freq)


def _index_operand(t: torch.Tensor) -> torch.Tensor:
    """An indexer dot operand as the kernel reads it: f32, rounded to bf16 first when INDEX_BF16."""
    return (t.to(torch.bfloat16) if INDEX_BF16 else t).float()


def indexer_scores_ref(qi, wts, rows, slot, count, wscale: float = 1.0):
    """Torch twin of indexer_scores (same signature and result)."""
    r = _index_operand(rows.index_select(0, slot))  # [B, cap, Di]
    score = torch.einsum("bhd,bcd->bhc", _index_operand(qi), r).relu()
    score = torch.einsum("bhc,bh->bc", score, wts.float() * wscale)
    cap = rows.shape[1]
    return score.masked_fill(torch.arange(cap, device=count.device)[None, :] >= count[:, None], float("-inf"))


# =========================================================================================================
# attend_decode: partial softmax-attention over key splits, then the merge.


@triton.jit
def _dot3(a_hi, a_lo, b_hi, b_lo, acc):
    """acc + a @ b from split operands (_split_bf16): three bf16 tensor-core dots, f32 accumulation."""
    acc = tl.dot(a_hi, b_lo, acc)
    acc = tl.dot(a_lo, b_hi, acc)
    return tl.dot(a_hi, b_hi, acc)  # the large term last: the small ones are not rounded away early


@triton.jit
def _merge_heads(pm_ptr, pl_ptr, po_ptr, sink_ptr, inv_ptr, out_ptr, b, h, hm, pos, NS, H, D, R,
                 BH: tl.constexpr, BP: tl.constexpr, CH: tl.constexpr = 1):  # fmt: skip
    """Merge the key splits of heads h [BH] of row b: o = sum_s e^(m_s - M) acc_s / (e^(sink - M) +
    sum_s e^(m_s - M) l_s) with M the max of the m_s and the sink, then inverse RoPE at pos on the last R
    dims; each row handled as its BP adjacent pairs (even, odd dims). Run by _attend_merge (one head per
    program) or by the last split program of a head block (FUSED_MERGE); the partials are read from L2
    (.cg: other programs' stores), CH splits a step (MERGE_CH: fewer serial L2 round trips), in split
    order."""
    sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32)
    big = sink
    kk = tl.arange(0, CH)
    for k0 in range(0, NS, CH):
        km = hm[:, None] & ((k0 + kk) < NS)[None, :]  # [BH, CH]
        m = tl.load(pm_ptr + (b * NS + k0 + kk)[None, :] * H + h[:, None], mask=km, other=float("-inf"),
                    cache_modifier=".cg")  # fmt: skip
        big = tl.maximum(big, tl.max(m, axis=1))
    den = tl.exp(sink - big)
    i = tl.arange(0, BP)
    im = 2 * i < D
    mask = hm[:, None] & im[None, :]
    a = tl.zeros([BH, BP], tl.float32)  # even dims
    c = tl.zeros([BH, BP], tl.float32)  # odd dims
    for k0 in range(0, NS, CH):
        km = hm[:, None] & ((k0 + kk) < NS)[None, :]  # [BH, CH]
        part = (b * NS + k0 + kk)[None, :] * H + h[:, None]
        wk = tl.exp(tl.load(pm_ptr + part, mask=km, other=float("-inf"), cache_modifier=".cg") - big[:, None])
        den += tl.sum(wk * tl.load(pl_ptr + part, mask=km, other=0.0, cache_modifier=".cg"), axis=1)
        row = po_ptr + part[:, :, None] * D + 2 * i[None, None, :]  # [BH, CH, BP]
        m3 = km[:, :, None] & im[None, None, :]
        a += tl.sum(wk[:, :, None] * tl.load(row, mask=m3, other=0.0, cache_modifier=".cg"), axis=1)
        c += tl.sum(wk[:, :, None] * tl.load(row + 1, mask=m3, other=0.0, cache_modifier=".cg"), axis=1)
    a = a / den[:, None]
    c = c / den[:, None]
    jr = i - (D - R) // 2  # rotated pair index, < 0 in the nope part
    rot = jr >= 0
    # f32(pos) * inv rounded to f32, like every RoPE of the model (spec/model.md §4, the official recipe):
    # f64 angles drift from it (~4e-4 rad at pos 65535)
    ang = pos.to(tl.float32) * tl.load(inv_ptr + jr, mask=rot & im, other=0.0)
    cs = tl.where(rot, tl.cos(ang), 1.0)[None, :]
    sn = tl.where(rot, tl.sin(ang), 0.0)[None, :]
    out = out_ptr + (b * H + h)[:, None] * D + 2 * i[None, :]
    tl.store(out, a * cs + c * sn, mask=mask)  # rotation by -ang
    tl.store(out + 1, c * cs - a * sn, mask=mask)


@triton.jit
def _attend_partial(
    q_ptr, raw_ptr, comp_ptr, idx_ptr, slot_ptr, pos_ptr, pm_ptr, pl_ptr, po_ptr,
    sink_ptr, inv_ptr, out_ptr, cnt_ptr,
    H, D, W, cap, NC, ratio, scale, blocks_per_split, R,
    HAS_COMP: tl.constexpr, HAS_IDX: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, MERGE: tl.constexpr, BP: tl.constexpr,
):  # fmt: skip
    """Program (b, split, head block): running max m, sum l and output acc over the split's keys.

    Key j < W is ring row j (visible iff j <= pos: below W the ring is not yet full); key j >= W is
    compressed row c = comp_idx[b, j - W] (or j - W), visible iff c < (pos + 1) // ratio. Invisible keys are
    never loaded (masked to 0) and score -inf. Writes pm/pl [B, NS, H] and po [B, NS, H, D]; MERGE: the
    last split of each (b, head block) (counter cnt_ptr[b * head blocks + block]) then merges them into
    out [B, H, D] (_merge_heads) and re-arms the counter."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    b = tl.program_id(0)
    sp = tl.program_id(1)
    NS = tl.num_programs(1)
    h = tl.program_id(2) * BH + tl.arange(0, BH)
    hm = h < H
    d = tl.arange(0, BD)
    dm = d < D
    q = tl.load(q_ptr + (b * H + h)[:, None] * D + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    if PREC == "bf16x3":
        q_hi, q_lo = _split_bf16(q)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int32)  # < 2^31; 32-bit: an int64 division is a subroutine call
    n_keys = W + NC
    count = pos * 0
    if HAS_COMP:
        count = (pos + 1) // ratio
        if not HAS_IDX:  # rows past count are all invisible: stop there
            n_keys = W + tl.minimum(count, NC)
    j_lo = sp * blocks_per_split * BN
    j_hi = tl.minimum(j_lo + blocks_per_split * BN, n_keys)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BD], tl.float32)
    for j0 in range(j_lo, j_hi, BN):
        j = j0 + tl.arange(0, BN)
        vis = (j < W) & (j <= pos)
        row = raw_ptr + (slot * W + j) * D  # [BN] row pointers
        if HAS_COMP:
            i = j - W
            inc = (j >= W) & (i < NC)
            c = i
            if HAS_IDX:
                c = tl.load(idx_ptr + b * NC + i, mask=inc, other=0).to(tl.int32)
            cvis = inc & (c >= 0) & (c < count) & (c < cap)
            row = tl.where(j < W, row, comp_ptr + (slot * cap + c) * D)
            vis = vis | cvis
        # one load of the block's rows (two masked loads, ring + compressed, make ptxas spill heavily)
        kv = tl.load(row[:, None] + d[None, :], mask=vis[:, None] & dm[None, :], other=0.0).to(tl.float32)
        if PREC == "bf16x3":
            k_hi, k_lo = _split_bf16(kv)
            s = _dot3(q_hi, q_lo, tl.trans(k_hi), tl.trans(k_lo), tl.zeros([BH, BN], tl.float32))
        else:
            s = tl.dot(q, tl.trans(kv), input_precision=PREC)
        s = s * scale  # [BH, BN]
        s = tl.where(vis[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing visible yet: no NaN
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if PREC == "bf16x3":
            p_hi, p_lo = _split_bf16(p)
            acc = _dot3(p_hi, p_lo, k_hi, k_lo, acc * alpha[:, None])
        else:
            acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision=PREC)
        m_i = m_new
    part = (b * NS + sp) * H + h  # [BH]
    tl.store(pm_ptr + part, m_i, mask=hm)
    tl.store(pl_ptr + part, l_i, mask=hm)
    tl.store(po_ptr + part[:, None] * D + d[None, :], acc, mask=hm[:, None] & dm[None, :])
    if MERGE:
        tile = b * tl.num_programs(2) + tl.program_id(2)
        tl.debug_barrier()  # all threads' partial stores precede the release below
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")  # gpu scope: publishes, sees the others
        if done == NS - 1:
            _merge_heads(
                pm_ptr, pl_ptr, po_ptr, sink_ptr, inv_ptr, out_ptr, b, h, hm, pos, NS, H, D, R, BH, BP
            )
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")  # re-armed (kernel boundaries order it)


@triton.jit
def _attend_merge(
    pm_ptr, pl_ptr, po_ptr, sink_ptr, pos_ptr, inv_ptr, out_ptr, NS, H, D, R, BP: tl.constexpr,
    CH: tl.constexpr,
):  # fmt: skip
    """Program (b, h): _merge_heads of one head (the second launch when the merge is not fused), CH splits a
    step."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    b = tl.program_id(0)
    h = tl.program_id(1) + tl.arange(0, 1)  # [1]
    pos = tl.load(pos_ptr + b).to(tl.int32)
    _merge_heads(pm_ptr, pl_ptr, po_ptr, sink_ptr, inv_ptr, out_ptr, b, h, h < H, pos, NS, H, D, R, 1, BP, CH)


def _key_block(dense: bool = False) -> int:
    """Keys per inner block of _attend_partial at the current ATTEND_PREC; dense: all compressed rows read
    (no index)."""
    if ATTEND_PREC != "bf16x3":
        return ATTEND_BN_FMA
    return ATTEND_BN_DENSE if dense else ATTEND_BN


def _splits(B: int, H: int, n: int, bn: int) -> tuple[int, int]:
    """(NS, key blocks per split) for n keys in blocks of bn: enough programs to fill the GPU when B is
    small, never empty splits."""
    blocks = max(1, triton.cdiv(n, bn))
    per_row = B * triton.cdiv(H, ATTEND_BH)
    want = max(1, min(blocks, triton.cdiv(ATTEND_PROGRAMS, per_row)))
    per_split = triton.cdiv(blocks, want)
    return triton.cdiv(blocks, per_split), per_split


def _attend_triton(q, raw, slot, pos, comp, comp_idx, ratio, sinks, scale, inv_freq):
    B, H, D = q.shape
    W = raw.shape[1]
    cap = comp.shape[1] if comp is not None else 0
    NC = (comp_idx.shape[1] if comp_idx is not None else cap) if comp is not None else 0
    bn = _key_block(dense=comp is not None and comp_idx is None)
    NS, per_split = _splits(B, H, W + NC, bn)
    dev = q.device
    pm = torch.empty(B, NS, H, device=dev, dtype=torch.float32)
    pl = torch.empty(B, NS, H, device=dev, dtype=torch.float32)
    po = torch.empty(B, NS, H, D, device=dev, dtype=torch.float32)
    out = torch.empty(B, H, D, device=dev, dtype=torch.float32)
    if B == 0:
        return out
    q = q.float().contiguous()
    sinks, inv_freq, pos = sinks.float().contiguous(), inv_freq.float().contiguous(), pos.contiguous()
    n_hb = triton.cdiv(H, ATTEND_BH)
    cnt = _split_counters(dev, B * n_hb) if FUSED_MERGE else None  # None: the two-launch path
    _attend_partial[(B, NS, n_hb)](
        q, raw, comp if comp is not None else raw,
        comp_idx.contiguous() if comp_idx is not None else slot, slot.contiguous(), pos,
        pm, pl, po, sinks, inv_freq, out, pm if cnt is None else cnt,
        H, D, W, cap, NC, max(int(ratio), 1), float(scale), per_split, 2 * inv_freq.numel(),
        HAS_COMP=comp is not None, HAS_IDX=comp_idx is not None, BH=ATTEND_BH, BN=bn,
        BD=triton.next_power_of_2(D), PREC=ATTEND_PREC, MERGE=cnt is not None,
        BP=triton.next_power_of_2(D // 2), num_warps=ATTEND_WARPS, launch_pdl=PDL,
    )  # fmt: skip
    if cnt is None:
        _attend_merge[(B, H)](
            pm, pl, po, sinks, pos, inv_freq, out, NS, H, D, 2 * inv_freq.numel(),
            BP=triton.next_power_of_2(D // 2), CH=MERGE_CH, num_warps=MERGE_WARPS, launch_pdl=PDL,
        )  # fmt: skip
    return out


# =========================================================================================================
# indexer_scores: one launch, programs (row, block of compressed rows).


@triton.jit
def _indexer_kernel(
    qi_ptr, w_ptr, rows_ptr, slot_ptr, count_ptr, out_ptr, Hi, Di, cap, wscale,
    BH: tl.constexpr, BC: tl.constexpr, BCI: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
    BF16: tl.constexpr,
):  # fmt: skip
    """Program (b, block of BC rows): the row's query held once, its rows scored BCI at a time (a wider
    FMA dot spills on sm_90). Sub-blocks wholly past count[b] read nothing and store -inf. BF16: bf16
    operands on the tensor cores (exact for the QAT'd values, see INDEX_BF16), else PREC. The head weights
    are scaled by wscale on load (the torch multiply before the launch, folded in)."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    b = tl.program_id(0)
    count = tl.minimum(tl.load(count_ptr + b).to(tl.int32), cap)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    h = tl.arange(0, BH)
    hm = h < Hi
    d = tl.arange(0, BD)
    dm = d < Di
    qi = tl.load(qi_ptr + (b * Hi + h)[:, None] * Di + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    if BF16:
        qi = qi.to(tl.bfloat16)
    wts = tl.load(w_ptr + b * Hi + h, mask=hm, other=0.0) * wscale
    for k in range(0, BC // BCI):  # a loop, not unrolled: unrolled, ptxas spills
        c0 = tl.program_id(1) * BC + k * BCI
        c = c0 + tl.arange(0, BCI)
        score = tl.full([BCI], float("-inf"), tl.float32)
        if c0 < count:
            cm = c < count
            r = tl.load(
                rows_ptr + (slot * cap + c)[:, None] * Di + d[None, :],
                mask=cm[:, None] & dm[None, :],
                other=0.0,
            )
            if BF16:
                s = tl.maximum(tl.dot(qi, tl.trans(r.to(tl.bfloat16))), 0.0)  # [BH, BCI] f32
            else:
                s = tl.maximum(tl.dot(qi, tl.trans(r.to(tl.float32)), input_precision=PREC), 0.0)
            score = tl.where(cm, tl.sum(s * wts[:, None], axis=0), float("-inf"))
        tl.store(out_ptr + b * cap + c, score, mask=c < cap)


# =========================================================================================================
# Dispatchers


def _check_attend(q, raw, slot, pos, comp, comp_idx, ratio, sinks, inv_freq) -> None:
    _check(q.ndim == 3, f"attend_decode: q must be [B, H, D], got {tuple(q.shape)}")
    B, H, D = q.shape
    _check(
        raw.ndim == 3 and raw.shape[2] == D, f"attend_decode: raw must be [S, W, {D}], got {tuple(raw.shape)}"
    )
    _check(raw.is_contiguous(), "attend_decode: raw must be contiguous (the pool buffer is read in place)")
    _check(tuple(slot.shape) == (B,), f"attend_decode: slot must be [{B}], got {tuple(slot.shape)}")
    _check(tuple(pos.shape) == (B,), f"attend_decode: pos must be [{B}], got {tuple(pos.shape)}")
    _check(tuple(sinks.shape) == (H,), f"attend_decode: sinks must be [{H}], got {tuple(sinks.shape)}")
    R = 2 * inv_freq.numel()
    _check(0 < R <= D, f"attend_decode: 2 * len(inv_freq) = {R} must be in 1..{D}")
    _check(D % 2 == 0, f"attend_decode: head dim must be even (RoPE pairs), got {D}")
    if comp is None:
        _check(comp_idx is None, "attend_decode: comp_idx given without comp")
        return
    _check(ratio > 0, f"attend_decode: ratio must be > 0 with compressed rows, got {ratio}")
    _check(
        comp.ndim == 3 and comp.shape[0] == raw.shape[0] and comp.shape[2] == D,
        f"attend_decode: comp must be [{raw.shape[0]}, cap, {D}], got {tuple(comp.shape)}",
    )
    _check(comp.is_contiguous(), "attend_decode: comp must be contiguous (the pool buffer is read in place)")
    if comp_idx is not None:
        _check(
            comp_idx.ndim == 2 and comp_idx.shape[0] == B,
            f"attend_decode: comp_idx must be [{B}, k], got {tuple(comp_idx.shape)}",
        )


def attend_decode(
    q: torch.Tensor,
    raw: torch.Tensor,
    slot: torch.Tensor,
    pos: torch.Tensor,
    comp: torch.Tensor | None,
    comp_idx: torch.Tensor | None,
    ratio: int,
    sinks: torch.Tensor,
    scale: float,
    inv_freq: torch.Tensor,
) -> torch.Tensor:
    """q [B, H, D] (normed + RoPE'd) over each row's ring raw[slot[b]] [W, D] and compressed rows
    comp[slot[b]] [cap, D] (those listed in comp_idx [B, k], or all) -> de-rotated o [B, H, D] f32.

    slot/pos [B] int64 device tensors; sinks [H]; scale = D**-0.5 usually; inv_freq [P]."""
    _check_attend(q, raw, slot, pos, comp, comp_idx, ratio, sinks, inv_freq)
    if _use_triton(q):
        return _attend_triton(q, raw, slot, pos, comp, comp_idx, ratio, sinks, scale, inv_freq)
    return attend_decode_ref(q, raw, slot, pos, comp, comp_idx, ratio, sinks, scale, inv_freq)


def indexer_scores(
    qi: torch.Tensor,
    wts: torch.Tensor,
    rows: torch.Tensor,
    slot: torch.Tensor,
    count: torch.Tensor,
    wscale: float = 1.0,
) -> torch.Tensor:
    """qi [B, Hi, Di] (RoPE'd + QAT'd), wts [B, Hi] (times wscale: the head weights' constant scale, applied
    in the kernel instead of a launch of its own), rows [S, cap, Di] read at slot [B], count [B] visible rows
    -> scores [B, cap] f32 (-inf past count)."""
    _check(qi.ndim == 3, f"indexer_scores: qi must be [B, Hi, Di], got {tuple(qi.shape)}")
    B, Hi, Di = qi.shape
    _check(tuple(wts.shape) == (B, Hi), f"indexer_scores: wts must be [{B}, {Hi}], got {tuple(wts.shape)}")
    _check(
        rows.ndim == 3 and rows.shape[2] == Di,
        f"indexer_scores: rows must be [S, cap, {Di}], got {tuple(rows.shape)}",
    )
    _check(rows.is_contiguous(), "indexer_scores: rows must be contiguous (the pool buffer is read in place)")
    _check(tuple(slot.shape) == (B,), f"indexer_scores: slot must be [{B}], got {tuple(slot.shape)}")
    _check(tuple(count.shape) == (B,), f"indexer_scores: count must be [{B}], got {tuple(count.shape)}")
    if not _use_triton(qi):
        return indexer_scores_ref(qi, wts, rows, slot, count, wscale)
    cap = rows.shape[1]
    out = torch.empty(B, cap, device=qi.device, dtype=torch.float32)
    if B and cap:
        _indexer_kernel[(B, triton.cdiv(cap, INDEX_BC))](
            qi.float().contiguous(), wts.float().contiguous(), rows, slot.contiguous(),
            count.contiguous(), out, Hi, Di, cap, float(wscale), BH=max(16, triton.next_power_of_2(Hi)),
            BC=INDEX_BC, BCI=INDEX_BCI, BD=max(16, triton.next_power_of_2(Di)), PREC=DOT_PRECISION,
            BF16=INDEX_BF16, num_warps=INDEX_WARPS, launch_pdl=PDL,
        )  # fmt: skip
    return out


__all__ = ["attend_decode", "attend_decode_ref", "indexer_scores", "indexer_scores_ref"]
