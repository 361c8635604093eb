"""Row 4: the `ds4` command line (product.md §3): one-shot prompts, REPL and the debug tools.

This first version implements `--inspect`; every other mode parses its flags (the full flag set of §3.2)
and reports "not implemented yet". Each mode is one function in MODES, so later work replaces entries.

Errors a user can cause print one line `ds4: <message>` on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from ds4 import config
from ds4.errors import Ds4Error, UsageError

if TYPE_CHECKING:
    from ds4.gguf import ModelFile

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
    "mtp_draft": "--mtp-draft",
    "logprobs_top_k": "--logprobs-top-k", "imatrix_max_prompts": "--imatrix-max-prompts",
    "imatrix_max_tokens": "--imatrix-max-tokens",
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
            from ds4.tools.make_model import ensure_tiny_model  # builds it once (seconds)
        except ImportError as e:
            raise UsageError(f"-m tiny needs ds4.tools.make_model, which failed to import: {e}") from None
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
# Modes
# ---------------------------------------------------------------------------------------------------


def _not_implemented(what: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise UsageError(f"{what} is not implemented yet")

    return run


# mode -> handler; later work replaces the placeholders.
MODES: dict[str, Callable[[argparse.Namespace], int]] = {
    "inspect": cmd_inspect,
    "dump-tokens": _not_implemented("--dump-tokens"),
    "dump-logprobs": _not_implemented("--dump-logprobs"),
    "perplexity": _not_implemented("--perplexity-file"),
    "imatrix": _not_implemented("imatrix collection (--imatrix-dataset)"),
    "diagnostic": _not_implemented(
        "the developer diagnostics (--head-test, --first-token-test, --metal-graph-*)"
    ),
    "one-shot": _not_implemented("one-shot generation (-p/--prompt-file)"),
    "repl": _not_implemented("the interactive REPL"),
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
    return "one-shot" if has_prompt else "repl"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        return MODES[select_mode(args)](args)
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
