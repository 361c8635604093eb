"""Decode attention and indexer scores read from the KV pool buffers in place (no gathered / concatenated keys).

Legend: B rows of the step, S pool slots, H heads, D = head_dim, W = window (raw ring rows), cap = compressed-row
capacity, k = indexer top-k, P = RoPE pairs (n_rot = 2P, the tail of each row), Hi/Di indexer heads/dim.

  attend_decode(q, raw, slot, pos, comp, comp_idx, ratio, sinks, scale, inv_freq) -> o [B, H, D]
      row b attends over the W ring rows raw[slot[b]] (ring row j holds position pos - ((pos - j) mod W),
      visible iff >= 0) and the compressed rows comp[slot[b], comp_idx[b]] (or all cap rows when comp_idx is
      None; row c visible iff c < (pos + 1) // ratio), keys = values (one shared KV head), softmax with one
      sink logit per head that only enlarges the denominator; the output is de-rotated (inverse RoPE at pos).
  indexer_scores(qi, wts, rows, slot, count) -> [B, cap]
      score[b, c] = sum_h relu(qi[b, h] . rows[slot[b], c]) * wts[b, h], -inf for c >= count[b].

Each dispatches to Triton on CUDA tensors (or under TRITON_INTERPRET=1) and to its torch twin
(`attend_decode_ref`, `indexer_scores_ref`, below) elsewhere. All math f32 with exact products.
"""

from __future__ import annotations

import os

import torch

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


def indexer_scores_ref(qi, wts, rows, slot, count):
    """Torch twin of indexer_scores (same signature and result)."""
    r = rows.index_select(0, slot).float()  # [B, cap, Di]
    score = torch.einsum("bhd,bcd->bhc", qi.float(), r).relu()
    score = torch.einsum("bhc,bh->bc", score, wts.float())
    cap = rows.shape[1]
    return score.masked_fill(torch.arange(cap, device=count.device)[None, :] >= count[:, None], float("-inf"))


# =========================================================================================================
# Dispatchers


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_attend(q, raw, slot, pos, comp, comp_idx, ratio, sinks, inv_freq) -> None:
    _check(q.ndim == 3, f"attend_decode: q must be [B, H, D], got {tuple(q.shape)}")
    B, H, D = q.shape
    _check(
        raw.ndim == 3 and raw.shape[2] == D, f"attend_decode: raw must be [S, W, {D}], got {tuple(raw.shape)}"
    )
    _check(tuple(slot.shape) == (B,), f"attend_decode: slot must be [{B}], got {tuple(slot.shape)}")
    _check(tuple(pos.shape) == (B,), f"attend_decode: pos must be [{B}], got {tuple(pos.shape)}")
    _check(tuple(sinks.shape) == (H,), f"attend_decode: sinks must be [{H}], got {tuple(sinks.shape)}")
    R = 2 * inv_freq.numel()
    _check(0 < R <= D, f"attend_decode: 2 * len(inv_freq) = {R} must be in 1..{D}")
    if comp is None:
        _check(comp_idx is None, "attend_decode: comp_idx given without comp")
        return
    _check(ratio > 0, f"attend_decode: ratio must be > 0 with compressed rows, got {ratio}")
    _check(
        comp.ndim == 3 and comp.shape[0] == raw.shape[0] and comp.shape[2] == D,
        f"attend_decode: comp must be [{raw.shape[0]}, cap, {D}], got {tuple(comp.shape)}",
    )
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
    return attend_decode_ref(q, raw, slot, pos, comp, comp_idx, ratio, sinks, scale, inv_freq)


def indexer_scores(
    qi: torch.Tensor, wts: torch.Tensor, rows: torch.Tensor, slot: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """qi [B, Hi, Di] (RoPE'd + QAT'd), wts [B, Hi], rows [S, cap, Di] read at slot [B], count [B] visible
    rows -> scores [B, cap] f32 (-inf past count)."""
    _check(qi.ndim == 3, f"indexer_scores: qi must be [B, Hi, Di], got {tuple(qi.shape)}")
    B, Hi, Di = qi.shape
    _check(tuple(wts.shape) == (B, Hi), f"indexer_scores: wts must be [{B}, {Hi}], got {tuple(wts.shape)}")
    _check(
        rows.ndim == 3 and rows.shape[2] == Di,
        f"indexer_scores: rows must be [S, cap, {Di}], got {tuple(rows.shape)}",
    )
    _check(tuple(slot.shape) == (B,), f"indexer_scores: slot must be [{B}], got {tuple(slot.shape)}")
    _check(tuple(count.shape) == (B,), f"indexer_scores: count must be [{B}], got {tuple(count.shape)}")
    return indexer_scores_ref(qi, wts, rows, slot, count)


__all__ = ["attend_decode", "attend_decode_ref", "indexer_scores", "indexer_scores_ref"]
