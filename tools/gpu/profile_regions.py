"""Where the GPU time of a decode step and of an 8k prefill goes, by code region and by kernel (issue 5).

On the H200:   PYTHONPATH=. python tools/gpu/profile_regions.py [prefill_tokens]   (about 2 minutes)

Full synthetic Flash q2. The step functions of ds4.model.cuda.layer are wrapped in torch.profiler
record_function ranges ("R:name"; each kernel counts in the innermost range around the op that launched
it), run eagerly (no CUDA graph) so every kernel is seen; kernel times are what a graph replays, launch
gaps are not.
"""

from __future__ import annotations

import functools
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from ds4.bench import synthetic_model  # noqa: E402
from ds4.model.cuda import fused, layer  # noqa: E402

DECODE = ["lin", "attention_decode_pool", "route_decode", "routed_decode", "shared_gate_up", "_top_rows"]
FUSED = ["hc_pre_norm", "hc_post", "q_post", "kv_post", "indexer_q_post", "swiglu_mid"]
PREFILL = [
    "hc_pre", "hc_post", "_qkv", "_chunk_rows", "_indexer_pick", "_sink_attention_chunk", "routed_prefill",
    "route", "swiglu", "attention_prefill", "_ffn", "rope_tail",
]  # fmt: skip


def wrap(mod, name: str) -> None:
    fn = getattr(mod, name, None)
    if fn is None:
        return

    @functools.wraps(fn)
    def run(*a, **k):
        with record_function(f"R:{name}"):
            return fn(*a, **k)

    setattr(mod, name, run)


def _region(ev) -> str:
    """The innermost "R:" range around a CPU op (its launches' kernels count there), else "other"."""
    while ev is not None:
        if ev.name.startswith("R:"):
            return ev.name
        ev = ev.cpu_parent
    return "other"


def table(prof, title: str) -> None:
    """Kernel time by innermost region (exclusive: each kernel counted once) and by kernel name. Kernels
    the profiler does not link to a CPU op (Triton's driver-API launches) are listed as "unattributed"."""
    regions = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        for k in getattr(ev, "kernels", []):
            r = regions[_region(ev)]
            r[0] += 1
            r[1] += k.duration  # us
    kernels = defaultdict(lambda: [0, 0.0])
    for ev in prof.key_averages():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = getattr(ev, "self_device_time_total", None)
        row = kernels[ev.key[:80]]
        row[0] += ev.count
        row[1] += ev.self_cuda_time_total if t is None else t
    total = sum(t for _, t in kernels.values())
    n = sum(int(c) for c, _ in kernels.values())
    linked = sum(t for _, t in regions.values())
    regions["unattributed (Triton launches)"] = [n - sum(c for c, _ in regions.values()), total - linked]
    print(f"\n== {title}: {total / 1e3:.2f} ms GPU in {n} kernels")
    print(f"{'ms':>9} {'share':>6} {'kernels':>7}  region (innermost)")
    for k, (c, t) in sorted(regions.items(), key=lambda kv: -kv[1][1]):
        print(f"{t / 1e3:>9.3f} {100 * t / max(total, 1):>5.1f}% {int(c):>7}  {k}")
    print(f"{'ms':>9} {'share':>6} {'calls':>7}  kernel")
    for k, (c, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:35]:
        print(f"{t / 1e3:>9.3f} {100 * t / max(total, 1):>5.1f}% {int(c):>7}  {k}")


def main() -> int:
    n_pre = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    t0 = time.perf_counter()
    m = synthetic_model("q2", graphs=False)
    V = m.cfg.n_vocab
    prompt = [(i * 7919 + 13) % V for i in range(n_pre)]
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    with torch.inference_mode():
        m.forward(m.new_state(2560), prompt[:2048])  # warm-up: compiles (same size specializations), tables
        st = m.new_state(n_pre + 64)
        torch.cuda.synchronize()
        t = time.perf_counter()
        m.forward(st, prompt)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        print(f"prefill {n_pre}: {dt:.2f} s = {n_pre / dt:.0f} tok/s (unprofiled)", flush=True)
        for name in DECODE + PREFILL:
            wrap(layer, name)
        for name in FUSED:
            wrap(fused, name)
        first = int(m.forward(st, [5]).argmax())
        m.decode_greedy(st, first, 2)  # warm the eager decode path
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            m.decode_greedy(st, first, 1)
            torch.cuda.synchronize()
        table(prof, f"decode step at ctx {n_pre}")
        st2 = m.new_state(n_pre + 64)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            m.forward(st2, prompt)
            torch.cuda.synchronize()
        table(prof, f"prefill {n_pre} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
