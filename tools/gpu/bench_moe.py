"""Routed-expert decode kernels at Flash shapes: current (f32 dequant) vs integer (MoeConfig.int8), the latter
with one activation plane (terms 1, plain Q8_K) and two (terms 2, + residual plane: the default).

On the H200:  PYTHONPATH=. python3 tools/gpu/bench_moe.py [out_dir]          (~3 minutes, ~37 compiles)
              PYTHONPATH=. python3 tools/gpu/bench_moe.py --quick [out_dir]  (< 90 s: B = 1, 4; the int8
              default vs the session-4 variants (prefetch, sign_math, gather, k-splits); a verdict per B)
Anywhere:     PYTHONPATH=. python3 tools/gpu/bench_moe.py --compile-only     (sm_90 build, SASS per weight
              and per instruction class, for the defaults and every variant)

Flash widths (K = 4096, F = 2048, 256 experts, 6 per row), IQ2_XXS gate/up and Q2_K down, random valid blocks
built on the GPU (ds4.quant.random_blocks + ds4.kernels.packing.pack), B = 1, 4, 8, 32 rows.
  * checks (8-expert stacks, ids % 8, fresh random x / mid): max |diff| / max |ref| of every variant against
    the f32 reference (ref.moe_gate_up / moe_down on exactly dequantized weights) and of the int8 variants
    against their integer twin (ref.moe_gate_up_q8k / moe_down_q8k with the variant's terms);
  * timing: L layers' stacks (different random experts per layer), one CUDA graph per variant that runs the
    op once per layer (L calls: the ~42 MB of selected-expert bytes of one layer is below the 50 MB L2, the
    rotation over L layers is not), replayed R times and timed with CUDA events: median us per call. The
    int8 times include quantizing x (gate/up) or mid (down). TB/s = packed bytes of the distinct experts the
    call reads (DRAM minimum) / time. Per B, the best int8 tile of each terms value (t1 / t2) is summed per
    layer next to the current kernels: the cost of the second plane at equal tiles reads off the t1 / t2 rows
    of the same bn and warps.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from gpu_timing import median_us  # noqa: E402

from ds4.kernels import moe, ref  # noqa: E402
from ds4.kernels.packing import pack  # noqa: E402
from ds4.quant import GGMLType, random_blocks  # noqa: E402

IQ2, Q2K = GGMLType.IQ2_XXS, GGMLType.Q2_K
E, TOPK, K, F = 256, 6, 4096, 2048
LAYERS, REPS, WARMUP = 6, 25, 3
BATCHES = (1, 4, 8, 32)
QUICK = "--quick" in sys.argv
CLAMP = 10.0


def label(cfg: moe.MoeConfig) -> str:
    """Short name of an int8 config: tile, warps, k-splits, prefetch, sign masks, gather, terms ('t2' / 't1'
    last: the per-terms summary groups on it)."""
    extra = (f" s{cfg.splits}" if cfg.splits > 1 else "") + (" pf" if cfg.prefetch else "")
    extra += (
        (" fix" if cfg.fixup else "")
        + (" math" if cfg.sign_math else "")
        + (" smem" if cfg.gather else "")
        + (" g16" if cfg.grid16 else "")
        + (" prmt" if cfg.prmt else "")
        + (" lds" if cfg.lds else "")
        + (f" st{cfg.stages}" if cfg.stages else "")
        + (" gsum" if cfg.gsum else "")
        + ("" if cfg.dp4a else " int32")
    )
    return f"int8 bn{cfg.bn} w{cfg.warps}{extra} t{cfg.terms}"


def _int8_variants(tiles) -> list[tuple[str, moe.MoeConfig]]:
    """(label, config) of int8 variants from (bn, warps, dp4a, terms) tuples."""
    return [
        (label(c), c) for c in (moe.MoeConfig(bn, 1, w, int8=True, dp4a=d, terms=t) for bn, w, d, t in tiles)
    ]


def _new(**kw) -> moe.MoeConfig:
    return moe.MoeConfig(int8=True, **kw)


# Session-4 variants aimed at B <= 4 (see the analysis in ds4/kernels/moe.py): more weight bytes in flight per
# program (prefetch), no sign-mask gather (sign_math), table lookups in shared memory instead of L1 (gather),
# more programs (k-splits, smaller tiles).
GU_NEW = [
    _new(bn=16, prefetch=True),
    _new(bn=16, sign_math=True),
    _new(bn=16, gather=True),
    _new(bn=16, gather=True, sign_math=True),
    _new(bn=16, gather=True, prefetch=True),
    _new(bn=16, gather=True, sign_math=True, prefetch=True),
    _new(bn=8, prefetch=True),
    _new(bn=8, gather=True, sign_math=True, prefetch=True),
    _new(bn=16, splits=2, prefetch=True),
    _new(bn=32, warps=8, gather=True, sign_math=True, prefetch=True),
    _new(bn=16, sign_math=True, prefetch=True),
    _new(bn=16, warps=8, prefetch=True),  # 8 warps: half the prefetched registers per thread
    _new(bn=16, warps=8, gather=True, prefetch=True),
    _new(bn=16, sign_math=True, grid16=True),  # session 7: the grid as 16-bit codes (512-byte table)
    _new(bn=16, grid16=True),
    _new(bn=16, prmt=True),  # nibble tables + byte permutes (signed bytes in 2 PRMT per group)
    _new(bn=16, prmt=True, sign_math=True),  # session 8: the sign nibbles computed, one gather per group
    _new(bn=16, prmt=True, prefetch=True),  # session 8: barrier-free loop, prefetch at 71 registers (was 116)
    _new(bn=8, prmt=True),
    _new(bn=32, warps=8, prmt=True),
    _new(bn=16, prmt=True, grid16=True),  # session 14: the permutes from the 16-bit codes (512 B table)
    _new(bn=16, prmt=True, grid16=True, sign_math=True),
    _new(bn=16, prmt=True, lds=True),  # session 16: both nibble tables in static shared memory (ld.shared)
    _new(bn=16, prmt=True, lds=True, sign_math=True),
    _new(bn=8, prmt=True, lds=True),
]
DN_NEW = [
    _new(bn=64, prefetch=True),
    _new(bn=32, prefetch=True),
    _new(bn=16, prefetch=True),
    _new(bn=64, splits=2),
    _new(bn=32, splits=2, prefetch=True),
    _new(bn=64, splits=2, prefetch=True),
    _new(bn=64, warps=8, prefetch=True),
    _new(bn=64, fixup=True),  # the k-slot sum in the kernel: one launch less
    _new(bn=64, prefetch=True, fixup=True),
    _new(bn=32, prefetch=True, fixup=True),
]
_OLD_INT8_GU = [(8, 4, True, 2), (16, 4, True, 2), (32, 4, True, 2), (32, 8, True, 2), (16, 4, False, 2)] + [
    (16, 4, True, 1)
]
_OLD_INT8_DN = [(16, 4, True, 2), (32, 4, True, 2), (64, 4, True, 2), (64, 8, True, 2), (32, 4, False, 2)] + [
    (64, 4, True, 1)
]
GU = [("current", replace(moe.GATE_UP, int8=False))] + _int8_variants(_OLD_INT8_GU)
DOWN = [("current", replace(moe.DOWN, int8=False))] + _int8_variants(_OLD_INT8_DN)
_GU_DEF, _DN_DEF = replace(moe.GATE_UP, int8=True), replace(moe.DOWN, int8=True)  # the engine's defaults
# --quick: the variants most likely to win (each costs a JIT compile of ~2 s on the H200 machine)
GU_QUICK = [0, 1, 2, 3, 5, 6, 11, 12, 20, 21]  # pf, math, smem, smem math, smem math pf, bn8 pf, w8 pf,
# w8 smem pf, prmt g16 (masks / math)
DN_QUICK = [0, 1, 3, 6, 7, 8]  # bn64 pf, bn32 pf, bn64 s2, bn64 w8 pf, bn64 fix, bn64 pf fix
# --latest (session 20): gate/up with each sub-block's group sums added before its scaling (MoeConfig.gsum;
# sm_90 k loop 239 -> 218 instructions, with prefetch 259 -> 244), also with prefetch; down unchanged
GU_LATEST = [replace(_GU_DEF, gsum=True), replace(_GU_DEF, gsum=True, prefetch=True)]
DN_LATEST: list[moe.MoeConfig] = []
if "--latest" in sys.argv:
    QUICK, BATCHES = True, (1, 4)
    GU = [("default " + label(_GU_DEF), _GU_DEF)] + [(label(c), c) for c in GU_LATEST]
    DOWN = [("default " + label(_DN_DEF), _DN_DEF)] + [(label(c), c) for c in DN_LATEST]
elif QUICK:  # the int8 default first, then the new variants
    BATCHES = (1, 4)
    GU = [("default " + label(_GU_DEF), _GU_DEF)] + [(label(GU_NEW[i]), GU_NEW[i]) for i in GU_QUICK]
    DOWN = [("default " + label(_DN_DEF), _DN_DEF)] + [(label(DN_NEW[i]), DN_NEW[i]) for i in DN_QUICK]
else:
    GU += [(label(c), c) for c in GU_NEW]
    DOWN += [(label(c), c) for c in DN_NEW]
DEV = torch.device("cuda")
GEN: torch.Generator  # seeded in main()
LOG: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)


def packed(qtype, shape):
    return pack(random_blocks(qtype, shape, std=0.02, generator=GEN), qtype, shape)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def rand_ids(b: int) -> torch.Tensor:
    """[b, 6] int32: distinct experts per row, as a router picks them."""
    return torch.rand(b, E, device=DEV, generator=GEN).argsort(1)[:, :TOPK].int().contiguous()


def time_calls(calls) -> tuple[float, str]:
    """Median seconds per call of the list `calls` (run in order), from a CUDA graph of all of them."""
    for c in calls:  # compile, warm up allocator
        c()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        run, how = graph.replay, "graph"
    except Exception as exc:  # noqa: BLE001 - report and time eagerly instead
        say(f"    (graph capture failed: {type(exc).__name__}: {exc}; timing eager launches)")

        def run():
            for c in calls:
                c()

        how = "eager"
    return median_us(run, REPS, WARMUP) * 1e-6 / len(calls), how


def check(b: int, small) -> dict[str, tuple[float, float | None]]:
    """{'gu|dn label': (err vs f32 ref, err vs int twin or None)}; a variant that raises is reported and left
    out."""
    wg, wu, wd = small
    ids = rand_ids(b) % 8
    x = torch.randn(b, K, device=DEV, generator=GEN)
    mid = torch.randn(b, TOPK, F, device=DEV, generator=GEN)
    rw = torch.rand(b, TOPK, device=DEV, generator=GEN)
    want_gu, want_d = ref.moe_gate_up(x, wg, wu, ids, CLAMP), ref.moe_down(mid, rw, wd, ids)
    twin_gu = {t: ref.moe_gate_up_q8k(x, wg, wu, ids, CLAMP, t) for t in (1, 2)}
    twin_d = {t: ref.moe_down_q8k(mid, rw, wd, ids, t) for t in (1, 2)}
    out: dict[str, tuple[float, float | None]] = {}
    for op, variants in (("gu", GU), ("dn", DOWN)):
        for label, cfg in variants:
            try:
                if op == "gu":
                    got, want, twin = moe.moe_gate_up(x, wg, wu, ids, CLAMP, cfg), want_gu, twin_gu[cfg.terms]
                else:
                    got, want, twin = moe.moe_down(mid, rw, wd, ids, cfg), want_d, twin_d[cfg.terms]
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - one broken variant must not hide the others
                say(f"  {op} {label}: FAILED: {type(exc).__name__}: {str(exc)[:600]}")
                continue
            out[f"{op} {label}"] = (rel_err(got, want), rel_err(got, twin) if cfg.int8 else None)
    return out


# ---------------------------------------------------------------------------------------------------------
# --compile-only (any machine, no GPU): compile the kernels for sm_90 with the ptxas bundled in Triton, count
# the SASS instructions of their k loop per weight (per thread per iteration / weights a thread covers).

_GU_SIG = {"gq": "*u8", "gs": "*u8", "gd": "*fp16", "uq": "*u8", "us": "*u8", "ud": "*fp16"}
_COMMON_GU = {
    "ids_ptr": "*i32",
    "out_ptr": "*fp32",
    "n_slots": "i32",
    "F": "i32",
    "K": "i32",
    "xplane": "i32",
    "clamp": "fp32",
}


def _compile(fn, sig: dict[str, str], consts: dict, warps: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {n: sig.get(n, "constexpr") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if full[n].startswith("*")}
    src = ASTSource(fn, signature=full, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


_CLASSES = {  # SASS base opcode -> class, for the per-weight breakdown of --compile-only
    **dict.fromkeys(("LDG", "LDS", "LD", "LDGSTS", "LDSM"), "ld"),
    **dict.fromkeys(("IDP", "IDP4A"), "dp4a"),
    **dict.fromkeys(
        (
            "IMAD",
            "IADD3",
            "LOP3",
            "SHF",
            "SHL",
            "SHR",
            "IMNMX",
            "VIMNMX",
            "ISETP",
            "LEA",
            "PRMT",
            "SEL",
            "IABS",
            "VIADD",
            "IMUL",
            "POPC",
            "IADD",
            "LOP",
        ),
        "int",
    ),  # fmt: skip
    **dict.fromkeys(
        (
            "FFMA",
            "FMUL",
            "FADD",
            "FMNMX",
            "FSETP",
            "FSEL",
            "I2F",
            "F2I",
            "F2F",
            "HADD2",
            "HFMA2",
            "I2FP",
            "F2FP",
            "MUFU",
        ),
        "fp",
    ),  # fmt: skip
    "BAR": "bar",
}


def _sass_loop(cubin: bytes) -> tuple[str, list[str]]:
    """(register line, base opcodes of the longest backward-branch loop: the k loop)."""
    import re
    import subprocess
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
        usage = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    regs = next((t for t in usage.split() if t.startswith("REG:")), "REG:?")
    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\d+\s+)?([A-Z0-9_]+)(.*)", line)
        if m:
            ops.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = []
    for addr, op, rest in ops:
        tgt = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if tgt and int(tgt.group(1), 16) < addr:
            loops.append((int(tgt.group(1), 16), addr))
    if not loops:
        return regs, []
    lo, hi = max(loops, key=lambda ab: ab[1] - ab[0])  # the k loop (FIXUP adds a short split-sum loop)
    return regs, [op for addr, op, _ in ops if lo <= addr <= hi]


def _int8_runs(quick: bool) -> list[tuple]:
    """(label, kernel, signature, constexprs, warps, weights per loop step) of the int8 kernels: the engine's
    defaults and the session-4 variants, plus (not quick) the older tiles and the plain-int32 forms."""
    gu_sig = {
        "xw_ptr": "*i64",
        "dx_ptr": "*fp32",
        "tab64": "*i64",
        "ksm": "*i64",
        "kt_per_split": "i32",
        **_GU_SIG,
        **_COMMON_GU,
    }
    dn_sig = {
        "xw_ptr": "*i32",
        "dx_ptr": "*fp32",
        "qw": "*i32",
        "sc": "*u8",
        "dm": "*fp16",
        "ids_ptr": "*i32",
        "rw_ptr": "*fp32",
        "out_ptr": "*fp32",
        "D": "i32",
        "F": "i32",
        "E": "i32",
        "xplane": "i32",
        "kt_per_split": "i32",
    }
    gu = [_GU_DEF, *GU_NEW]
    dn = [_DN_DEF, *DN_NEW]
    if not quick:
        gu += [moe.MoeConfig(bn, 1, w, int8=True, dp4a=d, terms=t) for bn, w, d, t in _OLD_INT8_GU]
        dn += [moe.MoeConfig(bn, 1, w, int8=True, dp4a=d, terms=t) for bn, w, d, t in _OLD_INT8_DN]
    runs = []
    for c in gu:
        consts = {"BN": c.bn, "CLAMP": True, "SPLIT": c.splits > 1, "TERMS": c.terms, "DP4A": c.dp4a}
        consts |= {"SIGN_MATH": c.sign_math, "PREFETCH": c.prefetch, "GATHER": c.gather, "LDS": c.lds}
        weights = 2 * c.bn * 256
        sig = gu_sig | {"tab64": "*i16"} if c.grid16 else gu_sig
        sig = sig | {"tab64": "*i16" if c.grid16 else "*i32", "ksm": "*i32"} if c.prmt else sig
        runs.append((f"gu {label(c)}", moe._iq2_q8k_gate_up_kernel, sig, consts, c.warps, weights))
        if c is _GU_DEF:  # session 31: the stacks in the quad layout (moe._iq2_q8k_qp)
            qp_sig = sig | {"gq": "*i32", "gs": "*i32", "uq": "*i32", "us": "*i32"}
            runs.append((f"gu {label(c)} qp", moe._iq2_q8k_gate_up_kernel, qp_sig, consts | {"QP": True},
                         c.warps, weights))  # fmt: skip
    for c in dn:
        consts = {"BN": c.bn, "TERMS": c.terms, "DP4A": c.dp4a, "PREFETCH": c.prefetch, "FIXUP": c.fixup}
        if c.fixup:
            sig = dn_sig | {"sum_ptr": "*fp32", "cnt_ptr": "*i32", "n_slots": "i32"}
        else:
            sig, consts = dn_sig, consts | {"sum_ptr": None, "cnt_ptr": None, "n_slots": 1}
        runs.append((f"dn {label(c)}", moe._q2k_q8k_down_kernel, sig, consts, c.warps, c.bn * 256))
    return runs


def _f32_runs() -> list[tuple]:
    """The f32 dequant kernels ("current" of the full bench) at their tiles, for comparison."""
    from ds4.kernels.matvec import sub_width

    w_iq2 = pack(random_blocks(IQ2, (1, 256), std=0.02, generator=torch.Generator()), IQ2, (1, 256))
    w_q2k = pack(random_blocks(Q2K, (1, 256), std=0.02, generator=torch.Generator()), Q2K, (1, 256))
    gu_sig = {"x_ptr": "*fp32", "stride_x": "i32", "kt_per_split": "i32", **_COMMON_GU}
    gu_sig |= {f"{m}{i}": t for m in "gu" for i, t in enumerate(("*u8", "*i32", "*fp16", "*i64"))}
    dn_sig = {"mid_ptr": "*fp32", "w0": "*u8", "w1": "*u8", "w2": "*fp16", "w3": "*u8", "ids_ptr": "*i32"}
    dn_sig |= {"rw_ptr": "*fp32", "out_ptr": "*fp32", "D": "i32", "F": "i32", "kt_per_split": "i32"}
    runs = []
    for bn, w in ((8, 4), (16, 4), (32, 8)):
        consts = {"QT": 16, "BN": bn, "TK": 256, "SW": sub_width(w_iq2, 256), "CLAMP": True, "SPLIT": False}
        runs.append((f"gu current bn{bn} w{w}", moe._gate_up_kernel, gu_sig, consts, w, 2 * bn * 256))
    for bn, w in ((32, 4), (64, 4)):
        consts = {"QT": 10, "BN": bn, "TK": 256, "SW": sub_width(w_q2k, 256)}
        runs.append((f"dn current bn{bn} w{w}", moe._down_kernel, dn_sig, consts, w, bn * 256))
    return runs


def compile_only() -> None:
    """Every kernel variant compiled for sm_90; per variant: registers, the innermost loop's instructions per
    thread and per weight (weights a thread covers per loop step), split by class (ld = LDG/LDS, dp4a = IDP,
    int / fp ALU, bar), and the B = 1 launch: programs and resident programs per SM (register limit)."""
    say(f"triton {triton.__version__}: sm_90 compile, SASS of the k loop per weight{' (int8 only)' * QUICK}")
    runs = _int8_runs(QUICK) + ([] if QUICK else _f32_runs())
    say(f"  {'kernel':33s} {'regs':8s} {'loop':>4s} {'/wt':>5s}  per weight: ld dp4a int fp | bar | B=1 "
        f"programs (per SM resident max)")  # fmt: skip
    for name, fn, sig, consts, warps, weights in runs:
        try:
            regs, body = _sass_loop(_compile(fn, sig, consts, warps).asm["cubin"])
        except Exception as exc:  # noqa: BLE001 - report every kernel
            say(f"  {name:33s} FAILED: {type(exc).__name__}: {str(exc)[:400]}")
            continue
        per_thread = weights / (32 * warps)  # weights one thread covers per loop step
        cls = {c: 0 for c in ("ld", "dp4a", "int", "fp", "bar")}
        for op in body:
            if op in _CLASSES:
                cls[_CLASSES[op]] += 1
        per = len(body) / per_thread if body else float("nan")
        split = " ".join(f"{cls[c] / per_thread:4.2f}" for c in ("ld", "dp4a", "int", "fp"))
        n_rows = F if name.startswith("gu") else K
        progs = triton.cdiv(n_rows, consts["BN"]) * TOPK * _splits_of(name)
        r = int(regs.split(":")[1]) if regs[4:].isdigit() else 0
        resident = min(65536 // max(1, r * 32 * warps), 64 // warps, 32) if r else 0
        say(f"  {name:33s} {regs:8s} {len(body):4d} {per:5.2f}  {split} | {cls['bar']:2d} | {progs:5d} "
            f"({progs / 132:.1f}/SM, max {resident})")  # fmt: skip


def _splits_of(name: str) -> int:
    """k-splits of a label ('... s2 ...': 2; none: 1)."""
    return next((int(t[1:]) for t in name.split() if t[0] == "s" and t[1:].isdigit()), 1)


def verdict(b: int, rows: dict[str, dict[str, float]], best: dict) -> None:
    """One line: the fastest two-term gate+up and down configs at this B vs the engine's int8 defaults."""
    picks = []
    for op, default in (("gu", label(_GU_DEF)), ("dn", label(_DN_DEF))):
        t2 = {k: v for k, v in rows[op].items() if k.endswith(" t2") and "int32" not in k}
        dflt = next((v for k, v in t2.items() if k in (default, "default " + default)), None)
        if not t2 or dflt is None:
            say(f"  verdict B = {b}: no {op} numbers (default or all variants failed)")
            return
        pick = min(t2, key=t2.get)
        picks.append((op, pick.removeprefix("default "), t2[pick], dflt))
    (_, gl, gt, gd), (_, dl, dt, dd) = picks
    say(f"VERDICT B = {b}: gate+up {gl} {gt * 1e6:.1f} us (default {gd * 1e6:.1f}), "
        f"down {dl} {dt * 1e6:.1f} us (default {dd * 1e6:.1f}); "
        f"per layer {(gd + dd) * 1e6:.1f} -> {(gt + dt) * 1e6:.1f} us, "
        f"x43: {(gd + dd) * 43e3:.2f} -> {(gt + dt) * 43e3:.2f} ms/token")  # fmt: skip
    best.setdefault(str(b), {})["verdict"] = {"gate_up": gl, "down": dl, "us": (gt + dt) * 1e6}


def main() -> None:
    if "--compile-only" in sys.argv:
        compile_only()
        return
    global GEN
    GEN = torch.Generator(DEV).manual_seed(0)
    t0 = time.time()
    say(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    layers = [(packed(IQ2, (E, F, K)), packed(IQ2, (E, F, K)), packed(Q2K, (E, K, F))) for _ in range(LAYERS)]
    small = (packed(IQ2, (8, F, K)), packed(IQ2, (8, F, K)), packed(Q2K, (8, K, F)))
    gu_expert = 2 * layers[0][0].nbytes() / E  # gate + up bytes of one expert
    d_expert = layers[0][2].nbytes() / E
    say(f"{LAYERS} layers built in {time.time() - t0:.1f} s; per expert: gate+up {gu_expert / 1e6:.2f} MB, "
        f"down {d_expert / 1e6:.2f} MB")  # fmt: skip
    best: dict[str, dict[str, dict[str, str | float]]] = {}  # B -> t1/t2 -> best tiles and us per layer
    for b in BATCHES:
        if time.time() - t0 > 90:
            say(f"B = {b}: skipped (time budget)")
            continue
        errs = check(b, small)
        ids = [rand_ids(b) for _ in range(LAYERS)]
        x = [torch.randn(b, K, device=DEV, generator=GEN) for _ in range(LAYERS)]
        mid = [torch.randn(b, TOPK, F, device=DEV, generator=GEN) for _ in range(LAYERS)]
        rw = [torch.rand(b, TOPK, device=DEV, generator=GEN) for _ in range(LAYERS)]
        uniq = statistics.mean(len(set(i.reshape(-1).tolist())) for i in ids)  # distinct experts per call
        say(f"B = {b}: {b * TOPK} pairs, {uniq:.1f} distinct experts per layer")
        say(f"  {'kernel':29s} {'us/call':>9s} {'TB/s':>6s}  {'err vs f32 ref':>14s} {'vs int twin':>11s}")
        rows: dict[str, dict[str, float]] = {"gu": {}, "dn": {}}
        for op, variants, nbytes in (("gu", GU, gu_expert), ("dn", DOWN, d_expert)):
            for label, cfg in variants:
                if f"{op} {label}" not in errs:
                    continue  # failed its check
                if op == "gu":
                    calls = [
                        partial(moe.moe_gate_up, x[i], layers[i][0], layers[i][1], ids[i], CLAMP, cfg)
                        for i in range(LAYERS)
                    ]
                else:
                    calls = [
                        partial(moe.moe_down, mid[i], rw[i], layers[i][2], ids[i], cfg) for i in range(LAYERS)
                    ]
                try:
                    t, how = time_calls(calls)
                except Exception as exc:  # noqa: BLE001 - one broken variant must not hide the others
                    say(f"  {op} {label:26s} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                rows[op][label] = t
                e_ref, e_twin = errs[f"{op} {label}"]
                twin = f"{e_twin:11.1e}" if e_twin is not None else " " * 11
                say(f"  {op} {label:26s} {t * 1e6:9.1f} {uniq * nbytes / t / 1e12:6.2f}  {e_ref:14.1e} {twin}"
                    f"{'' if how == 'graph' else ' (eager)'}")  # fmt: skip
        cur = rows["gu"].get("current", 0.0) + rows["dn"].get("current", 0.0)
        for t in () if QUICK else (1, 2):  # --quick: no f32 "current" and no t1 rows, the verdict only
            int8 = {op: {k: v for k, v in r.items() if k.endswith(f" t{t}")} for op, r in rows.items()}
            if all(int8.values()):
                bg = min(int8["gu"], key=int8["gu"].get)
                bd = min(int8["dn"], key=int8["dn"].get)
                new = int8["gu"][bg] + int8["dn"][bd]
                say(f"  per layer: current {cur * 1e6:.1f} us, best int8 t{t} {new * 1e6:.1f} us "
                    f"({bg} / {bd}); x43 layers: {cur * 43e3:.2f} -> {new * 43e3:.2f} ms/token")  # fmt: skip
                best.setdefault(str(b), {})[f"t{t}"] = {"gate_up": bg, "down": bd, "us": new * 1e6}
        verdict(b, rows, best)
    say(f"total {time.time() - t0:.0f} s")
    out = [a for a in sys.argv[1:] if not a.startswith("--")]
    if out:
        Path(out[0]).mkdir(parents=True, exist_ok=True)
        Path(out[0], "bench_moe.txt").write_text("\n".join(LOG) + "\n")
        Path(out[0], "bench_moe.json").write_text(json.dumps(best, indent=1))


if __name__ == "__main__":
    main()
