"""Prefill routed experts at Flash shapes: the "fused" grouped GEMM (dequant in the k loop) vs "dequant"
(dequant_experts into a bf16 scratch + a dense bf16 grouped GEMM), ds4.kernels.matmul.PREFILL_MOE.

On the H200:  PYTHONPATH=. python3 tools/gpu/bench_prefill_moe.py [--quick]       (~2-4 minutes; --quick:
                                                                                    defaults only)
Anywhere:     PYTHONPATH=. python3 tools/gpu/bench_prefill_moe.py --compile-only  (sm_90 build: registers,
                                                                                    16-byte stores, wgmma)
              PYTHONPATH=. python3 tools/gpu/bench_prefill_moe.py --dry           (CPU, Triton interpreter,
                                                                                    tiny shapes: runs every
                                                                                    code path once)

One 4,096-token chunk of one layer: T tokens x 6 distinct experts each out of 256 (random, as a router picks
them), gate/up IQ2_XXS [256, 2048, 4096], down Q2_K [256, 4096, 2048], x bf16. Timed with
triton.testing.do_bench (median ms, L2 flushed between runs):
  * block: gate+up + SwiGLU + router weight, then down: the sequence of ds4.model.cuda.experts._slot_outputs
    without the gather/scatter, on the paths "fused" (two moe_grouped, SwiGLU in torch), "dequant-pair"
    (moe_grouped_pair, SwiGLU in torch) and "dequant" (moe_swiglu_grouped: SwiGLU in the GEMM epilogue);
    TFLOP/s = 2 * rows * N * K summed over the three matrices / time;
  * parts of the dequant path: dequant_experts of every expert of a stack (GB/s = bf16 bytes written + packed
    bytes read), the dense GEMM alone on a scratch already dequantized (TFLOP/s), and tile sweeps of both
    (DEQ_ROWS / DEQ_TK / DEQ_WARPS; GROUPED_DENSE);
  * the block with smaller scratch groups (DEQUANT_BYTES 512 .. 32 MiB);
  * checks: max |dequant - fused| / max |fused| per matrix (same bf16 operands: ~1e-6 expected).
Prints one line per measurement; the prefill time of 43 layers x 2 chunks is 86 x the block time.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

DRY = "--dry" in sys.argv
if DRY:  # must be set before ds4.kernels (and its @triton.jit kernels) is imported
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402

from ds4.kernels import matmul  # noqa: E402
from ds4.kernels.packing import pack  # noqa: E402
from ds4.quant import GGMLType, random_blocks  # noqa: E402

IQ2, Q2K = GGMLType.IQ2_XXS, GGMLType.Q2_K
E, TOPK, K, F, T = 256, 6, 4096, 2048, 4096
if DRY:  # tiny (row lengths stay multiples of 256 for the K-quants); the interpreter is slow
    E, TOPK, K, F, T = 2, 1, 256, 256, 8
CLAMP = 10.0
DENSE_SWEEP = [
    matmul.DenseConfig(128, 128, 64, 8, 3),
    matmul.DenseConfig(128, 128, 64, 8, 3, loop=True, waves=2),
    matmul.DenseConfig(128, 128, 64, 8, 3, loop=True, waves=4),
    matmul.DenseConfig(128, 128, 64, 4, 3),
    matmul.DenseConfig(128, 128, 64, 8, 4),
    matmul.DenseConfig(64, 128, 64, 4, 4),
    matmul.DenseConfig(64, 256, 64, 8, 3),
    matmul.DenseConfig(128, 256, 64, 8, 3),
    matmul.DenseConfig(128, 128, 128, 8, 2),
]
DEQ_SWEEP = [(16, 256, 4), (8, 512, 4), (32, 256, 8), (16, 512, 8), (4, 1024, 4), (32, 512, 8)]
if DRY:  # every code path once, not every tile
    DENSE_SWEEP, DEQ_SWEEP = [matmul.DenseConfig(32, 32, 64, 4, 1)], [(16, 256, 4), (8, 256, 4)]
    matmul.GROUPED_DENSE = DENSE_SWEEP[0]


def say(line: str) -> None:
    print(line, flush=True)


def bench_ms(fn) -> float:
    """Median ms of fn (do_bench on CUDA; one timed call under the interpreter, for --dry)."""
    if DRY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median"))


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def build(dev: torch.device, gen: torch.Generator):
    def packed(qtype, shape):
        return pack(random_blocks(qtype, shape, std=0.02, generator=gen), qtype, shape)

    gate, up, down = packed(IQ2, (E, F, K)), packed(IQ2, (E, F, K)), packed(Q2K, (E, K, F))
    ids = torch.rand(T, E, device=dev, generator=gen).argsort(1)[:, :TOPK]  # [T, 6] distinct experts
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device=dev)
    offsets[1:] = torch.bincount(flat, minlength=E).cumsum(0)
    x = torch.randn(T, K, device=dev, generator=gen).bfloat16()
    xs = x[order // TOPK].contiguous()  # [T*6, K] rows grouped by expert
    rw = torch.rand(T * TOPK, 1, device=dev, generator=gen)
    return gate, up, down, offsets, xs, rw


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    g, u = g.clamp(max=CLAMP), u.clamp(-CLAMP, CLAMP)
    return torch.nn.functional.silu(g) * u


def block(path: str, gate, up, down, offsets, xs, rw) -> torch.Tensor:
    """The expert block of one chunk on one path: [T*6, K] f32 (unscattered). Paths: "fused" (the old
    sequence), "dequant-pair" (gate+up in one GEMM, SwiGLU in torch), "dequant" (SwiGLU in the GEMM's
    epilogue: moe_swiglu_grouped, what ds4.model.cuda.experts runs)."""
    matmul.PREFILL_MOE = path.split("-")[0]
    if path == "fused":
        g, u = matmul.moe_grouped(xs, gate, offsets), matmul.moe_grouped(xs, up, offsets)
        mid = swiglu(g, u) * rw
    elif path == "dequant-pair":
        g, u = matmul.moe_grouped_pair(xs, gate, up, offsets)
        mid = swiglu(g, u) * rw
    else:
        mid = matmul.moe_swiglu_grouped(xs, gate, up, offsets, rw[:, 0], CLAMP)
    return matmul.moe_grouped(mid.bfloat16(), down, offsets)


def main() -> None:
    if "--compile-only" in sys.argv:
        compile_only()
        return
    dev = torch.device("cuda" if torch.cuda.is_available() and not DRY else "cpu")
    gen = torch.Generator(dev).manual_seed(0)
    quick = "--quick" in sys.argv
    t0 = time.time()
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (interpreter)"
    say(f"{name}  torch {torch.__version__}  triton {triton.__version__}  PREFILL_MOE={matmul.PREFILL_MOE}")
    gate, up, down, offsets, xs, rw = build(dev, gen)
    rows = xs.shape[0]
    used = int((offsets[1:] > offsets[:-1]).sum())
    groups = (
        f"{matmul.scratch_experts(E, 2 * F, K)} experts of gate+up, {matmul.scratch_experts(E, K, F)} of down"
    )
    say(f"T={T} x {TOPK} = {rows} rows over {used}/{E} experts; built in {time.time() - t0:.1f} s; "
        f"DEQUANT_BYTES={matmul.DEQUANT_BYTES / 2**30:.2f} GiB: {groups} per group")  # fmt: skip
    flop = 2 * rows * (2 * F * K + K * F)

    # checks: dequant vs fused on the same bf16 operands
    outs = {}
    for path in ("fused", "dequant"):
        matmul.PREFILL_MOE = path
        g, u = matmul.moe_grouped_pair(xs, gate, up, offsets)
        outs[path] = (g.clone(), u.clone(), matmul.moe_grouped(xs[:, :F].contiguous(), down, offsets))
    for i, what in enumerate(("gate", "up", "down")):
        err = rel(
            outs["dequant"][i], outs["fused"][i]
        )  # (--dry: ~5e-3, the interpreter's bf16 cast truncates)
        say(f"check {what:4s}: max|dequant - fused| / max|fused| = {err:.2e}")
    mids = {}
    for path in ("fused", "dequant"):
        matmul.PREFILL_MOE = path
        mids[path] = matmul.moe_swiglu_grouped(xs, gate, up, offsets, rw[:, 0], CLAMP)
    say(f"check mid : max|dequant - fused| / max|fused| = {rel(mids['dequant'], mids['fused']):.2e}")
    del outs, mids

    # the block on each path
    for path in ("fused", "dequant-pair", "dequant"):
        ms = bench_ms(lambda p=path: block(p, gate, up, down, offsets, xs, rw))
        tf = flop / ms / 1e9
        say(f"block {path:12s}: {ms:8.3f} ms  {tf:7.1f} TFLOP/s   x 86 (8k prompt): {86 * ms / 1e3:.2f} s")
    matmul.PREFILL_MOE = "dequant"

    # parts of the dequant path
    ids = torch.arange(E, dtype=torch.int32, device=dev)
    for label, w in (("gate IQ2_XXS", gate), ("down Q2_K", down)):
        per = matmul.scratch_experts(E, w.N, w.K)
        buf = torch.empty(per, w.N, w.K, dtype=torch.bfloat16, device=dev)
        sel = ids[:per]
        byts = buf.numel() * 2 + w.nbytes() * per / E
        for rows_, tk, warps in [DEQ_SWEEP[0]] if quick else DEQ_SWEEP:
            matmul.DEQ_ROWS, matmul.DEQ_TK, matmul.DEQ_WARPS = rows_, tk, warps
            ms = bench_ms(lambda w=w, buf=buf, sel=sel: matmul.dequant_experts(w, sel, buf))
            tile = f"rows{rows_} tk{tk} w{warps}"
            say(f"dequant {label} x{per} {tile}: {ms:7.3f} ms  {byts / ms / 1e6:7.1f} GB/s "
                f"({buf.numel() / ms / 1e6:.0f} G weights/s)")  # fmt: skip
        matmul.DEQ_ROWS, matmul.DEQ_TK, matmul.DEQ_WARPS = DEQ_SWEEP[0]
    for label, w, xin in (("gate+up", None, xs), ("down", down, xs[:, :F].contiguous())):
        n_rows, k = (2 * F, K) if w is None else (w.N, w.K)
        per = matmul.scratch_experts(E, n_rows, k)
        scratch = torch.randn(per, n_rows, k, device=dev, generator=gen).bfloat16()
        sub = offsets[: per + 1]  # the first group's experts only: the rows of experts 0 .. per-1
        m = int(sub[-1])
        gemm_flop = 2 * m * n_rows * k
        for cfg in [matmul.GROUPED_DENSE] if quick else DENSE_SWEEP:
            ms = bench_ms(lambda c=cfg, s=scratch, x=xin, o=sub: dense_only(x, s, o, c))
            tf = gemm_flop / ms / 1e9
            say(f"gemm {label:7s} x{per} experts {m} rows {cfg}: {ms:7.3f} ms  {tf:6.1f} TFLOP/s")
    if not quick:  # the whole block with each GEMM tile
        default = matmul.GROUPED_DENSE
        for cfg in DENSE_SWEEP:
            matmul.GROUPED_DENSE = cfg
            ms = bench_ms(lambda: block("dequant", gate, up, down, offsets, xs, rw))
            say(f"block dequant {cfg}: {ms:8.3f} ms")
        matmul.GROUPED_DENSE = default
        # smaller groups: fewer scratch bytes between the dequant and the GEMM (L2: 50 MB), more launches
        default_bytes = matmul.DEQUANT_BYTES
        for mib in (32,) if DRY else (512, 128, 64, 32):
            matmul.DEQUANT_BYTES = mib << 20
            matmul.release_scratch()
            ms = bench_ms(lambda: block("dequant", gate, up, down, offsets, xs, rw))
            say(f"block dequant DEQUANT_BYTES {mib} MiB: {ms:8.3f} ms")
        matmul.DEQUANT_BYTES = default_bytes
    held = sum(t.numel() * 2 for t in matmul._SCRATCH.values())
    say(f"scratch held: {held / 2**20:.0f} MiB; total {time.time() - t0:.0f} s")


def dense_only(x: torch.Tensor, scratch: torch.Tensor, offsets: torch.Tensor, cfg) -> torch.Tensor:
    """The dense grouped GEMM alone: rows of experts 0 .. n-1 (offsets [n+1]) times scratch [n, N, K]."""
    n, nt, k = scratch.shape
    m = x.shape[0]
    out = torch.empty(m, nt, dtype=torch.float32, device=x.device)
    tile_e, tile_r0 = matmul.tile_table(offsets, m, cfg.bm)
    bounds = matmul.group_tiles(offsets, cfg.bm, n)  # one group: all n experts
    n_col = triton.cdiv(nt, cfg.bn)
    n_prog = tile_e.numel()
    if cfg.loop:
        n_prog = max(1, min(n_prog, triton.cdiv(cfg.waves * matmul._sm_count(x.device), n_col)))
    matmul._grouped_dense_kernel[(n_col, n_prog)](
        x, scratch, out, tile_e, tile_r0, offsets, bounds, 0, 0, nt, k, x.stride(0), nt * k, nt, out, 0.0,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, LOOP=cfg.loop, EPI=0, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------------
# --compile-only (any machine, no GPU): sm_90 builds with the ptxas bundled in Triton


def _compile(fn, sig: dict[str, str], consts: dict, warps: int, stages: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {n: sig.get(n, "constexpr") for n in fn.arg_names}
    # pointers and the int arguments that are multiples of 16 at Flash shapes: what Triton specializes on
    ints16 = {"N", "K", "stride_oe", "stride_on", "stride_x", "stride_we", "stride_o"}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if full[n].startswith("*") or n in ints16
    }
    src = ASTSource(fn, signature=full, constexprs=consts, attrs=attrs)
    opts = {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _regs(cubin: bytes) -> str:
    import subprocess
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True)
    return next((t for t in usage.stdout.split() if t.startswith("REG:")), "REG:?")


def compile_only() -> None:
    say(f"triton {triton.__version__}: sm_90 compile of the dequant path's kernels")
    deq_sig = {
        "w0": "*u8",
        "w1": "*i32",
        "w2": "*fp16",
        "w3": "*i64",
        "out_ptr": "*bf16",
        "ids": "*i32",
        "offsets": "*i32",
        "N": "i32",
        "K": "i32",
        "stride_oe": "i64",
        "stride_on": "i64",
    }
    types = {"IQ2_XXS": (16, 8, {}), "Q2_K": (10, 16, {"w1": "*u8", "w3": "*u8"})}
    types["Q4_K"] = (12, 32, {"w1": "*u8", "w3": "*u8"})
    types["Q8_0"] = (8, 32, {"w0": "*i8", "w1": "*fp16", "w2": "*i8", "w3": "*i8"})
    types["BF16"] = (30, 16, {"w0": "*bf16", "w1": "*bf16", "w2": "*bf16", "w3": "*bf16"})
    for name, (qt, grp, sig) in types.items():
        for rows, tk, warps in DEQ_SWEEP if name in ("IQ2_XXS", "Q2_K") else DEQ_SWEEP[:1]:
            consts = {"QT": qt, "BR": rows, "G": tk // grp, "W": grp, "SKIP": True, "SOFT_RNE": False}
            try:
                k = _compile(matmul._dequant_kernel, {**deq_sig, **sig}, consts, warps, 1)
            except Exception as exc:  # noqa: BLE001 - report every kernel
                say(
                    f"  dequant {name:7s} rows{rows} tk{tk} w{warps}: FAILED {type(exc).__name__}: {exc}"[
                        :500
                    ]
                )
                continue
            ptx = k.asm["ptx"]
            stores = f"16-byte stores {ptx.count('st.global.v4')}, 2-byte stores {ptx.count('st.global.b16')}"
            say(f"  dequant {name:7s} rows{rows:3d} tk{tk:5d} w{warps}: {_regs(k.asm['cubin']):8s} {stores}")
    gemm_sig = {
        "x_ptr": "*bf16",
        "w_ptr": "*bf16",
        "out_ptr": "*fp32",
        "tile_e": "*i32",
        "tile_r0": "*i32",
        "offsets": "*i32",
        "group_tiles": "*i32",
        "g": "i32",
        "e_lo": "i32",
        "N": "i32",
        "K": "i32",
        "stride_x": "i32",
        "stride_we": "i64",
        "stride_o": "i32",
        "rw_ptr": "*fp32",
        "clamp": "fp32",
    }
    for cfg, epi in [(c, 0) for c in DENSE_SWEEP] + [(c, 1) for c in DENSE_SWEEP[:2]]:
        consts = {"BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk, "LOOP": cfg.loop, "EPI": epi}
        try:
            k = _compile(matmul._grouped_dense_kernel, gemm_sig, consts, cfg.warps, cfg.stages)
        except Exception as exc:  # noqa: BLE001
            say(f"  gemm EPI {epi} {cfg}: FAILED {type(exc).__name__}: {exc}"[:500])
            continue
        ptx = k.asm["ptx"]
        say(f"  gemm EPI {epi} {cfg}: {_regs(k.asm['cubin'])} wgmma {ptx.count('wgmma.mma_async')}, "
            f"cp.async {ptx.count('cp.async')}, shared {k.metadata.shared} B")  # fmt: skip


if __name__ == "__main__":
    main()
