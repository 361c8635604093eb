"""Row 0: frozen configuration and every default of the project, in one place.

Nothing here imports torch or any other part of ds4.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

# --------------------------------------------------------------------------------------------
# Model shape, read from the GGUF `deepseek4.*` metadata (see ds4/gguf.py for the key table).
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """Shape and constants of one DeepSeek V4 model file.

    Field names follow the metadata keys; the forward pass derives everything else from them
    (window, ratios, scales, FP8 block count, YaRN ramp), so tiny test models load unchanged.
    """

    n_layer: int  # deepseek4.block_count
    n_embd: int  # embedding_length: residual width per HC stream (d)
    n_vocab: int  # vocab_size
    n_head: int  # attention.head_count (H query heads)
    n_head_kv: int  # attention.head_count_kv (always 1: one shared KV row)
    head_dim: int  # attention.key_length (D, also the value width)
    value_dim: int  # attention.value_length
    n_rot: int  # rope.dimension_count: RoPE on the last n_rot dims of each head
    q_lora_rank: int  # attention.q_lora_rank
    o_lora_rank: int  # attention.output_lora_rank (per group)
    o_groups: int  # attention.output_group_count
    n_expert: int  # expert_count (routed)
    n_expert_used: int  # expert_used_count (top-k)
    n_expert_shared: int  # expert_shared_count
    expert_ff: int  # expert_feed_forward_length (routed and shared hidden width)
    n_hash_layers: int  # hash_layer_count: layers [0, n) route by tid2eid[token]
    window: int  # attention.sliding_window: raw rows p-window+1..p
    indexer_heads: int  # attention.indexer.head_count
    indexer_dim: int  # attention.indexer.key_length
    indexer_topk: int  # attention.indexer.top_k
    hc_mult: int  # hyper_connection.count (streams)
    hc_sinkhorn_iters: int  # hyper_connection.sinkhorn_iterations
    compress_ratios: tuple[int, ...]  # attention.compress_ratios, first n_layer entries
    swiglu_clamp: tuple[float, ...]  # swiglu_clamp_exp, first n_layer entries
    rope_orig_ctx: int  # rope.scaling.original_context_length (YaRN)
    rope_base: float  # rope.freq_base (dense layers)
    rope_factor: float  # rope.scaling.factor (YaRN)
    yarn_beta_fast: float  # rope.scaling.yarn_beta_fast
    yarn_beta_slow: float  # rope.scaling.yarn_beta_slow
    compress_rope_base: float  # attention.compress_rope_freq_base (compressed layers)
    expert_weights_scale: float  # expert_weights_scale (router weight multiplier)
    rms_eps: float  # attention.layer_norm_rms_epsilon
    hc_eps: float  # hyper_connection.epsilon
    expert_weights_norm: bool  # expert_weights_norm
    context_length: int = 0  # deepseek4.context_length (informational only)
    expert_group_count: int = 0  # optional, must be 0
    expert_group_used_count: int = 0  # optional, must be 0
    name: str = ""  # general.name (informational only)

    # ---- derived values (never stored in the file) ----
    @property
    def nope_dim(self) -> int:
        """Non-RoPE dims of a KV row: FP8-simulated in 64-blocks."""
        return self.head_dim - self.n_rot

    @property
    def is_flash(self) -> bool:
        """True when the shape is exactly DeepSeek V4 Flash (informational names ignored)."""
        skip = {"context_length", "name"}
        return all(
            getattr(self, f.name) == getattr(FLASH, f.name) for f in fields(self) if f.name not in skip
        )

    @property
    def preset_name(self) -> str:
        if self.is_flash:
            return "flash"
        if replace(self, name="", context_length=0) == replace(TINY, name="", context_length=0):
            return "tiny"
        return "custom"

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def has_indexer(self, layer: int) -> bool:
        """Ratio-4 layers carry the overlapping compressor and the indexer."""
        return self.compress_ratios[layer] == 4

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers


def _flash_ratios(n_layer: int) -> tuple[int, ...]:
    """0,0 then alternating 4,128 ending with 4 (layer 2 and every even layer are ratio 4)."""
    return tuple(0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(n_layer))


FLASH = ModelConfig(
    n_layer=43,
    n_embd=4096,
    n_vocab=129280,
    n_head=64,
    n_head_kv=1,
    head_dim=512,
    value_dim=512,
    n_rot=64,
    q_lora_rank=1024,
    o_lora_rank=1024,
    o_groups=8,
    n_expert=256,
    n_expert_used=6,
    n_expert_shared=1,
    expert_ff=2048,
    n_hash_layers=3,
    window=128,
    indexer_heads=64,
    indexer_dim=128,
    indexer_topk=512,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    compress_ratios=_flash_ratios(43),
    swiglu_clamp=(10.0,) * 43,
    rope_orig_ctx=65536,
    rope_base=10000.0,
    rope_factor=16.0,
    yarn_beta_fast=32.0,
    yarn_beta_slow=1.0,
    compress_rope_base=160000.0,
    expert_weights_scale=1.5,
    rms_eps=1e-6,
    hc_eps=1e-6,
    expert_weights_norm=True,
    context_length=1048576,
    name="DeepSeek-V4-Flash",
)

# The tiny synthetic model: every structural feature of Flash (dense + ratio-4 + ratio-128 layers,
# 3 hash layers, indexer, 4 HC streams, sinks, routed + shared experts) at a size the CPU runs in
# milliseconds. The vocabulary stays the real 129,280 ids so the real tokenizer drives it. Widths
# are multiples of 256 because the q2/q4 expert formats quantize rows in 256-element blocks.
TINY = replace(  # only the sizes differ from Flash; every constant of the math stays Flash's
    FLASH,
    n_layer=7,
    n_embd=256,
    n_head=4,
    head_dim=128,
    value_dim=128,
    q_lora_rank=64,
    o_lora_rank=64,
    o_groups=2,
    n_expert=16,
    expert_ff=256,
    window=32,
    indexer_heads=4,
    indexer_topk=8,
    compress_ratios=_flash_ratios(7),
    swiglu_clamp=(10.0,) * 7,
    rope_orig_ctx=4096,
    context_length=65536,
    name="ds4-tiny-synthetic",
)

PRESETS: dict[str, ModelConfig] = {"flash": FLASH, "tiny": TINY}

# --------------------------------------------------------------------------------------------
# Defaults (CLI, server and engine read them from here only).
# --------------------------------------------------------------------------------------------

DEFAULT_MODEL_PATH = "ds4flash.gguf"  # looked up in the working directory when -m is absent
TINY_MODEL_ALIAS = "tiny"  # `-m tiny` builds/uses the cached tiny synthetic model
TINY_MODEL_QUANT = "q2"  # quant mix of the cached tiny model (exercises the release formats)
TINY_MODEL_SEED = 1

# Sampling (model.md §13)
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MIN_P = 0.05
DEFAULT_TOP_K = 0
MAX_TOP_K = 1024

# CLI `ds4` (product.md §3.2)
DEFAULT_MAX_TOKENS = 50000  # -n; clamped to ctx - pos - 1
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant"  # -sys (no final period; "" disables it)
DEFAULT_MTP_DRAFT = 1
MAX_MTP_DRAFT = 16
DEFAULT_MTP_MARGIN = 3.0
DEFAULT_LOGPROBS_TOP_K = 20
MAX_LOGPROBS_TOP_K = 128

# Context and prefill
DEFAULT_CTX = 32768
PREFILL_CHUNK = 2048  # GPU chunk; chunk boundaries are absolute multiples of this

# Disk KV cache (product.md §5)
KV_DISK_SPACE_MB = 4096  # product.md §4.1: --kv-disk-space-mb default when enabled
KV_CACHE_MIN_TOKENS = 512
KV_CACHE_COLD_MAX_TOKENS = 30000
KV_CACHE_CONTINUED_INTERVAL_TOKENS = 10000
KV_CACHE_BOUNDARY_TRIM_TOKENS = 32
KV_CACHE_BOUNDARY_ALIGN_TOKENS = 2048

# Exact-DSML tool replay memory (product.md §2.7)
TOOL_MEMORY_MAX_IDS = 100000  # --tool-memory-max-ids
TOOL_MEMORY_MAX_BYTES = 512 << 20  # total id + block bytes kept

# Server
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
SERVER_DEFAULT_MAX_TOKENS = 393216  # -n/--tokens: max_tokens when the client omits it (clamped to ctx)
SERVER_MAX_BODY_BYTES = 64 << 20  # larger request bodies get 413
SERVER_MAX_TOKENS_LIMIT = 393216  # a client max_tokens above this is clamped
SERVER_KEEPALIVE_S = 5.0  # SSE ": keepalive" comment interval (wall clock, prefill and decode)
