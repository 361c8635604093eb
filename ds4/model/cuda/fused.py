"""Decode-step pieces made of many tiny element-wise ops, written as pure functions so torch.compile can fuse
each into a few kernels (the decode step is otherwise hundreds of ~1 us launches per layer).

Legend: S HC streams, d = n_embd, H heads, D = head_dim, n keys, P = rotated pairs, h = compressed row width.

Same math as the CPU reference (ds4.model.hc, norm, rope, quantsim); RoPE is written with cos/sin on the
adjacent pairs (the complex multiply spelled out), which inductor handles (it does not fuse complex tensors).
`fuse(fn)` returns fn compiled when enabled (CUDA), with a permanent fallback to eager on any compile error.
"""

from __future__ import annotations

import os
import sys

import torch

from ds4.model.cuda.streams import Branch
from ds4.model.hc import HCWeights, hc_head, sinkhorn

try:
    from ds4.kernels.hc import sinkhorn as _sinkhorn  # Triton on CUDA, the torch reference elsewhere
except ImportError:  # pragma: no cover - no triton
    _sinkhorn = sinkhorn
from ds4.model.norm import rms_norm
from ds4.model.quantsim import fp8_e4m3_roundtrip, indexer_qat
from ds4.model.rope import rope_tail

FP8_BLOCK = 64

# Decode through the Triton kernels of ds4.kernels.fused (HC pre/post, q/kv norm + RoPE (+FP8), router
# top-k): a handful of launches per layer instead of torch.compile's chains. False: the torch path below
# (compiled on CUDA when SWITCH.enabled), kept for A/B timing. Off CUDA the kernel dispatchers run their
# torch twins (ds4/kernels/ref.py), so the CPU tests exercise this wiring too. Env DS4_TRITON_FUSED=0: off.
TRITON_FUSED = os.environ.get("DS4_TRITON_FUSED", "1") != "0"
try:
    from ds4.kernels import compress as _kc
    from ds4.kernels import fused as _kf
except ImportError:  # pragma: no cover - no triton
    TRITON_FUSED, _kf, _kc = False, None, None


class _Switch:
    enabled = False  # set by CudaModel (compile=True on CUDA)


SWITCH = _Switch()


def fuse(fn=None, *, dynamic: bool = False, when=None):
    """fn compiled (torch.compile, `dynamic` shapes) while SWITCH is on and `when()` (if given) holds;
    usable bare (@fuse) or with options (@fuse(dynamic=True, when=...))."""
    if fn is None:
        return lambda f: fuse(f, dynamic=dynamic, when=when)
    compiled = None
    failed = False

    def run(*args):
        nonlocal compiled, failed
        if not SWITCH.enabled or failed or (when is not None and not when()):
            return fn(*args)
        if compiled is None:
            torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
            compiled = torch.compile(fn, dynamic=dynamic)
        try:
            return compiled(*args)
        except Exception as e:  # compile problems must not break decoding: stay eager
            failed = True
            print(
                f"ds4: torch.compile of {fn.__name__} failed, running it eagerly: {e!r}"[:400],
                file=sys.stderr,
            )
            return fn(*args)

    run.__name__ = fn.__name__
    return run


def rope_real(
    x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """rope_tail for x [1, W] or [1, heads, W] at pos [1] (GPT-J adjacent pairs of the last 2P dims)."""
    n_rot = 2 * inv_freq.numel()
    ang = pos[:, None] * inv_freq[None, :]  # [1, P]
    c, s = torch.cos(ang), torch.sin(ang)
    if inverse:
        s = -s
    if x.dim() == 3:
        c, s = c[:, None, :], s[:, None, :]
    tail = x[..., -n_rot:].unflatten(-1, (-1, 2))
    a, b = tail[..., 0], tail[..., 1]
    rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    return torch.cat([x[..., :-n_rot], rot], dim=-1)


def _fp8_nope(x: torch.Tensor, n_rot: int) -> torch.Tensor:
    return torch.cat([fp8_e4m3_roundtrip(x[..., :-n_rot], FP8_BLOCK), x[..., -n_rot:]], dim=-1)


@fuse
def _hc_mix(X, fn, scale, base, rms_eps: float, hc_eps: float):
    """(pre [1, S], post [1, S], combine logits [1, S, S]) of an HC site."""
    S = X.shape[1]
    flat = X.flatten(1)
    mix = torch.nn.functional.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    pre = torch.sigmoid(mix[:, :S] * scale[0] + base[:S]) + hc_eps
    post = 2 * torch.sigmoid(mix[:, S : 2 * S] * scale[1] + base[S : 2 * S])
    return pre, post, (mix[:, 2 * S :] * scale[2] + base[2 * S :]).unflatten(-1, (S, S))


@fuse
def _hc_collapse(pre, X, norm, rms_eps: float):
    return rms_norm((pre[:, :, None] * X).sum(1), norm, rms_eps)


def hc_pre_norm(
    X, fn, scale, base, norm, iters: int, rms_eps: float, hc_eps: float, mix=None, quant_out=None
):  # fmt: skip
    """HC collapse + the sublayer's RMSNorm: X [1, S, d] -> (xn [1, d], post [1, S], comb [1, S, S]).
    The Sinkhorn loop is one Triton kernel (ds4.kernels.hc) where available: inductor splits it into
    2 * iters tiny kernels. mix: X's mixing partials from hc_post_mix (kernel path only), or None;
    quant_out: xn's Q8_K planes (kernel path only: hc_pre_fused's), or None."""
    if TRITON_FUSED:
        return _kf.hc_pre_fused(
            X, fn, scale, base, iters, rms_eps, hc_eps, norm, mix=mix, quant_out=quant_out
        )
    pre, post, logits = _hc_mix(X, fn, scale, base, rms_eps, hc_eps)
    comb = _sinkhorn(logits, iters, hc_eps)
    return _hc_collapse(pre, X, norm, rms_eps), post, comb


# The combine matrix's Sinkhorn (2 * iters serial normalisations of a 4 x 4 tile, each a cross-warp sum in
# the 16-warp finish kernel) as its own launch on side lane 2, beside the sublayer: only hc_post reads comb.
# H200, session 17 (ab_decode.py, 4k ctx): 113.21 tok/s vs 111.20 inside the finish kernel (x1.018); B = 2 /
# 8 / 32 step x1.031 / x1.015 / x1.005. Env DS4_HC_COMB_SIDE=0: inside the finish kernel, on the step's
# critical path.
HC_COMB_SIDE = os.environ.get("DS4_HC_COMB_SIDE", "1") != "0"


# The routed experts' Q8_K input planes made by the FFN site's HC finish launch (kernels.fused.hc_pre_fused
# quant_out) instead of a quantization launch of their own before the gate/up kernel: 43 launches a token
# fewer, the same bits. Measured slower on the H200 (session 18, ab_decode.py at 4k ctx, both rounds alike):
# 131.13 tok/s with it vs 132.52 without (x0.989): the finish, on the step's critical path, grows by more
# than the separate launch costs (the [4096] row regrouped into [16, 256] blocks across its 16 warps). Off;
# env DS4_Q8K_IN_FINISH=1: on. Q8K_SIDE: that launch on side lane 3 instead, beside the router (batch.py):
# at 8k ctx 125.67 vs 125.56 tok/s (x1.001, session 18): no gain, off; env DS4_Q8K_SIDE=1: on.
Q8K_IN_FINISH = os.environ.get("DS4_Q8K_IN_FINISH", "0") == "1"
Q8K_SIDE = os.environ.get("DS4_Q8K_SIDE", "0") == "1"


def hc_pre_branch(
    X, fn, scale, base, norm, iters: int, rms_eps: float, hc_eps: float, mix=None, quant: int = 0
):  # fmt: skip
    """hc_pre_norm with comb as a streams.Branch: (xn, post, branch, xq), branch.join() -> comb [B, S, S].
    mix: as hc_pre_norm's. quant > 0 (with Q8K_IN_FINISH on the kernel path): xq = xn's Q8_K planes with
    that many terms (q int8 [quant, B, d], d [B, d/256]) as intq.quantize_q8k makes them; else None."""
    xq = None
    if TRITON_FUSED and quant and Q8K_IN_FINISH and X.shape[-1] % 256 == 0:
        B, d = X.shape[0], X.shape[-1]
        xq = (
            torch.empty(quant, B, d, dtype=torch.int8, device=X.device),
            torch.empty(B, d // 256, dtype=torch.float32, device=X.device),
        )
    if TRITON_FUSED and HC_COMB_SIDE:
        xn, post, logits = _kf.hc_pre_fused(
            X, fn, scale, base, iters, rms_eps, hc_eps, norm, sinkhorn=False, mix=mix, quant_out=xq
        )
        return xn, post, Branch(X.device, lambda: _sinkhorn(logits, iters, hc_eps), lane=2), xq
    xn, post, comb = hc_pre_norm(X, fn, scale, base, norm, iters, rms_eps, hc_eps, mix, xq)
    return xn, post, Branch.ready(comb), xq


# The HC post and the next HC site's mixing partials in one launch (ds4.kernels.fused.hc_post_mix: 85 launches
# a token fewer, X' not read again for them; the same K splits as the separate kernel's). Measured slower on
# the H200 (session 18, ab_decode.py at 4k ctx, both rounds alike): 121.81 vs 123.26 tok/s (x0.988); B = 1 /
# 8 / 32 step x0.990 / x0.991 / x0.990 (batch_check.py); the batched-vs-alone check passed with it. Off; env
# DS4_HC_POST_MIX=1: on.
HC_POST_MIX = os.environ.get("DS4_HC_POST_MIX", "0") == "1"


def hc_post_mix(f, X, post, comb, parts, next_fn):
    """(X', mix): hc_post(f, X, post, comb, parts), and with HC_POST_MIX and a next HC site (its mixing
    projection next_fn [M, S*d]) that site's mixing partials of X' for hc_pre_branch(..., mix=); else None."""
    if TRITON_FUSED and HC_POST_MIX and next_fn is not None:
        return _kf.hc_post_mix(f, X, post, comb, parts, next_fn)
    return hc_post(f, X, post, comb, parts), None


def hc_post(f, X, post, comb, parts=None):
    """X' [B, S, d] from the sublayer output f [B, d] (ds4.model.hc.hc_post); parts [B, k, d]: the output
    is sum_j parts[:, j] + f (ds4.kernels.fused.hc_post_fused folds that sum into its launch)."""
    if TRITON_FUSED:
        return _kf.hc_post_fused(f, X, post, comb, parts)
    if parts is not None:
        f = parts.sum(1) + f
    return _hc_post(f, X, post, comb)


@fuse
def _hc_post(f, X, post, comb):
    return post[:, :, None] * f[:, None, :] + (comb[:, :, :, None] * X[:, :, None, :]).sum(1)


def q_post(q, pos, inv_freq, eps: float):
    """q [B, H, D] (any float dtype, widened on load): per-head RMS (no weight), then RoPE -> f32."""
    if TRITON_FUSED:
        return _kf.q_norm_rope(q, pos, inv_freq, eps)
    return _q_post(q, pos, inv_freq, eps)


@fuse
def _q_post(q, pos, inv_freq, eps: float):
    return rope_real(rms_norm(q, None, eps), pos, inv_freq)


def o_post(o, pos, inv_freq, dtype: torch.dtype):
    """o [T, H, D] f32 -> the inverse RoPE of its tail, in `dtype` (the output projection's GEMM dtype)."""
    if TRITON_FUSED:
        return _kf.o_unrope(o, pos, inv_freq, dtype)
    return rope_tail(o, pos, inv_freq, inverse=True).to(dtype)


def _kv_kernel(kv, inv_freq, n_rot: int) -> bool:
    """Whether the kv row goes through ds4.kernels.fused's kernel: RoPE over all n_rot tail dims, whole FP8
    blocks before them."""
    return TRITON_FUSED and n_rot == 2 * inv_freq.numel() and (kv.shape[-1] - n_rot) % FP8_BLOCK == 0


def kv_post(kv, kv_norm, pos, inv_freq, eps: float, n_rot: int, out=None, rows=None):
    """kv [B, D]: RMSNorm with weight, RoPE, FP8 round trip of the first D - n_rot dims; with out [M, D] and
    rows [B]: written to out[rows] (the raw KV ring; returns out)."""
    if _kv_kernel(kv, inv_freq, n_rot):
        return _kf.kv_norm_rope_fp8(kv, kv_norm, pos, inv_freq, eps, out, rows)
    row = _kv_post(kv, kv_norm, pos, inv_freq, eps, n_rot)
    return row if out is None else out.index_copy_(0, rows, row)


# The decode step's q_a RMSNorm inside the kv row's launch (ds4.kernels.fused.qa_kv_norm_rope_fp8: 43 launches
# a token fewer, each on the step's critical path). H200, session 18 (ab_decode.py at 4k ctx, both rounds
# alike): 131.13 vs 130.23 tok/s with its own launch (x1.007). Env DS4_QA_NORM_FUSED=0: a compiled launch of
# its own.
QA_NORM_FUSED = os.environ.get("DS4_QA_NORM_FUSED", "1") != "0"


def qa_kv_post(qa, qa_norm, kv, kv_norm, pos, inv_freq, eps: float, n_rot: int, out, rows):
    """rms_norm(qa, qa_norm, eps) [B, Rq], after kv_post(kv, kv_norm, ..., out, rows) has written the kv
    rows: one launch when QA_NORM_FUSED and the kv kernel applies."""
    if QA_NORM_FUSED and _kv_kernel(kv, inv_freq, n_rot):
        return _kf.qa_kv_norm_rope_fp8(qa, qa_norm, kv, kv_norm, pos, inv_freq, eps, out, rows)[0]
    kv_post(kv, kv_norm, pos, inv_freq, eps, n_rot, out, rows)
    return _rms(qa, qa_norm, eps)


@fuse(dynamic=True)
def _rms(x, weight, eps: float):
    """rms_norm (eager: five kernels)."""
    return rms_norm(x, weight, eps)


@fuse
def _kv_post(kv, kv_norm, pos, inv_freq, eps: float, n_rot: int):
    return _fp8_nope(rope_real(rms_norm(kv, kv_norm, eps), pos, inv_freq), n_rot)


# The indexer query's QAT by ds4.kernels.compress.indexer_q (one launch) rather than the compiled torch chain;
# not yet timed on a GPU. Env DS4_INDEXER_Q_KERNEL=0: the torch chain.
INDEXER_Q_KERNEL = os.environ.get("DS4_INDEXER_Q_KERNEL", "1") != "0"


def indexer_q_post(qi, pos, inv_freq):
    """qi [B, Hi, Di]: RoPE of the tail, then the indexer QAT (Hadamard + FP4): one Triton launch
    (ds4.kernels.compress.indexer_q) when on and Di is a power of two, else the torch chain (compiled: ~5
    kernels)."""
    D = qi.shape[-1]
    if INDEXER_Q_KERNEL and TRITON_FUSED and _kc is not None and D >= 32 and D & (D - 1) == 0:
        return _kc.indexer_q(qi, pos, inv_freq)
    return _indexer_q_post(qi, pos, inv_freq)


@fuse
def _indexer_q_post(qi, pos, inv_freq):
    return indexer_qat(rope_real(qi, pos, inv_freq))


# The decode step's two torch chains outside the layers' kernels as Triton launches (ds4.kernels.fused): the
# output head's HC collapse + output norm (hc_head_fused: 2 launches for ~18 torch kernels a step) and the
# hash layers' routing (router_hash: 1 for ~8, 3 layers on Flash). ~40 launches a step fewer, each of them
# a plain torch kernel that ends the PDL chain (dispatch.PDL) around it: the replayed 4k step's timeline
# (tools/gpu/graph_timeline.py, session 21) charged the torch kernels ~125 us of its 7,310. Built in
# session 22 without a GPU (interpreter tests, sm_90 builds). Session 23, H100, the first 30 layers at 4k
# ctx (tools/gpu/ab_decode.py "tail fused", 3 rounds, all alike): 183.30 vs 181.05 tok/s (x1.012); B = 1 /
# 16 / 32 steps at 8k x1.031 / x0.994 / x0.995 (batch_check.py, 2 rounds); on, then torch as the variant
# (3 rounds): B = 1 x0.986, B = 32 x1.001 for torch. On. Env DS4_TAIL_FUSED=0: off.
TAIL_FUSED = os.environ.get("DS4_TAIL_FUSED", "1") != "0"


def head_norm(X, w: HCWeights, norm, rms_eps: float, hc_eps: float):
    """The output head's input: rms_norm(hc_head(X), norm), X [B, S, d] -> [B, d] f32."""
    if TRITON_FUSED and TAIL_FUSED:
        return _kf.hc_head_fused(X, w.fn, w.scale, w.base, norm, rms_eps, hc_eps)
    return rms_norm(hc_head(X, w, rms_eps=rms_eps, hc_eps=hc_eps), norm, rms_eps)


def router_hash(logits, tid2eid, tokens, scale: float, normalize: bool):
    """(ids [B, k] int32, weights [B, k]) of a hash layer (ds4.kernels.fused.router_hash; TAIL_FUSED)."""
    return _kf.router_hash(logits, tid2eid, tokens, scale, normalize)


def router_topk(logits, bias, k: int, scale: float, normalize: bool):
    """(ids [1, k] int32, weights [1, k]) of a non-hash router (ds4.kernels.fused.router_topk)."""
    return _kf.router_topk(logits, bias, k, scale, normalize)
