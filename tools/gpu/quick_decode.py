"""Short device probe: full-size synthetic Flash, prefill 2,048 tokens, decode tok/s at 2k and at 64k ctx
(graph + compile). Usage (device machine):
    PYTHONPATH=. python tools/gpu/quick_decode.py [quant] [moe.json] [profile.txt]
moe.json (from tools/gpu/tune_decode.py): MoeConfig fields for "gate_up" / "down" to use instead of the
defaults. The 64k state has its KV buffers filled with random rows (decode reads them as it would real ones).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from ds4 import bench
from ds4.kernels import moe


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


quant = sys.argv[1] if len(sys.argv) > 1 else "q2"
if len(sys.argv) > 2 and Path(sys.argv[2]).exists():
    cfg = json.loads(Path(sys.argv[2]).read_text())
    moe.GATE_UP, moe.DOWN = moe.MoeConfig(**cfg["gate_up"]), moe.MoeConfig(**cfg["down"])
print(f"moe configs: gate+up {moe.GATE_UP}, down {moe.DOWN}", flush=True)
t_build, m = timed(lambda: bench.synthetic_model(quant))
step_gb = bench.decode_bytes_per_token(m) / 1e9
prompt = torch.randint(2, m.cfg.n_vocab, (2048,), generator=torch.Generator().manual_seed(0)).tolist()
with torch.inference_mode():
    m.forward(m.new_state(512), prompt[:300])
    st = m.new_state(4096)
    t_pre, logits = timed(lambda: m.forward(st, prompt))
first = int(logits.argmax())
t_cap, _ = timed(lambda: m.decode_greedy(st, first, 2))
t_dec, _ = timed(lambda: m.decode_greedy(st, first, 64))
print(
    f"build {t_build:.1f}s  prefill@2k {2048 / t_pre:.0f} tok/s  capture+compile {t_cap:.1f}s  "
    f"decode@2k {64 / t_dec:.1f} tok/s = {step_gb * 64 / t_dec:.0f} GB/s of {step_gb:.2f} GB/token",
    flush=True,
)
if len(sys.argv) > 3:  # per-kernel CUDA time of one decode step (eager launches, compiled fusions)
    from torch.profiler import ProfilerActivity, profile

    m.graphs = False
    m.decode_greedy(st, first, 1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        m.decode_greedy(st, first, 1)
        torch.cuda.synchronize()
    m.graphs = True
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    Path(sys.argv[3]).write_text(table)
    print(table.splitlines()[-1], flush=True)
st = None
ctx = 65536
st64 = m.new_state(ctx + 128)
for layer in st64.layers:
    for t in layer.tensors():
        t.normal_()
st64.n_tokens = ctx
t_cap64, _ = timed(lambda: m.decode_greedy(st64, first, 2))
t64, _ = timed(lambda: m.decode_greedy(st64, first, 32))
print(f"decode@64k {32 / t64:.1f} tok/s (capture {t_cap64:.1f}s)", flush=True)
