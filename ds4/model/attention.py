"""Attention sublayer: Q/KV paths, compressors, indexer, sink attention, output (model.md §5.4, §6-§8).

Legend: T tokens of the chunk, B sessions of a batched decode step, d = n_embd, H query heads,
D = head_dim, R = n_rot, Rq = q_lora_rank, G output groups, Ro = o_lora_rank, r = compress ratio,
c = 2 if r == 4 else 1, h = compressed row width (D for the attention compressor, Di for the indexer one),
K windows completed in the chunk, C compressed rows visible after the chunk, Hi/Di indexer heads/dim,
N raw key rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds4.model.norm import rms_norm
from ds4.model.quantsim import fp8_e4m3_roundtrip, indexer_qat
from ds4.model.rope import rope_tail
from ds4.model.state import EMPTY_SCORE, LayerKV

FP8_BLOCK = 64
SCORE_BUDGET = 1 << 22  # max elements of one query block's score temporary ([B, heads, keys])


@dataclass
class CompressorWeights:
    ape: torch.Tensor  # [r, c*h] added to the gate score at slot pos mod r
    kv: torch.Tensor  # [c*h, d]
    gate: torch.Tensor  # [c*h, d]
    norm: torch.Tensor  # [h]


@dataclass
class IndexerWeights:
    q_b: torch.Tensor  # [Hi*Di, Rq]
    proj: torch.Tensor  # [Hi, d]
    compressor: CompressorWeights


@dataclass
class AttentionWeights:
    q_a: torch.Tensor  # [Rq, d]
    q_a_norm: torch.Tensor  # [Rq]
    q_b: torch.Tensor  # [H*D, Rq]
    kv: torch.Tensor  # [D, d]
    kv_norm: torch.Tensor  # [D]
    sinks: torch.Tensor  # [H]
    out_a: torch.Tensor  # [G*Ro, H*D/G]
    out_b: torch.Tensor  # [d, G*Ro]
    compressor: CompressorWeights | None  # compressed layers
    indexer: IndexerWeights | None  # ratio-4 layers


@dataclass(frozen=True)
class AttentionShape:
    """The per-layer constants the attention math needs (all from the file's metadata)."""

    n_head: int
    head_dim: int
    n_rot: int
    window: int
    ratio: int
    o_groups: int
    indexer_topk: int
    rms_eps: float


# ---------------------------------------------------------------------------------------------
# Compressors (§6)
# ---------------------------------------------------------------------------------------------


def compress_chunk(
    w: CompressorWeights,
    xn: torch.Tensor,
    p0: int,
    ratio: int,
    front_kv: torch.Tensor,
    front_score: torch.Tensor,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
) -> tuple[torch.Tensor, int]:
    """Feed T tokens (positions p0..) through a compressor frontier; pool every window they complete.
    linear: how x @ w^T is computed (the device prefill passes its f32 tensor-core GEMM).

    xn [T, d]; front_kv/front_score [c*r, c*h] are updated in place (ratio 4: rows 0..r-1 previous
    window, rows r..2r-1 current window at slot pos mod r; other ratios: row pos mod r).
    Returns (pooled [K, h], position of the first token of the first completed window).
    """
    r, overlap = ratio, ratio == 4
    h = w.norm.numel()
    positions = torch.arange(p0, p0 + xn.shape[0])
    kv = linear(xn, w.kv)  # [T, c*h]
    score = linear(xn, w.gate) + w.ape[positions % r]  # [T, c*h]

    m = p0 % r  # tokens of the current window already in the frontier
    cur = r if overlap else 0  # first frontier row of the current window
    seq_kv = torch.cat([front_kv[cur : cur + m], kv])  # [m+T, c*h], positions p0-m ..
    seq_score = torch.cat([front_score[cur : cur + m], score])
    K = seq_kv.shape[0] // r
    win_kv = seq_kv[: K * r].unflatten(0, (K, r))  # [K, r, c*h]
    win_score = seq_score[: K * r].unflatten(0, (K, r))

    pooled = kv.new_zeros(0, h)
    if K > 0:
        if overlap:  # candidates: previous window's first half + this window's second half
            prev_kv = torch.cat([front_kv[None, :r], win_kv[:-1]])  # [K, r, 2h]
            prev_score = torch.cat([front_score[None, :r], win_score[:-1]])
            cand_kv = torch.cat([prev_kv[..., :h], win_kv[..., h:]], dim=1)  # [K, 2r, h]
            cand_score = torch.cat([prev_score[..., :h], win_score[..., h:]], dim=1)
        else:
            cand_kv, cand_score = win_kv, win_score  # [K, r, h]
        pooled = (cand_kv * cand_score.softmax(dim=1)).sum(dim=1)  # softmax per output dim over tokens
        if overlap:
            front_kv[:r], front_score[:r] = win_kv[-1], win_score[-1]

    rest = seq_kv.shape[0] - K * r  # tokens of the new partial window
    front_kv[cur : cur + rest], front_score[cur : cur + rest] = seq_kv[K * r :], seq_score[K * r :]
    front_kv[cur + rest : cur + r], front_score[cur + rest : cur + r] = 0.0, EMPTY_SCORE
    return pooled, p0 - m


def compressed_rows(
    w: CompressorWeights,
    xn: torch.Tensor,
    p0: int,
    ratio: int,
    front_kv: torch.Tensor,
    front_score: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    *,
    indexer: bool,
) -> torch.Tensor:
    """Rows [K, h] emitted by the chunk: pooled, RMS-normed, RoPE'd at the window start, then FP8
    (attention rows, nope dims) or Hadamard + FP4 (indexer rows, all dims)."""
    pooled, first = compress_chunk(w, xn, p0, ratio, front_kv, front_score)
    if pooled.shape[0] == 0:  # no window completed (most decode steps)
        return pooled
    rows = rms_norm(pooled, w.norm, eps)
    starts = first + ratio * torch.arange(rows.shape[0])  # RoPE position = first token of the window
    rows = rope_tail(rows, starts, inv_freq)
    return indexer_qat(rows) if indexer else fp8_nope(rows, 2 * inv_freq.numel())


def fp8_nope(x: torch.Tensor, n_rot: int) -> torch.Tensor:
    """FP8 round trip of the non-RoPE dims of rows [..., D]; the RoPE tail stays f32."""
    out = x.clone()
    out[..., :-n_rot] = fp8_e4m3_roundtrip(x[..., :-n_rot], FP8_BLOCK)
    return out


# ---------------------------------------------------------------------------------------------
# Indexer (§7)
# ---------------------------------------------------------------------------------------------


def indexer_select(
    w: IndexerWeights,
    qn: torch.Tensor,
    xn: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    topk: int,
    inv_freq: torch.Tensor,
) -> torch.Tensor:
    """Visible compressed rows per token [T, C] (bool): all causal rows, or the top-k of them by
    the indexer score when more than top-k are visible (ties -> lower row index)."""
    counts = (positions + 1) // 4  # [T] causal rows per token (ratio 4)
    visible = torch.arange(rows.shape[0])[None, :] < counts[:, None]  # [T, C]
    if int(counts.max()) <= topk:
        return visible
    n_heads, dim = w.proj.shape[0], rows.shape[1]
    qi = F.linear(qn, w.q_b).unflatten(-1, (n_heads, dim))  # [T, Hi, Di]
    qi = indexer_qat(rope_tail(qi, positions, inv_freq))
    wts = F.linear(xn, w.proj) * (dim**-0.5 * n_heads**-0.5)  # [T, Hi]
    score = torch.empty(visible.shape)  # [T, C]
    block = max(1, SCORE_BUDGET // (n_heads * rows.shape[0]))  # bound the [B, Hi, C] temporary
    for a in range(0, len(positions), block):
        per_head = torch.einsum("thd,cd->thc", qi[a : a + block], rows).relu()  # [B, Hi, C]
        score[a : a + block] = (per_head * wts[a : a + block, :, None]).sum(1)
    score = score.masked_fill(~visible, float("-inf"))
    top = score.sort(dim=-1, descending=True, stable=True).indices[:, :topk]  # stable: ties keep low index
    chosen = torch.zeros_like(visible).scatter_(1, top, True)
    return chosen & visible


# ---------------------------------------------------------------------------------------------
# Sink attention (§8)
# ---------------------------------------------------------------------------------------------


def sink_attention(
    q: torch.Tensor,
    raw: torch.Tensor,
    raw_pos: torch.Tensor,
    positions: torch.Tensor,
    window: int,
    comp: torch.Tensor,
    comp_visible: torch.Tensor,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """o [T, H, D]: softmax over each token's visible rows plus a per-head sink logit (denominator only).

    q [T, H, D]; raw [N, D] rows at consecutive positions raw_pos [N]; a token at p sees raw rows
    p-window+1..p and the compressed rows comp [C, D] marked in comp_visible [T, C]. K = V = row.
    """
    T, H, D = q.shape
    scale = D**-0.5
    out = torch.empty_like(q)
    block = max(1, min(T, SCORE_BUDGET // (H * (window + comp.shape[0] + T))))
    for a in range(0, T, block):
        b = min(T, a + block)
        pos = positions[a:b]  # [B]
        lo = max(0, int(pos[0]) - window + 1 - int(raw_pos[0]))  # raw rows any token of the block sees
        hi = int(pos[-1]) - int(raw_pos[0]) + 1
        kp = raw_pos[lo:hi]
        raw_vis = (kp[None, :] <= pos[:, None]) & (kp[None, :] > pos[:, None] - window)  # [B, n]
        keys = torch.cat([raw[lo:hi], comp])  # [n + C, D]
        vis = torch.cat([raw_vis, comp_visible[a:b]], dim=1)  # [B, n + C]
        s = torch.einsum("thd,kd->thk", q[a:b], keys) * scale  # [B, H, keys]
        s = s.masked_fill(~vis[:, None, :], float("-inf"))
        s = torch.cat([s, sinks[None, :, None].expand(b - a, H, 1)], dim=-1)
        p = s.softmax(-1)[..., :-1]  # drop the sink column: it only enlarges the denominator
        out[a:b] = torch.einsum("thk,kd->thd", p, keys)
    return out


# ---------------------------------------------------------------------------------------------
# The sublayer
# ---------------------------------------------------------------------------------------------


def attention_forward(
    w: AttentionWeights,
    shape: AttentionShape,
    kv_state: LayerKV,
    xn: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
) -> torch.Tensor:
    """Attention output [T, d] for the chunk xn [T, d] (attn-normed) at consecutive positions [T];
    appends the chunk's raw rows, compressed rows and frontier updates to kv_state."""
    qn, q, kv = project_qkv(w, shape, xn, positions, inv_freq)
    o = attend(w, shape, kv_state, xn, qn, q, kv, positions, inv_freq)
    return attention_output(w, shape, o, positions, inv_freq)


def attention_decode_batch(
    w: AttentionWeights,
    shape: AttentionShape,
    kv_states: list[LayerKV],
    xn: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
) -> torch.Tensor:
    """One decode token for each of B sessions: xn [B, d] at positions [B] (row b belongs to
    kv_states[b]) -> [B, d]. Projections run batched; the KV-touching part runs per session."""
    qn, q, kv = project_qkv(w, shape, xn, positions, inv_freq)
    o = torch.cat(
        [
            attend(
                w,
                shape,
                st,
                xn[b : b + 1],
                qn[b : b + 1],
                q[b : b + 1],
                kv[b : b + 1],
                positions[b : b + 1],
                inv_freq,
            )
            for b, st in enumerate(kv_states)
        ]
    )  # [B, H, D]
    return attention_output(w, shape, o, positions, inv_freq)


def project_qkv(
    w: AttentionWeights,
    shape: AttentionShape,
    xn: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token projections (no state): qn [T, Rq], q [T, H, D] (RoPE'd), kv [T, D] (RoPE'd, FP8 nope)."""
    H, D, R, eps = shape.n_head, shape.head_dim, shape.n_rot, shape.rms_eps
    qn = rms_norm(F.linear(xn, w.q_a), w.q_a_norm, eps)  # [T, Rq] (also the indexer's query input)
    q = F.linear(qn, w.q_b).unflatten(-1, (H, D))  # [T, H, D]
    q = rope_tail(rms_norm(q, None, eps), positions, inv_freq)  # per-head RMS without weight

    kv = rms_norm(F.linear(xn, w.kv), w.kv_norm, eps)  # [T, D] one shared K=V row per token
    kv = fp8_nope(rope_tail(kv, positions, inv_freq), R)
    return qn, q, kv


def attend(
    w: AttentionWeights,
    shape: AttentionShape,
    kv_state: LayerKV,
    xn: torch.Tensor,
    qn: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
) -> torch.Tensor:
    """The stateful part for one session's chunk at consecutive positions: compressors, indexer, raw
    window append and sink attention. Returns o [T, H, D] (RoPE tail still rotated)."""
    p0 = int(positions[0])
    comp, comp_visible = compressed_keys(w, shape, kv_state, xn, qn, positions, inv_freq)  # [C, D], [T, C]

    raw = torch.cat([kv_state.raw, kv])  # [N, D] previous window rows + this chunk's rows
    raw_pos = torch.arange(p0 - kv_state.raw.shape[0], p0 + kv.shape[0])
    o = sink_attention(q, raw, raw_pos, positions, shape.window, comp, comp_visible, w.sinks)
    kv_state.raw = raw[-shape.window :].clone()
    return o


def attention_output(
    w: AttentionWeights,
    shape: AttentionShape,
    o: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
) -> torch.Tensor:
    """o [T, H, D] -> [T, d]: de-rotate the tail at the query position, then the grouped output."""
    o = rope_tail(o, positions, inv_freq, inverse=True)
    return grouped_output(o, w.out_a, w.out_b, shape.o_groups)


def compressed_keys(
    w: AttentionWeights,
    shape: AttentionShape,
    kv_state: LayerKV,
    xn: torch.Tensor,
    qn: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the chunk through the layer's compressors (appending their rows to kv_state).

    Returns every compressed attention row [C, D] and which of them each token sees [T, C]: rows whose
    window it has completed (n < (p+1)/r), narrowed to the indexer's top-k on ratio-4 layers.
    """
    r, eps, p0 = shape.ratio, shape.rms_eps, int(positions[0])
    if r == 0:  # dense layer: raw window only
        return xn.new_zeros(0, shape.head_dim), torch.zeros(len(positions), 0, dtype=torch.bool)
    kv_state.append_comp(
        compressed_rows(
            w.compressor, xn, p0, r, kv_state.comp_kv, kv_state.comp_score, inv_freq, eps, indexer=False
        )
    )
    if w.indexer is None:
        causal = torch.arange(kv_state.comp.shape[0])[None, :] < ((positions + 1) // r)[:, None]
        return kv_state.comp, causal
    ic = w.indexer.compressor
    kv_state.append_index(
        compressed_rows(ic, xn, p0, r, kv_state.index_kv, kv_state.index_score, inv_freq, eps, indexer=True)
    )
    chosen = indexer_select(w.indexer, qn, xn, positions, kv_state.index, shape.indexer_topk, inv_freq)
    return kv_state.comp, chosen


def grouped_output(o: torch.Tensor, out_a: torch.Tensor, out_b: torch.Tensor, groups: int) -> torch.Tensor:
    """o [T, H, D] -> [T, d]: each group of H/G heads (head-major) -> Ro by its out_a slice, then out_b."""
    T = o.shape[0]
    og = o.reshape(T, groups, -1)  # [T, G, H/G*D]
    wa = out_a.view(groups, -1, og.shape[-1])  # [G, Ro, H/G*D]
    low = torch.einsum("tgd,grd->tgr", og, wa)  # [T, G, Ro]
    return F.linear(low.flatten(1), out_b)
