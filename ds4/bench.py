"""`ds4-bench`: instantaneous prefill and decode speed at context frontiers (product.md §6.1).

For each frontier f (ctx-start, then + step-incr or x step-mul, capped at ctx-max): extend the session to
tokens[:f] (only the new interval is prefilled, timed), keep an in-memory copy of the state, decode gen-tokens
greedy tokens with EOS excluded (timed), restore the copy. The sweep runs --repeats times from an empty
session (the first pass also pays the JIT compiles of the longer prefills' kernels); one CSV row per
frontier, with the median speeds of the passes (of an even count, the faster middle one):

    ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes,weights_gbps

kvcache_bytes is the DSV4 payload size of the session at f (model.md §11.3); weights_gbps is the weight
bytes a decode step reads (matrices as stored on the device, routed experts k/E of their bytes) x gen_tps.
`--parallel N` measures many sessions instead (issue 8): per frontier f, ONE session is prefilled to f and
its state copied into N pool sessions (no N prefills); G = gen-tokens batched greedy decode steps of all N
are timed (median of --repeats; EOS excluded; row i starts from the greedy token shifted by i so the
streams route to different experts), then the time to first token of a new request of --ttft-prompt
tokens, submitted to ds4.engine.Scheduler (prefill budget --prefill-budget tokens per step) while N - 1
streams decode, twice: ttft_first_s is the first such request of the process (it also pays the JIT compiles
of the prefill kernels at its slice shapes), ttft_s the second (steady state). One CSV row per frontier:

    parallel,ctx_tokens,gen_tokens,step_ms,gen_tps_aggregate,weights_gbps,ttft_prompt,ttft_s,ttft_first_s,
    kv_pool_bytes

`--decode-at C1,C2,...` measures decode deep into the context without prefilling it (issue 5: the largest
context that fits, with its decode speed): per listed context C, a session allocated for C tokens has its
KV filled with random rows up to the depth its timed runs leave room for (C - gen-tokens x (repeats + 1) -
1), then one warm-up run (compiles, graph capture) and --repeats timed runs of gen-tokens greedy tokens
continue from there (each from where the last ended). Decode work depends on the position, not on the
values, so the speed is the real one (the tokens mean nothing). One sweep-format row per C: ctx_tokens the
fill depth, prefill_tokens 0 and prefill_tps empty, kvcache_bytes the payload at that depth.

`--synthetic flash-q2|flash-q4` builds full-size random Flash weights directly on the GPU (no file); its
prompt tokens are the text's UTF-8 bytes spread over the vocabulary (random weights: token identity does
not matter).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ds4 import launch
from ds4.config import DEFAULT_MODEL_PATH, DEFAULT_SYSTEM_PROMPT, FLASH
from ds4.errors import Ds4Error

COLUMNS = [
    "ctx_tokens",
    "prefill_tokens",
    "prefill_tps",
    "gen_tokens",
    "gen_tps",
    "kvcache_bytes",
    "weights_gbps",
]
PARALLEL_COLUMNS = [
    "parallel",
    "ctx_tokens",
    "gen_tokens",
    "step_ms",
    "gen_tps_aggregate",
    "weights_gbps",
    "ttft_prompt",
    "ttft_s",
    "ttft_first_s",
    "kv_pool_bytes",
]
SYNTHETIC = {"flash-q2": "q2", "flash-q4": "q4"}
SYNTHETIC_EOS = 1  # <｜end▁of▁sentence｜> in the DeepSeek V4 vocabulary
SYNTHETIC_SEED = 1
EXPERT_FIELDS = ("gate_exps", "up_exps", "down_exps")


class BenchError(Ds4Error, ValueError):
    pass


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def default_text() -> Path:
    """The bundled bench text in the shared folder next to the repository (or $DS4_SHARED)."""
    shared = Path(os.environ.get("DS4_SHARED", Path(__file__).resolve().parents[2] / "shared"))
    return shared / "bench-text" / "promessi_sposi.txt"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ds4-bench", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt-file", help="raw text, plain BPE, no BOS (default: the bundled bench text)")
    src.add_argument("--chat-prompt-file", help="text rendered as one no-thinking chat user message")
    p.add_argument("-sys", "--system", default=DEFAULT_SYSTEM_PROMPT + ".", help="system prompt (chat file)")
    p.add_argument("-m", "--model", default=DEFAULT_MODEL_PATH, help="GGUF path, or 'tiny'")
    p.add_argument("--synthetic", choices=sorted(SYNTHETIC), help="random full-size Flash weights on the GPU")
    for flag in ("cuda", "cpu"):
        p.add_argument(f"--{flag}", dest="backend", action="store_const", const=flag, help=f"{flag} backend")
    p.add_argument("--backend", choices=("cuda", "cpu"), help="backend (default: cuda when a GPU is present)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (0: torch default)")
    p.add_argument("--ctx-start", type=int, default=2048)
    p.add_argument("--ctx-max", type=int, default=32768)
    p.add_argument("--ctx-alloc", type=int, default=0, help="session ctx (default ctx-max + gen-tokens + 1)")
    p.add_argument("--step-mul", type=float, default=1.0)
    p.add_argument("--step-incr", type=int, default=2048)
    p.add_argument("--gen-tokens", "--tokens", "-n", dest="gen_tokens", type=int, default=128)
    p.add_argument("--csv", help="CSV output file (default stdout)")
    p.add_argument("--plot", action="store_true", help="also write <csv>_ts.png and .svg (needs matplotlib)")
    p.add_argument("--no-graphs", action="store_true", help="cuda: decode without CUDA graphs")
    p.add_argument("--parallel", type=int, default=0, help="N sessions decoding together (batched decode)")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed repeats (median): sweep passes, or --parallel's steps"
    )
    p.add_argument(
        "--ttft-prompt", type=int, default=1024, help="--parallel: prompt tokens of the new request"
    )
    p.add_argument("--prefill-budget", type=int, default=512, help="--parallel: prefill tokens per step")
    p.add_argument("--gpus", type=int, default=None, help="N processes, experts split (runs under torchrun)")
    p.add_argument(
        "--decode-at", type=_depths, default=[], help="contexts C1,C2,...: decode on random-filled sessions"
    )
    a = p.parse_args(argv)
    if a.decode_at and a.parallel:
        p.error("--decode-at and --parallel are different runs: pick one")
    if any(c - a.gen_tokens * (a.repeats + 1) - 1 < 1 for c in a.decode_at):
        p.error(f"--decode-at contexts must exceed gen-tokens x (repeats + 1) + 1, got {a.decode_at}")
    if a.ctx_start < 1 or a.ctx_max < a.ctx_start:
        p.error(f"need 1 <= --ctx-start <= --ctx-max, got {a.ctx_start} and {a.ctx_max}")
    if a.step_mul < 1:
        p.error(f"--step-mul must be >= 1, got {a.step_mul}")
    if a.step_mul == 1 and a.step_incr < 1:
        p.error(f"--step-incr must be >= 1, got {a.step_incr}")
    if a.gen_tokens < 1:
        p.error(f"--gen-tokens must be >= 1, got {a.gen_tokens}")
    if a.parallel < 0 or a.repeats < 1 or a.ttft_prompt < 1 or a.prefill_budget < 1:
        p.error("--parallel must be >= 0; --repeats, --ttft-prompt and --prefill-budget >= 1")
    if a.parallel:  # room for the streams decoding while the new request prefills, and for that request
        need = max(
            a.ctx_max + a.gen_tokens, a.ctx_max + -(-a.ttft_prompt // a.prefill_budget) + 4, a.ttft_prompt
        )
        a.ctx_alloc = max(a.ctx_alloc, need + 1)
    a.ctx_alloc = a.ctx_alloc or a.ctx_max + a.gen_tokens + 1
    if a.ctx_alloc <= a.ctx_max + a.gen_tokens:
        p.error(f"--ctx-alloc must be > ctx-max + gen-tokens = {a.ctx_max + a.gen_tokens}, got {a.ctx_alloc}")
    if a.plot and not a.csv:
        p.error("--plot needs --csv FILE (the plots are written next to it)")
    return a


def _depths(spec: str) -> list[int]:
    """--decode-at's "C1,C2,..." -> sorted positive ints."""
    try:
        out = sorted(int(c) for c in spec.split(",") if c.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated token counts, got {spec!r}") from None
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"want positive token counts, got {spec!r}")
    return out


def frontiers(start: int, stop: int, incr: int, mul: float) -> list[int]:
    out, f = [start], start
    while f < stop:
        f = min(stop, f + incr if mul == 1 else max(f + 1, math.ceil(f * mul)))
        out.append(f)
    return out


# ---------------------------------------------------------------------------------------------
# Model and prompt
# ---------------------------------------------------------------------------------------------


@dataclass
class Loaded:
    model: object  # DS4Model or CudaModel
    tokens: list[int]
    eos: int
    label: str


def read_text(path: str | None) -> str:
    p = Path(path) if path else default_text()
    if not p.exists():
        hint = "" if path else " (the bundled text lives in ../shared/bench-text; pass --prompt-file FILE)"
        raise BenchError(f"prompt file not found: {p}{hint}")
    return p.read_text(encoding="utf-8")


def load(a: argparse.Namespace) -> Loaded:
    import torch

    text = read_text(a.chat_prompt_file or a.prompt_file)
    backend = a.backend or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.synthetic:
        if backend != "cuda" or not torch.cuda.is_available():
            raise BenchError("--synthetic builds its weights on a CUDA GPU; none is available")
        if a.chat_prompt_file:
            raise BenchError("--synthetic has no tokenizer: use --prompt-file (or the default text)")
        model = _distributed(synthetic_model(SYNTHETIC[a.synthetic], graphs=not a.no_graphs))
        vocab = model.cfg.n_vocab
        tokens = [(b * 1009 + i % 7) % vocab for i, b in enumerate(text.encode("utf-8"))]  # bytes -> ids
        return Loaded(model, tokens, SYNTHETIC_EOS, f"synthetic {a.synthetic}")
    from ds4.engine import Engine

    engine = Engine.open(a.model, backend=backend)
    engine.model = _distributed(engine.model)
    tok = engine.tokenizer
    if a.chat_prompt_file:
        from ds4.chat import encode_chat_prompt

        tokens = encode_chat_prompt(tok, a.system, text, "none")
    else:
        tokens = tok.encode(text)
    if backend == "cuda" and a.no_graphs:
        engine.model.graphs = False
    return Loaded(engine.model, tokens, tok.eos_id, f"{Path(a.model).name} ({backend})")


def first_layers(n: int | None):
    """Flash cut to its first n layers (None: all 43). Tools that time kernels take this where the whole q2
    model does not fit the card (an H100's 78 GiB holds ~32 layers)."""
    return FLASH if n is None else replace(FLASH, n_layer=n, compress_ratios=FLASH.compress_ratios[:n])


def synthetic_model(quant: str, *, graphs: bool = True, cfg=None):
    """CudaModel over random Flash weights generated tensor by tensor on the GPU (bounded peak memory)."""
    from ds4.model.cuda import CudaModel
    from ds4.tools.synthetic import build_weights, plan

    cfg = cfg or FLASH
    names = {pt.name for pt in plan(cfg, quant)}

    from ds4 import dist

    shard = dist.expert_range(cfg.n_expert) if dist.active() else None  # expert parallel: this rank's rows

    def source(name: str):
        built = build_weights(cfg, quant, seed=SYNTHETIC_SEED, device="cuda", names=[name], expert_rows=shard)
        return built[name]

    return CudaModel(cfg, source, has=names.__contains__, device="cuda", graphs=graphs)


def _distributed(model):
    """Under torchrun: rank 0 gets a mirror of the model (ds4.dist.Leader), the other ranks follow rank 0's
    calls and exit. One process: the model itself."""
    from ds4 import dist

    return dist.wrap_or_follow(model) if dist.active() else model


def decode_bytes_per_token(model) -> int:
    """Weight bytes one decode step reads: matrices as stored, k/E of the routed experts, no embeddings, and
    not the block-scale copies only the batched kernels read."""
    from ds4.kernels.packing import SCALE_COPY_ROW_DIM

    cfg = model.cfg
    frac = cfg.n_expert_used / cfg.n_expert

    def size(obj, depth=0) -> float:
        import torch

        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        packed = getattr(obj, "packed", None)  # QLinear: decode reads the packed blocks
        if packed is not None:
            return size(packed, depth + 1)
        data = getattr(obj, "data", None)
        if isinstance(data, torch.Tensor):  # Packed expert stack
            return size(data)
        if isinstance(data, dict):  # ds4.kernels PackedWeight
            return sum(size(v) for k, v in data.items() if k not in SCALE_COPY_ROW_DIM)
        if depth < 4 and hasattr(obj, "__dict__"):
            total = 0.0
            for name, v in vars(obj).items():
                if name == "tid2eid":
                    continue  # one row per token
                total += size(v, depth + 1) * (frac if name in EXPERT_FIELDS else 1.0)
            return total
        return 0

    total = sum(size(blk.w) for blk in model.layers)
    return int(total + size(model.output) + size(model.head_hc) + size(model.output_norm))


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------


class Driver:
    """One growing timeline over a model (CPU or device): extend, copy/restore state, greedy decode."""

    def __init__(self, model, ctx: int, eos: int) -> None:
        import torch

        self.torch, self.model, self.eos = torch, model, eos
        self.device = getattr(model, "device", torch.device("cpu"))
        self.state = model.new_state(ctx)
        self.n = 0
        self.logits = None

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def extend(self, tokens: list[int]) -> None:
        with self.torch.inference_mode():
            self.logits = self.model.forward(self.state, tokens)
        self.n += len(tokens)

    def save(self):
        return self.state.clone(), self.n, self.logits

    def reset(self) -> None:
        """Back to an empty session (device states in place: the captured decode graph stays valid)."""
        if hasattr(self.state, "reset"):
            self.state.reset()
        else:
            self.state = self.model.new_state(self.state.ctx)
        self.n, self.logits = 0, None

    def restore(self, saved) -> None:
        state, self.n, self.logits = saved
        if hasattr(self.state, "copy_from"):
            self.state.copy_from(state)  # same buffers: the captured decode graph stays valid
        else:
            self.state = state.clone()

    def greedy(self, n: int) -> list[int]:
        torch = self.torch
        logits = self.logits.clone()
        logits[self.eos] = float("-inf")
        first = int(logits.argmax())
        if hasattr(self.model, "decode_greedy"):
            return self.model.decode_greedy(self.state, first, n, exclude=self.eos).tolist()
        out, tok = [], first
        with torch.inference_mode():
            for _ in range(n):
                out.append(tok)
                logits = self.model.forward(self.state, [tok])
                logits[self.eos] = float("-inf")
                tok = int(logits.argmax())
        return out


def run(a: argparse.Namespace, out, loaded: Loaded | None = None) -> list[dict]:
    """The sweep, --repeats passes from an empty session; a frontier's CSV row (medians over the passes) is
    written as the last pass reaches it. `loaded` reuses an already built model."""
    loaded = loaded or load(a)
    if a.parallel:
        return run_parallel(a, out, loaded)
    if a.decode_at:
        return run_decode_at(a, out, loaded)
    tokens, model = loaded.tokens, loaded.model
    if len(tokens) < a.ctx_max:
        raise BenchError(f"prompt too short: {len(tokens)} tokens, --ctx-max needs at least {a.ctx_max}")
    drv = Driver(model, a.ctx_alloc, loaded.eos)
    warm_up(drv, tokens)
    fronts = frontiers(a.ctx_start, a.ctx_max, a.step_incr, a.step_mul)
    step_bytes = decode_bytes_per_token(model)
    writer = csv.DictWriter(out, COLUMNS, lineterminator="\n")
    writer.writeheader()
    times: list[list[tuple[float, float]]] = [[] for _ in fronts]  # per frontier: (prefill s, decode s)
    rows = []
    for rep in range(a.repeats):
        drv.reset()
        for i, f in enumerate(fronts):
            times[i].append(_frontier_times(drv, tokens[drv.n : f], a.gen_tokens))
            if rep == a.repeats - 1:
                n_new = f - (fronts[i - 1] if i else 0)
                rows.append(_sweep_row(model.cfg, step_bytes, f, n_new, a.gen_tokens, times[i]))
                writer.writerow(rows[-1])
                out.flush()
    return rows


def _frontier_times(drv: Driver, new_tokens: list[int], gen_tokens: int) -> tuple[float, float]:
    """Prefill new_tokens (timed), then gen_tokens greedy tokens from a copy of the state (timed); the
    session is left at the frontier."""
    t0 = time.perf_counter()
    drv.extend(new_tokens)
    drv.sync()
    t_pre = time.perf_counter() - t0
    saved = drv.save()
    drv.sync()
    t0 = time.perf_counter()
    drv.greedy(gen_tokens)
    drv.sync()
    t_gen = time.perf_counter() - t0
    drv.restore(saved)
    return t_pre, t_gen


def _sweep_row(
    cfg, step_bytes: int, f: int, n_new: int, gen_tokens: int, times: list[tuple[float, float]]
) -> dict:
    """One CSV row of frontier f from its passes' (prefill s, decode s): median speeds (of an even count the
    faster middle one, not their mean: with 2 passes, the second; the first pays the longer prefills' JIT
    compiles)."""
    from ds4.engine.snapshot import payload_size

    prefill_tps = statistics.median_high(n_new / t for t, _ in times)
    gen_tps = statistics.median_high(gen_tokens / t for _, t in times)
    return {
        "ctx_tokens": f,
        "prefill_tokens": n_new,
        "prefill_tps": f"{prefill_tps:.2f}",
        "gen_tokens": gen_tokens,
        "gen_tps": f"{gen_tps:.2f}",
        "kvcache_bytes": payload_size(cfg, f),
        "weights_gbps": f"{step_bytes * gen_tps / 1e9:.2f}",
    }


# ---------------------------------------------------------------------------------------------
# --decode-at C,...: decode on sessions filled with random KV rows
# ---------------------------------------------------------------------------------------------


def fill_random(state, depth: int, window: int, seed: int = SYNTHETIC_SEED) -> None:
    """A session's KV as if `depth` tokens had been seen, with random rows (timing only): a device state's
    buffers all random (the position decides what a step reads), a CPU state's ring and compressed rows
    random at their lengths for that depth (its compressor frontiers left empty)."""
    import torch

    gen = torch.Generator(device=getattr(state, "device", "cpu")).manual_seed(seed)
    for layer in state.layers:
        if hasattr(layer, "tensors"):  # DeviceLayerKV: static buffers
            for t in layer.tensors():
                t.normal_(generator=gen)
            continue
        layer.raw = torch.randn(min(depth, window), layer.raw.shape[1], generator=gen)
        if layer.comp is not None:
            layer.comp = torch.randn(depth // layer.ratio, layer.comp.shape[1], generator=gen)
        if layer.index is not None:
            layer.index = torch.randn(depth // layer.ratio, layer.index.shape[1], generator=gen)
    state.n_tokens = depth


def run_decode_at(a: argparse.Namespace, out, loaded: Loaded) -> list[dict]:
    """--decode-at: one sweep-format row per listed context (see the module doc)."""
    import torch

    model = loaded.model
    step_bytes = decode_bytes_per_token(model)
    writer = csv.DictWriter(out, COLUMNS, lineterminator="\n")
    writer.writeheader()
    rows = []
    for ctx in a.decode_at:
        depth = ctx - a.gen_tokens * (a.repeats + 1) - 1
        drv = Driver(model, ctx, loaded.eos)
        fill_random(drv.state, depth, model.cfg.window)
        drv.n, drv.logits = depth, torch.zeros(model.cfg.n_vocab, device=drv.device)
        drv.greedy(a.gen_tokens)  # warm-up: compiles and captures at this context
        times = []
        for _ in range(a.repeats):
            drv.sync()
            t0 = time.perf_counter()
            drv.greedy(a.gen_tokens)
            drv.sync()
            times.append(time.perf_counter() - t0)
        # no prefill: an infinite prefill time gives the row's prefill speed 0, replaced by "" (none run)
        row = _sweep_row(model.cfg, step_bytes, depth, 0, a.gen_tokens, [(math.inf, t) for t in times])
        rows.append({**row, "prefill_tps": ""})
        writer.writerow(rows[-1])
        out.flush()
        del drv  # its buffers go before the next context's (a 1M session holds ~14 GB on the GPU)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# --parallel N: batched decode of N sessions, TTFT of a new request while N - 1 stream
# ---------------------------------------------------------------------------------------------


def _bench_backend(model, ctx: int, n: int):
    """A ModelBackend over n + 1 preallocated sessions: n for the streams (handed out again to each new
    Scheduler, after a reset) and one `base` timeline; restore(session, base) copies base's state."""
    from ds4.engine.batch_backend import ModelBackend

    class BenchBackend(ModelBackend):
        def __init__(self) -> None:
            super().__init__(model, ctx, slots=n + 1)
            self.streams = [super(BenchBackend, self).new_session() for _ in range(n)]
            self.base = super().new_session()
            self._next = 0

        def new_session(self):
            s = self.streams[self._next % n]
            self._next += 1
            self.reset(s)
            return s

        def restore(self, session, base):
            copy_session(session, base)
            return session.logits

    return BenchBackend()


def copy_session(dst, src) -> None:
    """dst (a BatchSession) := src: in place for device states (pool views), else a clone."""
    if hasattr(dst.state, "copy_from"):
        dst.state.copy_from(src.state)
    else:
        dst.state = src.state.clone()
    dst.tokens, dst.logits = list(src.tokens), src.logits


def _greedy_token(logits, eos: int) -> int:
    lg = logits.float().clone()
    lg[eos] = float("-inf")
    return int(lg.argmax())


def time_batched(model, backend, eos: int, steps: int, repeats: int, sync) -> float:
    """Median seconds of `steps` batched greedy decode steps of every stream (each a copy of base)."""
    import torch

    n, V = len(backend.streams), model.cfg.n_vocab
    first = _greedy_token(backend.base.logits, eos)
    start = [(first + 7919 * i) % V for i in range(n)]  # distinct streams: different experts per row
    start = [t if t != eos else (t + 1) % V for t in start]
    times = []
    for rep in range(repeats + 1):  # the first run warms up (kernels, the bucket's CUDA graph)
        for s in backend.streams:
            copy_session(s, backend.base)
        states, toks = [s.state for s in backend.streams], list(start)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(steps if rep else min(steps, 2)):
                logits = model.decode_batch(states, toks)  # [N, V]
                logits[:, eos] = float("-inf")
                toks = logits.argmax(-1).tolist()
        sync()
        if rep:
            times.append(time.perf_counter() - t0)
    for s in backend.streams:
        backend.reset(s)
    return sorted(times)[len(times) // 2]


def time_to_first_token(model, backend, a: argparse.Namespace, eos: int, sync) -> float:
    """Seconds from submitting a new request of a.ttft_prompt tokens to its first token, while N - 1 streams
    (restored copies of base) decode; prefill of at most a.prefill_budget tokens per scheduler step."""
    from ds4.engine.scheduler import Request, Scheduler, Token

    n, base, V = len(backend.streams), backend.base, model.cfg.n_vocab
    events: list = []
    sched = Scheduler(
        backend,
        sampler=lambda req, logits: _greedy_token(logits, eos),
        on_event=events.append,
        slots=n,
        prefill_budget=a.prefill_budget,
        ctx=backend.ctx,
        restore=lambda prompt: (
            (len(base.tokens), base) if prompt[: len(base.tokens)] == base.tokens else None
        ),
    )
    streams = [f"s{i}" for i in range(n - 1)]
    for rid in streams:
        sched.submit(Request(rid, list(base.tokens), max_tokens=backend.ctx))
    for _ in range(3):  # admitted, decoding, graphs of their batch bucket captured
        sched.step()
    prompt = [(t * 31 + 17) % V for t in base.tokens[: a.ttft_prompt]]  # shares no prefix with base
    prompt += [(7 * i + 3) % V for i in range(a.ttft_prompt - len(prompt))]
    del events[:]
    sync()
    t0 = time.perf_counter()
    sched.submit(Request("new", prompt, max_tokens=1))
    while not any(isinstance(e, Token) and e.request_id == "new" for e in events):
        if not sched.step():
            raise BenchError("the scheduler went idle before the new request's first token")
    ttft = time.perf_counter() - t0
    for rid in streams:
        sched.cancel(rid)
    sched.run()
    for s in backend.streams:
        backend.reset(s)
    return ttft


def run_parallel(a: argparse.Namespace, out, loaded: Loaded) -> list[dict]:
    import torch

    tokens, model, n = loaded.tokens, loaded.model, a.parallel
    if len(tokens) < a.ctx_max:
        raise BenchError(f"prompt too short: {len(tokens)} tokens, --ctx-max needs at least {a.ctx_max}")
    device = getattr(model, "device", torch.device("cpu"))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    backend = _bench_backend(model, a.ctx_alloc, n)
    pool = getattr(backend.base.state, "pool", None)
    pool_bytes = pool.nbytes() if pool is not None else 0
    step_bytes = decode_bytes_per_token(model)
    writer = csv.DictWriter(out, PARALLEL_COLUMNS, lineterminator="\n")
    writer.writeheader()
    rows = []
    for f in frontiers(a.ctx_start, a.ctx_max, a.step_incr, a.step_mul):
        base = backend.base
        backend.prefill(base, tokens[len(base.tokens) : f])  # only the new interval
        t = time_batched(model, backend, loaded.eos, a.gen_tokens, a.repeats, sync)
        first = time_to_first_token(model, backend, a, loaded.eos, sync)  # incl. any kernel compiles
        ttft = time_to_first_token(model, backend, a, loaded.eos, sync)
        row = {
            "parallel": n,
            "ctx_tokens": f,
            "gen_tokens": a.gen_tokens,
            "step_ms": f"{1e3 * t / a.gen_tokens:.3f}",
            "gen_tps_aggregate": f"{n * a.gen_tokens / t:.2f}",
            "weights_gbps": f"{step_bytes * a.gen_tokens / t / 1e9:.2f}",
            "ttft_prompt": a.ttft_prompt,
            "ttft_s": f"{ttft:.4f}",
            "ttft_first_s": f"{first:.4f}",
            "kv_pool_bytes": pool_bytes,
        }
        writer.writerow(row)
        out.flush()
        rows.append(row)
    return rows


def warm_up(drv: Driver, tokens: list[int]) -> None:
    """Compile the decode kernels and capture the decode graph outside the timed region, then start over
    (kernels of longer prefills still compile in the first pass: --repeats' median leaves that pass out)."""
    drv.extend(tokens[:8])
    drv.greedy(2)
    drv.reset()
    drv.sync()


def plot(csv_path: Path, title: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("ds4-bench: matplotlib is not installed; skipping --plot", file=sys.stderr)
        return []
    with open(csv_path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    ctx = [int(r["ctx_tokens"]) for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    pre = [(c, float(r["prefill_tps"])) for c, r in zip(ctx, rows, strict=True) if r["prefill_tps"]]
    ax1.plot([c for c, _ in pre], [t for _, t in pre], marker="o")  # --decode-at rows prefill nothing
    ax1.set_ylabel("prefill tokens/s")
    ax2.plot(ctx, [float(r["gen_tps"]) for r in rows], marker="o", color="tab:orange")
    ax2.set_ylabel("decode tokens/s")
    ax2.set_xlabel("context (tokens)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.suptitle(title)
    outs = [csv_path.with_name(csv_path.stem + "_ts" + ext) for ext in (".png", ".svg")]
    for o in outs:
        fig.savefig(o)
    plt.close(fig)
    return outs


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    launch.start(a.gpus, argv, "ds4.bench", a.backend)
    try:
        if a.csv:
            with open(a.csv, "w", newline="") as fh:
                run(a, fh)
            if a.plot:
                for o in plot(Path(a.csv), f"ds4-bench {a.synthetic or Path(a.model).name}"):
                    print(f"ds4-bench: wrote {o}", file=sys.stderr)
        else:
            run(a, sys.stdout)
    except Ds4Error as e:
        print(f"ds4-bench: {e}", file=sys.stderr)
        return 2
    finally:
        _end_distributed()
    return 0


def _end_distributed() -> None:
    dist = launch.current()
    if dist is not None:
        dist.shutdown()  # the followers exit too


if __name__ == "__main__":
    sys.exit(main())
