"""Tune + check the batch-1 decode kernels at DeepSeek V4 Flash shapes (one device call; prints a table).

On the H200:  PYTHONPATH=. python3 tools/gpu/tune_decode.py [out_dir] [--quick]
  * Q8_0 matvec at B = 1: the general tile kernel (matvec._qmatvec_tiles, the old path) vs q8_mv1 under
    several Q8Config tiles, on every Q8_0 shape of a decode step (o_a grouped: 8 x 1024 rows, own x slices);
  * routed experts (6 of 256, IQ2_XXS gate/up, Q2_K down) under several MoeConfig shapes.
Every variant is first checked against its torch twin (ds4/kernels/ref.py) on fresh random inputs (rel. error
of max |diff| / max |ref| <= 1e-5), then timed with triton.testing.do_bench (median, L2 flushed per call: cold
weights, as in decode). GB/s counts the weight bytes read once.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402

from ds4.kernels import matvec as mv  # noqa: E402
from ds4.kernels import moe, ref  # noqa: E402
from ds4.kernels.packing import pack  # noqa: E402
from ds4.quant import GGMLType, random_blocks  # noqa: E402

Q8, IQ2, Q2K = GGMLType.Q8_0, GGMLType.IQ2_XXS, GGMLType.Q2_K
# (name, K, N, calls per token): the Q8_0 matrices of one Flash decode step (x43 layers; head once).
SHAPES = [
    ("q_a", 4096, 1024, 43),
    ("q_b", 1024, 32768, 43),
    ("kv", 4096, 512, 43),
    ("o_a(8 groups)", 4096, 8 * 1024, 43),
    ("o_b", 8192, 4096, 43),
    ("sh gate/up", 4096, 2048, 86),
    ("sh down", 2048, 4096, 43),
    ("head", 4096, 129280, 1),
]
Q8_CONFIGS = [
    mv.Q8Config(8, 512, 4, 1, 528),
    mv.Q8Config(4, 512, 4, 1, 528),
    mv.Q8Config(16, 512, 4, 1, 528),
    mv.Q8Config(16, 512, 8, 1, 528),
    mv.Q8Config(32, 512, 8, 1, 528),
    mv.Q8Config(8, 256, 4, 1, 528),
    mv.Q8Config(8, 1024, 4, 1, 528),
    mv.Q8Config(16, 1024, 8, 1, 528),
    mv.Q8Config(8, 512, 4, 3, 528),
    mv.Q8Config(16, 512, 4, 3, 528),
    mv.Q8Config(8, 1024, 4, 3, 528),
    mv.Q8Config(16, 256, 4, 3, 1056),
    mv.Q8Config(8, 512, 4, 1, 264),
    mv.Q8Config(8, 512, 4, 1, 1056),
    mv.Q8Config(8, 512, 4, 1, 2112),
    mv.Q8Config(4, 1024, 4, 1, 1056),
]
GU_CONFIGS = [
    moe.MoeConfig(bn, sp, 4, fast) for fast in (False, True) for bn, sp in ((8, 1), (16, 1), (8, 2))
]
DOWN_CONFIGS = [
    moe.MoeConfig(bn, sp, 4, fast) for fast in (False, True) for bn, sp in ((16, 1), (32, 1), (32, 2))
]
if "--quick" in sys.argv:  # the Q8_0 tiles were swept on 2026-11-29 (BENCHMARKS.md): confirm the top ones
    Q8_CONFIGS = [mv.Q8_MV1, mv.Q8Config(4, 1024, 4, 1, 1056), mv.Q8Config(8, 512, 4, 3, 2112)]
DEV = torch.device("cuda")
GEN = torch.Generator(DEV).manual_seed(0)
LOG: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)


def packed(qtype, shape):
    return pack(random_blocks(qtype, shape, std=0.02, generator=GEN), qtype, shape)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e-3


def tune_q8() -> dict[str, tuple[float, float]]:
    """Per shape: (old us, best new us); prints every variant."""
    best: dict[str, tuple[float, float]] = {}
    totals = {c: 0.0 for c in Q8_CONFIGS}
    t_old_total = 0.0
    for name, k, n, calls in SHAPES:
        grouped = name.startswith("o_a")
        w = packed(Q8, (n, k)) if not grouped else packed(Q8, (8, n // 8, k))
        rows_per_group = n // 8 if grouped else n
        x = torch.randn(8 * k if grouped else k, device=DEV, generator=GEN)
        want = ref.qmatvec_grouped(x.view(1, 8, k), w).reshape(-1) if grouped else ref.qmatvec(x[None], w)[0]
        if grouped:
            t_old = bench(lambda: mv.qmatvec(x.view(8, k), w.view(n, k)))  # noqa: B023 - the old diagonal
        else:
            t_old = bench(lambda: mv._qmatvec_tiles(x[None], w))  # noqa: B023
        t_old_total += t_old * calls
        gb = w.nbytes() / 1e9
        say(f"{name:14s} {gb * 1e3:7.1f} MB  old {t_old * 1e6:7.1f} us {gb / t_old:6.0f} GB/s")
        t_best = 1e9
        for c in Q8_CONFIGS:
            if grouped and rows_per_group % c.bn:
                continue
            err = rel_err(mv.q8_mv1(x, w, rows_per_group, c), want)
            t = bench(lambda: mv.q8_mv1(x, w, rows_per_group, c))  # noqa: B023
            totals[c] += t * calls
            t_best = min(t_best, t)
            flag = "" if err < 1e-5 else f"  FAIL err {err:.1e}"
            say(f"    {c.bn:3d} {c.tk:5d} w{c.warps} s{c.stages} t{c.target:5d}: {t * 1e6:7.1f} us "
                f"{gb / t:6.0f} GB/s{flag}")  # fmt: skip
        best[name] = (t_old, t_best)
    say(f"Q8_0 per decode step: old {t_old_total * 1e3:.2f} ms; per config (all shapes, one config):")
    for c, t in sorted(totals.items(), key=lambda kv: kv[1]):
        say(f"    {c}: {t * 1e3:.3f} ms")
    return best


def tune_moe() -> tuple[moe.MoeConfig, moe.MoeConfig]:
    E, k, d, f = 256, 6, 4096, 2048
    wg, wu, wd = packed(IQ2, (E, f, d)), packed(IQ2, (E, f, d)), packed(Q2K, (E, d, f))
    small = [packed(IQ2, (8, f, d)), packed(IQ2, (8, f, d)), packed(Q2K, (8, d, f))]
    ids = torch.randperm(E, device=DEV, generator=GEN)[:k].view(1, k).int()
    x = torch.randn(1, d, device=DEV, generator=GEN)
    mid = torch.randn(1, k, f, device=DEV, generator=GEN)
    rw = torch.rand(1, k, device=DEV, generator=GEN)
    gu_bytes = 2 * k * wg.nbytes() / E
    d_bytes = k * wd.nbytes() / E
    want_gu = ref.moe_gate_up(x, small[0], small[1], ids % 8, 10.0)
    want_d = ref.moe_down(mid, rw, small[2], ids % 8)
    say(f"experts gate+up IQ2_XXS {gu_bytes / 1e6:.1f} MB, down Q2_K {d_bytes / 1e6:.1f} MB (6 of 256)")
    t_gu = {}
    for c in GU_CONFIGS:
        err = rel_err(moe.moe_gate_up(x, small[0], small[1], ids % 8, 10.0, c), want_gu)
        t = t_gu[c] = bench(lambda: moe.moe_gate_up(x, wg, wu, ids, 10.0, c))  # noqa: B023
        flag = "" if err < 1e-5 else f"  FAIL err {err:.1e}"
        say(f"  gate+up {c}: {t * 1e6:7.1f} us {gu_bytes / t / 1e9:6.0f} GB/s{flag}")
    t_d = {}
    for c in DOWN_CONFIGS:
        err = rel_err(moe.moe_down(mid, rw, small[2], ids % 8, c), want_d)
        t = t_d[c] = bench(lambda: moe.moe_down(mid, rw, wd, ids, c))  # noqa: B023
        flag = "" if err < 1e-5 else f"  FAIL err {err:.1e}"
        say(f"  down    {c}: {t * 1e6:7.1f} us {d_bytes / t / 1e9:6.0f} GB/s{flag}")
    bg, bd = min(t_gu, key=t_gu.get), min(t_d, key=t_d.get)
    say(f"MoE per layer: best gate+up {bg} {t_gu[bg] * 1e6:.1f} us, down {bd} {t_d[bd] * 1e6:.1f} us")
    return bg, bd


def main() -> None:
    say(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    best = tune_q8()
    bg, bd = tune_moe()
    say("shape           old us   best new us   speed-up")
    for name, (a, b) in best.items():
        say(f"{name:14s} {a * 1e6:8.1f} {b * 1e6:12.1f} {a / b:9.2f}x")
    out = [a for a in sys.argv[1:] if not a.startswith("--")]
    if out:
        Path(out[0], "tune.txt").write_text("\n".join(LOG) + "\n")
        Path(out[0], "best_moe.json").write_text(json.dumps({"gate_up": asdict(bg), "down": asdict(bd)}))


if __name__ == "__main__":
    main()
