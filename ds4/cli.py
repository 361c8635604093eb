"""Row 4: the `ds4` command line (product.md §3): one-shot prompts, REPL and the debug tools.

Modes (one function each in MODES): one-shot generation (-p / --prompt-file, or a prompt piped on stdin),
the interactive REPL (ds4.repl; no prompt and a terminal on stdin, or -i), --inspect, --dump-tokens (vocab
only), --dump-logprobs, --perplexity-file. The imatrix collection and the Metal developer diagnostics are
not implemented and say so.

Errors a user can cause print one line `ds4: <message>` on stderr and exit with status 2. Ctrl+C stops a
generation at the next token (exit 130 in one-shot mode; back to the prompt in the REPL); a second Ctrl+C
interrupts at once. Every mode that runs the model holds the single-instance lock (ds4.lock).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TextIO

from ds4 import config, launch
from ds4.errors import Ds4Error, UsageError

if TYPE_CHECKING:
    import torch

    from ds4.engine import Engine, Rng, SamplingParams, Session
    from ds4.engine.generate import Finish, GenerateParams
    from ds4.gguf import ModelFile
    from ds4.tokenizer import Tokenizer

# How to get a real model (product.md §6.6), shown when no model file can be found.
Q2_RELEASE = "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix.gguf"
RELEASE_REPO = "https://huggingface.co/antirez/deepseek-v4-gguf"

# The 7 special strings ds4 looks up by text in the vocabulary (product.md §1.1).
SPECIAL_TOKENS = (
    ("BOS", "<｜begin▁of▁sentence｜>"),
    ("EOS", "<｜end▁of▁sentence｜>"),
    ("<｜User｜>", "<｜User｜>"),
    ("<｜Assistant｜>", "<｜Assistant｜>"),
    ("<think>", "<think>"),
    ("</think>", "</think>"),
    ("｜DSML｜", "｜DSML｜"),
)


# ---------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------


class _Exit(Exception):
    """argparse wants to exit (after --help): carry the status back to main()."""

    def __init__(self, status: int) -> None:
        self.status = status


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # unknown option or missing argument: usage + one line
        self.print_usage(sys.stderr)
        raise UsageError(message)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise _Exit(status)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ds4",
        description="DeepSeek V4 Flash: one-shot prompts, interactive chat, debug tools.",
        allow_abbrev=False,
    )
    m = p.add_argument_group("model and engine")
    m.add_argument(
        "-m",
        "--model",
        metavar="FILE",
        help=f"GGUF model (default ./{config.DEFAULT_MODEL_PATH}; 'tiny' = tiny random test model)",
    )
    m.add_argument("--mtp", metavar="FILE", help="MTP GGUF for speculative decoding")
    m.add_argument(
        "--mtp-draft",
        metavar="N",
        default=str(config.DEFAULT_MTP_DRAFT),
        help=f"draft tokens per step (default %(default)s, capped at {config.MAX_MTP_DRAFT})",
    )
    m.add_argument(
        "--mtp-margin",
        metavar="F",
        default=str(config.DEFAULT_MTP_MARGIN),
        help="MTP acceptance margin, 0..1000 (default %(default)s)",
    )
    m.add_argument(
        "-c",
        "--ctx",
        metavar="N",
        default=str(config.DEFAULT_CTX),
        help="context size in tokens (default %(default)s)",
    )
    for flag in ("metal", "cuda", "cpu"):
        m.add_argument(f"--{flag}", dest="backend", action="store_const", const=flag, help=f"{flag} backend")
    m.add_argument("--backend", choices=("metal", "cuda", "cpu"), help="backend selection")
    m.add_argument("-t", "--threads", metavar="N", help="CPU helper threads")
    m.add_argument(
        "--gpus",
        metavar="N",
        help="N processes, one per GPU, routed experts split over them (re-runs itself under "
        "torch.distributed.run; with --cpu: N CPU processes over gloo)",
    )
    m.add_argument("--quality", action="store_true", help="prefer exact kernels")
    m.add_argument("--warm-weights", action="store_true", help="touch the mapped weights at startup")
    m.add_argument("--dir-steering-file", metavar="FILE", help="directional steering vectors")
    m.add_argument(
        "--dir-steering-ffn", metavar="F", help="FFN steering scale, -100..100 (default 1 with a file)"
    )
    m.add_argument("--dir-steering-attn", metavar="F", help="attention steering scale, -100..100 (default 0)")

    g = p.add_argument_group("prompt and sampling")
    g.add_argument("-p", "--prompt", metavar="TEXT", help="run one prompt and exit")
    g.add_argument("--prompt-file", metavar="FILE", help="run the prompt in FILE and exit")
    g.add_argument(
        "-i",
        "--interactive",
        action="store_true",
        help="run the interactive chat even when stdin is not a terminal",
    )
    g.add_argument(
        "-sys",
        "--system",
        metavar="TEXT",
        default=config.DEFAULT_SYSTEM_PROMPT,
        help="system prompt (default %(default)r; empty string disables it)",
    )
    g.add_argument(
        "-n",
        "--tokens",
        metavar="N",
        default=str(config.DEFAULT_MAX_TOKENS),
        help="max generated tokens (default %(default)s)",
    )
    g.add_argument(
        "--temp",
        metavar="F",
        default=str(config.DEFAULT_TEMPERATURE),
        help="temperature, 0..100; 0 = greedy (default %(default)s)",
    )
    g.add_argument(
        "--top-p", metavar="F", default=str(config.DEFAULT_TOP_P), help="top-p, 0..1 (default %(default)s)"
    )
    g.add_argument(
        "--min-p", metavar="F", default=str(config.DEFAULT_MIN_P), help="min-p, 0..1 (default %(default)s)"
    )
    g.add_argument("--top-k", metavar="N", help="top-k, 0..1024 (default 0 = off; ds4's CLI has no flag)")
    g.add_argument("--seed", metavar="N", help="sampling seed > 0 (default: time-based)")
    for flag, mode in (("think", "high"), ("think-max", "max"), ("nothink", "none")):
        g.add_argument(
            f"--{flag}", dest="think", action="store_const", const=mode, help=f"thinking mode {mode}"
        )

    d = p.add_argument_group("tools and diagnostics")
    d.add_argument("--inspect", action="store_true", help="load the model and print a summary")
    d.add_argument("--dump-tokens", action="store_true", help="print the prompt's token ids (vocab only)")
    d.add_argument("--dump-logprobs", metavar="FILE", help="greedy continuation with top-k logprobs as JSON")
    d.add_argument(
        "--logprobs-top-k",
        metavar="N",
        default=str(config.DEFAULT_LOGPROBS_TOP_K),
        help=f"top-k for --dump-logprobs (default %(default)s, capped at {config.MAX_LOGPROBS_TOP_K})",
    )
    d.add_argument("--perplexity-file", metavar="FILE", help="teacher-forced NLL of a text file")
    d.add_argument("--imatrix-dataset", metavar="FILE", help="rendered prompts for imatrix collection")
    d.add_argument("--imatrix-out", metavar="FILE", help="imatrix output file")
    d.add_argument("--imatrix-max-prompts", metavar="N", help="imatrix: prompts to use")
    d.add_argument("--imatrix-max-tokens", metavar="N", help="imatrix: tokens per prompt")
    for flag in (
        "head-test",
        "first-token-test",
        "metal-graph-test",
        "metal-graph-full-test",
        "metal-graph-prompt-test",
    ):
        d.add_argument(f"--{flag}", action="store_true", help="developer diagnostic")
    d.add_argument("--server", action="store_true", help=argparse.SUPPRESS)
    d.add_argument("--metal-graph-generate", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(think="high")
    return p


# Numeric options, parsed after argparse so every bad value gets `invalid value for OPT: V` (product.md §3.2).
# Integers: option dest -> flag; all must be > 0.
_INT_OPTIONS = {
    "ctx": "--ctx", "tokens": "--tokens", "threads": "--threads", "seed": "--seed",
    "mtp_draft": "--mtp-draft", "top_k": "--top-k",
    "logprobs_top_k": "--logprobs-top-k", "imatrix_max_prompts": "--imatrix-max-prompts",
    "imatrix_max_tokens": "--imatrix-max-tokens", "gpus": "--gpus",
}  # fmt: skip
# Floats: option dest -> (flag, minimum, maximum).
_FLOAT_OPTIONS = {
    "temp": ("--temp", 0.0, 100.0), "top_p": ("--top-p", 0.0, 1.0), "min_p": ("--min-p", 0.0, 1.0),
    "mtp_margin": ("--mtp-margin", 0.0, 1000.0), "dir_steering_ffn": ("--dir-steering-ffn", -100.0, 100.0),
    "dir_steering_attn": ("--dir-steering-attn", -100.0, 100.0),
}  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags; numbers are converted here so every bad value gets the same message."""
    args = build_parser().parse_args(argv)
    for dest, flag in _INT_OPTIONS.items():
        text = getattr(args, dest)
        if text is not None:
            setattr(args, dest, _int_value(flag, text))
    for dest, (flag, lo, hi) in _FLOAT_OPTIONS.items():
        text = getattr(args, dest)
        if text is not None:
            setattr(args, dest, _float_value(flag, text, lo, hi))
    args.mtp_draft = min(args.mtp_draft, config.MAX_MTP_DRAFT)
    args.logprobs_top_k = min(args.logprobs_top_k, config.MAX_LOGPROBS_TOP_K)
    if args.dir_steering_file:
        args.dir_steering_ffn = 1.0 if args.dir_steering_ffn is None else args.dir_steering_ffn
    args.dir_steering_ffn = args.dir_steering_ffn or 0.0
    args.dir_steering_attn = args.dir_steering_attn or 0.0
    return args


def _int_value(flag: str, text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        value = 0
    if value <= 0:
        raise UsageError(f"invalid value for {flag}: {text}")
    return value


def _float_value(flag: str, text: str, lo: float, hi: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"invalid value for {flag}: {text}") from None
    if not lo <= value <= hi:  # also rejects nan
        raise UsageError(f"invalid value for {flag}: {text} (expected {lo:g}..{hi:g})")
    return value


# ---------------------------------------------------------------------------------------------------
# Model path
# ---------------------------------------------------------------------------------------------------


def resolve_model_path(model: str | None) -> Path:
    """-m PATH; -m tiny -> the cached tiny synthetic model; no -m -> ./ds4flash.gguf if present."""
    if model == config.TINY_MODEL_ALIAS:
        try:
            from ds4.tools.make_model import ensure_tiny_model, tiny_model_path  # builds it once (seconds)
        except ImportError as e:
            raise UsageError(f"-m tiny needs ds4.tools.make_model, which failed to import: {e}") from None
        if not tiny_model_path().exists():
            print(f"ds4: building the tiny test model once: {tiny_model_path()}", file=sys.stderr)
        return Path(ensure_tiny_model())
    if model is not None:
        return Path(model)
    default = Path(config.DEFAULT_MODEL_PATH)
    if default.exists():
        return default
    raise UsageError(
        f"no model file: ./{config.DEFAULT_MODEL_PATH} not found. Download the q2 release GGUF for ds4 "
        f"({Q2_RELEASE} from {RELEASE_REPO}) and pass it with -m FILE or save it as "
        f"./{config.DEFAULT_MODEL_PATH}; or try -m tiny for a small random-weight test model"
    )


# ---------------------------------------------------------------------------------------------------
# --inspect
# ---------------------------------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
    from ds4.gguf import open_model

    path = resolve_model_path(args.model)
    start = time.perf_counter()
    with open_model(path) as mf:
        open_ms = (time.perf_counter() - start) * 1000
        for line in inspect_lines(mf, open_ms):
            print(line)
    return 0


def inspect_lines(mf: ModelFile, open_ms: float | None = None) -> list[str]:
    """The --inspect summary of an opened model, as lines."""
    cfg = mf.config
    opened = f", opened in {open_ms:.1f} ms" if open_ms is not None else ""
    lines = [
        f"file: {mf.path}",
        f"file size: {mf.file_size:,} bytes ({mf.file_size / 2**30:.2f} GiB), GGUF v{mf.version}, "
        f"alignment {mf.alignment}, {len(mf.metadata)} metadata keys, {len(mf.tensors)} tensors{opened}",
        f"name: {cfg.name or '(none)'}",
        f"preset: {_preset_text(cfg)}",
        f"layers: {_layer_kinds(cfg)}",
        "shape:",
        *_wrap_fields(cfg),
        *_quant_lines(mf),
        *_tokenizer_lines(mf),
    ]
    return lines


def _preset_text(cfg: config.ModelConfig) -> str:
    from dataclasses import fields

    name = cfg.preset_name
    if name == "flash":
        return "flash (DeepSeek V4 Flash)"
    if name == "tiny":
        return "tiny (the ds4 tiny synthetic test shape)"
    skip = {"name", "context_length"}
    diff = [
        f.name
        for f in fields(cfg)
        if f.name not in skip and getattr(cfg, f.name) != getattr(config.FLASH, f.name)
    ]
    more = f" and {len(diff) - 8} more" if len(diff) > 8 else ""
    return f"custom (differs from Flash in {', '.join(diff[:8])}{more})"


def _layer_kinds(cfg: config.ModelConfig) -> str:
    counts: dict[str, int] = {}
    for ratio in cfg.compress_ratios:
        kind = "dense" if ratio == 0 else ("ratio-4 + indexer" if ratio == 4 else f"ratio-{ratio}")
        counts[kind] = counts.get(kind, 0) + 1
    hashed = f", {cfg.n_hash_layers} hash-routed" if cfg.n_hash_layers else ""
    return f"{cfg.n_layer} ({', '.join(f'{n} {k}' for k, n in counts.items())}{hashed})"


def _format_value(value: object) -> str:
    if isinstance(value, tuple):
        if value and all(v == value[0] for v in value):
            return f"{_format_value(value[0])}x{len(value)}"
        return ",".join(_format_value(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return repr(value)
    return str(value)


def _wrap_fields(cfg: config.ModelConfig, width: int = 100) -> list[str]:
    from dataclasses import fields

    lines, line = [], ""
    for f in fields(cfg):
        if f.name == "name":
            continue
        item = f"{f.name}={_format_value(getattr(cfg, f.name))}"
        if line and len(line) + 1 + len(item) > width:
            lines.append(line)
            line = ""
        line = f"{line} {item}" if line else f"  {item}"
    return lines + ([line] if line else [])


def _quant_lines(mf: ModelFile) -> list[str]:
    from ds4.quant.types import type_name

    per_type: dict[str, list[int]] = {}
    for info in mf.tensors.values():
        entry = per_type.setdefault(info.type_name, [0, 0])
        entry[0] += 1
        entry[1] += info.nbytes
    total = sum(n for _, n in per_type.values())
    gate = mf.tensors["blk.0.ffn_gate_exps.weight"].qtype
    down = mf.tensors["blk.0.ffn_down_exps.weight"].qtype
    lines = [
        f"quant: family {mf.quant_family}, routed experts gate/up {type_name(gate)}, down {type_name(down)} "
        f"(layer 0; expert bits {mf.expert_quant_bits})"
    ]
    for name, (count, nbytes) in sorted(per_type.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {name:<8} {count:5d} tensors {nbytes:>16,} bytes {nbytes / 2**30:8.2f} GiB")
    lines.append(f"tensor data: {total / 2**30:.2f} GiB ({total:,} bytes)")
    return lines


def _tokenizer_lines(mf: ModelFile) -> list[str]:
    tokens = mf.tokens()
    index: dict[str, int] = {}
    for text in dict(SPECIAL_TOKENS).values():
        try:
            index[text] = tokens.index(text)
        except ValueError:
            pass
    specials = " ".join(f"{label}={index.get(text, 'MISSING')}" for label, text in SPECIAL_TOKENS)
    model = mf.metadata.get("tokenizer.ggml.model", "?")
    pre = mf.metadata.get("tokenizer.ggml.pre", "?")
    return [
        f"tokenizer: {len(tokens)} tokens, {len(mf.merges())} merges (model {model}, pre {pre})",
        f"special tokens: {specials}",
    ]


# ---------------------------------------------------------------------------------------------------
# Shared pieces of the generating modes: engine + lock, prompt, terminal output
# ---------------------------------------------------------------------------------------------------

GREY, RESET = "\x1b[90m", "\x1b[0m"


def default_backend() -> str:
    from ds4.engine.engine import BACKENDS

    if "cuda" in BACKENDS:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    return "cpu"


def requested_threads(args: argparse.Namespace) -> int | None:
    """-t N (or $DS4_THREADS): torch intra-op threads; None lets the engine choose."""
    return int(args.threads) if args.threads else _env_threads()


def _env_threads() -> int | None:
    text = os.environ.get("DS4_THREADS", "")
    return int(text) if text.isdigit() and int(text) > 0 else None


def open_engine(args: argparse.Namespace, stack: contextlib.ExitStack) -> Engine:
    """Take the instance lock, then load the model (the lock is released when `stack` closes).

    Under torchrun (rank 0 of several) the followers are told what to load, and the engine's model becomes
    a ds4.dist.Leader that mirrors every call to them."""
    from ds4.engine import Engine
    from ds4.lock import InstanceLock

    path = resolve_model_path(args.model)
    stack.enter_context(InstanceLock())
    backend, threads = args.backend or default_backend(), requested_threads(args)
    dist = launch.current()
    if dist is not None:
        dist.leader_message(("load", str(path), backend, threads))
    engine = Engine.open(path, backend=backend, threads=threads)
    stack.callback(engine.close)
    if dist is not None:
        engine.model = dist.wrap_or_follow(engine.model)
    return engine


def follower_main() -> int:
    """Ranks > 0: wait for rank 0 to name the model, load it, run the ops rank 0 mirrors (silently)."""
    from ds4 import dist
    from ds4.engine import Engine

    dist.ignore_interrupts()
    _, path, backend, threads = dist.leader_message()  # exits the process if rank 0 loads nothing
    engine = Engine.open(path, backend=backend, threads=threads)
    dist.wrap_or_follow(engine.model)  # returns only by exiting the process
    return 0


def prompt_text(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    return read_text_file(args.prompt_file, "--prompt-file")


def read_text_file(path: str, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} {path} is not UTF-8 text: {e.reason} at byte {e.start}") from None


def think_mode(requested: str, ctx: int, *, warn: bool = True) -> str:
    """The effective thinking mode: Think Max needs ctx >= 393216, else normal thinking (product.md §1.3)."""
    from ds4.chat import THINK_MAX_MIN_CTX, effective_mode

    mode = effective_mode(requested, ctx)
    if warn and requested == "max" and mode != "max":
        print(
            f"ds4: warning: --think-max needs --ctx >= {THINK_MAX_MIN_CTX}; "
            f"ctx={ctx} uses normal thinking instead",
            file=sys.stderr,
        )
    return mode


def build_prompt(tok: Tokenizer, args: argparse.Namespace, text: str) -> list[int]:
    """Raw mode when the text starts with BOS (specials recognised, no template); else the §1.4 template."""
    from ds4.chat import encode_chat_prompt
    from ds4.tokenizer import BOS

    if text.startswith(BOS):
        return tok.encode_chat(text)
    return encode_chat_prompt(tok, args.system, text, think_mode(args.think, args.ctx))


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    from ds4.engine.sampling import SamplingParams

    return SamplingParams(args.temp, args.top_k or 0, args.top_p, args.min_p, args.seed)


class StreamPrinter:
    """Writes reasoning and answer deltas: reasoning grey on a terminal (plain otherwise), tags removed,
    a newline between reasoning and answer when needed, a trailing newline at the end (product.md §3.2)."""

    def __init__(self, out: TextIO, color: bool | None = None) -> None:
        self.out = out
        self.color = out.isatty() if color is None else color
        self.in_reasoning = False
        self.at_line_start = True

    def reasoning(self, text: str) -> None:
        if not self.in_reasoning:
            self.in_reasoning = True
            if self.color:
                self.out.write(GREY)
        self._write(text)

    def text(self, text: str) -> None:
        self._end_reasoning()
        self._write(text)

    def done(self) -> None:
        self._end_reasoning()
        if not self.at_line_start:
            self._write("\n")

    def _end_reasoning(self) -> None:
        if self.in_reasoning:
            self.in_reasoning = False
            if self.color:
                self.out.write(RESET)
            if not self.at_line_start:
                self._write("\n")

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
            self.at_line_start = text.endswith("\n")


def prefill_progress(enabled: bool) -> Callable[[int, int], None] | None:
    """`processing N input tokens: a/N (p%)` on stderr, updated in place; only on a terminal."""
    if not enabled:
        return None

    def show(done: int, total: int) -> None:
        pct = 100.0 * done / total if total else 100.0
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\rprocessing {total} input tokens: {done}/{total} ({pct:.0f}%){end}")
        sys.stderr.flush()

    return show


def stats_line(fin: Finish) -> str:
    """The timing line on stderr; the parenthesis tells how much of the prompt came from the live KV."""
    u, t = fin.usage, fin.timing
    return (
        f"ds4: prefill: {t.prefill_tps:.2f} t/s, generation: {t.decode_tps:.2f} t/s "
        f"(prompt {u.prompt_tokens} tokens: {u.prefilled_tokens} prefilled, {u.reused_tokens} reused; "
        f"{u.generated_tokens} generated)"
    )


@contextlib.contextmanager
def interrupt_sets(event: threading.Event) -> Iterator[None]:
    """While active, the first Ctrl+C sets `event` (generation stops at the next token); a second one
    raises KeyboardInterrupt as usual. Outside the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        if event.is_set():
            raise KeyboardInterrupt
        event.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_generation(
    session: Session,
    prompt: list[int],
    params: GenerateParams,
    printer: StreamPrinter,
    *,
    rng: Rng | None = None,
    on_token: Callable[[int], None] | None = None,
) -> Finish:
    """Stream one generation to `printer` with Ctrl+C as the cancel flag; prints the stats line."""
    from ds4.engine.generate import Finish, ReasoningDelta, TextDelta, TokenEvent, generate

    cancel = threading.Event()
    progress = prefill_progress(sys.stderr.isatty())
    fin: Finish | None = None
    with interrupt_sets(cancel):
        for ev in generate(session, prompt, params, rng=rng, cancel=cancel, progress=progress):
            if isinstance(ev, ReasoningDelta):
                printer.reasoning(ev.text)
            elif isinstance(ev, TextDelta):
                printer.text(ev.text)
            elif isinstance(ev, TokenEvent):
                if on_token is not None:
                    on_token(ev.token)
            elif isinstance(ev, Finish):
                fin = ev
    assert fin is not None  # generate always ends with a Finish
    printer.done()
    if fin.reason == "error":
        print(f"ds4: {fin.error}", file=sys.stderr)
    print(stats_line(fin), file=sys.stderr)
    return fin


# ---------------------------------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------------------------------


def cmd_one_shot(args: argparse.Namespace) -> int:
    from ds4.engine.generate import GenerateParams

    text = prompt_text(args) if args.prompt is not None or args.prompt_file else sys.stdin.read()
    with contextlib.ExitStack() as stack:
        engine = open_engine(args, stack)
        prompt = build_prompt(engine.tokenizer, args, text)
        session = engine.session(args.ctx, checkpoint=False)
        params = GenerateParams(max_tokens=args.tokens, sampling=sampling_params(args))
        fin = run_generation(session, prompt, params, StreamPrinter(sys.stdout))
    if fin.reason == "cancelled":
        return 130
    return 1 if fin.reason == "error" else 0


def cmd_repl(args: argparse.Namespace) -> int:
    from ds4.repl import run_repl

    with contextlib.ExitStack() as stack:
        engine = open_engine(args, stack)
        return run_repl(engine, args)


def cmd_dump_tokens(args: argparse.Namespace) -> int:
    from ds4.tokenizer import dump_tokens

    text = prompt_text(args)
    sys.stdout.write(dump_tokens(resolve_model_path(args.model), text))
    return 0


def cmd_dump_logprobs(args: argparse.Namespace) -> int:
    """Greedy continuation with the top-k log-probabilities of every step, as ds4's JSON (§3.5)."""
    text = prompt_text(args) if args.prompt is not None or args.prompt_file else ""
    with contextlib.ExitStack() as stack:
        engine = open_engine(args, stack)
        tok = engine.tokenizer
        prompt = build_prompt(tok, args, text)
        session = engine.session(args.ctx, checkpoint=False)
        session.sync(prompt, prefill_progress(sys.stderr.isatty()))
        room = args.ctx - len(prompt)
        steps = 0 if room <= 1 else min(args.tokens, room - 1)
        k = args.logprobs_top_k
        parts = [f'{{\n  "source":"ds4",\n  "prompt_tokens":{len(prompt)},\n  "ctx":{args.ctx},\n']
        parts.append(f'  "top_k":{k},\n  "steps":[\n')
        for step in range(steps):
            logits = session.logits
            token = int(logits.argmax())
            parts.append(",\n" if step else "")
            parts.append(f'    {{"step":{step},"selected":{json_token(tok, token)},"top_logprobs":[')
            parts.append(",".join(top_logprob_items(tok, logits, k)) + "]}")
            if token == tok.eos_id:
                break
            if step + 1 < steps:
                session.eval(token)
        parts.append("\n  ]\n}\n")
    try:
        Path(args.dump_logprobs).write_text("".join(parts), encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot write --dump-logprobs file {args.dump_logprobs}: {e.strerror}") from None
    return 0


def json_token(tok: Tokenizer, token: int) -> str:
    """`{"id":I,"text":"…","bytes":[…]}` as ds4 writes it: `"`, `\\`, \\n, \\r, \\t escaped, other control
    bytes as \\u00XX; when the piece is not valid UTF-8, every byte >= 0x80 too (`bytes` is authoritative)."""
    raw = tok.token_bytes(token)
    try:
        raw.decode("utf-8")
        valid = True
    except UnicodeDecodeError:
        valid = False
    text = bytearray()
    for b in raw:
        if b in _JSON_ESCAPES:
            text += _JSON_ESCAPES[b]
        elif b < 0x20 or (not valid and b >= 0x80):
            text += f"\\u{b:04x}".encode()
        else:
            text.append(b)
    ids = ",".join(str(b) for b in raw)
    return f'{{"id":{token},"text":"{text.decode("utf-8")}","bytes":[{ids}]}}'


_JSON_ESCAPES = {
    ord('"'): b'\\"',
    ord("\\"): b"\\\\",
    ord("\n"): b"\\n",
    ord("\r"): b"\\r",
    ord("\t"): b"\\t",
}


def top_logprob_items(tok: Tokenizer, logits: torch.Tensor, k: int) -> list[str]:
    """Top-k by logit (descending; ties: lower id first), log-softmax over the finite logits of the vocab."""
    import torch

    x = logits.detach().float().reshape(-1)  # [V]
    finite = torch.isfinite(x)
    lse = float(torch.logsumexp(x[finite].double(), 0))
    masked = torch.where(finite, x, torch.full_like(x, float("-inf")))
    vals, ids = torch.sort(masked, descending=True, stable=True)
    items = []
    for v, i in zip(vals[:k].tolist(), ids[:k].tolist(), strict=True):
        if v == float("-inf"):
            break
        items.append(f'{{"token":{json_token(tok, i)},"logit":{v:.9g},"logprob":{v - lse:.9g}}}')
    return items


PERPLEXITY_PREFIX = 32  # tokens of context before scoring starts (product.md §3.6)


def cmd_perplexity(args: argparse.Namespace) -> int:
    """Teacher-forced NLL of a text file (plain BPE, no template) after a 32-token prefix (§3.6)."""
    import torch

    text = read_text_file(args.perplexity_file, "--perplexity-file")
    with contextlib.ExitStack() as stack:
        engine = open_engine(args, stack)
        ids = engine.tokenizer.encode(text)
        if len(ids) <= PERPLEXITY_PREFIX:
            raise UsageError(
                f"--perplexity-file needs more than {PERPLEXITY_PREFIX} tokens to score, "
                f"{args.perplexity_file} has {len(ids)}"
            )
        if args.ctx <= PERPLEXITY_PREFIX + 1:
            raise UsageError(f"--perplexity-file needs --ctx > {PERPLEXITY_PREFIX + 1}, got {args.ctx}")
        targets = ids[PERPLEXITY_PREFIX:][: min(args.tokens, args.ctx - PERPLEXITY_PREFIX)]
        session = engine.session(args.ctx, checkpoint=False)
        session.sync(ids[:PERPLEXITY_PREFIX], prefill_progress(sys.stderr.isatty()))
        nll = 0.0
        for j, target in enumerate(targets):
            logp = torch.log_softmax(session.logits.double(), 0)  # [V]
            nll -= float(logp[target])
            if j + 1 < len(targets):
                session.eval(target)
    n = len(targets)
    print(f"tokens={len(ids)} scored={n} nll={nll:.9f} avg_nll={nll / n:.9f} ppl={math.exp(nll / n):.9f}")
    return 0


def _not_implemented(what: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise UsageError(f"{what} is not implemented yet")

    return run


MODES: dict[str, Callable[[argparse.Namespace], int]] = {
    "inspect": cmd_inspect,
    "dump-tokens": cmd_dump_tokens,
    "dump-logprobs": cmd_dump_logprobs,
    "perplexity": cmd_perplexity,
    "imatrix": _not_implemented("imatrix collection (--imatrix-dataset)"),
    "diagnostic": _not_implemented(
        "the developer diagnostics (--head-test, --first-token-test, --metal-graph-*)"
    ),
    "one-shot": cmd_one_shot,
    "repl": cmd_repl,
}

_DIAGNOSTICS = ("head_test", "first_token_test", "metal_graph_test", "metal_graph_full_test",
                "metal_graph_prompt_test")  # fmt: skip


def select_mode(args: argparse.Namespace) -> str:
    """Which mode the flags ask for, rejecting contradictory combinations (product.md §3.1-3.2)."""
    if args.server:
        raise UsageError("use ds4-server for the HTTP server")
    if args.metal_graph_generate:
        raise UsageError("--metal-graph-generate was removed; use -p with --temp 0 for greedy generation")
    if args.backend == "metal":
        raise UsageError("the metal backend is not available in this ds4 (use --cuda or --cpu)")
    has_prompt = args.prompt is not None or args.prompt_file is not None
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("specify only one prompt source")
    if args.perplexity_file and args.prompt is not None:
        raise UsageError("--perplexity-file cannot be combined with -p")
    if bool(args.imatrix_dataset) != bool(args.imatrix_out):
        raise UsageError("--imatrix-dataset and --imatrix-out require each other")
    if args.inspect:
        return "inspect"
    if args.dump_tokens:
        if not has_prompt:
            raise UsageError("--dump-tokens requires -p or --prompt-file")
        return "dump-tokens"
    if args.dump_logprobs:
        return "dump-logprobs"
    if args.perplexity_file:
        return "perplexity"
    if args.imatrix_dataset:
        return "imatrix"
    if any(getattr(args, d) for d in _DIAGNOSTICS):
        return "diagnostic"
    if has_prompt or not (args.interactive or sys.stdin.isatty()):
        return "one-shot"  # no prompt and no terminal: the prompt is read from stdin
    return "repl"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        mode = select_mode(args)
        dist = launch.start(args.gpus, argv, "ds4", args.backend)
        if dist is not None and dist.rank() > 0:
            return follower_main()
        try:
            return MODES[mode](args)
        finally:
            if dist is not None:
                dist.shutdown()
    except _Exit as e:
        return e.status
    except Ds4Error as e:
        print(f"ds4: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `ds4 --inspect | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
