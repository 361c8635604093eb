"""Disk KV cache (product.md §5.4–5.7, model.md §11.4) with real DSV4 payloads from the official-tiny model.

The KVC layout is re-parsed here with struct from the spec text (not with ds4/kvstore.py); trigger numbers
are worked out from the §5.5 rules; restored sessions are compared bit for bit with the saved session.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import BENCH_TEXT, REPO

import ds4
from ds4.kvstore import KVStore, SaveReason, StoreSchedule, chat_anchor

CTX = 1024
MIN = 64
LOGGER = "ds4.kvstore"


@pytest.fixture(scope="module")
def engine(official_gguf):
    eng = ds4.Engine.open(official_gguf, backend="cpu")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tokens(engine):
    ids = engine.tokenizer.encode(BENCH_TEXT.read_text(encoding="utf-8")[2000:8000])
    assert len(ids) >= 320
    return ids[:320]


@pytest.fixture(scope="module")
def snaps(engine, tokens):
    """One growing session: payload + logits at 96, 160 and 256 tokens, and logits after extending to 320."""
    s = engine.session(ctx=CTX)
    out = {}
    for n in (96, 160, 256):
        s.sync(tokens[:n])
        out[n] = (s.snapshot(), s.logits.clone())
    s.sync(tokens[:320])
    out[320] = (None, s.logits.clone())
    return out


@pytest.fixture
def text(engine, tokens):
    return lambda n: engine.tokenizer.decode_bytes(tokens[:n])


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(d: Path, **kw) -> KVStore:
    opts = dict(space_mb=64, min_tokens=MIN, cold_max_tokens=300, quant_bits=2, ctx=CTX)
    opts.update(kw)
    return KVStore(d, **opts)


def kv_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.is_file())


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


# ------------------------------------------------------------------ file format


def test_header_bytes_field_by_field(tmp_path, snaps, text):
    payload = snaps[160][0]
    body = text(160)
    body_str = body.decode("utf-8", errors="ignore")
    block = body_str[10:60]  # a DSML block that occurs in the text, and one that does not
    clock = Clock(1_790_000_123.0)
    st = make(tmp_path, clock=clock, quant_bits=4)
    tool_map = [("call_a", block), ("call_b", block), ("call_x", "\n\n<not in the text>")]
    e = st.store(body, payload, SaveReason.COLD, tool_map=tool_map)
    assert e is not None
    name = hashlib.sha1(body).hexdigest() + ".kv"
    assert kv_files(tmp_path) == [name] and e.path.name == name
    raw = (tmp_path / name).read_bytes()

    assert raw[0:3] == b"KVC" and raw[3] == 1 and raw[4] == 4  # magic, version, quant bits
    assert raw[5] == 1 and raw[6] == 0b001 and raw[7] == 0  # reason cold, ext: tool map, reserved
    n_tok, hits, ctx = struct.unpack_from("<3I", raw, 8)
    assert (n_tok, hits, ctx) == (160, 0, CTX)
    assert raw[20:24] == bytes(4)
    created, last_used, n_payload = struct.unpack_from("<3Q", raw, 24)
    assert created == last_used == 1_790_000_123 and n_payload == len(payload)
    (n_text,) = struct.unpack_from("<I", raw, 48)
    assert n_text == len(body) and raw[52 : 52 + n_text] == body
    off = 52 + n_text
    assert raw[off : off + n_payload] == payload
    assert raw[off : off + 4] == b"DSV4" and struct.unpack_from("<I", raw, off + 28)[0] == 160

    ktm = raw[off + n_payload :]
    assert ktm[0:3] == b"KTM" and ktm[3] == 1
    (count,) = struct.unpack_from("<I", ktm, 4)
    pos, got = 8, []
    for _ in range(count):
        id_len, dsml_len = struct.unpack_from("<II", ktm, pos)
        pos += 8
        got.append((ktm[pos : pos + id_len].decode(), ktm[pos + id_len : pos + id_len + dsml_len].decode()))
        pos += id_len + dsml_len
    assert pos == len(ktm)
    assert got == [("call_a", block), ("call_b", block)]  # only ids whose block occurs in the cache text


def test_round_trip_restores_bit_identical(tmp_path, engine, tokens, snaps, text):
    payload, logits256 = snaps[256]
    make(tmp_path).store(text(256), payload, SaveReason.EVICT)

    st = make(tmp_path)  # a restarted server
    hit = st.lookup(text(320).decode("utf-8", errors="strict"))
    assert hit is not None and hit.text_bytes == len(text(256)) and hit.n_tokens == 256
    s = engine.session(ctx=CTX)
    assert st.restore_into(s, hit)
    assert s.tokens == tokens[:256]
    assert torch.equal(s.logits, logits256)
    assert s.sync(tokens[:320]) == 64  # only the suffix is prefilled
    assert torch.equal(s.logits, snaps[320][1])  # bit-identical to the session that never left memory
    raw = hit.entry.path.read_bytes()
    assert struct.unpack_from("<I", raw, 12)[0] == 1  # hit counted in place
    assert s.snapshot()[:4] == b"DSV4"


def test_lookup_longest_prefix(tmp_path, snaps, text):
    st = make(tmp_path)
    for n in (96, 160, 256):
        assert st.store(text(n), snaps[n][0], SaveReason.CONTINUED) is not None
    assert st.lookup(text(320)).n_tokens == 256
    assert st.lookup(text(256)).n_tokens == 256  # the whole prompt
    assert st.lookup(text(200)).n_tokens == 160
    bent = bytearray(text(200))
    bent[len(text(96)) + 3] ^= 0x01  # diverges after the 96-token text
    assert st.lookup(bytes(bent)).n_tokens == 96
    assert st.lookup(b"unrelated " + text(320)) is None
    assert st.lookup(text(90)) is None

    assert make(tmp_path, ctx=512).lookup(text(320)) is None  # saved ctx 1024 > current 512
    assert make(tmp_path, min_tokens=200).lookup(text(320)).n_tokens == 256
    assert make(tmp_path, min_tokens=200).lookup(text(200)) is None  # 160 < min
    assert make(tmp_path, quant_bits=4).lookup(text(320)).n_tokens == 256  # 2/4-bit interchangeable
    assert make(tmp_path, quant_bits=4, reject_different_quant=True).lookup(text(320)) is None


def test_same_text_rewrites_only_the_tool_map(tmp_path, snaps, text):
    st = make(tmp_path)
    body = text(160)
    block = body.decode(errors="ignore")[5:40]
    e = st.store(body, snaps[160][0], SaveReason.COLD)
    ino, size = e.path.stat().st_ino, e.path.stat().st_size
    st.store(body, snaps[160][0], SaveReason.CONTINUED, tool_map=[("call_1", block)])
    raw = e.path.read_bytes()
    assert e.path.stat().st_ino == ino and raw[5] == 1 and raw[6] & 1  # same file, reason kept, map added
    assert raw[size : size + 3] == b"KTM"
    assert st.lookup(text(320)).tool_map == [("call_1", block)]

    def full(stage):
        if stage == "trailer":
            raise OSError(errno.ENOSPC, "No space left on device")

    make(tmp_path, fault_hook=full).store(body, snaps[160][0], tool_map=[("call_2", block)])
    raw = e.path.read_bytes()
    assert raw[6] & 1 == 0 and len(raw) == size  # map dropped, file still valid
    assert make(tmp_path).lookup(text(320)).tool_map == []


# ------------------------------------------------------------------ bad files


def _corrupt(kind: str, raw: bytes, n_text: int, n_payload: int) -> bytes:
    b = bytearray(raw)
    pay = 52 + n_text
    if kind.startswith("trunc@"):
        at = {"head": 30, "textlen": 50, "text": 52 + n_text // 2, "payload": pay + n_payload // 2}
        at["ktm"] = len(raw) - 3
        return bytes(b[: at[kind[6:]]])
    if kind == "magic":
        b[0:3] = b"KVX"
    elif kind == "version2":
        b[3] = 2
    elif kind == "quant3":
        b[4] = 3
    elif kind == "tokens0":
        b[8:12] = bytes(4)
    elif kind == "tokens_mismatch":
        struct.pack_into("<I", b, 8, 150)
    elif kind == "ktm_garbage":
        b[pay + n_payload :] = os.urandom(len(b) - pay - n_payload)
    elif kind == "ktm_idlen":
        struct.pack_into("<I", b, pay + n_payload + 8, 4000)
    elif kind == "wrong_model":
        struct.pack_into("<I", b, pay + 32, 43)  # DSV4 field 8: layer count of another model
    return bytes(b)


BAD = ["trunc@head", "trunc@textlen", "trunc@text", "trunc@payload", "trunc@ktm", "magic", "version2",
       "quant3", "tokens0", "tokens_mismatch", "ktm_garbage", "ktm_idlen", "wrong_model"]  # fmt: skip


@pytest.mark.parametrize("kind", BAD)
def test_bad_file_is_skipped_with_one_warning_and_moved_aside(tmp_path, engine, snaps, text, caplog, kind):
    body, payload = text(160), snaps[160][0]
    block = body.decode(errors="ignore")[5:40]
    e = make(tmp_path).store(body, payload, tool_map=[("call_1", block)])
    e.path.write_bytes(_corrupt(kind, e.path.read_bytes(), len(body), len(payload)))

    caplog.set_level(logging.INFO, logger=LOGGER)
    st = make(tmp_path)
    s = engine.session(ctx=CTX)
    hit = st.lookup(text(320))
    if kind == "wrong_model":  # header and text are fine: the engine's SnapshotError catches it
        assert hit is not None and not st.restore_into(s, hit) and s.tokens == []
    else:
        assert hit is None
    assert st.lookup(text(320)) is None
    msgs = warnings_of(caplog)
    assert len(msgs) == 1 and e.path.name in msgs[0], msgs
    assert not e.path.exists() and (tmp_path / "bad" / e.path.name).exists()
    assert make(tmp_path).entries() == [] and len(warnings_of(caplog)) == 1


# ------------------------------------------------------------------ crash safety


CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from ds4.kvstore import KVStore

    d, pay, txt, stage = sys.argv[1:]
    def hook(s):
        if s == stage:
            print(s, flush=True)
            sys.stdin.readline()  # parked here until the parent kills us
    st = KVStore(d, space_mb=64, min_tokens=8, quant_bits=2, ctx=1024, fault_hook=hook)
    st.store(Path(txt).read_bytes(), Path(pay).read_bytes())
    print("stored", flush=True)
    """
)


@pytest.mark.parametrize("stage", ["partial", "synced"])
def test_kill9_during_save_leaves_nothing_loadable(tmp_path, snaps, text, stage):
    d = tmp_path / "cache"
    (tmp_path / "p").write_bytes(snaps[256][0])
    (tmp_path / "t").write_bytes(text(256))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(d), str(tmp_path / "p"), str(tmp_path / "t"), stage],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert child.stdout.readline().decode().strip() == stage  # handshake: the child is mid-save
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert kv_files(d) == [f"{hashlib.sha1(text(256)).hexdigest()}.kv.tmp.{child.pid}"]
    st = make(d)
    assert kv_files(d) == []  # the dead writer's temp file is cleaned at start
    assert st.lookup(text(320)) is None and st.entries() == []


def test_disk_full_during_save_loses_nothing(tmp_path, snaps, text, caplog):
    p96 = snaps[96][0]
    size = 52 + len(text(96)) + len(p96)
    old = make(tmp_path, space_mb=1).store(text(96), p96)
    assert old is not None and size < (1 << 20) < 2 * size  # a second file forces an eviction

    def full(stage):
        if stage == "partial":
            raise OSError(errno.ENOSPC, "No space left on device")

    caplog.set_level(logging.WARNING, logger=LOGGER)
    st = make(tmp_path, space_mb=1, fault_hook=full, clock=Clock(2_000_000_000.0))
    assert st.store(b"other " + text(96), p96) is None
    msgs = warnings_of(caplog)
    assert len(msgs) == 1 and "disk full" in msgs[0]
    assert kv_files(tmp_path) == [old.path.name]  # temp removed, the old file not evicted
    assert make(tmp_path, space_mb=1).lookup(text(160)).n_tokens == 96


# ------------------------------------------------------------------ budget and eviction


def test_budget_holds_and_hot_prefix_survives_distinct_prompts(tmp_path, snaps, text):
    clock = Clock()
    hot_text, hot_payload = text(160), snaps[160][0]
    pay = snaps[256][0]
    per_file = 52 + len(pay) + 40
    budget_mb = 4
    st = make(tmp_path, space_mb=budget_mb, clock=clock)
    st.store(hot_text, hot_payload, SaveReason.COLD)
    stored = []
    for i in range(24):
        clock.t += 60
        if i % 3 == 0:  # the hot prefix is hit again (agent main loop)
            hit = st.lookup(hot_text + f" turn {i}".encode())
            assert hit is not None and hit.n_tokens == 160
            st.touch(hit.entry)
        e = st.store(f"distinct prompt {i:04d} ".encode() * 2, pay, SaveReason.EVICT)
        assert e is not None and e.path.exists()  # admitted, and not evicted by its own store
        stored.append(e.path.name)
        total = sum(p.stat().st_size for p in tmp_path.glob("*.kv"))
        assert total <= budget_mb << 20
        assert (tmp_path / hashlib.sha1(hot_text).hexdigest()).with_suffix(".kv").exists()
    names = kv_files(tmp_path)
    assert (budget_mb << 20) // per_file - 1 <= len(names) <= (budget_mb << 20) // per_file
    assert stored[-1] in names and stored[0] not in names  # the oldest one-off prompts went first


def test_just_hit_and_protected_prefixes_are_not_evicted(tmp_path, snaps, text):
    clock = Clock()
    pay = snaps[256][0]
    budget = 2  # room for two of these files, not three
    st = make(tmp_path, space_mb=budget, clock=clock)
    a = st.store(text(160), snaps[160][0])  # smaller file: the lowest score
    clock.t += 3600
    b = st.store(b"b " + text(256), pay)
    clock.t += 3600
    assert st.lookup(text(200)).entry.name == a.name  # a is pinned as the latest hit
    c = st.store(b"c " + text(256), pay)
    assert c is not None and a.path.exists() and not b.path.exists()
    # a restarted store has no pinned hit, but the caller protects the prefix of the prompt it will look up
    st2 = make(tmp_path, space_mb=budget, clock=clock)
    clock.t += 3600
    assert st2.store(b"d " + text(256), pay, protect=[text(320)]) is not None
    assert a.path.exists() and not c.path.exists()
    # when only protected files could make room, the store is declined instead of evicting them
    assert st2.store(b"e " + text(256), pay, protect=[text(320), b"d " + text(300)]) is None
    assert sorted(kv_files(tmp_path)) == sorted(
        [a.path.name, hashlib.sha1(b"d " + text(256)).hexdigest() + ".kv"]
    )


def test_admission_keeps_a_more_valuable_file(tmp_path, snaps, text):
    clock = Clock()
    st = make(tmp_path, space_mb=1, clock=clock)
    big = st.store(text(256), snaps[256][0])
    for _ in range(3):
        st.touch(big, hit=True)
    st._hit_name = None  # no pin: the decision is the score alone
    clock.t += 60
    assert st.store(b"one-off " + text(256), snaps[256][0]) is None  # would evict a hit file: declined
    assert big.path.exists()
    assert st.store(b"one-off " + text(256), snaps[256][0], hits=2) is None  # 3 < 4: still declined
    assert big.path.exists()
    clock.t += 30 * 24 * 3600  # a month later the hits have faded: the new file wins
    assert st.store(b"one-off " + text(256), snaps[256][0]) is not None and not big.path.exists()


def test_budget_enforced_at_start(tmp_path, snaps, text):
    clock = Clock()
    st = make(tmp_path, clock=clock)
    for i in range(4):
        clock.t += 60
        st.store(f"p{i} ".encode() + text(256), snaps[256][0])
    assert len(kv_files(tmp_path)) == 4
    make(tmp_path, space_mb=1, clock=clock)  # restart with a smaller budget
    left = kv_files(tmp_path)
    assert len(left) == 1 and left[0] == hashlib.sha1(b"p3 " + text(256)).hexdigest() + ".kv"  # newest kept


def test_too_small_or_too_big_is_declined(tmp_path, snaps, text):
    assert make(tmp_path, min_tokens=200).store(text(160), snaps[160][0]) is None
    assert make(tmp_path, space_mb=1).store(b"x" * 200_000 + text(256), snaps[256][0]) is None  # > budget
    assert kv_files(tmp_path) == []


# ------------------------------------------------------------------ triggers (§5.5 defaults)


def test_store_triggers(tmp_path):
    st = KVStore(
        tmp_path, ctx=65536
    )  # defaults: min 512, cold max 30000, interval 10000, trim 32, align 2048
    assert st.cold_target(5000, 0) == 4096  # floor(5000 - 32, 2048)
    assert st.cold_target(30000, 0) == 28672
    assert st.cold_target(600, 0) == 600  # 600 > 544 but floor(568, 2048) = 0 < min: the full prompt
    assert st.cold_target(540, 0) == 540  # not > min + trim
    assert st.cold_target(511, 0) is None and st.cold_target(30001, 0) is None
    assert st.cold_target(5000, 10) is None  # only when nothing was reused
    assert st.cold_target(5000, 0, anchor=700) == 700  # the chat anchor wins when >= min
    assert st.cold_target(5000, 0, anchor=100) == 4096
    assert KVStore(tmp_path, ctx=65536, cold_max_tokens=0).cold_target(5000, 0) is None
    assert KVStore(tmp_path, ctx=65536, boundary_align_tokens=0).cold_target(5000, 0) == 4968

    assert st.continued_step == 10240
    assert KVStore(tmp_path, ctx=65536, boundary_align_tokens=0).continued_step == 10000
    assert KVStore(tmp_path, ctx=65536, continued_interval_tokens=0).continued_step == 0
    assert st.continued_due(10240, 0) and st.continued_due(20480, 10240)
    assert not st.continued_due(10240, 10240) and not st.continued_due(10239, 0)
    assert not st.continued_due(10240, 0, in_tool_block=True)
    assert st.continued_frontiers(0, 25000, 0) == [10240, 20480]
    assert st.continued_frontiers(10240, 25000, 4096) == [20480]
    assert st.continued_frontiers(0, 10239, 0) == []

    cold, cont = SaveReason.COLD, SaveReason.CONTINUED
    assert st.prefill_stops(25000, 0, 0) == [(24576, cold)]  # cold reserves its frontier: no 10240/20480
    assert st.prefill_stops(35000, 0, 0) == [(10240, cont), (20480, cont), (30720, cont)]  # > cold max
    assert st.prefill_stops(25000, 0, 0, anchor=900) == [(900, cold), (10240, cont), (20480, cont)]
    assert st.prefill_stops(45000, 12000, 10240) == [(20480, cont), (30720, cont), (40960, cont)]
    assert st.prefill_stops(400, 0, 0) == []
    assert st.evict_target(600) == 600 and st.evict_target(511) is None
    assert st.evict_target(1000, covered=700) is None  # 300 new tokens: a cheap re-prefill, no new file
    assert st.evict_target(2000, covered=700) == 2000
    budget = 4096 << 20
    assert st.fits_budget(int(budget / 1.01)) and not st.fits_budget(int(budget / 1.01) + 2)

    sched = StoreSchedule()
    sched.on_store(24576)
    assert not st.continued_due(20480, sched.last_stored)
    sched.on_live_miss()
    assert st.continued_due(20480, sched.last_stored)
    sched.on_disk_hit(30000)
    assert st.continued_frontiers(30000, 45000, sched.last_stored) == [30720, 40960]

    u, a = 128803, 128804
    assert chat_anchor([0, 5, 6, u, 7, a, 8, u, a], u, a) == 3
    assert chat_anchor([0, 5, u, 6, u, 7, a], u, a) == 4
    assert chat_anchor([0, 5, a, u], u, a) is None


def test_bad_parameters_name_the_value(tmp_path):
    with pytest.raises(ValueError, match="cold max tokens must be 0 or >= min tokens"):
        KVStore(tmp_path, ctx=4096, min_tokens=512, cold_max_tokens=100)
    with pytest.raises(ValueError, match="quant bits must be 2 or 4, got 3"):
        KVStore(tmp_path, ctx=4096, quant_bits=3)
    assert (tmp_path.stat().st_mode & 0o777) and KVStore(tmp_path / "new", ctx=4096).dir.is_dir()
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700


def test_listing_and_lookup_do_not_read_payloads(tmp_path, snaps, text, monkeypatch):
    import ds4.kvstore as kvstore

    st = make(tmp_path)
    for n in (96, 160, 256):
        st.store(text(n), snaps[n][0])
    read = []

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            out = self.f.read(n)
            read.append(len(out))
            return out

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(kvstore, "open", lambda *a, **k: Counting(open(*a, **k)), raising=False)
    assert len(st.entries()) == 3 and sum(read) == 3 * 52  # heads only
    read.clear()
    assert st.lookup(text(320)).n_tokens == 256
    assert sum(read) <= 3 * 52 + 52 + len(text(256)) + 52  # heads, the winner's head + text, DSV4 header
    read.clear()
    assert len(st.read_payload(st.lookup(text(320)))) == len(snaps[256][0])


def test_temp_file_of_a_live_writer_is_kept(tmp_path):
    live = tmp_path / f"{'a' * 40}.kv.tmp.{os.getppid()}"
    dead = tmp_path / f"{'b' * 40}.kv.tmp.{os.getpid()}"  # our own pid: left by an earlier instance
    live.write_bytes(b"x")
    dead.write_bytes(b"x")
    make(tmp_path)
    assert live.exists() and not dead.exists()
