"""`ds4-server`: flags (product.md §4.1), model load, worker thread, uvicorn."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from collections.abc import Sequence
from typing import Any

from ds4 import config, launch
from ds4.engine.stepper import DEFAULT_GATHER_S  # torch-free: --help stays light

EPILOG = f"""\
Thinking is on (effort high) unless the request disables it (thinking: {{type: disabled}}, think: false,
reasoning_effort: none, or model deepseek-chat); in thinking mode the client's sampling knobs are ignored
and temperature {config.DEFAULT_TEMPERATURE}, top_p {config.DEFAULT_TOP_P}, min_p {config.DEFAULT_MIN_P}
are used.
Disk cache (--kv-disk-dir): a cold prompt of min..cold-max tokens is saved at its system-prompt anchor,
long sessions every continued-interval tokens (aligned), and the live session when another prompt evicts it.
Live sessions (--parallel N): a request continues the idle session holding the longest prefix of its prompt,
else takes an empty one, else evicts the least recently used idle one (saved to the disk cache first); the
running streams' decode steps are batched. The KV budget is logged at start-up and exported on /metrics.
"""


MAX_AUTO_PARALLEL = 32  # the automatic --parallel on cuda never exceeds this
CPU_PARALLEL = 4  # the CPU backend's default --parallel
KV_MEMORY_SHARE = 0.9  # share of the free memory the automatic --parallel fills with KV states
PARALLEL_PREFILL_BUDGET = 512  # prefill tokens per step when streams share the model


def default_parallel(backend: str, free_bytes: int | None, bytes_per_session: int, scratch: int = 0) -> int:
    """--parallel when none is given: cuda fills 90% of the free memory (at most 32 sessions, next to the
    pool's `scratch` bytes); cpu: 4."""
    if backend != "cuda":
        return CPU_PARALLEL
    if free_bytes is None or bytes_per_session <= 0:
        return 1
    fit = (int(KV_MEMORY_SHARE * free_bytes) - scratch) // bytes_per_session
    return max(1, min(MAX_AUTO_PARALLEL, fit))


def build_worker(
    engine: Any,
    ctx: int,
    *,
    parallel: int | None = None,
    prefill_budget: int | None = None,
    gather_s: float = DEFAULT_GATHER_S,
    checkpoint: bool = True,
    **worker_kw: Any,
) -> tuple[Any, Any]:
    """The worker over `parallel` live sessions whose model calls share one Stepper; logs the KV budget.
    Returns (worker, stepper); the caller stops the worker first, then the stepper."""
    from ds4.engine.stepper import Stepper
    from ds4.server.worker import KVBudget, Worker

    device_checkpoint = checkpoint and engine.backend == "cuda"  # a pooled checkpoint buffer per session
    per_session = engine.session_nbytes(ctx, checkpoint=device_checkpoint)
    # a device pool holds one scratch slot (the padded rows of a batched step) per pool: states, checkpoints
    scratch = per_session if engine.backend == "cuda" else 0
    free = engine.free_memory()
    n = parallel if parallel is not None else default_parallel(engine.backend, free, per_session, scratch)
    if n < 1:
        raise ValueError(f"--parallel must be at least 1, got {n}")
    budget = prefill_budget or (config.PREFILL_CHUNK if n == 1 else PARALLEL_PREFILL_BUDGET)
    stepper = Stepper(engine.model, prefill_budget=budget, gather_s=gather_s, fetch=engine.host_logits)
    try:
        sessions = engine.sessions(n, ctx, checkpoint=checkpoint, forward=stepper.forward, call=stepper.call)
    except BaseException:
        stepper.stop()
        raise
    kv_budget = KVBudget(n, ctx, per_session, free, scratch)
    logging.getLogger("ds4.server").info("%s", kv_budget.line())
    worker = Worker(engine.tokenizer, sessions, stepper=stepper, kv_budget=kv_budget, **worker_kw)
    return worker, stepper


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ds4-server",
        description="OpenAI / Anthropic / Responses compatible server for DeepSeek V4 Flash",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("-m", "--model", help=f"GGUF model (default ./{config.DEFAULT_MODEL_PATH}; 'tiny' = tiny test model)")
    add("-c", "--ctx", type=int, default=config.DEFAULT_CTX, help="context size (default %(default)s)")
    add(
        "-n",
        "--tokens",
        type=int,
        default=config.SERVER_DEFAULT_MAX_TOKENS,
        help="default max_tokens when the client omits it (default %(default)s)",
    )
    add("--max-tokens-limit", type=int, default=None, help="clamp any client max_tokens to this")
    add(
        "--max-body-mb",
        type=int,
        default=config.SERVER_MAX_BODY_BYTES >> 20,
        help="largest request body in MiB (default %(default)s)",
    )
    add("-t", "--threads", type=int, default=None, help="CPU threads")
    add(
        "--backend",
        choices=("cpu", "cuda"),
        default=None,
        help="backend (default: cuda when a GPU is present)",
    )
    add(
        "--gpus",
        type=int,
        default=None,
        help="run on N GPUs (expert parallel; re-launches under torchrun, one process per GPU)",
    )
    add("--cpu", dest="backend", action="store_const", const="cpu", help="same as --backend cpu")
    add("--cuda", dest="backend", action="store_const", const="cuda", help="same as --backend cuda")
    add("--host", default=config.DEFAULT_HOST, help="IPv4 address to listen on (default %(default)s)")
    add("--port", type=int, default=config.DEFAULT_PORT, help="port (default %(default)s)")
    add("--cors", action="store_true", help="send Access-Control-Allow-* headers on every response")
    add("--api-key", default=None, help="require Authorization: Bearer KEY or x-api-key: KEY")
    add("--trace", default=None, metavar="FILE", help="append a human-readable trace of every request")
    add("--kv-disk-dir", default=None, help="enable the disk KV cache in DIR")
    add("--kv-disk-space-mb", type=int, default=config.KV_DISK_SPACE_MB)
    add("--kv-cache-min-tokens", type=int, default=config.KV_CACHE_MIN_TOKENS)
    add("--kv-cache-cold-max-tokens", type=int, default=config.KV_CACHE_COLD_MAX_TOKENS)
    add("--kv-cache-continued-interval-tokens", type=int, default=config.KV_CACHE_CONTINUED_INTERVAL_TOKENS)
    add("--kv-cache-boundary-trim-tokens", type=int, default=config.KV_CACHE_BOUNDARY_TRIM_TOKENS)
    add("--kv-cache-boundary-align-tokens", type=int, default=config.KV_CACHE_BOUNDARY_ALIGN_TOKENS)
    add("--kv-cache-reject-different-quant", action="store_true")
    add(
        "--parallel",
        type=int,
        default=None,
        metavar="N",
        help="live sessions kept at once, their decode steps batched (default: cuda: as many as fit in "
        f"90%% of the GPU memory free after the weights, at most {MAX_AUTO_PARALLEL}; cpu: {CPU_PARALLEL})",
    )
    add(
        "--prefill-budget",
        type=int,
        default=None,
        metavar="T",
        help="prefill tokens per batched step, so running streams never wait for a whole prompt "
        f"(default {config.PREFILL_CHUNK} with --parallel 1, else {PARALLEL_PREFILL_BUDGET})",
    )
    add(
        "--batch-gather-ms",
        type=float,
        default=DEFAULT_GATHER_S * 1000,
        metavar="MS",
        help="longest wait of a decode step for the other running streams' tokens (default %(default)s)",
    )
    add("--nothink", action="store_true", help="thinking off for requests that do not ask for it")
    add("--tool-memory-max-ids", type=int, default=config.TOOL_MEMORY_MAX_IDS)
    add("--disable-exact-dsml-tool-replay", action="store_true")
    return p


def _host(text: str) -> str:
    host = "127.0.0.1" if text == "localhost" else text
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise SystemExit(f"ds4-server: --host must be an IPv4 address, got {text!r}") from None
    return host


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%m%d %H:%M:%S"
    )
    host = _host(args.host)
    if args.ctx < 2 or args.tokens < 0 or not 0 < args.port < 65536:
        print("ds4-server: --ctx must be >= 2, --tokens >= 0 and --port in 1..65535", file=sys.stderr)
        return 2
    if (args.parallel is not None and args.parallel < 1) or (
        args.prefill_budget is not None and args.prefill_budget < 1
    ):
        print("ds4-server: --parallel and --prefill-budget must be at least 1", file=sys.stderr)
        return 2
    if args.gpus is not None and args.gpus < 1:
        print("ds4-server: --gpus must be at least 1", file=sys.stderr)
        return 2
    dist = launch.start(args.gpus, argv, "ds4.server.main", args.backend)
    import uvicorn

    from ds4.cli import resolve_model_path
    from ds4.dsml import ToolMemory
    from ds4.engine import Engine
    from ds4.errors import Ds4Error
    from ds4.server.app import ServerOptions, create_app
    from ds4.server.worker import WorkerOptions

    try:
        path = (
            resolve_model_path(args.model)
            if dist is None
            else dist.on_leader(lambda: resolve_model_path(args.model))
        )
        engine = Engine.open(path, backend=args.backend, threads=args.threads)
    except (Ds4Error, OSError, ValueError) as err:
        print(f"ds4-server: {err}", file=sys.stderr)
        return 1
    if dist is not None:  # rank 0 serves through a mirror of the model; the other ranks follow, then exit
        engine.model = dist.wrap_or_follow(engine.model)
    kv = None
    if args.kv_disk_dir:
        from ds4.kvstore import KVStore

        try:
            kv = KVStore(
                args.kv_disk_dir,
                space_mb=args.kv_disk_space_mb,
                min_tokens=args.kv_cache_min_tokens,
                cold_max_tokens=args.kv_cache_cold_max_tokens,
                continued_interval_tokens=args.kv_cache_continued_interval_tokens,
                boundary_trim_tokens=args.kv_cache_boundary_trim_tokens,
                boundary_align_tokens=args.kv_cache_boundary_align_tokens,
                ctx=args.ctx,
                quant_bits=engine.model_file.expert_quant_bits,
                reject_different_quant=args.kv_cache_reject_different_quant,
            )
        except (Ds4Error, OSError, ValueError) as err:
            print(f"ds4-server: disk cache: {err}", file=sys.stderr)
            return 2
    trace = open(args.trace, "a", encoding="utf-8", buffering=1) if args.trace else None  # noqa: SIM115
    exact = not args.disable_exact_dsml_tool_replay
    try:
        worker, stepper = build_worker(
            engine,
            args.ctx,
            parallel=args.parallel,
            prefill_budget=args.prefill_budget,
            gather_s=max(0.0, args.batch_gather_ms) / 1000,
            options=WorkerOptions(ctx=args.ctx, default_max_tokens=args.tokens, exact_replay=exact),
            kvstore=kv,
            tool_memory=ToolMemory(max_ids=args.tool_memory_max_ids),
            trace=trace,
        )
    except (Ds4Error, ValueError, RuntimeError) as err:  # e.g. the sessions do not fit in memory
        print(f"ds4-server: {err}", file=sys.stderr)
        engine.close()
        return 2
    worker.start()
    opt = ServerOptions(
        ctx=args.ctx,
        default_max_tokens=args.tokens,
        max_tokens_limit=args.max_tokens_limit,
        api_key=args.api_key,
        cors=args.cors,
        max_body_bytes=args.max_body_mb << 20,
        exact_replay=exact,
        default_mode="none" if args.nothink else "high",
    )
    try:
        uvicorn.run(create_app(worker, opt), host=host, port=args.port, log_level="warning", lifespan="off")
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl+C after its shutdown: ours follows below
        pass
    finally:
        worker.stop()
        stepper.stop()
        if kv is not None:
            worker.store_shutdown()
        engine.close()
        if trace is not None:
            trace.close()
        if dist is not None:
            dist.shutdown()  # the followers exit too
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
