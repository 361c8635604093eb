"""Static weights pulled into L2 ahead of the kernel that reads them (sm_90 bulk prefetch).

Why: the batch-1 decode step is a chain of short kernels, most of them latency-bound (the H200 streams far
below its 4.3 TB/s in each, and DRAM idles between them: the attention's score / select / softmax kernels
read little). A matrix that the chain reaches next (the attention output projection, 36 MB of Q8_0 on
Flash, within the 50 MB L2) can be requested from DRAM while those kernels run, so that its matvec reads L2
instead of waiting on DRAM. `cp.async.bulk.prefetch.L2` asks the memory system for a byte range without
registers, shared memory or a wait: the launch costs one short kernel, the transfer runs behind the next
kernels. Values never change, so only timing can tell whether it pays (tools/gpu/ab_decode.py "prefetch o"):
on the H200 it did not: session 18 x0.873 with o_a's 36 MB on the main stream; session 19 x0.975-1.004 on
a side lane at any of model.cuda.layer.PREFETCH's sites, and tools/gpu/bench_prefetch.py found a matvec
on prefetched blocks only ~18 % faster (the decode matvecs are not DRAM-latency-bound). Off.

Legend: n bytes, CHUNK bytes per prefetch instruction, PER instructions per program (one per thread).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .dispatch import PDL, pdl_wait

# Bytes per bulk prefetch (a multiple of 16) and prefetches per program (one warp, a thread each). Session 18
# measured 64 KB x 32 (2 MB a program: 18 programs for 36 MB, a few SMs' copy engines doing all of it);
# tools/gpu/bench_prefetch.py times the spread. Env DS4_PREFETCH_CHUNK_KB / DS4_PREFETCH_PER.
PREFETCH_CHUNK = int(os.environ.get("DS4_PREFETCH_CHUNK_KB", "64")) << 10
PREFETCH_PER = int(os.environ.get("DS4_PREFETCH_PER", "32"))


@triton.jit
def _l2_prefetch_kernel(base_ptr, nbytes, PER: tl.constexpr, CHUNK: tl.constexpr, PTX: tl.constexpr):
    """Program p requests bytes [p PER CHUNK, (p + 1) PER CHUNK) of base (nbytes a multiple of 16) into L2.
    PTX off (the interpreter): the offsets only, no request."""
    pdl_wait()  # nothing it touches is written by the kernel before; the wait keeps the launch rules simple
    i = tl.program_id(0) * PER + tl.arange(0, PER)
    off = i.to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - off, 0), CHUNK).to(tl.int32)
    if PTX:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [base_ptr + off, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def _where(t: torch.Tensor) -> str | None:
    """ "gpu" where bulk prefetch runs (CUDA sm_90+), "interpreter" under TRITON_INTERPRET=1 (the kernel's
    offsets only: tests), None where nothing is launched (CPU tensors, older GPUs, a start not 16-byte
    aligned, a strided view)."""
    if not t.is_contiguous() or t.data_ptr() % 16:
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "interpreter"
    if t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9:
        return "gpu"
    return None


def prefetch_l2(
    tensors: list[torch.Tensor], budget: int, chunk: int | None = None, per: int | None = None
) -> int:
    """Request up to `budget` bytes of the tensors, in order, into L2 (one launch each; nothing where bulk
    prefetch is not available) -> the bytes requested. Values are never changed. chunk / per: bytes per
    request (a multiple of 16) and requests per program (a power of two), PREFETCH_CHUNK / _PER if None."""
    chunk, per = chunk or PREFETCH_CHUNK, per or PREFETCH_PER
    if chunk % 16 or per & (per - 1):
        raise ValueError(f"prefetch_l2: chunk {chunk} must be a multiple of 16 and per {per} a power of two")
    done = 0
    for t in tensors:
        n = min(t.numel() * t.element_size(), budget - done) // 16 * 16
        if n <= 0:
            break
        where = _where(t)
        if where is None:
            continue
        _l2_prefetch_kernel[(triton.cdiv(n, per * chunk),)](
            t.view(torch.uint8), n, PER=per, CHUNK=chunk, PTX=where == "gpu",
            num_warps=1, launch_pdl=PDL,
        )  # fmt: skip
        done += n
    return done


__all__ = ["prefetch_l2"]
