"""One-call GPU probe of the cuda backend on full-size synthetic Flash weights (run on the device machine).

Builds the model on the GPU, then: prefill of an 8k prompt (tok/s), decode at ~8k ctx (CUDA graph and eager),
a per-kernel profile of one eager decode step, decode at 64k ctx (KV buffers filled with random rows: decode
cost does not depend on their values), memory numbers, and a ds4-bench sweep with the same model.
Usage: PYTHONPATH=. python tools/gpu/cuda_probe.py OUT_DIR [quant] [bench ctx-max]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from ds4 import bench
from ds4.engine.snapshot import payload_size


def sync_time(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def main() -> None:
    out_dir = Path(sys.argv[1])
    quant = sys.argv[2] if len(sys.argv) > 2 else "q2"
    bench_max = int(sys.argv[3]) if len(sys.argv) > 3 else 16384
    res: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    import triton

    res["triton"] = triton.__version__
    t_build, m = sync_time(lambda: bench.synthetic_model(quant))
    res.update(build_s=round(t_build, 1), kernels=m.kernels, dtype=str(m.dtype))
    res["weights_gb"] = m.weight_bytes() / 1e9
    res["decode_bytes_gb"] = bench.decode_bytes_per_token(m) / 1e9
    res["mem_after_load_gb"] = torch.cuda.memory_allocated() / 1e9
    print(json.dumps(res), flush=True)

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, m.cfg.n_vocab, (8192,), generator=g).tolist()
    st = m.new_state(8192 + 256)
    with torch.inference_mode():
        m.forward(st, prompt[:600])  # compile the prefill kernels
        st = m.new_state(8192 + 256)
        t_pre, logits = sync_time(lambda: m.forward(st, prompt))
    res["prefill_8k_tps"] = round(8192 / t_pre, 1)
    print("prefill", res["prefill_8k_tps"], flush=True)

    first = int(logits.argmax())
    from ds4.model.cuda import fused

    with torch.inference_mode():  # compiled + graph decode step vs plain eager, same state
        fused.SWITCH.enabled, m.graphs = False, False
        la = m.forward(st.clone(), [first])
        fused.SWITCH.enabled, m.graphs = True, True
        t_first, lb = sync_time(lambda: m.forward(st.clone(), [first]))
    res["compiled_vs_eager_rel"] = float((la - lb).abs().max() / la.std())
    res["first_capture_s"] = round(t_first, 1)
    print("compiled vs eager", res["compiled_vs_eager_rel"], "capture+compile s", t_first, flush=True)
    m.decode_greedy(st, first, 2)  # captures the graph
    n = 64
    t_dec, _ = sync_time(lambda: m.decode_greedy(st, first, n))
    res["decode_8k_tps"] = round(n / t_dec, 1)
    res["decode_8k_gbps"] = round(res["decode_bytes_gb"] * n / t_dec, 1)
    print("decode@8k", res["decode_8k_tps"], flush=True)

    m.graphs = False
    t_eager, _ = sync_time(lambda: m.decode_greedy(st, first, 8))
    res["decode_8k_eager_tps"] = round(8 / t_eager, 1)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        m.decode_greedy(st, first, 1)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    (out_dir / "decode_profile.txt").write_text(table)
    print(table[:6000], flush=True)
    m.graphs = True
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        m.forward(m.new_state(4200), prompt[:4096])
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    (out_dir / "prefill_profile.txt").write_text(table)
    print(table[:5000], flush=True)

    ctx64 = 65536
    st64 = m.new_state(ctx64 + 128)
    for layer in st64.layers:
        for t in layer.tensors():
            t.normal_()
    st64.n_tokens = ctx64
    m.decode_greedy(st64, first, 2)
    t64, _ = sync_time(lambda: m.decode_greedy(st64, first, 32))
    res["decode_64k_tps"] = round(32 / t64, 1)
    print("decode@64k", res["decode_64k_tps"], flush=True)

    res["kv_device_bytes_per_token"] = st64.nbytes() / (ctx64 + 128)
    res["kv_payload_128k_bytes"] = payload_size(m.cfg, 131072)
    st64 = None
    torch.cuda.empty_cache()
    res["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    free, total = torch.cuda.mem_get_info()
    res["free_gb_after"] = free / 1e9
    res["max_ctx_estimate"] = int((free - 8e9) / res["kv_device_bytes_per_token"])  # keep 8 GB for temps
    (out_dir / "probe.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res), flush=True)

    a = bench.parse_args(
        ["--synthetic", f"flash-{quant}", "--ctx-start", "2048", "--ctx-max", str(bench_max),
         "--step-mul", "2", "-n", "64", "--csv", str(out_dir / f"bench_flash_{quant}.csv")]
    )  # fmt: skip
    text = bench.read_text(None)
    tokens = [(b * 1009 + i % 7) % m.cfg.n_vocab for i, b in enumerate(text.encode("utf-8"))]
    with open(a.csv, "w") as fh:
        bench.run(a, fh, bench.Loaded(m, tokens, bench.SYNTHETIC_EOS, "synthetic"))
    print(Path(a.csv).read_text(), flush=True)
    for p in bench.plot(Path(a.csv), f"ds4-bench synthetic flash-{quant}, H200"):
        print("plot", p)


if __name__ == "__main__":
    main()
