"""DSV4 session payload (model.md §11.3): byte layout, size formula, bit-identical restore, every load check.

The layout is re-parsed here with struct/numpy from the §11.3 text (not with ds4/engine/snapshot.py), and the
size formula is written out again in the test, generalised from the Flash numbers to the file's config.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import ds4
from ds4.config import FLASH
from ds4.engine import SnapshotError
from ds4.engine.snapshot import payload_size

PROMPT = [0] + [(7919 * i + 13) % 129280 for i in range(1, 70)]  # 70 tokens: 70 mod 4 = 2, mod 32 = 6


@pytest.fixture(scope="module")
def engine(official_gguf):
    eng = ds4.Engine.open(official_gguf)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base(engine):
    """A session after a 70-token prompt at ctx 2048, and its payload."""
    s = engine.session(ctx=2048)
    s.sync(PROMPT)
    return s, s.snapshot()


def _size_formula(cfg, T: int) -> int:
    """§11.3 size, generalised: 52 + 4T + 4V + 8L + L*raw_live*4D + per-ratio rows and frontiers."""
    D, Di, L = cfg.head_dim, cfg.indexer_dim, cfg.n_layer
    raw_live = min(T, cfg.window)
    size = 52 + 4 * T + 4 * cfg.n_vocab + 8 * L + L * raw_live * 4 * D
    for r in cfg.compress_ratios[:L]:
        if r == 4:  # compressed + indexer rows, frontiers 2 x (8 x 2D) and 2 x (8 x 2Di) f32
            size += (T // 4) * 4 * (D + Di) + 2 * 8 * 2 * D * 4 + 2 * 8 * 2 * Di * 4
        elif r:  # compressed rows, frontiers 2 x (r x D)
            size += (T // r) * 4 * D + 2 * r * D * 4
    return size


# ------------------------------------------------------------------ layout


def test_flash_size_formula_as_written():
    for T in [0, 1, 5, 127, 128, 129, 1000, 4097, 65536]:
        raw_live = min(T, 128)
        written = (
            52 + 4 * T + 517120 + 344 + 43 * raw_live * 2048
            + 21 * (2560 * (T // 4) + 81920) + 20 * (2048 * (T // 128) + 524288)
        )  # fmt: skip
        assert payload_size(FLASH, T) == written == _size_formula(FLASH, T)
    # "for T >= 128: ≈ 24.0 MB fixed ... plus ≈ 13.8 KB per token"
    per_token = (payload_size(FLASH, 128 + 128 * 100) - payload_size(FLASH, 128)) / (128 * 100)
    assert 13.7e3 < per_token < 13.9e3
    assert 23.9e6 < payload_size(FLASH, 128) - 128 * per_token < 24.2e6


def test_payload_bytes_follow_the_layout(engine, base):
    s, blob = base
    cfg, T = engine.config, len(PROMPT)
    assert len(blob) == _size_formula(cfg, T) == payload_size(cfg, T)

    head = struct.unpack_from("<13I", blob, 0)
    assert blob[:4] == b"DSV4"
    raw_live = min(T, 16)
    assert head == (0x34565344, 1, 2048, 2048, 16, 16, 2048 // 4 + 2, T, 7, 128, 128, 129280, raw_live)
    off = 52
    assert list(np.frombuffer(blob, "<u4", T, off)) == PROMPT
    off += 4 * T
    assert np.frombuffer(blob, "<f4", cfg.n_vocab, off).tobytes() == s.logits.numpy().tobytes()
    off += 4 * cfg.n_vocab
    n_comp = list(np.frombuffer(blob, "<u4", 7, off))
    n_index = list(np.frombuffer(blob, "<u4", 7, off + 28))
    assert n_comp == [0, 0, T // 4, T // 32, T // 4, T // 32, T // 4]
    assert n_index == [0, 0, T // 4, 0, T // 4, 0, T // 4]
    off += 56

    def take(rows: int, cols: int) -> torch.Tensor:
        nonlocal off
        a = np.frombuffer(blob, "<f4", rows * cols, off).reshape(rows, cols)
        off += rows * cols * 4
        return torch.from_numpy(a.copy())

    for il, r in enumerate(cfg.compress_ratios):
        kv = s.state.layers[il]
        assert torch.equal(take(raw_live, 128), kv.raw)  # positions T-16..T-1, logical order
        if r:
            c = 2 if r == 4 else 1
            assert torch.equal(take(n_comp[il], 128), kv.comp)
            fkv, fsc = take(c * r, c * 128), take(c * r, c * 128)
            assert torch.equal(fkv, kv.comp_kv) and torch.equal(fsc, kv.comp_score)
            if r == 32:  # rows p mod 32 of the 6 tokens of the open window are live, the rest empty (§11.1)
                assert bool((fsc[T % 32 :] == -1e30).all()) and bool((fkv[T % 32 :] == 0).all())
                assert bool((fsc[: T % 32] > -1e29).all())
        if r == 4:
            assert torch.equal(take(n_index[il], 128), kv.index)
            assert torch.equal(take(8, 256), kv.index_kv) and torch.equal(take(8, 256), kv.index_score)
    assert off == len(blob)


@pytest.mark.parametrize("T", [1, 3, 16, 17, 33])
def test_size_for_short_sessions(engine, T):
    s = engine.session(ctx=64)
    s.sync(PROMPT[:T])
    assert len(s.snapshot()) == _size_formula(engine.config, T)


def test_empty_session_round_trip(engine):
    s = engine.session(ctx=64)
    blob = s.snapshot()
    assert len(blob) == _size_formula(engine.config, 0)
    other = engine.session(ctx=64)
    other.restore(blob)
    assert len(other) == 0 and other.snapshot() == blob


# ------------------------------------------------------------------ restore → continue


def _continue(sess, steps: int) -> list[torch.Tensor]:
    out = []
    for _ in range(steps):
        out.append(sess.eval(int(sess.logits.argmax())).clone())
    return out


def test_restore_then_continue_is_bit_identical(engine, base):
    s, blob = base
    ref = engine.session(ctx=2048)
    ref.sync(PROMPT)
    restored = engine.session(ctx=2048)
    restored.restore(blob)
    assert restored.snapshot() == blob  # byte-exact round trip
    assert restored.tokens == PROMPT and torch.equal(restored.logits, s.logits)
    # 12 decode steps cross ratio-4 row completions (T = 72, 76, 80) and slide the 16-row window
    a, b = _continue(ref, 12), _continue(restored, 12)
    for la, lb in zip(a, b, strict=True):
        assert torch.equal(la, lb)
    assert ref.snapshot() == restored.snapshot()

    # a suffix prefill after restore equals the same suffix prefill on the uninterrupted session
    more = [5, 6, 7, 8, 9, 10, 11]
    ref.sync(ref.tokens + more)
    restored.sync(restored.tokens + more)
    assert restored.last_prefill == len(more)
    assert torch.equal(ref.logits, restored.logits)


def test_restore_into_larger_context(engine):
    small = engine.session(ctx=2048)
    small.sync(PROMPT[:41])
    big = engine.session(ctx=4096)
    big.restore(small.snapshot())
    for la, lb in zip(_continue(small, 6), _continue(big, 6), strict=True):
        assert torch.equal(la, lb)


def test_tiny_synthetic_model_round_trip(base):
    eng = ds4.Engine.open("tiny")  # TINY preset: window 32, ratios 4/128, q2 experts
    try:
        cfg = eng.config
        a = eng.session(ctx=256)
        a.sync(PROMPT[:45])
        blob = a.snapshot()
        assert len(blob) == _size_formula(cfg, 45) == payload_size(cfg, 45)
        assert struct.unpack_from("<13I", blob)[4:6] == (32, 32)
        b = eng.session(ctx=256)
        b.restore(blob)
        for la, lb in zip(_continue(a, 5), _continue(b, 5), strict=True):
            assert torch.equal(la, lb)
        # the official-tiny payload has the same layer count / dims / vocab, but a 16-token window
        other = eng.session(ctx=2048)
        with pytest.raises(
            SnapshotError, match="graph chunk layout does not match: raw window expected 32, got 16"
        ):
            other.restore(base[1])
    finally:
        eng.close()


# ------------------------------------------------------------------ load checks


def _patch(blob: bytes, field: int, value: int) -> bytes:
    out = bytearray(blob)
    struct.pack_into("<I", out, 4 * field, value)
    return bytes(out)


def _n_comp_offset(T: int) -> int:
    return 52 + 4 * T + 4 * 129280


BAD = {
    "truncated by one byte": (lambda b: b[:-1], r"truncated: layer 6 indexer state_score needs 8192 bytes"),
    "truncated header": (
        lambda b: b[:20],
        r"truncated: the 13-field header needs 52 bytes at offset 0, 20 left",
    ),
    "truncated logits": (lambda b: b[:1000], r"truncated: logits needs 517120 bytes"),
    "empty": (lambda b: b"", r"truncated"),
    "extended": (lambda b: b + b"\0" * 4, r"4 trailing bytes"),
    "wrong magic": (
        lambda b: b"DSV3" + b[4:],
        r"not a DSV4 session payload: magic expected 0x34565344, got 0x33565344",
    ),
    "wrong version": (
        lambda b: _patch(b, 1, 2),
        r"unsupported session payload version: version expected 1, got 2",
    ),
    "other layer count": (
        lambda b: _patch(b, 8, 43),
        r"different DS4 layout: layer count expected 7, got 43",
    ),
    "other head dim": (lambda b: _patch(b, 9, 512), r"different DS4 layout: head dim expected 128, got 512"),
    "other indexer dim": (
        lambda b: _patch(b, 10, 64),
        r"different DS4 layout: indexer head dim expected 128, got 64",
    ),
    "other vocab": (lambda b: _patch(b, 11, 1000), r"different DS4 layout: vocab expected 129280, got 1000"),
    "too many tokens": (
        lambda b: _patch(b, 7, 2048),
        r"does not fit current context: saved ctx 2048 with 2048 tokens",
    ),
    "prefill cap": (
        lambda b: _patch(b, 3, 1024),
        r"graph chunk layout does not match: prefill_cap expected 2048, got 1024",
    ),
    "raw_live": (
        lambda b: _patch(b, 12, 15),
        r"raw ring layout does not match: raw_live expected 16, got 15",
    ),
    "comp capacity": (lambda b: _patch(b, 6, 9999), r"compressed cache is larger than current context"),
    "n_comp": (
        lambda b: _patch(b, _n_comp_offset(70) // 4 + 2, 18),
        r"invalid compressed row count: layer 2 n_comp expected 17, got 18",
    ),
    "n_index": (
        lambda b: _patch(b, _n_comp_offset(70) // 4 + 7 + 3, 2),
        r"invalid indexer row count: layer 3 n_index_comp expected 0, got 2",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_payloads_raise_clear_errors(engine, base, name):
    mutate, message = BAD[name]
    s = engine.session(ctx=2048)
    s.sync([0, 1, 2])
    before = s.snapshot()
    with pytest.raises(SnapshotError, match=message):
        s.restore(mutate(base[1]))
    assert s.snapshot() == before  # a failed restore leaves the session as it was


def test_context_checks(engine, base):
    s, blob = base
    small = engine.session(ctx=1024)  # saved ctx 2048 > 1024
    with pytest.raises(
        SnapshotError, match=r"does not fit current context: saved ctx 2048 with 70 tokens, current ctx 1024"
    ):
        small.restore(blob)
    a, b = engine.session(ctx=512), engine.session(ctx=1024)  # fits, but the writer's prefill_cap was 512
    a.sync(PROMPT[:20])
    with pytest.raises(
        SnapshotError, match="graph chunk layout does not match: prefill_cap expected 1024, got 512"
    ):
        b.restore(a.snapshot())
    assert isinstance(SnapshotError("x"), ValueError)
    with pytest.raises(SnapshotError, match="must be bytes"):
        b.restore("DSV4")
