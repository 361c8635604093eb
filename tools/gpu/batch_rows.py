"""Per-session view of batch_check's check (a): which of the 16 sessions' batched logits drift from the
single-session decode, step by step (max |dlogit| / std per row).

On the H200:  PYTHONPATH=. python3 tools/gpu/batch_rows.py
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from batch_check import CHECK_LENGTHS, prompt_tokens  # noqa: E402

from ds4.bench import synthetic_model  # noqa: E402
from ds4.config import FLASH  # noqa: E402


def main() -> None:
    cfg = replace(FLASH, n_layer=4, compress_ratios=FLASH.compress_ratios[:4])
    model = synthetic_model("q2", cfg=cfg)
    n, steps = len(CHECK_LENGTHS), 4
    ctx = max(CHECK_LENGTHS) + steps + 8
    pool, alone, toks = model.new_states(n, ctx), [], []
    for i, length in enumerate(CHECK_LENGTHS):
        lg = model.forward(pool[i], prompt_tokens(length, cfg.n_vocab, i))
        alone.append(pool[i].clone())
        toks.append(int(lg.argmax()))
    print("length " + " ".join(f"{x:>6}" for x in CHECK_LENGTHS))
    for s in range(steps):
        got = model.decode_batch(pool, toks).float()
        want = torch.stack([model.forward(a, [t]) for a, t in zip(alone, toks, strict=True)]).float()
        rel = ((got - want).abs().amax(-1) / want.std(-1)).tolist()
        print(f"step {s} " + " ".join(f"{r:6.0e}" for r in rel))
        toks = want.argmax(-1).tolist()


if __name__ == "__main__":
    main()
