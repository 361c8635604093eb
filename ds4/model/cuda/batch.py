"""One decode step of B sessions of one KVPool, each at its own position (issue 8), graph-safe; a single
state runs it too, as a one-slot pool (B = 1, slot 0: DeviceLayerKV.as_pool).

Legend: B rows of the step (sessions, padded to a bucket), N + 1 pool slots, S HC streams, d = n_embd,
H heads, D = head_dim, W = window, r = ratio, c = 2 if r == 4 else 1, h = compressed row width, cap =
compressed-row capacity, k = indexer top-k (or cap when every row fits), Hi/Di indexer heads/dim.

Attention goes through the kernels of ds4.kernels.compress / attend (layer.attention_decode_pool); with
DS4_TRITON_FUSED=0 through the torch code below (the kernels' oracle in tests), row by row: row b reads and
writes only pool slot slot[b] at position pos[b] (its raw ring, compressor frontiers, compressed rows, its
own indexer top-k and visibility). Pool writes go through flattened index_copy_ / torch.where on device
tensors: no host sync and no data-dependent shape, so a CUDA graph can capture a step. Padded rows point
at the pool's scratch slot (duplicate writes there are harmless). The per-token work (projections, HC,
router, MoE, head) is batched over the B rows.
"""

from __future__ import annotations

import os

import torch

from ds4 import dist
from ds4.kernels import ref as kernel_ref
from ds4.model.attention import AttentionShape, CompressorWeights
from ds4.model.cuda import fused
from ds4.model.cuda.experts import local_slots, reduce_slots, routed_decode, swiglu_mid
from ds4.model.cuda.layer import (
    _top_rows,
    attention_decode_pool,
    grouped_output,
    indexer_width,
    join_prefetches,
    lin,
    pool_kernels,
    prefetch_site,
    qmatvec_grouped,
    reads_packed,
    route_decode,
    shared_gate_up,
    swiglu_decode,
)
from ds4.model.cuda.state import DeviceLayerKV
from ds4.model.cuda.streams import Branch
from ds4.model.cuda.weights import Packed, QLinear
from ds4.model.norm import rms_norm
from ds4.model.quantsim import indexer_qat
from ds4.quant import GGMLType

try:  # grouped expert GEMMs (tokens sorted by expert: each selected expert's weights read once per step)
    from ds4.kernels.matmul import moe_grouped
    from ds4.kernels.moe import group_by_expert
except ImportError:  # pragma: no cover - no triton
    moe_grouped = group_by_expert = None
try:  # int8 expert kernels grouped by expert (each selected expert's blocks decoded once per step)
    from ds4.kernels import moe as kmoe
    from ds4.kernels import moe_grouped as kgrouped
    from ds4.kernels.intq import quantize_q8k
except ImportError:  # pragma: no cover - no triton
    kmoe = kgrouped = quantize_q8k = None

# Rows from which the routed experts of a batched step run as grouped GEMMs over the (row, slot) pairs
# sorted by expert (bf16 activations) instead of the gathered-expert matvec kernels, which read an expert
# once per pair. 0: never, and it stays off: H200, session 21 (tools/gpu/batch_check.py "8g" / "32g"), B = 32
# step 210 vs 48 ms by the int8 paths, and batched vs alone at B = 8 6.2e-1 of the logit std (median 1.3e-2;
# bar 2e-2: its bf16 activations). Env DS4_BATCH_GROUPED_ROWS. Read when a step is built: recapture (a new
# pool runner) after changing it.
GROUPED_ROWS = int(os.environ.get("DS4_BATCH_GROUPED_ROWS", "0"))

# Rows from which the routed experts of a batched step take the int8 kernels grouped by expert
# (ds4.kernels.moe_grouped: one program per expert run decodes the expert's IQ2_XXS / Q2_K blocks once for all
# its (row, slot) pairs, instead of once per pair), when the experts have those formats and the int8 path is
# on (moe.GATE_UP.int8, env DS4_MOE_INT8). 0: never. Env DS4_MOE_GROUPED_MIN_ROWS; read when a step is built:
# recapture (a new pool runner) after changing it. GROUPED_ROWS (bf16 GEMMs), when set and reached, wins.
# H200 (tools/gpu/bench_moe_grouped.py, per layer): B = 8 pair kernels 421 us vs grouped 440; B = 16 816 vs
# 779; B = 32 1,605 vs 1,330 (128 distinct experts of 192 pairs). Session 14 (coalesced loads; the grouped
# path's down now the pair kernel, moe_grouped.GroupedConfig.pair_down): B = 8 221.1 vs 217.9, B = 16 421.0
# vs 395.0, B = 32 818.4 vs 715.0: 16 stays. Session 28 (H100; the mma gate/up the grouped default): per layer
# B = 2 / 4 / 8 46.2 / 80.9 / 139.2 us vs the pair kernel's 53.7 / 89.4 / 164.5 (B = 1 33.8 vs 28.1: the pair
# kernel stays there); 30-layer steps at 8k (batch_check.py "grouped from 2") x1.025 / x1.000 / x1.019 (with
# the down's tile at 64 below 16 rows, "grouped from 2 dn64", x1.034 / x1.014 / x1.032: not yet checked, off);
# the batched-vs-alone check passed from 2 (B = 3 4.39e-4, B = 8 1.83e-2 of the logit std at one near tie): 2.
MOE_GROUPED_MIN_ROWS = int(os.environ.get("DS4_MOE_GROUPED_MIN_ROWS", "2"))


# Pure pieces of the step (no pool writes) may be compiled by torch.compile with dynamic shapes (one compile
# for every batch bucket), when the single-session path compiles too (fused.SWITCH: CUDA, DS4_COMPILE) AND
# env DS4_BATCH_COMPILE=1. Off by default: not yet timed on a GPU, and duck-sized dims (B equal to another
# dim) can force recompiles per bucket. Any compile error falls back to eager for good.
COMPILE = os.environ.get("DS4_BATCH_COMPILE", "0") == "1"


def _compile_on() -> bool:
    return COMPILE


_fuse = fused.fuse(dynamic=True, when=_compile_on)  # one compile per piece for every batch size


def _compress_step(
    w: CompressorWeights, xn, pos, slot, fk_pool, fs_pool, rows_pool, inv_freq, eps, n_rot, indexer
):
    """Advance each row's frontier (pool slot slot[b]) by its token; write the rows of completed windows
    (the compressor kernel's torch twin, ds4.kernels.ref.compress_decode).

    fk_pool/fs_pool [N+1, c r, c h], rows_pool [N+1, cap, h]; xn [B, d], pos/slot [B]."""
    kernel_ref.compress_decode(
        lin(xn, w.kv), lin(xn, w.gate), w.ape, fk_pool, fs_pool, rows_pool,
        slot, pos, w.norm, inv_freq, eps, n_rot, indexer,
    )  # fmt: skip


@_fuse
def _attend(q, keys, valid, sinks, scale: float, pos, inv_freq):
    """q [B, H, D] over each row's keys [B, n, D] (valid [B, n]) with sinks -> de-rotated o [B, H, D]."""
    B, H, _ = q.shape
    s = torch.bmm(q, keys.transpose(1, 2)) * scale  # [B, H, n]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    s = torch.cat([s, sinks[None, :, None].expand(B, H, 1)], dim=2)
    o = torch.bmm(s.softmax(-1)[..., :-1], keys)
    return fused.rope_real(o, pos, inv_freq, inverse=True)


@_fuse
def _indexer_scores(qi, wts, rows, rows_valid, pos, inv_freq):
    """Indexer scores [B, cap] of each row's compressed rows (invisible ones -inf): qi [B, Hi, Di] before
    RoPE/QAT, head weights wts [B, Hi], rows [B, cap, Di], rows_valid [B, cap]."""
    qi = indexer_qat(fused.rope_real(qi, pos, inv_freq))
    score = (torch.bmm(qi, rows.transpose(1, 2)).relu() * wts[:, :, None]).sum(1)
    return score.masked_fill(~rows_valid, float("-inf"))


def _gather_rows(rows_pool, slot, idx):
    """rows_pool [N+1, cap, h], idx [B, k] -> rows [B, k, h] of each row's own slot."""
    cap, h = rows_pool.shape[1:]
    flat = (slot[:, None] * cap + idx).reshape(-1)
    return rows_pool.view(-1, h).index_select(0, flat).view(idx.shape[0], idx.shape[1], h)


def attention_decode_batch(
    w, shape: AttentionShape, kv: DeviceLayerKV, xn, pos, slot, inv_freq, side=None, bound: int | None = None
):
    """xn [B, d] at positions pos [B] of pool slots slot [B] -> [B, d]; appends to the pool layer kv.
    side: the layer's SideMatrices (kernel path only); bound: every pos[b] < bound, or None
    (layer.indexer_width)."""
    if pool_kernels():  # the compressor / attention kernels read and write the pool in place
        o = attention_decode_pool(w, shape, kv, xn, pos, slot, inv_freq, side, bound)
        return _grouped_output(o, w.out_a, w.out_b, shape.o_groups)
    R, eps, W, r = shape.n_rot, shape.rms_eps, shape.window, shape.ratio
    D = shape.head_dim
    qn = rms_norm(lin(xn, w.q_a), w.q_a_norm, eps)
    q = fused.q_post(lin(qn, w.q_b).unflatten(-1, (shape.n_head, D)), pos, inv_freq, eps)  # [B, H, D]
    row = fused.kv_post(lin(xn, w.kv), w.kv_norm, pos, inv_freq, eps, R)  # [B, D]
    kv.raw.view(-1, D).index_copy_(0, slot * W + pos % W, row)
    ar = torch.arange(W, device=pos.device)
    slot_pos = pos[:, None] - torch.remainder(pos[:, None] - ar[None, :], W)  # [B, W] position per ring slot
    keys, valid = [kv.raw.index_select(0, slot)], [slot_pos >= 0]
    if r:
        _compress_step(
            w.compressor, xn, pos, slot, kv.comp_kv, kv.comp_score, kv.comp, inv_freq, eps, R, False
        )
        cap = kv.comp.shape[1]
        rows_valid = torch.arange(cap, device=pos.device)[None, :] < ((pos + 1) // r)[:, None]  # [B, cap]
        if w.indexer is not None:  # keep the indexer rows current (used once more than top-k rows exist)
            ic = w.indexer.compressor
            _compress_step(ic, xn, pos, slot, kv.index_kv, kv.index_score, kv.index, inv_freq, eps, R, True)
        if w.indexer is not None and cap > shape.indexer_topk:
            iw = w.indexer
            n_heads, dim = iw.proj.shape[0], iw.compressor.norm.numel()
            qi = lin(qn, iw.q_b).unflatten(-1, (n_heads, dim))  # [B, Hi, Di]
            wts = lin(xn, iw.proj) * (dim**-0.5 * n_heads**-0.5)  # [B, Hi]
            rows = kv.index.index_select(0, slot)  # [B, cap, Di]
            score = _indexer_scores(qi, wts, rows, rows_valid, pos, inv_freq)  # [B, cap]
            n = indexer_width(cap, shape.indexer_topk, r, bound)
            top = _top_rows(score[:, :n], shape.indexer_topk)  # [B, k]
            keys.append(_gather_rows(kv.comp, slot, top))
            valid.append(rows_valid.gather(1, top))
        else:
            keys.append(kv.comp.index_select(0, slot))  # [B, cap, D]
            valid.append(rows_valid)
    o = _attend(q, torch.cat(keys, dim=1), torch.cat(valid, dim=1), w.sinks, D**-0.5, pos, inv_freq)
    return _grouped_output(o, w.out_a, w.out_b, shape.o_groups)


def _grouped_output(o, out_a, out_b, groups: int):
    """grouped_output for B rows: the grouped packed matvec for decode-sized B, else the dense path."""
    B = o.shape[0]
    if isinstance(out_a, QLinear) and reads_packed(B):
        pa = out_a.packed
        low = qmatvec_grouped(o.reshape(B, groups, -1), pa.view(groups, pa.N // groups, pa.K))  # [B, G, Ro]
        return lin(low.reshape(B, -1), out_b)
    return grouped_output(o, out_a, out_b, groups)


def _routed_path(m, B: int) -> str:
    """How _routed runs B rows: "grouped" (bf16 GEMMs from GROUPED_ROWS rows), "int8 grouped" (int8
    kernels grouped by expert from MOE_GROUPED_MIN_ROWS rows), "pairs" (the gathered-expert kernels on [B]
    rows) or "rows" (the torch Packed path, one row at a time: CPU / no kernels)."""
    if isinstance(m.gate_exps, Packed):
        return "rows"
    if 0 < GROUPED_ROWS <= B and moe_grouped is not None:
        return "grouped"
    if 0 < MOE_GROUPED_MIN_ROWS <= B and _int8_grouped(m):
        return "int8 grouped"
    return "pairs"


def _routed_terms(m, B: int) -> int:
    """Q8_K terms in which the routed experts' int8 gate/up kernel reads its input on _routed's path for B
    rows (that input quantized by the FFN site's HC finish, fused.hc_pre_branch), or 0: none read it."""
    path = _routed_path(m, B)
    if path == "int8 grouped":
        return kgrouped.CONFIG.terms
    int8 = path == "pairs" and kmoe is not None and kmoe.GATE_UP.int8
    return kmoe.GATE_UP.terms if int8 and m.gate_exps.qtype == GGMLType.IQ2_XXS else 0


def _routed(xf, ids, weights, m, clamp, xq=None):
    """Routed experts of B rows, per slot [B, k, d] (summed over the ranks, not over the slots: the HC post
    kernel sums them, experts.reduce_slots), on _routed_path's path. xq: xf's Q8_K planes in
    _routed_terms(m, B) terms, or None."""
    path = _routed_path(m, xf.shape[0])
    if path == "grouped":
        return _routed_grouped(xf, ids, weights, m, clamp)
    if path == "int8 grouped":
        return _routed_int8_grouped(xf, ids, weights, m, clamp, xq)
    if path == "pairs":
        gate, up, down = m.gate_exps, m.up_exps, m.down_exps
        return routed_decode(xf, ids, weights, gate, up, down, clamp, per_slot=True, xq=xq)
    rows = [
        routed_decode(
            xf[b : b + 1], ids[b : b + 1], weights[b : b + 1], m.gate_exps, m.up_exps, m.down_exps, clamp,
            per_slot=True,
        )
        for b in range(xf.shape[0])
    ]  # fmt: skip
    return torch.cat(rows)


def _int8_grouped(m) -> bool:
    return (
        kgrouped is not None and kmoe.GATE_UP.int8 and kgrouped.supports(m.gate_exps, m.up_exps, m.down_exps)
    )


def _routed_int8_grouped(xf, ids, weights, m, clamp, xq=None):
    """The int8 kernels grouped by expert: xf [B, d], ids/weights [B, k] -> per slot [B, k, d]. Expert
    parallel: the stacks hold this rank's E/N experts; other ranks' ids fall outside [0, E/N) and add nothing
    (the kernels' sentinel run). The per-slot terms are summed over the ranks (experts.reduce_slots; the
    slots are summed later in fixed order: each term is made on one rank, so bit-exact to one GPU)."""
    n_local = m.gate_exps.shape[0]
    local = ids - dist.rank() * n_local if dist.active() else ids
    per_slot = kgrouped.moe_routed_grouped(
        xf, local, weights, m.gate_exps, m.up_exps, m.down_exps, clamp, per_slot=True, xq=xq
    )
    return reduce_slots(per_slot)


def _routed_grouped(xf, ids, weights, m, clamp):
    """Routed experts of B rows as grouped GEMMs: pairs (row, slot) sorted by expert, no host sync.
    xf [B, d], ids/weights [B, k] -> per slot [B, k, d]. Expert parallel: other ranks' experts get weight 0
    (local_slots); the per-slot terms are summed over the ranks (the slots later, in fixed order)."""
    B, k = ids.shape
    ids, weights = local_slots(ids, weights, m.gate_exps.shape[0])
    order, offsets = group_by_expert(ids, m.gate_exps.shape[0])  # [B k], [E + 1]
    rows = order // k  # [B k] source row of each sorted pair
    xs = xf.index_select(0, rows)  # [B k, d]
    mid = swiglu_mid(moe_grouped(xs, m.gate_exps, offsets), moe_grouped(xs, m.up_exps, offsets), clamp)
    mid = mid * weights.reshape(-1).index_select(0, order)[:, None]
    out = moe_grouped(mid, m.down_exps, offsets)  # [B k, d] in expert order
    per_slot = torch.empty(B * k, out.shape[1], dtype=torch.float32, device=xf.device).index_copy_(
        0, order, out
    )
    return reduce_slots(per_slot.view(B, k, -1))


def _quant_side(xf, terms: int) -> Branch:
    """xf's Q8_K planes in `terms` terms on side lane 3, beside the router (fused.Q8K_SIDE), as a Branch; a
    ready None (the gate/up kernel quantizes xf itself) when off, or no int8 kernel reads them."""
    if not (terms and fused.Q8K_SIDE and quantize_q8k is not None):
        return Branch.ready(None)
    return Branch(xf.device, lambda: quantize_q8k(xf, terms), lane=3)


def decode_layer_batch(blk, kv, X, tokens, pos, slot, bound: int | None = None, mix=None, next_fn=None):
    """X [B, S, d] -> (X' [B, S, d], mix) for B tokens (tokens/pos/slot [B] device tensors) over pool layer
    kv; blk: the layer (ds4.model.block.Block: cfg, il, w, shape, inv_freq; `side`, its SideMatrices, if set);
    bound: every pos[b] < bound (tokens), or None (layer.indexer_width). mix: X's mixing partials for this
    layer's attention HC (from the layer before), or None; next_fn: the next layer's attention HC
    projection (None for the last), whose partials of X' come back as mix (fused.hc_post_mix; or None)."""
    cfg, il, w, shape, inv_freq = blk.cfg, blk.il, blk.w, blk.shape, blk.inv_freq
    side = getattr(blk, "side", None)
    hc = (cfg.hc_sinkhorn_iters, cfg.rms_eps, cfg.hc_eps)
    h = w.hc_attn
    a = w.attn
    merged = side is not None and side.qa_kv is not None  # q_a and kv are row views of side.qa_kv
    prefetch_site("attn", X.device, [side.qa_kv, a.q_b] if merged else [a.q_a, a.kv, a.q_b])
    xn, post, comb, _ = fused.hc_pre_branch(X, h.fn, h.scale, h.base, w.attn_norm, *hc, mix)  # comb: a Branch
    o = attention_decode_batch(w.attn, shape, kv, xn, pos, slot, inv_freq, side, bound)
    h, m, clamp = w.hc_ffn, w.moe, cfg.swiglu_clamp[il]
    gu = [side.shared_gu] if side is not None and side.shared_gu is not None else [m.gate_sh, m.up_sh]
    prefetch_site("ffn", X.device, [*gu, m.down_sh, side.router if side is not None else None])
    X, mix = fused.hc_post_mix(o, X, post, comb.join(), None, h.fn)
    terms = _routed_terms(m, X.shape[0])
    xf, post, comb, xq = fused.hc_pre_branch(X, h.fn, h.scale, h.base, w.ffn_norm, *hc, mix, terms)
    xq = _quant_side(xf, terms) if xq is None else Branch.ready(xq)
    # the shared expert on the side stream, next to the router and the routed experts (streams.Branch)
    shared = Branch(xf.device, lambda: lin(swiglu_decode(*shared_gate_up(xf, m, side), clamp), m.down_sh))
    weights, ids = route_decode(
        m, xf, tokens, cfg.n_expert_used, cfg.expert_weights_scale, cfg.expert_weights_norm, side
    )
    routed = _routed(xf, ids, weights, m, clamp, xq.join())  # [B, k, d] per slot
    join_prefetches()
    return fused.hc_post_mix(shared.join(), X, post, comb.join(), routed, next_fn)  # output: slots + shared
