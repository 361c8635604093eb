"""The DS4 GGUF tensor inventory (model.md §2.3), derived from a ModelConfig.

One table serves both sides: ds4/gguf.py validates a file against it and ds4/tools/make_model.py
writes synthetic files from it, so the reader and the writer cannot drift apart.
Dims are in GGUF order (fastest first); the logical torch shape is the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds4.config import ModelConfig
from ds4.quant.types import GGMLType as T

QUANT_MIXES = ("f32", "q8", "q2", "q4")

# Types a loader accepts per role. Release types first; wider float types are accepted too so
# that unquantized test models (the official-tiny fixture) load.
_MATRIX = frozenset({T.Q8_0, T.F16, T.BF16, T.F32})
_F16_MATRIX = frozenset({T.F16, T.BF16, T.F32})
_VECTOR = frozenset({T.F32})
_EXPERTS = frozenset({T.IQ2_XXS, T.Q2_K, T.Q4_K, T.Q8_0, T.F16, T.BF16, T.F32})


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dims: tuple[int, ...]  # GGUF order, fastest first
    release: T  # type in the q2 release file (experts: see expert_type)
    allowed: frozenset[T]
    required: bool = True
    role: str = ""  # "expert_gate_up", "expert_down" for routed experts, else ""

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (row-major, last dim = row) shape."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n


def _spec(name, dims, release, allowed, required=True, role=""):
    return TensorSpec(name, tuple(dims), release, allowed, required, role)


def global_specs(cfg: ModelConfig) -> list[TensorSpec]:
    d, v, hc = cfg.n_embd, cfg.n_vocab, cfg.hc_mult
    return [
        _spec("token_embd.weight", [d, v], T.F16, _F16_MATRIX),
        _spec("output_hc_base.weight", [hc], T.F32, _VECTOR),
        _spec("output_hc_fn.weight", [hc * d, hc], T.F16, _F16_MATRIX),
        _spec("output_hc_scale.weight", [1], T.F32, _VECTOR),
        _spec("output_norm.weight", [d], T.F32, _VECTOR),
        _spec("output.weight", [d, v], T.Q8_0, _MATRIX),
    ]


def layer_specs(cfg: ModelConfig, il: int) -> list[TensorSpec]:
    d, hc, hd = cfg.n_embd, cfg.hc_mult, cfg.head_dim
    n_mix = (2 + hc) * hc  # pre (hc) + post (hc) + combine (hc*hc) = 24 for hc=4
    p = f"blk.{il}."
    s: list[TensorSpec] = []
    for sub, norm in (("attn", "attn_norm"), ("ffn", "ffn_norm")):
        s += [
            _spec(f"{p}hc_{sub}_fn.weight", [hc * d, n_mix], T.F16, _F16_MATRIX),
            _spec(f"{p}hc_{sub}_scale.weight", [3], T.F32, _VECTOR),
            _spec(f"{p}hc_{sub}_base.weight", [n_mix], T.F32, _VECTOR),
            _spec(f"{p}{norm}.weight", [d], T.F32, _VECTOR),
        ]
    s += [
        _spec(f"{p}attn_q_a.weight", [d, cfg.q_lora_rank], T.Q8_0, _MATRIX),
        _spec(f"{p}attn_q_a_norm.weight", [cfg.q_lora_rank], T.F32, _VECTOR),
        _spec(f"{p}attn_q_b.weight", [cfg.q_lora_rank, cfg.n_head * hd], T.Q8_0, _MATRIX),
        _spec(f"{p}attn_kv.weight", [d, hd], T.Q8_0, _MATRIX),
        _spec(f"{p}attn_kv_a_norm.weight", [hd], T.F32, _VECTOR),
        _spec(f"{p}attn_sinks.weight", [cfg.n_head], T.F32, _VECTOR),
        _spec(
            f"{p}attn_output_a.weight",
            [cfg.n_head * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank],
            T.Q8_0,
            _MATRIX,
        ),
        _spec(f"{p}attn_output_b.weight", [cfg.o_groups * cfg.o_lora_rank, d], T.Q8_0, _MATRIX),
    ]
    ratio = cfg.compress_ratios[il]
    if ratio:
        c = 2 if ratio == 4 else 1
        s += _compressor_specs(f"{p}attn_compressor_", d, c * hd, ratio, hd)
    if ratio == 4:
        idim = cfg.indexer_dim
        s += [
            _spec(
                f"{p}indexer.attn_q_b.weight", [cfg.q_lora_rank, cfg.indexer_heads * idim], T.F16, _F16_MATRIX
            ),
            _spec(f"{p}indexer.proj.weight", [d, cfg.indexer_heads], T.F16, _F16_MATRIX),
        ]
        s += _compressor_specs(f"{p}indexer_compressor_", d, 2 * idim, ratio, idim)
    e, ff = cfg.n_expert, cfg.expert_ff
    s += [
        _spec(f"{p}ffn_gate_inp.weight", [d, e], T.F16, _F16_MATRIX),
        _spec(f"{p}exp_probs_b.bias", [e], T.F32, _VECTOR, required=False),
    ]
    if cfg.is_hash_layer(il):
        s.append(
            _spec(f"{p}ffn_gate_tid2eid.weight", [cfg.n_expert_used, cfg.n_vocab], T.I32, frozenset({T.I32}))
        )
    s += [
        _spec(f"{p}ffn_gate_exps.weight", [d, ff, e], T.IQ2_XXS, _EXPERTS, role="expert_gate_up"),
        _spec(f"{p}ffn_up_exps.weight", [d, ff, e], T.IQ2_XXS, _EXPERTS, role="expert_gate_up"),
        _spec(f"{p}ffn_down_exps.weight", [ff, d, e], T.Q2_K, _EXPERTS, role="expert_down"),
        _spec(f"{p}ffn_gate_shexp.weight", [d, ff], T.Q8_0, _MATRIX),
        _spec(f"{p}ffn_up_shexp.weight", [d, ff], T.Q8_0, _MATRIX),
        _spec(f"{p}ffn_down_shexp.weight", [ff, d], T.Q8_0, _MATRIX),
    ]
    return s


def _compressor_specs(prefix: str, d: int, width: int, ratio: int, norm_dim: int) -> list[TensorSpec]:
    return [
        _spec(f"{prefix}ape.weight", [width, ratio], T.F16, _F16_MATRIX),
        _spec(f"{prefix}kv.weight", [d, width], T.F16, _F16_MATRIX),
        _spec(f"{prefix}gate.weight", [d, width], T.F16, _F16_MATRIX),
        _spec(f"{prefix}norm.weight", [norm_dim], T.F32, _VECTOR),
    ]


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of a DS4 file in the order ds4's release files store them."""
    out = global_specs(cfg)
    for il in range(cfg.n_layer):
        out += layer_specs(cfg, il)
    return out


def mix_type(spec: TensorSpec, quant: str) -> T:
    """Type of `spec` in a synthetic file of the given mix (ds4-make-model --quant)."""
    if quant not in QUANT_MIXES:
        raise ValueError(f"unknown quant mix {quant!r}; expected one of {', '.join(QUANT_MIXES)}")
    if quant == "f32":
        return spec.release if spec.release in (T.I32, T.F32) else T.F32
    if spec.role:
        return {"q8": T.F32, "q4": T.Q4_K}.get(quant, spec.release)
    return spec.release
