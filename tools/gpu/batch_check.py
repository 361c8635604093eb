"""Batched decode on the GPU (issue 8): correctness against per-session decode, then throughput.

On the H200:   PYTHONPATH=. python tools/gpu/batch_check.py        (about 3-6 minutes)

(a) check: a reduced-depth (4 layers), full-width synthetic Flash q2; up to 16 sessions prefilled to
    different positions (indexer selecting, window wrapped, a ratio-128 row completing during the steps);
    for B = 1, 3, 8, 16 (the paths the engine takes; 16 runs the int8 experts grouped by expert,
    batch.MOE_GROUPED_MIN_ROWS; "8g" opts into the bf16 grouped GEMMs of batch.GROUPED_ROWS, off in the
    engine: session 21 measured them at 6.2e-1 of the logit std at B = 8, median 1.3e-2, a fail) the pool
    sessions decode together with CudaModel.decode_batch (bucket CUDA graphs) while copies decode alone
    through forward(state, [tok]) (the single-state graph); prints max |dlogit| / std(logits) and the argmax
    agreement. Bar (cuda_plan.md): <= 2e-2 and the same argmax.
(b) time: the full synthetic Flash q2; ONE session prefilled to --ctx tokens, copied into B pool sessions;
    median of 3 runs of --steps batched greedy steps (host argmax per step, as the scheduler does) for each
    B: step ms, aggregate tok/s, weight GB/s (the bytes one decode step reads x steps/s). B = 1 goes through
    the single-state graph (what decode_batch does for one session); "1*" is the batched code at bucket 1;
    without --plain also "Bg" (routed experts as grouped bf16 GEMMs) and "Bd" (the Q8_0 projections on their
    dense bf16 copies above 8 rows, layer.BATCH_QROWS = 0: the path before matvec.q8_rows).
(c) peak GPU memory and the KV pool bytes.
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ds4.bench import decode_bytes_per_token, first_layers, synthetic_model  # noqa: E402
from ds4.config import FLASH  # noqa: E402
from ds4.model.cuda import batch, layer  # noqa: E402
from ds4.model.cuda.model import BatchRunner  # noqa: E402
from ds4.model.cuda.state import session_nbytes  # noqa: E402

REL_TOL = 2e-2
# positions of the check sessions (8, then 8 more for B = 16: the grouped-by-expert kernels' threshold)
CHECK_LENGTHS = [2100, 700, 125, 5, 1500, 2600, 64, 1027, 333, 2049, 17, 900, 1200, 260, 2300, 129]


def sync() -> None:
    torch.cuda.synchronize()


def prompt_tokens(n: int, vocab: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729 + 13) % vocab for i in range(n)]


DEFAULT_QROWS = layer.BATCH_QROWS  # env DS4_BATCH_QROWS at start-up


def set_grouped(on: bool, pool, qrows: int = DEFAULT_QROWS) -> None:
    """Routed experts of batched steps as grouped GEMMs (ds4.model.cuda.batch.GROUPED_ROWS) or not, and the
    packed-matvec row limit (layer.BATCH_QROWS); a change drops the pool's bucket graphs (recaptured)."""
    want = 1 if on else 0
    if (batch.GROUPED_ROWS, layer.BATCH_QROWS) != (want, qrows):
        batch.GROUPED_ROWS, layer.BATCH_QROWS = want, qrows
        pool.runner = None


def check(batches: list[str], steps: int) -> bool:
    cfg = first_layers(4)
    t0 = time.perf_counter()
    model = synthetic_model("q2", cfg=cfg)
    print(f"(a) 4-layer full-width synthetic Flash q2 built in {time.perf_counter() - t0:.1f} s")
    n = max(int(b.rstrip("g")) for b in batches)
    ctx = max(CHECK_LENGTHS[:n]) + steps + 8
    base, first = [], []
    for i in range(n):
        st = model.new_state(ctx)
        lg = model.forward(st, prompt_tokens(CHECK_LENGTHS[i], cfg.n_vocab, i))
        base.append(st)
        first.append(int(lg.argmax()))
    pool = model.new_states(n, ctx)
    alone = [st.clone() for st in base]  # decoded one by one through forward(state, [tok])
    ok = True
    print(f"{'B':>3} {'steps':>5} {'max|d|/std':>11} {'argmax':>9}")
    for label in batches:
        B, grouped = int(label.rstrip("g")), label.endswith("g")
        set_grouped(grouped, pool[0].pool)
        for i in range(B):
            pool[i].copy_from(base[i])
            alone[i].copy_from(base[i])
        toks, agree, ties, rel = first[:B], 0, 0, []
        for _ in range(steps):
            got = model.decode_batch(pool[:B], toks).float()
            want = torch.stack([model.forward(a, [t]) for a, t in zip(alone[:B], toks, strict=True)]).float()
            diff = (got - want).abs().amax(-1)  # [B]
            rel.append(diff / want.std(-1))
            hit = got.argmax(-1) == want.argmax(-1)
            agree += int(hit.sum())
            # argmax differing within 2 x the max |dlogit| of the top: a near tie
            top_got = want.gather(1, got.argmax(-1, keepdim=True))[:, 0]
            ties += int((~hit & (want.amax(-1) - top_got <= 2 * diff)).sum())
            toks = want.argmax(-1).tolist()
        rel_t = torch.stack(rel)  # [steps, B]
        worst = float(rel_t.max())
        good = worst <= REL_TOL and agree + ties == B * steps
        ok &= good
        verdict = ("ok" if good else "FAIL") + (f" (+{ties} near ties)" if ties else "")
        print(f"{label:>3} {steps:>5} {worst:>11.2e} {agree:>4}/{B * steps:<4} {verdict}")
        # where the worst sits: one (row, step) far above the median is a rounding point flipping (an FP8
        # KV value, the indexer's top-k) on a tiny difference; all rows up together is a systematic error
        at = int(rel_t.argmax())
        print(f"    worst at row {at % B} step {at // B}; median {float(rel_t.median()):.2e}, rows over "
              f"{REL_TOL:g}: {int((rel_t.amax(0) > REL_TOL).sum())} of {B}")  # fmt: skip
        state = max(  # informational: FP8/FP4 round trips may flip one step on a tiny difference
            float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
            for a, p in zip(alone[:B], pool[:B], strict=True)
            for la, lp in zip(a.layers, p.layers, strict=True)
            for x, y in zip(lp.tensors(), la.tensors(), strict=True)
        )
        print(f"    state buffers vs single-session: max |d| / max |x| = {state:.2e}")
    set_grouped(False, pool[0].pool)
    del model, base, pool, alone
    gc.collect()
    torch.cuda.empty_cache()
    return ok


def _rows_int8(matvec) -> dict:
    """q8_rows in mode int8 at each of its tiles (the narrow / wide ones are set apart from Q8_ROWS)."""
    return {(matvec, k): replace(cfg, mode="int8") for k, cfg in matvec.rows_tiles().items()}


def _mv1_int8(matvec):
    return replace(matvec.Q8_MV1, int8=True, **matvec.Q8_INT8_TILE)


def _rows_scales(matvec, scales: str) -> dict:
    """Every q8_rows tile (narrow, default, wide) reading the block scales' f32 copy `scales`."""
    return {(matvec, k): replace(cfg, scales=scales) for k, cfg in matvec.rows_tiles().items()}


def _variants() -> dict[str, dict]:
    """--variants: name -> {(module, attribute): value} set for a timing, the defaults restored after."""
    from ds4.kernels import attend, fused, matvec, moe, moe_grouped
    from ds4.model.cuda import fused as cfused

    # the dp4a gate/up as the engine ran it in sessions 25-27 (the variants timed then are fields on it)
    dp4a = replace(moe_grouped.CONFIG, **moe_grouped.DP4A_FIELDS)
    qp128 = replace(moe_grouped.CONFIG, quad_pack=True, maxnreg=128)  # the quad layout at 128 registers

    def grouped(**fields) -> dict:  # the batched routed experts at that config with these fields
        return {(moe_grouped, "CONFIG"): replace(dp4a, **fields)}

    return {
        "default": {},
        "hc comb main": {(cfused, "HC_COMB_SIDE"): False},  # the Sinkhorn inside the finish kernel
        "indexer sort": {(layer, "INDEXER_SELECT"): False, (layer, "INDEXER_WIDE"): False},  # the stable sort
        "hc post mix": {(cfused, "HC_POST_MIX"): True},  # the next HC site's partials in the post's launch
        "qa norm apart": {(cfused, "QA_NORM_FUSED"): False},  # the q_a norm as a launch of its own
        "q8k in finish": {(cfused, "Q8K_IN_FINISH"): True},  # the routed experts' Q8_K input by the finish
        "q8k side": {(cfused, "Q8K_SIDE"): True},  # ... by its own launch on side lane 3
        "comp main": {(layer, "COMP_SIDE"): False},  # the compressor chain on the main stream
        "prefetch o": {(layer, "PREFETCH"): {"o": 36}},  # o_a's blocks into L2 before the attention
        "prefetch all": {(layer, "PREFETCH"): {"attn": 42, "o": 36, "ffn": 29}},  # three sites, lane 4
        "merge ch8": {(attend, "MERGE_CH"): 8},  # the attention merge reading 8 key splits a step
        "small warps": {(fused, "ROUTER_WARPS"): 1, (fused, "KV_ROW_WARPS"): 1},  # one-warp row kernels
        "dn st3": {(moe, "DOWN"): replace(moe.DOWN, stages=3)},  # the pair down's loop pipelined (B > 1 too)
        "hc bns32": {(fused, "HC_FINISH_BNS"): 32},  # the finish's partial sums in chunks of 32 (<= 16)
        "rows int8": _rows_int8(matvec),  # every q8_rows tile (narrow / default / wide) in mode int8
        "runs sort": {(moe_grouped, "RUNS_KERNEL_MAX"): 0},
        "hmv fixup": {(matvec, "HMV_LARGE"): replace(matvec.HMV_LARGE, fixup=True)},
        "mv1 int8": {(matvec, "Q8_MV1"): replace(matvec.Q8_MV1, int8=True, **matvec.Q8_INT8_TILE)},
        "grouped dp4a": grouped(),  # the default before session 28
        "grouped down": grouped(pair_down=False),
        "grouped sign math": grouped(sign_math=True),
        "grouped prmt16": grouped(grid16=True, lds=False, lds_rep=1),
        "grouped smem1": grouped(smem=1, lds=False, lds_rep=1),
        "grouped smem2": grouped(smem=2, lds=False, lds_rep=1),
        "grouped lds": grouped(lds=True, lds_rep=1),
        "grouped tables l1": grouped(lds=False, lds_rep=1),
        "grouped lds math": grouped(lds=True, lds_rep=1, sign_math=True),
        "grouped chain preg": grouped(chain=True, pos_reg=True),
        "grouped lds preg": grouped(lds=True, lds_rep=1, pos_reg=True),
        "grouped lds x16": grouped(lds=True, lds_rep=16),
        "grouped lds x32": grouped(lds=True, lds_rep=32),
        "grouped mma": grouped(mma=True),  # session 26: gate/up / down on the int8 tensor cores (slower)
        "grouped mma r96": grouped(mma=True, maxnreg=96),
        "grouped mma dn": grouped(mma_dn=True),
        "grouped mma both": grouped(mma=True, mma_dn=True),
        "grouped mma w2": grouped(mma=True, warps=2),
        "grouped mma w8": grouped(mma=True, warps=8),
        "grouped mma ld128": grouped(mma=True, mma_ld128=True),  # session 27: per layer x1.195 at B = 32
        "grouped mma ld128 x32": grouped(mma=True, mma_ld128=True, lds_rep=32),
        "grouped mma both ld128": grouped(mma=True, mma_ld128=True, mma_dn=True),  # + session 27's mma down
        "grouped mma ld128 x64": grouped(mma=True, mma_ld128=True, lds_rep=64),  # both tables in 32 copies
        "grouped mma ld128 sprmt": grouped(mma=True, mma_ld128=True, sign_prmt=True),  # sign nibbles computed
        "grouped sprmt": grouped(sign_prmt=True),
        "grouped r64": grouped(maxnreg=64),
        "grouped math r64": grouped(sign_math=True, maxnreg=64),
        "grouped lds x32 r64": grouped(lds_rep=32, maxnreg=64),
        "grouped lds x8": grouped(lds=True, lds_rep=8),
        "grouped prefetch": grouped(prefetch=True),
        "grouped prefetch pt2": grouped(prefetch=True, pairs=2),
        "grouped prefetch dn": grouped(prefetch=True, prefetch_dn=True),
        "grouped lds chain preg": grouped(lds=True, lds_rep=1, chain=True, pos_reg=True),
        "grouped lcp bn32": grouped(bn_gu=32, lds=True, lds_rep=1, chain=True, pos_reg=True),
        "grouped lcp bn32 pt2": grouped(bn_gu=32, pairs=2, lds=True, lds_rep=1, chain=True, pos_reg=True),
        "grouped unsorted down": grouped(sorted_down=False),
        "side rows from 2": {(layer, "DECODE_ROWS"): 1},  # no merged side matrices above 1 row
        "q8 rows from 2": {(matvec, "Q8_ROWS_FROM"): 2},  # matvec.q8_rows instead of _qmv_kernel (from 3)
        "q8 rows from 5": {(matvec, "Q8_ROWS_FROM"): 5},
        "q8 rows from 9": {(matvec, "Q8_ROWS_FROM"): 9},  # before session 16
        "grouped from 8": {(batch, "MOE_GROUPED_MIN_ROWS"): 8},  # the int8 grouped experts from 8 rows
        "grouped mma from 8": {**grouped(mma=True), (batch, "MOE_GROUPED_MIN_ROWS"): 8},
        "grouped qp": {(moe_grouped, "CONFIG"): replace(moe_grouped.CONFIG, quad_pack=True)},  # session 28
        # session 31: the quad layout at 128 registers (per layer B = 32 326.1 vs 353.9 us uncapped, H100)
        "grouped qp r128": {(moe_grouped, "CONFIG"): qp128},
        "grouped qp r128 from 1": {(moe_grouped, "CONFIG"): qp128, (batch, "MOE_GROUPED_MIN_ROWS"): 1},
        # session 28: the mma gate/up (the default) from 2 rows (per layer B = 2 / 4 / 8 46.2 / 80.9 / 139.2
        # us vs the pair kernel's 53.7 / 89.4 / 164.5, H100), the pair down at the default tile or at 64
        "grouped from 2": {(batch, "MOE_GROUPED_MIN_ROWS"): 2},
        "grouped from 2 dn64": {
            (batch, "MOE_GROUPED_MIN_ROWS"): 2,
            (moe_grouped, "CONFIG"): replace(moe_grouped.CONFIG, bn_pair_dn=64),
        },
        "pair down bn64": grouped(bn_pair_dn=64),
        "grouped pt2": grouped(pairs=2),
        "grouped bn32 w8": grouped(bn_gu=32, warps=8),
        "rows w4": {(matvec, "Q8_ROWS"): replace(matvec.Q8_ROWS, warps=4)},  # wgmma (before session 15)
        "rows wide": {(matvec, "Q8_ROWS_WIDE"): replace(matvec.Q8_ROWS, **matvec.Q8_ROWS_WIDE_TILE)},
        "rows no wide": {(matvec, "Q8_ROWS_WIDE"): None},
        "rows narrow": {(matvec, "Q8_ROWS_NARROW"): replace(matvec.Q8_ROWS, **matvec.Q8_ROWS_NARROW_TILE)},
        "rows no narrow": {(matvec, "Q8_ROWS_NARROW"): None},
        "rows int8 + mv1 int8": {**_rows_int8(matvec), (matvec, "Q8_MV1"): _mv1_int8(matvec)},
        "tail torch": {(cfused, "TAIL_FUSED"): False},  # the head's HC + norm, hash routing as torch chains
        "merged rows 8": {(layer, "MERGED_ROWS"): 8},  # q_a + kv, gate + up: one q8_rows launch each above 8
        "rows f32": _rows_scales(matvec, "f32"),  # session 29: q8_rows's block scales as an f32 copy
        "rows f32t": _rows_scales(matvec, "f32t"),  # ... block-major (packed in the graphs' eager warm-up)
    }


def _rows_variant(name: str) -> dict:
    """'rows:field=value+...' -> the switch set of that q8_rows config (bench_q8.rows_cfg; '+' between the
    fields: --variants is comma-separated)."""
    from bench_q8 import rows_cfg  # tools/gpu, this script's directory

    from ds4.kernels import matvec

    return {(matvec, "Q8_ROWS"): rows_cfg(name.split(":", 1)[1].replace("+", ","))}


def _quad_pack_model(model) -> None:
    """Every layer's routed gate / up stacks also in the quad layout (GroupedConfig.quad_pack, an experiment:
    ~1 GB more a layer, so ~20 layers on an H100)."""
    from ds4.kernels import moe_grouped

    for blk in model.layers:
        for stack in (blk.w.moe.gate_exps, blk.w.moe.up_exps):
            moe_grouped.quad_pack_stack(stack)


def _quad_stacks(model) -> dict:
    """Variant "quad": each layer's routed gate / up stacks swapped for quad-layout-only stacks (packing.
    to_quad's form, as moe_grouped.QUAD_STACKS loads them) sharing a second copy packed beside the split one
    (quad_pack_stack: ~1 GB more a layer, so ~20 layers on an H100)."""
    from ds4.kernels import moe_grouped
    from ds4.kernels.packing import PackedWeight

    table = {}
    for blk in model.layers:
        for attr in ("gate_exps", "up_exps"):
            w = getattr(blk.w.moe, attr)
            moe_grouped.quad_pack_stack(w)
            table[(blk.w.moe, attr)] = PackedWeight(w.qtype, w.shape, {"qp": w.data["qp"], "d": w.data["d"]})
    return table


def time_variants(
    names: list[str], batches: list[int], ctx: int, steps: int, rounds: int, layers: int, prefill: int = 0
) -> None:
    """Batched steps of the model per variant (module switches; the bucket graphs recaptured), the
    variants taking turns for `rounds` rounds; per (variant, B) the median step ms and tok/s."""
    table = _variants() | {n: _rows_variant(n) for n in names if n.startswith("rows:")}
    model = synthetic_model("q2", cfg=first_layers(layers))
    if any(getattr(v, "quad_pack", False) for n in names for v in table.get(n, {}).values()):
        _quad_pack_model(model)
    if "quad" in names:  # session 31, the engine with moe_grouped.QUAD_STACKS (needs the model's stacks)
        table["quad"] = _quad_stacks(model)
    if unknown := [n for n in names if n not in table]:
        raise SystemExit(f"batch_check: unknown variants {unknown}")
    V = model.cfg.n_vocab
    pool = model.new_states(max(batches), ctx + steps * (rounds + 2) * len(names) + 8)
    lg = model.forward(pool[0], prompt_tokens(ctx, V, 0))
    base, first, kv = pool[0].clone(), int(lg.argmax()), pool[0].pool
    times: dict[tuple[str, int], list[float]] = {}
    fresh = model.new_state(prefill + 8) if prefill else None  # --prefill: one prompt a turn (B = 0 below)
    for _ in range(rounds):
        for name in names:
            saved = {key: getattr(*key) for key in table[name]}
            for (mod, attr), value in table[name].items():
                setattr(mod, attr, value)
            _drop_graphs(kv, pool)  # recapture the graphs with the switches in force
            for B in batches:
                for rep in range(2):  # rep 0: warm-up / capture
                    for st in pool[:B]:
                        st.copy_from(base)
                    toks = [(first + 7919 * i) % V for i in range(B)]
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(steps if rep else 2):
                        toks = model.decode_batch(pool[:B], toks).argmax(-1).tolist()
                    sync()
                    if rep:
                        times.setdefault((name, B), []).append((time.perf_counter() - t0) / steps)
            if fresh is not None:
                times.setdefault((name, 0), []).append(_prefill_s(model, fresh, prefill))
            for (mod, attr), value in saved.items():
                setattr(mod, attr, value)
            _drop_graphs(kv, pool)
    print(f"(b) variants at {ctx} ctx, median of {rounds} x {steps} steps (B = 0: {prefill}-token prefill):")
    for (name, B), ts in times.items():
        med = sorted(ts)[len(ts) // 2]
        ratio = med / sorted(times[("default", B)])[rounds // 2] if ("default", B) in times else 1.0
        tps = (B or prefill) / med
        print(f"    {name:22s} B={B:3d} {1e3 * med:8.2f} ms  {tps:8.1f} tok/s  x{1 / ratio:.3f}")


def _prefill_s(model, state, n: int) -> float:
    """Seconds of one n-token prefill into `state` from empty (after an untimed one: compiles, scratch)."""
    V = model.cfg.n_vocab
    for _ in range(2):
        state.reset()
        sync()
        t0 = time.perf_counter()
        model.forward(state, prompt_tokens(n, V, 1))
        sync()
    return time.perf_counter() - t0


def _drop_graphs(kv, pool) -> None:
    """Drop the pool's bucket graphs and each session's single-state graph (B = 1 takes that one: model
    BATCH1_SINGLE), so that the next steps capture them anew."""
    kv.runner = None
    for st in pool:
        st._runner = None


def time_batches(batches: list[int], ctx: int, steps: int, repeats: int, plain: bool = False) -> None:
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = synthetic_model("q2")
    sync()
    print(f"(b) full synthetic Flash q2 built in {time.perf_counter() - t0:.1f} s")
    V = model.cfg.n_vocab
    alloc = ctx + steps * (repeats + 2) + 8
    pool = model.new_states(max(batches), alloc)
    t0 = time.perf_counter()
    lg = model.forward(pool[0], prompt_tokens(ctx, V, 0))
    sync()
    print(f"    prefill of {ctx} tokens: {time.perf_counter() - t0:.1f} s")
    base, first = pool[0].clone(), int(lg.argmax())
    step_bytes = decode_bytes_per_token(model)
    kv = pool[0].pool
    print(f"{'B':>3} {'step ms':>8} {'agg tok/s':>10} {'weights GB/s':>13}")
    rows = [(1, False, "")] if 1 in batches else []  # single-state graph
    rows += [(1, True, "")] if 1 in batches else []  # the batched code at bucket 1
    rows += [(b, False, "") for b in batches if b != 1]
    if not plain:  # the alternative paths (--plain: the defaults only)
        rows += [(b, False, "g") for b in batches if b >= 8]  # routed experts as grouped GEMMs
        rows += [(b, False, "d") for b in batches if b > 8]  # Q8_0 projections on the dense bf16 copies
    for B, bucket1, mode in rows:
        states = pool[:B]
        set_grouped(mode == "g", kv, 0 if mode == "d" else DEFAULT_QROWS)
        runner = kv.runner = kv.runner or BatchRunner(model, kv)

        def step(toks: list[int], states=states, bucket1=bucket1, runner=runner) -> list[int]:
            if bucket1:  # the batched code at bucket 1 (decode_batch itself takes the single-state graph)
                with torch.inference_mode():
                    lg = runner.step([states[0].slot], toks, [states[0].n_tokens])
                states[0].n_tokens += 1
            else:
                lg = model.decode_batch(states, toks)
            return lg.argmax(-1).tolist()

        times = []
        for rep in range(repeats + 1):  # run 0: warm-up (compile, capture the bucket's graph)
            for s in states:
                s.copy_from(base)
            toks = [(first + 7919 * i) % V for i in range(B)]  # distinct streams: different experts
            sync()
            t0 = time.perf_counter()
            for _ in range(steps if rep else 2):
                toks = step(toks)
            sync()
            if rep:
                times.append(time.perf_counter() - t0)
        med = sorted(times)[len(times) // 2]
        label = "1*" if bucket1 else f"{B}{mode}"
        gbps = step_bytes * steps / med / 1e9
        print(f"{label:>3} {1e3 * med / steps:>8.2f} {B * steps / med:>10.1f} {gbps:>13.1f}")
    n, peak = max(batches), torch.cuda.max_memory_allocated() / 2**30
    print(
        f"(c) peak GPU memory {peak:.1f} GiB; KV pool {kv.nbytes() / 2**30:.2f} GiB"
        f" = ({n} + 1 scratch) x {session_nbytes(model.cfg, alloc) / 2**20:.1f} MiB (ctx {alloc})"
    )


def roundtrips_off() -> None:
    """FP8 / FP4 round trips -> identity, on every path the check runs (call before any model is built; run
    with DS4_TRITON_FUSED=0 DS4_COMPILE=0 so decode takes the torch paths that call these functions).

    Why: the round trips make steps of size 2^-3 relative out of values; the batched step and the single
    step reach them through different kernels (ulp-level differences), so a value on a step edge rounds
    differently and a random 4-layer model amplifies that one flip far past any tolerance. With the round
    trips off, what is left is the batched logic itself, which must then agree closely."""
    from ds4.kernels import ref as kernel_ref
    from ds4.model import attention, quantsim
    from ds4.model.cuda import fused

    def identity(x, *args, **kw):
        return x

    quantsim.fp4_e2m1_roundtrip = identity  # indexer QAT: the Hadamard rotation stays
    attention.fp8_e4m3_roundtrip = identity
    fused.fp8_e4m3_roundtrip = identity
    kernel_ref._fp8_e4m3 = identity


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check-batches", default="1,3,8,16", help="B values; 'g': grouped bf16 GEMM experts")
    p.add_argument("--check-steps", type=int, default=6)
    p.add_argument("--batches", default="1,8,16,32")
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--plain", action="store_true", help="time the default paths only")
    p.add_argument("--skip-time", action="store_true")
    p.add_argument("--no-roundtrips", action="store_true", help="FP8/FP4 round trips off")
    p.add_argument(
        "--variants", default="", help="time these switch sets instead (_variants, or rows:field=value+...)"
    )
    p.add_argument("--rounds", type=int, default=2, help="--variants: rounds of turns")
    p.add_argument("--layers", type=int, default=FLASH.n_layer, help="--variants: the first N layers only")
    p.add_argument("--prefill", type=int, default=0, help="--variants: also time a prefill of N tokens")
    a = p.parse_args()
    if a.no_roundtrips:
        if os.environ.get("DS4_TRITON_FUSED") != "0" or os.environ.get("DS4_COMPILE") != "0":
            print("batch_check: --no-roundtrips needs DS4_TRITON_FUSED=0 DS4_COMPILE=0", file=sys.stderr)
            return 2
        roundtrips_off()
    if not torch.cuda.is_available():
        print("batch_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    ok = True
    if not a.skip_check:
        ok = check(a.check_batches.split(","), a.check_steps)
    if a.variants:
        names = ["default"] + [v for v in a.variants.split(",") if v != "default"]
        batches = [int(b) for b in a.batches.split(",")]
        time_variants(names, batches, a.ctx, a.steps, a.rounds, a.layers, a.prefill)
    elif not a.skip_time:
        time_batches([int(b) for b in a.batches.split(",")], a.ctx, a.steps, a.repeats, a.plain)
    print("batch_check:", "all checks ok" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
