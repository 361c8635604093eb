"""What a chain of dependent Q8_0 matvecs pays at each kernel boundary, against a grid barrier inside one
persistent launch (the question behind a per-layer persistent decode kernel).

On the H200:  PYTHONPATH=. python3 tools/gpu/bench_chain.py [--n 4096,2048,1024] [--stages 32] [--per-sm 1,2]
Anywhere:     TRITON_INTERPRET=1 PYTHONPATH=. python3 tools/gpu/bench_chain.py --check-only (one program)

A chain of M stages, out[s] = W[s] @ out[s - 1] (out[-1] = x), W[s] a distinct Q8_0 [N, N] matrix (M x N^2
bytes: cold in L2 at N >= 2048), run these ways, each captured as one CUDA graph and replayed (median us per
stage, CUDA events; the ways take turns):
  tuned        matvec.q8_mv1 (the decode step's kernel: split-K, fixup, PDL) once per stage;
  launch       _chain_kernel once per stage, P = per-sm x SMs programs walking the row tiles (PDL wait first);
  launch+pre   the same with each program's first k-tile of weights loaded before the PDL wait;
  tiles        _chain_kernel once per stage, one program per row tile ("tiles <name>": at the TILES tiles);
  persist      _chain_kernel once for all M stages, P programs, a grid barrier between stages (an atomic
               arrive, then a spin on the count; every program co-resident at P = per-sm x SMs);
  persist+pre  the same with the next stage's first k-tile loaded before each barrier;
  empty        _chain_kernel once per stage with no stage to run (P programs: the PDL wait, then exit): the
               cost of a dependent launch itself.
launch - persist is the boundary's cost beyond a barrier's; tuned vs launch the inner loop's quality. Each
way's output is checked against the float64 product chain (the barrier's spin gives up after SPIN_MAX polls
and counts it, so a non-resident grid shows as an error, not a hang). Session 20's H200 figures:
BENCHMARKS.md (an empty dependent launch ~1 us; the barrier no cheaper than a boundary).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ds4.kernels import matvec as mv  # noqa: E402
from ds4.kernels.dispatch import PDL, pdl_wait  # noqa: E402
from ds4.kernels.packing import PackedWeight  # noqa: E402
from ds4.quant import GGMLType  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_q8  # noqa: E402  (its graph timing)

BN, TK = 8, 512  # rows a tile, elements a k-tile (the decode step's Q8_0 tile)
TILE = (BN, TK, 4)  # (rows, k-tile, warps) of the ways but the "tiles ..." variants
# the "tiles" way at other tiles: more bytes of a program's weights in flight per load (Little's law: the
# bandwidth a chain reaches grows with the bytes in flight until the DRAM saturates)
TILES = {
    "tk1024": (8, 1024, 4),
    "tk2048 w8": (8, 2048, 8),
    "bn16": (16, 512, 4),
    "bn16 tk1024 w8": (16, 1024, 8),
}
SPIN_MAX = tl.constexpr(200_000)  # polls of the barrier count before a program gives up (counted)


@triton.jit
def _grid_barrier(bar_ptr, err_ptr, target):
    """Wait until bar reaches target arrivals (this program's included): the CTA's writes ordered before
    one release arrive, the spin's acquire before the CTA's later reads (bar.sync on both sides)."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    cur = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (cur < target) & (spins < SPIN_MAX):
        cur = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if cur < target:
        tl.atomic_add(err_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _tile_load(qs_ptr, d_ptr, N, s, rows, k0, BN: tl.constexpr, TK: tl.constexpr):
    """Stage s's weights of rows [BN] at k-tile k0: quants [BN, TK] int8, scales [BN, TK / 32] f16."""
    wq = qs_ptr + s * N * N  # int32 offsets: Chain keeps M N^2 < 2^31
    wd = d_ptr + s * N * (N // 32)
    q = tl.load(wq + rows[:, None] * N + k0 + tl.arange(0, TK)[None, :])
    d = tl.load(wd + rows[:, None] * (N // 32) + k0 // 32 + tl.arange(0, TK // 32)[None, :])
    return q, d


@triton.jit
def _chain_kernel(
    x_ptr, qs_ptr, d_ptr, out_ptr, bar_ptr, err_ptr, N, s0, s1, n_prog,
    BN: tl.constexpr, TK: tl.constexpr, SYNC: tl.constexpr, PRE: tl.constexpr,
):  # fmt: skip
    """Stages s0 .. s1 - 1 of out[s] = W[s] @ (x if s == 0 else out[s - 1]): qs [M, N, N] int8, d [M, N,
    N / 32] f16, out [M, N] f32; program p takes row tiles p, p + n_prog, ...; SYNC: a grid barrier after
    each stage (all n_prog programs co-resident); PRE: a stage's first k-tile of its first row tile loaded
    before the wait for its input (pdl_wait / the barrier: the weights are static)."""
    TB: tl.constexpr = TK // 32
    pid = tl.program_id(0)
    first = tl.minimum(pid, N // BN - 1) * BN + tl.arange(0, BN)  # rows of this program's first tile
    if PRE:
        q_pre, d_pre = _tile_load(qs_ptr, d_ptr, N, s0, first, 0, BN, TK)
    pdl_wait()
    kk = tl.arange(0, TK)
    for s in range(s0, s1):
        xp = x_ptr
        if s > 0:
            xp = out_ptr + (s - 1) * N
        for t in range(pid, N // BN, n_prog):
            rows = t * BN + tl.arange(0, BN)
            acc = tl.zeros([BN, TB], dtype=tl.float32)
            for k0 in range(0, N, TK):
                if PRE and (t == pid) and (k0 == 0):
                    q, d = q_pre, d_pre
                else:
                    q, d = _tile_load(qs_ptr, d_ptr, N, s, rows, k0, BN, TK)
                xv = tl.load(xp + k0 + kk, cache_modifier=".cg")  # [TK]: written by other programs
                prod = tl.reshape(q.to(tl.float32) * xv[None, :], (BN, TB, 32))
                acc += tl.sum(prod, axis=2) * d.to(tl.float32)
            tl.store(out_ptr + s * N + rows, tl.sum(acc, axis=1))
        if SYNC:
            if PRE:  # the next stage's first k-tile (the last stage's again after the last)
                q_pre, d_pre = _tile_load(qs_ptr, d_ptr, N, tl.minimum(s + 1, s1 - 1), first, 0, BN, TK)
            _grid_barrier(bar_ptr, err_ptr, n_prog * (s - s0 + 1))


class Chain:
    """M random Q8_0 [N, N] stages and the buffers of the ways."""

    def __init__(self, n: int, m: int, dev: torch.device, gen: torch.Generator):
        if m * n * n >= 2**31:
            raise ValueError(f"{m} stages of {n} x {n}: past int32 offsets")
        self.n, self.m = n, m
        self.qs = torch.randint(-127, 128, (m, n, n), dtype=torch.int8, device=dev, generator=gen)
        # scales ~ 1 / (127 sqrt(n)) keep each stage's output near unit size
        self.d = (torch.rand(m, n, n // 32, device=dev, generator=gen) + 0.5).div(127 * n**0.5).half()
        self.x = torch.randn(n, device=dev, generator=gen)
        self.out = torch.zeros(m, n, device=dev)
        self.bar = torch.zeros(1, dtype=torch.int32, device=dev)
        self.err = torch.zeros(1, dtype=torch.int32, device=dev)
        self.packed = [
            PackedWeight(GGMLType.Q8_0, (n, n), {"qs": q, "d": d})
            for q, d in zip(self.qs, self.d, strict=True)
        ]

    def want(self) -> torch.Tensor:
        """The last stage's output by torch in float64 -> [N]."""
        v = self.x.double()
        for q, d in zip(self.qs, self.d, strict=True):
            v = (q.double() * d.double().repeat_interleave(32, dim=1)) @ v
        return v

    def launch(
        self, s0: int, s1: int, n_prog: int, sync: bool, pre: bool = False, tile: tuple[int, int, int] = TILE
    ) -> None:
        bn, tk, warps = tile
        _chain_kernel[(n_prog,)](
            self.x, self.qs, self.d, self.out, self.bar, self.err, self.n, s0, s1, n_prog,
            BN=bn, TK=min(tk, self.n), SYNC=sync, PRE=pre, num_warps=warps, launch_pdl=PDL,
        )  # fmt: skip

    def tiles(self, tile: tuple[int, int, int]) -> None:
        """One launch a stage, one program a row tile of `tile` (rows, k-tile, warps)."""
        for s in range(self.m):
            self.launch(s, s + 1, self.n // tile[0], False, tile=tile)

    def ways(self, n_prog: int) -> dict:
        """name -> the calls of one pass of the chain."""

        def tuned():
            v = self.x
            for s in range(self.m):
                v = mv.q8_mv1(v, self.packed[s], self.n)
            self.out[-1].copy_(v)

        def persist(pre: bool):
            self.bar.zero_()
            self.launch(0, self.m, n_prog, True, pre)

        return {
            "tuned": tuned,
            "launch": lambda: [self.launch(s, s + 1, n_prog, False) for s in range(self.m)],
            "launch+pre": lambda: [self.launch(s, s + 1, n_prog, False, True) for s in range(self.m)],
            "tiles": lambda: self.tiles(TILE),
            **{f"tiles {name}": lambda t=t: self.tiles(t) for name, t in TILES.items()},
            "persist": lambda: persist(False),
            "persist+pre": lambda: persist(True),
            # no stage to run: the boundaries alone
            "empty": lambda: [self.launch(s, s, n_prog, False) for s in range(self.m)],
        }


def check(chain: Chain, n_prog: int) -> dict:
    """name -> max relative error of the last stage's output vs the float64 chain (and barrier give-ups)."""
    want = chain.want()
    errs = {}
    for name, fn in chain.ways(n_prog).items():
        if name == "empty":  # computes nothing
            continue
        chain.out.zero_()
        chain.err.zero_()
        fn()
        errs[name] = (bench_q8.rel(chain.out[-1], want), int(chain.err.item()))
    return errs


def time_ways(chain: Chain, n_prog: int) -> dict:
    """name -> median us per stage, one CUDA graph per way, the replays taking turns (bench_q8's timing)."""
    ways = {name: ([fn], lambda: None) for name, fn in chain.ways(n_prog).items()}
    return {name: t * 1e6 / chain.m for name, t in bench_q8.time_graphs(ways).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", default="4096,2048,1024", help="matrix sizes N (comma-separated)")
    p.add_argument("--stages", type=int, default=32)
    p.add_argument("--per-sm", default="1,2,4", help="persistent programs per SM (comma-separated)")
    p.add_argument("--check-only", action="store_true", help="one small chain, one program, no timing")
    a = p.parse_args()
    if a.check_only:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        chain = Chain(64, 3, dev, torch.Generator(dev).manual_seed(0))
        errs = check(chain, 1)
        print("check (N 64, 3 stages, 1 program):", errs)
        sys.exit(0 if all(e < 1e-4 and f == 0 for e, f in errs.values()) else 1)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}, {sms} SMs"
    )
    print("per (N, P programs): us a stage and GB/s by way; max rel error vs float64 (barrier give-ups)")
    for n in (int(v) for v in a.n.split(",")):
        chain = Chain(n, a.stages, dev, torch.Generator(dev).manual_seed(n))
        mb = n * n * (1 + 2 / 32) / 1e6
        for per in (int(v) for v in a.per_sm.split(",")):
            errs = check(chain, per * sms)
            t = time_ways(chain, per * sms)
            print(f"N {n} ({mb:.2f} MB a stage), P {per * sms}:")
            for k, us in t.items():
                e = f"{mb / us * 1e3:6.0f} GB/s  err {errs[k][0]:.1e} ({errs[k][1]})" if k in errs else ""
                print(f"  {k:12s} {us:8.2f} us {e}")
            gap, gap_pre = t["launch"] - t["persist"], t["launch+pre"] - t["persist+pre"]
            print(f"  boundary - barrier: {gap:.2f} us a stage ({gap_pre:.2f} with pre)", flush=True)
        del chain
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
