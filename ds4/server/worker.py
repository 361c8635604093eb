"""Row 4: the inference worker, the ONLY server module that touches the engine (architecture.md principle 2).

The worker keeps N live sessions (`--parallel N`, issue 8), each with its own KV state. HTTP handlers render
and tokenize on their own threads, then `submit()` a Job; a dispatcher thread takes jobs FIFO and gives each
a session: the idle one whose tokens, prompt checkpoint or live text binding is the longest prefix of the
prompt, else an empty one, else the least recently used idle one (whose KV goes to the disk cache first,
reason evict, through the live-miss rule below); with all N busy the job waits. Each job then runs on its
own thread; the sessions' model calls all go through one ds4.engine.stepper.Stepper (when given), which
batches the decode steps of the running jobs. Per job: cache decision (§5.2: live token prefix, live text
prefix, disk checkpoint, cold), chunked prefill that checks the job's cancel flag between chunks and sends
keepalives, then decode through the shared loop `ds4.engine.generate.generate` (max tokens, cancel checked
every token, usage and timing), on which the worker adds greedy-for-structure sampling, stop strings, the
DSML streaming projection, exact-DSML tool memory, and the disk-cache stores (cold, continued, evict).
Events go back through the job's `emit` callback (thread-safe on the handler side).

`TokenSource` is the seam where a test double replaces the model's sampler: generate asks it (through the
worker) for the next token id and evaluates that token in the session like any sampled one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from ds4.config import (
    DEFAULT_CTX,
    PREFILL_CHUNK,
    SERVER_DEFAULT_MAX_TOKENS,
    SERVER_KEEPALIVE_S,
)
from ds4.dsml import DsmlStream, DsmlTracker, ParsedMessage, ToolMemory
from ds4.server.protocol import Done, Event, Failed, Keepalive, Request, Started, TextDelta, Usage
from ds4.tokenizer import EOS, THINK_END, THINK_START, Tokenizer

log = logging.getLogger("ds4.server")


class SessionLike(Protocol):
    """What the worker needs from ds4.engine.Session (tests plug in a fake with the same counters)."""

    ctx: int
    tokens: list[int]
    stats: Any

    def sync(self, tokens: Sequence[int], progress: Any = None) -> int: ...
    def eval(self, token: int) -> Any: ...
    def snapshot(self) -> bytes: ...


class TokenSource(Protocol):
    """Picks each decode token. `params` and `rng` are the job's (ds4.engine.sampling); `greedy` is the DSML
    greedy-for-structure rule: the next token lies inside tool-call structure."""

    def start(self, job: Job) -> None: ...
    def next_token(self, job: Job, logits: Any, params: Any, rng: Any, greedy: bool) -> int: ...


class SamplerSource:
    """The real source: ds4.engine.sampling over the next-token logits, at temperature 0 when greedy."""

    def start(self, job: Job) -> None:
        pass

    def next_token(self, job: Job, logits: Any, params: Any, rng: Any, greedy: bool) -> int:
        from dataclasses import replace

        from ds4.engine.sampling import sample

        return sample(logits, replace(params, temperature=0.0) if greedy else params, rng)


@dataclass
class Job:
    request: Request
    emit: Callable[[Event], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False  # set by the worker when it stopped early because of `cancel`
    stats: dict[str, Any] = field(default_factory=dict)


class _Cancelled(Exception):
    pass


@dataclass(frozen=True)
class _Binding:
    """A live protocol binding (§5.3): the text the client will send for the live KV, and its length."""

    visible: bytes
    live_len: int
    source: str
    dialects: tuple[str, ...]

    def dialect_ok(self, dialect: str) -> bool:
        return dialect in self.dialects


@dataclass(eq=False)
class _Slot:
    """One live session and what the worker remembers about its timeline."""

    index: int
    session: SessionLike
    busy: bool = False
    last_used: int = 0  # dispatch counter of its latest job (LRU)
    binding: _Binding | None = None  # serves the next request on this session only
    last_stored: int = 0  # continued-store schedule (§5.5)
    requests_on_live: int = 0
    text_of: list[int] = field(default_factory=list)  # the tokens `text` was detokenized from
    text: bytes = b""


@dataclass(frozen=True)
class KVBudget:
    """What the live sessions' KV costs (reported at start-up and on /metrics)."""

    sessions: int
    ctx: int
    bytes_per_session: int
    free_bytes: int | None = None  # free memory after the weights (GPU, or host for CPU), when known
    scratch_bytes: int = 0  # allocated next to the sessions (a device pool's scratch slot)

    def line(self) -> str:
        total = self.sessions * self.bytes_per_session
        free = "unknown" if self.free_bytes is None else f"{self.free_bytes / 2**30:.2f} GiB"
        scratch = f" + {self.scratch_bytes / 2**20:.1f} MiB scratch" if self.scratch_bytes else ""
        return (
            f"kv: {self.sessions} sessions x ctx {self.ctx} = {total / 2**30:.3f} GiB "
            f"({self.bytes_per_session / 2**20:.1f} MiB each{scratch}), free after weights {free}"
        )


class Batcher(Protocol):
    """What the worker needs from ds4.engine.stepper.Stepper: clients register around each job."""

    def client(self) -> AbstractContextManager[None]: ...


@dataclass
class WorkerOptions:
    ctx: int = DEFAULT_CTX
    default_max_tokens: int = SERVER_DEFAULT_MAX_TOKENS
    prefill_chunk: int = PREFILL_CHUNK
    keepalive_s: float = SERVER_KEEPALIVE_S
    exact_replay: bool = True


@dataclass
class Metrics:
    requests_total: int = 0
    prompt_tokens_total: int = 0
    prefill_tokens_total: int = 0
    generated_tokens_total: int = 0
    kv_disk_hits_total: int = 0
    kv_disk_misses_total: int = 0
    cancelled_total: int = 0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    evictions_total: int = 0  # jobs that took over an idle session holding another timeline


class StopScanner:
    """Stop strings (§4.3): text passes through except the last maxlen-1 chars, which could begin a match.

    Kept apart from generate's TextRouter on purpose: §4.3 streams with exactly this maxlen-1 hold-back (the
    router holds back only a real partial match), a match ends generation as soon as it is complete (the
    router waits while an earlier-starting stop could still complete), and the server's KV keeps the token
    that completed the stop (the router ends generation before evaluating it).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""
        self.hit = False

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        self.buf += text
        pos = min((p for p in (self.buf.find(s) for s in self.stops) if p >= 0), default=-1)
        if pos >= 0:
            self.hit = True
            out, self.buf = self.buf[:pos], ""
            return out
        cut = max(0, len(self.buf) - self.hold)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class Worker:
    def __init__(
        self,
        tokenizer: Tokenizer,
        session: SessionLike | Sequence[SessionLike],
        *,
        source: TokenSource | None = None,
        options: WorkerOptions | None = None,
        kvstore: Any = None,
        tool_memory: ToolMemory | None = None,
        trace: IO[str] | None = None,
        stepper: Batcher | None = None,
        kv_budget: KVBudget | None = None,
    ) -> None:
        sessions = list(session) if isinstance(session, Sequence) else [session]
        if not sessions:
            raise ValueError("the worker needs at least one session")
        self.tok = tokenizer
        self.slots = [_Slot(i, s) for i, s in enumerate(sessions)]
        self.source: TokenSource = source or SamplerSource()
        self.opt = options or WorkerOptions(ctx=sessions[0].ctx)
        self.kv = kvstore
        self.memory = tool_memory if tool_memory is not None else ToolMemory()
        self.memory_lock = threading.Lock()  # handlers render with the memory while the jobs update it
        self.trace = trace
        self.stepper = stepper
        self.kv_budget = kv_budget
        self.metrics = Metrics()
        self._count_lock = threading.Lock()  # metrics counters: several job threads update them
        self._trace_lock = threading.Lock()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None  # the dispatcher
        self._stopping = False
        self._slots_cond = threading.Condition()  # guards slot.busy / last_used and _running
        self._running: dict[int, tuple[Job, threading.Thread]] = {}  # id(job) -> the job, its thread
        self._waiting = 0  # a job the dispatcher holds while every session is busy
        self._dispatched = 0
        self.current_job: Job | None = None  # the latest job started (tests and diagnostics)

    @property
    def session(self) -> SessionLike:
        """The first live session (the only one with --parallel 1)."""
        return self.slots[0].session

    @property
    def sessions(self) -> list[SessionLike]:
        return [s.session for s in self.slots]

    @property
    def busy_sessions(self) -> int:
        return sum(s.busy for s in self.slots)

    @property
    def live_sessions(self) -> int:
        return sum(bool(s.session.tokens) for s in self.slots)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ds4-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, end the running generations (finish=error), finish the queued ones, join."""
        self._stopping = True
        with self._slots_cond:
            running = [job for job, _ in self._running.values()]
        for job in running:
            if not job.finished.is_set():
                job.cancel.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The dispatcher runs (and the model thread, when there is a stepper)."""
        threads_ok = self._thread is not None and self._thread.is_alive()
        return threads_ok and bool(getattr(self.stepper, "alive", True))

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize() + self._waiting

    def submit(self, job: Job) -> None:
        if self._stopping:
            raise RuntimeError("server shutting down")
        self._queue.put(job)

    def _run(self) -> None:
        """Dispatcher: FIFO; each job waits for a session, then runs on its own thread."""
        while True:
            job = self._queue.get()
            if job is None:
                break
            self._waiting = 1
            slot = self._acquire(job)
            self._waiting = 0
            thread = threading.Thread(target=self._run_job, args=(job, slot), name="ds4-job", daemon=True)
            with self._slots_cond:
                self._running[id(job)] = (job, thread)
            thread.start()
        with self._slots_cond:
            threads = [t for _, t in self._running.values()]
        for t in threads:
            t.join()

    def _run_job(self, job: Job, slot: _Slot) -> None:
        self.current_job = job
        final: Event | None = None
        try:
            with self.stepper.client() if self.stepper is not None else nullcontext():
                final = self._serve(job, slot)
        except _Cancelled:
            job.cancelled = True
            self._count(cancelled_total=1)
            final = Failed("client disconnected", status=499)
        except Exception as err:  # one bad job never takes the worker down
            log.exception("request failed in the worker")
            final = Failed(f"generation failed: {err}")
        finally:
            self._release(slot)  # before the last event: the client's next turn may find it idle
            try:
                if isinstance(final, Failed):
                    self._emit_quietly(job, final)
                elif final is not None:
                    try:
                        job.emit(final)
                    except Exception as err:
                        log.exception("request failed in the worker")
                        self._emit_quietly(job, Failed(f"generation failed: {err}"))
            finally:
                with self._slots_cond:
                    self._running.pop(id(job), None)
                job.finished.set()

    @staticmethod
    def _emit_quietly(job: Job, ev: Event) -> None:
        try:
            job.emit(ev)
        except Exception:  # the handler is gone; the worker must survive it
            log.warning("could not deliver the final event of a request")

    def _count(self, **inc: int) -> None:
        with self._count_lock:
            for name, n in inc.items():
                setattr(self.metrics, name, getattr(self.metrics, name) + n)

    # ---- session choice ----------------------------------------------------------------------

    def _acquire(self, job: Job) -> _Slot:
        """The session this job runs on (marked busy); waits while every session is busy."""
        with self._slots_cond:
            while True:
                idle = [s for s in self.slots if not s.busy]
                if idle:
                    break
                self._slots_cond.wait()
            slot = self._choose(job.request, idle)
            slot.busy = True
            self._dispatched += 1
            slot.last_used = self._dispatched
            return slot

    def _release(self, slot: _Slot) -> None:
        with self._slots_cond:
            slot.busy = False
            self._slots_cond.notify_all()

    def _choose(self, req: Request, idle: list[_Slot]) -> _Slot:
        """Longest reusable prefix, else an empty session, else the least recently used (evicted)."""
        if len(self.slots) == 1:
            return idle[0]
        prompt_bytes = req.prompt_text.encode()
        scored = [(self._reusable(s, req, prompt_bytes), s.last_used, s) for s in idle]
        best = max(scored, key=lambda x: (x[0], x[1]))
        if best[0] > 0:
            return best[2]
        empty = [s for s in idle if not s.session.tokens]
        if empty:
            return empty[0]
        lru = min(idle, key=lambda s: s.last_used)
        self._count(evictions_total=1)  # its KV goes to disk in _cache_decision (live miss, reason evict)
        return lru

    def _reusable(self, slot: _Slot, req: Request, prompt_bytes: bytes) -> int:
        """Tokens of `req` this session could serve without prefill (the §5.2 rules of _cache_decision)."""
        tokens, live = req.prompt_tokens, slot.session.tokens
        if live and tokens[: len(live)] == live:
            return len(live)
        best = self._checkpoint_prefix(slot, tokens)
        b = slot.binding
        if b is not None and b.live_len == len(live) and b.dialect_ok(req.dialect):
            if len(prompt_bytes) > len(b.visible) and prompt_bytes.startswith(b.visible):
                best = max(best, len(live))
        if live and best < len(live):
            live_bytes = self._live_bytes(slot)
            if len(prompt_bytes) > len(live_bytes) and prompt_bytes.startswith(live_bytes):
                best = len(live)
        return best

    def _live_bytes(self, slot: _Slot) -> bytes:
        """The session's text, detokenized once per timeline (every job's session choice reads it)."""
        live = slot.session.tokens
        if slot.text_of != live:  # a list compare: far cheaper than detokenizing again
            slot.text_of, slot.text = list(live), self.tok.decode_bytes(live)
        return slot.text

    # ---- one job -----------------------------------------------------------------------------

    def _serve(self, job: Job, slot: _Slot) -> Done:
        req, session = job.request, slot.session
        self._count(requests_total=1)
        if job.cancel.is_set():
            raise _Cancelled
        tokens, source = self._cache_decision(slot, req)
        if len(tokens) >= self.opt.ctx:  # a text-prefix reuse tokenized longer than the plain prompt
            tokens, source = req.prompt_tokens, "none"
        t0 = time.perf_counter()
        before = session.stats.prefill_tokens
        reused = self._prefill(job, slot, tokens)
        prefilled = session.stats.prefill_tokens - before
        dt = time.perf_counter() - t0
        if prefilled and dt > 0:
            self.metrics.prefill_tps = prefilled / dt
        self._count(prompt_tokens_total=len(tokens), prefill_tokens_total=prefilled)
        job.stats.update(cache_source=source, prefilled=prefilled, cached=reused, prompt=len(tokens))
        job.stats["session"] = slot.index
        job.emit(Started(len(tokens), reused))
        done = self._decode(job, slot, tokens, reused, prefilled, dt)
        slot.requests_on_live += 1
        slot.binding = self._visible_binding(slot, req, done, job.stats.get("stop_hit", False))
        log.info(
            "%s s%d ctx=%d..%d source=%s prefilled=%d gen=%d tools=%d finish=%s %.2fs",
            req.dialect, slot.index, reused, len(tokens), source, prefilled, done.usage.completion_tokens,
            len(done.message.calls), done.finish, time.perf_counter() - t0,
        )  # fmt: skip
        self._write_trace(job, done, source)
        return done

    def _cache_decision(self, slot: _Slot, req: Request) -> tuple[list[int], str]:
        """The effective prompt tokens (§5.2) and where the reused prefix comes from."""
        session = slot.session
        tokens, live = req.prompt_tokens, session.tokens
        binding, slot.binding = slot.binding, None  # a binding serves the very next request only
        if live and tokens[: len(live)] == live:
            return tokens, "memory-token"
        prompt_bytes = req.prompt_text.encode()
        if binding is not None and binding.live_len == len(live) and binding.dialect_ok(req.dialect):
            vis = binding.visible
            if len(prompt_bytes) > len(vis) and prompt_bytes.startswith(vis):
                rest = prompt_bytes[len(vis) :].decode("utf-8", "replace")
                # the visible text ends with EOS, which decode never evaluates
                return [*live, self.tok.eos_id, *self.tok.encode_chat(rest)], binding.source
        if self._checkpoint_prefix(slot, tokens):
            return tokens, "memory-token"
        if live:
            live_bytes = self.tok.decode_bytes(live)
            if len(prompt_bytes) > len(live_bytes) and prompt_bytes.startswith(live_bytes):
                try:
                    rest = prompt_bytes[len(live_bytes) :].decode()
                except UnicodeDecodeError:
                    rest = None  # the live end splits a character: not a usable text prefix
                if rest is not None:
                    return list(live) + self.tok.encode_chat(rest), "memory-text"
            slot.last_stored = 0  # live miss: the continued schedule restarts (§5.5)
            self._store_live_on_miss(slot)
        if self.kv is not None:
            hit = self.kv.lookup(prompt_bytes)
            if hit is not None and self.kv.restore_into(session, hit):
                self._count(kv_disk_hits_total=1)
                slot.last_stored = hit.n_tokens
                if hit.tool_map and self.opt.exact_replay:
                    with self.memory_lock:
                        self.memory.load(hit.tool_map)
                rest = prompt_bytes[hit.text_bytes :].decode("utf-8", "replace")
                return list(session.tokens) + self.tok.encode_chat(rest), "disk-text"
            self._count(kv_disk_misses_total=1)
        return tokens, "none"

    def _visible_binding(self, slot: _Slot, req: Request, done: Done, stop_hit: bool) -> _Binding | None:
        """§5.3: after a turn whose KV holds text the client will not replay (hidden reasoning), remember
        how the client WILL render this turn, so the next request continues on the live KV.

        thinking-visible (chat/messages, tool-less, no tool history): the turn replays as
        `...<｜Assistant｜></think>content EOS` (earlier reasoning is dropped by the template).
        responses-visible: Codex replays content and calls but not the reasoning (unless summaries were
        returned and the turn ended in calls): `...<think>[reasoning]</think>content DSML EOS`.
        """
        m = done.message
        if (
            done.finish in ("error", "length")
            or stop_hit
            or m.error
            or not req.thinking
            or not m.reasoning_closed
        ):
            return None
        if not req.prompt_text.endswith(THINK_START):
            return None
        if req.dialect in ("chat", "messages"):
            tool_history = any(x.role in ("tool", "function") or x.tool_calls for x in req.messages)
            if req.tools or tool_history or m.calls:
                return None
            visible = req.prompt_text[: -len(THINK_START)] + THINK_END + m.content + EOS
            return _Binding(
                visible.encode(), len(slot.session.tokens), "thinking-visible", ("chat", "messages")
            )
        if req.dialect == "responses":
            if m.calls and not (m.raw_dsml and self.opt.exact_replay):
                return None  # a canonical re-rendering would not match the sampled bytes anyway
            shown = (m.reasoning or "") if req.reasoning_summary and m.calls else ""
            visible = req.prompt_text + shown + THINK_END + m.content + (m.raw_dsml or "") + EOS
            return _Binding(visible.encode(), len(slot.session.tokens), "responses-visible", ("responses",))
        return None

    @staticmethod
    def _checkpoint_prefix(slot: _Slot, tokens: list[int]) -> int:
        """Length of the session's post-prompt checkpoint when it is a prefix of `tokens` (else 0).

        ds4.engine.Session rewinds to that checkpoint by itself in sync(); the worker only needs to know
        so it neither evict-stores nor disk-loads over it."""
        cp_tokens = list(getattr(slot.session, "checkpoint_tokens", ()))  # test doubles may have none
        if cp_tokens and tokens[: len(cp_tokens)] == cp_tokens:
            return len(cp_tokens)
        return 0

    def _store_live_on_miss(self, slot: _Slot) -> None:
        live = slot.session.tokens
        if self.kv is None or len(live) < self.kv.min_tokens:
            return
        text = self.tok.decode_bytes(live)
        target = self.kv.evict_target(len(live), self.kv.covered_tokens(text))
        if target is not None:
            self._store(slot, 3, hits=slot.requests_on_live)  # SaveReason.EVICT
        slot.requests_on_live = 0

    def seed_tool_memory(self, ids: Iterable[str]) -> int:
        """Load, from the disk cache's KTM trailers, the exact DSML of tool ids the memory lacks (§2.7), so
        exact replay survives a restart. Called by handlers before rendering; reads files only."""
        if self.kv is None or not self.opt.exact_replay:
            return 0
        from ds4.kvstore import FLAG_TOOL_MAP, KVFileError, decode_ktm

        with self.memory_lock:
            missing = {i for i in ids if i and i not in self.memory}
        if not missing:
            return 0
        found: list[tuple[str, str]] = []
        for e in self.kv.entries():
            if not e.flags & FLAG_TOOL_MAP:
                continue
            try:
                with open(e.path, "rb") as f:
                    f.seek(e.trailer_offset)
                    found += [(i, b) for i, b in decode_ktm(f.read()) if i in missing]
            except (OSError, KVFileError) as err:
                log.warning("kv cache: tool map of %s unreadable: %s", e.name, err)
        with self.memory_lock:
            self.memory.load(found)
        return len(found)

    def store_shutdown(self) -> None:
        """Save the live sessions on a clean exit (§5.5 shutdown), unless a disk file already covers one."""
        if self.kv is None:
            return
        for slot in self.slots:
            live = slot.session.tokens
            if len(live) < self.kv.min_tokens:
                continue
            text = self.tok.decode_bytes(live)
            if self.kv.shutdown_target(len(live), self.kv.covered_tokens(text)) is not None:
                self._store(slot, 4)  # SaveReason.SHUTDOWN

    def _store(self, slot: _Slot, reason: int, hits: int = 0) -> None:
        from ds4.kvstore import SaveReason

        session = slot.session
        text = self.tok.decode_bytes(session.tokens)
        with self.memory_lock:
            tool_map = (
                self.memory.entries_in(text.decode("utf-8", "replace")) if self.opt.exact_replay else []
            )
        try:
            self.kv.store(text, session.snapshot(), SaveReason(reason), tool_map=tool_map, hits=hits)
        except Exception:  # a failed store never fails the request
            log.exception("kv cache store failed")
        slot.last_stored = max(slot.last_stored, len(session.tokens))

    def _prefill(self, job: Job, slot: _Slot, tokens: list[int]) -> int:
        """Sync the session to `tokens` in chunks; returns the reused prefix length."""
        if len(tokens) >= self.opt.ctx:
            raise RuntimeError(f"prompt has {len(tokens)} tokens, context is {self.opt.ctx}")
        session = slot.session
        live = session.tokens
        if live and tokens[: len(live)] == live:
            reused = len(live)
        else:
            reused = self._checkpoint_prefix(slot, tokens)
        stops: dict[int, int] = {}
        if self.kv is not None:
            from ds4.kvstore import chat_anchor

            anchor = chat_anchor(tokens, self.tok.user_id, self.tok.assistant_id)
            stops = dict(self.kv.prefill_stops(len(tokens), reused, slot.last_stored, anchor))
        step = max(1, self.opt.prefill_chunk)
        first = (reused // step + 1) * step  # chunk ends at absolute multiples of the chunk size
        ends = set(range(first, len(tokens), step)) | {len(tokens)} | set(stops)
        keep = getattr(session, "keep_checkpoint", None)
        last_beat = time.monotonic()
        try:
            for end in sorted(e for e in ends if reused < e <= len(tokens)):
                if job.cancel.is_set():  # the client is gone: keep what was prefilled, stop here
                    raise _Cancelled
                if keep is not None:  # only the whole prompt is worth a rewind checkpoint
                    session.keep_checkpoint = keep and end == len(tokens)  # type: ignore[attr-defined]
                session.sync(tokens[:end])
                if end in stops:
                    self._store(slot, int(stops[end]))
                if time.monotonic() - last_beat >= self.opt.keepalive_s:
                    job.emit(Keepalive())
                    last_beat = time.monotonic()
        finally:
            if keep is not None:
                session.keep_checkpoint = keep  # type: ignore[attr-defined]
        if reused >= len(tokens):
            session.sync(tokens)  # nothing to prefill; makes the checkpoint current
        return min(reused, len(tokens))

    def _decode(
        self, job: Job, slot: _Slot, prompt: list[int], reused: int, prefilled: int, prefill_s: float
    ) -> Done:
        """Decode after `_prefill` through the shared generation loop; the session holds `prompt`."""
        from ds4.engine.generate import Finish, Prefilled, TokenEvent, generate

        req, session = job.request, slot.session
        raw = req.dialect == "completions"
        stream = (
            None if raw else DsmlStream(thinking=req.thinking, id_prefix=req.id_prefix, taken=self._taken)
        )
        tracker = DsmlTracker() if req.tools and not raw else None
        stopper = StopScanner(req.stops)  # the stops stay here, not in generate: see StopScanner
        self.source.start(job)
        halt: str | None = None  # the finish the worker itself ended on: a stop string, a closed tool block
        store_due = False  # the last token's continued store, once generate has evaluated that token

        def pick(logits: Any, sp: Any, rng: Any) -> int:
            nonlocal store_due
            if store_due:  # generate evaluated the previous token: its continued store comes first
                self._maybe_continued_store(slot, stream)
                store_due = False
            return self.source.next_token(job, logits, sp, rng, bool(tracker and tracker.force_greedy))

        events = generate(
            session,  # type: ignore[arg-type]
            prompt,
            self._generate_params(req, len(prompt)),
            cancel=lambda: halt is not None or job.cancel.is_set(),
            tokenizer=self.tok,
            prefilled=Prefilled(prefilled, prefill_s),
            next_token=pick,
            eval_last=True,  # the KV keeps every generated token: the next turn continues on it
        )
        pieces: list[str] = []  # the text after stop scanning
        seen = 0  # characters of raw token text so far
        fin: Finish | None = None
        for ev in events:
            if isinstance(ev, Finish):
                fin = ev
            elif isinstance(ev, TokenEvent):
                seen += len(ev.piece)
                if tracker is not None:
                    tracker.update(ev.piece)
                text = stopper.feed(ev.piece)
                pieces.append(text)
                self._forward_text(job, stream, text)
                if stopper.hit:
                    job.stats["stop_hit"] = True
                    halt = "stop"
                elif stream is not None and req.tools and stream.block_ended:
                    halt = "tool_calls"
                else:
                    store_due = True
        assert fin is not None  # generate always ends with a Finish
        if fin.reason == "error":
            raise fin.exception or RuntimeError(fin.error)
        if store_due:
            self._maybe_continued_store(slot, stream)
        finish = halt or ("error" if fin.reason == "cancelled" else fin.reason)
        if finish == "error":  # the client went away: not one token more
            job.cancelled = True
            self._count(cancelled_total=1)
        if not stopper.hit:  # what the detokenizer still held (an incomplete UTF-8 tail) goes out now
            tail = stopper.feed(fin.text[seen:]) + stopper.flush()
            pieces.append(tail)
            self._forward_text(job, stream, tail)
        message = self._message(job, stream, "".join(pieces))
        if message.calls:
            finish = "tool_calls"
        n = len(fin.tokens) + fin.eos  # the server counts the EOS token as generated
        if n and fin.timing.decode_s > 0:
            self.metrics.decode_tps = n / fin.timing.decode_s
        self._count(generated_tokens_total=n)
        job.stats["generated"] = n
        usage = Usage(prompt_tokens=len(prompt), completion_tokens=n, cached_tokens=reused)
        return Done(finish=finish, message=message, usage=usage, raw_text="".join(pieces))  # type: ignore[arg-type]

    def _generate_params(self, req: Request, prompt_len: int) -> Any:
        """The request's limits and sampling as ds4.engine.generate.GenerateParams (no stop strings)."""
        from ds4.engine.generate import GenerateParams
        from ds4.engine.sampling import SamplingParams

        limit = req.max_tokens if req.max_tokens is not None else self.opt.default_max_tokens
        s = req.sampling
        return GenerateParams(
            max_tokens=max(0, min(limit, self.opt.ctx - prompt_len)),
            sampling=SamplingParams(s.temperature, s.top_k, s.top_p, s.min_p, s.seed),
            thinking=False,  # raw text back: DsmlStream does the thinking split
        )

    def _message(self, job: Job, stream: DsmlStream | None, text: str) -> ParsedMessage:
        """Close the DSML projection (its last events go out) and remember the exact DSML of any calls."""
        if stream is None:
            return ParsedMessage(reasoning=None, content=text)
        for ev in stream.finish():
            job.emit(ev)
        message = stream.message
        if message.calls and message.raw_dsml and self.opt.exact_replay:
            with self.memory_lock:
                self.memory.remember([c.id for c in message.calls], message.raw_dsml)
        return message

    def _taken(self, tool_id: str) -> bool:
        with self.memory_lock:
            return tool_id in self.memory

    def _forward_text(self, job: Job, stream: DsmlStream | None, text: str) -> None:
        if not text:
            return
        if stream is None:
            job.emit(TextDelta(text))
            return
        for ev in stream.feed(text):
            job.emit(ev)

    def _maybe_continued_store(self, slot: _Slot, stream: DsmlStream | None) -> None:
        n = len(slot.session.tokens)
        if self.kv is None or n >= self.opt.ctx:  # a full context is not continued
            return
        in_block = bool(stream is not None and stream.in_block)
        if self.kv.continued_due(n, slot.last_stored, in_tool_block=in_block):
            self._store(slot, 2)  # SaveReason.CONTINUED

    # ---- trace -------------------------------------------------------------------------------

    def _write_trace(self, job: Job, done: Done, source: str) -> None:
        if self.trace is None:
            return
        req, m = job.request, done.message
        n = self.metrics.requests_total
        lines = [
            f"===== request {n} {time.strftime('%Y-%m-%d %H:%M:%S')} =====",
            f"kind={req.dialect} model={req.model} stream={req.stream} tools={len(req.tools)} "
            f"think_mode={req.mode} prompt_tokens={done.usage.prompt_tokens} "
            f"cached_tokens={done.usage.cached_tokens} max_tokens={req.max_tokens}",
            "--- cache decision ---",
            f"cache_source={source} prefilled={job.stats.get('prefilled')} tool_replay: "
            f"mem={req.replay_stats.get('replayed', 0)} canonical={req.replay_stats.get('canonical', 0)}",
            "--- raw request json ---",
            req.raw_json.decode("utf-8", "replace"),
            "--- rendered prompt ---",
            req.prompt_text,
            "--- generated text ---",
            done.raw_text,
            "--- parsed message ---",
            f"finish={done.finish} generated_tokens={done.usage.completion_tokens}",
            f"reasoning={m.reasoning!r}",
            f"content={m.content!r}",
            *(
                f"tool_call[{i}] id={c.id} name={c.name} arguments={c.arguments}"
                for i, c in enumerate(m.calls)
            ),
            f"===== end request {n} =====",
            "",
        ]
        try:
            with self._trace_lock:
                self.trace.write("\n".join(lines))
                self.trace.flush()
        except OSError:
            log.warning("could not write the trace file")


__all__ = ["Job", "KVBudget", "SamplerSource", "StopScanner", "TokenSource", "Worker", "WorkerOptions"]
