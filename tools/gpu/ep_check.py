"""Expert parallelism on several GPUs of one host (issue 9): synthetic Flash q2 on 1 GPU vs N GPUs, and q4
(which does not fit one H200) on N GPUs.

Run from the repository root, NVLink multicast off (ds4.dist.init also sets it):

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. torchrun --standalone --nproc-per-node 2 tools/gpu/ep_check.py \
        [--prompt 4096] [--steps 32] [--decode 64] [--no-ref] [--no-q4] [--no-graphs] [--json FILE]

Phases (weights built on the GPU tensor by tensor, routed experts only this rank's shard):
  0. a captured all_reduce in a CUDA graph on every rank (decode graphs hold one per MoE layer); if it
     fails anywhere, the run falls back to eager decode and says so.
  1. q2 on rank 0 alone (ds4.dist.local_only: all experts, no collectives) while the others wait; freed.
  2. q2 expert parallel on all ranks (rank 0 drives a ds4.dist.Leader, the others follow).
  3. q4 expert parallel.
Each phase: warm-up (kernel compile, graph capture), prefill of --prompt tokens (timed), --steps greedy
tokens (EOS excluded), then --decode greedy tokens timed from the same post-prefill state. Rank 0 prints a
table: build s, prefill tok/s, decode tok/s, peak GB per GPU, weights GB per GPU; scaling vs 1 GPU; greedy
tokens equal to the 1-GPU run; max relative difference of the prefill logits.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

from ds4 import dist
from ds4.config import FLASH, TINY
from ds4.model.cuda import CudaModel
from ds4.tools.synthetic import build_weights, plan

SEED = 1  # ds4.bench's synthetic seed: same weights as ds4-bench --synthetic
EOS = 1
# --cpu-smoke (CI-less dry run of this script's control flow): tiny config on CPU processes over gloo
RUN = {"device": "cuda", "cfg": FLASH}


def log(msg: str) -> None:
    print(f"[ep_check rank {dist.rank()} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync() -> None:
    if RUN["device"] == "cuda":
        torch.cuda.synchronize()


def peak_bytes() -> int:
    return torch.cuda.max_memory_allocated() if RUN["device"] == "cuda" else 0


def graph_allreduce_ok() -> bool:
    """Capture x.clone() + all_reduce in a CUDA graph and replay it with new inputs on every rank."""
    n = dist.world()
    x = torch.full((4096,), float(dist.rank() + 1), device="cuda")
    ok, g, y = True, None, None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_reduce_(x.clone())  # eager warm-up on a side stream, like DecodeRunner
        torch.cuda.current_stream().wait_stream(side)
        sync()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x.clone()
            dist.all_reduce_(y)
    except Exception as e:  # noqa: BLE001 - reported, and every rank falls back together
        log(f"capturing all_reduce failed: {type(e).__name__}: {e}")
        ok = False
    if not all(dist.gather_objects(ok)):  # replay only when every rank captured (else a replay would hang)
        return False
    x.fill_(float(dist.rank() + 2))
    g.replay()
    sync()
    want = float(sum(r + 2 for r in range(n)))
    ok = bool((y == want).all())
    if not ok:
        log(f"replayed all_reduce gave {y[:4].tolist()}, expected {want}")
    return all(dist.gather_objects(ok))


def build(quant: str, graphs: bool) -> tuple[CudaModel, float]:
    """Synthetic Flash weights generated on this GPU, routed experts only this rank's rows."""
    cfg, dev = RUN["cfg"], RUN["device"]
    names = {pt.name for pt in plan(cfg, quant)}
    rows = dist.expert_range(cfg.n_expert)

    def source(name: str):
        return build_weights(cfg, quant, seed=SEED, device=dev, names=[name], expert_rows=rows)[name]

    t0 = time.perf_counter()
    model = CudaModel(cfg, source, has=names.__contains__, device=dev, graphs=graphs)
    sync()
    return model, time.perf_counter() - t0


def first_token(logits: torch.Tensor) -> int:
    masked = logits.float().clone()
    masked[EOS] = float("-inf")
    return int(masked.argmax())


def measure(model, prompt: list[int], steps: int, n_decode: int) -> dict:
    """Rank 0's timeline on `model` (a CudaModel, or a Leader mirroring it to the other ranks)."""
    st = model.new_state(len(prompt) + max(steps, n_decode) + 16)
    t0 = time.perf_counter()
    model.forward(st, prompt)  # warm-up at the timed length (a longer prompt selects rows by indexer score,
    # whose kernels would otherwise compile inside the timed prefill), then decode compile + graph capture
    model.decode_greedy(st, 5, 4, exclude=EOS)
    sync()
    st.reset()
    log(f"warm-up {time.perf_counter() - t0:.1f} s")
    sync()
    t0 = time.perf_counter()
    logits = model.forward(st, prompt)
    sync()
    t_pre = time.perf_counter() - t0
    saved = st.clone()
    first = first_token(logits)
    tokens = model.decode_greedy(st, first, steps, exclude=EOS).tolist()
    st.copy_from(saved)
    sync()
    t0 = time.perf_counter()
    again = model.decode_greedy(st, first, n_decode, exclude=EOS).tolist()
    sync()
    t_dec = time.perf_counter() - t0
    return {
        "prefill_tps": len(prompt) / t_pre,
        "decode_tps": n_decode / t_dec,
        "tokens": tokens,
        "replay_same": again[: len(tokens)] == tokens[: len(again)],
        "logits": logits.float().cpu(),
    }


def free() -> None:
    gc.collect()
    if RUN["device"] == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def phase(quant: str, graphs: bool, a: argparse.Namespace, prompt: list[int]) -> dict | None:
    """Build on every rank, drive from rank 0, gather per-rank memory. Returns rank 0's result."""
    free()
    model, t_build = build(quant, graphs)
    wbytes = model.weight_bytes()
    log(f"{quant}: built in {t_build:.1f} s, {wbytes / 1e9:.1f} GB of weights on this GPU")
    result = None
    if dist.rank() == 0:
        leader = dist.Leader(model) if dist.active() else model
        result = measure(leader, prompt, a.steps, a.decode)
        if dist.active():
            leader.end()
        del leader
    else:
        dist.follow(model)
    info = {"peak": peak_bytes(), "weights": wbytes, "build": t_build}
    infos = dist.gather_objects(info)
    del model
    free()
    if RUN["device"] == "cuda":
        log(f"{quant}: freed, {torch.cuda.memory_allocated() / 1e9:.2f} GB still allocated on this GPU")
    if result is not None:
        result.update(build=t_build, peaks=[i["peak"] for i in infos], weights=[i["weights"] for i in infos])
        log(f"{quant}: prefill {result['prefill_tps']:.0f} tok/s, decode {result['decode_tps']:.2f} tok/s")
    return result


def report(results: dict[str, dict], a: argparse.Namespace, graphs: bool) -> dict:
    n = dist.world()
    print(f"\nexpert parallel check: {n} GPUs, prompt {a.prompt} tokens, decode {a.decode} tokens, "
          f"CUDA graphs {'on' if graphs else 'off'}")  # fmt: skip
    print(f"{'run':<14}{'build s':>9}{'prefill tok/s':>15}{'decode tok/s':>14}{'peak GB/GPU':>22}"
          f"{'weights GB/GPU':>22}")  # fmt: skip
    summary: dict = {"world": n, "prompt": a.prompt, "decode": a.decode, "graphs": graphs, "runs": {}}
    for name, r in results.items():
        peaks = "/".join(f"{p / 1e9:.1f}" for p in r["peaks"])
        wts = "/".join(f"{w / 1e9:.1f}" for w in r["weights"])
        print(f"{name:<14}{r['build']:>9.1f}{r['prefill_tps']:>15.1f}{r['decode_tps']:>14.2f}{peaks:>22}"
              f"{wts:>22}")  # fmt: skip
        summary["runs"][name] = {k: v for k, v in r.items() if k != "logits"}
    ref, ep = results.get("q2 1 GPU"), results.get(f"q2 EP x{n}")
    if ref and ep:
        same = sum(1 for _ in _common_prefix(ref["tokens"], ep["tokens"]))
        diff = float((ep["logits"] - ref["logits"]).abs().max() / ref["logits"].abs().max())
        print(f"q2 scaling {n} GPUs / 1: prefill x{ep['prefill_tps'] / ref['prefill_tps']:.2f}, "
              f"decode x{ep['decode_tps'] / ref['decode_tps']:.2f}")  # fmt: skip
        print(f"q2 greedy tokens, {n} GPUs vs 1: {same}/{len(ref['tokens'])} equal from the start; "
              f"prefill logits max relative diff {diff:.2e}")  # fmt: skip
        print(f"  1 GPU : {ref['tokens']}\n  EP    : {ep['tokens']}")
        summary.update(
            greedy_equal_prefix=same, greedy_steps=len(ref["tokens"]), prefill_logits_rel_diff=diff
        )
    for name, r in results.items():
        if not r["replay_same"]:
            print(f"warning: {name}: the timed decode replay did not repeat the first greedy tokens")
    return summary


def _common_prefix(x: list[int], y: list[int]):
    for p, q in zip(x, y, strict=False):
        if p != q:
            return
        yield p


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=4096, help="prefill tokens (timed)")
    p.add_argument("--steps", type=int, default=32, help="greedy tokens compared with the 1-GPU run")
    p.add_argument("--decode", type=int, default=64, help="greedy tokens timed")
    p.add_argument("--no-ref", action="store_true", help="skip the 1-GPU q2 reference")
    p.add_argument("--no-q2", action="store_true", help="skip the expert-parallel q2 run")
    p.add_argument("--no-q4", action="store_true", help="skip the expert-parallel q4 run")
    p.add_argument("--no-graphs", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--json", help="rank 0 writes the results here")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU over gloo (control flow only)")
    a = p.parse_args()
    if a.cpu_smoke:
        RUN.update(device="cpu", cfg=TINY)
    if not dist.init("gloo" if a.cpu_smoke else "nccl"):
        print("ep_check: run under torchrun with --nproc-per-node >= 2", file=sys.stderr)
        return 2
    n = dist.world()
    if not a.cpu_smoke:
        dev = torch.cuda.current_device()
        log(f"{n} ranks, cuda:{dev} {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, RUN["cfg"].n_vocab, (a.prompt,), generator=gen).tolist()
    graphs = not a.no_graphs and not a.cpu_smoke
    if graphs and not graph_allreduce_ok():
        graphs = False
        log("WARNING: an all_reduce captured in a CUDA graph failed: decode runs WITHOUT graphs")
    results: dict[str, dict] = {}
    if not a.no_ref:
        if dist.rank() == 0:
            with dist.local_only():
                results["q2 1 GPU"] = phase("q2", graphs, a, prompt)
        dist.leader_message("reference done")  # the other ranks wait here while rank 0 runs alone
    if not a.no_q2:
        results[f"q2 EP x{n}"] = phase("q2", graphs, a, prompt)
    if not a.no_q4:
        results[f"q4 EP x{n}"] = phase("q4", graphs, a, prompt)
    if dist.rank() == 0:
        summary = report(results, a, graphs)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(summary, fh, indent=1)
    dist.shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # NCCL teardown after graph capture can hang (see ds4.dist.shutdown)
