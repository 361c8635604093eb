"""KV state of a session (model.md §11.1), float32 CPU tensors of the reference path.

Legend: D = head_dim, Di = indexer_dim, r = compress ratio of a layer, c = 2 if r == 4 else 1.
Frontier rows that hold no token carry kv = 0 and score = EMPTY_SCORE (ds4's CPU convention); the math
treats them exactly like -inf (they get softmax weight 0 next to any real candidate).
"""

from __future__ import annotations

import torch

EMPTY_SCORE = -1e30


class RowBuffer:
    """Append-only rows [n, width] in a preallocated buffer; `rows` is the live view."""

    def __init__(self, capacity: int, width: int) -> None:
        self._buf = torch.zeros(max(capacity, 0), width)
        self.n = 0

    @property
    def rows(self) -> torch.Tensor:
        return self._buf[: self.n]

    def append(self, rows: torch.Tensor) -> None:
        k = rows.shape[0]
        if self.n + k > self._buf.shape[0]:  # grow (only when the caller under-estimated capacity)
            grown = torch.zeros(max(2 * self._buf.shape[0], self.n + k), self._buf.shape[1])
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n : self.n + k] = rows
        self.n += k

    def replace(self, rows: torch.Tensor) -> None:
        self.n = 0
        self.append(rows)

    def clone(self) -> RowBuffer:
        """Same capacity, copying only the live rows (the zero tail stays lazily allocated)."""
        out = RowBuffer(self._buf.shape[0], self._buf.shape[1])
        out.append(self.rows)
        return out


def empty_frontier(rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(rows, width), torch.full((rows, width), EMPTY_SCORE)


class LayerKV:
    """One layer's state. Fields of the engine contract: raw, comp, comp_kv, comp_score, index,
    index_kv, index_score (None where the layer has no such part)."""

    def __init__(self, ratio: int, head_dim: int, indexer_dim: int, ctx: int) -> None:
        self.ratio = ratio
        self.raw = torch.zeros(0, head_dim)  # [n_raw, D] last min(T, window) rows, logical order
        self._comp: RowBuffer | None = None
        self._index: RowBuffer | None = None
        self.comp_kv = self.comp_score = None  # [c*r, c*D] attention-compressor frontier
        self.index_kv = self.index_score = None  # [2*4, 2*Di] indexer-compressor frontier (ratio 4)
        if ratio:
            c = 2 if ratio == 4 else 1
            self._comp = RowBuffer(ctx // ratio + 2, head_dim)
            self.comp_kv, self.comp_score = empty_frontier(c * ratio, c * head_dim)
        if ratio == 4:
            self._index = RowBuffer(ctx // ratio + 2, indexer_dim)
            self.index_kv, self.index_score = empty_frontier(2 * ratio, 2 * indexer_dim)

    @property
    def comp(self) -> torch.Tensor | None:
        """[n_comp, D] compressed attention rows, n_comp = T // r."""
        return None if self._comp is None else self._comp.rows

    @comp.setter
    def comp(self, rows: torch.Tensor) -> None:
        self._require(self._comp, "comp").replace(rows)

    @property
    def index(self) -> torch.Tensor | None:
        """[n_index, Di] indexer rows (ratio 4 only), n_index = T // 4."""
        return None if self._index is None else self._index.rows

    @index.setter
    def index(self, rows: torch.Tensor) -> None:
        self._require(self._index, "index").replace(rows)

    def append_comp(self, rows: torch.Tensor) -> None:
        self._require(self._comp, "comp").append(rows)

    def append_index(self, rows: torch.Tensor) -> None:
        self._require(self._index, "index").append(rows)

    def _require(self, buf: RowBuffer | None, what: str) -> RowBuffer:
        if buf is None:
            raise ValueError(f"layer with compress ratio {self.ratio} has no {what} rows")
        return buf

    def clone(self) -> LayerKV:
        out = LayerKV.__new__(LayerKV)
        out.ratio = self.ratio
        out.raw = self.raw.clone()
        out._comp = None if self._comp is None else self._comp.clone()
        out._index = None if self._index is None else self._index.clone()
        for name in ("comp_kv", "comp_score", "index_kv", "index_score"):
            t = getattr(self, name)
            setattr(out, name, None if t is None else t.clone())
        return out


class KVState:
    """Everything a session needs to continue at position n_tokens."""

    def __init__(self, ctx: int, layers: list[LayerKV], n_tokens: int = 0) -> None:
        self.ctx = ctx
        self.n_tokens = n_tokens
        self.layers = layers

    def clone(self) -> KVState:
        return KVState(self.ctx, [layer.clone() for layer in self.layers], self.n_tokens)
