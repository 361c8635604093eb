"""Static KV buffers of a device session (model.md §11.1), allocated once for the session's ctx.

Legend: W = window, D = head_dim, Di = indexer_dim, r = ratio, c = 2 if r == 4 else 1, cap = ctx // r + 2.

Many sessions (issue 8): a KVPool allocates every layer's buffers ONCE with a leading slot dim [N + 1, ...]
(the last slot is scratch for the padded rows of a batched decode step); each pool state is a DeviceKVState
whose tensors are VIEWS of one slot, so the single-session code (prefill, decode graph, snapshots, reset,
copy_from) runs on it unchanged while a batched step (ds4.model.cuda.batch) indexes the pool by slot.

Raw rows live in a ring: position p sits in slot p % W. Compressed rows are append-only buffers whose live
length is a function of the position ((n_tokens) // r), so a decode step can find everything from the device
position alone. Frontiers have the CPU layout (ds4.model.state). `to_cpu` / `from_cpu` convert to and from the
CPU KVState, which is what the DSV4 snapshot format (ds4.engine.snapshot) reads and writes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds4.model.state import EMPTY_SCORE, KVState, LayerKV


class DeviceLayerKV:
    """One layer's buffers; `lead` prepends dims to every buffer (a KVPool layer: lead = (N + 1,))."""

    def __init__(
        self, ratio: int, window: int, head_dim: int, indexer_dim: int, ctx: int, device, lead: tuple = ()
    ) -> None:
        self.ratio, self.window = ratio, window
        f32 = dict(dtype=torch.float32, device=device)
        self.raw = torch.zeros(*lead, window, head_dim, **f32)  # [W, D] ring
        self.comp = self.comp_kv = self.comp_score = None
        self.index = self.index_kv = self.index_score = None
        if ratio:
            c = 2 if ratio == 4 else 1
            cap = ctx // ratio + 2
            self.comp = torch.zeros(*lead, cap, head_dim, **f32)  # [cap, D]
            self.comp_kv = torch.zeros(*lead, c * ratio, c * head_dim, **f32)
            self.comp_score = torch.full((*lead, c * ratio, c * head_dim), EMPTY_SCORE, **f32)
        if ratio == 4:
            cap = ctx // ratio + 2
            self.index = torch.zeros(*lead, cap, indexer_dim, **f32)  # [cap, Di]
            self.index_kv = torch.zeros(*lead, 2 * ratio, 2 * indexer_dim, **f32)
            self.index_score = torch.full((*lead, 2 * ratio, 2 * indexer_dim), EMPTY_SCORE, **f32)

    _FIELDS = ("raw", "comp", "comp_kv", "comp_score", "index", "index_kv", "index_score")

    def slot(self, i: int) -> DeviceLayerKV:
        """A layer whose buffers are views of slot i of this (pool) layer's buffers."""
        out = DeviceLayerKV.__new__(DeviceLayerKV)
        out.ratio, out.window = self.ratio, self.window
        for f in self._FIELDS:
            t = getattr(self, f)
            setattr(out, f, None if t is None else t[i])
        return out

    def as_pool(self) -> DeviceLayerKV:
        """This (single-state) layer as a one-slot pool layer: views [1, ...] of the same buffers, so the
        batched decode step (ds4.model.cuda.batch) runs a single state at slot 0."""
        out = DeviceLayerKV.__new__(DeviceLayerKV)
        out.ratio, out.window = self.ratio, self.window
        for f in self._FIELDS:
            t = getattr(self, f)
            setattr(out, f, None if t is None else t[None])
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (getattr(self, f) for f in self._FIELDS) if t is not None]

    def copy_from(self, other: DeviceLayerKV) -> None:
        for a, b in zip(self.tensors(), other.tensors(), strict=True):
            a.copy_(b)


class DeviceKVState:
    """All layers' static buffers plus the host-side token count (the device position mirrors it)."""

    def __init__(self, cfg, ctx: int, device, *, layers: list[DeviceLayerKV] | None = None) -> None:
        self.cfg, self.ctx, self.device = cfg, ctx, torch.device(device)
        self.n_tokens = 0
        self.pool: KVPool | None = None  # set for the states of a KVPool (their buffers are slot views)
        self.slot: int | None = None
        if layers is None:
            ratios = cfg.compress_ratios[: cfg.n_layer]
            layers = [
                DeviceLayerKV(r, cfg.window, cfg.head_dim, cfg.indexer_dim, ctx, device) for r in ratios
            ]
        self.layers = layers

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())

    def clone(self) -> DeviceKVState:
        out = DeviceKVState(self.cfg, self.ctx, self.device)
        out.copy_from(self)
        return out

    def copy_from(self, other: DeviceKVState) -> None:
        """Overwrite these buffers in place (a decode graph captured on them stays valid)."""
        for a, b in zip(self.layers, other.layers, strict=True):
            a.copy_from(b)
        self.n_tokens = other.n_tokens

    # What a decode step at position pos overwrites of the state before it: the compressors' frontiers, the
    # only buffers it rewrites from their own old values (a window completion shifts the current window into
    # the previous one), and the ring row pos % W (position pos - W: out of the step's window, but still in
    # a snapshot taken before the step). Its other writes land at rows not yet visible and are written before
    # the step reads them. So after a step run for real (a graph capture's warm-up), restoring these alone
    # makes a replay of the step equal the step run once (tests/test_cuda_batch.py checks it bit for bit).
    _FRONTIERS = ("comp_kv", "comp_score", "index_kv", "index_score")

    def step_restorer(self, pos: torch.Tensor) -> Callable[[], None]:
        """Save what a decode step at device position pos [1] overwrites (KB per layer, whatever the ctx);
        the returned call puts it back."""
        saved = []
        for layer in self.layers:
            ring = torch.remainder(pos, layer.window)
            saved.append((layer.raw, ring, layer.raw.index_select(0, ring)))
            fronts = (getattr(layer, f) for f in self._FRONTIERS)
            saved += [(t, None, t.clone()) for t in fronts if t is not None]

        def restore() -> None:
            for t, rows, old in saved:
                if rows is None:
                    t.copy_(old)
                else:
                    t.index_copy_(0, rows, old)

        return restore

    def reset(self) -> None:
        """Back to an empty timeline, in place (frontier scores EMPTY_SCORE, everything else 0)."""
        for layer in self.layers:
            for name in DeviceLayerKV._FIELDS:
                t = getattr(layer, name)
                if t is not None:
                    t.fill_(EMPTY_SCORE if name.endswith("_score") else 0.0)
        self.n_tokens = 0

    # ---- CPU KVState conversion (snapshots) ----------------------------------------------------

    def to_cpu(self) -> KVState:
        n, cfg = self.n_tokens, self.cfg
        out = []
        for dev in self.layers:
            kv = LayerKV(dev.ratio, cfg.head_dim, cfg.indexer_dim, self.ctx)
            first = max(0, n - dev.window)
            slots = [p % dev.window for p in range(first, n)]  # logical order: oldest first
            kv.raw = dev.raw[slots].cpu() if slots else torch.zeros(0, cfg.head_dim)
            if dev.ratio:
                kv.comp = dev.comp[: n // dev.ratio].cpu()
                kv.comp_kv, kv.comp_score = dev.comp_kv.cpu(), dev.comp_score.cpu()
            if dev.ratio == 4:
                kv.index = dev.index[: n // 4].cpu()
                kv.index_kv, kv.index_score = dev.index_kv.cpu(), dev.index_score.cpu()
            out.append(kv)
        return KVState(self.ctx, out, n)

    def load_cpu(self, state: KVState) -> None:
        """Overwrite the buffers with a CPU state (e.g. a restored snapshot)."""
        n = state.n_tokens
        for dev, kv in zip(self.layers, state.layers, strict=True):
            dev.raw.zero_()
            first = n - kv.raw.shape[0]
            for i in range(kv.raw.shape[0]):
                dev.raw[(first + i) % dev.window] = kv.raw[i].to(self.device)
            if dev.ratio:
                dev.comp.zero_()
                dev.comp[: kv.comp.shape[0]] = kv.comp.to(self.device)
                dev.comp_kv.copy_(kv.comp_kv)
                dev.comp_score.copy_(kv.comp_score)
            if dev.ratio == 4:
                dev.index.zero_()
                dev.index[: kv.index.shape[0]] = kv.index.to(self.device)
                dev.index_kv.copy_(kv.index_kv)
                dev.index_score.copy_(kv.index_score)
        self.n_tokens = n


def session_nbytes(cfg, ctx: int) -> int:
    """Exact bytes of one DeviceKVState of context ctx (every buffer float32), without allocating it."""
    D, Di, W = cfg.head_dim, cfg.indexer_dim, cfg.window
    total = 0
    for r in cfg.compress_ratios[: cfg.n_layer]:
        total += W * D
        if r:
            c, cap = (2 if r == 4 else 1), ctx // r + 2
            total += cap * D + 2 * (c * r) * (c * D)
        if r == 4:
            total += (ctx // 4 + 2) * Di + 2 * (2 * r) * (2 * Di)
    return 4 * total


class KVPool:
    """The KV buffers of n_slots sessions of one ctx, allocated once: every layer's tensors have a leading
    slot dim [n_slots + 1, ...]; slot n_slots is scratch (the padded rows of a batched decode step write
    there). `states[i]` is a DeviceKVState viewing slot i; views stay valid for the pool's lifetime."""

    def __init__(self, cfg, n_slots: int, ctx: int, device) -> None:
        if n_slots <= 0:
            raise ValueError(f"a KV pool needs at least one slot, got {n_slots}")
        if ctx <= 0:
            raise ValueError(f"context size must be positive, got {ctx}")
        self.cfg, self.n_slots, self.ctx, self.device = cfg, n_slots, ctx, torch.device(device)
        self.scratch = n_slots  # index of the scratch slot
        ratios = cfg.compress_ratios[: cfg.n_layer]
        lead = (n_slots + 1,)
        self.layers = [
            DeviceLayerKV(r, cfg.window, cfg.head_dim, cfg.indexer_dim, ctx, device, lead) for r in ratios
        ]
        self.states: list[DeviceKVState] = []
        for i in range(n_slots):
            st = DeviceKVState(cfg, ctx, device, layers=[layer.slot(i) for layer in self.layers])
            st.pool, st.slot = self, i
            self.states.append(st)
        self.runner = None  # the batched decode runner (ds4.model.cuda.model), made on first use

    def nbytes(self) -> int:
        """Bytes of every buffer, scratch slot included: (n_slots + 1) * session_nbytes(cfg, ctx)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())
