"""Test-only loader: a DS4Model from a GGUF via ds4.gguf.open_model, or (until that exists) via the
independent `gguf` package (GGUFReader + gguf.quants.dequantize)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ds4.config import ModelConfig
from ds4.model import DS4Model

_KEYS = {  # ModelConfig field -> deepseek4.* metadata key
    "n_layer": "block_count",
    "n_embd": "embedding_length",
    "n_vocab": "vocab_size",
    "n_head": "attention.head_count",
    "n_head_kv": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "value_dim": "attention.value_length",
    "n_rot": "rope.dimension_count",
    "q_lora_rank": "attention.q_lora_rank",
    "o_lora_rank": "attention.output_lora_rank",
    "o_groups": "attention.output_group_count",
    "n_expert": "expert_count",
    "n_expert_used": "expert_used_count",
    "n_expert_shared": "expert_shared_count",
    "expert_ff": "expert_feed_forward_length",
    "n_hash_layers": "hash_layer_count",
    "window": "attention.sliding_window",
    "indexer_heads": "attention.indexer.head_count",
    "indexer_dim": "attention.indexer.key_length",
    "indexer_topk": "attention.indexer.top_k",
    "hc_mult": "hyper_connection.count",
    "hc_sinkhorn_iters": "hyper_connection.sinkhorn_iterations",
    "rope_orig_ctx": "rope.scaling.original_context_length",
    "rope_base": "rope.freq_base",
    "rope_factor": "rope.scaling.factor",
    "yarn_beta_fast": "rope.scaling.yarn_beta_fast",
    "yarn_beta_slow": "rope.scaling.yarn_beta_slow",
    "compress_rope_base": "attention.compress_rope_freq_base",
    "expert_weights_scale": "expert_weights_scale",
    "rms_eps": "attention.layer_norm_rms_epsilon",
    "hc_eps": "hyper_connection.epsilon",
    "expert_weights_norm": "expert_weights_norm",
}


def _via_gguf_package(path: Path):
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("deepseek4.")}
    n_layer = int(meta["deepseek4.block_count"])
    kw = {f: meta[f"deepseek4.{k}"] for f, k in _KEYS.items()}
    kw["compress_ratios"] = tuple(int(r) for r in meta["deepseek4.attention.compress_ratios"][:n_layer])
    kw["swiglu_clamp"] = tuple(float(c) for c in meta["deepseek4.swiglu_clamp_exp"][:n_layer])
    cfg = ModelConfig(**kw)
    tensors = {t.name: t for t in reader.tensors}

    def tensor(name: str) -> torch.Tensor:
        t = tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))  # logical = reversed GGUF dims
        if t.tensor_type == gguf.GGMLQuantizationType.I32:
            return torch.from_numpy(np.array(t.data, dtype=np.int32).reshape(shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32).reshape(shape))

    return cfg, tensor, tensors.__contains__


def _open(path: Path):
    try:
        from ds4.gguf import open_model  # the engine's own loader, once it exists
    except ImportError:
        return _via_gguf_package(path)
    mf = open_model(path)
    return mf.config, mf.tensor, mf.has


@lru_cache(maxsize=2)
def load_model(path: Path) -> DS4Model:
    cfg, tensor, has = _open(Path(path))
    return DS4Model(cfg, tensor, has=has)
