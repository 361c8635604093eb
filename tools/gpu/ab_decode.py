"""Whole-model decode A/B of the kernel variants that are switches (one process, one synthetic model).

On the H200:  PYTHONPATH=. python3 tools/gpu/ab_decode.py [--ctx 4096] [--tokens 64] [--rounds 3]

Builds the full synthetic Flash q2 once, prefills --ctx tokens (4,096: 1,024 compressed rows, so the
indexer selects its top 512), then for each variant sets its module switches, drops the state's decode
graph (the next step recaptures it with the switch in force), restores the prefilled state and times
--tokens greedy steps through the graph. The variants take turns for --rounds rounds (drift hits all
alike); per variant: the median tok/s and its ratio to the default, then one VERDICT line per variant.
Variants (each the other side of an engine default; env names in brackets):
  q8 no xdirect   matvec.Q8_MV1.xdirect off (DS4_Q8_XDIRECT=0)  x through shared memory (on by default)
  q8 magic        matvec.Q8_MV1.magic       (DS4_Q8_MAGIC=1)    int8 -> f32 without I2F
  hc 2 pass       fused.HC_FINISH_BD / _WARPS = 1024 / 4  (DS4_HC_FINISH_BD, DS4_HC_FINISH_WARPS; one pass
                  is the default)
  1 stream        streams.CONCURRENT off    (DS4_STREAMS=0)     no side-stream branches
  indexer topk    layer.INDEXER_TOPK        (DS4_INDEXER_TOPK=1) torch.topk over keys, no full sort
  indexer sort    layer.INDEXER_SELECT off  (DS4_INDEXER_SELECT=0) the stable sort, not the radix select
  select 16k      layer.INDEXER_SELECT_MAX = 16384: the select (in registers) up to 64k ctx too
  q8 no prefetch  matvec.Q8_MV1.prefetch off (DS4_Q8_PREFETCH=0) first weight tile loaded after the wait
  q8 int8         matvec.Q8_MV1.int8        (DS4_Q8_INT8=1)     x quantized to 2 int8 planes, dp4a dots
  q8 int8 bn16    the same at 16 rows x 256 per tile
  q8 int8 bn4     the same at 4 rows x 1024 per tile (session 12's best in bench_q8)
  half prefetch   matvec.HMV_SMALL / HMV_LARGE .prefetch (DS4_HALF_PREFETCH=1)
  attend fma      attend.ATTEND_PREC "ieee" (DS4_ATTEND_PREC=ieee)  the FMA attention dots (bf16x3: default)
  attend fused    attend.FUSED_MERGE        (DS4_ATTEND_FUSED_MERGE=1) the split merge in the partial kernel
  attend dense16  attend.ATTEND_BN_DENSE    (DS4_ATTEND_BN_DENSE=16) 16 keys per block in the ratio-128 layers
  moe no prmt     moe.GATE_UP.prmt off      (DS4_MOE_PRMT=0) gate/up: the 8-byte grid rows + sign math
  moe grid16      moe.GATE_UP.grid16        (DS4_MOE_PRMT=0 DS4_MOE_GRID16=1) gate/up: 16-bit grid codes
  moe down s2     moe.DOWN.splits = 2       two programs per down row tile (bench_moe B = 1: 21.4 -> 18.5 us)
  no step memo    layer.STEP_MEMO off       (DS4_STEP_MEMO=0) each layer computes its ring rows / counts
  indexer q torch INDEXER_Q_KERNEL off      (DS4_INDEXER_Q_KERNEL=0) the compiled torch chain for qi's QAT
  moe prmt math   moe.GATE_UP.sign_math     (DS4_MOE_SIGN_MATH=1) gate/up prmt: sign nibbles computed
  hc scalar       fused.HC_FINISH_SCALAR    (DS4_HC_FINISH_SCALAR=1) S = 4 finish: Sinkhorn on scalars
  hc comb main    model.cuda.fused.HC_COMB_SIDE off (DS4_HC_COMB_SIDE=0) the Sinkhorn in the finish kernel
  hc bns32        fused.HC_FINISH_BNS = 32  (DS4_HC_FINISH_BNS) the finish's partial sums in 4 chunks
  hc post mix     model.cuda.fused.HC_POST_MIX (DS4_HC_POST_MIX=1) the next HC site's mixing partials in
                  the HC post's launch
  qa norm apart   model.cuda.fused.QA_NORM_FUSED off (DS4_QA_NORM_FUSED=0) the q_a norm as a launch of its
                  own, not in the kv row's
  q8k in finish   model.cuda.fused.Q8K_IN_FINISH (DS4_Q8K_IN_FINISH=1) the routed experts' Q8_K input made
                  by the HC finish, not by a launch of its own
  q8k side        model.cuda.fused.Q8K_SIDE (DS4_Q8K_SIDE=1) that launch on side lane 3, beside the router
  comp main       layer.COMP_SIDE off (DS4_COMP_SIDE=0) the compressor chain on the main stream, not on side
                  lane 3
  router w1       fused.ROUTER_WARPS = 1 (DS4_ROUTER_WARPS=1) the router top-k in one warp (shuffles only)
  kv w1 / kv w2   fused.KV_ROW_WARPS = 1 / 2 (DS4_KV_ROW_WARPS) the kv row (+ q_a norm) kernel's warps
  merge ch4 / ch8 attend.MERGE_CH = 4 / 8 (DS4_ATTEND_MERGE_CH) the attention merge reading that many key
                  splits a step; "merge w2": attend.MERGE_WARPS = 2
  prefetch o      layer.PREFETCH = {"o": 36} (DS4_PREFETCH=o=36) o_a's blocks requested into L2 before the
                  attention kernels, on side lane 4; "prefetch o main": on the main stream (session 18's
                  way); "prefetch o 4k": 4 KB requests (288 programs); "prefetch attn": q_a + kv and q_b
                  (42 MB) at the layer's start; "prefetch ffn": the shared expert + router (29 MB) before
                  the FFN's HC; "prefetch all": the three
  topk kernel     layer.TOPK_KERNEL         (DS4_TOPK_KERNEL=1) the indexer top-k by ds4.kernels.topk
  no wide         layer.INDEXER_WIDE off (DS4_INDEXER_WIDE=0): the rows past INDEXER_SELECT_MAX by the sort,
                  not topk.select_rows_wide (time it at --ctx 65536); "wide all": INDEXER_WIDE_MAX = 2^18,
                  the wide select up to 1M ctx; "wide c1024" / "c512" / "c256": its chunks of that many
                  scores (topk.WIDE_MIN_CHUNK, WIDE_PROGRAMS 32 / 64 / 128: G = 17 / 33 / 65 at 64k ctx);
                  "wide d11": its passes by 11 / 11 / 10-bit digits (topk.WIDE_DIGITS, DS4_WIDE_DIGITS=11),
                  not the default 8-bit ones ("wide d8")
  tail torch      model.cuda.fused.TAIL_FUSED off (DS4_TAIL_FUSED=0) the output head's HC collapse + norm and
                  the hash layers' routing as torch chains (~40 launches a step more; default: Triton)
  moe prmt16      moe.GATE_UP.grid16 with prmt (DS4_MOE_GRID16=1) the permutes from the 16-bit codes
  moe bn8 / s2    moe.GATE_UP.bn = 8 / .splits = 2: more gate/up programs at B = 1
  moe down bn32   moe.DOWN.bn = 32
  moe st3 / st2   moe.GATE_UP / DOWN .stages = 3 / 2: the B = 1 expert kernels' loops pipelined by Triton
                  ("moe gu st3" / "moe dn st3": one of them)
  moe gsum        moe.GATE_UP.gsum (DS4_MOE_GSUM=1): each sub-block's group sums added before its scaling
                  ("moe gsum pf": with the next block's loads issued first)
  moe lds (math)  moe.GATE_UP.lds (DS4_MOE_LDS=1): the nibble tables in static shared memory (+ sign math)
  q8 tma          matvec.Q8_MV1.tma at Q8_TMA_TILE (DS4_Q8_TMA=1): the weight tiles by TMA copies into a
                  ring of shared buffers; "q8 tma bn32" / "bn8" / "s3" / "s6": other rows / stages; "q8
                  pipe": its tile with plain loads (Triton's cp.async pipelining); "q8 head tma": the output
                  head alone by it at 32 rows (matvec.Q8_HEAD, DS4_Q8_HEAD_TMA=1)
  q8 flat         matvec.Q8_MV1.flat = 660 (1056: "q8 flat 1056") long-lived programs on the large matrices
  q8 target 1056  matvec.Q8_MV1.target = 1056 ("528", the default; "2112", the one before; "264" /
                  "396" / "792"; "q8 no split": 1):
                  the split-K programs aimed at (DS4_Q8_TARGET); "q8 tk1024"
                  / "q8 bn16": longer k-tiles / more rows a program (more bytes in flight per load);
                  "q8 tk1024 body": those k-tiles on all matrices but the output head (matvec.Q8_HEAD:
                  the default tile)
  all             the off-by-default switches (magic, indexer topk, half prefetch) at once
--variants picks some (comma-separated). dispatch.PDL_EARLY (env DS4_PDL_EARLY, on) is fixed per process:
time it by running the tool once with DS4_PDL_EARLY=0 and once without.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ds4.bench import first_layers, synthetic_model  # noqa: E402
from ds4.config import FLASH  # noqa: E402
from ds4.kernels import attend, dispatch, fused, moe, prefetch, topk  # noqa: E402
from ds4.kernels import matvec as mv  # noqa: E402
from ds4.model.cuda import fused as cfused  # noqa: E402
from ds4.model.cuda import layer, streams  # noqa: E402

BASE_Q8 = mv.Q8_MV1
SORT = {(layer, "INDEXER_SELECT"): False, (layer, "INDEXER_WIDE"): False}  # neither select: the sort
SWITCHES = {  # variant -> {(module, attribute): value}
    "q8 no xdirect": {(mv, "Q8_MV1"): replace(BASE_Q8, xdirect=False)},
    "q8 magic": {(mv, "Q8_MV1"): replace(BASE_Q8, magic=True)},
    "hc 2 pass": {(fused, "HC_FINISH_BD"): 1024, (fused, "HC_FINISH_WARPS"): 4},
    "1 stream": {(streams, "CONCURRENT"): False},
    "indexer topk": {(layer, "INDEXER_TOPK"): True, **SORT},
    "indexer sort": SORT,
    "select 16k": {(layer, "INDEXER_SELECT_MAX"): 16384},
    "attend fma": {(attend, "ATTEND_PREC"): "ieee"},
    "attend fused": {(attend, "FUSED_MERGE"): True},
    "attend dense16": {(attend, "ATTEND_BN_DENSE"): 16},
    "moe no prmt": {(moe, "GATE_UP"): replace(moe.GATE_UP, prmt=False, sign_math=True)},
    "moe grid16": {(moe, "GATE_UP"): replace(moe.GATE_UP, prmt=False, sign_math=True, grid16=True)},
    "moe prmt math": {(moe, "GATE_UP"): replace(moe.GATE_UP, sign_math=True)},
    "moe down s2": {(moe, "DOWN"): replace(moe.DOWN, splits=2)},
    "moe prmt16": {(moe, "GATE_UP"): replace(moe.GATE_UP, grid16=True)},
    "moe bn8": {(moe, "GATE_UP"): replace(moe.GATE_UP, bn=8)},
    "moe s2": {(moe, "GATE_UP"): replace(moe.GATE_UP, splits=2)},
    "moe down bn32": {(moe, "DOWN"): replace(moe.DOWN, bn=32)},
    "moe st3": {(moe, "GATE_UP"): replace(moe.GATE_UP, stages=3), (moe, "DOWN"): replace(moe.DOWN, stages=3)},
    "moe gu st3": {(moe, "GATE_UP"): replace(moe.GATE_UP, stages=3)},
    "moe dn st3": {(moe, "DOWN"): replace(moe.DOWN, stages=3)},
    "moe st2": {(moe, "GATE_UP"): replace(moe.GATE_UP, stages=2), (moe, "DOWN"): replace(moe.DOWN, stages=2)},
    "moe lds": {(moe, "GATE_UP"): replace(moe.GATE_UP, lds=True)},
    "moe gsum": {(moe, "GATE_UP"): replace(moe.GATE_UP, gsum=True)},
    "moe gsum pf": {(moe, "GATE_UP"): replace(moe.GATE_UP, gsum=True, prefetch=True)},
    "moe lds math": {(moe, "GATE_UP"): replace(moe.GATE_UP, lds=True, sign_math=True)},
    "no step memo": {(layer, "STEP_MEMO"): False},
    "hc scalar": {(fused, "HC_FINISH_SCALAR"): True},
    "hc comb main": {(cfused, "HC_COMB_SIDE"): False},
    "hc bns32": {(fused, "HC_FINISH_BNS"): 32},
    "hc post mix": {(cfused, "HC_POST_MIX"): True},
    "qa norm apart": {(cfused, "QA_NORM_FUSED"): False},
    "q8k in finish": {(cfused, "Q8K_IN_FINISH"): True},
    "q8k side": {(cfused, "Q8K_SIDE"): True},
    "comp main": {(layer, "COMP_SIDE"): False},
    "router w1": {(fused, "ROUTER_WARPS"): 1},
    "kv w1": {(fused, "KV_ROW_WARPS"): 1},
    "kv w2": {(fused, "KV_ROW_WARPS"): 2},
    "merge ch4": {(attend, "MERGE_CH"): 4},
    "merge ch8": {(attend, "MERGE_CH"): 8},
    "merge w2": {(attend, "MERGE_WARPS"): 2},
    "prefetch o": {(layer, "PREFETCH"): {"o": 36}},
    "prefetch o main": {(layer, "PREFETCH"): {"o": 36}, (layer, "PREFETCH_SIDE"): False},
    "prefetch o 4k": {(layer, "PREFETCH"): {"o": 36}, (prefetch, "PREFETCH_CHUNK"): 4096},
    "prefetch attn": {(layer, "PREFETCH"): {"attn": 42}},
    "prefetch ffn": {(layer, "PREFETCH"): {"ffn": 29}},
    "prefetch all": {(layer, "PREFETCH"): {"attn": 42, "o": 36, "ffn": 29}},
    "topk kernel": {(layer, "TOPK_KERNEL"): True, **SORT},
    "no wide": {(layer, "INDEXER_WIDE"): False},
    "wide all": {(layer, "INDEXER_WIDE_MAX"): 1 << 18},
    "wide d11": {(topk, "WIDE_DIGITS"): topk.WIDE_DIGITS_11},  # session 20's 11 / 11 / 10-bit passes
    "wide d8": {(topk, "WIDE_DIGITS"): topk.WIDE_DIGITS_8},  # 4 passes of 8-bit digits (the default)
    # shorter chunks (more programs a row): each program's histogram passes run fewer instructions
    **{
        f"wide c{c}": {(topk, "WIDE_MIN_CHUNK"): c, (topk, "WIDE_PROGRAMS"): p}
        for c, p in ((1024, 32), (512, 64), (256, 128))
    },
    "indexer q torch": {(cfused, "INDEXER_Q_KERNEL"): False},
    "tail torch": {(cfused, "TAIL_FUSED"): False},
    "q8 no prefetch": {(mv, "Q8_MV1"): replace(BASE_Q8, prefetch=False)},
    "q8 int8": {(mv, "Q8_MV1"): replace(BASE_Q8, int8=True)},
    "q8 int8 bn16": {(mv, "Q8_MV1"): replace(BASE_Q8, int8=True, bn=16, tk=256)},
    "q8 int8 bn4": {(mv, "Q8_MV1"): replace(BASE_Q8, int8=True, **mv.Q8_INT8_TILE)},
    "q8 tma": {(mv, "Q8_MV1"): replace(BASE_Q8, tma=True, **mv.Q8_TMA_TILE)},
    "q8 tma bn32": {(mv, "Q8_MV1"): replace(BASE_Q8, tma=True, **{**mv.Q8_TMA_TILE, "bn": 32})},
    "q8 tma bn8": {(mv, "Q8_MV1"): replace(BASE_Q8, tma=True, **{**mv.Q8_TMA_TILE, "bn": 8})},
    "q8 tma s3": {(mv, "Q8_MV1"): replace(BASE_Q8, tma=True, **{**mv.Q8_TMA_TILE, "stages": 3})},
    "q8 tma s6": {(mv, "Q8_MV1"): replace(BASE_Q8, tma=True, **{**mv.Q8_TMA_TILE, "stages": 6})},
    "q8 pipe": {(mv, "Q8_MV1"): replace(BASE_Q8, **mv.Q8_TMA_TILE)},  # that tile with plain loads
    "q8 head tma": {(mv, "Q8_HEAD"): mv.Q8_HEAD_TILE},
    "q8 flat": {(mv, "Q8_MV1"): replace(BASE_Q8, flat=660)},
    "q8 flat 1056": {(mv, "Q8_MV1"): replace(BASE_Q8, flat=1056)},
    # split-K aimed at t programs (528: the default; 2112: the one before session 21)
    **{
        f"q8 target {t}": {(mv, "Q8_MV1"): replace(BASE_Q8, target=t)}
        for t in (264, 396, 528, 792, 1056, 2112)
    },
    "q8 no split": {(mv, "Q8_MV1"): replace(BASE_Q8, target=1)},
    "q8 tk1024": {(mv, "Q8_MV1"): replace(BASE_Q8, tk=1024)},
    # the longer k-tiles on every matrix but the output head, which bench_q8 measured slower with them
    "q8 tk1024 body": {(mv, "Q8_MV1"): replace(BASE_Q8, tk=1024), (mv, "Q8_HEAD"): BASE_Q8},
    "q8 bn16": {(mv, "Q8_MV1"): replace(BASE_Q8, bn=16)},
    "half prefetch": {
        (mv, "HMV_SMALL"): replace(mv.HMV_SMALL, prefetch=True),
        (mv, "HMV_LARGE"): replace(mv.HMV_LARGE, prefetch=True),
    },
}
SWITCHES["all"] = {
    (mv, "Q8_MV1"): replace(BASE_Q8, magic=True),
    (layer, "INDEXER_TOPK"): True,
    (layer, "INDEXER_SELECT"): False,
    **SWITCHES["half prefetch"],
}
DEFAULTS = {key: getattr(*key) for sw in SWITCHES.values() for key in sw}


def apply(variant: str) -> None:
    for (mod, attr), value in DEFAULTS.items():
        setattr(mod, attr, value)
    for (mod, attr), value in SWITCHES.get(variant, {}).items():
        setattr(mod, attr, value)


def decode_tps(model, state, base, first: int, n: int) -> float:
    """Greedy tok/s of n steps from the prefilled state, through a graph captured under the current
    switches (a warm-up of 2 steps compiles and captures it)."""
    state._runner = None  # recapture: a graph keeps the kernels chosen when it was captured
    state.copy_from(base)
    model.decode_greedy(state, first, 2)
    state.copy_from(base)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.decode_greedy(state, first, n)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="", help="comma-separated names of SWITCHES (default: all)")
    p.add_argument("--layers", type=int, default=FLASH.n_layer, help="the first N layers (H100: ~32)")
    a = p.parse_args()
    picked = [v for v in a.variants.split(",") if v] or list(SWITCHES)
    if unknown := [v for v in picked if v not in SWITCHES]:
        p.error(f"unknown variants {unknown}; known: {list(SWITCHES)}")
    if not torch.cuda.is_available():
        print("ab_decode: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model = synthetic_model("q2", cfg=first_layers(a.layers))
    print(f"synthetic Flash q2, {a.layers} layers, built in {time.perf_counter() - t0:.1f} s; "
          f"{torch.cuda.get_device_name()}; "
          f"PDL {dispatch.PDL}, PDL_EARLY {dispatch.PDL_EARLY}")  # fmt: skip
    state = model.new_state(a.ctx + 2 * a.tokens + 8)
    vocab = model.cfg.n_vocab
    with torch.inference_mode():
        logits = model.forward(state, [(i * 7919 + 13) % vocab for i in range(a.ctx)])
    base, first = state.clone(), int(logits.argmax())
    variants = ["default", *picked]
    tps: dict[str, list[float]] = {v: [] for v in variants}
    with torch.inference_mode():
        for r in range(a.rounds):
            for v in variants:
                apply(v)
                tps[v].append(decode_tps(model, state, base, first, a.tokens))
            print(f"round {r + 1}: " + ", ".join(f"{v} {tps[v][-1]:.1f}" for v in variants), flush=True)
    apply("default")
    ref = statistics.median(tps["default"])
    print(f"decode at {a.ctx} ctx, median of {a.rounds} x {a.tokens} tokens (tok/s):")
    for v in variants:
        med = statistics.median(tps[v])
        print(f"  {v:14s} {med:7.2f}  x{med / ref:.3f}")
    for v in variants[1:]:
        med = statistics.median(tps[v])
        print(f"VERDICT {v}: {'faster' if med > ref * 1.01 else 'not faster'} ({med:.2f} vs {ref:.2f} tok/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
