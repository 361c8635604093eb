"""Triton kernels of the CUDA fast path, one module per family, each with a plain-torch twin in ref.py.

Quantized-weight ops: weights are repacked once by ``packing.pack`` and stay quantized on the GPU; every op
dispatches to Triton on CUDA tensors (or under TRITON_INTERPRET=1) and to its ref twin on CPU. All outputs are
f32; ids are read on the device (no host syncs: CUDA-graph capturable once the kernels are compiled).

  packing.pack(raw, qtype, shape) -> PackedWeight; packing.unpack(pw) -> f32 (bit-exact dequant)
  matvec.qmatvec(x [B, K], W [N, K]) -> [B, N]                 decode; f32-exact, or bf16 MMA if x bf16, B > 4
  matvec.qmatvec_grouped(x [B, G, K], W [G, N, K]) -> [B, G, N]  per-group matrices (attention o_a)
  moe.moe_gate_up(x [B, K], Wg, Wu [E, F, K], ids [B, k], clamp[, xq]) -> mid [B, k, F]  unweighted SwiGLU
  moe.moe_down(mid [B, k, F], weights [B, k], Wd [E, D, F], ids) -> [B, D]       router weights applied here
  moe.group_by_expert(ids [T, k], E) -> (order [T*k], offsets [E+1])             for the grouped GEMM
  matmul.qmatmul(x [M, K], W [N, K]) -> [M, N]                 prefill; bf16 tensor cores
  matmul.moe_grouped(x_sorted [M, K], W [E, N, K], offsets [E+1]) -> [M, N]     prefill; bf16 tensor cores
  matmul.moe_swiglu_grouped(x, Wg, Wu, offsets, row_weights, clamp) -> mid [M, F]  prefill gate+up+SwiGLU
  matmul.dequant_experts(W [E, N, K], ids) -> bf16 [n, N, K]   the experts' weights once per chunk (scratch)
  matvec.hmatvec(x [B, K], W [N, K] f16/bf16) -> [B, N]       decode side matrices (compressor, router, ...)
  gemm.linear_f32(x [M, K], W [N, K] f32) -> [M, N]            prefill's f32 matrices; tf32x3 tensor cores
  attend.attend_decode(q [B, H, D], pool ring / compressed rows by slot, ...) -> o [B, H, D]   decode
  attend.indexer_scores(qi [B, Hi, Di], wts [B, Hi], rows [S, cap, Di], slot, count[, wscale]) -> [B, cap]
  attend_prefill.attend_prefill(q [T, H, D], raw, comp rows by index, ...) -> o [T, H, D]       prefill
  compress.compress_decode(kv, score, ape, frontiers [S, ...], rows [S, cap, h], slot, pos, ...)  in place
  fused.*: HC pre/post (+ x's Q8_K planes), q / kv norm + RoPE (+ FP8, + the q_a norm), router top-k  decode
  intq.quantize_q8k(x [R, K], terms) -> (planes [T, R, K] int8, scales)  the routed experts' activations
  topk.top_rows(score [B, n], k) -> [B, k]  the indexer's top-k by tl.topk (off: slower than the sort)
Supported weight types: F32, F16, BF16, Q8_0, Q2_K, Q4_K, IQ2_XXS (row length a multiple of 256 for K-quants,
of 16 otherwise).
"""

from __future__ import annotations

import os


def _fix_triton_interpreter() -> None:
    """Three fixes to Triton 3.6's interpreter (tests only; no effect on compiled kernels).

    1. It stores scalars as 1-element arrays and converts them with ``int(array)``, which numpy >= 2.3 rejects
       for ndim > 0, so every ``for i in range(n)`` with a runtime ``n`` fails: convert the single element.
    2. ``tl.dot`` on bf16 operands multiplies their raw uint16 storage: widen bf16 to f32 first (exact), which
       is what the tensor cores compute (exact products, f32 accumulation).
    3. f32 -> bf16 casts (explicit, or a store into a bf16 tensor) truncate: round to nearest even instead,
       as the compiled code does.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - triton missing: the CPU path never needs it
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_ds4_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._ds4_fixed = True
    interpreter._patch_lang_tensor = patched

    import numpy as np
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = dot
    cast_impl = builder.cast_impl

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:  # round, as cvt.rn.bf16.f32
            # (the interpreter's own RTNE path drops the carry into the exponent: 1.9973 -> 1.0)
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            nan = np.isnan(src.data)
            data = np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)  # NaN stays NaN
            return interpreter.TensorHandle(data, tl.bfloat16)
        return cast_impl(self, src, dst_type)

    builder.cast_impl = cast


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_triton_interpreter()
