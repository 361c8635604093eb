"""Routed experts on packed weights: gather the selected experts' blocks, decode, multiply (model.md §5.5).

Legend: T tokens, k experts per token, E experts, F expert hidden width, d = n_embd, rb = packed row bytes.

Decode (T = 1) takes the expert ids as a DEVICE tensor and only gathers those experts' blocks, so the step
has no host sync and can be captured in a CUDA graph. Prefill groups tokens by expert (host loop over the
experts in use) and decodes one expert at a time to the compute dtype for a GEMM. When the Triton kernels
of ds4.kernels.moe are present they replace the gather + decode + matmul of decode.

Expert parallel (ds4.dist, N > 1 processes): the stacks hold only this rank's contiguous shard of E/N experts
(ds4.model.cuda.weights loads only those rows). Decode keeps its static shapes for CUDA graphs: ids outside
the shard get router weight 0 and are clamped to a valid local expert; prefill drops them. The routed output
is summed over the ranks with one all_reduce on the current stream (capturable in a CUDA graph).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from ds4 import dist
from ds4.model.cuda.weights import Packed

try:  # gathered-expert / grouped Triton kernels (another module's family); optional
    from ds4.kernels import moe as kmoe
except ImportError:  # pragma: no cover - not there yet
    kmoe = None
try:
    from ds4.kernels.matmul import gather_sum, moe_grouped, moe_swiglu_grouped
except ImportError:  # pragma: no cover
    gather_sum = moe_grouped = moe_swiglu_grouped = None
from ds4.quant import GGMLType
from ds4.quant.dequant import _BLOCK_DECODERS, _f16, _iq2xxs_signed_grid  # the bit-exact block formulas
from ds4.quant.types import BLOCK_GEOMETRY


@functools.cache
def _iq2_shifts(device: torch.device) -> torch.Tensor:
    return torch.tensor([0, 7, 14, 21], dtype=torch.int32, device=device)


def _iq2_xxs(blk: torch.Tensor) -> torch.Tensor:
    """Same formula as ds4.quant's IQ2_XXS decoder, with its constants cached (CUDA-graph safe)."""
    n = blk.shape[0]
    d = _f16(blk[:, 0:2])
    sub = blk[:, 2:66].reshape(n, 8, 8)
    b = sub[..., 4:8].to(torch.int32)
    a1 = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    db = d[:, None] * (0.5 + (sub[..., 7] >> 4).float()) * 0.25
    sign_idx = (a1[..., None] >> _iq2_shifts(blk.device)) & 127
    row = sub[..., 0:4].to(torch.int64) * 128 + sign_idx
    vals = torch.index_select(_iq2xxs_signed_grid(blk.device), 0, row.reshape(-1)).reshape(n, 8, 4, 8)
    return (db[..., None, None] * vals).reshape(n, 256)


def decode_rows(data: torch.Tensor, qtype: GGMLType, cols: int) -> torch.Tensor:
    """Packed rows [..., rb] uint8 -> float32 [..., cols] (no host sync; shapes from the input only)."""
    lead = data.shape[:-1]
    if qtype == GGMLType.F32:
        return data.contiguous().view(torch.float32).reshape(*lead, cols)
    if qtype in (GGMLType.F16, GGMLType.BF16):
        dt = torch.float16 if qtype == GGMLType.F16 else torch.bfloat16
        return data.contiguous().view(dt).float().reshape(*lead, cols)
    _, block_bytes = BLOCK_GEOMETRY[qtype]
    blk = data.reshape(-1, block_bytes)
    dec = _iq2_xxs(blk) if qtype == GGMLType.IQ2_XXS else _BLOCK_DECODERS[qtype](blk)
    return dec.reshape(*lead, cols)


def swiglu_mid(g: torch.Tensor, u: torch.Tensor, clamp: float) -> torch.Tensor:
    if clamp > 0:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)  # asymmetric: the gate has no lower bound
    return F.silu(g) * u


def _n_stack(w) -> int:
    return w.data.shape[0] if isinstance(w, Packed) else w.shape[0]


def local_slots(ids: torch.Tensor, weights: torch.Tensor, n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global expert ids [T, k] -> (local ids clamped into [0, n_local), weights with other ranks' experts
    zeroed); no host sync. One process: unchanged."""
    if not dist.active():
        return ids, weights
    local = ids - dist.rank() * n_local
    own = (local >= 0) & (local < n_local)
    return local.clamp(0, n_local - 1), torch.where(own, weights, torch.zeros_like(weights))


def combine_slots(per_slot: torch.Tensor) -> torch.Tensor:
    """[T, k, d] f32 weighted expert outputs per (token, slot) -> [T, d]: summed over the ranks, then over
    the k slots in a fixed order.

    Why per slot: each slot's output is made on exactly one rank (the others hold exact zeros there), so the
    all_reduce adds only zeros and the fixed-order slot sum afterwards is the same float arithmetic as on one
    GPU: expert-parallel outputs equal the single-GPU ones bit for bit, and runs repeat exactly (no atomics).
    Summing per rank first would round differently, which the model's FP8 / FP4 steps and the indexer's top-k
    turn into visibly different tokens within a few layers."""
    return reduce_slots(per_slot).sum(1)


def reduce_slots(per_slot: torch.Tensor) -> torch.Tensor:
    """combine_slots before its slot sum: [T, k, d] summed over the ranks (one process: unchanged), for a
    consumer that sums the k slots itself in a fixed order (the decode step's fused HC post)."""
    return dist.all_reduce_(per_slot)


def routed_decode(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate: Packed,
    up: Packed,
    down: Packed,
    clamp,
    per_slot: bool = False,
    xq: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [B, d], ids [B, k] (device), weights [B, k] -> [B, d]: sum_j w_j down_j(swiglu(gate_j x, up_j x));
    per_slot: the terms [B, k, d] unsummed (reduce_slots); xq: x's Q8_K planes for the int8 kernels
    (ds4.kernels.moe.moe_gate_up's), or None."""
    finish = reduce_slots if per_slot else combine_slots
    B, k = ids.shape
    ids, weights = local_slots(ids, weights, _n_stack(gate))
    if not isinstance(gate, Packed):  # PackedWeight stacks: the fused gather kernels
        ids32 = ids.to(torch.int32)
        mid = kmoe.moe_gate_up(x, gate, up, ids32, clamp, xq=xq)  # [B, k, F]
        # every (row, slot) pair as a row of its own: moe_down's per-pair outputs [B k, d], unsummed
        pairs = kmoe.moe_down(
            mid.reshape(B * k, 1, -1), weights.reshape(B * k, 1), down, ids32.reshape(-1, 1)
        )
        return finish(pairs.view(B, k, -1))
    out = []
    for b in range(B):  # torch Packed path (CPU): one row at a time
        sel = ids[b]
        g = decode_rows(gate.data.index_select(0, sel), gate.qtype, gate.cols)  # [k, F, d]
        u = decode_rows(up.data.index_select(0, sel), up.qtype, up.cols)
        mid = swiglu_mid(g @ x[b], u @ x[b], clamp) * weights[b, :, None]  # [k, F]
        dn = decode_rows(down.data.index_select(0, sel), down.qtype, down.cols)  # [k, d, F]
        out.append(torch.einsum("kdf,kf->kd", dn, mid))
    return finish(torch.stack(out))


def routed_prefill(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate: Packed,
    up: Packed,
    down: Packed,
    clamp: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """x [T, d], ids/weights [T, k] -> [T, d]; tokens grouped by expert, one expert decoded at a time."""
    T, k = ids.shape
    n_exp = _n_stack(gate)
    flat, w_flat = ids.reshape(-1), weights.reshape(-1)  # [N] slots, N = T*k
    slot = torch.arange(T * k, device=ids.device)  # [N] flat slot t*k + j
    if dist.active():  # keep only this rank's slots, with local expert ids (host sync: prefill only)
        lo = dist.rank() * n_exp
        slot = torch.nonzero((flat >= lo) & (flat < lo + n_exp)).reshape(-1)
        flat, w_flat = flat[slot] - lo, w_flat[slot]
    stacks = (gate, up, down)
    if not dist.active() and _grouped(gate, dtype):  # one process: the per-token sum read in place
        out, slot_sorted = _grouped_outputs(x, flat, w_flat, slot, k, stacks, clamp, dtype, n_exp)
        pos = torch.empty_like(slot_sorted)  # [N] row of `out` holding each flat slot t k + j
        pos[slot_sorted] = torch.arange(slot_sorted.numel(), device=pos.device)
        return gather_sum(out, pos.view(T, k))
    per_slot = torch.zeros(T * k, x.shape[1], dtype=torch.float32, device=x.device)  # [T k, d]
    _slot_outputs(x, flat, w_flat, slot, k, per_slot, stacks, clamp, dtype, n_exp)
    return combine_slots(per_slot.view(T, k, -1))


def _grouped(gate, dtype: torch.dtype) -> bool:
    """Whether prefill runs the grouped bf16 GEMMs (PackedWeight stacks, the kernels present)."""
    wide = dtype != torch.float32 or os.environ.get("DS4_GROUPED_F32") == "1"
    return moe_grouped is not None and wide and not isinstance(gate, Packed)


def _grouped_outputs(x, flat, w_flat, slot, k: int, stacks, clamp: float, dtype, n_exp: int):
    """(out [N, d] f32: w_flat[s] * expert_{flat[s]}(x[slot[s] // k]) in expert order, slot_sorted [N]: the
    flat slot of each row) by the grouped GEMMs (matmul.PREFILL_MOE picks how)."""
    gate, up, down = stacks
    order = torch.argsort(flat, stable=True)  # [N] slots sorted by expert
    offsets = torch.zeros(n_exp + 1, dtype=torch.int32, device=x.device)
    offsets[1:] = torch.bincount(flat, minlength=n_exp).cumsum(0)
    slot_sorted = slot[order]
    xs = x.to(dtype)[slot_sorted // k]  # [N, d] rows grouped by expert (cast first: half the bytes gathered)
    mid = moe_swiglu_grouped(xs, gate, up, offsets, w_flat[order], clamp, out_dtype=dtype)  # swiglu * weight
    return moe_grouped(mid, down, offsets), slot_sorted  # [N, d]


def _slot_outputs(x, flat, w_flat, slot, k: int, per_slot, stacks, clamp: float, dtype, n_exp: int) -> None:
    """per_slot[slot[s]] = w_flat[s] * expert_{flat[s]}(x[slot[s] // k]) for every kept slot s (each written
    once: no accumulation)."""
    gate, up, down = stacks
    if _grouped(gate, dtype):
        out, slot_sorted = _grouped_outputs(x, flat, w_flat, slot, k, stacks, clamp, dtype, n_exp)
        per_slot.index_copy_(0, slot_sorted, out.float())
        return
    order = torch.argsort(flat, stable=True)  # [N] slots sorted by expert
    hist = torch.bincount(flat, minlength=n_exp)
    slot_sorted = slot[order]
    tok_sorted = slot_sorted // k
    w_sorted = w_flat[order]
    counts = hist.tolist()  # host sync: prefill only
    xs = x.to(dtype)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sl, tok, we = (v[start : start + n] for v in (slot_sorted, tok_sorted, w_sorted))
        start += n
        xe = xs[tok]  # [n, d]
        g = xe @ _expert(gate, e).to(dtype).T  # [n, F]
        u = xe @ _expert(up, e).to(dtype).T
        mid = swiglu_mid(g.float(), u.float(), clamp) * we[:, None]
        out = mid.to(dtype) @ _expert(down, e).to(dtype).T  # [n, d]
        per_slot.index_copy_(0, sl, out.float())


def _expert(w, e: int) -> torch.Tensor:
    """Expert e of a stack, float32 [rows, cols] (Packed blocks or a ds4.kernels PackedWeight)."""
    if isinstance(w, Packed):
        return decode_rows(w.data[e], w.qtype, w.cols)
    from ds4.kernels.packing import PackedWeight, unpack

    n = w.shape[1]
    part = {key: v[e * n : (e + 1) * n] for key, v in w.data.items()}
    return unpack(PackedWeight(w.qtype, tuple(w.shape[1:]), part))
