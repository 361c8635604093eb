"""The generation loop shared by the CLI and the server worker: prompt ids in, a stream of small events out.

    for ev in generate(session, prompt_ids, GenerateParams(max_tokens=64, stop=("\\n\\n",))):
        TokenEvent      one sampled token (never EOS) and its raw decoded piece (complete UTF-8 only)
        ReasoningDelta  thinking text (the prompt ended in <think>, or `thinking=True`), tags removed
        TextDelta       answer text
        Finish          reason stop / length / cancelled / error, the whole reasoning and text, usage, timing

Pure orchestration over `Session` (prefill/decode), `sampling.sample` and the tokenizer's `StreamDecoder`:
no policy about caching, no protocol. Guarantees:
  * deltas never split a UTF-8 character and never show part of a stop string or of the `</think>` marker;
  * the deltas concatenate to Finish.reasoning / Finish.text, which are the generated text with the first
    `</think>` removed (and a leading `<think>` skipped), cut at the earliest stop-string match;
  * cancellation (a threading.Event or a callable) is checked before every token, so it takes effect within
    one decode step; an exception during prefill or decode ends the stream with Finish(reason="error").

Stop strings are matched on the whole generated text (reasoning included), as ds4's server does. EOS is a
stop, not text. The last sampled token is not evaluated (nothing needs its logits), so on return the session
holds the prompt plus every generated token but the last one (all of them when the model stopped on EOS);
with `eval_last=True` a generation that ran to max_tokens evaluates its last token too.

The server worker keeps its own cache policy and cancellable chunked prefill: it passes `prefilled=` (the
session already holds the prompt; generate only decodes) and a `next_token` seam (its tests script tokens).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ds4.config import DEFAULT_MAX_TOKENS
from ds4.dsml import ReasoningDelta  # the same reasoning-text event the DSML projection emits
from ds4.engine.sampling import Rng, SamplingParams, sample
from ds4.tokenizer import THINK_END, THINK_START

if TYPE_CHECKING:
    import torch

    from ds4.engine.session import Session
    from ds4.tokenizer import Tokenizer

FinishReason = Literal["stop", "length", "cancelled", "error"]
# (next-token logits [V], sampling params) -> possibly changed (logits, params) for this one token; the
# server uses it for the DSML greedy-structure rule (force temperature 0 while inside tool-call structure).
LogitsHook = Callable[["torch.Tensor", SamplingParams], "tuple[torch.Tensor, SamplingParams]"]
# (next-token logits [V], sampling params, rng) -> the next token id; the default is `sampling.sample`.
NextToken = Callable[["torch.Tensor", SamplingParams, Rng], int]
ProgressFn = Callable[[int, int], None]  # prefill progress: (tokens done, tokens to prefill)
Cancel = threading.Event | Callable[[], bool] | None


# ---- events -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenEvent:
    token: int
    piece: str  # the token's text as far as it completes UTF-8 characters (raw: before stop/think handling)


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # length of the prompt
    prefilled_tokens: int  # prompt tokens actually run through prefill (the rest came from the held KV)
    reused_tokens: int  # prompt tokens served by the session's held state
    generated_tokens: int  # sampled tokens, EOS not counted


@dataclass(frozen=True)
class Timing:
    prefill_s: float  # wall time of session.sync
    decode_s: float  # wall time from the end of prefill to the finish
    ttft_s: float | None  # from the call to the first sampled token (None if none was sampled)
    prefilled_tokens: int = 0
    generated_tokens: int = 0

    @property
    def prefill_tps(self) -> float:
        return self.prefilled_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class Finish:
    reason: FinishReason
    usage: Usage
    timing: Timing
    reasoning: str = ""  # all reasoning text (an unclosed thinking block stays reasoning: issue #509)
    text: str = ""  # all answer text
    tokens: tuple[int, ...] = ()  # the generated ids (EOS excluded)
    stop_string: str | None = None  # the stop string that ended generation, if any
    eos: bool = False  # True when the model emitted EOS
    error: str | None = None  # reason == "error": what went wrong
    exception: Exception | None = field(default=None, repr=False, compare=False)  # ... and the exception


Event = TokenEvent | ReasoningDelta | TextDelta | Finish


@dataclass(frozen=True)
class Prefilled:
    """A caller that synced the session to the prompt itself: what that prefill cost (for Usage/Timing)."""

    tokens: int  # prompt tokens run through prefill (the rest came from the held KV)
    seconds: float  # wall time of that prefill


@dataclass(frozen=True)
class GenerateParams:
    max_tokens: int = DEFAULT_MAX_TOKENS  # clamped to the room left in the context
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # empty strings are ignored
    stop_at_eos: bool = True
    thinking: bool | None = None  # None: thinking iff the prompt ends with the <think> token


# ---- text routing ---------------------------------------------------------------------------------------


def _partial_prefix_len(text: str, needles: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `needles`."""
    best = 0
    for needle in needles:
        for n in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:n]):
                best = n
                break
    return best


class TextRouter:
    """Raw generated text in, (kind, text) deltas out: stop strings held back and cut, thinking split.

    push(piece) returns the deltas that are now safe to show; finish() releases what was held back (the
    text can no longer become a stop string or a </think> marker). `stopped` tells a stop string matched.
    """

    def __init__(self, stop: Sequence[str], thinking: bool) -> None:
        self.stop = tuple(s for s in stop if s)
        self.raw = ""  # all generated text (cut at the stop match once one is found)
        self._released = 0  # raw[:_released] has gone to the thinking splitter
        self._scan = 0  # stop matches cannot start before this offset
        self.stop_string: str | None = None
        self._in_think = thinking
        self._at_start = thinking  # a leading <think> in generated text is skipped
        self._pending = ""  # released text the thinking splitter still holds
        self.reasoning = ""
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def push(self, piece: str) -> list[tuple[str, str]]:
        if self.stopped or not piece:
            return []
        self.raw += piece
        # A match wins only once no earlier-starting partial match can still complete (earliest match rule).
        end = len(self.raw) - _partial_prefix_len(self.raw, self.stop)
        hit = self._find_stop()
        if hit is not None and hit[0] <= end:
            self._cut(*hit)
            end = hit[0]
        elif hit is not None:
            end = min(end, hit[0])
        out = self._split(self.raw[self._released : end], final=False)
        self._released = max(self._released, end)
        self._scan = max(self._scan, end)
        return out

    def finish(self) -> list[tuple[str, str]]:
        hit = None if self.stopped else self._find_stop()
        if hit is not None:
            self._cut(*hit)
        out = self._split(self.raw[self._released :], final=True)
        self._released = len(self.raw)
        return out

    def _find_stop(self) -> tuple[int, str] | None:
        """(start, stop string) of the earliest complete match at or after the scan point."""
        found = [(i, s) for s in self.stop if (i := self.raw.find(s, self._scan)) >= 0]
        return min(found, key=lambda m: (m[0], -len(m[1]))) if found else None

    def _cut(self, start: int, stop: str) -> None:
        self.raw = self.raw[:start]
        self.stop_string = stop

    def _split(self, text: str, final: bool) -> list[tuple[str, str]]:
        """Thinking split of released text: reasoning until the first </think>, then content."""
        self._pending += text
        out: list[tuple[str, str]] = []
        if self._at_start:
            if THINK_START.startswith(self._pending) and not final:
                return out  # could still become a leading <think>
            if self._pending.startswith(THINK_START):
                self._pending = self._pending[len(THINK_START) :]
            self._at_start = False
        if self._in_think:
            i = self._pending.find(THINK_END)
            if i >= 0:
                self._emit(out, "reasoning", self._pending[:i])
                self._pending = self._pending[i + len(THINK_END) :]
                self._in_think = False
            else:
                keep = 0 if final else _partial_prefix_len(self._pending, (THINK_END,))
                self._emit(out, "reasoning", self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                return out
        self._emit(out, "text", self._pending)
        self._pending = ""
        return out

    def _emit(self, out: list[tuple[str, str]], kind: str, text: str) -> None:
        if not text:
            return
        if kind == "reasoning":
            self.reasoning += text
        else:
            self.text += text
        out.append((kind, text))


def _delta(kind: str, text: str) -> ReasoningDelta | TextDelta:
    return ReasoningDelta(text) if kind == "reasoning" else TextDelta(text)


def _cancelled(cancel: Cancel) -> bool:
    if cancel is None:
        return False
    if isinstance(cancel, threading.Event):
        return cancel.is_set()
    return bool(cancel())


# ---- the loop ---------------------------------------------------------------------------------------


def generate(
    session: Session,
    prompt: Sequence[int],
    params: GenerateParams | None = None,
    *,
    rng: Rng | None = None,
    cancel: Cancel = None,
    logits_hook: LogitsHook | None = None,
    progress: ProgressFn | None = None,
    tokenizer: Tokenizer | None = None,
    prefilled: Prefilled | None = None,
    next_token: NextToken = sample,
    eval_last: bool = False,
) -> Iterator[Event]:
    """Prefill `prompt` (reusing the session's KV where it can) and stream the continuation as events.

    `rng` lets a caller keep one RNG across turns (default: params.sampling.make_rng()). `prefilled`: the
    session already holds exactly `prompt` (the caller prefilled it, at that cost); only decode runs here.
    `next_token` picks each token from the (hooked) logits. `eval_last`: at max_tokens, evaluate the last
    token too (the server keeps every generated token in its KV). The last event is always a Finish.
    """
    params = params or GenerateParams()
    tok = tokenizer if tokenizer is not None else session.engine.tokenizer
    prompt = [int(t) for t in prompt]
    thinking = (
        params.thinking if params.thinking is not None else bool(prompt and prompt[-1] == tok.think_start_id)
    )
    router = TextRouter(params.stop, thinking)
    decoder = tok.stream_decoder()
    rng = rng or params.sampling.make_rng()
    generated: list[int] = []
    t0 = time.perf_counter()
    t_prefill_end = t0
    ttft: float | None = None
    n_prefilled = 0

    def finish(
        reason: FinishReason, *, eos: bool = False, error: str | None = None, exc: Exception | None = None
    ) -> Iterator[Event]:
        if reason != "stop" or not router.stopped:
            yield from (_delta(k, t) for k, t in router.push(decoder.flush()))
        yield from (_delta(k, t) for k, t in router.finish())
        t_end = time.perf_counter()
        usage = Usage(len(prompt), n_prefilled, len(prompt) - n_prefilled, len(generated))
        timing = Timing(t_prefill_end - t0, t_end - t_prefill_end, ttft, n_prefilled, len(generated))
        yield Finish(
            reason, usage, timing, router.reasoning, router.text, tuple(generated),
            router.stop_string, eos, error, exc,
        )  # fmt: skip

    if prefilled is not None:  # the clock starts where the caller's prefill started (TTFT includes it)
        t0 -= prefilled.seconds
        n_prefilled = prefilled.tokens
    else:
        if _cancelled(cancel):
            yield from finish("cancelled")
            return
        try:
            n_prefilled = session.sync(prompt, progress)
        except Exception as e:  # a prompt that does not fit, a failing forward pass: the caller decides
            t_prefill_end = time.perf_counter()
            yield from finish("error", error=f"prompt processing failed: {e}", exc=e)
            return
        t_prefill_end = time.perf_counter()
    max_tokens = max(0, min(params.max_tokens, session.ctx - len(prompt)))
    logits = session.logits
    while True:
        if len(generated) >= max_tokens:
            yield from finish("length")
            return
        if _cancelled(cancel):
            yield from finish("cancelled")
            return
        sp = params.sampling
        if logits_hook is not None:
            logits, sp = logits_hook(logits, sp)
        token = next_token(logits, sp, rng)
        if ttft is None:
            ttft = time.perf_counter() - t0
        if params.stop_at_eos and token == tok.eos_id:
            yield from finish("stop", eos=True)
            return
        generated.append(token)
        piece = decoder.push(token)
        yield TokenEvent(token, piece)
        for kind, text in router.push(piece):
            yield _delta(kind, text)
        if router.stopped:
            yield from finish("stop")
            return
        if len(generated) >= max_tokens and not eval_last:
            continue  # the last token needs no evaluation
        try:
            logits = session.eval(token)
        except Exception as e:
            yield from finish("error", error=f"decode failed: {e}", exc=e)
            return
