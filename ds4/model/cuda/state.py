"""Static KV buffers of a device session (model.md §11.1), allocated once for the session's ctx.

Legend: W = window, D = head_dim, Di = indexer_dim, r = ratio, c = 2 if r == 4 else 1, cap = ctx // r + 2.

Raw rows live in a ring: position p sits in slot p % W. Compressed rows are append-only buffers whose live
length is a function of the position ((n_tokens) // r), so a decode step can find everything from the device
position alone. Frontiers have the CPU layout (ds4.model.state). `to_cpu` / `from_cpu` convert to and from the
CPU KVState, which is what the DSV4 snapshot format (ds4.engine.snapshot) reads and writes.
"""

from __future__ import annotations

import torch

from ds4.model.state import EMPTY_SCORE, KVState, LayerKV


class DeviceLayerKV:
    def __init__(self, ratio: int, window: int, head_dim: int, indexer_dim: int, ctx: int, device) -> None:
        self.ratio, self.window = ratio, window
        f32 = dict(dtype=torch.float32, device=device)
        self.raw = torch.zeros(window, head_dim, **f32)  # [W, D] ring
        self.comp = self.comp_kv = self.comp_score = None
        self.index = self.index_kv = self.index_score = None
        if ratio:
            c = 2 if ratio == 4 else 1
            cap = ctx // ratio + 2
            self.comp = torch.zeros(cap, head_dim, **f32)  # [cap, D]
            self.comp_kv = torch.zeros(c * ratio, c * head_dim, **f32)
            self.comp_score = torch.full((c * ratio, c * head_dim), EMPTY_SCORE, **f32)
        if ratio == 4:
            cap = ctx // ratio + 2
            self.index = torch.zeros(cap, indexer_dim, **f32)  # [cap, Di]
            self.index_kv = torch.zeros(2 * ratio, 2 * indexer_dim, **f32)
            self.index_score = torch.full((2 * ratio, 2 * indexer_dim), EMPTY_SCORE, **f32)

    _FIELDS = ("raw", "comp", "comp_kv", "comp_score", "index", "index_kv", "index_score")

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (getattr(self, f) for f in self._FIELDS) if t is not None]

    def copy_from(self, other: DeviceLayerKV) -> None:
        for a, b in zip(self.tensors(), other.tensors(), strict=True):
            a.copy_(b)


class DeviceKVState:
    """All layers' static buffers plus the host-side token count (the device position mirrors it)."""

    def __init__(self, cfg, ctx: int, device) -> None:
        self.cfg, self.ctx, self.device = cfg, ctx, torch.device(device)
        self.n_tokens = 0
        ratios = cfg.compress_ratios[: cfg.n_layer]
        self.layers = [
            DeviceLayerKV(r, cfg.window, cfg.head_dim, cfg.indexer_dim, ctx, device) for r in ratios
        ]

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
