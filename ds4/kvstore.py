"""Disk KV cache (product.md §5.4–5.8, model.md §11.4): one checkpoint = one `DIR/<sha1>.kv` file.

File ("KVC" v1, little-endian; the name is the lowercase SHA-1 of the cache text + ".kv"):

    0  "KVC"  3 version=1  4 quant_bits (2|4)  5 reason  6 ext flags  7 reserved
    8  u32 tokens  12 u32 hits  16 u32 ctx at save  20 reserved[4]
    24 u64 created unix  32 u64 last-used unix  40 u64 payload bytes
    48 u32 text length, text bytes | DSV4 payload |
    [flag bit0] "KTM" v1, u32 n, n x (u32 id_len, u32 dsml_len, id, dsml)

Listing and lookup read only the 52-byte head of each file (the candidate's stored text, the payload's own
13-u32 header and its KTM trailer are read once it wins); the payload is read only to restore it.

Durability: a file is written to `<name>.kv.tmp.<pid>` in the same directory, fsynced, renamed over the final
name and the directory fsynced, so a kill -9 at any point leaves either no file or a complete one (temp files
of dead writers are removed at start). Hit count and last-used time are patched in place (two small writes
into the first sector; a torn update leaves the old or the new value, both valid). A tool-map rewrite clears
the trailer flag before touching the trailer and sets it only after the new trailer is on disk.

Any file that fails validation is logged once (warning) and moved to `DIR/bad/` (the newest few are kept);
nothing in here raises on a bad file.

Eviction policy (see `_score`; where it deliberately differs from the original ds4 of §5.7):
  * benefit per byte: score = weight x tokens / file_bytes, weight = (hits + 1) x 2^(-age / 6 h) with age the
    time since last use (or creation). The original decays only the hits, so a never-hit file kept its full
    weight forever and a stale big file outranked the fresh cold anchor; here every file fades unless hit.
  * files this server can never load (saved ctx > current ctx, or another quant when cross-quant reuse is
    refused) go first (score 0).
  * protected, never evicted: the file being stored (during its own store), the file of the latest lookup
    hit (until the next hit), and every file whose text is a prefix of a text the caller is about to look up
    (`protect=`) — the original evicted, before a fallback load, the very prefix that load needed
    (ds4 PR #447/#448).
  * admission instead of store-then-evict: a store that would have to evict a file scoring higher than the
    new file (or a protected file) is declined before anything is written, as is a file that alone exceeds
    the budget, so one-off prompts cannot flush a hot prefix and no file is written only to be deleted.
  * a hit is not deleted ("consumed") when it is longer than cold_max (the original did): the budget decides,
    and the file still serves a retry/regenerate of the same turn.
  * evict/shutdown stores are skipped when a disk file already covers the live text to within min_tokens
    tokens (`evict_target(..., covered=)`): re-prefilling that tail is cheap, writing a new file is not
    (54% of one user's 870 GiB/month of cache writes were evict stores, product.md §8.1).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from ds4.config import (
    KV_CACHE_BOUNDARY_ALIGN_TOKENS,
    KV_CACHE_BOUNDARY_TRIM_TOKENS,
    KV_CACHE_COLD_MAX_TOKENS,
    KV_CACHE_CONTINUED_INTERVAL_TOKENS,
    KV_CACHE_MIN_TOKENS,
    KV_DISK_SPACE_MB,
)
from ds4.errors import Ds4Error

if TYPE_CHECKING:  # the engine (torch) is imported only when a payload is restored into a session
    from ds4.engine.session import Session

log = logging.getLogger("ds4.kvstore")

MAGIC = b"KVC"
VERSION = 1
HEADER = struct.Struct("<3sBBBBBIII4sQQQ")  # the 48-byte fixed header
TEXT_LEN = struct.Struct("<I")
HEAD_BYTES = HEADER.size + TEXT_LEN.size  # 52: all a directory scan reads
KTM_MAGIC = b"KTM"
KTM_VERSION = 1
KTM_HEAD = struct.Struct("<3sBI")
KTM_ENTRY = struct.Struct("<II")
KTM_MAX_ID = 256
DSV4_HEAD = struct.Struct("<13I")  # model.md §11.3 payload header
DSV4_MAGIC = 0x34565344

FLAG_TOOL_MAP = 1  # KTM trailer present
FLAG_RESPONSES_VISIBLE = 2  # cache text is the Responses-visible transcript
FLAG_THINKING_VISIBLE = 4  # cache text is the thinking-visible transcript

HIT_HALF_LIFE_S = 6 * 3600.0
BUDGET_SLACK = 1.01  # a file must fit the budget with 1% to spare (§5.5)
BAD_DIR = "bad"
BAD_KEEP = 4  # quarantined files kept for inspection, newest first
WRITE_CHUNK = 8 << 20
_NAME_RE = re.compile(r"^[0-9a-f]{40}\.kv$")
_TEMP_RE = re.compile(r"^[0-9a-f]{40}\.kv\.tmp\.(\d+)$")

FaultHook = Callable[[str], None]  # called with a write stage ("partial", "synced"); tests inject faults


class SaveReason(IntEnum):
    UNKNOWN = 0
    COLD = 1
    CONTINUED = 2
    EVICT = 3
    SHUTDOWN = 4
    AGENT_SYSTEM = 5
    AGENT_SESSION = 6


class KVFileError(Ds4Error, ValueError):
    """A cache file that cannot be used (the message names the field, expected and actual value)."""


class _FileChanged(KVFileError):
    """The file was replaced since it was listed: not a bad file, just a stale listing."""


# ---------------------------------------------------------------------------------------------
# File format
# ---------------------------------------------------------------------------------------------


def cache_name(text: bytes) -> str:
    """File name of a checkpoint: lowercase hex SHA-1 of its cache text + ".kv"."""
    return hashlib.sha1(text).hexdigest() + ".kv"


@dataclass(frozen=True)
class Entry:
    """One cache file as its head describes it (the stored text itself is not held)."""

    path: Path
    quant_bits: int
    reason: int
    flags: int
    n_tokens: int
    hits: int
    ctx: int
    created: int
    last_used: int
    payload_bytes: int
    text_bytes: int
    file_bytes: int

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def payload_offset(self) -> int:
        return HEAD_BYTES + self.text_bytes

    @property
    def trailer_offset(self) -> int:
        return self.payload_offset + self.payload_bytes


def pack_header(
    *,
    quant_bits: int,
    reason: int,
    flags: int,
    n_tokens: int,
    hits: int,
    ctx: int,
    created: int,
    last_used: int,
    payload_bytes: int,
    text_bytes: int,
) -> bytes:
    """The 52 bytes that start a file: the fixed header and the cache-text length."""
    head = HEADER.pack(
        MAGIC,
        VERSION,
        quant_bits,
        reason,
        flags,
        0,
        n_tokens,
        hits,
        ctx,
        bytes(4),
        created,
        last_used,
        payload_bytes,
    )
    return head + TEXT_LEN.pack(text_bytes)


def parse_head(head: bytes, path: Path, file_bytes: int) -> Entry:
    """Validate a file's first 52 bytes against its size (§5.4 validity rules); raises KVFileError."""
    if len(head) < HEAD_BYTES:
        raise KVFileError(f"truncated header: expected {HEAD_BYTES} bytes, got {len(head)}")
    (magic, version, quant, reason, flags, _, n_tokens, hits, ctx, _, created, last_used, payload_bytes) = (
        HEADER.unpack_from(head)
    )
    (text_bytes,) = TEXT_LEN.unpack_from(head, HEADER.size)
    checks = [
        ("magic", MAGIC, magic),
        ("version", VERSION, version),
    ]
    for what, want, got in checks:
        if want != got:
            raise KVFileError(f"bad {what}: expected {want!r}, got {got!r}")
    if quant not in (2, 4):
        raise KVFileError(f"bad quant bits: expected 2 or 4, got {quant}")
    if n_tokens == 0:
        raise KVFileError("bad token count: expected > 0, got 0")
    need = HEAD_BYTES + text_bytes + payload_bytes
    if file_bytes < need:
        raise KVFileError(f"truncated file: header needs at least {need} bytes, file has {file_bytes}")
    return Entry(
        path,
        quant,
        reason,
        flags,
        n_tokens,
        hits,
        ctx,
        created,
        last_used,
        payload_bytes,
        text_bytes,
        file_bytes,
    )


def encode_ktm(entries: Sequence[tuple[str, str]]) -> bytes:
    """The "KTM" tool-id trailer for (tool id, exact DSML block) pairs."""
    parts = [KTM_HEAD.pack(KTM_MAGIC, KTM_VERSION, len(entries))]
    for tool_id, dsml in entries:
        tid, block = tool_id.encode(), dsml.encode()
        if not 1 <= len(tid) <= KTM_MAX_ID:
            raise ValueError(f"tool id must be 1..{KTM_MAX_ID} bytes, got {len(tid)}: {tool_id[:40]!r}")
        parts += [KTM_ENTRY.pack(len(tid), len(block)), tid, block]
    return b"".join(parts)


def decode_ktm(blob: bytes) -> list[tuple[str, str]]:
    """Parse a whole KTM trailer (it must end exactly at the end of the file); raises KVFileError."""
    if len(blob) < KTM_HEAD.size:
        raise KVFileError(f"truncated KTM trailer: expected >= {KTM_HEAD.size} bytes, got {len(blob)}")
    magic, version, count = KTM_HEAD.unpack_from(blob)
    if magic != KTM_MAGIC or version != KTM_VERSION:
        raise KVFileError(f"bad KTM trailer: expected {KTM_MAGIC!r} v{KTM_VERSION}, got {magic!r} v{version}")
    pos, out = KTM_HEAD.size, []
    for i in range(count):
        if pos + KTM_ENTRY.size > len(blob):
            raise KVFileError(f"truncated KTM trailer: entry {i} of {count} starts past the end")
        id_len, dsml_len = KTM_ENTRY.unpack_from(blob, pos)
        pos += KTM_ENTRY.size
        if not 1 <= id_len <= KTM_MAX_ID:
            raise KVFileError(f"bad KTM entry {i}: id length expected 1..{KTM_MAX_ID}, got {id_len}")
        if pos + id_len + dsml_len > len(blob):
            raise KVFileError(f"truncated KTM trailer: entry {i} needs {id_len + dsml_len} bytes")
        try:
            tool_id = blob[pos : pos + id_len].decode()
            dsml = blob[pos + id_len : pos + id_len + dsml_len].decode()
        except UnicodeDecodeError as e:
            raise KVFileError(f"bad KTM entry {i}: not UTF-8 ({e.reason})") from None
        pos += id_len + dsml_len
        out.append((tool_id, dsml))
    if pos != len(blob):
        raise KVFileError(f"bad KTM trailer: {len(blob) - pos} trailing bytes after {count} entries")
    return out


def payload_head(payload: bytes | memoryview) -> tuple[int, int]:
    """(ctx, token count) from a DSV4 payload's header; raises KVFileError if it is not one."""
    if len(payload) < DSV4_HEAD.size:
        raise KVFileError(f"payload too short for a DSV4 header: {len(payload)} bytes")
    h = DSV4_HEAD.unpack_from(payload)
    if h[0] != DSV4_MAGIC or h[1] != 1:
        raise KVFileError(f"payload is not DSV4 v1: magic {h[0]:#010x} version {h[1]}")
    return h[2], h[7]


# ---------------------------------------------------------------------------------------------
# Store triggers (§5.5): pure decisions, the worker owns the live session
# ---------------------------------------------------------------------------------------------


def chat_anchor(tokens: Sequence[int], user_id: int, assistant_id: int) -> int | None:
    """Position of the last User token before the first Assistant token (the stable system prefix)."""
    anchor = None
    for i, t in enumerate(tokens):
        if t == assistant_id:
            break
        if t == user_id:
            anchor = i
    return anchor


def floor_align(n: int, align: int) -> int:
    return n // align * align if align > 0 else n


@dataclass
class StoreSchedule:
    """The continued-store frontier of the live session (§5.5): what was last saved (or reserved)."""

    last_stored: int = 0

    def on_store(self, n_tokens: int) -> None:  # also cold's reservation
        self.last_stored = max(self.last_stored, n_tokens)

    def on_disk_hit(self, n_tokens: int) -> None:
        self.last_stored = n_tokens

    def on_live_miss(self) -> None:
        self.last_stored = 0


@dataclass(frozen=True)
class Hit:
    """A lookup result: the file, how many prompt bytes its text covers, and its tool-id map."""

    entry: Entry
    text_bytes: int
    tool_map: list[tuple[str, str]] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return self.entry.n_tokens


# ---------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------


class KVStore:
    """A directory of checkpoint files with a byte budget. Thread-safe; one instance per directory."""

    def __init__(
        self,
        dir: str | os.PathLike[str],
        *,
        space_mb: int = KV_DISK_SPACE_MB,
        min_tokens: int = KV_CACHE_MIN_TOKENS,
        cold_max_tokens: int = KV_CACHE_COLD_MAX_TOKENS,
        continued_interval_tokens: int = KV_CACHE_CONTINUED_INTERVAL_TOKENS,
        boundary_trim_tokens: int = KV_CACHE_BOUNDARY_TRIM_TOKENS,
        boundary_align_tokens: int = KV_CACHE_BOUNDARY_ALIGN_TOKENS,
        quant_bits: int = 2,
        ctx: int,
        reject_different_quant: bool = False,
        clock: Callable[[], float] = time.time,
        fault_hook: FaultHook | None = None,
    ) -> None:
        _check_params(
            space_mb,
            min_tokens,
            cold_max_tokens,
            continued_interval_tokens,
            boundary_trim_tokens,
            boundary_align_tokens,
            quant_bits,
            ctx,
        )
        self.dir = Path(dir)
        self.budget = space_mb << 20
        self.min_tokens, self.cold_max = min_tokens, cold_max_tokens
        self.interval, self.trim, self.align = (
            continued_interval_tokens,
            boundary_trim_tokens,
            boundary_align_tokens,
        )
        self.quant_bits, self.ctx, self.reject_different_quant = quant_bits, ctx, reject_different_quant
        self.clock, self.fault_hook = clock, fault_hook
        self._lock = threading.RLock()
        self._hit_name: str | None = None  # protected: the latest lookup hit
        self._warned: set[tuple[str, int, int]] = set()  # bad files that could not be moved aside
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._clean_temps()
        self.evict()

    # ---- triggers ----------------------------------------------------------------------------

    @property
    def continued_step(self) -> int:
        """The continued interval rounded up to the alignment (10000 -> 10240); 0 = disabled."""
        if self.interval <= 0:
            return 0
        return -(-self.interval // self.align) * self.align if self.align > 0 else self.interval

    def cold_target(self, prompt_len: int, cached: int, anchor: int | None = None) -> int | None:
        """Token count to save during a cold prefill (None: no cold save). Reserve it in the schedule."""
        if self.cold_max == 0 or cached != 0 or not self.min_tokens <= prompt_len <= self.cold_max:
            return None
        if anchor is not None and self.min_tokens <= anchor <= prompt_len:
            return anchor
        if prompt_len > self.min_tokens + self.trim:
            target = floor_align(prompt_len - self.trim, self.align)
            if target >= self.min_tokens:
                return target
        return prompt_len

    def continued_due(self, live_len: int, last_stored: int, *, in_tool_block: bool = False) -> bool:
        """True when the live session sits exactly on a continued frontier that is not yet stored."""
        step = self.continued_step
        return (
            step > 0
            and not in_tool_block
            and live_len > 0
            and live_len % step == 0
            and live_len >= self.min_tokens
            and live_len > last_stored
        )

    def continued_frontiers(self, start: int, end: int, last_stored: int) -> list[int]:
        """Frontiers in (start, end] a prefill from `start` to `end` should stop at to save."""
        step = self.continued_step
        if step <= 0:
            return []
        first = (start // step + 1) * step
        return [n for n in range(first, end + 1, step) if self.continued_due(n, last_stored)]

    def prefill_stops(
        self, prompt_len: int, cached: int, last_stored: int, anchor: int | None = None
    ) -> list[tuple[int, SaveReason]]:
        """Where a prefill from `cached` to `prompt_len` tokens stops to save, in order.

        The cold target is reserved first (§5.5), so no continued store repeats or precedes it; the caller
        records each stop with StoreSchedule.on_store once the file is written.
        """
        cold = self.cold_target(prompt_len, cached, anchor)
        stops = [(cold, SaveReason.COLD)] if cold is not None else []
        reserved = max(last_stored, cold or 0)
        stops += [(n, SaveReason.CONTINUED) for n in self.continued_frontiers(cached, prompt_len, reserved)]
        return sorted(stops)

    def evict_target(self, live_len: int, covered: int = 0) -> int | None:
        """Token count to save when the live session is dropped (also shutdown); None = not worth it.

        `covered` is the token count of the longest disk file already covering the live text (lookup).
        """
        if live_len < self.min_tokens or live_len - covered < self.min_tokens:
            return None
        return live_len

    shutdown_target = evict_target

    def fits_budget(self, file_bytes: int) -> bool:
        return math.ceil(file_bytes * BUDGET_SLACK) <= self.budget

    # ---- lookup and load ---------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        """Every valid file (bad ones are moved aside), by the 52-byte head only."""
        with self._lock:
            return self._scan()

    def usable(self, e: Entry) -> bool:
        """Whether this server could load the file at all (ctx, quant, min tokens)."""
        if e.ctx > self.ctx or e.n_tokens < self.min_tokens:
            return False
        return not (self.reject_different_quant and e.quant_bits != self.quant_bits)

    def lookup(self, prompt: str | bytes) -> Hit | None:
        """The file whose cache text is the longest byte prefix of `prompt` (ties: more tokens).

        `Hit.text_bytes` counts UTF-8 bytes (a token boundary may split a character): the caller restores the
        payload and tokenizes `prompt_bytes[text_bytes:]` as the suffix. The hit is pinned against eviction.
        """
        data = prompt.encode() if isinstance(prompt, str) else bytes(prompt)
        with self._lock:
            cands = [e for e in self._scan() if e.text_bytes <= len(data) and self.usable(e)]
            digests = _prefix_names(data, {e.text_bytes for e in cands})
            cands.sort(key=lambda e: (e.text_bytes, e.n_tokens), reverse=True)
            for e in cands:
                if digests[e.text_bytes] != e.name:
                    continue
                try:
                    hit = self._verify(e, data)
                except _FileChanged:
                    continue
                except (OSError, KVFileError) as err:
                    self._quarantine(e.path, str(err))
                    continue
                self._hit_name = e.name
                return hit
            return None

    def covered_tokens(self, text: str | bytes) -> int:
        """Tokens of the longest file covering `text` (for evict_target); does not pin the file."""
        with self._lock:
            pinned = self._hit_name
            hit = self.lookup(text)
            self._hit_name = pinned
            return hit.n_tokens if hit else 0

    def read_payload(self, hit: Hit) -> bytes | None:
        """The DSV4 payload of a hit (None, after a warning and moving the file aside, if unreadable)."""
        e = hit.entry
        try:
            with open(e.path, "rb") as f:
                _check_same(f, e)
                f.seek(e.payload_offset)
                payload = f.read(e.payload_bytes)
            if len(payload) != e.payload_bytes:
                raise KVFileError(f"payload truncated: expected {e.payload_bytes} bytes, got {len(payload)}")
            if payload_head(payload)[1] != e.n_tokens:
                raise KVFileError("payload token count differs from the header")
        except _FileChanged as err:
            log.info("kv cache: %s", err)
            return None
        except (OSError, KVFileError) as err:
            self._quarantine(e.path, str(err))
            return None
        return payload

    def restore_into(self, session: Session, hit: Hit) -> bool:
        """Load a hit into a session and count the hit; False (file moved aside) if it does not load.

        A payload of another model or layout fails with the engine's SnapshotError, which leaves the
        session untouched.
        """
        from ds4.engine.snapshot import SnapshotError

        payload = self.read_payload(hit)
        if payload is None:
            return False
        try:
            session.restore(payload)
        except SnapshotError as err:
            self._quarantine(hit.entry.path, f"payload does not load: {err}")
            return False
        self.touch(hit.entry)
        return True

    def touch(self, e: Entry, *, hit: bool = True) -> None:
        """In place: hits + 1 (if hit) and last_used = now. A failure is logged, never raised."""
        with self._lock:
            try:
                with open(e.path, "r+b") as f:
                    cur = _check_same(f, e)
                    if hit:
                        f.seek(12)
                        f.write(struct.pack("<I", min(cur.hits + 1, 0xFFFFFFFF)))
                    f.seek(32)
                    f.write(struct.pack("<Q", int(self.clock())))
                    f.flush()
                    os.fsync(f.fileno())
            except (OSError, KVFileError) as err:
                log.warning("kv cache: could not update %s: %s", e.name, err)

    # ---- store -------------------------------------------------------------------------------

    def store(
        self,
        text: str | bytes,
        payload: bytes,
        reason: int = SaveReason.UNKNOWN,
        *,
        tool_map: Iterable[tuple[str, str]] | None = None,
        flags: int = 0,
        protect: Iterable[str | bytes] = (),
        hits: int = 0,
    ) -> Entry | None:
        """Save a checkpoint keyed by `text` (its decoded tokens, or a visible transcript with `flags`).

        Declines (None, logged) below min_tokens, beyond the budget, or when admitting it would evict a
        more valuable or protected file; a failed write (ENOSPC...) leaves the directory as it was.
        `protect`: texts about to be looked up, whose prefixes eviction must keep. `hits`: the initial hit
        count, e.g. how many requests the live session served before this evict store (its proven value).
        """
        data = text.encode() if isinstance(text, str) else bytes(text)
        ctx, n_tokens = payload_head(payload)
        if n_tokens < self.min_tokens:
            log.info("kv cache: not storing %d tokens (< min %d)", n_tokens, self.min_tokens)
            return None
        ktm_entries = [
            (i, b) for i, b in (tool_map or ()) if 1 <= len(i.encode()) <= KTM_MAX_ID and b.encode() in data
        ]
        ktm = encode_ktm(ktm_entries) if ktm_entries else b""
        flags = (flags & ~FLAG_TOOL_MAP) | (FLAG_TOOL_MAP if ktm else 0)
        name = cache_name(data)
        with self._lock:
            existing = self._compatible(self.dir / name, data)
            if existing is not None:
                self._rewrite_trailer(existing, ktm)
                return existing
            size = HEAD_BYTES + len(data) + len(payload) + len(ktm)
            if not self.fits_budget(size):
                log.warning("kv cache: not storing %s: %d bytes exceed the budget", name, size)
                return None
            protected = self._protected(protect) - {name}
            new_score = _score(hits + 1, 0, n_tokens, size)  # a fresh file: age 0
            if not self._admit(size, new_score, protected, name):
                return None
            now = int(self.clock())
            head = pack_header(
                quant_bits=self.quant_bits,
                reason=int(reason),
                flags=flags,
                n_tokens=n_tokens,
                hits=min(max(hits, 0), 0xFFFFFFFF),
                ctx=ctx,
                created=now,
                last_used=now,
                payload_bytes=len(payload),
                text_bytes=len(data),
            )
            if not self._write_atomic(name, [head, data, payload, ktm]):
                return None
            self._evict(protected | {name})
            log.info("kv cache: stored %s tokens=%d reason=%s bytes=%d", name, n_tokens, reason, size)
            return self._read_entry(self.dir / name)

    def evict(self, protect: Iterable[str | bytes] = ()) -> None:
        """Delete lowest-score files until the directory fits the budget (see the module docstring)."""
        with self._lock:
            self._evict(self._protected(protect))

    # ---- internals: scanning ---------------------------------------------------------------------

    def _scan(self) -> list[Entry]:
        out = []
        try:
            names = sorted(os.listdir(self.dir))
        except OSError as err:
            log.warning("kv cache: cannot list %s: %s", self.dir, err)
            return out
        for name in names:
            if _NAME_RE.match(name):
                e = self._read_entry(self.dir / name)
                if e is not None:
                    out.append(e)
        return out

    def _read_entry(self, path: Path) -> Entry | None:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                return parse_head(f.read(HEAD_BYTES), path, size)
        except FileNotFoundError:
            return None
        except (OSError, KVFileError) as err:
            self._quarantine(path, str(err))
            return None

    def _verify(self, e: Entry, data: bytes) -> Hit:
        """Re-read a winning candidate: its text, the payload header and the KTM trailer."""
        with open(e.path, "rb") as f:
            _check_same(f, e)
            f.seek(HEAD_BYTES)
            if f.read(e.text_bytes) != data[: e.text_bytes]:
                raise KVFileError("stored text does not match its SHA-1 name")
            f.seek(e.payload_offset)
            ctx, n_tokens = payload_head(f.read(DSV4_HEAD.size))
            if n_tokens != e.n_tokens or ctx != e.ctx:
                raise KVFileError(
                    f"payload header disagrees with the file header: tokens {n_tokens} vs {e.n_tokens}, "
                    f"ctx {ctx} vs {e.ctx}"
                )
            tool_map = []
            if e.flags & FLAG_TOOL_MAP:
                f.seek(e.trailer_offset)
                tool_map = decode_ktm(f.read())
        return Hit(e, e.text_bytes, tool_map)

    def _compatible(self, path: Path, data: bytes) -> Entry | None:
        """An existing file for the same text that can be kept (only its trailer rewritten)."""
        e = self._read_entry(path)
        if e is None:
            return None
        if e.ctx > self.ctx or (self.reject_different_quant and e.quant_bits != self.quant_bits):
            log.info("kv cache replaced incompatible file %s", e.name)
            return None
        try:
            with open(path, "rb") as f:
                f.seek(HEAD_BYTES)
                same = f.read(e.text_bytes) == data
        except OSError:
            same = False
        if not same:
            log.info("kv cache replaced incompatible file %s (text differs)", e.name)
        return e if same else None

    # ---- internals: writing --------------------------------------------------------------------

    def _write_atomic(self, name: str, parts: list[bytes]) -> bool:
        final, tmp = self.dir / name, self.dir / f"{name}.tmp.{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                half = sum(map(len, parts)) // 2
                written = 0
                for part in parts:
                    for off in range(0, len(part), WRITE_CHUNK):
                        chunk = memoryview(part)[off : off + WRITE_CHUNK]
                        if written < half <= written + len(chunk):
                            f.write(chunk[: half - written])
                            f.flush()
                            self._fault("partial")
                            f.write(chunk[half - written :])
                        else:
                            f.write(chunk)
                        written += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            self._fault("synced")
            os.replace(tmp, final)
            _fsync_dir(self.dir)
            return True
        except OSError as err:
            why = "disk full" if err.errno == errno.ENOSPC else "write failed"
            log.warning("kv cache: %s while saving %s (%s); nothing stored", why, name, err)
            _unlink(tmp)
            return False

    def _rewrite_trailer(self, e: Entry, ktm: bytes) -> None:
        """Replace a file's tool map in place; at every step the file is valid (flag set last)."""
        try:
            with open(e.path, "r+b") as f:
                cur = _check_same(f, e)
                if cur.flags & FLAG_TOOL_MAP:
                    _patch_flags(f, cur.flags & ~FLAG_TOOL_MAP)
                f.truncate(e.trailer_offset)
                f.seek(32)
                f.write(struct.pack("<Q", int(self.clock())))
                if ktm:
                    f.seek(e.trailer_offset)
                    f.write(ktm)
                    f.flush()
                    os.fsync(f.fileno())
                    self._fault("trailer")
                    _patch_flags(f, cur.flags | FLAG_TOOL_MAP)
                f.flush()
                os.fsync(f.fileno())
        except (OSError, KVFileError) as err:
            log.warning("kv cache: could not rewrite the tool map of %s: %s", e.name, err)
            try:
                os.truncate(e.path, e.trailer_offset)
            except OSError:
                pass

    def _fault(self, stage: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(stage)

    def _clean_temps(self) -> None:
        """Remove temp files left by writers that died (another live process keeps its own)."""
        for name in os.listdir(self.dir):
            m = _TEMP_RE.match(name)
            if m and (int(m.group(1)) == os.getpid() or not _pid_alive(int(m.group(1)))):
                log.info("kv cache: removing stale temp file %s", name)
                _unlink(self.dir / name)

    # ---- internals: eviction ----------------------------------------------------------------------

    def _score(self, e: Entry, now: float) -> float:
        if not self.usable(e):
            return 0.0
        return _score(e.hits + 1, now - (e.last_used or e.created or now), e.n_tokens, e.file_bytes)

    def _protected(self, texts: Iterable[str | bytes]) -> set[str]:
        names = {self._hit_name} if self._hit_name else set()
        for text in texts:
            data = text.encode() if isinstance(text, str) else bytes(text)
            lengths = {e.text_bytes for e in self._scan() if e.text_bytes <= len(data)}
            names |= set(_prefix_names(data, lengths).values())
        return names

    def _victims(self, need: int, protected: set[str]) -> tuple[list[Entry], int, float]:
        """Lowest-score unprotected files to delete so that `need` more bytes fit the budget."""
        entries, now = self._scan(), self.clock()
        total = sum(e.file_bytes for e in entries)
        order = sorted(
            (e for e in entries if e.name not in protected),
            key=lambda e: (self._score(e, now), e.last_used, e.name),
        )
        victims, worst = [], 0.0
        for e in order:
            if total + need <= self.budget:
                break
            victims.append(e)
            worst = max(worst, self._score(e, now))
            total -= e.file_bytes
        return victims, total + need - self.budget, worst

    def _admit(self, size: int, new_score: float, protected: set[str], name: str) -> bool:
        _, over, worst = self._victims(size, protected | {name})
        if over > 0:
            log.info("kv cache: not storing %s: protected files fill the budget", name)
            return False
        if worst > new_score:
            log.info("kv cache: not storing %s: it would evict a more valuable checkpoint", name)
            return False
        return True

    def _evict(self, protected: set[str]) -> None:
        victims, over, _ = self._victims(0, protected)
        for e in victims:
            log.info(
                "kv cache: evicting %s tokens=%d hits=%d bytes=%d", e.name, e.n_tokens, e.hits, e.file_bytes
            )
            _unlink(e.path)
        if over > 0:
            log.warning("kv cache: protected files exceed the budget by %d bytes", over)

    # ---- internals: bad files ---------------------------------------------------------------------

    def _quarantine(self, path: Path, why: str) -> None:
        """Warn once and move a bad file into DIR/bad/ (keeping the newest BAD_KEEP)."""
        try:
            st = path.stat()
        except OSError:
            return
        key = (path.name, st.st_size, st.st_mtime_ns)
        if key in self._warned:
            return
        log.warning("kv cache: skipping bad file %s: %s", path.name, why)
        bad = self.dir / BAD_DIR
        try:
            bad.mkdir(mode=0o700, exist_ok=True)
            os.replace(path, bad / path.name)
        except OSError as err:
            log.warning("kv cache: could not move %s aside: %s", path.name, err)
            self._warned.add(key)
            return
        if self._hit_name == path.name:
            self._hit_name = None
        kept = sorted(bad.iterdir(), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in kept[BAD_KEEP:]:
            _unlink(old)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _score(weight: float, age_s: float, n_tokens: int, file_bytes: int) -> float:
    """Benefit per byte: (hits + 1) decayed by recency, times tokens saved, per byte of disk."""
    decay = 2.0 ** (-max(age_s, 0.0) / HIT_HALF_LIFE_S)
    return weight * decay * n_tokens / max(file_bytes, 1)


def _prefix_names(data: bytes, lengths: Iterable[int]) -> dict[int, str]:
    """cache_name(data[:n]) for every n, hashing `data` once (incremental SHA-1, copied at each length)."""
    out, h, pos = {}, hashlib.sha1(), 0
    for n in sorted(set(lengths)):
        h.update(data[pos:n])
        pos = n
        out[n] = h.copy().hexdigest() + ".kv"
    return out


def _check_same(f: BinaryIO, e: Entry) -> Entry:
    """Re-read an open file's head and check it is still the file `e` describes (not replaced)."""
    cur = parse_head(f.read(HEAD_BYTES), e.path, os.fstat(f.fileno()).st_size)
    if (cur.n_tokens, cur.payload_bytes, cur.text_bytes) != (e.n_tokens, e.payload_bytes, e.text_bytes):
        raise _FileChanged(f"{e.name} changed since it was listed")
    return cur


def _patch_flags(f: BinaryIO, flags: int) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.seek(6)
    f.write(bytes([flags]))
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        log.warning("kv cache: could not remove %s: %s", path, err)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_params(
    space_mb: int,
    min_tokens: int,
    cold_max: int,
    interval: int,
    trim: int,
    align: int,
    quant_bits: int,
    ctx: int,
) -> None:
    if space_mb <= 0:
        raise ValueError(f"kv disk space must be > 0 MiB, got {space_mb}")
    if min_tokens < 1:
        raise ValueError(f"kv cache min tokens must be >= 1, got {min_tokens}")
    if cold_max != 0 and cold_max < min_tokens:
        raise ValueError(
            f"kv cache cold max tokens must be 0 or >= min tokens ({min_tokens}), got {cold_max}"
        )
    for what, v in [("continued interval", interval), ("boundary trim", trim), ("boundary align", align)]:
        if v < 0:
            raise ValueError(f"kv cache {what} must be >= 0, got {v}")
    if quant_bits not in (2, 4):
        raise ValueError(f"kv cache quant bits must be 2 or 4, got {quant_bits}")
    if ctx < 2:
        raise ValueError(f"kv cache ctx must be >= 2, got {ctx}")
