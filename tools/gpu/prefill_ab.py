"""Prefill A/B on the H200 (issue 5): one 8k prompt from an empty state under each prefill switch.

On the H200:   PYTHONPATH=. python tools/gpu/prefill_ab.py [tokens] [--repeats N]   (about 2 minutes)

Full synthetic Flash q2, one model in one process; each variant sets module switches, prefills the prompt
into a fresh state (after one untimed run of the same variant: compiles, scratch), median of --repeats.
Prints tok/s and the final logits' max |d| / std against the first variant (how far the switch moves the
numbers: the f32 switches should stay near 1e-3; bf16 noise of the other matrices is there in every run).
Variants: "old" (session 8's path: per-row HC mixing, cuBLAS FMA f32 GEMMs, 4096-token chunks, torch chains
for q / kv / o), three switches on their own, "all" (= the shipped defaults), and "all but <switch>".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ds4.bench import synthetic_model  # noqa: E402
from ds4.kernels import fused  # noqa: E402
from ds4.model.cuda import layer  # noqa: E402

# the switches: HC mixing as row tiles (fused.HC_ROWS_MIN), f32 matrices on tensor cores (layer.F32_TC_ROWS),
# the chunk length, the per-token chains through the fused kernels (layer.PREFILL_FUSED)
OLD = {"hc_rows": 0, "f32_tc": 0, "chunk": 4096, "pfused": False}
ALL = {"hc_rows": 64, "f32_tc": 256, "chunk": 8192, "pfused": True}
VARIANTS = {
    "old": OLD,
    "hc rows": {**OLD, "hc_rows": 64},
    "f32 tc": {**OLD, "f32_tc": 256},
    "chunk 8192": {**OLD, "chunk": 8192},
    "all": ALL,
    **{f"all but {k}": {**ALL, k: OLD[k]} for k in ALL},
}


def _set(m, v: dict) -> None:
    fused.HC_ROWS_MIN, layer.F32_TC_ROWS, m.prefill_chunk = v["hc_rows"], v["f32_tc"], v["chunk"]
    layer.PREFILL_FUSED = v["pfused"]


def _prefill(m, prompt: list[int]) -> tuple[float, torch.Tensor]:
    st = m.new_state(len(prompt) + 64)
    torch.cuda.synchronize()
    t = time.perf_counter()
    logits = m.forward(st, prompt)
    torch.cuda.synchronize()
    return time.perf_counter() - t, logits.float()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("tokens", type=int, nargs="?", default=8192)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}")
    a = p.parse_args()
    t0 = time.perf_counter()
    m = synthetic_model("q2", graphs=False)
    V = m.cfg.n_vocab
    prompt = [(i * 7919 + 13) % V for i in range(a.tokens)]
    print(f"built in {time.perf_counter() - t0:.1f} s; prefill {a.tokens} tokens from empty", flush=True)
    base = None
    with torch.inference_mode():
        for name in a.variants.split(","):
            _set(m, VARIANTS[name])
            torch.cuda.reset_peak_memory_stats()
            _prefill(m, prompt)  # untimed: compiles this variant's kernels
            runs = [_prefill(m, prompt) for _ in range(a.repeats)]
            dt = statistics.median(r[0] for r in runs)
            logits = runs[-1][1]
            base = logits if base is None else base
            d = float((logits - base).abs().max() / base.std())
            same = int(logits.argmax()) == int(base.argmax())
            peak = torch.cuda.max_memory_allocated() / 2**30
            print(f"  {name:<11} {dt:6.3f} s  {a.tokens / dt:7.0f} tok/s  logits vs first {d:.2e} argmax "
                  f"{'same' if same else 'DIFFERS'}  peak {peak:.1f} GiB", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
