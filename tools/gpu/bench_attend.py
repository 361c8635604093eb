"""Time + check decode attention (ds4.kernels.attend.attend_decode) at Flash shapes, per precision and tile.

On the H200:   PYTHONPATH=. python3 tools/gpu/bench_attend.py

Flash decode shapes: H 64 heads, D 512, W 128 ring rows, RoPE over the last 64 dims; a ratio-4 layer (top 512
of 2,048 compressed rows, 8k context) and a ratio-128 layer (all 64 rows), B = 1 and 32 rows at positions
near 8k. Per configuration (ATTEND_PREC, ATTEND_BH / BN / WARPS, FUSED_MERGE): the median time
(triton.testing.do_bench, partial + merge launches) and the max error vs the f32 torch twin relative to the
output's max. The keys' first 448 dims are FP8-simulated like the model's KV rows (exact in bf16), the RoPE
tail is plain f32.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from ds4.kernels import attend  # noqa: E402

H, D, W, P, TOPK = 64, 512, 128, 32, 512
CONFIGS = [  # (precision, heads per program, keys per block, warps, merge fused into the partial kernel)
    ("ieee", 16, 16, 8, False),
    ("bf16x3", 16, 16, 8, False),
    ("bf16x3", 16, 32, 8, False),
    ("bf16x3", 16, 32, 8, True),
    ("bf16x3", 16, 64, 8, False),
    ("bf16x3", 32, 16, 8, False),
]
SWITCHES = ("ATTEND_PREC", "ATTEND_BH", "ATTEND_BN", "ATTEND_WARPS", "FUSED_MERGE")


def _fp8_keys(x: torch.Tensor) -> torch.Tensor:
    """The model's KV rows: dims 0..447 FP8 E4M3 round-tripped per 64 with power-of-two scales."""
    nope = x[..., :448].unflatten(-1, (7, 64))
    amax = nope.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    q = (nope / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return torch.cat([q.flatten(-2), x[..., 448:]], dim=-1)


def case(B: int, ratio: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cap = 8192 // ratio
    pos = torch.randint(8000, 8190, (B,), device="cuda", generator=g)
    slot = torch.arange(1, B + 1, device="cuda")
    q = torch.randn(B, H, D, device="cuda", generator=g)
    raw = _fp8_keys(torch.randn(B + 1, W, D, device="cuda", generator=g))
    comp = _fp8_keys(torch.randn(B + 1, cap, D, device="cuda", generator=g))
    idx = None
    if ratio == 4:
        idx = torch.stack([torch.randperm(cap, device="cuda", generator=g)[:TOPK] for _ in range(B)])
    sinks = torch.randn(H, device="cuda", generator=g)
    inv = 1.0 / (10000.0 ** (torch.arange(P, dtype=torch.float32, device="cuda") / P))
    return q, raw, slot, pos, comp, idx, ratio, sinks, D**-0.5, inv


def run_config(cfg, args) -> tuple[float, float]:
    for name, value in zip(SWITCHES, cfg, strict=True):
        setattr(attend, name, value)
    attend.ATTEND_BN_FMA = attend.ATTEND_BN_DENSE = attend.ATTEND_BN  # the config's keys per block everywhere
    want = attend.attend_decode_ref(*args)
    got = attend.attend_decode(*args)
    err = float((got - want).abs().max() / want.abs().max())
    us = triton.testing.do_bench(lambda: attend.attend_decode(*args), warmup=25, rep=200) * 1e3
    return us, err


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_attend: needs a CUDA GPU", file=sys.stderr)
        return 2
    default = tuple(getattr(attend, name) for name in (*SWITCHES, "ATTEND_BN_FMA", "ATTEND_BN_DENSE"))
    print(f"default {default}; us per call (partial + merge), error vs the f32 twin / max |out|")
    for B in (1, 32):
        for ratio in (4, 128):
            args = case(B, ratio, seed=B * 1000 + ratio)
            for cfg in CONFIGS:
                try:
                    us, err = run_config(cfg, args)
                    name = f"{cfg[0]:7s} bh {cfg[1]:2d} bn {cfg[2]:2d} w {cfg[3]}" + " fused" * cfg[4]
                    print(f"  B {B:2d} ratio {ratio:3d}  {name}: {us:8.1f} us  err {err:.1e}", flush=True)
                except Exception as e:  # report every configuration
                    print(f"  B {B:2d} ratio {ratio:3d}  {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}")
    for name, value in zip((*SWITCHES, "ATTEND_BN_FMA", "ATTEND_BN_DENSE"), default, strict=True):
        setattr(attend, name, value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
