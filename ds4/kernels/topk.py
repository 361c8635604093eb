"""The decode indexer's top-k rows: the k largest of each row's scores, in the order of a stable descending
sort (ties to the lower index), by Triton's bitonic top-k over unique int64 keys.

Legend: B rows, n scores per row, k kept (a power of two), C keys per program (a power of two >= k).

torch's stable sort of every compressed row (the twin, ref.top_rows) was a 25 us radix sort per ratio-4 layer
at 8k context on the H200 (21 calls per token; session 11 profile), and torch.topk was slower still. Here
each score becomes a unique key (the float's order-preserving bits above 2^31 - 1 - index, so equal scores
rank the lower index first) and a program keeps the top k of C keys with tl.topk (sorted, descending). Rows
of more than C scores go in rounds: each chunk of C keeps its k best, until one chunk is left. No host sync,
shapes fixed by (B, n, k): a CUDA graph can capture it. Measured slower than the sort in the model (69 vs
25 us a call at 8k ctx, H200, session 11): off by default (ds4.model.cuda.layer.TOPK_KERNEL).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ref
from .dispatch import PDL, pdl_wait
from .dispatch import require as _check
from .dispatch import use_triton as _use_triton

TOPK_CHUNK = 4096  # keys per program: 16 int64 a thread at TOPK_WARPS = 8
TOPK_WARPS = 8


@triton.jit
def _pad():
    """Below every real key: -2^63."""
    return -9223372036854775807 - 1


@triton.jit
def _score_keys(score_ptr, i, valid):
    """Unique int64 keys of the scores at i (valid), as (score desc, index asc); _pad() elsewhere."""
    s = tl.load(score_ptr + i, mask=valid, other=0.0) + 0.0  # + 0.0: -0.0 -> +0.0 (the sort ties them)
    bits = s.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    key = (ordered << 32) | (0x7FFFFFFF - i.to(tl.int64))  # lower index -> larger key
    return tl.where(valid, key, _pad())


@triton.jit
def _topk_kernel(
    src_ptr, dst_ptr, n, stride_src, chunks,
    C: tl.constexpr, K: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
):  # fmt: skip
    """Program (b, chunk c): the K largest keys of row b's elements [c C, (c + 1) C) of n. FIRST: src is the
    f32 scores [B, stride_src], else keys [B, n] int64. LAST (one chunk): dst gets the K indices [B, K]
    int64, else keys [B, chunks, K]."""
    pdl_wait()  # inputs of the previous kernel (dispatch.PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    i = c * C + tl.arange(0, C)
    valid = i < n
    if FIRST:
        keys = _score_keys(src_ptr + b.to(tl.int64) * stride_src, i, valid)
    else:
        keys = tl.load(src_ptr + b.to(tl.int64) * n + i, mask=valid, other=_pad())
    top = tl.topk(keys, K)  # [K] descending
    j = tl.arange(0, K)
    if LAST:
        tl.store(dst_ptr + b.to(tl.int64) * K + j, 0x7FFFFFFF - (top & 0xFFFFFFFF))
    else:
        tl.store(dst_ptr + (b.to(tl.int64) * chunks + c) * K + j, top)


def supports(n: int, k: int) -> bool:
    """Whether the kernel takes n scores per row and k kept: k a power of two, k <= n, within one chunk."""
    return 0 < k <= min(n, TOPK_CHUNK) and k & (k - 1) == 0 and n < (1 << 31)


def top_rows(score: torch.Tensor, k: int) -> torch.Tensor:
    """score [B, n] f32 (rows may be a column slice: unit stride in the last dim) -> [B, k] int64 indices
    of the k largest, in stable descending order (= ref.top_rows). Triton on CUDA when supports(n, k)."""
    _check(score.ndim == 2 and score.dtype == torch.float32, "top_rows: score must be [B, n] float32")
    B, n = score.shape
    _check(0 < k <= n, f"top_rows: need 0 < k <= n, got k={k}, n={n}")
    if not (_use_triton(score) and supports(n, k)) or B == 0:
        return ref.top_rows(score, k)
    if score.stride(1) != 1:
        score = score.contiguous()
    src, stride, first = score, score.stride(0), True
    while True:
        C = min(TOPK_CHUNK, max(k, triton.next_power_of_2(n)))
        chunks = triton.cdiv(n, C)
        last = chunks == 1
        dst = torch.empty((B, k) if last else (B, chunks, k), dtype=torch.int64, device=score.device)
        _topk_kernel[(B, chunks)](
            src, dst, n, stride, chunks, C=C, K=k, FIRST=first, LAST=last, num_warps=TOPK_WARPS,
            launch_pdl=PDL,
        )  # fmt: skip
        if last:
            return dst
        src, n, stride, first = dst, chunks * k, chunks * k, False


__all__ = ["top_rows", "supports"]
