"""The interactive `ds4>` chat (product.md §3.3): a multi-turn transcript that reuses the live KV.

The transcript is a token list built incrementally (BOS, [Think-Max prefix], system, then per turn
`<｜User｜>` text `<｜Assistant｜>` `<think>|</think>`, the generated tokens and EOS). Each turn syncs the
session to the whole transcript; since the session still holds every earlier token, only the new user
message (plus the previous turn's last token and EOS) is prefilled. The stats line on stderr says how many
prompt tokens were prefilled and how many were reused.

Ctrl+C during a generation stops it at the next token: with no token generated yet the user turn is
rolled back, otherwise the partial answer is kept and closed with EOS. Ctrl+C at the prompt clears the
line; Ctrl+D (EOF) or /quit leaves. History lives in $HOME/.ds4_history (512 entries, saved every line).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ds4.chat import THINK_MAX_MIN_CTX, THINK_MAX_PREFIX, append_message_ids, assistant_prefix_ids
from ds4.cli import StreamPrinter, read_text_file, run_generation, sampling_params, think_mode
from ds4.engine.generate import GenerateParams
from ds4.errors import Ds4Error

if TYPE_CHECKING:
    from ds4.engine import Engine

HISTORY_FILE = ".ds4_history"
HISTORY_MAX = 512
PROMPT = "ds4> "

HELP = """Commands:
  /help          Show this help.
  /think         Use normal thinking mode.
  /think-max     Use Think Max only when context is at least 393216 tokens.
  /nothink       Disable thinking mode.
  /ctx N         Set context size for following prompts.
  /read FILE     Read a prompt from FILE and run it.
  /quit, /exit   Leave the prompt.
  Ctrl+C         Stop generation and return to the prompt."""


def history_path() -> Path:
    return Path(os.environ.get("HOME") or ".") / HISTORY_FILE


class Chat:
    """One conversation: the transcript, the live session and the current thinking mode."""

    def __init__(self, engine: Engine, args: argparse.Namespace) -> None:
        self.engine = engine
        self.tok = engine.tokenizer
        self.args = args
        self.mode: str = args.think
        self.ctx: int = args.ctx
        self.transcript: list[int] = [self.tok.bos_id]
        self.max_prefix_len = 0  # tokens of the Think-Max prefix right after BOS (0 = absent)
        if args.system:
            append_message_ids(self.tok, self.transcript, "system", args.system)
        self._apply_max_prefix(think_mode(self.mode, self.ctx, warn=True) == "max")
        self.session = engine.session(self.ctx, checkpoint=False)
        self.rng = sampling_params(args).make_rng()  # one RNG for the whole chat, like ds4

    def _apply_max_prefix(self, enable: bool) -> None:
        """Insert/remove the Think-Max prefix after BOS; the next turn then re-prefills (sync sees it)."""
        if enable and not self.max_prefix_len:
            prefix = self.tok.encode(THINK_MAX_PREFIX)
            self.transcript[1:1] = prefix
            self.max_prefix_len = len(prefix)
        elif not enable and self.max_prefix_len:
            del self.transcript[1 : 1 + self.max_prefix_len]
            self.max_prefix_len = 0

    # ---- commands ------------------------------------------------------------------------------

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        effective = think_mode(mode, self.ctx, warn=False)
        self._apply_max_prefix(effective == "max")
        if mode == "max" and effective != "max":
            print(f"Thinking mode: high (ctx below {THINK_MAX_MIN_CTX}).")
            think_mode(mode, self.ctx, warn=True)
        else:
            print(f"Thinking mode: {mode}.")

    def set_ctx(self, ctx: int) -> None:
        from ds4.engine.snapshot import payload_size

        self.session = self.engine.session(ctx, checkpoint=False)  # the old KV is dropped here
        self.ctx = ctx
        self._apply_max_prefix(think_mode(self.mode, ctx, warn=False) == "max")
        mib = payload_size(self.engine.config, ctx) / 2**20
        print(
            f"ds4: context buffers {mib:.2f} MiB (ctx={ctx}, backend={self.engine.backend}); "
            f"the transcript ({len(self.transcript)} tokens) is re-prefilled next turn",
            file=sys.stderr,
        )

    # ---- a turn --------------------------------------------------------------------------------

    def turn(self, text: str) -> None:
        mode = think_mode(self.mode, self.ctx, warn=False)
        self._apply_max_prefix(mode == "max")
        rollback = len(self.transcript)
        append_message_ids(self.tok, self.transcript, "user", text)
        self.transcript += assistant_prefix_ids(self.tok, mode)
        params = GenerateParams(max_tokens=self.args.tokens, sampling=sampling_params(self.args))
        try:
            fin = run_generation(
                self.session,
                list(self.transcript),
                params,
                StreamPrinter(sys.stdout),
                rng=self.rng,
                on_token=self.transcript.append,
            )
        except KeyboardInterrupt:  # a second Ctrl+C inside a forward pass: the KV is gone, drop the turn
            del self.transcript[rollback:]
            self.session.reset()
            print("\nds4: interrupted; the turn was dropped", file=sys.stderr)
            return
        prefill_failed = fin.reason == "error" and fin.timing.ttft_s is None
        if prefill_failed or (fin.reason == "cancelled" and not fin.tokens):
            del self.transcript[rollback:]  # the session no longer matches: sync rebuilds next turn
        else:
            self.transcript.append(self.tok.eos_id)  # closes the turn; evaluated with the next one


def _setup_history() -> object | None:
    try:
        import readline
    except ImportError:  # no readline on this platform: plain input() still works
        return None
    readline.set_history_length(HISTORY_MAX)
    try:
        readline.read_history_file(history_path())
    except (FileNotFoundError, OSError):
        pass
    return readline


def _save_history(readline: object | None) -> None:
    if readline is None:
        return
    try:
        readline.write_history_file(history_path())  # type: ignore[attr-defined]
    except OSError as e:
        print(f"ds4: cannot save history to {history_path()}: {e.strerror}", file=sys.stderr)


def run_repl(engine: Engine, args: argparse.Namespace) -> int:
    chat = Chat(engine, args)
    readline = _setup_history()
    print(HELP)
    while True:
        try:
            line = input(PROMPT)
        except KeyboardInterrupt:  # Ctrl+C at the prompt clears the line
            print()
            continue
        except EOFError:  # Ctrl+D
            print()
            return 0
        cmd = line.strip()
        if not cmd:
            continue
        _save_history(readline)
        if cmd in ("/quit", "/exit"):
            return 0
        try:
            _dispatch(chat, cmd)
        except Ds4Error as e:
            print(f"ds4: {e}", file=sys.stderr)


def _dispatch(chat: Chat, cmd: str) -> None:
    word, _, rest = cmd.partition(" ")
    rest = rest.strip()
    if not word.startswith("/"):
        chat.turn(cmd)
    elif word == "/help" and not rest:
        print(HELP)
    elif word in ("/think", "/think-max", "/nothink") and not rest:
        chat.set_mode({"/think": "high", "/think-max": "max", "/nothink": "none"}[word])
    elif word == "/ctx":
        if not rest.isdigit() or int(rest) <= 1:
            print(
                f"ds4: /ctx needs a context size of at least 2 tokens, got {rest or 'nothing'}",
                file=sys.stderr,
            )
        else:
            chat.set_ctx(int(rest))
    elif word == "/read":
        if not rest:
            print("ds4: /read needs a file path", file=sys.stderr)
        else:
            chat.turn(read_text_file(rest, "/read file"))
    else:
        print(f"ds4: unknown command: {cmd}", file=sys.stderr)
        print("ds4: type /help for commands", file=sys.stderr)
