"""Check + time the quantized-weight kernels (ds4/kernels: matvec, moe, matmul) at DeepSeek V4 Flash shapes.

On the H200:   python tools/gpu/bench_kernels.py [--quick] [--sweep]
  builds random packed weights on the GPU, checks every op against its torch twin (ds4/kernels/ref.py), times
  it with triton.testing.do_bench (median) and prints achieved GB/s of weight bytes vs the 4.3 TB/s ceiling
  (decode) or TFLOP/s vs cuBLAS bf16 on the same shape (prefill). --sweep also times the alternatives of
  the fixed kernel configurations (split-K target, expert rows per program, prefill tile).
               python tools/gpu/bench_kernels.py --fused-only   (the fused decode ops alone, B = 1)
Anywhere (no GPU): python tools/gpu/bench_kernels.py --compile-only
  compiles every launch configuration of the ops for sm_90 with Triton's bundled ptxas and prints registers,
  spills and shared memory per kernel.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ds4.quant import GGMLType, random_blocks  # noqa: E402

PEAK_BW = 4.3e12  # bytes/s, H200 copy bandwidth
Q8, F16, Q2K, Q4K, IQ2 = GGMLType.Q8_0, GGMLType.F16, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS

# (name, qtype, K in, N out); "o_a" is grouped: 8 groups of 4096 -> 1024 on their own input slices.
DENSE = [
    ("q_a", Q8, 4096, 1024),
    ("q_b", Q8, 1024, 32768),
    ("kv", Q8, 4096, 512),
    ("o_b", Q8, 8192, 4096),
    ("f16 4096x1024", F16, 4096, 1024),
    ("f16 4096x256", F16, 4096, 256),
]
GROUPED = [("o_a 8x(4096->1024)", Q8, 8, 4096, 1024)]
# (name, gate/up qtype, down qtype); E = 256 experts, k = 6 per row, K = 4096, F = 2048.
EXPERTS = [("experts iq2/q2k", IQ2, Q2K), ("experts q4k", Q4K, Q4K)]
N_EXP, TOPK, DIM, FFN = 256, 6, 4096, 2048
DEV = "cuda"
PREFILL_M, PREFILL_TOKENS = 4096, 2048  # --quick: 1024, 512
SMOKE = False
# fused decode ops (ds4/kernels/fused.py) at Flash shapes: streams, width, heads, head dim, RoPE dims, experts
FUSED = dict(S=4, d=4096, H=64, D=512, R=64, E=256, k=6, iters=20)


def _smoke_setup() -> None:
    """--smoke: tiny shapes on CPU under Triton's interpreter, one timed call per op (tests this script)."""
    global DENSE, GROUPED, N_EXP, TOPK, DIM, FFN, DEV, PREFILL_M, PREFILL_TOKENS, SMOKE, FUSED
    FUSED = dict(S=4, d=64, H=2, D=192, R=64, E=16, k=2, iters=20)
    os.environ["TRITON_INTERPRET"] = "1"
    DENSE = [(name, qt, 256, 40) for name, qt, _, _ in DENSE]
    GROUPED = [(name, qt, 2, 256, 24) for name, qt, *_ in GROUPED]
    N_EXP, TOPK, DIM, FFN, DEV, PREFILL_M, PREFILL_TOKENS, SMOKE = 8, 2, 256, 256, "cpu", 70, 40, True


def packed(qtype, shape, gen, std=0.02):
    from ds4.kernels.packing import pack

    return pack(random_blocks(qtype, shape, std=std, generator=gen), qtype, shape)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def bench(fn) -> float:
    if SMOKE:  # one call: checks the script, times nothing meaningful
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3  # seconds


def row(name, qtype, b, dtype, secs, nbytes, err, tol, extra=""):
    gbs = nbytes / secs / 1e9
    ok = "ok" if err <= tol else f"FAIL(>{tol:g})"
    dt = "bf16" if dtype == torch.bfloat16 else "f32"
    print(
        f"{name:22s} {qtype:>8s} B={b:<3d} {dt:4s} {secs * 1e6:9.1f} us {gbs:8.0f} GB/s "
        f"{100 * gbs * 1e9 / PEAK_BW:5.1f}%  err {err:.1e} {ok} {extra}"
    )


def run_gpu(quick: bool) -> int:
    from ds4.kernels import matmul, matvec, moe, ref

    dev = torch.device(DEV)
    gen = torch.Generator(dev).manual_seed(0)
    batches = (1, 8) if quick else (1, 8, 32)
    fails = 0
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
    print(f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}  torch {torch.__version__}")
    print("--- decode: dense qmatvec (time includes the split-K sum)")
    for name, qt, k, n in DENSE:
        w = packed(qt, (n, k), gen)
        for b in batches:
            for dt in (torch.float32, torch.bfloat16) if b > 1 else (torch.float32,):
                x = torch.randn(b, k, device=dev, generator=gen).to(dt)
                err = rel_err(matvec.qmatvec(x, w), ref.qmatvec(x, w))
                fails += err > tol[dt]
                secs = bench(lambda: matvec.qmatvec(x, w))  # noqa: B023
                row(name, qt.name, b, dt, secs, w.nbytes(), err, tol[dt])
    for name, qt, g, k, n in GROUPED:
        w = packed(qt, (g, n, k), gen)
        for b in batches:
            x = torch.randn(b, g, k, device=dev, generator=gen)
            err = rel_err(matvec.qmatvec_grouped(x, w), ref.qmatvec_grouped(x, w))
            fails += err > 1e-5
            secs = bench(lambda: matvec.qmatvec_grouped(x, w))  # noqa: B023
            row(name, qt.name, b, torch.float32, secs, w.nbytes(), err, 1e-5)
    print(f"--- decode: gathered experts ({TOPK} of {N_EXP}); GB/s counts each distinct expert once")
    for name, qgu, qd in EXPERTS:
        wg = packed(qgu, (N_EXP, FFN, DIM), gen)
        wu = packed(qgu, (N_EXP, FFN, DIM), gen)
        wd = packed(qd, (N_EXP, DIM, FFN), gen)
        small = [
            packed(qgu, (8, FFN, DIM), gen),
            packed(qgu, (8, FFN, DIM), gen),
            packed(qd, (8, DIM, FFN), gen),
        ]
        per_gu = wg.nbytes() // N_EXP
        per_d = wd.nbytes() // N_EXP
        for b in batches:
            ids = torch.stack(
                [torch.randperm(N_EXP, device=dev, generator=gen)[:TOPK] for _ in range(b)]
            ).int()
            uniq = int(torch.unique(ids).numel())
            x = torch.randn(b, DIM, device=dev, generator=gen)
            weights = torch.rand(b, TOPK, device=dev, generator=gen)
            ids8 = ids % 8
            mid = moe.moe_gate_up(x, small[0], small[1], ids8, 10.0)
            err = rel_err(mid, ref.moe_gate_up(x, small[0], small[1], ids8, 10.0))
            fails += err > 1e-5
            secs = bench(lambda: moe.moe_gate_up(x, wg, wu, ids, 10.0))  # noqa: B023
            row(name + " gate+up", qgu.name, b, torch.float32, secs, 2 * uniq * per_gu, err, 1e-5)
            mid = torch.randn(b, TOPK, FFN, device=dev, generator=gen)
            err = rel_err(
                moe.moe_down(mid, weights, small[2], ids8), ref.moe_down(mid, weights, small[2], ids8)
            )
            fails += err > 1e-5
            secs = bench(lambda: moe.moe_down(mid, weights, wd, ids))  # noqa: B023
            row(name + " down", qd.name, b, torch.float32, secs, uniq * per_d, err, 1e-5)
    fails += run_fused(dev, gen)
    print(
        "--- prefill: qmatmul / moe_grouped, bf16 activations (TFLOP/s; cuBLAS bf16 on a bf16 copy for scale)"
    )
    m = min(1024, PREFILL_M) if quick else PREFILL_M
    for name, qt, k, n in DENSE[:2] + [DENSE[3]]:
        w = packed(qt, (n, k), gen)
        x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
        err = rel_err(matmul.qmatmul(x, w), ref.qmatmul(x, w))
        fails += err > 1e-2
        secs = bench(lambda: matmul.qmatmul(x, w))  # noqa: B023
        wb = ref._unpack(w).bfloat16()
        cublas = bench(lambda: x @ wb.T)  # noqa: B023
        flops = 2 * m * n * k
        row(name, qt.name, m, torch.bfloat16, secs, w.nbytes(), err, 1e-2,
            f"{flops / secs / 1e12:6.1f} TFLOP/s (cuBLAS bf16 {flops / cublas / 1e12:6.1f})")  # fmt: skip
    tokens = min(512, PREFILL_TOKENS) if quick else PREFILL_TOKENS
    for name, qgu, _ in EXPERTS:
        wg = packed(qgu, (N_EXP, FFN, DIM), gen)
        w8 = packed(qgu, (8, FFN, DIM), gen)  # check on 8 experts (the twin dequantizes whole stacks)
        ids = torch.stack([torch.randperm(N_EXP, device=dev, generator=gen)[:TOPK] for _ in range(tokens)])
        x = torch.randn(tokens, DIM, device=dev, generator=gen).bfloat16()
        order, offsets = moe.group_by_expert(ids % 8, 8)
        xs = x[order // TOPK]
        err = rel_err(matmul.moe_grouped(xs, w8, offsets), ref.moe_grouped(xs, w8, offsets))
        fails += err > 1e-2
        order, offsets = moe.group_by_expert(ids, N_EXP)
        xs = x[order // TOPK]
        secs = bench(lambda: matmul.moe_grouped(xs, wg, offsets))  # noqa: B023
        flops = 2 * xs.shape[0] * FFN * DIM
        row(name + " grouped", qgu.name, xs.shape[0], torch.bfloat16, secs, wg.nbytes(), err, 1e-2,
            f"{flops / secs / 1e12:6.1f} TFLOP/s")  # fmt: skip
    print("FAILURES:", fails if fails else "none")
    return 1 if fails else 0


def _fused_cases(dev, gen):
    """(name, fused call, eager torch reference call, old decode call, tolerance) at the FUSED shapes."""
    from ds4.kernels import fused
    from ds4.model import hc
    from ds4.model.attention import fp8_nope
    from ds4.model.cuda import fused as old
    from ds4.model.norm import rms_norm
    from ds4.model.rope import rope_inv_freq, rope_tail

    S, d, H, D, R, E, k, it = (FUSED[n] for n in ("S", "d", "H", "D", "R", "E", "k", "iters"))
    M, eps = (2 + S) * S, 1e-6

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, device=dev, generator=gen) * s

    X, f, q, kv, logits = rnd(1, S, d), rnd(1, d), rnd(1, H, D), rnd(1, D), rnd(1, E, s=4.0)
    fn, scale, base = rnd(M, S * d, s=(S * d) ** -0.5), rnd(3).abs() + 0.5, rnd(M, s=0.5)
    norm, kvw, bias = rnd(d).abs() + 0.5, rnd(D).abs() + 0.5, rnd(E, s=0.2)
    pos, inv = torch.tensor([1234], device=dev), rope_inv_freq(R, 10000.0).to(dev)
    post, comb = rnd(1, S).abs(), rnd(1, S, S).abs()
    w = hc.HCWeights(fn, scale, base)

    def pre_eager():
        x, p, c = hc.hc_pre(X, w, iters=it, rms_eps=eps, hc_eps=eps)
        return rms_norm(x, norm, eps), p, c

    def route_eager():
        probs = torch.nn.functional.softplus(logits).sqrt()
        ids = (probs + bias).topk(k, dim=-1).indices
        wts = probs.gather(1, ids)
        return ids.int(), wts / wts.sum(-1, keepdim=True) * 2.5

    def pre_two_pass():  # the finish kernel's old chunked row walk (fused.HC_FINISH_BD / HC_FINISH_WARPS)
        saved = fused.HC_FINISH_BD, fused.HC_FINISH_WARPS
        fused.HC_FINISH_BD, fused.HC_FINISH_WARPS = 1024, 4
        try:
            return fused.hc_pre_fused(X, fn, scale, base, it, eps, eps, norm)
        finally:
            fused.HC_FINISH_BD, fused.HC_FINISH_WARPS = saved

    return [
        ("hc_pre + norm", lambda: fused.hc_pre_fused(X, fn, scale, base, it, eps, eps, norm), pre_eager,
         lambda: old.hc_pre_norm(X, fn, scale, base, norm, it, eps, eps), 2e-5),
        ("hc_pre + norm 2 pass", pre_two_pass, pre_eager,
         lambda: old.hc_pre_norm(X, fn, scale, base, norm, it, eps, eps), 2e-5),
        ("hc_post", lambda: fused.hc_post_fused(f, X, post, comb), lambda: hc.hc_post(f, X, post, comb),
         lambda: old.hc_post(f, X, post, comb), 2e-5),
        ("q_norm_rope", lambda: fused.q_norm_rope(q, pos, inv, eps),
         lambda: rope_tail(rms_norm(q, None, eps), pos, inv), lambda: old.q_post(q, pos, inv, eps), 2e-5),
        ("kv_norm_rope_fp8", lambda: fused.kv_norm_rope_fp8(kv, kvw, pos, inv, eps),
         lambda: fp8_nope(rope_tail(rms_norm(kv, kvw, eps), pos, inv), R),
         lambda: old.kv_post(kv, kvw, pos, inv, eps, R), 0.07),  # an FP8 midpoint flip: one E4M3 step
        ("router_topk", lambda: fused.router_topk(logits, bias, k, 2.5), route_eager,
         lambda: route_eager(), 2e-5),
    ]  # fmt: skip


def run_fused(dev, gen) -> int:
    """Fused decode ops vs the unfused torch sequences they replace: eager reference math, and the decode
    path before them (ds4.model.cuda.fused with TRITON_FUSED off: torch.compile on CUDA)."""
    from ds4.model.cuda import fused as old

    print("--- decode: fused small ops, B=1 (us: Triton / eager torch / torch.compile path; err vs eager)")
    fails = 0
    for name, new_fn, eager_fn, old_fn, tol in _fused_cases(dev, gen):
        got, want = new_fn(), eager_fn()
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        err = max(rel_err(a.float(), b.float()) for a, b in zip(got, want, strict=True))
        fails += err > tol
        t_new, t_eager = bench(new_fn), bench(eager_fn)
        saved = old.TRITON_FUSED, old.SWITCH.enabled
        old.TRITON_FUSED, old.SWITCH.enabled = False, dev.type == "cuda"
        try:
            old_fn()  # compile outside the timing
            t_old = bench(old_fn)
        finally:
            old.TRITON_FUSED, old.SWITCH.enabled = saved
        ok = "ok" if err <= tol else f"FAIL(>{tol:g})"
        print(
            f"{name:22s} {t_new * 1e6:8.1f} {t_eager * 1e6:8.1f} {t_old * 1e6:8.1f} us   "
            f"x{t_old / t_new:5.1f} vs old  err {err:.1e} {ok}"
        )
    return fails


def sweep() -> None:
    """Time the fixed configuration knobs of the kernels (module constants) on representative shapes."""
    from ds4.kernels import matmul, matvec, moe

    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(1)
    saved = (
        matvec.TARGET_PROGRAMS,
        None,
        (matmul.BM, matmul.BN, matmul.WARPS, matmul.STAGES),
        matvec.DECODE_ROWS,
    )
    print("--- sweep: matvec.TARGET_PROGRAMS (split-K), B = 1, x f32")
    for name, qt, k, n in (DENSE[0], DENSE[2], DENSE[3], DENSE[4]):
        w = packed(qt, (n, k), gen)
        x = torch.randn(1, k, device=dev, generator=gen)
        for target in (128, 256, 512, 1024, 2048, 4096):
            matvec.TARGET_PROGRAMS = target
            secs = bench(lambda: matvec.qmatvec(x, w))  # noqa: B023
            print(f"{name:16s} target {target:5d}: {secs * 1e6:8.1f} us {w.nbytes() / secs / 1e9:7.0f} GB/s")
    matvec.TARGET_PROGRAMS = saved[0]
    print("--- sweep: matvec.DECODE_ROWS (weight rows per program), B = 1, x f32")
    for qt in (Q8, IQ2, Q2K, Q4K, F16):
        w = packed(qt, (2048, 4096), gen)
        x = torch.randn(1, 4096, device=dev, generator=gen)
        for rows in (8, 16, 32, 64):
            matvec.DECODE_ROWS = rows
            secs = bench(lambda: matvec.qmatvec(x, w))  # noqa: B023
            gbs = w.nbytes() / secs / 1e9
            print(f"{qt.name:8s} 4096->2048 rows {rows:3d}: {secs * 1e6:8.1f} us {gbs:7.0f} GB/s")
    matvec.DECODE_ROWS = saved[3]
    print("--- sweep: moe rows per program (MoeConfig.bn, no split), 6 of 256 experts")
    wg = packed(IQ2, (N_EXP, FFN, DIM), gen)
    wd = packed(Q2K, (N_EXP, DIM, FFN), gen)
    for b in (1, 8):
        ids = torch.stack([torch.randperm(N_EXP, device=dev, generator=gen)[:TOPK] for _ in range(b)]).int()
        x = torch.randn(b, DIM, device=dev, generator=gen)
        mid = torch.randn(b, TOPK, FFN, device=dev, generator=gen)
        weights = torch.rand(b, TOPK, device=dev, generator=gen)
        for bn in (8, 16, 32, 64):
            cfg = moe.MoeConfig(bn=bn)
            t_gu = bench(lambda: moe.moe_gate_up(x, wg, wg, ids, 10.0, cfg))  # noqa: B023
            t_d = bench(lambda: moe.moe_down(mid, weights, wd, ids, cfg))  # noqa: B023
            print(f"B={b:<3d} BN {bn:3d}: gate+up {t_gu * 1e6:8.1f} us  down {t_d * 1e6:8.1f} us")
    print("--- sweep: matmul (BM, BN, warps, stages), bf16 x, M = 4096")
    w = packed(Q8, (1024, 4096), gen)
    x = torch.randn(4096, 4096, device=dev, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(N_EXP, device=dev, generator=gen)[:TOPK] for _ in range(1024)])
    order, offsets = moe.group_by_expert(ids, N_EXP)
    xs = torch.randn(1024, DIM, device=dev, generator=gen).bfloat16()[order // TOPK]
    for cfg in (
        (64, 64, 4, 2),
        (64, 64, 8, 2),
        (64, 64, 8, 3),
        (128, 64, 8, 2),
        (64, 128, 8, 2),
        (128, 128, 8, 3),
    ):
        matmul.BM, matmul.BN, matmul.WARPS, matmul.STAGES = cfg
        try:
            t_mm = bench(lambda: matmul.qmatmul(x, w))
            t_g = bench(lambda: matmul.moe_grouped(xs, wg, offsets))
        except Exception as exc:  # e.g. out of shared memory / registers for a large tile
            print(f"{cfg}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        tf_mm = 2 * 4096 * 1024 * 4096 / t_mm / 1e12
        tf_g = 2 * xs.shape[0] * FFN * DIM / t_g / 1e12
        print(f"{cfg}: qmatmul Q8_0 {tf_mm:6.1f} TFLOP/s   moe_grouped IQ2_XXS {tf_g:6.1f} TFLOP/s")
    matmul.BM, matmul.BN, matmul.WARPS, matmul.STAGES = saved[2]


# ---------------------------------------------------------------------------------------------------------
# Offline compile for sm_90


class _Capture:
    """Stands in for a @triton.jit kernel: records launches instead of running them."""

    def __init__(self, fn, sink):
        self.fn, self.sink = fn, sink

    def __getitem__(self, grid):
        return lambda *args, **kw: self.sink.append((self.fn, args, kw))


_PTR = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.int32: "*i32",
    torch.int64: "*i64",
}


def _compile(fn, args, kw, target):
    import triton
    from triton.compiler import ASTSource

    kw = dict(kw)
    opts = {k: kw.pop(k) for k in ("num_warps", "num_stages", "launch_pdl", "enable_fp_fusion") if k in kw}
    sig, consts, attrs = {}, {}, {}
    pos = iter(args)
    for i, (name, p) in enumerate(zip(fn.arg_names, fn.params, strict=True)):
        if p.is_constexpr:
            sig[name], consts[name] = "constexpr", kw[name] if name in kw else p.default
            continue
        v = kw[name] if name in kw else next(pos, p.default)  # past the given args: the default
        if v is None:  # an unused optional pointer: Triton specializes None as a constexpr
            sig[name], consts[name] = "constexpr", None
            continue
        if isinstance(v, torch.Tensor):
            sig[name] = _PTR[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 256-byte aligned
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    key = (fn.__name__, tuple(sig.values()), tuple(sorted(consts.items())), tuple(sorted(opts.items())))
    src = ASTSource(fn, signature=sig, constexprs=consts, attrs=attrs)
    return key, triton.compile(src, target=target, options=opts)


def _usage(cubin: bytes) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    line = next((ln.strip() for ln in out.splitlines() if "REG:" in ln), "?")
    keep = [t for t in line.split() if t.split(":")[0] in ("REG", "STACK", "SHARED", "LOCAL")]
    return " ".join(keep)


def _capture_fused(sink: list) -> None:
    """Record the launches of the fused decode ops (ds4/kernels/fused.py) at Flash and small shapes."""
    from ds4.kernels import fused

    fused._use_triton = lambda t: True
    for attr in ("_hc_mix_partial", "_hc_mix_rows", "_hc_pre_finish", "_hc_post_kernel",
                 "_q_norm_rope_kernel", "_o_unrope_kernel", "_kv_norm_rope_fp8_kernel",
                 "_router_kernel", "_router_hash_kernel"):  # fmt: skip
        setattr(fused, attr, _Capture(getattr(fused, attr), sink))
    S, d, H, D, R, E = 4, 4096, 64, 512, 64, 256
    M, pos, inv = (2 + S) * S, torch.zeros(1, dtype=torch.long), torch.rand(R // 2)
    for fn_dtype in (torch.float32, torch.float16, torch.bfloat16):
        for norm in (None, torch.ones(d)):
            X = torch.randn(1, S, d)
            fused.hc_pre_fused(X, torch.zeros(M, S * d, dtype=fn_dtype), torch.ones(3), torch.zeros(M), 20,
                               1e-6, 1e-6, norm)  # fmt: skip
    fused.hc_post_fused(torch.randn(1, d), torch.randn(1, S, d), torch.rand(1, S), torch.rand(1, S, S))
    X = torch.randn(fused.HC_ROWS_MIN + 8, S, d)  # prefill rows: the row-tile mixing
    fused.hc_pre_fused(X, torch.zeros(M, S * d), torch.ones(3), torch.zeros(M), 20, 1e-6, 1e-6, torch.ones(d))
    fused.q_norm_rope(torch.randn(1, H, D), pos, inv, 1e-6)
    fused.q_norm_rope(torch.randn(1, H, D).bfloat16(), pos, inv, 1e-6)  # prefill: the bf16 GEMM output
    fused.o_unrope(torch.randn(1, H, D), pos, inv, torch.bfloat16)
    fused.kv_norm_rope_fp8(torch.randn(1, D), torch.ones(D), pos, inv, 1e-6)
    for bias in (None, torch.zeros(E)):
        fused.router_topk(torch.randn(1, E), bias, 6, 2.5)
    tid2eid = torch.zeros(129280, 6, dtype=torch.long)
    fused.router_hash(torch.randn(1, E), tid2eid, torch.zeros(1, dtype=torch.long), 2.5)
    for B in (1, 32):  # the output head's collapse + norm (the head's fn is f32)
        fused.hc_head_fused(torch.randn(B, S, d), torch.zeros(S, S * d), torch.ones(1), torch.zeros(S),
                            torch.ones(d), 1e-6, 1e-6)  # fmt: skip


def _capture_launched(mod, sink: list) -> None:
    """Replace every jit kernel that `mod` launches (`name[grid](...)` in its source) by a recorder, so the
    calls below collect launch configurations instead of running (no GPU needed)."""
    import inspect
    import re

    from triton.runtime.jit import JITFunction

    launched = set(re.findall(r"\b(\w+)\[[^\]]*\]\(", inspect.getsource(mod)))
    for name in sorted(launched):
        fn = getattr(mod, name, None)
        if isinstance(fn, JITFunction):
            setattr(mod, name, _Capture(fn, sink))


def compile_only() -> int:
    from triton.backends.compiler import GPUTarget

    from ds4.kernels import compress, gemm, matmul, matvec, moe

    sink: list = []
    for mod in (matvec, moe, matmul, gemm):
        mod.use_triton = lambda t: True
        _capture_launched(mod, sink)
    compress._use_triton = lambda t: True
    compress._indexer_q_kernel = _Capture(compress._indexer_q_kernel, sink)
    for dt in (torch.float32, torch.bfloat16):
        compress.indexer_q(torch.randn(2, 64, 128).to(dt), torch.zeros(2, dtype=torch.long), torch.rand(32))
    gemm.linear_f32(torch.randn(256, 4096), torch.randn(1024, 4096))
    for dt in (torch.float32, torch.bfloat16):
        matmul.gather_sum(torch.randn(12, 4096).to(dt), torch.randint(0, 12, (4, 6)))
    gen = torch.Generator().manual_seed(0)
    k, n = 512, 64
    for qt in (Q8, F16, Q2K, Q4K, IQ2):
        w = packed(qt, (n, k), gen)
        w3 = packed(qt, (4, n, k), gen)
        for b in (1, 2, 4, 8, 32, 64):
            for dt in (torch.float32, torch.bfloat16):
                matvec.qmatvec(torch.randn(b, k).to(dt), w)
        for dt in (torch.float32, torch.bfloat16):
            matmul.qmatmul(torch.randn(128, k).to(dt), w)
            matmul.moe_grouped(torch.randn(128, k).to(dt), w3, torch.tensor([0, 50, 50, 100, 128]).int())
        matvec.qmatvec_grouped(torch.randn(2, 4, k), w3)
        ids = torch.tensor([[0, 3], [2, 2]]).int()
        for cfg in (moe.GATE_UP, moe.DOWN, moe.MoeConfig(16, 2), moe.MoeConfig(8, 1, fast=True)):
            moe.moe_gate_up(torch.randn(2, k), w3, w3, ids, 10.0, cfg)
            moe.moe_down(torch.randn(2, 2, k), torch.rand(2, 2), w3, ids, cfg)
    _capture_fused(sink)
    target = GPUTarget("cuda", 90, 32)
    seen = set()
    failures = 0
    for fn, args, kw in sink:
        t0 = time.time()
        try:
            key, compiled = _compile(fn, args, kw, target)
        except Exception as exc:  # report and continue: one broken config must not hide the others
            failures += 1
            print(f"FAIL {fn.__name__} {kw}: {type(exc).__name__}: {str(exc)[:400]}")
            continue
        if key in seen:
            continue
        seen.add(key)
        cfg = {c: kw[c] for c in ("QT", "BB", "BN", "BM", "USE_DOT", "num_warps") if c in kw}
        print(f"{fn.__name__:20s} {str(cfg):80s} {_usage(compiled.asm['cubin'])}  ({time.time() - t0:.1f}s)")
    print(f"{len(seen)} configurations compiled for sm_90, {failures} failures")
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--compile-only", action="store_true", help="compile every config for sm_90 (no GPU needed)"
    )
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes and smaller prefill shapes")
    ap.add_argument("--sweep", action="store_true", help="also time alternative kernel configurations")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under Triton's interpreter")
    ap.add_argument("--fused-only", action="store_true", help="only the fused decode ops (B = 1)")
    args = ap.parse_args()
    if args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
        return compile_only()
    if args.smoke:
        _smoke_setup()
        return run_gpu(quick=True)
    if not torch.cuda.is_available():
        print("no CUDA device: use --compile-only here, or run on the GPU machine", file=sys.stderr)
        return 2
    if args.fused_only:
        return run_fused(torch.device("cuda"), torch.Generator("cuda").manual_seed(0))
    rc = run_gpu(args.quick)
    if args.sweep:
        sweep()
    return rc


if __name__ == "__main__":
    sys.exit(main())
