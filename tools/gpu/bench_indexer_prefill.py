"""Prefill indexer pick at Flash shapes: the former torch scores ([T, Hi, C] f32 per token block, two einsums)
vs the Triton kernel ds4.kernels.indexer_prefill (masked [T, C] scores in one launch), each + the top-k.

On the H200:  PYTHONPATH=. python3 tools/gpu/bench_indexer_prefill.py   (~50 s; past BUDGET: skips)
Anywhere:     PYTHONPATH=. python3 tools/gpu/bench_indexer_prefill.py --compile-only   (sm_90 builds, no GPU)
CPU smoke:    TRITON_INTERPRET=1 PYTHONPATH=. python3 tools/gpu/bench_indexer_prefill.py --smoke  (tiny)

Shapes: a T = 4096 chunk, Hi = 64 heads of Di = 128, C = 1024 rows (the first chunk of an 8k prompt, p0 = 0)
and C = 2048 (the second, p0 = 4096); queries and rows through the indexer QAT like the model's, head weights
~N(0, 1) / sqrt(Di Hi).
  * checks first (fresh random inputs): kernel vs its torch twin (ref.indexer_scores_prefill), max |diff| /
    max |twin| over the visible entries, and the -inf mask equal; the pick (ds4.model.cuda.layer.
    _indexer_pick, DS4_PREFILL_INDEXER kernel vs torch): the share of tokens whose selected (index, valid)
    sets are equal (differences can only come from near-ties at the k-th score);
  * timing (CUDA events, median of REPS after warm-ups at the timed sizes): scores alone (torch, kernel per
    tile config; TFLOP/s = 2 T C Hi Di / time, the dense-equivalent work, the kernel skips the masked
    triangle), then the whole _indexer_pick (query projection + scores + top-k) old vs new, with the top-k
    by stable sort (default) and by torch.topk over packed keys (DS4_PREFILL_TOPK=keys); a summary last.
The C = 2048 shape runs first (with the one-off torch.compile of the keys top-k in its check); configs and
the second shape are skipped once BUDGET seconds have passed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from gpu_timing import median_us  # noqa: E402

from ds4.kernels import indexer_prefill as ip  # noqa: E402
from ds4.kernels import ref  # noqa: E402

T, HI, DI, TOPK = 4096, 64, 128, 512
RQ, D_MODEL = 1024, 4096  # q LoRA rank (qn width) and n_embd of Flash: the pick's own projections
SHAPES = ((2048, 4096), (1024, 0))  # (C, p0): the larger first (the time guard skips the last)
CONFIGS = [  # the default first; all build without spills for sm_90 (--compile-only)
    ip.IndexerPrefillConfig(64, 128, 4, 2),
    ip.IndexerPrefillConfig(64, 128, 4, 3),
    ip.IndexerPrefillConfig(128, 128, 8, 2),
    ip.IndexerPrefillConfig(64, 64, 4, 2),
    ip.IndexerPrefillConfig(64, 256, 8, 2),
    ip.IndexerPrefillConfig(64, 128, 4, 2, precast=True),
    ip.IndexerPrefillConfig(64, 256, 8, 2, precast=True),
]
REPS, WARMUP = 10, 2
BUDGET = 45.0  # s: later configs / shapes are skipped past it (tools/gpu/session4.sh gives 60 s)
DEV = "cuda"


def say(msg: str) -> None:
    print(msg, flush=True)


def time_us(fn, reps: int = REPS) -> float:
    """Median us per call over reps calls, each between two CUDA events (after WARMUP calls)."""
    if DEV == "cuda":
        return median_us(fn, reps, WARMUP)
    for _ in range(WARMUP):
        fn()
    t = time.perf_counter()  # --smoke: one untimed-quality wall-clock call
    fn()
    return (time.perf_counter() - t) * 1e6


def inputs(C: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ds4.model.quantsim import indexer_qat

    g = torch.Generator(DEV).manual_seed(seed)
    qi = indexer_qat(torch.randn(T, HI, DI, device=DEV, generator=g))
    rows = indexer_qat(torch.randn(C, DI, device=DEV, generator=g))
    wts = torch.randn(T, HI, device=DEV, generator=g) * (DI * HI) ** -0.5
    return qi, wts, rows


def pick_args(C: int, p0: int, seed: int):
    """(w, qn, xn, positions, rows, inv_freq) for layer._indexer_pick with bf16 projections like Flash's."""
    from ds4.model.quantsim import indexer_qat

    g = torch.Generator(DEV).manual_seed(seed)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    w = SimpleNamespace(
        q_b=(torch.randn(HI * DI, RQ, device=DEV, generator=g) * RQ**-0.5).to(**bf),
        proj=(torch.randn(HI, D_MODEL, device=DEV, generator=g) * D_MODEL**-0.5).to(**bf),
        compressor=SimpleNamespace(norm=torch.ones(DI, device=DEV)),
    )
    qn = torch.randn(T, RQ, device=DEV, generator=g)
    xn = torch.randn(T, D_MODEL, device=DEV, generator=g)
    rows = indexer_qat(torch.randn(C, DI, device=DEV, generator=g))
    inv_freq = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, device=DEV).float() / 64))
    return w, qn, xn, torch.arange(p0, p0 + T, device=DEV), rows, inv_freq


def run_pick(layer, mode: str, topk: str, args, p0: int):
    layer.PREFILL_INDEXER, layer.PREFILL_TOPK = mode, topk
    w, qn, xn, pos, rows, inv_freq = args
    return layer._indexer_pick(w, qn, xn, pos, rows, TOPK, inv_freq, p0=p0)


def same_sets(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Share of tokens whose (index, valid) sets agree: sort each token's packed (index, valid) entries."""
    ka = (a[0] * 2 + a[1].long()).sort(-1).values
    kb = (b[0] * 2 + b[1].long()).sort(-1).values
    return float((ka == kb).all(-1).float().mean())


def check(layer, C: int, p0: int, keys: bool) -> None:
    """Kernel vs twin and the pick old vs new on fresh inputs of one shape (keys: also the keys top-k, whose
    first call compiles _order_keys)."""
    qi, wts, rows = inputs(C, seed=C)
    got = ip.indexer_scores_prefill(qi, wts, rows, p0, 4)
    twin = ref.indexer_scores_prefill(qi, wts, rows, p0, 4)
    fin = torch.isfinite(twin)
    rel = float((got[fin] - twin[fin]).abs().max() / twin[fin].abs().max())
    mask_ok = torch.equal(torch.isneginf(got), torch.isneginf(twin))
    args = pick_args(C, p0, seed=C + 1)
    old = run_pick(layer, "torch", "sort", args, p0)
    new = run_pick(layer, "kernel", "sort", args, p0)
    say(f"\nC {C} (p0 {p0}): kernel vs twin max rel err {rel:.2e}, -inf mask equal: {mask_ok}")
    msg = f"  pick sets equal old vs new on {same_sets(old, new):.4%} of tokens"
    if keys:
        by_keys = run_pick(layer, "kernel", "keys", args, p0)
        msg += f"; keys == sort: {torch.equal(new[0], by_keys[0]) and torch.equal(new[1], by_keys[1])}"
    say(msg)


def bench(layer, C: int, p0: int, t0: float) -> dict[str, float | str]:
    """Timings of one shape: scores (torch, kernel configs while the budget lasts), top-k, whole pick."""
    qi, wts, rows = inputs(C, seed=C + 2)
    flops = 2 * T * C * HI * DI
    say(f"  {'scores':34s} {'us/call':>9s} {'TFLOP/s':>8s}")
    counts = (torch.arange(p0, p0 + T, device=DEV) + 1) // 4
    ar = torch.arange(C, device=DEV)
    block = max(1, layer.SCORE_BUDGET // (HI * C))

    def torch_scores() -> None:
        for a in range(0, T, block):
            b = a + block
            layer._indexer_scores_torch(qi[a:b], wts[a:b], rows, counts[a:b], ar)

    res: dict[str, float | str] = {"torch scores": time_us(torch_scores)}
    say(f"  {'torch einsums (old)':34s} {res['torch scores']:9.1f} {flops / res['torch scores'] / 1e6:8.1f}")
    best = (float("inf"), "")
    for cfg in CONFIGS:
        if cfg != CONFIGS[0] and time.time() - t0 > BUDGET:
            say(f"  kernel {label(cfg)}: skipped (time budget)")
            continue
        us = time_us(lambda cfg=cfg: ip.indexer_scores_prefill(qi, wts, rows, p0, 4, cfg=cfg))
        best = min(best, (us, label(cfg)))
        say(f"  {f'kernel {label(cfg)}':34s} {us:9.1f} {flops / us / 1e6:8.1f}")
    res["kernel best"], res["best cfg"] = best
    score = ip.indexer_scores_prefill(qi, wts, rows, p0, 4)
    res["sort"] = time_us(lambda: layer._top_rows(score, TOPK))
    res["keys"] = time_us(lambda: layer.top_rows_by_keys(score, TOPK))
    say(f"  top-k of [T, C]: stable sort {res['sort']:.1f} us, topk over keys {res['keys']:.1f} us")
    args = pick_args(C, p0, seed=C + 3)
    say(f"  {'whole _indexer_pick':34s} {'us/call':>9s}")
    for mode, topk in (("torch", "sort"), ("kernel", "sort"), ("kernel", "keys")):
        us = time_us(lambda m=mode, k=topk: run_pick(layer, m, k, args, p0))
        res[f"pick {mode}+{topk}"] = us
        say(f"  {f'{mode} + {topk}':34s} {us:9.1f}")
    return res


def main() -> None:
    from ds4.model.cuda import layer

    t0 = time.time()
    name = torch.cuda.get_device_name() if DEV == "cuda" else "CPU smoke run (interpreter)"
    say(f"{name}  torch {torch.__version__}  triton {triton.__version__}")
    say(f"T {T}  Hi {HI}  Di {DI}  top-k {TOPK}; default config {label(ip.INDEXER_PREFILL_CFG)}")
    results = {}
    try:
        for n, (C, p0) in enumerate(SHAPES):
            if n and time.time() - t0 > BUDGET:
                say(f"\nC {C}: skipped (time budget)")
                continue
            check(layer, C, p0, keys=n == 0)
            results[C] = bench(layer, C, p0, t0)
    finally:
        layer.PREFILL_INDEXER, layer.PREFILL_TOPK = "kernel", "sort"
    say("\nsummary (us per call; pick = query projection + scores + top-k):")
    for C, r in results.items():
        say(
            f"  C {C}: pick old {r['pick torch+sort']:.0f} -> kernel+sort {r['pick kernel+sort']:.0f}, "
            f"kernel+keys {r['pick kernel+keys']:.0f}"
        )
        say(
            f"    scores torch {r['torch scores']:.0f} -> kernel {r['kernel best']:.0f} ({r['best cfg']}); "
            f"top-k sort {r['sort']:.0f} / keys {r['keys']:.0f}"
        )
    say(f"done in {time.time() - t0:.1f} s")


# ---------------------------------------------------------------------------------------------------------
# --compile-only (any machine, no GPU): build the kernel for sm_90 with Triton's bundled ptxas, per config;
# report registers, spill stores/loads and shared memory from the cubin's resource usage.

_SIG = {
    "qi_ptr": "*fp32",
    "w_ptr": "*fp32",
    "rows_ptr": "*fp32",
    "out_ptr": "*fp32",
    **dict.fromkeys(("T", "C", "Hi", "Di", "p0", "ratio", "s_qt", "s_qh", "s_wt", "s_rc"), "i32"),
}
_DIV16 = ("T", "C", "Hi", "Di", "s_qt", "s_qh", "s_wt", "s_rc")  # multiples of 16 at Flash shapes


def label(cfg: ip.IndexerPrefillConfig) -> str:
    return f"bt{cfg.bt} bc{cfg.bc} w{cfg.warps} s{cfg.stages}" + (" bf16 q" if cfg.precast else "")


def _compile(cfg: ip.IndexerPrefillConfig):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = ip._indexer_prefill_kernel
    sig = {n: _SIG.get(n, "constexpr") for n in fn.arg_names}
    if cfg.precast:
        sig["qi_ptr"] = "*bf16"
    consts = {"BT": cfg.bt, "BC": cfg.bc, "BD": DI}
    div = [i for i, n in enumerate(fn.arg_names) if sig[n].startswith("*") or n in _DIV16]
    attrs = {(i,): [["tt.divisibility", 16]] for i in div}
    src = ASTSource(fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": cfg.warps, "num_stages": cfg.stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _usage(cubin: bytes) -> str:
    import subprocess
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True)
    line = next((ln for ln in out.stdout.splitlines() if "REG:" in ln), out.stdout.strip()[-200:])
    return " ".join(line.split())


def compile_only() -> None:
    say(f"triton {triton.__version__}: sm_90 builds of _indexer_prefill_kernel (BD {DI})")
    for cfg in CONFIGS:
        name = label(cfg)
        try:
            k = _compile(cfg)
        except Exception as exc:  # noqa: BLE001 - report every config
            say(f"  {name:22s} FAILED: {type(exc).__name__}: {str(exc)[:400]}")
            continue
        wgmma = k.asm["ptx"].count("wgmma.mma_async")
        say(f"  {name:22s} {_usage(k.asm['cubin'])}  dyn smem {k.metadata.shared}  wgmma in PTX: {wgmma}")


def smoke() -> None:
    """Tiny shapes on the CPU (under TRITON_INTERPRET=1): the script's own code paths, no meaningful times."""
    global T, HI, TOPK, RQ, D_MODEL, SHAPES, CONFIGS, DEV, REPS, WARMUP
    T, HI, TOPK, RQ, D_MODEL, DEV, REPS, WARMUP = 32, 2, 8, 32, 64, "cpu", 1, 0
    SHAPES = ((16, 32),)
    CONFIGS = [ip.IndexerPrefillConfig(16, 16, 1, 1)]
    main()


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    elif "--smoke" in sys.argv:
        smoke()
    else:
        main()
