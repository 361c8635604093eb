"""Decode A/B of the two context-dependent switches (issue 5), one process, one synthetic Flash q2.

On the H200:  PYTHONPATH=. python3 tools/gpu/ctx_ab.py [--alloc 262144] [--tokens 64] [--rounds 2]

(1) context buckets (model.CTX_BUCKETS, env DS4_CTX_BUCKETS): a session allocated for --alloc tokens but
    2,048 deep; off, every decode step sorts the indexer scores of all --alloc / 4 compressed rows of each
    ratio-4 layer; on, the rows below the 8k bucket only.
(2) the indexer's top-k at depth (layer.INDEXER_TOPK, env DS4_INDEXER_TOPK): a session 65,536 deep (its
    buffers filled with random rows, as tools/gpu/quick_decode.py does): a stable sort of 16k scores per
    ratio-4 layer vs torch.topk over unique keys.
Each variant decodes --tokens greedy tokens through a freshly captured graph, the two sides of a switch
taking turns for --rounds rounds; median tok/s per side and a VERDICT line per switch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from ab_decode import decode_tps  # noqa: E402  (this folder: the graph-recapturing timing of one variant)

from ds4.bench import synthetic_model  # noqa: E402
from ds4.model.cuda import layer  # noqa: E402
from ds4.model.cuda import model as cuda_model  # noqa: E402


def ab(name: str, model, state, first: int, a, setter) -> None:
    base = state.clone()
    got: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(a.rounds):
        for on in (False, True):
            setter(on)
            got[on].append(decode_tps(model, state, base, first, a.tokens))
    setter(False)
    off, on = statistics.median(got[False]), statistics.median(got[True])
    print(f"{name}: off {off:.2f} tok/s, on {on:.2f} tok/s (x{on / off:.3f})", flush=True)
    print(f"VERDICT {name}: {'faster' if on > off * 1.01 else 'not faster'}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alloc", type=int, default=262144)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    t0 = time.perf_counter()
    model = synthetic_model("q2")
    print(f"synthetic Flash q2 built in {time.perf_counter() - t0:.1f} s", flush=True)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, model.cfg.n_vocab, (2048,), generator=gen).tolist()
    with torch.inference_mode():
        st = model.new_state(a.alloc)
        first = int(model.forward(st, prompt).argmax())
        ab(f"ctx buckets (alloc {a.alloc}, 2k deep)", model, st, first, a,
           lambda on: setattr(cuda_model, "CTX_BUCKETS", on))  # fmt: skip
        del st
        deep = 65536
        st = model.new_state(deep + 2 * a.tokens + 8)
        for lay in st.layers:
            for t in lay.tensors():
                t.normal_()
        st.n_tokens = deep
        ab("indexer topk (64k deep)", model, st, first, a, lambda on: setattr(layer, "INDEXER_TOPK", on))
    return 0


if __name__ == "__main__":
    sys.exit(main())
