"""The decode kernels that bound issues 5 and 8, each launched once in a profiler range, for Nsight Compute.

On the H200 (Firecracker: ncu reads the hardware counters; clocks left alone):
    ncu --clock-control none --profile-from-start off --section ... -o rep python3 tools/gpu/ncu_probe.py
(tools/gpu/session14.sh a runs it and prints the report's details page.) Without ncu it only runs the
kernels (a smoke test of the script).

Flash widths, random valid blocks built on the GPU, one layer: the routed experts at B = 32 (grouped by
expert, the engine's moe_grouped.CONFIG) and B = 1 (the pair kernels, moe.GATE_UP / moe.DOWN), the Q8_0
matvecs at B = 1 (q8_mv1) and B = 32 (q8_rows) on q_b and o_b. Everything is run twice before the range
(compiles, allocator), then once inside it, so each kernel is profiled once and its name says what it is.
--grouped: only the B = 32 grouped kernels, the engine's and the tensor-core ones (grouped_calls).
With DS4_PDL=0 (the session script sets it) no kernel waits on a programmatic dependency.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ds4.config import FLASH  # noqa: E402
from ds4.kernels import matvec as mv  # noqa: E402
from ds4.kernels import moe, moe_grouped  # noqa: E402
from ds4.kernels.packing import pack  # noqa: E402
from ds4.quant import GGMLType, random_blocks  # noqa: E402

C = FLASH
E, TOPK, K, F = C.n_expert, C.n_expert_used, C.n_embd, C.expert_ff
CLAMP = 10.0
DEV = torch.device("cuda")
CFG = moe_grouped.CONFIG  # the engine's grouped launch


def _packed(qtype: GGMLType, shape: tuple[int, ...], gen: torch.Generator):
    return pack(random_blocks(qtype, shape, std=0.02, generator=gen), qtype, shape)


def _q8(n: int, k: int, gen: torch.Generator):
    from bench_q8 import random_q8  # noqa: PLC0415 - tools/gpu sibling, on sys.path when run as a script

    return random_q8(n, k, 1, gen)


def _route(b: int, gen: torch.Generator) -> torch.Tensor:
    """[b, k] int32 distinct experts per row: top k of a popularity bias plus Gumbel noise."""
    bias = 0.5 * torch.randn(E, device=DEV, generator=gen)
    u = torch.rand(b, E, device=DEV, generator=gen).clamp_min(1e-9)
    return (bias[None, :] - torch.log(-torch.log(u))).topk(TOPK, dim=1).indices.int().contiguous()


def grouped_calls(gen: torch.Generator) -> list:
    """--grouped: only the B = 32 routed experts, the engine's grouped launch then the tensor-core kernels
    (GroupedConfig.mma with 16-byte loads, mma_dn), for their stall reasons side by side."""
    wg, wu = _packed(GGMLType.IQ2_XXS, (E, F, K), gen), _packed(GGMLType.IQ2_XXS, (E, F, K), gen)
    wd = _packed(GGMLType.Q2_K, (E, K, F), gen)
    ids = _route(32, gen)
    x = torch.randn(32, K, device=DEV, generator=gen)
    mid = torch.randn(32, TOPK, F, device=DEV, generator=gen)
    rw = torch.rand(32, TOPK, device=DEV, generator=gen)
    r = moe_grouped.expert_runs(ids, E)
    out = []
    for cfg in (CFG, replace(CFG, mma=True, mma_ld128=True, mma_dn=True)):
        out.append(lambda c=cfg: moe_grouped.moe_gate_up_grouped(x, wg, wu, ids, CLAMP, c, r))
        out.append(lambda c=cfg: moe_grouped.moe_down_grouped(mid, rw, wd, ids, c, r))
    return out


def calls(gen: torch.Generator) -> list:
    """The probed launches, each a no-argument callable."""
    if "--grouped" in sys.argv:
        return grouped_calls(gen)
    wg, wu = _packed(GGMLType.IQ2_XXS, (E, F, K), gen), _packed(GGMLType.IQ2_XXS, (E, F, K), gen)
    wd = _packed(GGMLType.Q2_K, (E, K, F), gen)
    out = []
    for b in (32, 1):
        ids = _route(b, gen)
        x = torch.randn(b, K, device=DEV, generator=gen)
        mid = torch.randn(b, TOPK, F, device=DEV, generator=gen)
        rw = torch.rand(b, TOPK, device=DEV, generator=gen)
        if b > 1:
            r = moe_grouped.expert_runs(ids, E)
            out.append(lambda x=x, i=ids, r=r: moe_grouped.moe_gate_up_grouped(x, wg, wu, i, CLAMP, CFG, r))
            out.append(lambda m=mid, w=rw, i=ids, r=r: moe_grouped.moe_down_grouped(m, w, wd, i, CFG, r))
        else:
            out.append(lambda x=x, ids=ids: moe.moe_gate_up(x, wg, wu, ids, CLAMP, moe.GATE_UP))
            out.append(lambda m=mid, w=rw, ids=ids: moe.moe_down(m, w, wd, ids, moe.DOWN))
    for n, k in ((C.n_head * C.head_dim, C.q_lora_rank), (C.n_embd, C.o_groups * C.o_lora_rank)):
        w = _q8(n, k, gen)
        for b in (1, 32):
            x = torch.randn(b, k, device=DEV, generator=gen)
            out.append(lambda x=x, w=w: mv.qmatvec(x, w))
    return out


def main() -> None:
    gen = torch.Generator(device=DEV)
    gen.manual_seed(14)
    probes = calls(gen)
    for _ in range(2):
        for c in probes:
            c()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for c in probes:
        c()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"ncu_probe: {len(probes)} probes ran")


if __name__ == "__main__":
    main()
