"""Q8_0 decode matvecs at Flash shapes: split-K summed inside the kernel (matvec.Q8_FIXUP) vs a torch sum.

On the H200:  PYTHONPATH=. python3 tools/gpu/bench_q8.py            (< 90 s)
              PYTHONPATH=. python3 tools/gpu/bench_q8.py --variants   (q8_mv1 code variants, B = 1; < 60 s)
              PYTHONPATH=. python3 tools/gpu/bench_q8.py --rows [--cfgs "w4,bn32 w2"]   (B = 16 / 32 / 64:
              q8_rows vs dense bf16 and its ROW_CFGS variants, or those named)
Anywhere:     PYTHONPATH=. python3 tools/gpu/bench_q8.py --list     (shapes and launch plans; no GPU)
              PYTHONPATH=. python3 tools/gpu/bench_q8.py --compile-only   (sm_90 builds with Triton's bundled
              ptxas: registers, spill stack, atomics, for fixup off and on; q8_mv1's variants with their k
              loop's SASS per weight)

Shapes: the Q8_0 matrices of one Flash decode step ([out N, in K], ds4/layout.py; the engine merges q_a with
kv and the shared expert's gate with up, DS4_MERGE_PACKED): q_a + kv [1024 + 512, 4096], q_b [64 x 512, 1024],
o_a 8 groups of [1024, 4096] (B = 1 only: qmatvec_grouped uses q8_mv1 there; at B > 1 its own kernel, which
has no split-K), o_b [4096, 8192], shared gate + up [2 x 2048, 4096], shared down [4096, 2048], output head
[129280, 4096]; x f32 as the decode step passes it, B = 1 (q8_mv1) and 4 (the B-row tiles).
  * check first (fresh random x, the first weight copy): max |got - twin| / max |twin| of the fixup against
    ref.qmatvec (exact dequantization + f32 matmul), and of the fixup against the torch sum;
  * timing: per (shape, B, fixup off / on) one CUDA graph of L calls on L different weight copies (L = 16;
    4 for the 0.56 GB head, already 11x the 50 MB L2), so each call reads its weights from DRAM as in a
    decode step; the off and on graphs replayed in turn R times each, CUDA events, median us per call;
    GB/s = packed weight bytes / time.
    Shapes with one split show no difference (no sum either way): the control rows.
Columns: S split-K count, MB packed bytes, err twin, vs sum ("=": bit-equal to the torch sum), us and GB/s
with the torch sum (off) and in the kernel (on), on/off time ratio. Last: per decode step (each shape's time
x its count per step) off vs on.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402

from ds4.config import FLASH  # noqa: E402
from ds4.kernels import matvec as mv  # noqa: E402
from ds4.kernels import ref  # noqa: E402
from ds4.kernels.packing import PackedWeight  # noqa: E402
from ds4.quant import GGMLType  # noqa: E402

C = FLASH
L = 16  # weight copies per graph
REPS, WARMUP = 20, 3
BATCHES = (1, 4)
# (label, N, K, groups, calls per decode step): N rows of one group; groups > 1: qmatvec_grouped
SHAPES = [
    ("q_a+kv", C.q_lora_rank + C.head_dim, C.n_embd, 1, C.n_layer),
    ("q_b", C.n_head * C.head_dim, C.q_lora_rank, 1, C.n_layer),
    ("o_a grp", C.o_lora_rank, C.n_head * C.head_dim // C.o_groups, C.o_groups, C.n_layer),
    ("o_b", C.n_embd, C.o_groups * C.o_lora_rank, 1, C.n_layer),
    ("shexp g+u", 2 * C.expert_ff, C.n_embd, 1, C.n_layer),
    ("shexp down", C.n_embd, C.expert_ff, 1, C.n_layer),
    ("head", C.n_vocab, C.n_embd, 1, 1),
]


def splits_of(n: int, k: int, groups: int, b: int) -> int:
    """Split-K count of the launch qmatvec / qmatvec_grouped makes (f32 x)."""
    if b == 1:
        return mv.q8_mv1_plan(n * groups, k, mv.Q8_MV1)[2]
    w = PackedWeight(GGMLType.Q8_0, (n * groups, k), {})
    return mv.qmatvec_plan(b, w, False).grid[2]


def random_q8(n: int, k: int, groups: int, gen: torch.Generator) -> PackedWeight:
    """Random packed Q8_0 ([groups, n, k] if groups > 1): quants in [-127, 127], scales ~ 0.05 / 127 * 3."""
    rows, dev = n * groups, gen.device
    qs = torch.randint(-127, 128, (rows, k), dtype=torch.int8, device=dev, generator=gen)
    d = (torch.rand(rows, k // 32, device=dev, generator=gen) * 2e-3 + 2e-4).half()
    shape = (groups, n, k) if groups > 1 else (n, k)
    return PackedWeight(GGMLType.Q8_0, shape, {"qs": qs, "d": d})


def call(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    if len(w.shape) == 3:
        return mv.qmatvec_grouped(x.view(x.shape[0], w.shape[0], -1), w).flatten(1)
    return mv.qmatvec(x, w)


def capture(calls, setup) -> torch.cuda.CUDAGraph:
    """`calls` (run in order) captured as one CUDA graph after setup() (module switches are read by each
    call, so they are fixed in the graph)."""
    setup()
    for c in calls:  # compile; counters and allocator warm-up outside the capture
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return graph


def _fixup(on: bool):
    def setup():
        mv.Q8_FIXUP = on

    return setup


def time_ways(calls, ways: dict) -> dict:
    """{way: median seconds per call} of `calls` as one graph per way (ways: name -> setup)."""
    return time_graphs({name: (calls, setup) for name, setup in ways.items()})


def time_graphs(ways: dict) -> dict:
    """{way: median seconds per call}, ways: name -> (calls, setup), each captured as one graph; the replays
    alternate between the ways so that clock drift hits all alike."""
    graphs = {name: (capture(calls, setup), len(calls)) for name, (calls, setup) in ways.items()}
    ts: dict = {name: [] for name in ways}
    for i in range(WARMUP + REPS):
        for name, (graph, n) in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            if i >= WARMUP:
                ts[name].append(a.elapsed_time(b) * 1e-3 / n)
    return {name: statistics.median(v) for name, v in ts.items()}


def time_ab(calls) -> dict[bool, float]:
    """{fixup: median seconds per call}, fixup off and on."""
    return time_ways(calls, {fix: _fixup(fix) for fix in (False, True)})


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def check(x: torch.Tensor, w: PackedWeight) -> tuple[float, float, bool]:
    """(fixup vs twin, fixup vs torch sum, bit-equal to the torch sum) on x."""
    mv.Q8_FIXUP = True
    on = call(x, w)
    mv.Q8_FIXUP = False
    off = call(x, w)
    xw = x.view(x.shape[0], w.shape[0], -1) if len(w.shape) == 3 else x
    want = (ref.qmatvec_grouped(xw, w) if len(w.shape) == 3 else ref.qmatvec(x, w)).flatten(1)
    return rel(on, want), rel(on, off), torch.equal(on, off)


def run(dev: torch.device) -> None:
    gen = torch.Generator(dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"{'shape':11s} {'N x K':>16s} B  S {'MB':>6s} | {'err twin':>8s} {'vs sum':>8s} | "
          f"{'off us':>7s} {'GB/s':>6s} | {'on us':>7s} {'GB/s':>6s} | on/off")  # fmt: skip
    step = {b: [0.0, 0.0] for b in BATCHES}  # ms per decode step: off, on
    worst = 0.0
    for label, n, k, groups, count in SHAPES:
        copies = 4 if n * k > 100e6 else L
        ws = [random_q8(n, k, groups, gen) for _ in range(copies)]
        mb = ws[0].nbytes() / 1e6
        for b in BATCHES:
            if groups > 1 and b > 1:
                continue
            x = torch.randn(b, k * groups, device=dev, generator=gen)
            e_twin, e_sum, same = check(torch.randn(b, k * groups, device=dev, generator=gen), ws[0])
            worst = max(worst, e_twin)
            t = time_ab([lambda w=w, x=x: call(x, w) for w in ws])
            dims = f"{groups}x{n}x{k}" if groups > 1 else f"{n}x{k}"
            s = splits_of(n, k, groups, b)
            vs_sum = "=" if same else f"{e_sum:.1e}"  # "=": bit-equal
            cols = [f"{label:11s} {dims:>16s} {b} {s:2d} {mb:6.1f}", f"{e_twin:8.1e} {vs_sum:>8s}"]
            cols += [f"{t[f] * 1e6:7.1f} {mb / t[f] / 1e3:6.0f}" for f in (False, True)]
            print(" | ".join(cols) + f" | {t[True] / t[False]:.3f}", flush=True)
            step[b][0] += t[False] * count * 1e3
            step[b][1] += t[True] * count * 1e3
        del ws
        torch.cuda.empty_cache()
    mv.Q8_FIXUP = True
    print(f"max rel err vs twin {worst:.1e} ({'OK' if worst < 1e-5 else 'ABOVE 1e-5'})")
    for b, (off, on) in step.items():
        print(
            f"per decode step, B={b}: torch sum {off:.3f} ms, in-kernel {on:.3f} ms, saved {off - on:.3f} ms"
        )


# ---------------------------------------------------------------------------------------------------------
# --variants: q8_mv1 code variants (matvec.Q8Config.xdirect / magic) at B = 1, fixup on

VARIANTS = {
    "default": mv.Q8_MV1,
    "xdirect": replace(mv.Q8_MV1, xdirect=True),
    "magic": replace(mv.Q8_MV1, magic=True),  # loads x directly too
    "prefetch": replace(mv.Q8_MV1, prefetch=True),  # first weight tile before pdl_wait()
    "int8": replace(mv.Q8_MV1, int8=True),  # x quantized (2 planes per 32 values), dp4a
    "int8 bn16": replace(mv.Q8_MV1, int8=True, bn=16, tk=256),
    "int8 tk1024": replace(mv.Q8_MV1, int8=True, tk=1024),
    "int8 bn4": replace(mv.Q8_MV1, int8=True, **mv.Q8_INT8_TILE),
    # session 15: long-lived programs from FLAT_MIN_TILES row tiles (sm_90: 96 registers, 5 per SM)
    "flat 528": replace(mv.Q8_MV1, flat=528),
    "flat 660": replace(mv.Q8_MV1, flat=660),
    "flat 1056": replace(mv.Q8_MV1, flat=1056),
    # session 19: the weight tiles by TMA copies into a ring of shared buffers (Q8Config.tma)
    "tma": replace(mv.Q8_MV1, tma=True, **mv.Q8_TMA_TILE),
    "tma bn32": replace(mv.Q8_MV1, tma=True, **{**mv.Q8_TMA_TILE, "bn": 32}),
    "tma bn8": replace(mv.Q8_MV1, tma=True, **{**mv.Q8_TMA_TILE, "bn": 8}),
    "tma s3": replace(mv.Q8_MV1, tma=True, **{**mv.Q8_TMA_TILE, "stages": 3}),
    "tma s6": replace(mv.Q8_MV1, tma=True, **{**mv.Q8_TMA_TILE, "stages": 6}),
    # the same tile and stages with plain loads (cp.async pipelining, registers): TMA's share of any gain
    "pipe bn16 tk256 s4": replace(mv.Q8_MV1, **mv.Q8_TMA_TILE),
    # session 20 (tools/gpu/bench_chain.py: one program a row tile, no split-K, beat q8_mv1 at 4096 x 4096;
    # a chain's bandwidth grows with the bytes in flight): fewer splits, longer k-tiles, more rows
    "target 1056": replace(mv.Q8_MV1, target=1056),
    "target 528": replace(mv.Q8_MV1, target=528),
    "no split": replace(mv.Q8_MV1, target=1),
    "tk1024": replace(mv.Q8_MV1, tk=1024),
    "bn16": replace(mv.Q8_MV1, bn=16),
}
LATEST = ("target", "no split", "tk1024", "bn16")  # this session's variants
if "--latest" in sys.argv:  # the default and those
    VARIANTS = {k: v for k, v in VARIANTS.items() if k == "default" or k.startswith(LATEST)}


HEAD = mv.Q8_HEAD  # the default's head tile (None: Q8_MV1's); the other variants run theirs on the head too


def _variant(cfg: mv.Q8Config):
    def setup():
        mv.Q8_FIXUP, mv.Q8_MV1 = True, cfg
        mv.Q8_HEAD = HEAD if cfg is VARIANTS["default"] else None

    return setup


def run_variants(dev: torch.device) -> None:
    """Per shape: each variant checked against the twin on fresh x, then all timed in alternating graph
    replays (L weight copies each); last lines: per decode step and the VERDICT (fastest step)."""
    gen = torch.Generator(dev).manual_seed(1)
    default = mv.Q8_MV1
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  B=1")
    print(f"{'shape':11s} {'MB':>6s} | " + " | ".join(f"{v:>13s} us GB/s" for v in VARIANTS) + " | err twin")
    step = dict.fromkeys(VARIANTS, 0.0)
    worst = worst8 = 0.0  # f32 variants vs the exact product; int8 ones (x rounded: ~2e-5 expected)
    for label, n, k, groups, count in SHAPES:
        ws = [random_q8(n, k, groups, gen) for _ in range(4 if n * k > 100e6 else L)]
        mb = ws[0].nbytes() / 1e6
        x = torch.randn(1, k * groups, device=dev, generator=gen)
        xc = torch.randn(1, k * groups, device=dev, generator=gen)
        xw = xc.view(1, groups, -1) if groups > 1 else xc
        want = (ref.qmatvec_grouped(xw, ws[0]) if groups > 1 else ref.qmatvec(xc, ws[0])).flatten(1)
        errs = []
        for cfg in VARIANTS.values():
            _variant(cfg)()
            errs.append(rel(call(xc, ws[0]), want))
        pairs = list(zip(errs, VARIANTS.values(), strict=True))
        worst = max([worst] + [e for e, c in pairs if not c.int8])
        worst8 = max([worst8] + [e for e, c in pairs if c.int8])  # none under --latest
        calls = [lambda w=w, x=x: call(x, w) for w in ws]
        t = time_ways(calls, {v: _variant(c) for v, c in VARIANTS.items()})
        cols = [f"{t[v] * 1e6:9.1f} {mb / t[v] / 1e3:6.0f}" for v in VARIANTS]
        print(f"{label:11s} {mb:6.1f} | " + " | ".join(cols) + f" | {max(errs):.1e}", flush=True)
        for v in VARIANTS:
            step[v] += t[v] * count * 1e3
        del ws
        torch.cuda.empty_cache()
    mv.Q8_MV1, mv.Q8_HEAD = default, HEAD
    print(f"max rel err vs twin {worst:.1e} ({'OK' if worst < 1e-5 else 'ABOVE 1e-5'})")
    ok8 = "OK" if worst8 < 1e-4 else "ABOVE 1e-4"
    print(f"int8 variants: max rel err vs the exact product {worst8:.1e} ({ok8})")
    print("per decode step (B = 1): " + ", ".join(f"{v} {ms:.3f} ms" for v, ms in step.items()))
    best = min(step, key=step.get)
    print(f"VERDICT q8_mv1: {best} ({step[best]:.3f} ms vs default {step['default']:.3f} ms per step)")


# ---------------------------------------------------------------------------------------------------------
# --rows: the Q8_0 projections of a batched decode step above 8 rows: matvec.q8_rows (packed blocks, f32
# accurate; the default up to layer.BATCH_QROWS rows) vs the dense bf16 copy's GEMM (F.linear / bmm: the
# path before it) vs the packed bf16 tiles (x rounded to bf16)

ROW_BATCHES = (16, 32, 64)
ROW_CFGS = {  # q8_rows variants timed beside the default (spec: Q8RowsConfig fields, batch_check "rows:")
    "int8": "mode=int8",  # at the default's 2 warps: mma.sync (sm_90 k loop 248 instructions vs tf32x2's 349)
    "int8 bn32": "mode=int8,bn=32",
    "int8 s4": "mode=int8,stages=4",
    "mb16": "min_blocks=16",
    "mb32": "min_blocks=32",
    "mb16 s5": "min_blocks=16,stages=5",
    "mb32 s6": "min_blocks=32,stages=6",
    "bn32 mb16": "bn=32,min_blocks=16",
    "t528": "target=528",
    "bn128 w8": "bn=128,warps=8",  # half the x re-reads per weight byte (sm_90: 87 registers, 157-op loop)
    "bn128 w8 mb16": "bn=128,warps=8,min_blocks=16",
    # session 15: mma.sync (2 warps, now the default: see matvec.Q8_ROWS) against wgmma (4 warps) and others
    "w4": "warps=4",
    "w2 t2112": "warps=2,target=2112",
    "bn32 w2": "bn=32,warps=2",
    "bn32 w1": "bn=32,warps=1",
    "bn32 w2 t2112": "bn=32,warps=2,target=2112",
    "w2 mb16": "warps=2,min_blocks=16",
    # session 29: the block scales as an f32 copy (cp.async-able), row- or block-major; with BN 128
    "f32": "scales=f32",
    "f32t": "scales=f32t",
    "bn128": "bn=128",
    "bn128 f32t": "bn=128,scales=f32t",
    "f32t r144": "scales=f32t,maxnreg=144",  # 7 programs an SM instead of 6 (sm_90: 24 bytes of spill)
}
if "--cfgs" in sys.argv:  # a subset: --cfgs "w4,bn32 w2"
    _pick = sys.argv[sys.argv.index("--cfgs") + 1].split(",")
    ROW_CFGS = {name: ROW_CFGS[name] for name in _pick}


def rows_cfg(spec: str) -> mv.Q8RowsConfig:
    """'field=value,...' -> Q8_ROWS with those fields (ints, or the mode / scales name)."""
    kw = dict(item.split("=") for item in spec.split(","))
    return replace(mv.Q8_ROWS, **{k: v if k in ("mode", "scales") else int(v) for k, v in kw.items()})


def _row_cfg_ways(x: torch.Tensor, ws: list[PackedWeight], nop) -> dict:
    cfgs = {name: rows_cfg(spec) for name, spec in ROW_CFGS.items()}
    return {
        f"q8_rows {name}": ([lambda w=w, c=c: mv.q8_rows(x, w, w.N, c) for w in ws], nop)
        for name, c in cfgs.items()
    }


def _dense(w: PackedWeight, groups: int) -> torch.Tensor:
    return (
        ref._unpack(w).to(torch.bfloat16).reshape(groups, -1, w.K)
        if groups > 1
        else ref._unpack(w).bfloat16()
    )


def _row_ways(x: torch.Tensor, ws: list[PackedWeight], dense: list[torch.Tensor], groups: int) -> dict:
    """name -> (calls, setup) of the three ways over the weight copies."""
    nop = _fixup(True)
    if groups > 1:
        xg = x.view(x.shape[0], groups, -1)
        xt = xg.transpose(0, 1)  # [G, B, K]: layer.grouped_output's bmm

        def bmm(d: torch.Tensor) -> torch.Tensor:
            return torch.bmm(xt.bfloat16(), d.transpose(1, 2)).float()

        return {
            "q8_rows": ([lambda w=w: mv.qmatvec_grouped(xg, w) for w in ws], nop),
            **_row_cfg_ways(x, ws, nop),
            "dense bf16": ([lambda d=d: bmm(d) for d in dense], nop),
            "bf16 tiles": ([lambda w=w: mv.qmatvec_grouped(xg.bfloat16(), w) for w in ws], nop),
        }
    return {
        "q8_rows": ([lambda w=w: mv.qmatvec(x, w) for w in ws], nop),
        **_row_cfg_ways(x, ws, nop),
        "dense bf16": ([lambda d=d: torch.nn.functional.linear(x.bfloat16(), d).float() for d in dense], nop),
        "bf16 tiles": ([lambda w=w: mv.qmatvec(x.bfloat16(), w) for w in ws], nop),
    }


def run_rows(dev: torch.device) -> None:
    """Per shape and B: q8_rows's error vs the twin (and the bf16 ways'), then the three ways timed in
    alternating graph replays; last lines: per decode step (each shape x its count) and the VERDICT."""
    gen = torch.Generator(dev).manual_seed(2)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    names = ("q8_rows", *(f"q8_rows {c}" for c in ROW_CFGS), "dense bf16", "bf16 tiles")
    print(
        f"{'shape':11s}  B {'MB':>6s} | "
        + " | ".join(f"{v:>10s} us" for v in names)
        + " | err q8_rows / bf16"
    )
    step = {b: dict.fromkeys(names, 0.0) for b in ROW_BATCHES}
    worst = 0.0
    for label, n, k, groups, count in SHAPES:
        copies = 2 if n * k > 100e6 else 8
        ws = [random_q8(n, k, groups, gen) for _ in range(copies)]
        dense = [_dense(w, groups) for w in ws]
        mb = ws[0].nbytes() / 1e6
        for b in ROW_BATCHES:
            x = torch.randn(b, k * groups, device=dev, generator=gen)
            xw = x.view(b, groups, -1) if groups > 1 else x
            want = (ref.qmatvec_grouped(xw, ws[0]) if groups > 1 else ref.qmatvec(x, ws[0])).reshape(b, -1)
            ways = _row_ways(x, ws, dense, groups)
            got = {v: ways[v][0][0]().reshape(b, -1).float() for v in names}
            if groups > 1:
                got["dense bf16"] = got["dense bf16"].view(groups, b, n).transpose(0, 1).reshape(b, -1)
            err = {v: rel(got[v], want) for v in names}
            worst = max(worst, err["q8_rows"])
            t = time_graphs(ways)
            cols = [f"{t[v] * 1e6:13.1f}" for v in names]
            errs = f"{err['q8_rows']:.1e} / {err['dense bf16']:.1e}"
            if "int8" in ROW_CFGS:
                errs += f" / int8 {err['q8_rows int8']:.1e}"
            worst_var = max((err[f"q8_rows {c}"] for c in ROW_CFGS if "int8" not in c), default=0.0)
            errs += f" / variants {worst_var:.1e}"
            print(f"{label:11s} {b:2d} {mb:6.1f} | " + " | ".join(cols) + f" | {errs}", flush=True)
            for v in names:
                step[b][v] += t[v] * count * 1e3
        del ws, dense
        torch.cuda.empty_cache()
    print(f"max rel err of q8_rows vs twin {worst:.1e} ({'OK' if worst < 1e-5 else 'ABOVE 1e-5'})")
    for b, ms in step.items():
        print(f"per decode step, B={b}: " + ", ".join(f"{v} {t:.3f} ms" for v, t in ms.items()))
        print(f"VERDICT rows B={b}: q8_rows {ms['q8_rows'] / ms['dense bf16']:.2f} x the dense bf16 time")
        for c in ROW_CFGS:
            print(f"VERDICT rows {c} B={b}: {ms[f'q8_rows {c}'] / ms['q8_rows']:.3f} x the default's time")
    best = min(ROW_CFGS, key=lambda c: step[32][f"q8_rows {c}"])  # B = 32: issue 8's bar
    print(f"BEST32 {ROW_CFGS[best] if step[32][f'q8_rows {best}'] < step[32]['q8_rows'] else 'none'}")


# ---------------------------------------------------------------------------------------------------------
# --list and --compile-only: no GPU needed


def list_plans() -> None:
    for label, n, k, groups, count in SHAPES:
        per_b = ", ".join(
            f"B={b}: {splits_of(n, k, groups, b)} split(s)" for b in BATCHES if groups == 1 or b == 1
        )
        print(f"{label:11s} N={n * groups:6d} K={k:5d} x{count}/step  {per_b}")


_PTR = {"x_ptr": "*fp32", "qs": "*i8", "dsc": "*fp16", "w0": "*i8", "w1": "*fp16", "w2": "*i8", "w3": "*i8"}
_PTR |= {"out_ptr": "*fp32", "sum_ptr": "*fp32", "cnt_ptr": "*i32", "w_ptr": "*fp16"}
_PTR |= {"xq_ptr": "*i32", "dx_ptr": "*fp32"}


# ints that are multiples of 16 at every Flash shape: Triton's launcher specializes such values as divisible
# by 16 (what lets the quant loads vectorize), so the builds here mark them too
_DIV16 = ("N", "K", "NG", "stride_x", "XPLANE")


def _build(fn, consts: dict, warps: int, x_type="*fp32", qs_type="*i8", d_type="*fp16", maxnreg: int = 0):
    """fn compiled for sm_90: pointers 16-byte aligned, ints i32 (_DIV16 divisible by 16), constexprs."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptr = {**_PTR, "x_ptr": x_type, "qs": qs_type, "dsc": d_type}
    sig = {a: "constexpr" if a in consts else ptr.get(a, "i32") for a in fn.arg_names}
    div = [i for i, a in enumerate(fn.arg_names) if a in ptr or (a in _DIV16 and a not in consts)]
    attrs = {(i,): [["tt.divisibility", 16]] for i in div}
    src = ASTSource(fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _usage(cubin: bytes) -> str:
    """Registers, spill stack and global atomics (ATOMG / RED: the fixup's counter) of a cubin."""
    import re
    import subprocess
    import tempfile

    tool = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        use = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+)", use), re.search(r"STACK:(\d+)", use)
    atoms = len(re.findall(r"\b(?:ATOMG|RED)\.", sass))
    return f"regs {regs.group(1) if regs else '?'} stack {stack.group(1) if stack else '?'} atomics {atoms}"


def _loop_summary(cubin: bytes, weights_per_thread: float) -> str:
    """The k loop's SASS instructions per weight a thread covers, by class (bench_moe's classes)."""
    from collections import Counter

    from bench_moe import _CLASSES, _sass_loop

    _, body = _sass_loop(cubin)
    by = Counter(_CLASSES.get(op, "other") for op in body)
    i2f = sum(op == "I2F" for op in body)
    parts = " ".join(f"{c} {n / weights_per_thread:.2f}" for c, n in sorted(by.items()))
    per = len(body) / weights_per_thread
    sts, ldgsts = body.count("STS"), body.count("LDGSTS")  # loads staged by hand vs by cp.async
    staged = f"STS {sts}, LDGSTS {ldgsts}"
    return f"k loop {len(body)} ({per:.2f}/weight: {parts}; I2F {i2f}, BAR {by['bar']}, {staged})"


def compile_only() -> int:
    q8 = mv.Q8_MV1
    tk = 256  # tile_k of every Flash Q8_0 row length in the B-row tiles
    runs = []
    for fix in (False, True):
        for name, cfg in VARIANTS.items() if fix else [("default", q8)]:
            if cfg.tma:  # a descriptor argument: not built here (its sm_90 figures: matvec.Q8_TMA_TILE)
                continue
            consts = {"BN": cfg.bn, "TK": cfg.tk, "STAGES": cfg.stages, "FIXUP": fix}
            consts["PREFETCH"] = cfg.prefetch
            if cfg.int8:
                fn, qs = mv._q8_int_kernel, "*i32"
                consts["DP4A"] = True
            else:
                fn, qs = mv._q8_mv1_kernel, "*i32" if cfg.magic else "*i8"
                consts |= {"XDIRECT": cfg.xdirect, "MAGIC": cfg.magic}
            wpt = cfg.bn * cfg.tk / (32 * cfg.warps)
            label = f"q8_mv1 bn{cfg.bn} tk{cfg.tk} {name}"
            runs.append((label, fn, consts, cfg.warps, "*fp32", qs, wpt))
        for bb, bn, dot, xt in ((1, 16, False, "*fp32"), (4, 4, False, "*fp32"), (16, 32, True, "*bf16")):
            consts = {"QT": 8, "BB": bb, "BN": bn, "TK": tk, "SW": tk, "USE_DOT": dot, "FIXUP": fix}
            runs.append((f"qmv tiles BB{bb} BN{bn}{' dot' * dot}", mv._qmv_kernel, consts, 4, xt, "*i8", 0))
    rows = mv.Q8_ROWS
    # (mode, BB, blocks an iteration, BN, warps) at the f16 scales, no register cap; then the scale copies
    tiles = [(m, bb, 1, rows.bn, rows.warps) for m in mv.Q8_ROWS_MODES for bb in (16, 32, 64)]
    tiles += [("tf32x2", 32, 4, rows.bn, rows.warps), ("int8", 32, 4, rows.bn, rows.warps)]
    tiles += [("tf32x2", bb, 1, bn, w) for bb in (16, 32, 64) for bn, w in ((64, 2), (32, 2), (32, 1))]
    tiles += [("tf32x2", 32, 1, 128, rows.warps)]
    row_builds = [(*t, "f16", 0) for t in tiles]
    row_builds += [("tf32x2", 32, 1, bn, rows.warps, sc, 0) for bn in (64, 128) for sc in ("f32", "f32t")]
    row_builds += [("tf32x2", 32, 1, 64, rows.warps, "f32t", cap) for cap in (128, 144)]
    for mode, bb, nb, bn, warps, scales, cap in row_builds:
        consts = {"BB": bb, "BN": bn, "STAGES": rows.stages, "FIXUP": True, "NB": nb}
        consts |= {"DROW": 1} if scales == "f32t" else {"DKB": 1}  # the stride of 1 the JIT specializes
        wpt = bn * 32 * nb / (32 * warps)
        label = f"q8_rows {mode} BB{bb} BN{bn} NB{nb} w{warps}" + (f" {scales}" if scales != "f16" else "")
        label += f" cap{cap}" if cap else ""
        consts["MODE"] = mode
        x_type = "*i8" if mode == "int8" else "*fp32"  # int8: x's planes
        d_type = "*fp16" if scales == "f16" else "*fp32"
        runs.append((label, mv._q8_rows_kernel, consts, warps, x_type, "*i8", wpt, d_type, cap))
    # _split_fixup's other user
    hmv = {"BB": 8, "BN": 32, "TK": 128, "MODE": 2, "STAGES": 2, "FIXUP": True, "PREFETCH": False}
    runs.append(("hmv tf32x2 (fixup)", mv._hmv_kernel, hmv, 4, "*fp32", "*i8", 0))
    print(f"triton {triton.__version__}, sm_90")
    failures = 0
    for name, fn, consts, warps, xt, qt, wpt, *dt in runs:
        t0 = time.time()
        try:
            cubin = _build(fn, consts, warps, xt, qt, *dt).asm["cubin"]
            summary = _usage(cubin) + (f"\n      {_loop_summary(cubin, wpt)}" if wpt else "")
        except Exception as e:  # report every build
            failures += 1
            summary = f"FAILED {type(e).__name__}: {str(e)[:300]}"
        fix = consts.get("FIXUP")
        print(
            f"  {name:30s} fixup {'on ' if fix else 'off'}  {summary}  ({time.time() - t0:.1f} s)", flush=True
        )
    print(f"{len(runs) - failures} of {len(runs)} builds for sm_90 compiled")
    return 1 if failures else 0


def main() -> int:
    if "--list" in sys.argv:
        list_plans()
        return 0
    if "--compile-only" in sys.argv:
        return compile_only()
    if not torch.cuda.is_available():
        print("bench_q8: needs a CUDA GPU (--list / --compile-only run anywhere)", file=sys.stderr)
        return 2
    t0 = time.time()
    if "--variants" in sys.argv:
        run_variants(torch.device("cuda"))
    elif "--rows" in sys.argv:
        run_rows(torch.device("cuda"))
    else:
        run(torch.device("cuda"))
    print(f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
