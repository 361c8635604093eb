"""Indexer scores of a prefill chunk: every token against every compressed row, causally masked, one launch.

Legend: T tokens of the chunk (positions p0 .. p0 + T - 1), Hi indexer heads, Di indexer head dim,
C compressed indexer rows, r = ratio (4), BT tokens / BC rows per program.

  indexer_scores_prefill(qi, wts, rows, p0, ratio=4, cfg=None) -> score [T, C] f32
      score[t, c] = sum_h wts[t, h] * relu(qi[t, h, :] . rows[c, :])   where c < (p0 + t + 1) // ratio,
      -inf elsewhere (rows not yet complete at token t's position: model.md §6, §7).

This is what ds4.model.cuda.layer._indexer_pick computes with two einsums over a dense [T, Hi, C] f32
temporary (DS4_PREFILL_INDEXER=torch); the kernel never builds it: program (block of BT tokens, block of BC
rows) holds its key tile, loops over the Hi heads (one [BT, Di] x [Di, BC] tensor-core dot each), applies
the ReLU and accumulates the weighted sum in registers. Tiles wholly past every visible row of their tokens
(the causal upper triangle) read nothing.

Numerics contract.
 * Inputs: qi [T, Hi, Di] and rows [C, Di] f32 (or bf16) as the model feeds them: both come out of the
   indexer QAT (quantsim.indexer_qat: Hadamard, then an FP4 E2M1 round trip with one power-of-two scale per
   32 values), so every element is m * 2^e with m in {0, 0.5, 1, 1.5, 2, 3, 4, 6}: two significant bits. The
   dot operands are cast to bf16 (8-bit significand), which is EXACT for such values (the reference model
   itself rounds both operands to FP4 first: model.md §7 step 1, §6 step 7), and bf16 x bf16 products are
   exact in the f32 accumulator. Other inputs would be rounded to bf16 (RTNE on the GPU); the twin rounds
   the same way, so kernel and twin agree for any input. (FP4 values below 2^-126, possible only for an
   all-but-zero 32-block, are bf16 subnormals that tensor cores may flush to 0: a change far below any
   tolerance.)
   wts [T, Hi] f32 (the projection already scaled by 1/sqrt(Di * Hi)), used in f32.
 * Sums: the twin (ref.indexer_scores_prefill) sums each dot over Di and the heads over Hi with torch's f32
   einsum/GEMM order; the kernel sums the dot in the tensor core's f32 order and the heads sequentially
   h = 0..Hi-1 (acc += wts[t, h] * relu(dot)). Only the order of f32 sums differs, so
   |kernel - twin| <= (Di + Hi) * 2^-24 * sum_h |wts[t, h]| * sum_d |qi[t, h, d] * rows[c, d]| (worst case);
   tests/test_kernels_indexer_prefill.py checks 1e-5 of that bound elementwise on tiny shapes and max |diff| /
   max |twin| <= 1e-5 at Flash shapes (measured values in the module's docstring there).
 * Masked entries are exactly -inf in both (the value the top-k treats as never selected).

Dispatches to Triton on CUDA tensors (or under TRITON_INTERPRET=1) and to the torch twin on other devices.
p0 and ratio are host ints. Tiling: IndexerPrefillConfig (cfg), default INDEXER_PREFILL_CFG.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .dispatch import require as _check
from .dispatch import use_triton as _use_triton
from .ref import indexer_scores_prefill as indexer_scores_prefill_ref


class IndexerPrefillConfig(NamedTuple):
    """Tiling of the kernel (tools/gpu/bench_indexer_prefill.py times a few on the H200)."""

    bt: int  # tokens per program (>= 16: the smallest tl.dot tile on sm_90)
    bc: int  # compressed rows per program (>= 16)
    warps: int
    stages: int  # software-pipeline stages of the head loop
    precast: bool = False  # cast qi to bf16 in one torch pass first: half the bytes each row block re-reads


# H200 (tools/gpu/bench_indexer_prefill.py, T 4096, C 1024): 174 us with qi cast to bf16 first, 203-318 us for
# the other tiles without it; the einsum path it replaces took 3,021 us.
INDEXER_PREFILL_CFG = IndexerPrefillConfig(bt=64, bc=128, warps=4, stages=2, precast=True)


@triton.jit
def _indexer_prefill_kernel(
    qi_ptr, w_ptr, rows_ptr, out_ptr, T, C, Hi, Di, p0, ratio,
    s_qt, s_qh, s_wt, s_rc,
    BT: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """Program (row block pid 0, token block pid 1): score tile [BT, BC] of tokens t0.., rows c0..
    Row blocks vary fastest, so the programs running together share one token block's queries in L2."""
    c0 = tl.program_id(0) * BC
    t0 = tl.program_id(1) * BT
    t = t0 + tl.arange(0, BT)  # [BT]
    c = c0 + tl.arange(0, BC)  # [BC]
    tm = t < T
    cm = c < C
    count = (p0 + t + 1) // ratio  # [BT] rows visible to each token
    visible = (c[None, :] < count[:, None]) & cm[None, :]  # [BT, BC]
    last = (p0 + tl.minimum(t0 + BT, T)) // ratio  # rows visible to the block's last token
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    if c0 < last:  # else: wholly masked, read nothing
        d = tl.arange(0, BD)
        dm = d < Di
        keys = tl.load(
            rows_ptr + c[:, None].to(tl.int64) * s_rc + d[None, :], mask=cm[:, None] & dm[None, :], other=0.0
        ).to(tl.bfloat16)  # [BC, BD], exact for QAT'd rows
        keys_t = tl.trans(keys)  # [BD, BC]
        q_off = t[:, None].to(tl.int64) * s_qt + d[None, :]  # [BT, BD]
        qm = tm[:, None] & dm[None, :]
        w_off = t.to(tl.int64) * s_wt
        for h in range(0, Hi):
            q = tl.load(qi_ptr + q_off + h * s_qh, mask=qm, other=0.0).to(tl.bfloat16)  # [BT, BD]
            w = tl.load(w_ptr + w_off + h, mask=tm, other=0.0)  # [BT]
            s = tl.dot(q, keys_t)  # [BT, BC] f32, exact products
            acc += w[:, None] * tl.maximum(s, 0.0)
    score = tl.where(visible, acc, float("-inf"))
    out = out_ptr + t[:, None].to(tl.int64) * C + c[None, :]
    tl.store(out, score, mask=tm[:, None] & cm[None, :])


def _check_inputs(qi: torch.Tensor, wts: torch.Tensor, rows: torch.Tensor, p0: int, ratio: int) -> None:
    name = "indexer_scores_prefill"
    _check(qi.ndim == 3, f"{name}: qi must be [T, Hi, Di], got shape {tuple(qi.shape)}")
    T, Hi, Di = qi.shape
    _check(tuple(wts.shape) == (T, Hi), f"{name}: wts must be [{T}, {Hi}], got {tuple(wts.shape)}")
    _check(rows.ndim == 2 and rows.shape[1] == Di, f"{name}: rows must be [C, {Di}], got {tuple(rows.shape)}")
    for n, x in (("qi", qi), ("wts", wts), ("rows", rows)):
        _check(x.is_floating_point(), f"{name}: {n} must be floating point, got {x.dtype}")
        _check(x.device == qi.device, f"{name}: {n} is on {x.device}, qi on {qi.device}")
    _check(isinstance(p0, int) and p0 >= 0, f"{name}: p0 must be a host int >= 0, got {p0!r}")
    _check(isinstance(ratio, int) and ratio > 0, f"{name}: ratio must be a host int > 0, got {ratio!r}")


def indexer_scores_prefill(
    qi: torch.Tensor,
    wts: torch.Tensor,
    rows: torch.Tensor,
    p0: int,
    ratio: int = 4,
    cfg: IndexerPrefillConfig | None = None,
) -> torch.Tensor:
    """qi [T, Hi, Di] (RoPE'd + QAT'd queries of tokens at positions p0..), wts [T, Hi] (scaled head
    weights), rows [C, Di] (QAT'd compressed indexer rows) -> score [T, C] f32, -inf where row c is not
    yet visible to token t (c >= (p0 + t + 1) // ratio). See the module docstring for the numerics."""
    _check_inputs(qi, wts, rows, p0, ratio)
    if not _use_triton(qi):
        return indexer_scores_prefill_ref(qi, wts, rows, p0, ratio)
    cfg = cfg or INDEXER_PREFILL_CFG
    _check(cfg.bt >= 16 and cfg.bc >= 16, f"indexer_scores_prefill: tiles must be >= 16, got {cfg}")
    T, Hi, Di = qi.shape
    C = rows.shape[0]
    out = torch.empty(T, C, device=qi.device, dtype=torch.float32)
    if T == 0 or C == 0:
        return out
    if cfg.precast:  # exact for QAT'd values (module docstring), as the kernel's own cast
        qi = qi.to(torch.bfloat16)
    if qi.stride(2) != 1:
        qi = qi.contiguous()
    wts = wts.float().contiguous()
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    grid = (triton.cdiv(C, cfg.bc), triton.cdiv(T, cfg.bt))
    _indexer_prefill_kernel[grid](
        qi, wts, rows, out, T, C, Hi, Di, p0, ratio,
        qi.stride(0), qi.stride(1), wts.stride(0), rows.stride(0),
        BT=cfg.bt, BC=cfg.bc, BD=max(16, triton.next_power_of_2(Di)), num_warps=cfg.warps,
        num_stages=cfg.stages,
    )  # fmt: skip
    return out


__all__ = [
    "IndexerPrefillConfig",
    "INDEXER_PREFILL_CFG",
    "indexer_scores_prefill",
    "indexer_scores_prefill_ref",
]
