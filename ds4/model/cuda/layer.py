"""One decoder layer on the device: chunked prefill (host-known positions) and a graph-safe decode step.

Legend: T tokens of the chunk, B tokens of a query block, S HC streams, d = n_embd, H heads, D = head_dim,
R = n_rot, W = window, r = ratio, c = 2 if r == 4 else 1, h = compressed row width, cap = compressed-row
capacity, k = indexer top-k (or every row when fewer exist), Hi/Di indexer heads/dim, V vocabulary.

The math is the CPU reference's (ds4.model.*), reusing its primitives (RMSNorm, RoPE, FP8/FP4 round trips,
HC, router, compressor pooling); what differs is where state lives (DeviceKVState) and how the work is cut:
 * decode pieces (`attention_decode_pool`, `route_decode`, `shared_gate_up`) read positions from device
   tensors and write the pool-layout KV buffers in place, so they have no host sync and no data-dependent
   shape: a CUDA graph can capture them. The step itself is ds4.model.cuda.batch.decode_layer_batch, for
   B sessions of a pool or one state as a one-slot pool (DeviceLayerKV.as_pool);
 * prefill (`prefill_layer`) runs a chunk layer-major like the CPU path, attention in query blocks over the
   raw window + the compressed rows each query may see, and the routed experts grouped by expert.
Big matrices may be bfloat16 (`lin` casts the activations); KV rows, scores and softmax stay float32.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds4.kernels import ref as kernel_ref
from ds4.model.attention import AttentionShape, CompressorWeights, compress_chunk, fp8_nope
from ds4.model.block import LayerWeights
from ds4.model.cuda import fused
from ds4.model.cuda.experts import routed_prefill, swiglu_mid
from ds4.model.cuda.state import DeviceLayerKV
from ds4.model.cuda.streams import Branch
from ds4.model.cuda.weights import QLinear
from ds4.model.hc import hc_post, hc_pre
from ds4.model.moe import route
from ds4.model.norm import rms_norm
from ds4.model.quantsim import indexer_qat
from ds4.model.rope import rope_tail

try:  # the packed-weight matvec kernels (another module's family); the dense path works without them
    from ds4.kernels.matvec import hmatvec, qmatvec, qmatvec_grouped
except ImportError:  # pragma: no cover - kernels not installed
    hmatvec = qmatvec = qmatvec_grouped = None
try:  # decode attention / compressor kernels over pool-layout buffers (their torch twins on the CPU)
    from ds4.kernels import attend as attend_k
    from ds4.kernels import compress as compress_k
    from ds4.kernels import topk as topk_k
    from ds4.kernels.prefetch import prefetch_l2
except ImportError:  # pragma: no cover - no triton
    attend_k = compress_k = topk_k = prefetch_l2 = None
try:  # chunk prefill attention reading the gathered compressed rows in place (no [T, k, D] copies)
    from ds4.kernels.attend_prefill import attend_prefill
except ImportError:  # pragma: no cover - no triton
    attend_prefill = None
try:  # prefill's f32 matrices on tensor cores at f32 accuracy (tf32x3)
    from ds4.kernels.gemm import linear_f32
except ImportError:  # pragma: no cover - no triton
    linear_f32 = None
try:  # the prefill indexer's masked [T, C] scores in one launch (no [T, Hi, C] temporary)
    from ds4.kernels.dispatch import use_triton
    from ds4.kernels.indexer_prefill import indexer_scores_prefill
except ImportError:  # pragma: no cover - no triton
    indexer_scores_prefill = use_triton = None

SCORE_BUDGET = 1 << 25  # elements of one query block's score / gathered-key temporaries


DECODE_ROWS = 8  # activation rows up to which a QLinear uses the packed matvec kernel
# Rows (above DECODE_ROWS) up to which a QLinear still reads its packed Q8_0 blocks with f32 activations
# (matvec.q8_rows: tensor cores, f32-accurate) instead of its dense bf16 copy (prefill's GEMMs): batched
# decode steps of many sessions. The bf16 copy rounds weights and activations to bf16, which put batched
# decode at 16 rows ~3e-2 of the logit std off the single-session path on the H200 (session 4; 8 rows:
# within 2e-2); the packed blocks are also half the bytes. 0: the dense copy above DECODE_ROWS (the old
# path). Not yet timed on a GPU (tools/gpu/bench_q8.py --rows, tools/gpu/batch_check.py). Env
# DS4_BATCH_QROWS. Read when a step is built: recapture the graphs after changing it.
BATCH_QROWS = int(os.environ.get("DS4_BATCH_QROWS", "64"))
# Activation rows up to which the merged packed matrices of one input (SideMatrices.qa_kv: q_a + kv;
# shared_gu: the shared expert's gate + up) are read by one launch instead of one each; they are read only
# where the rows read packed blocks (reads_packed) at all. DECODE_ROWS: the batch-1 matvec and the small
# tiles; up to BATCH_QROWS (64) the batched steps' q8_rows too (86 launches a step fewer, larger grids:
# the q_a + kv row tiles and their k-splits are the separate launches', so those sums are the same; gate +
# up may split k fewer times). Built in session 22 without a GPU; session 23, H100, the first 30 layers at
# 8k ctx (tools/gpu/batch_check.py --variants "merged rows 64", 2 rounds): B = 32 33.98 vs 34.72 ms
# (x1.022), B = 16 x1.005, B = 1 x1.001; then 8 as the variant (3 rounds): B = 32 x0.977 for 8. So
# wherever rows read packed blocks (reads_packed's bound, 64); the batched-vs-alone check passed at it.
# Env DS4_MERGED_ROWS (8: DECODE_ROWS, the batch-1 paths only); read when a step is built: recapture after
# changing.
MERGED_ROWS = int(os.environ.get("DS4_MERGED_ROWS", str(max(DECODE_ROWS, BATCH_QROWS))))


# Rows from which a float32 matrix (router, compressors, q_a, kv, indexer proj: ds4.model.cuda.weights keeps
# them f32) is applied by ds4.kernels.gemm.linear_f32 (tf32x3 tensor cores, f32 accuracy) on CUDA instead of
# cuBLAS' FMA kernels: prefill chunks, not decode. An 8k prompt from empty (synthetic Flash q2, H200,
# tools/gpu/prefill_ab.py, session 9): 2.207 -> 2.158 s with this alone. 0: never. Env DS4_F32_TC_ROWS.
F32_TC_ROWS = int(os.environ.get("DS4_F32_TC_ROWS", "256"))


def lin_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ w[out, in]^T: linear_f32 for f32 operands from F32_TC_ROWS rows on CUDA, else F.linear."""
    tc = linear_f32 is not None and 0 < F32_TC_ROWS <= x.shape[0] and x.is_cuda and x.ndim == 2
    if tc and x.dtype == w.dtype == torch.float32:
        return linear_f32(x, w)
    return F.linear(x, w)


def reads_merged(rows: int) -> bool:
    """Whether `rows` activation rows read a merged packed matrix by one launch (MERGED_ROWS)."""
    return rows <= MERGED_ROWS and reads_packed(rows)


def reads_packed(rows: int) -> bool:
    """Whether a QLinear applied to `rows` activation rows reads its packed blocks (decode and batched decode)
    rather than its dense copy (prefill)."""
    return rows <= max(DECODE_ROWS, BATCH_QROWS)


def lin(x: torch.Tensor, w: torch.Tensor | QLinear, keep: bool = False) -> torch.Tensor:
    """x [T, in] f32 @ w[out, in]^T -> f32 [T, out]: the packed matvec kernels for decode-sized row counts
    of a QLinear (reads_packed), else a GEMM in the dense copy's dtype (tensor cores for bf16). keep: a
    bf16 GEMM's output left in bf16 (for a kernel that widens on load: the same values, no f32 copy)."""
    if isinstance(w, QLinear):
        if reads_packed(x.shape[0]):
            return qmatvec(x, w.packed)
        w = w.dense
    if w.dtype == torch.float32:
        return lin_f32(x, w)
    y = F.linear(x.to(w.dtype), w)
    return y if keep else y.float()


def dense_dtype(w: torch.Tensor | QLinear) -> torch.dtype:
    """The dtype a prefill GEMM with w runs in (its dense copy's)."""
    return (w.dense if isinstance(w, QLinear) else w).dtype


# Prefill's per-token chains through the decode step's Triton kernels (ds4.kernels.fused): q's per-head norm +
# RoPE (q_norm_rope, reading the bf16 GEMM output), kv's norm + RoPE + FP8 (kv_norm_rope_fp8), the attention
# output's inverse RoPE + bf16 cast (o_unrope), the indexer query's RoPE + Hadamard + FP4
# (compress.indexer_q), each one launch over the chunk instead of torch chains that pass the chunk's
# [T, H, D] q / o (1 GiB in f32 at 8192 tokens) through memory 5-8 times. The same math
# (the decode step uses these kernels). Off (or without TRITON_FUSED): the torch ops. Env DS4_PREFILL_FUSED.
PREFILL_FUSED = os.environ.get("DS4_PREFILL_FUSED", "1") != "0"


def grouped_output(o: torch.Tensor, out_a: torch.Tensor, out_b: torch.Tensor, groups: int) -> torch.Tensor:
    """o [T, H, D] -> [T, d] (model.md §5.4: each head group -> Ro by its out_a slice, then out_b)."""
    T = o.shape[0]
    if isinstance(out_a, QLinear) and T == 1:  # decode: each group's rows read once, on its own input slice
        pa = out_a.packed
        low = qmatvec_grouped(o.reshape(1, groups, -1), pa.view(groups, pa.N // groups, pa.K))  # [1, G, Ro]
        return lin(low.reshape(1, -1), out_b)
    if isinstance(out_a, QLinear):
        out_a = out_a.dense
    og = o.reshape(T, groups, -1).transpose(0, 1)  # [G, T, H/G*D]
    wa = out_a.view(groups, -1, og.shape[-1])  # [G, Ro, H/G*D]
    low = torch.bmm(og.to(wa.dtype), wa.transpose(1, 2)).float()  # [G, T, Ro]
    return lin(low.transpose(0, 1).flatten(1), out_b)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, clamp: float) -> torch.Tensor:
    return swiglu_mid(lin(x, gate), lin(x, up), clamp)


# ---------------------------------------------------------------------------------------------
# Shared by both paths
# ---------------------------------------------------------------------------------------------


def _qkv(w, shape: AttentionShape, xn, positions, inv_freq):
    """(qn [T, Rq], q [T, H, D], kv rows [T, D]) exactly as the CPU attention_forward builds them."""
    H, D, eps = shape.n_head, shape.head_dim, shape.rms_eps
    qn = rms_norm(lin(xn, w.q_a), w.q_a_norm, eps)
    if PREFILL_FUSED and fused.TRITON_FUSED:
        q = fused.q_post(lin(qn, w.q_b, keep=True).unflatten(-1, (H, D)), positions, inv_freq, eps)
        return qn, q, fused.kv_post(lin(xn, w.kv), w.kv_norm, positions, inv_freq, eps, shape.n_rot)
    q = lin(qn, w.q_b).unflatten(-1, (H, D))
    q = rope_tail(rms_norm(q, None, eps), positions, inv_freq)
    kv = rms_norm(lin(xn, w.kv), w.kv_norm, eps)
    kv = fp8_nope(rope_tail(kv, positions, inv_freq), shape.n_rot)
    return qn, q, kv


def _finish_rows(w: CompressorWeights, pooled, starts, inv_freq, eps, n_rot: int, indexer: bool):
    rows = rope_tail(rms_norm(pooled, w.norm, eps), starts, inv_freq)
    return indexer_qat(rows) if indexer else fp8_nope(rows, n_rot)


def _indexer_query(w, qn, xn, positions, inv_freq):
    """qi [T, Hi, Di] (QAT'd) and head weights [T, Hi] (model.md §7)."""
    n_heads, dim = w.proj.shape[0], w.compressor.norm.numel()
    if PREFILL_FUSED and fused.TRITON_FUSED and dim >= 32 and dim & (dim - 1) == 0:  # decode's kernel
        qi = lin(qn, w.q_b, keep=True).unflatten(-1, (n_heads, dim))  # bf16: widened on load
        qi = fused.indexer_q_post(qi, positions, inv_freq)
    else:
        qi = indexer_qat(rope_tail(lin(qn, w.q_b).unflatten(-1, (n_heads, dim)), positions, inv_freq))
    wts = lin(xn, w.proj) * (dim**-0.5 * n_heads**-0.5)
    return qi, wts


def _ffn_prefill(cfg, il: int, w: LayerWeights, X, tokens, dtype):
    xf, post, comb = _hc_pre_norm(cfg, X, w.hc_ffn, w.ffn_norm)
    m, clamp = w.moe, cfg.swiglu_clamp[il]
    k, scale, norm = cfg.n_expert_used, cfg.expert_weights_scale, cfg.expert_weights_norm
    weights, ids = route(m, xf, tokens, k, scale, norm, linear=lin_f32)
    y = routed_prefill(xf, ids, weights, m.gate_exps, m.up_exps, m.down_exps, clamp, dtype)
    y = y + lin(swiglu(xf, m.gate_sh, m.up_sh, clamp), m.down_sh)
    return _hc_post(y, X, post, comb)


def _hc_pre_norm(cfg, X, h, norm):
    """HC collapse of X [T, S, d] + the sublayer RMSNorm -> (xn [T, d], post [T, S], comb [T, S, S]): the
    decode step's Triton kernels (any row count: 2 launches instead of ~30 torch ops over [T, S, d]) when on,
    else ds4.model.hc."""
    hc = (cfg.hc_sinkhorn_iters, cfg.rms_eps, cfg.hc_eps)
    if fused.TRITON_FUSED:
        return fused.hc_pre_norm(X, h.fn, h.scale, h.base, norm, *hc)
    x, post, comb = hc_pre(X, h, iters=hc[0], rms_eps=hc[1], hc_eps=hc[2])
    return rms_norm(x, norm, cfg.rms_eps), post, comb


def _hc_post(f, X, post, comb):
    """X' [T, S, d] from the sublayer output f [T, d]: one Triton launch when on, else ds4.model.hc."""
    return fused.hc_post(f, X, post, comb) if fused.TRITON_FUSED else hc_post(f, X, post, comb)


# ---------------------------------------------------------------------------------------------
# Decode: one token, position in a device tensor, no host sync.
# ---------------------------------------------------------------------------------------------


@dataclass
class SideMatrices:
    """Half-precision copies of one layer's small decode matrices (exact: the file stores them as F16),
    concatenated per input so that each input is read by one hmatvec launch instead of one GEMV per matrix.
    Built at load on the GPU (ds4.model.cuda.model); prefill and the CPU path keep the f32 originals."""

    xn: torch.Tensor | None  # [n, d]: compressor kv, gate (+ indexer compressor kv, gate, indexer proj)
    xn_split: tuple[int, ...]  # row counts of those parts
    router: torch.Tensor | None  # [E, d] ffn_gate_inp
    q_b: torch.Tensor | None  # [Hi Di, Rq] indexer q_b
    # Packed (QLinear) matrices of one input merged into one PackedWeight: one qmatvec instead of two. The
    # layer's QLinears read row views of it (no extra memory); None where the formats differ.
    qa_kv: object = None  # [Rq + D, d] attention q_a and kv
    shared_gu: object = None  # [2 F, d] shared-expert gate and up


def pool_kernels() -> bool:
    """Decode attention through ds4.kernels.compress / attend (their twins on the CPU): DS4_TRITON_FUSED."""
    return fused.TRITON_FUSED and compress_k is not None


def _xn_side(xn, side: SideMatrices | None) -> list[torch.Tensor] | None:
    """[compressor kv, gate(, indexer compressor kv, gate, indexer proj)] of xn [B, d] ([B, n] each) by one
    hmatvec over the layer's half copies; None without them (the caller runs a GEMV per matrix)."""
    if side is None or side.xn is None:
        return None
    return list(hmatvec(xn, side.xn).split(side.xn_split, dim=1))


# Small chains of the decode attention as one compiled kernel each when the decode step compiles
# (fused.SWITCH: CUDA, DS4_COMPILE); dynamic shapes: one compile for B = 1, one for every larger bucket.
@fused.fuse(dynamic=True)
def swiglu_decode(g, u, clamp: float):
    """experts.swiglu_mid of the decode step's shared expert (eager: four kernels)."""
    return swiglu_mid(g, u, clamp)


@fused.fuse(dynamic=True)
def _ring_and_count(slot, pos, window: int, ratio: int):
    """(flat ring row slot * W + pos % W, visible compressed rows (pos + 1) // r) of each row [B]."""
    return slot * window + pos % window, (pos + 1) // max(ratio, 1)


_STEP_MEMO: dict | None = None
STEP_MEMO = os.environ.get("DS4_STEP_MEMO", "1") != "0"  # off: each layer computes its own (A/B timing)


@contextlib.contextmanager
def step_memo() -> Iterator[None]:
    """Around one decode step (its graph body): what depends only on the step's (slot, pos) rows is computed
    once for all layers (ring_and_count: 2 launches a layer, 86 a step, down to 2 per distinct ratio). A
    fresh memo per step body, so a CUDA graph never reads a tensor that another graph's replay writes."""
    global _STEP_MEMO
    outer, _STEP_MEMO = _STEP_MEMO, ({} if STEP_MEMO else None)
    try:
        yield
    finally:
        _STEP_MEMO = outer


def ring_and_count(slot, pos, window: int, ratio: int):
    """_ring_and_count, shared by the layers of a step inside step_memo()."""
    if _STEP_MEMO is None:
        return _ring_and_count(slot, pos, window, ratio)
    key = (id(slot), id(pos), window, max(ratio, 1))  # slot and pos live through the whole step
    if key not in _STEP_MEMO:
        _STEP_MEMO[key] = _ring_and_count(slot, pos, window, ratio)
    return _STEP_MEMO[key]


def indexer_width(cap: int, k: int, ratio: int, bound: int | None) -> int:
    """Compressed rows the decode indexer ranks: all cap, or, when every row of the step sees at most `bound`
    tokens, the first bound // ratio of them (never fewer than k). The rows past that hold no visible row
    (count = (pos + 1) // ratio <= bound // ratio), so the top-k is the same; the sort shrinks with the
    context instead of the session's allocation."""
    return cap if bound is None else min(cap, max(k, bound // max(ratio, 1)))


def attention_decode_pool(
    w, shape: AttentionShape, kv, xn, pos, slot, inv_freq, side=None, bound: int | None = None
) -> torch.Tensor:
    """Decode attention of B rows over pool-layout buffers (kv.* [S, ...]; row b at pool slot slot[b] and
    position pos[b]) through the kernels of ds4.kernels.compress / attend -> de-rotated o [B, H, D], before
    the output projection. Serves both the single state (S = 1, its buffers [None]) and the batched step.
    bound: every pos[b] < bound (tokens), or None (see indexer_width)."""
    R, eps, W, r, D = shape.n_rot, shape.rms_eps, shape.window, shape.ratio, shape.head_dim
    rows = None  # the compressor chain, from xn alone: beside q_a / kv / q_b (streams.Branch, COMP_SIDE)
    if r:
        chain = functools.partial(_compress_rows, w, shape, kv, xn, slot, pos, inv_freq, side)
        rows = Branch(xn.device, chain, lane=3) if COMP_SIDE else Branch.ready(chain())
    if side is not None and side.qa_kv is not None and reads_merged(xn.shape[0]):
        qa, kv_raw = qmatvec(xn, side.qa_kv).split([w.q_a_norm.numel(), D], dim=1)
    else:
        qa, kv_raw = lin(xn, w.q_a), lin(xn, w.kv)
    ring, count = ring_and_count(slot, pos, W, r)  # [B] each
    # the q_a norm [B, Rq], and the kv row into the ring
    qn = fused.qa_kv_post(qa, w.q_a_norm, kv_raw, w.kv_norm, pos, inv_freq, eps, R, kv.raw.view(-1, D), ring)
    # the query projection on the side stream, next to the ring / compressor / indexer chain (streams.Branch)
    q = Branch(
        xn.device, lambda: fused.q_post(lin(qn, w.q_b).unflatten(-1, (shape.n_head, D)), pos, inv_freq, eps)
    )
    comp = top = None
    if r:
        comp, iw = kv.comp, w.indexer
        if iw is not None and kv.comp.shape[1] > shape.indexer_topk:
            n_heads, dim = iw.proj.shape[0], iw.compressor.norm.numel()
            qb = hmatvec(qn, side.q_b) if side is not None and side.q_b is not None else lin(qn, iw.q_b)
            qi = fused.indexer_q_post(qb.unflatten(-1, (n_heads, dim)), pos, inv_freq)  # [B, Hi, Di]
            wts = rows.join()  # [B, Hi] head weights, scaled in the kernel; the index rows are current
            score = attend_k.indexer_scores(qi, wts, kv.index, slot, count, dim**-0.5 * n_heads**-0.5)
            n = indexer_width(score.shape[1], shape.indexer_topk, r, bound)
            pick = _indexer_picker(n)
            top = pick(score[:, :n], shape.indexer_topk)  # [B, k]
        rows.join()
    q = q.join()  # [B, H, D]
    prefetch_site("o", xn.device, [w.out_a, w.out_b])
    return attend_k.attend_decode(q, kv.raw, slot, pos, comp, top, r, w.sinks, D**-0.5, inv_freq)


# L2 prefetch of static weights in the decode step (ds4.kernels.prefetch): site -> MB requested there, from
# env DS4_PREFETCH ("attn=42,o=36,ffn=27"; empty: none). Sites (decode_layer_batch / attention_decode_pool):
#   attn  the layer's q_a + kv and q_b blocks, at the layer's start (beside the HC collapse and the kv row);
#   o     o_a then o_b, before the attention kernels (DRAM idles under the softmax and merge);
#   ffn   the shared expert's blocks and the router, before the FFN's HC collapse.
# Session 18 had "o" on the main stream, with 64 KB x 32 requests a program: 116.77 tok/s with 36 MB vs 133.68
# without at 4k ctx (x0.873; +25 us a layer): the attention waited for the prefetch kernel, whose 18
# programs issue all of it. PREFETCH_SIDE (env DS4_PREFETCH_SIDE=0: the main stream) puts each request on
# side lane 4, which no main-stream kernel waits for; the branches join at the layer's end. H200, session 19
# (ab_decode.py at 4k ctx, 2 rounds; default 132.95 tok/s): o=36 on lane 4 133.50 (x1.004), on the main
# stream 115.85 (x0.871 again), with 4 KB requests (288 programs) 131.12, attn=42 130.90, ffn=29 132.00,
# all three 129.68 (x0.975). And tools/gpu/bench_prefetch.py: a Q8_0 matvec whose blocks were prefetched
# into L2 60 us earlier takes 16.3 vs 19.8 us (q_b, 35.7 MB): the decode matvecs are not bound by DRAM
# latency, so warming L2 gains little, and the requests' DRAM traffic costs the kernels beside them. Off.
def _parse_prefetch(spec: str) -> dict[str, int]:
    """DS4_PREFETCH's "site=MB,..." -> {site: MB}; a clear error for an unknown site or a bad size."""
    sites = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, mb = part.partition("=")
        if name not in ("attn", "o", "ffn") or not mb.isdigit():
            raise ValueError(f"DS4_PREFETCH: want site=MB with site attn|o|ffn, got {part!r}")
        sites[name] = int(mb)
    return sites


PREFETCH = _parse_prefetch(os.environ.get("DS4_PREFETCH", ""))
PREFETCH_SIDE = os.environ.get("DS4_PREFETCH_SIDE", "1") != "0"
_PREFETCH_PENDING: list[Branch] = []


def prefetch_site(site: str, device: torch.device, mats: list) -> None:
    """Request the packed blocks of mats (QLinear / PackedWeight / tensors; others skipped), in order, up to
    PREFETCH[site] MB into L2: on side lane 4 when PREFETCH_SIDE (joined by join_prefetches)."""
    mb = PREFETCH.get(site, 0)
    if not mb or prefetch_l2 is None:
        return
    parts = []
    for m in mats:
        m = m.packed if isinstance(m, QLinear) else m
        parts += [m] if isinstance(m, torch.Tensor) else list(getattr(m, "data", {}).values())
    if PREFETCH_SIDE:
        _PREFETCH_PENDING.append(Branch(device, lambda: prefetch_l2(parts, mb << 20), lane=4))
    else:
        prefetch_l2(parts, mb << 20)


def join_prefetches() -> None:
    """Join the prefetch branches opened so far (a CUDA graph's capture must join every fork)."""
    while _PREFETCH_PENDING:
        _PREFETCH_PENDING.pop().join()


# The decode step's compressor chain (the side half matrices of xn, the compressor and indexer-compressor
# frontiers, the indexer head weights) on side lane 3, beside the q_a + kv matvec, the kv row, q_b and the
# indexer query: it needs xn alone, and only the indexer scores / attention read what it writes. H200,
# session 18 (ab_decode.py, both rounds alike): 4k ctx 131.13 vs 123.54 tok/s on the main stream (x1.061),
# 8k 125.56 vs 118.55 (x1.059); B = 8 / 32 step at 8k 19.49 / 48.46 vs 20.21 / 49.50 ms (batch_check.py).
# Env DS4_COMP_SIDE=0: on the main stream, in that order (the same kernels: the same results).
COMP_SIDE = os.environ.get("DS4_COMP_SIDE", "1") != "0"


def _compress_rows(w, shape: AttentionShape, kv, xn, slot, pos, inv_freq, side) -> torch.Tensor | None:
    """Advance the layer's compressor frontiers (and its indexer's) by xn [B, d] at pos (pool slots slot),
    writing the rows of completed windows -> the indexer head weights [B, Hi] (unscaled) when the indexer
    selects (more compressed rows than its top-k), else None."""
    R, eps = shape.n_rot, shape.rms_eps
    cw, iw = w.compressor, w.indexer
    parts = _xn_side(xn, side) or [lin(xn, cw.kv), lin(xn, cw.gate)]
    compress_k.compress_decode(
        parts[0], parts[1], cw.ape, kv.comp_kv, kv.comp_score, kv.comp,
        slot, pos, cw.norm, inv_freq, eps, R, False,
    )  # fmt: skip
    if iw is None:
        return None
    ic = iw.compressor  # keep the indexer rows current (used once more than top-k rows exist)
    if len(parts) == 2:
        parts += [lin(xn, ic.kv), lin(xn, ic.gate), None]
    compress_k.compress_decode(
        parts[2], parts[3], ic.ape, kv.index_kv, kv.index_score, kv.index,
        slot, pos, ic.norm, inv_freq, eps, R, True,
    )  # fmt: skip
    if kv.comp.shape[1] <= shape.indexer_topk:
        return None
    return lin(xn, iw.proj) if parts[4] is None else parts[4]


def route_decode(w, xf, token, k: int, scale: float, normalize: bool, side: SideMatrices | None = None):
    """ds4.model.moe.route for one token, with torch.topk instead of a stable sort of all E experts (a sort
    costs ~20 us per layer; exact ties of continuous router scores do not occur in practice). side: the
    layer's half copies (the router logits by hmatvec)."""
    if side is not None and side.router is not None:
        logits = hmatvec(xf, side.router)  # [B, E]
    else:
        logits = F.linear(xf, w.gate_inp)
    if fused.TRITON_FUSED and w.tid2eid is None:  # one kernel: probs, biased top-k, normalised weights
        ids, weights = fused.router_topk(logits, w.bias, k, scale, normalize)
        return weights, ids
    if fused.TRITON_FUSED and fused.TAIL_FUSED:  # a hash layer, one kernel: the token's experts, weights
        ids, weights = fused.router_hash(logits, w.tid2eid, token, scale, normalize)
        return weights, ids
    probs = torch.sqrt(F.softplus(logits))  # [1, E]
    if w.tid2eid is not None:
        ids = w.tid2eid[token]  # [1, k]
    else:
        ids = (probs if w.bias is None else probs + w.bias).topk(k, dim=-1).indices
    weights = probs.gather(1, ids)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * scale, ids


def shared_gate_up(xf, m, side: SideMatrices | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) projections [B, F] of the shared expert: one qmatvec over the merged rows when the layer
    has them (decode-sized B), else one matvec / GEMM each."""
    if side is not None and side.shared_gu is not None and reads_merged(xf.shape[0]):
        g, u = qmatvec(xf, side.shared_gu).chunk(2, dim=1)
        return g, u
    return lin(xf, m.gate_sh), lin(xf, m.up_sh)


# ---------------------------------------------------------------------------------------------
# Prefill: a chunk at host-known positions p0..p0+T-1.
# ---------------------------------------------------------------------------------------------


def _chunk_rows(w, xn, p0, r, fk, fs, out_rows, inv_freq, eps, n_rot, indexer) -> None:
    """Run the chunk through a compressor frontier; store the rows of every window it completes."""
    pooled, first = compress_chunk(w, xn, p0, r, fk, fs, linear=lin_f32)
    K = pooled.shape[0]
    if K:
        starts = first + r * torch.arange(K, device=xn.device)
        n0 = first // r
        out_rows[n0 : n0 + K] = _finish_rows(w, pooled, starts, inv_freq, eps, n_rot, indexer)


def _indexer_picker(n: int):
    """The decode indexer's top-k function of n scores a row under the switches in force (INDEXER_SELECT
    first, for the rows it keeps in registers)."""
    if INDEXER_SELECT and topk_k is not None and n <= INDEXER_SELECT_MAX:
        return topk_k.select_rows
    if INDEXER_WIDE and topk_k is not None and n <= min(INDEXER_WIDE_MAX, topk_k.WIDE_MAX):
        return topk_k.select_rows_wide
    return top_rows_by_keys if INDEXER_TOPK else topk_k.top_rows if TOPK_KERNEL else _top_rows


def _top_rows(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim, ties to the lower row (FP4-quantized scores tie
    often, e.g. at exactly 0 after the ReLU); a stable descending sort, like the CPU reference."""
    return kernel_ref.top_rows(score, k)


# Decode's indexer top-k by the bitonic top-k kernel (ds4.kernels.topk: same indices, same order as the stable
# sort). Measured slower: on the H200 (session 11) 69 us a call at 8k ctx vs the sort's 25 us radix kernel
# (profile_regions.py 8192); whole model 98.72 (sort) vs 98.33 tok/s at 4k ctx, 88.11 vs 81.45 at 64k
# (ab_decode.py, both rounds alike). Triton's tl.topk runs its bitonic network's cross-warp steps through
# shared memory with a barrier each. Off; env DS4_TOPK_KERNEL=1: on. Read when a step is built.
TOPK_KERNEL = os.environ.get("DS4_TOPK_KERNEL", "0") == "1"

# Decode's indexer top-k by torch.topk over unique int64 keys (top_rows_by_keys) instead of a full stable
# sort of every compressed row: same indices; slower on the H200 (ab_decode.py, session 6: 77.31 vs 79.07
# tok/s at 4k ctx; session 19, tools/gpu/long_decode.py: 256k ctx 88.74 vs 97.89, 1M 67.96 vs 74.39).
# Env DS4_INDEXER_TOPK=1: on.
INDEXER_TOPK = os.environ.get("DS4_INDEXER_TOPK", "0") == "1"

# Decode's indexer top-k as a set (ds4.kernels.topk.select_rows: a radix select, the indices in ascending
# order; the attention reads them as a set) instead of the stable sort's order, for rows of at most
# INDEXER_SELECT_MAX scores (4,096: 16k ctx). H200, session 17 (ab_decode.py): 4k ctx 118.11 vs 112.94 tok/s
# with the sort (x1.046); at 64k ctx (16,384 scores, then streamed in chunks: 5 passes over the row) 96.19
# vs 99.52, so longer rows keep the sort; session 18, with 16,384 kept in registers (topk.SELECT_REG_MAX):
# 64k ctx 102.64 vs 102.74 with the sort (ab_decode.py "select 16k"): still no gain; session 19
# (long_decode.py, the select for every row length): 256k ctx 67.47 vs 97.89, 1M 27.50 vs 74.39 (65,536 /
# 262,144 scores streamed in many passes). Env DS4_INDEXER_SELECT=0: off (the sort, or TOPK_KERNEL /
# INDEXER_TOPK when set); DS4_INDEXER_SELECT_MAX.
# Read when a step is built.
INDEXER_SELECT = os.environ.get("DS4_INDEXER_SELECT", "1") == "1"
INDEXER_SELECT_MAX = int(os.environ.get("DS4_INDEXER_SELECT_MAX", "4096"))
# The rows past INDEXER_SELECT_MAX, up to INDEXER_WIDE_MAX scores (20,480: an 80k allocation; the rows a
# step ranks are indexer_width's, a session's cap = ctx / 4 + 2 or a power-of-two bucket's), by the select
# with several programs a row (ds4.kernels.topk.select_rows_wide: 6 launches, the same set in the same order)
# instead of the stable sort (~40 us of kernels in ~10 launches a ratio-4 layer at 64k ctx, session 19
# profile). H200, session 20, wide vs sort: 64k ctx (16,420 rows) 113.49 vs 109.39 tok/s at this default
# (ab_decode.py "no wide", both rounds alike), ds4-bench --decode-at 107.81 vs 104.91; longer rows lost:
# 128k (32,770) 97.87 vs 103.03 (101.03 at 32 programs a row), 256k (65,538) 82.63 / 84.50 vs 96.13 /
# 97.66, 1M (262,146) 72.10 / 74.02 vs 76.24 / 74.19. Session 21: its passes by 8-bit digits
# (topk.WIDE_DIGITS) made it x1.112 at 64k; whether it now beats the sort past 20,480 rows (128k-1M ctx) is
# not yet measured, so the bound stays. Env DS4_INDEXER_WIDE=0: off; DS4_INDEXER_WIDE_MAX. Read when a step
# is built.
INDEXER_WIDE = os.environ.get("DS4_INDEXER_WIDE", "1") == "1"
INDEXER_WIDE_MAX = int(os.environ.get("DS4_INDEXER_WIDE_MAX", "20480"))


@fused.fuse(dynamic=True)
def _order_keys(score):
    """score [..., n] f32 -> int64 keys in the same order, all distinct: the float's order-preserving bits
    (-0.0 folded into +0.0, negatives' magnitude bits flipped) above (2^31 - 1 - index), so that equal
    scores rank the lower index first."""
    bits = (score + 0.0).view(torch.int32).long()  # + 0.0: -0.0 -> +0.0 (the sort ties them)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    idx = torch.arange(score.shape[-1], device=score.device)
    return ordered * (1 << 32) + ((1 << 31) - 1 - idx)


def top_rows_by_keys(score: torch.Tensor, k: int) -> torch.Tensor:
    """_top_rows(score, k) (same indices, same order) by torch.topk on unique keys: no full sort."""
    return _order_keys(score).topk(k, dim=-1).indices


# The prefill indexer's scores on CUDA: "kernel" (ds4.kernels.indexer_prefill: one launch per token block, no
# dense [T, Hi, C] temporary) or "torch" (two einsums per token block). Env DS4_PREFILL_INDEXER; off CUDA
# (unless under TRITON_INTERPRET=1: the tests) the torch code runs. The top-k after either: "sort" (_top_rows,
# a stable sort of every row) or "keys" (top_rows_by_keys: torch.topk over unique keys, the same indices in
# the same order). Env DS4_PREFILL_TOPK.
PREFILL_INDEXER = os.environ.get("DS4_PREFILL_INDEXER", "kernel")
PREFILL_TOPK = os.environ.get("DS4_PREFILL_TOPK", "sort")


def _indexer_pick(w, qn, xn, positions, rows, topk, inv_freq, p0: int | None = None):
    """(idx [T, k], valid [T, k]): each token's visible compressed rows, or its top-k by indexer score.
    p0: host value of positions[0] (read from the device, one sync, when not given)."""
    T, C = positions.shape[0], rows.shape[0]
    counts = (positions + 1) // 4  # [T]
    ar = torch.arange(C, device=xn.device)
    if C <= topk:
        return ar.expand(T, C), ar[None, :] < counts[:, None]
    if PREFILL_INDEXER not in ("kernel", "torch") or PREFILL_TOPK not in ("sort", "keys"):
        raise ValueError(
            f"DS4_PREFILL_INDEXER must be kernel|torch and DS4_PREFILL_TOPK sort|keys, got "
            f"{PREFILL_INDEXER!r} and {PREFILL_TOPK!r}"
        )
    kernel = PREFILL_INDEXER == "kernel" and indexer_scores_prefill is not None and use_triton(xn)
    pick = top_rows_by_keys if PREFILL_TOPK == "keys" else _top_rows
    qi, wts = _indexer_query(w, qn, xn, positions, inv_freq)
    if kernel and p0 is None:
        p0 = int(positions[0])
    idx = torch.empty(T, topk, dtype=torch.long, device=xn.device)
    valid = torch.empty(T, topk, dtype=torch.bool, device=xn.device)
    block = max(1, SCORE_BUDGET // (C if kernel else qi.shape[1] * C))  # tokens per score temporary
    for a in range(0, T, block):
        b = min(T, a + block)
        if kernel:
            score = indexer_scores_prefill(qi[a:b], wts[a:b], rows, p0 + a, 4)  # [B, C], -inf if hidden
        else:
            score = _indexer_scores_torch(qi[a:b], wts[a:b], rows, counts[a:b], ar)
        top = pick(score, topk)
        idx[a:b], valid[a:b] = top, score.gather(-1, top) > float("-inf")
    return idx, valid


def _indexer_scores_torch(qi, wts, rows, counts, ar):
    """score [B, C] of a token block: dense per-head scores [B, Hi, C], ReLU, weighted head sum, mask."""
    per_head = torch.einsum("thd,cd->thc", qi, rows).relu()  # [B, Hi, C]
    score = torch.einsum("thc,th->tc", per_head, wts)
    return score.masked_fill(ar[None, :] >= counts[:, None], float("-inf"))


def _sink_attention_chunk(q, raw, raw_p0, positions, window, comp, comp_idx, comp_valid, sinks, dtype):
    """o [T, H, D] for queries q [T, H, D] at `positions`.

    raw [N, D] rows at positions raw_p0..; comp [C, D]; each query t sees comp rows comp_idx[t] where
    comp_valid[t] (comp_idx [T, k] or None when there are no compressed rows).
    """
    T, H, D = q.shape
    scale = D**-0.5
    out = torch.empty_like(q)
    k = 0 if comp_idx is None else comp_idx.shape[1]
    block = max(1, min(T, SCORE_BUDGET // (H * (window + k + 64) + k * D)))
    p0 = int(positions[0])  # host value of the chunk's first position (positions are consecutive)
    for a in range(0, T, block):
        b = min(T, a + block)
        pos = positions[a:b]  # [B]
        lo = max(0, p0 + a - window + 1 - raw_p0)
        hi = p0 + b - raw_p0
        kraw = raw[lo:hi].to(dtype)  # [n, D]
        kp = raw_p0 + torch.arange(lo, hi, device=q.device)
        vis = (kp[None, :] <= pos[:, None]) & (kp[None, :] > pos[:, None] - window)  # [B, n]
        qb = q[a:b].to(dtype)
        s = torch.einsum("thd,kd->thk", qb, kraw).float() * scale  # [B, H, n]
        s = s.masked_fill(~vis[:, None, :], float("-inf"))
        parts = [s]
        if k:
            kc = comp[comp_idx[a:b]].to(dtype)  # [B, k, D]
            sc = torch.einsum("thd,tkd->thk", qb, kc).float() * scale
            parts.append(sc.masked_fill(~comp_valid[a:b, None, :], float("-inf")))
        parts.append(sinks[None, :, None].expand(b - a, H, 1))
        p = torch.cat(parts, dim=-1).softmax(-1)  # the sink column only enlarges the denominator
        n = kraw.shape[0]
        o = torch.einsum("thk,kd->thd", p[..., :n].to(dtype), kraw).float()
        if k:
            o = o + torch.einsum("thk,tkd->thd", p[..., n : n + k].to(dtype), kc).float()
        out[a:b] = o
    return out


def attention_prefill(w, shape: AttentionShape, kv: DeviceLayerKV, xn, p0: int, inv_freq, dtype):
    T = xn.shape[0]
    R, eps, W, r = shape.n_rot, shape.rms_eps, shape.window, shape.ratio
    positions = torch.arange(p0, p0 + T, device=xn.device)
    qn, q, rows = _qkv(w, shape, xn, positions, inv_freq)
    comp = idx = valid = None
    if r:
        _chunk_rows(w.compressor, xn, p0, r, kv.comp_kv, kv.comp_score, kv.comp, inv_freq, eps, R, False)
        C = (p0 + T) // r
        comp = kv.comp[:C]
        if w.indexer is not None:
            ic = w.indexer.compressor
            _chunk_rows(ic, xn, p0, r, kv.index_kv, kv.index_score, kv.index, inv_freq, eps, R, True)
            topk = shape.indexer_topk
            idx, valid = _indexer_pick(w.indexer, qn, xn, positions, kv.index[:C], topk, inv_freq, p0)
        else:
            ar = torch.arange(C, device=xn.device)
            idx, valid = ar.expand(T, C), ar[None, :] < ((positions + 1) // r)[:, None]
        if C == 0:
            idx = valid = None
    n_prev = min(p0, W - 1)  # earlier rows any token of the chunk can still see
    prev = kv.raw[torch.remainder(torch.arange(p0 - n_prev, p0, device=xn.device), W)]
    raw = torch.cat([prev, rows])  # [N, D] at positions p0 - n_prev ..
    if attend_prefill is not None and fused.TRITON_FUSED:  # one Triton launch (its torch twin off CUDA)
        o = attend_prefill(q, raw, p0 - n_prev, p0, W, comp, idx, valid, w.sinks, shape.head_dim**-0.5, dtype)
    else:
        o = _sink_attention_chunk(q, raw, p0 - n_prev, positions, W, comp, idx, valid, w.sinks, dtype)
    keep = min(T, W)  # the ring keeps the last W rows
    kv.raw[torch.remainder(positions[-keep:], W)] = rows[-keep:]
    if PREFILL_FUSED and fused.TRITON_FUSED and T > 1:  # T = 1 goes to the packed grouped matvec in f32
        o = fused.o_post(o, positions, inv_freq, dense_dtype(w.out_a))
    else:
        o = rope_tail(o, positions, inv_freq, inverse=True)
    return grouped_output(o, w.out_a, w.out_b, shape.o_groups)


def prefill_layer(blk, kv, X, tokens, p0: int, dtype):
    """X [T, S, d] -> [T, S, d] for a chunk at positions p0..; tokens [T] device ids; blk: the layer
    (ds4.model.block.Block: cfg, il, w, shape, inv_freq)."""
    cfg, il, w, shape, inv_freq = blk.cfg, blk.il, blk.w, blk.shape, blk.inv_freq
    xn, post, comb = _hc_pre_norm(cfg, X, w.hc_attn, w.attn_norm)
    X = _hc_post(attention_prefill(w.attn, shape, kv, xn, p0, inv_freq, dtype), X, post, comb)
    return _ffn_prefill(cfg, il, w, X, tokens, dtype)
