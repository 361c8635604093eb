"""Routed experts of a batched decode step: the int8 pair kernels (moe.moe_gate_up / moe_down, one program per
(row, slot) pair) vs the grouped-by-expert kernels (ds4.kernels.moe_grouped: one program per expert run).

On the H200:  PYTHONPATH=. python3 tools/gpu/bench_moe_grouped.py [out_dir]        (< 90 s)
              ... --latest: gate/up only the engine's config and the last five variants
              ... --pick=I,J,..: gate/up the engine's config and the variants at these indices
              ... --batches=1,2,4: these batch sizes (B rows) instead
Anywhere:     PYTHONPATH=. python3 tools/gpu/bench_moe_grouped.py --compile-only   (sm_90 builds: registers
              and k-loop instructions of every gate/up variant at 1, 2 and its own pairs per program)

Flash widths (K = 4096, F = 2048, 256 experts, 6 per row), IQ2_XXS gate/up and Q2_K down, random valid blocks
built on the GPU, B = 8, 16, 32 rows. Routing: per layer a random expert popularity (N(0, 0.5) logits) plus
Gumbel noise per row, top 6: distinct experts per row, some experts more popular than others.
  * check first (fresh random inputs, layer 0's full stacks): grouped vs the pair kernels (max |diff| /
    max |pair|, B = 32, plus ids outside [0, E) zeroed on both sides) and vs the integer twin
    (ref.moe_gate_up_q8k / moe_down_q8k, B = 2);
  * timing: one CUDA graph per variant running the op once per layer over L layers' stacks (cold-ish L2),
    replayed R times, CUDA events, median us per layer call. gate/up times include quantizing x and (grouped)
    sorting the pairs; down times quantizing mid. GB/s = packed bytes of the DISTINCT experts the call reads /
    time. Per B: best gate/up + best down of each kind, and the whole routed call (x43 layers per step).
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

import torch  # noqa: E402
import triton  # noqa: E402

from ds4.kernels import moe, moe_grouped, ref  # noqa: E402
from ds4.kernels.moe_grouped import GroupedConfig  # noqa: E402
from ds4.kernels.packing import PackedWeight, pack  # noqa: E402
from ds4.quant import GGMLType, random_blocks  # noqa: E402

IQ2, Q2K = GGMLType.IQ2_XXS, GGMLType.Q2_K
E, TOPK, K, F = 256, 6, 4096, 2048
LAYERS, REPS, WARMUP = 4, 20, 3
BATCHES = (8, 16, 32)
CHECK_B = (32, 2)  # rows of the check against the pair kernels, against the twin
CLAMP = 10.0
CHAIN_TOL = 1e-4
PAIR_GU, PAIR_DN = moe.GATE_UP, moe.DOWN  # the engine's pair kernels as configured now (int8 by default)
# the dp4a gate/up as the engine ran it in sessions 25-27: the base of the variants timed then
DP4A = replace(moe_grouped.CONFIG, **moe_grouped.DP4A_FIELDS)
GU_VARIANTS = [
    moe_grouped.CONFIG,  # the engine's
    DP4A,  # the engine's before session 28
    GroupedConfig(),
    GroupedConfig(sign_math=False),
    GroupedConfig(bn_gu=8),
    GroupedConfig(bn_gu=32),
    GroupedConfig(pairs=2),
    GroupedConfig(bn_gu=32, warps=8),
    GroupedConfig(grid16=True),  # session 7: the pair kernels' decode variants
    GroupedConfig(sign_math=False, grid16=True),
    GroupedConfig(prmt=True, sign_math=False),
    GroupedConfig(prmt=True),  # session 8: prmt with the sign nibbles computed
    GroupedConfig(bn_gu=32, prmt=True, sign_math=False),
    GroupedConfig(prmt=True, sign_math=False, chain=True),  # session 8: one dp4a chain per sub-block
    GroupedConfig(prmt=True, sign_math=False, pos_reg=True),  # the permutes' positive word loaded
    GroupedConfig(prmt=True, sign_math=False, chain=True, pos_reg=True),
    GroupedConfig(prmt=True, sign_math=False, chain=True, pairs=2),
    GroupedConfig(prmt=True, grid16=True, sign_math=False),  # session 14: permutes from the 16-bit codes
    GroupedConfig(prmt=True, grid16=True, sign_math=True),
    GroupedConfig(prmt=True, sign_math=False, smem=1),  # session 15: the tables by tl.gather (shared)
    GroupedConfig(prmt=True, sign_math=False, smem=2),  # one joined lookup
    GroupedConfig(prmt=True, sign_math=False, lds=True),  # session 16: static shared tables (ld.shared)
    GroupedConfig(prmt=True, sign_math=True, lds=True),  # the grid nibbles shared, the sign ones computed
    # session 24 (sm_90 k loop at 1 / 2 / 4 pairs, the engine's 229 / 304 / 454 instructions): chain + the
    # positive word loaded again since session 14's loads (201 / 269 / 376), the shared tables with it
    # (the sign table's offset now the load's immediate: 195 / 276 / 400), all three (183 / 246 / 362)
    GroupedConfig(prmt=True, sign_math=False, chain=True, pos_reg=True),
    GroupedConfig(prmt=True, sign_math=False, lds=True, pos_reg=True),
    GroupedConfig(prmt=True, sign_math=False, lds=True, chain=True, pos_reg=True),
    # ... at 32 rows a program (4 warps: two rows a thread), 4 / 2 pairs: 319 / 423 / 616 instructions for
    # twice the weights (the engine's at bn 32: 424 at one pair, 813 at 4)
    GroupedConfig(bn_gu=32, prmt=True, sign_math=False, lds=True, chain=True, pos_reg=True),
    GroupedConfig(bn_gu=32, pairs=2, prmt=True, sign_math=False, lds=True, chain=True, pos_reg=True),
    # session 25 (H100: session 24's variants all slower at B = 32, so not issue-bound but short of bytes in
    # flight): super-block kt + 1's bytes loaded before kt is decoded, alone, with the shared tables, and at
    # two pairs a program (more programs, each with two blocks in flight)
    replace(DP4A, prefetch=True),
    replace(DP4A, prefetch=True, lds=True),
    replace(DP4A, prefetch=True, pairs=2),
    # the shared tables in 8 / 16 copies, lane l reading copy l % copies: ~2 wavefronts a warp's lookup
    # instead of ~3.5 (the gathers were ~87 % of the kernel's L1 requests, session 14)
    replace(DP4A, lds=True, lds_rep=16),  # on since session 25
    replace(DP4A, lds=True, lds_rep=8),
    replace(DP4A, lds=True, lds_rep=16, pairs=2),
    replace(DP4A, lds=False, lds_rep=1),  # the default before session 25: L1 gathers
    replace(DP4A, lds=True, lds_rep=32),  # the grid lookups without conflicts (40 KB)
    # ptxas capped at 64 registers (sm_90: no spills): 8 programs an SM at 16 copies instead of 6, and 32
    # copies at the 5 that their 41 KB allow
    replace(DP4A, maxnreg=64),
    replace(DP4A, lds_rep=32, maxnreg=64),
    # one lookup a group instead of two: the sign nibbles computed (~16 ALU ops), the grid's from the copies
    replace(DP4A, sign_math=True, maxnreg=64),
    # session 26: gate/up on the int8 tensor cores (one mma.sync m16n8k32 a sub-block of 16 rows x 4 pairs x 2
    # planes; sm_90 k loop 627-703 instructions a thread for 256 weights at any pair count up to 4, vs the
    # dp4a kernel's 209 / 265 for 64 at 1 / 2 pairs): 4 warps (80 registers), capped at 96 (no stack), 2
    # warps (148 registers), 8 warps, and the tables through L1
    replace(DP4A, mma=True),
    replace(DP4A, mma=True, warps=8),
    replace(DP4A, mma=True, lds=False, lds_rep=1),
    # ... all slower than the dp4a kernel (H100, B = 32: 548-608 vs 501 us). Its loads are in the fragment
    # layout: a lane reads 8 bytes of a row (its quad the same 8), 25 % of each sector; 16-byte loads
    # (mma_ld128) test whether the L1 sectors bound it
    replace(DP4A, mma=True, maxnreg=96),
    replace(DP4A, mma=True, maxnreg=96, mma_ld128=True),
    replace(DP4A, mma=True, warps=2),
    replace(DP4A, mma=True, warps=2, mma_ld128=True),
    replace(DP4A, mma=True, mma_ld128=True),
    # session 27 (H100, B = 32: ld128 419.5 vs 501.3 us for the dp4a kernel, 561.4 with 8-byte loads; Nsight
    # Compute: both kernels at 92-94 % of the L1/TEX throughput, ~half the dp4a kernel's shared wavefronts
    # excess): the grid nibbles in 32 copies (one wavefront a lookup instead of two; 40 KB), 8 warps
    replace(DP4A, mma=True, mma_ld128=True, lds_rep=32),
    replace(DP4A, mma=True, mma_ld128=True, lds_rep=32, warps=8),
    replace(DP4A, mma=True, mma_ld128=True, warps=8),
    # ... and both tables in 32 copies (lds_rep 64, 48 KB: no lookup conflicts at all), 4 / 8 warps
    replace(DP4A, mma=True, mma_ld128=True, lds_rep=64),
    replace(DP4A, mma=True, mma_ld128=True, lds_rep=64, warps=8),
    # ... or the sign nibbles computed by one byte permute (sign_prmt: half the lookups gone, ~8 ALU ops a
    # group), for the mma gate/up and the dp4a one
    replace(DP4A, mma=True, mma_ld128=True, sign_prmt=True),
    replace(DP4A, sign_prmt=True),
    # session 28 (the mma gate/up the default for B >= 16): at B = 1-8 (--batches=1,2,4,8) against the pair
    # kernel, the B = 1 decode's: fewer rows a program (1 / 2 warps: 16 / 32 rows, as many programs as the
    # pair kernel's bn 16 at 1 warp), with fewer table copies (the fill: 48 KB over 32 threads is 384 stores
    # a thread) or the tables through L1
    replace(moe_grouped.CONFIG, warps=1, lds_rep=16),
    replace(moe_grouped.CONFIG, warps=1, lds=False, lds_rep=1),
    replace(moe_grouped.CONFIG, warps=2, lds_rep=16),
    replace(moe_grouped.CONFIG, warps=2),
    # the quad layout (quad_pack: the stacks packed a second time for it, x reordered alike): each lane
    # loads its own group's 16 bytes and its x words 16 bytes at a time, 8 loads a lane and super-block
    # instead of 24 (sm_90: 133 registers, k loop 649 instructions with 8 shuffles); at 128 registers: 4
    # programs an SM instead of 3
    replace(moe_grouped.CONFIG, quad_pack=True),
    replace(moe_grouped.CONFIG, quad_pack=True, maxnreg=128),
]
DN_VARIANTS = [
    moe_grouped.CONFIG,  # the engine's
    GroupedConfig(bn_dn=32, pairs_dn=4),
    GroupedConfig(bn_dn=64, pairs_dn=4),
    GroupedConfig(bn_dn=128, pairs_dn=4),
    GroupedConfig(bn_dn=64),  # session 8's default (session 9: bn 128)
    GroupedConfig(bn_dn=128),
    replace(moe_grouped.CONFIG, prefetch_dn=True),  # session 25: the pair down kernel's prefetch
    # session 26: down on the int8 tensor cores (sc q in the A operand, I and M summed in the mma's
    # accumulators over a super-block; sm_90 k loop 293 instructions a thread for 128 weights, 60 registers;
    # H100 B = 32: 300 vs the pair kernel's 190 us)
    replace(moe_grouped.CONFIG, mma_dn=True),
    replace(moe_grouped.CONFIG, mma_dn=True, warps=8),
]
# --latest: the last five gate/up variants; --pick=I,J,..: those at these indices (-1 the last). Either way
# the engine's configs first, the last two down variants, and the batch of issue 8's bar first (time budget)
_PICK = next((a[len("--pick=") :] for a in sys.argv if a.startswith("--pick=")), None)
if "--latest" in sys.argv or _PICK:
    _chosen = GU_VARIANTS[-5:] if _PICK is None else [GU_VARIANTS[int(i)] for i in _PICK.split(",")]
    GU_VARIANTS, DN_VARIANTS = [GU_VARIANTS[0], *_chosen], [DN_VARIANTS[0], *DN_VARIANTS[-2:]]
    BATCHES = (32, 16, 8)
_B = next((a[len("--batches=") :] for a in sys.argv if a.startswith("--batches=")), None)
if _B:  # --batches=1,2,4: these rows instead
    BATCHES = tuple(int(b) for b in _B.split(","))
PAIR_GU_LABEL = f"pair {'int8' if PAIR_GU.int8 else 'f32'} bn{PAIR_GU.bn}"
PAIR_DN_LABEL = f"pair {'int8' if PAIR_DN.int8 else 'f32'} bn{PAIR_DN.bn}"
DEV = torch.device("cuda")
GEN: torch.Generator
LOG: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)


def packed(qtype, shape):
    return pack(random_blocks(qtype, shape, std=0.02, generator=GEN), qtype, shape)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def route(b: int, bias: torch.Tensor) -> torch.Tensor:
    """[b, 6] int32 distinct experts per row: top 6 of popularity bias [E] + Gumbel noise."""
    u = torch.rand(b, E, device=DEV, generator=GEN).clamp_min(1e-9)
    return (bias[None, :] - torch.log(-torch.log(u))).topk(TOPK, dim=1).indices.int().contiguous()


def gu_label(c: GroupedConfig) -> str:
    extra = (" sprmt" if c.sign_prmt else " math" if c.sign_math else " masks") + " g16" * c.grid16
    extra += " prmt" * c.prmt
    extra += " chain" * c.chain + " preg" * c.pos_reg + f" smem{c.smem}" * bool(c.smem) + " lds" * c.lds
    extra += f" x{c.lds_rep}" * (c.lds_rep > 1) + f" r{c.maxnreg}" * bool(c.maxnreg)
    if c.mma:  # the tensor-core kernel: 16 rows a warp, 4 pairs, the nibble tables
        return (
            f"grouped mma w{c.warps}"
            + " lds" * c.lds
            + f" x{c.lds_rep}" * (c.lds_rep > 1)
            + f" r{c.maxnreg}" * bool(c.maxnreg)
            + " ld128" * c.mma_ld128
            + " sprmt" * c.sign_prmt
            + " qp" * c.quad_pack
        )
    return f"grouped bn{c.bn_gu} pt{c.pairs} w{c.warps}{extra}" + " pf" * c.prefetch


def dn_label(c: GroupedConfig) -> str:
    if c.mma_dn:
        return f"grouped mma dn w{c.warps}"
    if c.pair_down:  # moe.py's pair kernel at the grouped config's tile
        return f"grouped/pair bn{c.bn_pair_dn}" + " sorted" * c.sorted_down + " pf" * c.prefetch_dn
    return f"grouped bn{c.bn_dn} pt{c.pairs_dn} w{c.warps}"


def time_calls(calls) -> float:
    """Median seconds per call of the list `calls` (run in order), from a CUDA graph of all of them."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    for _ in range(WARMUP):
        graph.replay()
    ts = []
    for _ in range(REPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3 / len(calls))
    return statistics.median(ts)


def grouped_gu(x, wg, wu, ids, cfg):
    runs = moe_grouped.expert_runs(ids, E)
    return moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, CLAMP, cfg, runs)


def check(layer, bias) -> bool:
    """Grouped vs pair kernels (B = 32) and vs the integer twin (B = 2); True when all within 1e-5."""
    wg, wu, wd = layer
    ok = True
    for b in CHECK_B:
        ids = route(b, bias)
        x = torch.randn(b, K, device=DEV, generator=GEN)
        rw = torch.rand(b, TOPK, device=DEV, generator=GEN)
        if b == CHECK_B[0]:
            ids[0, 1], ids[-1, 3] = -1, E + 7  # other ranks' experts: nothing on either side
            rw_valid = rw * ((ids >= 0) & (ids < E))
            safe = ids.clamp(0, E - 1)
            want_mid = moe.moe_gate_up(x, wg, wu, safe, CLAMP, PAIR_GU)
            want_y = moe.moe_down(want_mid, rw_valid, wd, safe, PAIR_DN)
            what = "pair kernels"
        else:
            want_mid = ref.moe_gate_up_q8k(x, wg, wu, ids, CLAMP)
            want_y = ref.moe_down_q8k(want_mid, rw, wd, ids)
            what = "int twin"
        for cfg in (GU_VARIANTS[0], DN_VARIANTS[0]):
            mid = moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, CLAMP, cfg)
            y = moe_grouped.moe_down_grouped(want_mid, rw, wd, ids, cfg)  # the same mid: f32 order only
            chain = moe_grouped.moe_routed_grouped(x, ids, rw, wg, wu, wd, CLAMP, cfg)
            valid = ((ids >= 0) & (ids < E))[..., None]
            e_mid = rel_err(mid * valid, want_mid * valid)
            zero = bool((mid * ~valid).abs().max() == 0)
            e_y, e_chain = rel_err(y, want_y), rel_err(chain, want_y)
            # chained: mid differing in the last bit can move one Q8_K rounding of mid: CHAIN_TOL
            good = e_mid < 1e-5 and e_y < 1e-5 and e_chain < CHAIN_TOL and zero
            ok &= good
            flag = "" if good else "  <-- FAIL"
            say(f"  check B={b:2d} vs {what:12s} {gu_label(cfg)[8:]:14s}/{dn_label(cfg)[8:]:14s}: mid "
                f"{e_mid:.1e}, down {e_y:.1e}, chained {e_chain:.1e}, other ids 0 {zero}{flag}")  # fmt: skip
        if b == CHECK_B[0] and "qp" in wg.data:  # the batch-1 pair kernel on the quad-only stacks
            e_qp = rel_err(moe.moe_gate_up(x, quad_only(wg), quad_only(wu), safe, CLAMP, PAIR_GU), want_mid)
            ok &= e_qp < 1e-6
            say(f"  check B={b:2d} pair kernel on the quad layout vs the split: {e_qp:.1e}"
                f"{'' if e_qp < 1e-6 else '  <-- FAIL'}")  # fmt: skip
    return ok


def quad_only(w: PackedWeight) -> PackedWeight:
    """The stack as moe_grouped.QUAD_STACKS loads it (qp and d alone), sharing the second copy's words."""
    return PackedWeight(w.qtype, w.shape, {"qp": w.data["qp"], "d": w.data["d"]})


def bench(layers, biases, t0) -> dict:
    gu_bytes = 2 * layers[0][0].nbytes() / E  # gate + up bytes of one expert
    dn_bytes = layers[0][2].nbytes() / E
    summary = {}
    for b in BATCHES:
        if time.time() - t0 > 75:
            say(f"B = {b}: skipped (time budget)")
            continue
        ids = [route(b, biases[i]) for i in range(LAYERS)]
        x = [torch.randn(b, K, device=DEV, generator=GEN) for _ in range(LAYERS)]
        mid = [torch.randn(b, TOPK, F, device=DEV, generator=GEN) for _ in range(LAYERS)]
        rw = [torch.rand(b, TOPK, device=DEV, generator=GEN) for _ in range(LAYERS)]
        uniq = statistics.mean(len(set(i.reshape(-1).tolist())) for i in ids)
        say(f"B = {b}: {b * TOPK} pairs, {uniq:.1f} distinct experts per layer")
        rows: dict[str, dict[str, float]] = {"gu": {}, "dn": {}}
        L = range(LAYERS)
        gu = [
            (
                "pair int8 bn16",
                [partial(moe.moe_gate_up, x[i], *layers[i][:2], ids[i], CLAMP, PAIR_GU) for i in L],
            )
        ]
        if "qp" in layers[0][0].data:  # session 31: the batch-1 pair kernel on the quad-only stacks
            gu.append((
                PAIR_GU_LABEL + " qp",
                [partial(moe.moe_gate_up, x[i], *map(quad_only, layers[i][:2]), ids[i], CLAMP, PAIR_GU)
                 for i in L],
            ))  # fmt: skip
        gu += [
            (gu_label(c), [partial(grouped_gu, x[i], *layers[i][:2], ids[i], c) for i in L])
            for c in GU_VARIANTS
        ]
        dn = [
            (
                "pair int8 bn64",
                [partial(moe.moe_down, mid[i], rw[i], layers[i][2], ids[i], PAIR_DN) for i in L],
            )
        ]
        runs = [moe_grouped.expert_runs(ids[i], E) for i in L]
        dn += [
            (
                dn_label(c),
                [
                    partial(moe_grouped.moe_down_grouped, mid[i], rw[i], layers[i][2], ids[i], c, runs[i])
                    for i in L
                ],
            )
            for c in DN_VARIANTS
        ]
        for op, variants, nbytes in (("gu", gu, gu_bytes), ("dn", dn, dn_bytes)):
            for label, calls in variants:
                try:
                    t = time_calls(calls)
                except Exception as exc:  # noqa: BLE001 - one broken variant must not hide the others
                    say(f"  {op} {label:24s} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                rows[op][label] = t
                say(f"  {op} {label:24s} {t * 1e6:9.1f} us  {uniq * nbytes / t / 1e9:7.0f} GB/s")
        pair = rows["gu"].get(PAIR_GU_LABEL, 0.0) + rows["dn"].get(PAIR_DN_LABEL, 0.0)
        g_gu = {k: v for k, v in rows["gu"].items() if k.startswith("grouped")}
        g_dn = {k: v for k, v in rows["dn"].items() if k.startswith("grouped")}
        if g_gu and g_dn:
            bg, bd = min(g_gu, key=g_gu.get), min(g_dn, key=g_dn.get)
            new = g_gu[bg] + g_dn[bd]
            say(f"  per layer: pair {pair * 1e6:.1f} us, grouped {new * 1e6:.1f} us ({bg} / {bd}); "
                f"x43 layers: {pair * 43e3:.2f} -> {new * 43e3:.2f} ms/step")  # fmt: skip
            summary[str(b)] = {"gate_up": bg, "down": bd, "pair_us": pair * 1e6, "grouped_us": new * 1e6}
    return summary


# ---------------------------------------------------------------------------------------------------------
# --compile-only (any machine, no GPU): sm_90 build with the ptxas bundled in Triton; registers, spills and
# the instructions of the k loop (all PT pairs' branches included).

_GU_SIG = {
    "xw_ptr": "*i64",
    "dx_ptr": "*fp32",
    "gq": "*u8",
    "gs": "*u8",
    "gd": "*fp16",
    "uq": "*u8",
    "us": "*u8",
    "ud": "*fp16",
    "tab64": "*i64",
    "ksm": "*i64",
    "order_ptr": "*i32",
    "eid_ptr": "*i32",
    "offs_ptr": "*i32",
    "out_ptr": "*fp32",
    "n_slots": "i32",
    "n_pairs": "i32",
    "E": "i32",
    "F": "i32",
    "K": "i32",
    "xplane": "i32",
    "clamp": "fp32",
}
_DN_SIG = {
    "xw_ptr": "*i32",
    "xs_ptr": "*i32",
    "dx_ptr": "*fp32",
    "qw": "*i32",
    "sc": "*u8",
    "dm": "*fp16",
    "order_ptr": "*i32",
    "eid_ptr": "*i32",
    "offs_ptr": "*i32",
    "rw_ptr": "*fp32",
    "out_ptr": "*fp32",
    "n_pairs": "i32",
    "E": "i32",
    "D": "i32",
    "F": "i32",
    "xplane": "i32",
}


# ints that are multiples of 16 at Flash widths and B = 32: the launcher specializes them as divisible by 16
# (the x loads vectorize), so the builds here mark them too, as they are at run time
_DIV16 = ("E", "F", "K", "D", "xplane", "n_pairs")


def _compile(fn, sig: dict[str, str], consts: dict, warps: int, maxnreg: int = 0):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {n: sig.get(n, "constexpr") for n in fn.arg_names}
    div = [i for i, n in enumerate(fn.arg_names) if full[n].startswith("*") or n in _DIV16]
    attrs = {(i,): [["tt.divisibility", 16]] for i in div}
    src = ASTSource(fn, signature=full, constexprs=consts, attrs=attrs)
    opts = {"num_warps": warps} | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _sass_stats(cubin: bytes) -> tuple[str, int, int]:
    """(resource line: registers, spills; instructions between the outermost backward branch and its target,
    dp4a (IDP.4A) count in the whole kernel)."""
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
    res = " ".join(t for t in usage.split() if t.startswith(("REG:", "STACK:", "LOCAL:")))
    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\d+\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            ops.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = []
    for addr, op, rest in ops:
        tgt = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if tgt and int(tgt.group(1), 16) < addr:
            loops.append((int(tgt.group(1), 16), addr))
    n_loop = 0
    if loops:
        lo, hi = max(loops, key=lambda ab: ab[1] - ab[0])
        n_loop = sum(1 for addr, _, _ in ops if lo <= addr <= hi)
    return res, n_loop, sum(1 for _, op, _ in ops if op.startswith("IDP"))


def _gu_build(c: GroupedConfig, pairs: int) -> tuple[dict[str, str], dict]:
    """The gate/up kernel's signature (table dtypes as moe.iq2_tables gives them for c) and constexprs,
    all of them (Triton's cache key holds their values, not their names)."""
    tab = "*i16" if c.grid16 else "*i32" if c.prmt else "*i64"
    sig = {**_GU_SIG, "tab64": tab, "ksm": "*i32" if c.prmt else "*i64"}
    consts = {"BN": c.bn_gu, "PT": pairs, "CLAMP": True, "TERMS": c.terms, "DP4A": True}
    consts |= {"SIGN_MATH": c.sign_mode, "CHAIN": c.chain, "POS_REG": c.pos_reg, "SMEM": c.smem}
    consts["LDS"] = c.lds_rep if c.lds else 0
    consts["PREFETCH"] = c.prefetch
    return sig, consts


# the mma kernels' pointer types where they differ (_compile takes the kernel's own argument names)
_MMA_SIG = {**_GU_SIG, "gq": "*i64", "gs": "*i64", "uq": "*i64", "us": "*i64", "tab64": "*i32", "ksm": "*i32"}
_DN_MMA_SIG = {**_DN_SIG, "sc": "*i32", "dm": "*i32"}


def _mma_compile(c: GroupedConfig) -> bool:
    """Report the tensor-core gate/up's build (one k loop: every pair count up to 4 runs the same code)."""
    consts = {"WARPS": c.warps, "CLAMP": True, "PTX": True, "LDS": c.lds_rep if c.lds else 0}
    consts["LD128"] = c.mma_ld128
    consts["SIGN_MATH"] = c.sign_mode
    consts["QP"] = c.quad_pack
    try:
        k = _compile(moe_grouped._gate_up_mma_kernel, _MMA_SIG, consts, c.warps, c.maxnreg)
        res, n, _ = _sass_stats(k.asm["cubin"])
    except Exception as exc:  # noqa: BLE001 - report every kernel
        say(f"  {gu_label(c)} FAILED: {type(exc).__name__}: {str(exc)[:400]}")
        return False
    say(f"  {gu_label(c):44s} {res:26s} k loop {n} (256 weights a thread)")
    return True


def compile_only() -> None:
    """Registers and k-loop instructions of every gate/up variant at 1, 2 and its own pairs per program
    (a program runs the branches of the pairs it has: at B = 32 most have 1 or 2), and of the down tiles."""
    say(f"triton {triton.__version__}: sm_90 compile of the grouped kernels (runtime divisibility)")
    ok = True
    seen = set()
    for c in GU_VARIANTS + [GroupedConfig(terms=1), GroupedConfig(bn_gu=8)]:
        if c in seen:
            continue
        seen.add(c)
        if c.mma:
            ok &= _mma_compile(c)
            continue
        loops, res = [], ""
        for pt in sorted({1, 2, c.pairs}):
            try:
                sig, consts = _gu_build(c, pt)
                res, n, _ = _sass_stats(
                    _compile(moe_grouped._gate_up_grouped_kernel, sig, consts, c.warps, c.maxnreg).asm[
                        "cubin"
                    ]
                )
            except Exception as exc:  # noqa: BLE001 - report every kernel
                ok = False
                say(f"  {gu_label(c)} pt{pt} FAILED: {type(exc).__name__}: {str(exc)[:400]}")
                continue
            loops.append(f"pt{pt} {n}")
        say(f"  {gu_label(c) + f' t{c.terms}':44s} {res:26s} k loop {' / '.join(loops)}")
    for w in (4, 8):
        try:
            res, n, _ = _sass_stats(
                _compile(moe_grouped._down_mma_kernel, _DN_MMA_SIG, {"WARPS": w, "PTX": True}, w).asm["cubin"]
            )
            say(f"  {'dn mma w' + str(w):44s} {res:26s} k loop {n} (128 weights a thread)")
        except Exception as exc:  # noqa: BLE001 - report every kernel
            ok = False
            say(f"  dn mma w{w} FAILED: {type(exc).__name__}: {str(exc)[:400]}")
    for bn, pt, w in ((32, 4, 4), (64, 4, 4), (128, 4, 4), (64, 2, 4)):
        for t in (2, 1):
            consts = {"BN": bn, "PT": pt, "TERMS": t, "DP4A": True}
            label = f"dn bn{bn} pt{pt} w{w} t{t}"
            try:
                res, n, dp4a = _sass_stats(
                    _compile(moe_grouped._down_grouped_kernel, _DN_SIG, consts, w).asm["cubin"]
                )
            except Exception as exc:  # noqa: BLE001 - report every kernel
                ok = False
                say(f"  {label:22s} FAILED: {type(exc).__name__}: {str(exc)[:400]}")
                continue
            say(f"  {label:44s} {res:26s} k loop {n:5d} instr, {dp4a:4d} dp4a")
    say("all compiled" if ok else "SOME FAILED")


def main() -> None:
    if "--compile-only" in sys.argv:
        compile_only()
        return
    global GEN
    GEN = torch.Generator(DEV).manual_seed(0)
    t0 = time.time()
    say(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    layers = [(packed(IQ2, (E, F, K)), packed(IQ2, (E, F, K)), packed(Q2K, (E, K, F))) for _ in range(LAYERS)]
    biases = [0.5 * torch.randn(E, device=DEV, generator=GEN) for _ in range(LAYERS)]
    if any(c.quad_pack for c in GU_VARIANTS):  # the quad layout beside the split one (an experiment)
        for wg, wu, _ in layers:
            moe_grouped.quad_pack_stack(wg)
            moe_grouped.quad_pack_stack(wu)
    say(f"{LAYERS} layers built in {time.time() - t0:.1f} s")
    ok = check(layers[0], biases[0])
    summary = bench(layers, biases, t0) if ok else {}
    say(f"total {time.time() - t0:.0f} s{'' if ok else ' (check FAILED: not timed)'}")
    out = [a for a in sys.argv[1:] if not a.startswith("--")]
    if out:
        Path(out[0]).mkdir(parents=True, exist_ok=True)
        Path(out[0], "bench_moe_grouped.txt").write_text("\n".join(LOG) + "\n")
        Path(out[0], "bench_moe_grouped.json").write_text(json.dumps({"ok": ok, **summary}, indent=1))


if __name__ == "__main__":
    main()
