"""The "DSV4" session payload (model.md §11.3): encode a session to bytes and decode them back, byte for byte.

The payload carries the file's own shape (layer count, head dim, indexer dim, vocab, ratios), so tiny models
write the same format with other sizes. Layout (little-endian u32 / IEEE f32):

    header 13 u32 | T u32 tokens | V f32 logits | L u32 n_comp | L u32 n_index_comp |
    per layer: raw_live x D raw rows (logical order)
               [ratio != 0] n_comp x D compressed rows, state_kv [c*r, c*D], state_score [c*r, c*D]
               [ratio == 4] n_index x Di indexer rows, index_kv [8, 2*Di], index_score [8, 2*Di]

Legend: T tokens, V vocab, L layers, D head_dim, Di indexer_dim, r ratio, c = 2 if r == 4 else 1.
Every load check of §11.3 raises SnapshotError naming the field, the expected and the actual value.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from ds4.config import PREFILL_CHUNK, ModelConfig
from ds4.errors import Ds4Error
from ds4.model.state import KVState

MAGIC = 0x34565344  # bytes "DSV4"
VERSION = 1
HEADER = struct.Struct("<13I")
_F32 = np.dtype("<f4")
_U32 = np.dtype("<u4")


class SnapshotError(Ds4Error, ValueError):
    """A session payload that cannot be loaded into this session (or a state that cannot be saved)."""


# ---------------------------------------------------------------------------------------------
# Layout: the shape values a payload header carries, for one model and one session ctx.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    ctx: int
    prefill_cap: int  # field 3: min(ctx, 2048) for a session
    raw_cap: int  # field 4: CPU keeps exactly min(window, ctx) raw rows
    raw_window: int  # field 5: min(window, ctx)
    comp_cap: int  # field 6: ctx // (smallest ratio) + 2
    n_layer: int
    head_dim: int
    indexer_dim: int
    n_vocab: int
    ratios: tuple[int, ...]

    @classmethod
    def cpu(cls, cfg: ModelConfig, ctx: int) -> Layout:
        ratios = tuple(cfg.compress_ratios[: cfg.n_layer])
        nonzero = [r for r in ratios if r]
        window = min(cfg.window, ctx)
        return cls(
            ctx=ctx,
            prefill_cap=min(ctx, PREFILL_CHUNK),
            raw_cap=window,
            raw_window=window,
            comp_cap=ctx // min(nonzero) + 2 if nonzero else 0,
            n_layer=cfg.n_layer,
            head_dim=cfg.head_dim,
            indexer_dim=cfg.indexer_dim,
            n_vocab=cfg.n_vocab,
            ratios=ratios,
        )

    def layer_cap(self, ratio: int) -> int:
        """Row capacity of one layer's compressed (and indexer) cache at this ctx."""
        return self.ctx // ratio + 2

    def frontier_shape(self, ratio: int) -> tuple[int, int]:
        c = 2 if ratio == 4 else 1
        return c * ratio, c * self.head_dim

    @property
    def index_frontier_shape(self) -> tuple[int, int]:
        return 8, 2 * self.indexer_dim


def payload_size(cfg: ModelConfig, n_tokens: int) -> int:
    """Byte size of the payload of a T-token session: §11.3's formula with the file's own shape."""
    T, D, Di, L = n_tokens, cfg.head_dim, cfg.indexer_dim, cfg.n_layer
    raw_live = min(T, cfg.window)
    size = 4 * 13 + 4 * T + 4 * cfg.n_vocab + 2 * 4 * L + L * raw_live * 4 * D
    for r in cfg.compress_ratios[:L]:
        if r == 4:  # rows + 8 x 2D frontier pair + indexer rows + 8 x 2Di frontier pair
            size += (4 * D + 4 * Di) * (T // 4) + 2 * 8 * 2 * D * 4 + 2 * 8 * 2 * Di * 4
        elif r:
            size += 4 * D * (T // r) + 2 * r * D * 4
    return size


# ---------------------------------------------------------------------------------------------
# Encode
# ---------------------------------------------------------------------------------------------


def _f32(t: torch.Tensor, shape: tuple[int, ...], what: str) -> bytes:
    if tuple(t.shape) != shape:
        raise SnapshotError(f"cannot save session: {what} has shape {tuple(t.shape)}, expected {shape}")
    return t.detach().to("cpu", torch.float32).contiguous().numpy().astype(_F32, copy=False).tobytes()


def encode(layout: Layout, tokens: list[int], logits: torch.Tensor | None, state: KVState) -> bytes:
    """The payload bytes of a session holding `tokens` (state.n_tokens == len(tokens))."""
    T, D, Di = len(tokens), layout.head_dim, layout.indexer_dim
    if state.n_tokens != T:
        raise SnapshotError(f"cannot save session: KV holds {state.n_tokens} tokens, token list has {T}")
    raw_live = min(T, layout.raw_window)
    n_comp = [T // r if r else 0 for r in layout.ratios]
    n_index = [T // 4 if r == 4 else 0 for r in layout.ratios]
    head = (MAGIC, VERSION, layout.ctx, layout.prefill_cap, layout.raw_cap, layout.raw_window)
    head += (layout.comp_cap, T, layout.n_layer, D, Di, layout.n_vocab, raw_live)
    if logits is None:  # an empty session has no next-token logits yet
        logits = torch.zeros(layout.n_vocab)
    parts = [
        HEADER.pack(*head),
        np.asarray(tokens, dtype=_U32).tobytes(),
        _f32(logits.reshape(-1), (layout.n_vocab,), "logits"),
        np.asarray(n_comp, dtype=_U32).tobytes(),
        np.asarray(n_index, dtype=_U32).tobytes(),
    ]
    for il, (r, kv) in enumerate(zip(layout.ratios, state.layers, strict=True)):
        parts.append(_f32(kv.raw, (raw_live, D), f"layer {il} raw rows"))
        if r:
            fs = layout.frontier_shape(r)
            parts.append(_f32(kv.comp, (n_comp[il], D), f"layer {il} compressed rows"))
            parts.append(_f32(kv.comp_kv, fs, f"layer {il} compressor state_kv"))
            parts.append(_f32(kv.comp_score, fs, f"layer {il} compressor state_score"))
        if r == 4:
            fs = layout.index_frontier_shape
            parts.append(_f32(kv.index, (n_index[il], Di), f"layer {il} indexer rows"))
            parts.append(_f32(kv.index_kv, fs, f"layer {il} indexer state_kv"))
            parts.append(_f32(kv.index_score, fs, f"layer {il} indexer state_score"))
    return b"".join(parts)


# ---------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------


@dataclass
class Decoded:
    tokens: list[int]
    logits: torch.Tensor  # [V]
    layers: list[dict[str, torch.Tensor]]  # per layer: raw, and comp/comp_kv/... where present


class _Reader:
    def __init__(self, blob: bytes) -> None:
        self.buf = memoryview(blob)
        self.pos = 0

    def take(self, dtype: np.dtype, count: int, what: str) -> np.ndarray:
        n = count * dtype.itemsize
        left = len(self.buf) - self.pos
        if n > left:
            raise SnapshotError(
                f"session payload is truncated: {what} needs {n} bytes at offset {self.pos}, {left} left"
            )
        out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += n
        return out

    def rows(self, shape: tuple[int, int], what: str) -> torch.Tensor:
        a = self.take(_F32, shape[0] * shape[1], what)
        return torch.from_numpy(a.astype(np.float32).reshape(shape))  # astype copies: owns its memory


def _fail(message: str, field: str, expected: object, actual: object) -> SnapshotError:
    return SnapshotError(f"{message}: {field} expected {expected}, got {actual}")


def decode(blob: bytes, layout: Layout) -> Decoded:
    """Parse and check a payload against the current session's layout (the §11.3 load checks, in order)."""
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise SnapshotError(f"session payload must be bytes, got {type(blob).__name__}")
    rd = _Reader(bytes(blob))
    h = [int(v) for v in rd.take(_U32, 13, "the 13-field header")]
    magic, version, ctx, prefill_cap, raw_cap, raw_window, comp_cap, T, n_layer, D, Di, V, raw_live = h
    if magic != MAGIC:
        raise _fail("not a DSV4 session payload", "magic", f"{MAGIC:#010x}", f"{magic:#010x}")
    if version != VERSION:
        raise _fail("unsupported session payload version", "version", VERSION, version)
    if ctx > layout.ctx or T >= layout.ctx:
        raise SnapshotError(
            f"KV checkpoint does not fit current context: saved ctx {ctx} with {T} tokens, "
            f"current ctx {layout.ctx} (needs saved ctx <= current and tokens < current)"
        )
    for field, want, got in [
        ("layer count", layout.n_layer, n_layer),
        ("head dim", layout.head_dim, D),
        ("indexer head dim", layout.indexer_dim, Di),
        ("vocab", layout.n_vocab, V),
    ]:
        if want != got:
            raise _fail("session payload is for a different DS4 layout", field, want, got)
    if prefill_cap != layout.prefill_cap:
        raise _fail("graph chunk layout does not match", "prefill_cap", layout.prefill_cap, prefill_cap)
    if raw_window != layout.raw_window:
        raise _fail("graph chunk layout does not match", "raw window", layout.raw_window, raw_window)
    if raw_live != min(T, raw_window):
        raise _fail("raw ring layout does not match", "raw_live", min(T, raw_window), raw_live)
    if raw_live > raw_cap or raw_live > layout.raw_cap:
        raise _fail(
            "raw ring layout does not match",
            "raw_live <= raw capacity",
            min(raw_cap, layout.raw_cap),
            raw_live,
        )
    if comp_cap > layout.comp_cap:
        raise _fail(
            "compressed cache is larger than current context",
            "compressed capacity",
            f"<= {layout.comp_cap}",
            comp_cap,
        )

    tokens = [int(t) for t in rd.take(_U32, T, "token ids")]
    bad = [t for t in tokens if t >= V]
    if bad:
        raise _fail("invalid token id in session payload", "token id", f"< {V}", bad[0])
    logits = torch.from_numpy(rd.take(_F32, V, "logits").astype(np.float32))
    n_comp = [int(v) for v in rd.take(_U32, n_layer, "n_comp counts")]
    n_index = [int(v) for v in rd.take(_U32, n_layer, "n_index_comp counts")]
    for il, r in enumerate(layout.ratios):  # the counts T tokens produce at this ratio (within capacity)
        want_comp, want_index = (T // r if r else 0), (T // 4 if r == 4 else 0)
        if n_comp[il] != want_comp or (r and n_comp[il] > layout.layer_cap(r)):
            raise _fail("invalid compressed row count", f"layer {il} n_comp", want_comp, n_comp[il])
        if n_index[il] != want_index:
            raise _fail("invalid indexer row count", f"layer {il} n_index_comp", want_index, n_index[il])

    layers = []
    for il, r in enumerate(layout.ratios):
        part = {"raw": rd.rows((raw_live, D), f"layer {il} raw rows")}
        if r:
            fs = layout.frontier_shape(r)
            part["comp"] = rd.rows((n_comp[il], D), f"layer {il} compressed rows")
            part["comp_kv"] = rd.rows(fs, f"layer {il} compressor state_kv")
            part["comp_score"] = rd.rows(fs, f"layer {il} compressor state_score")
        if r == 4:
            fs = layout.index_frontier_shape
            part["index"] = rd.rows((n_index[il], Di), f"layer {il} indexer rows")
            part["index_kv"] = rd.rows(fs, f"layer {il} indexer state_kv")
            part["index_score"] = rd.rows(fs, f"layer {il} indexer state_score")
        layers.append(part)
    trailing = len(rd.buf) - rd.pos
    if trailing:
        raise SnapshotError(
            f"session payload has {trailing} trailing bytes after the last layer (offset {rd.pos})"
        )
    return Decoded(tokens, logits, layers)


def install(decoded: Decoded, state: KVState) -> None:
    """Write decoded rows into a fresh state (from model.new_state(ctx)); counters follow the token count."""
    for kv, part in zip(state.layers, decoded.layers, strict=True):
        for name, value in part.items():
            setattr(kv, name, value)  # comp/index go through the state's setters (preallocated buffers)
    state.n_tokens = len(decoded.tokens)
