"""Decode-step modes on a 4-layer full-width synthetic Flash (16 experts): eager vs compiled vs graph vs both.
Usage (device machine): PYTHONPATH=. python tools/gpu/diag_decode.py"""

from __future__ import annotations

from dataclasses import replace

import torch

from ds4.config import FLASH
from ds4.model.cuda import CudaModel, fused
from ds4.tools.synthetic import build_weights

cfg = replace(FLASH, n_layer=4, n_expert=16, compress_ratios=FLASH.compress_ratios[:4])
raw = build_weights(cfg, "q2", seed=3, device="cuda")
for dtype in (torch.bfloat16,):
    m = CudaModel(cfg, lambda n: raw[n], has=lambda n: n in raw, device="cuda", dtype=dtype)
    prompt = [(i * 7919) % cfg.n_vocab for i in range(2100)]
    with torch.inference_mode():
        st = m.new_state(2200)
        logits = m.forward(st, prompt)
        tok = int(logits.argmax())
        out = {}
        modes = [("eager", 0, 0), ("graph+compiled", 1, 1)]
        for name, comp, graph in modes:
            fused.SWITCH.enabled, m.graphs = bool(comp), bool(graph)
            s = st.clone()
            out[name] = [m.forward(s, [tok]).float(), m.forward(s, [tok + 1]).float()]
        ref = out["eager"]
        for name, v in out.items():
            rel = [float((a - b).abs().max() / b.std()) for a, b in zip(v, ref, strict=True)]
            print(dtype, name, [f"{r:.2e}" for r in rel], flush=True)
