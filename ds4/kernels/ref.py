"""Plain-torch twins of the Triton kernels: same signatures, f32 math on exactly dequantized weights.

They are the CPU path of the dispatchers and the oracles of tests/test_kernels_*.py. Each section belongs to
one kernel family.
"""

from __future__ import annotations

import torch

# =========================================================================================================
# Quantized weights: qmatvec / qmatmul (matvec.py, matmul.py) and gathered / grouped experts (moe.py)
# Legend: B (or M) activation rows, N output rows, K row length, E experts, k experts per row, F expert width.


def _unpack(w):  # lazy import: packing imports nothing from here, but keep this module light to import
    from .packing import unpack

    return unpack(w)


def qmatvec(x: torch.Tensor, w) -> torch.Tensor:
    """x [B, K] @ W[N, K]^T -> [B, N] f32."""
    return x.float() @ _unpack(w).T


def qmatvec_grouped(x: torch.Tensor, w) -> torch.Tensor:
    """x [B, G, K], W [G, N, K] -> [B, G, N] f32: out[b, g] = W[g] @ x[b, g]."""
    return torch.einsum("gnk,bgk->bgn", _unpack(w), x.float())


def qmatmul(x: torch.Tensor, w) -> torch.Tensor:
    """x [M, K] @ W[N, K]^T -> [M, N] f32."""
    return x.float() @ _unpack(w).T


def swiglu_clamped(g: torch.Tensor, u: torch.Tensor, clamp: float) -> torch.Tensor:
    """silu(min(g, c)) * clamp(u, -c, c) (model.md §5.5); clamp <= 0 means no clamp."""
    if clamp > 0:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    return torch.nn.functional.silu(g) * u


def moe_gate_up(x: torch.Tensor, wg, wu, ids: torch.Tensor, clamp: float) -> torch.Tensor:
    """x [B, K], W[E, F, K] gate/up, ids [B, k] -> mid [B, k, F] f32 (unweighted)."""
    g_all, u_all = _unpack(wg), _unpack(wu)  # [E, F, K]
    xf = x.float()
    ids = ids.long()
    g = torch.einsum("bjfk,bk->bjf", g_all[ids], xf) if ids.numel() else xf.new_zeros(*ids.shape, wg.N)
    u = torch.einsum("bjfk,bk->bjf", u_all[ids], xf) if ids.numel() else g
    return swiglu_clamped(g, u, clamp)


def moe_down(mid: torch.Tensor, weights: torch.Tensor, wd, ids: torch.Tensor) -> torch.Tensor:
    """mid [B, k, F], weights [B, k], Wd [E, D, F], ids [B, k] -> [B, D] = sum_j weights * Wd[ids] @ mid."""
    d_all = _unpack(wd)  # [E, D, F]
    y = torch.einsum("bjdf,bjf->bjd", d_all[ids.long()], mid.float())  # [B, k, D]
    return (y * weights.float()[..., None]).sum(1)


def moe_grouped(x_sorted: torch.Tensor, w, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[e]..offsets[e+1] of x_sorted [M, K] times W[e]^T -> [M, N] f32 (other rows: 0)."""
    w_all = _unpack(w)  # [E, N, K]
    out = x_sorted.new_zeros(x_sorted.shape[0], w.shape[-2], dtype=torch.float32)
    bounds = offsets.tolist()
    for e in range(len(bounds) - 1):
        if bounds[e + 1] > bounds[e]:
            out[bounds[e] : bounds[e + 1]] = x_sorted[bounds[e] : bounds[e + 1]].float() @ w_all[e].T
    return out


# ---------------------------------------------------------------------------------------------------------
# Q8_K integer path of the routed experts (moe.py with MoeConfig(int8=True)): the C original's formulation
# (model.md §14), optionally refined. The expert input and the mid activation are quantized per 256 values to
# `terms` int8 planes + one f32 scale; IQ2_XXS / Q2_K weights enter as their integers; dots are exact integer
# sums per (sub-)block, scaled in f32:
#   IQ2_XXS block: S = sum_sb (2 ls_sb + 1) sum_32 g_i v_i;   y += (d_w d_x) S;   finally y *= 0.125
#   Q2_K block: I = sum_g sc_g sum_16 q_i v_i, M = sum_g m_g sum_16 v_i;   y += (d_w d_x) I - (dmin_w d_x) M
# (g_i signed grid values, ls the 4-bit sub-block scale: db = d (0.5 + ls) / 4 = d (2 ls + 1) / 8.)
# Activation value v_i (x_i ~ d_x v_i), per block of 256 with amax = max |x_i|:
#   terms 1 (Q8_K): d_x = amax / 127, v = q1 = RNE(x * 127 / amax); |x - d_x v| <= d_x / 2 (~0.4 % of amax).
#   terms 2: d_x = amax / (127 * 254), v = 254 q1 + q2 with q1 as above and q2 = RNE(x * (127 * 254 / amax)
#            - 254 q1), the rounding residual of q1 in units of amax / (127 * 254), |q2| <= 127: two int8
#            planes whose dots share every weight decode; |x - d_x v| <= ~d_x / 2, 254 times smaller.
# Legend: R rows, K row length (multiple of 256), nb = K / 256, N weight rows, T terms (int8 planes).

Q8K_TINY = 1e-30  # blocks with amax below this quantize to zeros (keeps 127 / amax finite)
Q8K_STEP = 254  # terms 2: weight of the first plane (v = 254 q1 + q2)


def quantize_q8k(x: torch.Tensor, terms: int = 2, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (q int8 [T, R, K], d f32 [R, K/block]) per block values (256: Q8_K; 32: one scale per
    Q8_0 weight block), T = terms (1 or 2), see the section comment: q[0] = RNE(x * (127 / amax)) in
    [-127, 127], q[1] = RNE(x * (32258 / amax) - 254 q[0]) clamped to [-127, 127]; d = amax / 127 (T 1) or
    amax / 32258 (T 2). Divisions correctly rounded, f32 products rounded before the subtraction (no FMA); a
    block with amax < Q8K_TINY gives d = 0, q = 0."""
    if terms not in (1, 2):
        raise ValueError(f"quantize_q8k: terms must be 1 or 2, got {terms}")
    R, K = x.shape
    xb = x.float().reshape(R, K // block, block)
    amax = xb.abs().amax(-1)  # [R, nb]
    big = amax >= Q8K_TINY
    # tensor / tensor, correctly rounded (torch: `s / t` is t.reciprocal() * s, on CUDA `t / s` is t * (1/s))
    full = 127.0 * Q8K_STEP ** (terms - 1)
    c127, cfull = torch.full_like(amax, 127.0), torch.full_like(amax, full)
    iscale = torch.where(big, c127 / torch.where(big, amax, 1.0), 0.0)
    d = torch.where(big, amax / cfull, 0.0)
    q1 = torch.round(xb * iscale[..., None]).clamp(-127, 127)  # torch.round: half to even
    planes = [q1]
    if terms == 2:
        iscale2 = torch.where(big, cfull / torch.where(big, amax, 1.0), 0.0)
        planes.append(torch.round(xb * iscale2[..., None] - Q8K_STEP * q1).clamp(-127, 127))
    return torch.stack(planes).to(torch.int8).reshape(terms, R, K), d


def q8k_values(q: torch.Tensor) -> torch.Tensor:
    """Planes q int8 [T, ...] -> the activation integers v int64 [...] (254 q1 + q2 for T = 2)."""
    v = q[0].long()
    for plane in q[1:]:
        v = Q8K_STEP * v + plane.long()
    return v


def _table_tensors(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(grid [256, 8] int32 magnitudes, ksigns [128, 8] int32 0/1 negation bits)."""
    from ds4.quant.tables import IQ2XXS_GRID, KSIGNS

    grid = torch.tensor(IQ2XXS_GRID, dtype=torch.int64).view(torch.uint8).reshape(256, 8).int()
    bits = (torch.tensor(KSIGNS, dtype=torch.int32).reshape(128, 1) >> torch.arange(8)) & 1
    return grid.to(device), bits.int().to(device)


def q8k_weight_ints(w) -> dict[str, torch.Tensor]:
    """Integer form of packed IQ2_XXS / Q2_K rows (a PackedWeight; all leading dims flattened to N rows).

    IQ2_XXS: v int32 [N, K] signed grid values, ls int32 [N, K/32], d f32 [N, nb].
    Q2_K:    v int32 [N, K] 2-bit quants (k order), sc, m int32 [N, K/16], d, dmin f32 [N, nb].
    """
    from ds4.quant.types import GGMLType

    N, K, data, nb = w.rows, w.K, w.split_data(), w.K // 256
    if w.qtype == GGMLType.IQ2_XXS:
        grid, bits = _table_tensors(data["qs"].device)
        sg = data["sg"].reshape(N, nb * 8, 1)  # a1 word per 32-element sub-block
        sidx = (sg >> torch.tensor([0, 7, 14, 21], device=sg.device)) & 127  # [N, K/32, 4] sign indices
        idx = data["qs"].reshape(N, nb * 8, 4).long()  # grid index per group of 8
        v = grid[idx] * (1 - 2 * bits[sidx.long()])  # [N, K/32, 4, 8]
        ls = (sg[..., 0] >> 28) & 15
        return {"v": v.reshape(N, K), "ls": ls, "d": data["d"].reshape(N, nb).float()}
    if w.qtype == GGMLType.Q2_K:
        dev = data["qs"].device
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=dev).reshape(1, 1, 1, 4, 1)
        v = (data["qs"].reshape(N, nb, 2, 1, 32).int() >> shifts) & 3  # [N, nb, half, shift, 32]: k order
        sc = data["sc"].reshape(N, nb * 16).int()  # one byte per 16 values, k order
        dm = data["dm"].reshape(N, nb, 2).float()
        return {"v": v.reshape(N, K), "sc": sc & 15, "m": sc >> 4, "d": dm[..., 0], "dmin": dm[..., 1]}
    raise ValueError(f"the Q8_K integer path supports IQ2_XXS and Q2_K weights, got {w.qtype.name}")


def q8k_block_ints(wi: dict[str, torch.Tensor], q: torch.Tensor) -> dict[str, torch.Tensor]:
    """Exact per-super-block integer sums of weight ints (q8k_weight_ints) with one quantized row, planes
    q [T, K] int8 (or [K]: one plane).

    IQ2_XXS: {"S": [N, nb]}; Q2_K: {"I": [N, nb], "M": [N, nb]} (int64; see the section comment)."""
    w = wi["v"].long()
    N, K = w.shape
    nb = K // 256
    v = q8k_values(q.reshape(-1, K))  # [K] int64
    if "ls" in wi:
        isum = (w.reshape(N, K // 32, 32) * v.reshape(K // 32, 32)).sum(-1)  # [N, K/32]
        return {"S": ((2 * wi["ls"] + 1) * isum).reshape(N, nb, 8).sum(-1)}
    isum = (w.reshape(N, K // 16, 16) * v.reshape(K // 16, 16)).sum(-1)  # [N, K/16]
    xs = v.reshape(K // 16, 16).sum(-1)  # [K/16]
    return {
        "I": (wi["sc"] * isum).reshape(N, nb, 16).sum(-1),
        "M": (wi["m"] * xs).reshape(N, nb, 16).sum(-1),
    }


def q8k_matvec_row(wi: dict[str, torch.Tensor], q: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
    """[N] f32: weight ints (q8k_weight_ints) dotted with one quantized row (planes q [T, K] int8 or [K],
    dx [nb] f32)."""
    s = q8k_block_ints(wi, q)
    if "S" in s:
        return ((wi["d"] * dx) * s["S"].float()).sum(-1) * 0.125
    return ((wi["d"] * dx) * s["I"].float() - (wi["dmin"] * dx) * s["M"].float()).sum(-1)


def qmatvec_q8k(x: torch.Tensor, w, terms: int = 2) -> torch.Tensor:
    """x [B, K] quantized (`terms` planes) times IQ2_XXS / Q2_K rows W [N, K] -> [B, N] f32, integer dots."""
    q, dx = quantize_q8k(x, terms)
    wi = q8k_weight_ints(w)
    rows = [q8k_matvec_row(wi, q[:, b], dx[b]) for b in range(x.shape[0])]
    return torch.stack(rows) if rows else x.new_zeros(0, w.rows, dtype=torch.float32)


def qmatvec_q8_0_int(x: torch.Tensor, w, rows_per_group: int | None = None) -> torch.Tensor:
    """x [G*K] times Q8_0 rows W [N, K] -> [N] f32, row n reading x group n // rows_per_group (None: one
    group), the math of matvec's integer Q8_0 kernel (Q8Config.int8): x quantized per 32 values in two
    planes (quantize_q8k, block 32), each block's integer dot exact, scaled by d_w d_x, summed in f32."""
    N, K = w.rows, w.K
    g = rows_per_group or N
    q, dx = quantize_q8k(x.reshape(-1, K), 2, 32)  # [2, G, K], [G, K/32]
    v = q8k_values(q)  # [G, K] int64
    grp = torch.arange(N, device=x.device) // g  # [N]
    wq = w.data["qs"].reshape(N, K // 32, 32).long()
    s = (wq * v[grp].reshape(N, K // 32, 32)).sum(-1)  # [N, K/32] exact
    return ((w.data["d"].reshape(N, K // 32).float() * dx[grp]) * s.float()).sum(-1)


def _expert(w, e: int):
    """Expert e of a packed stack [E, N, K] as its own [N, K] PackedWeight (row slices of the arrays)."""
    N = w.N
    return type(w)(w.qtype, (N, w.K), {key: t[e * N : (e + 1) * N] for key, t in w.data.items()})


def _pairs_by_expert(ids: torch.Tensor) -> dict[int, list[tuple[int, int]]]:
    pairs: dict[int, list[tuple[int, int]]] = {}
    for b, row in enumerate(ids.tolist()):
        for j, e in enumerate(row):
            pairs.setdefault(int(e), []).append((b, j))
    return pairs


def moe_gate_up_q8k(x: torch.Tensor, wg, wu, ids: torch.Tensor, clamp: float, terms: int = 2) -> torch.Tensor:
    """moe_gate_up with x quantized (`terms` planes) and integer dots: mid [B, k, F] f32 (unweighted)."""
    B, k = ids.shape
    q, dx = quantize_q8k(x, terms)
    g = torch.zeros(B, k, wg.N, dtype=torch.float32, device=x.device)
    u = torch.zeros_like(g)
    for e, pairs in _pairs_by_expert(ids).items():  # one integer decode per selected expert
        gi, ui = q8k_weight_ints(_expert(wg, e)), q8k_weight_ints(_expert(wu, e))
        for b, j in pairs:
            g[b, j] = q8k_matvec_row(gi, q[:, b], dx[b])
            u[b, j] = q8k_matvec_row(ui, q[:, b], dx[b])
    return swiglu_clamped(g, u, clamp)


def moe_down_q8k(
    mid: torch.Tensor, weights: torch.Tensor, wd, ids: torch.Tensor, terms: int = 2
) -> torch.Tensor:
    """moe_down with each pair's mid row quantized (`terms` planes) and integer dots: [B, D] f32."""
    B, k, F = mid.shape
    q, dx = quantize_q8k(mid.reshape(B * k, F), terms)
    y = torch.zeros(B, k, wd.N, dtype=torch.float32, device=mid.device)
    for e, pairs in _pairs_by_expert(ids).items():
        wi = q8k_weight_ints(_expert(wd, e))
        for b, j in pairs:
            y[b, j] = q8k_matvec_row(wi, q[:, b * k + j], dx[b * k + j])
    return (y * weights.float()[..., None]).sum(1)


def gather_sum(rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """matmul.gather_sum's twin: out[t] = sum_j rows[pos[t, j]] in f32, j in order."""
    acc = torch.zeros(pos.shape[0], rows.shape[1], dtype=torch.float32, device=rows.device)
    for j in range(pos.shape[1]):
        acc = acc + rows[pos[:, j].long()].float()
    return acc


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """gemm.linear_f32's twin: x [M, K] @ w[N, K]^T in f32 (cuBLAS / the CPU BLAS)."""
    return torch.nn.functional.linear(x, w)


# =========================================================================================================
# Fused decode ops (fused.py): HC pre/post, q/kv norm + RoPE (+ FP8), router top-k
# Legend: B rows, S streams, d = n_embd, M = (2 + S) * S mixing logits, H heads, D head dim, R RoPE dims,
# E experts. The math of ds4.model.hc / norm / rope / quantsim / moe, written out in plain f32 torch.


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def hc_pre_fused(
    X, fn, scale, base, iters: int, rms_eps: float, hc_eps: float, norm=None, sinkhorn=True, mix=None
):
    """X [B, S, d] -> x [B, d] (RMS-normalised with `norm` if given), post [B, S], comb [B, S, S] (sinkhorn
    off: the combine logits instead); mix: X's mixing partials (mix_partials) instead of fn . X."""
    B, S, d = X.shape
    flat = X.float().reshape(B, S * d)
    if mix is None:
        mix = (flat @ fn.float().T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)  # [B, M]
    else:
        ss = mix[1].sum(1, keepdim=True)
        mix = mix[0].sum(1)[:, : fn.shape[0]] * torch.rsqrt(ss / (S * d) + rms_eps)
    pre = torch.sigmoid(mix[:, :S] * scale[0] + base[:S]) + hc_eps
    post = 2 * torch.sigmoid(mix[:, S : 2 * S] * scale[1] + base[S : 2 * S])
    c = (mix[:, 2 * S :] * scale[2] + base[2 * S :]).reshape(B, S, S)
    x = (pre[:, :, None] * X.float()).sum(1)
    if sinkhorn:
        from ds4.model.hc import sinkhorn as normalise  # lazy: no model imports at load (see indexer_qat)

        c = normalise(c, iters, hc_eps)
    return (x if norm is None else _rms(x, rms_eps) * norm.float()), post, c


def mix_partials(X, fn, chunk: int, width: int):
    """X [B, S, d] -> (pmix [B, NS, width], pss [B, NS]): fn . X and sum X^2 over each of the NS chunks of
    `chunk` columns of every stream's row (the splits of the HC mixing projection)."""
    B, S, d = X.shape
    M, n = fn.shape[0], -(-d // chunk)
    xs = torch.nn.functional.pad(X.float(), (0, n * chunk - d)).reshape(B, S, n, chunk)
    w = torch.nn.functional.pad(fn.float().reshape(M, S, d), (0, n * chunk - d)).reshape(M, S, n, chunk)
    pmix = torch.zeros(B, S * n, width, dtype=torch.float32, device=X.device)
    pmix[:, :, :M] = torch.einsum("bsnc,msnc->bsnm", xs, w).reshape(B, S * n, M)
    return pmix, xs.square().sum(-1).reshape(B, S * n)


def hc_post_fused(f, X, post, comb, parts=None):
    """X'[b, dst] = post[b, dst] * f[b] + sum_src comb[b, src, dst] * X[b, src]: [B, S, d] f32. parts
    [B, k, d]: summed over k in order, then f added (f <- sum_j parts[:, j] + f)."""
    f = f.float()
    if parts is not None:
        acc = parts[:, 0].float()
        for j in range(1, parts.shape[1]):
            acc = acc + parts[:, j].float()
        f = acc + f
    return post.float()[:, :, None] * f[:, None, :] + torch.einsum("bsd,bst->btd", X.float(), comb.float())


def _rope(y: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate the adjacent pairs of the last 2 * len(inv_freq) dims of y [B, ..., D] by pos[b] * inv_freq."""
    R = 2 * inv_freq.numel()
    ang = (pos.float()[:, None] * inv_freq.float()[None, :]).reshape(-1, *([1] * (y.dim() - 2)), R // 2)
    a, b = y[..., -R::2], y[..., -R + 1 :: 2]
    out = y.clone()
    out[..., -R::2] = a * torch.cos(ang) - b * torch.sin(ang)
    out[..., -R + 1 :: 2] = a * torch.sin(ang) + b * torch.cos(ang)
    return out


def q_norm_rope(q, pos, inv_freq, eps: float):
    """q [B, H, D]: per-head RMSNorm (no weight), RoPE on the last R dims."""
    return _rope(_rms(q.float(), eps), pos, inv_freq)


def indexer_q(qi, pos, inv_freq):
    """compress.indexer_q's twin: RoPE of the tail, then the reference model's indexer QAT (Hadamard, FP4)."""
    from ds4.model.quantsim import indexer_qat  # lazy: this module stays free of model imports at load

    return indexer_qat(_rope(qi.float(), pos, inv_freq))


def o_unrope(o, pos, inv_freq, dtype: torch.dtype):
    """o [B, H, D]: RoPE on the last R dims by the negated angle (the inverse rotation), cast to dtype."""
    return _rope(o.float(), -pos, inv_freq).to(dtype)


def _fp8_e4m3(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    xb = x.reshape(*x.shape[:-1], -1, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    m, e = torch.frexp(amax / 448.0)
    scale = torch.ldexp(torch.ones_like(amax), torch.where(m == 0.5, e - 1, e))  # 2^ceil(log2(amax/448))
    q = (xb / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(x.shape)


def kv_norm_rope_fp8(kv, weight, pos, inv_freq, eps: float, out=None, rows=None):
    """kv [B, D]: RMSNorm with weight, RoPE on the last R dims, FP8 E4M3 round trip of the first D - R; with
    out [M, D] and rows [B]: written to out[rows] (returns out)."""
    R = 2 * inv_freq.numel()
    y = _rope(_rms(kv.float(), eps) * weight.float(), pos, inv_freq)
    y = torch.cat([_fp8_e4m3(y[:, :-R]), y[:, -R:]], dim=-1)
    return y if out is None else out.index_copy_(0, rows, y)


def qa_kv_norm_rope_fp8(qa, qa_weight, kv, weight, pos, inv_freq, eps: float, out, rows):
    """(rms_norm(qa, qa_weight, eps) [B, Dq], kv_norm_rope_fp8(kv, weight, pos, inv_freq, eps, out, rows))."""
    qn = _rms(qa.float(), eps) * qa_weight.float()
    return qn, kv_norm_rope_fp8(kv, weight, pos, inv_freq, eps, out, rows)


def router_topk(logits, bias, k: int, scale: float, normalize: bool = True):
    """(ids [B, k] int32, weights [B, k]): top-k of sqrt(softplus) + bias, ties to the lower id."""
    prob = torch.nn.functional.softplus(logits.float()).sqrt()
    sel = prob if bias is None else prob + bias.float()
    ids = sel.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    w = prob.gather(1, ids)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return ids.to(torch.int32), w * scale


def router_hash(logits, tid2eid, tokens, scale: float, normalize: bool = True):
    """(ids [B, k] int32, weights [B, k]) of a hash layer: ids = tid2eid[tokens], weights their sqrt(softplus)
    probabilities (normalised, times scale)."""
    ids = tid2eid[tokens.long()].long()
    w = torch.nn.functional.softplus(logits.float()).sqrt().gather(1, ids)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return ids.to(torch.int32), w * scale


def hc_head_fused(X, fn, scale, base, norm, rms_eps: float, hc_eps: float):
    """The output head's HC collapse then its RMSNorm: X [B, S, d] -> [B, d] f32 (ds4.model.hc.hc_head, then
    ds4.model.norm.rms_norm with `norm`)."""
    flat = X.float().flatten(1)
    mix = (flat @ fn.float().T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)  # [B, S]
    pre = torch.sigmoid(mix * scale.float() + base.float()) + hc_eps
    return _rms((pre[:, :, None] * X.float()).sum(1), rms_eps) * norm.float()


# =========================================================================================================
# Half-precision side matrices: hmatvec (matvec.py). Legend: B rows, N output rows, K row length.


def hmatvec(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, K] @ w[N, K]^T (w float16 | bfloat16, exact in f32) -> [B, N] f32."""
    return x.float() @ w.float().T


# =========================================================================================================
# Compressor decode step: compress_decode (compress.py; also the DS4_TRITON_FUSED=0 torch decode path of
# ds4.model.cuda.batch). Legend: B rows, S pool slots, r ratio, c = 2 if r == 4 else 1, h row width.

EMPTY_SCORE = -1e30  # = ds4.model.state.EMPTY_SCORE: an empty frontier row's score (softmax weight 0)


def compress_decode(kv_new, score_new, ape, fk, fs, rows, slot, pos, norm, inv_freq, eps, n_rot, indexer):
    """Plain-torch twin of compress_decode (same arguments, same in-place updates): the gathered frontiers
    [B, c r, c h] get the token, are pooled and shifted, then written back with the finished rows."""
    from ds4.model.quantsim import indexer_qat  # lazy: this module stays free of model imports at load

    S, cap, h = rows.shape
    c = fk.shape[2] // h
    r, overlap = fk.shape[1] // c, c == 2
    if slot is None:
        slot = torch.zeros_like(pos)
    slot, pos = slot.long(), pos.long()
    fkb, fsb = fk.index_select(0, slot), fs.index_select(0, slot)  # [B, c r, c h] copies
    at = (r if overlap else 0) + pos % r  # [B]
    hit = (torch.arange(c * r, device=pos.device)[None, :] == at[:, None])[..., None]  # [B, c r, 1]
    fkb = torch.where(hit, kv_new.float()[:, None, :], fkb)
    fsb = torch.where(hit, (score_new.float() + ape.float().index_select(0, pos % r))[:, None, :], fsb)
    if overlap:  # candidates: previous window's first half + this window's second half
        cand_kv = torch.cat([fkb[:, :r, :h], fkb[:, r:, h:]], dim=1)  # [B, 2r, h]
        cand_score = torch.cat([fsb[:, :r, :h], fsb[:, r:, h:]], dim=1)
    else:
        cand_kv, cand_score = fkb, fsb
    pooled = (cand_kv * cand_score.softmax(dim=1)).sum(1)  # [B, h]
    row = _rope(_rms(pooled, eps) * norm.float(), pos - (r - 1), inv_freq)
    if indexer:
        row = indexer_qat(row)
    else:
        row = torch.cat([_fp8_e4m3(row[:, :-n_rot]), row[:, -n_rot:]], dim=-1)
    done = (pos % r == r - 1)[:, None, None]  # [B, 1, 1] this token completes a window
    if overlap:  # current window becomes the previous one; the current one empties
        fkb = torch.cat([torch.where(done, fkb[:, r:], fkb[:, :r]), torch.where(done, 0.0, fkb[:, r:])], 1)
        fsb = torch.cat(
            [torch.where(done, fsb[:, r:], fsb[:, :r]), torch.where(done, EMPTY_SCORE, fsb[:, r:])], 1
        )
    else:
        fkb, fsb = torch.where(done, 0.0, fkb), torch.where(done, EMPTY_SCORE, fsb)
    flat = rows.view(-1, h)  # [S cap, h]
    idx = slot * cap + torch.clamp(pos // r, max=cap - 1)  # [B]
    flat.index_copy_(0, idx, torch.where(done[:, 0], row, flat.index_select(0, idx)))
    fk.index_copy_(0, slot, fkb)
    fs.index_copy_(0, slot, fsb)


# =========================================================================================================
# Prefill indexer scores (indexer_prefill.py; helper "pindex")
# Legend: T tokens at positions p0.., Hi/Di indexer heads/dim, C compressed indexer rows, r = ratio.

INDEXER_SCORE_BUDGET = 1 << 25  # elements of the twin's [B, Hi, C] per-head temporary per token block


def indexer_scores_prefill(qi, wts, rows, p0: int, ratio: int = 4):
    """score [T, C] f32 = sum_h wts[t, h] * relu(qi[t, h] . rows[c]) with bf16-rounded qi / rows (exact for
    the indexer's FP4-QAT'd values) and f32 sums; -inf where c >= (p0 + t + 1) // ratio. The math of the
    model's former dense _indexer_pick, token block by token block."""
    T, Hi, _ = qi.shape
    C = rows.shape[0]
    q = qi.to(torch.bfloat16).float()  # [T, Hi, Di]
    k = rows.to(torch.bfloat16).float()  # [C, Di]
    w = wts.float()  # [T, Hi]
    counts = (p0 + torch.arange(T, device=qi.device) + 1) // ratio  # [T]
    out = torch.empty(T, C, device=qi.device, dtype=torch.float32)
    block = max(1, INDEXER_SCORE_BUDGET // max(1, Hi * C))
    for a in range(0, T, block):
        b = min(T, a + block)
        per_head = torch.einsum("thd,cd->thc", q[a:b], k).relu()  # [B, Hi, C]
        out[a:b] = torch.einsum("thc,th->tc", per_head, w[a:b])
    hidden = torch.arange(C, device=qi.device)[None, :] >= counts[:, None]  # [T, C]
    return out.masked_fill_(hidden, float("-inf"))


# =========================================================================================================
# Decode indexer top-k (topk.py)


def top_rows(score: torch.Tensor, k: int) -> torch.Tensor:
    """score [B, n] -> [B, k] int64: indices of the k largest, ties to the lower index (a stable descending
    sort, like the CPU reference's indexer)."""
    return score.sort(dim=-1, descending=True, stable=True).indices[..., :k]
