"""Short device probe: full-size synthetic Flash, prefill 2,048 tokens, decode tok/s at 2k (graph + compile).
Usage (device machine): PYTHONPATH=. python tools/gpu/quick_decode.py [quant]"""

from __future__ import annotations

import sys
import time

import torch

from ds4 import bench


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


quant = sys.argv[1] if len(sys.argv) > 1 else "q2"
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
