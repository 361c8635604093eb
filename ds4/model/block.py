"""One decoder block: HC pre -> attention -> HC post -> HC pre -> MoE -> HC post (model.md §5).

Legend: T tokens of the chunk, B sessions of a batched decode step, S HC streams, d = n_embd.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ds4.config import ModelConfig
from ds4.model.attention import (
    AttentionShape,
    AttentionWeights,
    CompressorWeights,
    IndexerWeights,
    attention_decode_batch,
    attention_forward,
)
from ds4.model.hc import HCWeights, hc_post, hc_pre
from ds4.model.moe import MoEWeights, moe_forward
from ds4.model.norm import rms_norm
from ds4.model.rope import layer_inv_freq
from ds4.model.state import LayerKV

Getter = Callable[[str], torch.Tensor]


@dataclass
class LayerWeights:
    hc_attn: HCWeights
    attn_norm: torch.Tensor  # [d]
    attn: AttentionWeights
    hc_ffn: HCWeights
    ffn_norm: torch.Tensor  # [d]
    moe: MoEWeights


def _hc(get: Getter, prefix: str) -> HCWeights:
    return HCWeights(
        fn=get(f"{prefix}_fn.weight"), scale=get(f"{prefix}_scale.weight"), base=get(f"{prefix}_base.weight")
    )


def _compressor(get: Getter, prefix: str) -> CompressorWeights:
    return CompressorWeights(
        ape=get(f"{prefix}ape.weight"),
        kv=get(f"{prefix}kv.weight"),
        gate=get(f"{prefix}gate.weight"),
        norm=get(f"{prefix}norm.weight"),
    )


def load_layer(cfg: ModelConfig, il: int, get: Getter, has: Callable[[str], bool]) -> LayerWeights:
    """Collect layer il's tensors (logical shapes, float32) through `get`."""
    p = f"blk.{il}."
    ratio = cfg.compress_ratios[il]
    indexer = None
    if ratio == 4:
        indexer = IndexerWeights(
            q_b=get(f"{p}indexer.attn_q_b.weight"),
            proj=get(f"{p}indexer.proj.weight"),
            compressor=_compressor(get, f"{p}indexer_compressor_"),
        )
    attn = AttentionWeights(
        q_a=get(f"{p}attn_q_a.weight"),
        q_a_norm=get(f"{p}attn_q_a_norm.weight"),
        q_b=get(f"{p}attn_q_b.weight"),
        kv=get(f"{p}attn_kv.weight"),
        kv_norm=get(f"{p}attn_kv_a_norm.weight"),
        sinks=get(f"{p}attn_sinks.weight"),
        out_a=get(f"{p}attn_output_a.weight"),
        out_b=get(f"{p}attn_output_b.weight"),
        compressor=_compressor(get, f"{p}attn_compressor_") if ratio else None,
        indexer=indexer,
    )
    hash_layer = cfg.is_hash_layer(il)
    bias_name = f"{p}exp_probs_b.bias"
    moe = MoEWeights(
        gate_inp=get(f"{p}ffn_gate_inp.weight"),
        bias=get(bias_name) if not hash_layer and has(bias_name) else None,  # hash layers never use it
        tid2eid=get(f"{p}ffn_gate_tid2eid.weight").long() if hash_layer else None,
        gate_exps=get(f"{p}ffn_gate_exps.weight"),
        up_exps=get(f"{p}ffn_up_exps.weight"),
        down_exps=get(f"{p}ffn_down_exps.weight"),
        gate_sh=get(f"{p}ffn_gate_shexp.weight"),
        up_sh=get(f"{p}ffn_up_shexp.weight"),
        down_sh=get(f"{p}ffn_down_shexp.weight"),
    )
    return LayerWeights(
        hc_attn=_hc(get, f"{p}hc_attn"),
        attn_norm=get(f"{p}attn_norm.weight"),
        attn=attn,
        hc_ffn=_hc(get, f"{p}hc_ffn"),
        ffn_norm=get(f"{p}ffn_norm.weight"),
        moe=moe,
    )


class Block:
    """Layer il's weights and constants; `forward` runs the chunk through it (layer-major prefill)."""

    def __init__(self, cfg: ModelConfig, il: int, weights: LayerWeights) -> None:
        self.cfg, self.il, self.w = cfg, il, weights
        self.inv_freq = layer_inv_freq(cfg, il)  # [n_rot/2], plain or YaRN by the layer's ratio
        self.shape = AttentionShape(
            n_head=cfg.n_head,
            head_dim=cfg.head_dim,
            n_rot=cfg.n_rot,
            window=cfg.window,
            ratio=cfg.compress_ratios[il],
            o_groups=cfg.o_groups,
            indexer_topk=cfg.indexer_topk,
            rms_eps=cfg.rms_eps,
        )

    def forward(
        self, X: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, kv: LayerKV
    ) -> torch.Tensor:
        """X [T, S, d] streams of the chunk -> new streams [T, S, d]; mutates kv."""

        def attn(xn: torch.Tensor) -> torch.Tensor:
            return attention_forward(self.w.attn, self.shape, kv, xn, positions, self.inv_freq)

        return self._run(X, tokens, attn)

    def decode_batch(
        self, X: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, kvs: Sequence[LayerKV]
    ) -> torch.Tensor:
        """One decode token per session: X [B, S, d] (row b at positions[b] of kvs[b]) -> [B, S, d]."""

        def attn(xn: torch.Tensor) -> torch.Tensor:
            return attention_decode_batch(self.w.attn, self.shape, list(kvs), xn, positions, self.inv_freq)

        return self._run(X, tokens, attn)

    def _run(
        self, X: torch.Tensor, tokens: torch.Tensor, attn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The block around its attention `attn` (xn [T, d] -> [T, d]); every other op is per token."""
        cfg, w = self.cfg, self.w
        hc = dict(iters=cfg.hc_sinkhorn_iters, rms_eps=cfg.rms_eps, hc_eps=cfg.hc_eps)

        x, post, comb = hc_pre(X, w.hc_attn, **hc)
        xn = rms_norm(x, w.attn_norm, cfg.rms_eps)  # [T, d]
        X = hc_post(attn(xn), X, post, comb)

        x, post, comb = hc_pre(X, w.hc_ffn, **hc)
        xf = rms_norm(x, w.ffn_norm, cfg.rms_eps)
        f = moe_forward(
            w.moe,
            xf,
            tokens,
            k=cfg.n_expert_used,
            scale=cfg.expert_weights_scale,
            normalize=cfg.expert_weights_norm,
            clamp=cfg.swiglu_clamp[self.il],
        )
        return hc_post(f, X, post, comb)
