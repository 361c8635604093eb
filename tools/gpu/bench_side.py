"""Tune hmatvec (x f32 @ f16 side matrices, ds4.kernels.matvec) at Flash shapes: GB/s per tile config.

On the H200:  PYTHONPATH=. python3 tools/gpu/bench_side.py [--b 1,8,32] [--quick]     (~2-4 minutes)
Anywhere:     PYTHONPATH=. python3 tools/gpu/bench_side.py --list   (shapes and configs; needs no GPU)
              PYTHONPATH=. python3 tools/gpu/bench_side.py --compile-only [--quick]   (sm_90 builds with
              Triton's bundled ptxas: registers, spill bytes and the k loop's instruction mix per config)

Shapes (one decode step of Flash): the attention input's concatenated compressor / indexer matrices of a
ratio-4 layer [2 x 1024 + 2 x 256 + 64, 4096] and of a ratio-128 layer [2 x 512, 4096], the router
[256, 4096], the indexer q_b [8192, 1024]; random f16 values on the GPU. For each shape, batch B and config:
max |got - f64 oracle| / max |oracle| (must stay < 1e-5), then triton.testing.do_bench (median; it flushes
the L2 before every call, as in a decode step where each layer's matrices are cold) and GB/s = (weight + x +
out bytes) / time. Baselines: cuBLAS f32 GEMV on the f32 copy (today's path) and torch f16 (bandwidth
reference; it rounds x to f16). Last: per step sums (shape time x layers using it) of the default configs
(HMV_SMALL for B <= HALF_SMALL_B, else HMV_LARGE) vs the best config per (shape, B): copy the winners into
HMV_SMALL / HMV_LARGE in ds4/kernels/matvec.py (and HALF_SMALL_B if "fma" wins at larger B).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from ds4.config import FLASH  # noqa: E402
from ds4.kernels import matvec  # noqa: E402
from ds4.kernels.matvec import HalfConfig  # noqa: E402

_R4 = sum(r == 4 for r in FLASH.compress_ratios)  # layers with the indexer
_R128 = sum(r == 128 for r in FLASH.compress_ratios)
_IDX = 2 * FLASH.indexer_dim  # indexer compressor width
# (label, N, K, matrices of this shape per decode step)
SHAPES = [
    ("attn r4", 2 * 2 * FLASH.head_dim + 2 * _IDX + FLASH.indexer_heads, FLASH.n_embd, _R4),
    ("attn r128", 2 * FLASH.head_dim, FLASH.n_embd, _R128),
    ("router", FLASH.n_expert, FLASH.n_embd, FLASH.n_layer),
    ("idx q_b", FLASH.indexer_heads * FLASH.indexer_dim, FLASH.q_lora_rank, _R4),
]
BATCHES = (1, 8, 32)
# (bn, tk, warps, stages, target, fixup); target 1: no split-K (full rows per program, many small programs)
FMA = [
    HalfConfig(bn, tk, warps, stages, target, "fma", fixup)
    for bn, tk, warps, stages, target, fixup in (
        (8, 512, 4, 1, 1056, False),
        (8, 512, 4, 1, 1056, True),
        (8, 512, 4, 1, 2112, True),
        (8, 512, 4, 2, 1056, True),
        (8, 1024, 8, 1, 1056, True),
        (4, 512, 4, 1, 1056, True),
        (16, 256, 4, 1, 1056, False),
        (8, 256, 4, 1, 528, False),
        (2, 512, 4, 3, 1, False),
        (4, 512, 4, 3, 1, False),
        (8, 512, 4, 3, 1, False),
    )
]
DOT = [
    HalfConfig(bn, tk, warps, stages, target, mode, fixup)
    for mode, bn, tk, warps, stages, target, fixup in (
        ("tf32x2", 32, 128, 4, 2, 1056, False),
        ("tf32x2", 32, 128, 4, 2, 1056, True),
        ("tf32x2", 32, 128, 4, 3, 1056, True),
        ("tf32x2", 16, 128, 4, 2, 1056, True),
        ("tf32x2", 64, 128, 4, 2, 1056, True),
        ("tf32x2", 64, 64, 4, 3, 1056, True),
        ("tf32x2", 32, 128, 4, 3, 1, False),
        ("ieee", 16, 128, 4, 2, 1056, True),
        ("tf32x3", 32, 128, 4, 2, 1056, True),
    )
]
QUICK = [matvec.HMV_SMALL, matvec.HMV_LARGE, FMA[1], FMA[9], DOT[1], DOT[6]]
TOL = 1e-5


def configs_for(b: int, quick: bool) -> list[HalfConfig]:
    """The default first, then the candidates ("fma" rows re-read W every 4 rows of x: try it at every B)."""
    default = matvec.HMV_SMALL if b <= matvec.HALF_SMALL_B else matvec.HMV_LARGE
    cands = QUICK if quick else FMA + DOT
    return [default] + [c for c in cands if c != default]


def label(c: HalfConfig) -> str:
    return f"{c.mode:6s} bn{c.bn:<3d} tk{c.tk:<5d} w{c.warps} s{c.stages} t{c.target:<5d}{' fixup' * c.fixup}"


def bench(fn) -> float:
    """Median ms of fn, L2 flushed before each call (do_bench's default)."""
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def bench_shape(w: torch.Tensor, x: torch.Tensor, quick: bool) -> tuple[float, float, float]:
    """Print one (shape, B) block; returns ms of (cuBLAS f32, default config, best accurate config)."""
    w32 = w.float()
    want = x.double() @ w.double().T
    nbytes = w.numel() * 2 + x.numel() * 4 + want.numel() * 4
    t32 = bench(lambda: x @ w32.T)
    t16 = bench(lambda: x.half() @ w.T)
    print(f"  cuBLAS f32 {t32 * 1e3:8.1f} us {2 * nbytes / t32 / 1e6:7.0f} GB/s (reads 2x the bytes)")
    print(f"  torch f16  {t16 * 1e3:8.1f} us {nbytes / t16 / 1e6:7.0f} GB/s")
    times: list[tuple[float, HalfConfig]] = []
    t_default = float("nan")
    for i, cfg in enumerate(configs_for(x.shape[0], quick)):
        try:
            err = float((matvec.hmatvec(x, w, cfg).double() - want).abs().max() / want.abs().max())
            t = bench(lambda cfg=cfg: matvec.hmatvec(x, w, cfg))
        except Exception as e:  # a config that fails to compile (registers, shared memory) is skipped
            print(f"  {label(cfg)}  FAILED {type(e).__name__}: {str(e)[:80]}")
            continue
        t_default = t if i == 0 else t_default
        note = ("default" if i == 0 else "") + ("" if err < TOL else "  <-- INACCURATE")
        print(f"  {label(cfg)} {t * 1e3:8.1f} us {nbytes / t / 1e6:7.0f} GB/s err {err:.1e} {note}")
        if err < TOL:
            times.append((t, cfg))
    t_best, c_best = min(times, key=lambda tc: tc[0])
    print(f"  best: {label(c_best)} {t_best * 1e3:.1f} us", flush=True)
    return t32, t_default, t_best


def run(batches: tuple[int, ...], quick: bool) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    step = {b: [0.0, 0.0, 0.0] for b in batches}  # ms per decode step: cuBLAS, defaults, best
    for name, n, k, count in SHAPES:
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.05).half()
        for b in batches:
            print(f"\n{name} [{n}, {k}] x{count}/step, B={b}  ({n * k * 2 / 1e6:.1f} MB of f16)", flush=True)
            x = torch.randn(b, k, device=dev, generator=gen)
            for i, t in enumerate(bench_shape(w, x, quick)):
                step[b][i] += t * count
    print("\nper decode step (all side matrices of all layers, cold L2):")
    for b, (t32, t_def, t_best) in step.items():
        print(
            f"  B={b:2d}: cuBLAS f32 {t32:.3f} ms, hmatvec defaults {t_def:.3f} ms, "
            f"best per shape {t_best:.3f} ms"
        )


# ---------------------------------------------------------------------------------------------------------
# --compile-only: no GPU needed

_SIG = {
    "x_ptr": "*fp32",
    "w_ptr": "*fp16",
    "out_ptr": "*fp32",
    "sum_ptr": "*fp32",
    "cnt_ptr": "*i32",
    "B": "i32",
    "N": "i32",
    "K": "i32",
}
_LOOP_OPS = ("LDG", "LDGSTS", "HMMA", "HGMMA", "FFMA", "LDS", "LDSM", "BAR", "STL", "LDL", "ATOMG", "RED")


def _build(b: int, k: int, cfg: HalfConfig):
    """The sm_90 kernel hmatvec launches for b rows of length k (16-byte aligned pointers and K)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = matvec._hmv_kernel
    bb, tk, mode = matvec.half_tiles(b, k, cfg)
    consts = {"BB": bb, "BN": cfg.bn, "TK": tk, "MODE": mode, "STAGES": cfg.stages, "FIXUP": cfg.fixup,
              "PREFETCH": cfg.prefetch}  # fmt: skip
    sig = {name: _SIG.get(name, "i32") if name not in consts else "constexpr" for name in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in _SIG}
    src = ASTSource(fn, signature=sig, constexprs=consts, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.warps})


def _sass_summary(cubin: bytes) -> str:
    """Registers, spill stack and the op mix of the k loop (the longest loop without an inner loop)."""
    import re
    import subprocess
    import tempfile

    tool = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        use = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", use)
    stack = re.search(r"STACK:(\d+)", use)
    ins = []  # (address, opcode without modifiers, operands)
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)[.\w]*(.*)", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    back = [
        (int(t.group(1), 16), a)
        for a, op, rest in ins
        if op == "BRA" and (t := re.search(r"0x([0-9a-f]+)", rest)) and int(t.group(1), 16) < a
    ]
    mix = ""
    if back:
        inner = [
            (lo, hi) for lo, hi in back if not any(lo <= a < b <= hi and (a, b) != (lo, hi) for a, b in back)
        ]
        lo, hi = max(inner, key=lambda r: r[1] - r[0])  # the k loop: the longest innermost loop
        ops = [op for a, op, _ in ins if lo <= a <= hi]
        mix = " ".join(f"{o} {ops.count(o)}" for o in _LOOP_OPS if ops.count(o))
    return f"regs {regs.group(1) if regs else '?'} stack {stack.group(1) if stack else '?'} | loop: {mix}"


def compile_only(batches: tuple[int, ...], quick: bool) -> None:
    print(f"triton {triton.__version__}, sm_90, K = 4096 (fp16 weights)")
    for b in batches:
        for cfg in configs_for(b, quick):
            try:
                summary = _sass_summary(_build(b, 4096, cfg).asm["cubin"])
            except Exception as e:  # report every config
                summary = f"FAILED {type(e).__name__}: {str(e)[:200]}"
            print(f"  B={b:2d} {label(cfg)}  {summary}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    ap.add_argument("--quick", action="store_true", help="defaults + a few alternatives only")
    ap.add_argument("--list", action="store_true", help="print shapes and configs, run nothing")
    ap.add_argument("--compile-only", action="store_true", help="sm_90 builds of the configs, no GPU needed")
    args = ap.parse_args()
    batches = tuple(int(v) for v in args.b.split(","))
    if args.list:
        for name, n, k, count in SHAPES:
            print(f"{name:10s} N={n:5d} K={k:5d} x{count} per step")
        for b in batches:
            print(f"B={b}: " + "; ".join(label(c) for c in configs_for(b, args.quick)))
        return
    if args.compile_only:
        compile_only(batches, args.quick)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_side: needs a CUDA GPU (use --list to see the shapes and configs)")
    run(batches, args.quick)


if __name__ == "__main__":
    main()
