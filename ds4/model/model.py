"""DS4Model: the whole forward pass on the CPU in float32 (model.md §5-§10).

Legend: T tokens of the chunk, B sessions of a batched decode step, S HC streams, d = n_embd, V vocabulary.
`forward` feeds a chunk at positions state.n_tokens.. layer-major (all T tokens through layer 0, then
layer 1, ...), which equals the per-token recurrence: every token only sees its own window, the
compressed rows its position makes visible, and compressor frontiers advanced token by token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ds4.config import ModelConfig
from ds4.layout import tensor_specs
from ds4.model.block import Block, load_layer
from ds4.model.hc import HCWeights, hc_head
from ds4.model.norm import rms_norm
from ds4.model.state import KVState, LayerKV


class DS4Model:
    def __init__(
        self, cfg: ModelConfig, weights: Callable[[str], torch.Tensor], *, has: Callable[[str], bool]
    ) -> None:
        self.cfg = cfg
        shapes = {s.name: s.shape for s in tensor_specs(cfg)}

        def get(name: str) -> torch.Tensor:
            t = weights(name)
            if name in shapes and tuple(t.shape) != shapes[name]:
                raise ValueError(
                    f"tensor {name}: expected logical shape {shapes[name]}, got {tuple(t.shape)}"
                )
            return t if t.dtype in (torch.int32, torch.int64) else t.to(torch.float32).contiguous()

        self.embd = get("token_embd.weight")  # [V, d]
        self.layers = [Block(cfg, il, load_layer(cfg, il, get, has)) for il in range(cfg.n_layer)]
        self.head_hc = HCWeights(
            fn=get("output_hc_fn.weight"),
            scale=get("output_hc_scale.weight"),
            base=get("output_hc_base.weight"),
        )
        self.output_norm = get("output_norm.weight")  # [d]
        self.output = get("output.weight")  # [V, d]

    def new_state(self, ctx: int) -> KVState:
        if ctx <= 0:
            raise ValueError(f"context size must be positive, got {ctx}")
        cfg = self.cfg
        layers = [LayerKV(r, cfg.head_dim, cfg.indexer_dim, ctx) for r in cfg.compress_ratios[: cfg.n_layer]]
        return KVState(ctx, layers)

    def new_states(self, n: int, ctx: int) -> list[KVState]:
        """n empty states of context ctx (the device model's pool contract; here simply n new_state)."""
        return [self.new_state(ctx) for _ in range(n)]

    @torch.no_grad()  # not inference_mode: state tensors must stay writable by the engine afterwards
    def forward(self, state: KVState, tokens: Sequence[int]) -> torch.Tensor:
        """Feed tokens at positions state.n_tokens.. (mutating state); float32 logits [V] of the last one."""
        cfg, T, p0 = self.cfg, len(tokens), state.n_tokens
        if T == 0:
            raise ValueError("forward needs at least one token, got none")
        if p0 + T > state.ctx:
            raise ValueError(f"context overflow: {p0} tokens + {T} new > ctx {state.ctx}")
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.n_vocab:
            raise ValueError(
                f"token id out of range [0, {cfg.n_vocab}): got {int(ids.min())}..{int(ids.max())}"
            )
        positions = torch.arange(p0, p0 + T)

        X = self.embd[ids][:, None, :].expand(T, cfg.hc_mult, cfg.n_embd).clone()  # [T, S, d] copies
        for block, kv in zip(self.layers, state.layers, strict=True):
            X = block.forward(X, ids, positions, kv)
        state.n_tokens = p0 + T
        return self.logits(X[-1:])[0]

    @torch.no_grad()
    def decode_batch(self, states: Sequence[KVState], tokens: Sequence[int]) -> torch.Tensor:
        """One decode step for B sessions at their own positions: tokens[b] is fed to states[b]
        (each mutated). Per-token work (embedding, HC, projections, MoE, head) runs batched, the
        KV-touching attention part per session. Returns float32 logits [B, V]."""
        cfg, B = self.cfg, len(states)
        if B == 0 or len(tokens) != B:
            raise ValueError(f"decode_batch needs one token per state: got {len(tokens)} tokens, {B} states")
        if len({id(s) for s in states}) != B:
            raise ValueError("decode_batch got the same state twice (one token per session per step)")
        for s in states:
            if s.n_tokens + 1 > s.ctx:
                raise ValueError(f"context overflow: {s.n_tokens} tokens + 1 new > ctx {s.ctx}")
        ids = torch.as_tensor([int(t) for t in tokens], dtype=torch.long)  # [B]
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.n_vocab:
            raise ValueError(
                f"token id out of range [0, {cfg.n_vocab}): got {int(ids.min())}..{int(ids.max())}"
            )
        positions = torch.as_tensor([s.n_tokens for s in states], dtype=torch.long)  # [B]

        X = self.embd[ids][:, None, :].expand(B, cfg.hc_mult, cfg.n_embd).clone()  # [B, S, d]
        for il, block in enumerate(self.layers):
            X = block.decode_batch(X, ids, positions, [s.layers[il] for s in states])
        for s in states:
            s.n_tokens += 1
        return self.logits(X)

    def logits(self, X: torch.Tensor) -> torch.Tensor:
        """Output head: HC collapse, output_norm, vocabulary projection. X [T, S, d] -> [T, V]."""
        h = hc_head(X, self.head_hc, rms_eps=self.cfg.rms_eps, hc_eps=self.cfg.hc_eps)  # [T, d]
        return F.linear(rms_norm(h, self.output_norm, self.cfg.rms_eps), self.output)
