"""Row 3: open a ds4 GGUF file (mmap), read its `deepseek4.*` metadata into a ModelConfig, bind and
validate the tensor inventory (model.md §2).

Two levels:

* `GGUFFile` is the container only (GGUF v3): header, metadata, tensor directory, memory-mapped data.
  It knows nothing about ds4, so the tokenizer can use it to read the vocabulary without touching weights.
* `open_model(path)` returns a `ModelFile`: a GGUFFile plus the frozen ModelConfig read from the file, with
  every tensor of `layout.tensor_specs(cfg)` checked (presence, ggml type, dims, bounds).

Nothing is copied at open time. Big string arrays (the 129k tokens and 128k merges of the real file) are only
skipped over while parsing (one length read per item) and decoded when first asked for; numeric arrays are
decoded on access from the mapping. The `gguf` package is never imported here (it is the test oracle): its
reader needs ~13 s for the real tokenizer arrays.

Every problem raises one `ModelFileError` naming the key or tensor, with the expected and the actual value.
torch is imported lazily (only `tensor()` needs it) so that text layers can read a vocabulary cheaply.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ds4.config import ModelConfig
from ds4.errors import ModelFileError
from ds4.layout import TensorSpec, tensor_specs
from ds4.quant.types import BLOCK_GEOMETRY, GGMLType, tensor_nbytes, type_name

if TYPE_CHECKING:
    import torch

GGUF_MAGIC = 0x46554747  # b"GGUF" read as little-endian u32
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 8
MAX_ARRAY_DEPTH = 8  # nested metadata arrays (ds4 files have none; bounds the recursion on bad files)
ARCHITECTURE = "deepseek4"


class ValueType(IntEnum):
    """GGUF metadata value types."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# Fixed-size value types -> (struct format, numpy dtype); STRING and ARRAY are variable-sized.
_FIXED: dict[ValueType, tuple[struct.Struct, np.dtype]] = {
    ValueType.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    ValueType.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    ValueType.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    ValueType.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    ValueType.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    ValueType.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    ValueType.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    ValueType.BOOL: (struct.Struct("<?"), np.dtype("?")),
    ValueType.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    ValueType.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    ValueType.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


# ---------------------------------------------------------------------------------------------------
# Container: metadata fields and tensor directory entries
# ---------------------------------------------------------------------------------------------------


@dataclass
class MetaField:
    """One metadata entry. Scalars are decoded while parsing; arrays only when first read."""

    key: str
    type: ValueType
    offset: int  # absolute offset of the value (arrays: of the first item)
    item_type: ValueType | None = None  # arrays only
    count: int = 1  # arrays: number of items
    decoded: bool = False
    _value: Any = None

    @property
    def type_name(self) -> str:
        """Type for error messages: UINT32, ARRAY of STRING, ..."""
        if self.type == ValueType.ARRAY and self.item_type is not None:
            return f"ARRAY of {self.item_type.name}"
        return self.type.name


@dataclass(frozen=True)
class TensorInfo:
    """One tensor directory entry, with its absolute location in the file."""

    name: str
    dims: tuple[int, ...]  # GGUF order, fastest first (ne0 = row length)
    qtype: GGMLType | int  # plain int when the ggml type is unknown to ds4
    offset: int  # absolute byte offset in the file
    nbytes: int  # 0 when the type is unknown (size cannot be computed)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (torch, row-major) shape: the reverse of dims."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def known_type(self) -> bool:
        return isinstance(self.qtype, GGMLType)

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)


class Metadata(Mapping[str, Any]):
    """Read-only mapping key -> python value; arrays become lists when first read (then cached)."""

    def __init__(self, owner: GGUFFile, fields: dict[str, MetaField]) -> None:
        self._owner = owner
        self.fields = fields

    def __getitem__(self, key: str) -> Any:
        field = self.fields[key]
        if not field.decoded:
            if self._owner._mm is None:
                raise ModelFileError(f"GGUF file is closed: {self._owner.path}")
            field._value = self._owner._decode_array(field)
            field.decoded = True
        return field._value

    def __iter__(self) -> Iterator[str]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def __contains__(self, key: object) -> bool:
        return key in self.fields


class _Cursor:
    """Bounds-checked little-endian reads from the mapped file; truncation names the section being read."""

    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0
        self.section = "header"

    def need(self, n: int, pos: int | None = None) -> None:
        at = self.pos if pos is None else pos
        if at + n > self.size:
            raise ModelFileError(
                f"GGUF file is truncated in the {self.section}: needs {n} bytes at offset {at}, "
                f"file has {self.size} bytes"
            )

    def unpack(self, st: struct.Struct) -> Any:
        self.need(st.size)
        (value,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return value

    def u32(self) -> int:
        return self.unpack(_U32)

    def u64(self) -> int:
        return self.unpack(_U64)

    def string(self, what: str) -> str:
        n = self.u64()
        self.need(n)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelFileError(f"{what} at offset {self.pos - n} is not valid UTF-8 ({e.reason})") from None


class GGUFFile:
    """A GGUF v3 file, memory-mapped: header, metadata, tensor directory. No ds4 validation.

    `metadata` maps keys to python values (arrays decoded lazily); `fields` keeps the GGUF value types;
    `tensors` maps names to TensorInfo (directory order). Weights are only read by `raw()`/`tensor()`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._mm, self.file_size = _map_file(self.path)
        self._bytes: np.ndarray | None = None
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    # ---- parsing ----
    def _parse(self) -> None:
        cur = _Cursor(self._mm, self.file_size)
        if self.file_size < 4 or _U32.unpack_from(self._mm, 0)[0] != GGUF_MAGIC:
            head = bytes(self._mm[:4]) if self.file_size else b""
            raise ModelFileError(
                f"model is not a GGUF file: {self.path} (starts with {head!r}, expected b'GGUF')"
            )
        cur.pos = 4
        self.version = cur.u32()
        if self.version != GGUF_VERSION:
            hint = " (big-endian GGUF?)" if self.version == GGUF_VERSION << 24 else ""
            raise ModelFileError(f"only GGUF v3 is supported, got version {self.version}{hint}")
        n_tensors, n_kv = cur.u64(), cur.u64()
        cur.section = "metadata"
        self.fields = self._parse_metadata(cur, n_kv)
        self.metadata = Metadata(self, self.fields)
        self.alignment = self._alignment()
        cur.section = "tensor directory"
        entries = [self._parse_tensor_entry(cur) for _ in range(n_tensors)]
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, qtype, rel in entries:
            if name in self.tensors:
                raise ModelFileError(f"duplicate tensor name in GGUF directory: {name}")
            self.tensors[name] = self._place_tensor(name, dims, qtype, rel)

    def _parse_metadata(self, cur: _Cursor, n_kv: int) -> dict[str, MetaField]:
        fields: dict[str, MetaField] = {}
        for _ in range(n_kv):
            key = cur.string("metadata key")
            field = self._parse_value(cur, key, cur.u32())
            if key in fields:
                raise ModelFileError(f"duplicate metadata key in GGUF file: {key}")
            fields[key] = field
        return fields

    def _parse_value(self, cur: _Cursor, key: str, raw_type: int) -> MetaField:
        vtype = _value_type(raw_type, key)
        if vtype == ValueType.STRING:
            start = cur.pos
            return MetaField(key, vtype, start, decoded=True, _value=cur.string(f"metadata value of {key}"))
        if vtype != ValueType.ARRAY:
            start = cur.pos
            return MetaField(
                key, vtype, start, decoded=True, _value=_plain(vtype, cur.unpack(_FIXED[vtype][0]))
            )
        item_type = _value_type(cur.u32(), key)
        count = cur.u64()
        field = MetaField(key, vtype, cur.pos, item_type=item_type, count=count)
        cur.pos = self._skip_items(cur, item_type, count, key)
        return field

    def _skip_items(self, cur: _Cursor, item_type: ValueType, count: int, key: str, depth: int = 1) -> int:
        """End offset of `count` items starting at cur.pos, reading only string lengths (fast path)."""
        if depth > MAX_ARRAY_DEPTH:
            raise ModelFileError(f"metadata key {key} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")
        if item_type in _FIXED:
            cur.need(count * _FIXED[item_type][0].size)
            return cur.pos + count * _FIXED[item_type][0].size
        if item_type == ValueType.STRING:
            return self._skip_strings(cur, count)
        # nested arrays: item = (u32 type, u64 count, items)
        for _ in range(count):
            sub_type = _value_type(cur.u32(), key)
            sub_count = cur.u64()
            cur.pos = self._skip_items(cur, sub_type, sub_count, key, depth + 1)
        return cur.pos

    def _skip_strings(self, cur: _Cursor, count: int) -> int:
        # The hot loop of opening a real file (257k tokenizer strings): one length read per item, bounds
        # checked once at the end (a length pointing past the file makes the next read fail instead).
        buf, pos, unpack = self._mm, cur.pos, _U64.unpack_from
        try:
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
        except (struct.error, OverflowError):  # a length ran past the file (or past any offset)
            cur.need(8, pos)
        cur.need(pos - cur.pos)
        return pos

    def _decode_array(self, field: MetaField) -> list[Any]:
        assert field.item_type is not None
        values, _ = self._decode_items(field.offset, field.item_type, field.count, field.key)
        return values

    def _decode_items(self, pos: int, item_type: ValueType, count: int, key: str) -> tuple[list[Any], int]:
        if item_type in _FIXED:
            dtype = _FIXED[item_type][1]
            arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=pos)
            return arr.tolist(), pos + count * dtype.itemsize
        if item_type == ValueType.STRING:
            return self._decode_strings(pos, count, key)
        cur = _Cursor(self._mm, self.file_size)
        cur.pos, cur.section = pos, "metadata"
        out: list[Any] = []
        for _ in range(count):  # nested arrays
            sub_type, sub_count = _value_type(cur.u32(), key), cur.u64()
            items, cur.pos = self._decode_items(cur.pos, sub_type, sub_count, key)
            out.append(items)
        return out, cur.pos

    def _decode_strings(self, pos: int, count: int, key: str) -> tuple[list[str], int]:
        # Bounds were checked when the array was skipped at open time.
        buf, unpack, out = self._mm, _U64.unpack_from, []
        append = out.append
        try:
            for _ in range(count):
                n = unpack(buf, pos)[0]
                pos += 8
                append(buf[pos : pos + n].decode("utf-8"))
                pos += n
        except UnicodeDecodeError as e:
            raise ModelFileError(f"item {len(out)} of {key} is not valid UTF-8 ({e.reason})") from None
        return out, pos

    def _alignment(self) -> int:
        field = self.fields.get("general.alignment")
        if field is None:
            return DEFAULT_ALIGNMENT
        if field.type != ValueType.UINT32:
            raise ModelFileError(
                f"metadata key general.alignment has GGUF type {field.type_name}, expected UINT32"
            )
        value = field._value
        if value <= 0 or value & (value - 1):
            raise ModelFileError(f"general.alignment must be a power of two, got {value}")
        return value

    def _parse_tensor_entry(self, cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string("tensor name")
        ndim = cur.u32()
        if not 1 <= ndim <= MAX_DIMS:
            raise ModelFileError(
                f"tensor {name} has {ndim} dimensions in the GGUF directory, expected 1..{MAX_DIMS}"
            )
        dims = tuple(cur.u64() for _ in range(ndim))
        return name, dims, cur.u32(), cur.u64()

    def _place_tensor(self, name: str, dims: tuple[int, ...], qtype: int, rel: int) -> TensorInfo:
        try:
            known: GGMLType | int = GGMLType(qtype)
            nbytes = tensor_nbytes(known, math.prod(dims))
        except ValueError:  # not a type ds4 knows: keep the id, size unknown (open_model rejects it)
            known, nbytes = qtype, 0
        if rel % self.alignment:
            raise ModelFileError(
                f"tensor {name} has data offset {rel}, expected a multiple of the alignment {self.alignment}"
            )
        start = self.data_offset + rel
        if start + nbytes > self.file_size:
            raise ModelFileError(
                f"tensor points outside GGUF file: {name} needs bytes {start}..{start + nbytes}, "
                f"file has {self.file_size} bytes (truncated file?)"
            )
        return TensorInfo(name, dims, known, start, nbytes)

    # ---- access ----
    def field(self, key: str) -> MetaField | None:
        return self.fields.get(key)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(f"tensor not found in {self.path.name}: {name}") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapping (nothing is copied)."""
        info = self.info(name)
        if not info.known_type:
            raise ModelFileError(f"tensor {name} has unknown ggml type id {info.qtype}; its size is unknown")
        if self._bytes is None:
            if self._mm is None:
                raise ModelFileError(f"GGUF file is closed: {self.path}")
            self._bytes = np.frombuffer(self._mm, dtype=np.uint8)
        return self._bytes[info.offset : info.offset + info.nbytes]

    def tensor(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """The tensor in its logical shape: float32 (dequantized), or int32 for I32 tensors."""
        import torch

        info = self.info(name)
        raw = self.raw(name)
        plain = _plain_array(raw, info)
        if plain is not None:
            out = torch.from_numpy(plain)
        else:
            from ds4.quant import dequantize  # the block formats (model.md §3)

            out = dequantize(raw, info.qtype, info.shape)
        return out.to(device)

    # ---- tokenizer arrays (decoded on first use, then cached) ----
    def tokens(self) -> list[str]:
        """The vocabulary strings (GPT-2 byte-encoded), index = token id."""
        return self.metadata[_string_array_field(self, TOKENS_KEY).key]

    def merges(self) -> list[str]:
        """BPE merges "a b"; rank = index."""
        return self.metadata[_string_array_field(self, MERGES_KEY).key]

    def token_types(self) -> list[int] | None:
        """Per-token types (1 normal, 3 control, 4 user-defined), or None when the file has none."""
        field = self.fields.get(TOKEN_TYPES_KEY)
        if field is None:
            return None
        if field.type != ValueType.ARRAY or field.item_type not in _INTEGER_TYPES:
            raise ModelFileError(
                f"metadata key {TOKEN_TYPES_KEY} has GGUF type {field.type_name}, expected ARRAY of INT32"
            )
        return self.metadata[TOKEN_TYPES_KEY]

    def close(self) -> None:
        """Release the mapping (views handed out by raw() keep their pages alive until dropped)."""
        self._bytes = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a raw() view is still alive; the mapping goes when it does
                pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _map_file(path: Path) -> tuple[mmap.mmap | None, int]:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise ModelFileError(f"model is not a GGUF file: {path} (file is empty)")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), size
    except FileNotFoundError:
        raise ModelFileError(f"model file not found: {path}") from None
    except IsADirectoryError:
        raise ModelFileError(f"model path is a directory, expected a GGUF file: {path}") from None
    except PermissionError:
        raise ModelFileError(f"model file is not readable (permission denied): {path}") from None


def _value_type(raw_type: int, key: str) -> ValueType:
    try:
        return ValueType(raw_type)
    except ValueError:
        raise ModelFileError(f"metadata key {key} has unknown GGUF value type {raw_type}") from None


def _plain(vtype: ValueType, value: Any) -> Any:
    return bool(value) if vtype == ValueType.BOOL else value


def _plain_array(raw: np.ndarray, info: TensorInfo) -> np.ndarray | None:
    """F32/F16/BF16 -> float32 and I32 -> int32 arrays in logical shape (a copy); None for block formats."""
    shape = info.shape
    if info.qtype == GGMLType.F32:
        return raw.view("<f4").reshape(shape).copy()
    if info.qtype == GGMLType.F16:
        return raw.view("<f2").reshape(shape).astype(np.float32)
    if info.qtype == GGMLType.BF16:
        # bf16 is the high half of a float32
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if info.qtype == GGMLType.I32:
        return raw.view("<i4").reshape(shape).copy()
    return None


# ---------------------------------------------------------------------------------------------------
# Tokenizer arrays (container level: the tokenizer reads them without the model config)
# ---------------------------------------------------------------------------------------------------

TOKENS_KEY = "tokenizer.ggml.tokens"
MERGES_KEY = "tokenizer.ggml.merges"
TOKEN_TYPES_KEY = "tokenizer.ggml.token_type"
_INTEGER_TYPES = frozenset(
    {ValueType.UINT8, ValueType.INT8, ValueType.UINT16, ValueType.INT16, ValueType.UINT32, ValueType.INT32,
     ValueType.UINT64, ValueType.INT64}
)  # fmt: skip


def _string_array_field(f: GGUFFile, key: str) -> MetaField:
    field = f.fields.get(key)
    if field is None:
        raise ModelFileError(f"required metadata key is missing: {key}")
    if field.type != ValueType.ARRAY or field.item_type != ValueType.STRING:
        raise ModelFileError(f"metadata key {key} has GGUF type {field.type_name}, expected ARRAY of STRING")
    return field


# ---------------------------------------------------------------------------------------------------
# deepseek4.* metadata -> ModelConfig (model.md §2.2 type rules)
# ---------------------------------------------------------------------------------------------------

# How a key is read. "u32": UINT32 exactly; "u64": UINT64 or UINT32; "float": FLOAT32, FLOAT64, UINT32 or
# INT32; "bool": BOOL; "ratios": array of UINT32/INT32; "clamps": array of FLOAT32/FLOAT64; a trailing "?"
# marks an optional key (absent -> the ModelConfig default).
_ACCEPTED: dict[str, tuple[ValueType, ...]] = {
    "u32": (ValueType.UINT32,),
    "u64": (ValueType.UINT64, ValueType.UINT32),
    "float": (ValueType.FLOAT32, ValueType.FLOAT64, ValueType.UINT32, ValueType.INT32),
    "bool": (ValueType.BOOL,),
    "ratios": (ValueType.UINT32, ValueType.INT32),
    "clamps": (ValueType.FLOAT32, ValueType.FLOAT64),
}
_ARRAY_KINDS = frozenset({"ratios", "clamps"})


@dataclass(frozen=True)
class ConfigKey:
    field: str  # ModelConfig field
    key: str  # full GGUF metadata key
    kind: str  # see _ACCEPTED
    optional: bool = False

    @property
    def expected_type(self) -> str:
        names = " or ".join(t.name for t in _ACCEPTED[self.kind])
        return f"ARRAY of {names}" if self.kind in _ARRAY_KINDS else names


def _k(field: str, key: str, kind: str, optional: bool = False) -> ConfigKey:
    return ConfigKey(field, f"{ARCHITECTURE}.{key}", kind, optional)


# Every validated key of model.md §2.2, in the spec's order (a writer of synthetic files can use it too).
CONFIG_KEYS: tuple[ConfigKey, ...] = (
    _k("n_layer", "block_count", "u32"),
    _k("n_embd", "embedding_length", "u32"),
    _k("n_vocab", "vocab_size", "u32"),
    _k("n_head", "attention.head_count", "u32"),
    _k("n_head_kv", "attention.head_count_kv", "u32"),
    _k("head_dim", "attention.key_length", "u32"),
    _k("value_dim", "attention.value_length", "u32"),
    _k("n_rot", "rope.dimension_count", "u32"),
    _k("q_lora_rank", "attention.q_lora_rank", "u32"),
    _k("o_lora_rank", "attention.output_lora_rank", "u32"),
    _k("o_groups", "attention.output_group_count", "u32"),
    _k("n_expert", "expert_count", "u32"),
    _k("n_expert_used", "expert_used_count", "u32"),
    _k("expert_ff", "expert_feed_forward_length", "u32"),
    _k("n_expert_shared", "expert_shared_count", "u32"),
    _k("n_hash_layers", "hash_layer_count", "u32"),
    _k("expert_group_count", "expert_group_count", "u32", optional=True),
    _k("expert_group_used_count", "expert_group_used_count", "u32", optional=True),
    _k("window", "attention.sliding_window", "u32"),
    _k("indexer_heads", "attention.indexer.head_count", "u32"),
    _k("indexer_dim", "attention.indexer.key_length", "u32"),
    _k("indexer_topk", "attention.indexer.top_k", "u32"),
    _k("hc_mult", "hyper_connection.count", "u32"),
    _k("hc_sinkhorn_iters", "hyper_connection.sinkhorn_iterations", "u32"),
    _k("compress_ratios", "attention.compress_ratios", "ratios"),
    _k("swiglu_clamp", "swiglu_clamp_exp", "clamps"),
    _k("rope_orig_ctx", "rope.scaling.original_context_length", "u64"),
    _k("rope_base", "rope.freq_base", "float"),
    _k("rope_factor", "rope.scaling.factor", "float"),
    _k("yarn_beta_fast", "rope.scaling.yarn_beta_fast", "float"),
    _k("yarn_beta_slow", "rope.scaling.yarn_beta_slow", "float"),
    _k("compress_rope_base", "attention.compress_rope_freq_base", "float"),
    _k("expert_weights_scale", "expert_weights_scale", "float"),
    _k("rms_eps", "attention.layer_norm_rms_epsilon", "float"),
    _k("hc_eps", "hyper_connection.epsilon", "float"),
    _k("expert_weights_norm", "expert_weights_norm", "bool"),
)
CONTEXT_LENGTH_KEY = f"{ARCHITECTURE}.context_length"  # informational only (any integer type)


def read_config(f: GGUFFile) -> ModelConfig:
    """ModelConfig from the file's `deepseek4.*` keys, with the §2.2 GGUF value-type rules."""
    arch = f.fields.get("general.architecture")
    if arch is not None and arch.type == ValueType.STRING and arch._value != ARCHITECTURE:
        raise ModelFileError(
            f"general.architecture is {arch._value!r}, expected {ARCHITECTURE!r} "
            "(ds4 runs DeepSeek V4 Flash files only)"
        )
    values: dict[str, Any] = {}
    for ck in CONFIG_KEYS:
        field = f.fields.get(ck.key)
        if field is None:
            if not ck.optional:
                raise ModelFileError(f"required metadata key is missing: {ck.key}")
            continue
        values[ck.field] = _read_key(f, ck, field, values.get("n_layer", 0))
    ctx = f.fields.get(CONTEXT_LENGTH_KEY)
    if ctx is not None and ctx.type in _INTEGER_TYPES:
        values["context_length"] = int(ctx._value)
    name = f.fields.get("general.name")
    if name is not None and name.type == ValueType.STRING:
        values["name"] = name._value
    return ModelConfig(**values)


def _read_key(f: GGUFFile, ck: ConfigKey, field: MetaField, n_layer: int) -> Any:
    accepted = _ACCEPTED[ck.kind]
    if ck.kind in _ARRAY_KINDS:
        if field.type != ValueType.ARRAY or field.item_type not in accepted:
            raise ModelFileError(
                f"metadata key {ck.key} has GGUF type {field.type_name}, expected {ck.expected_type}"
            )
        if field.count < n_layer:
            raise ModelFileError(
                f"metadata key {ck.key} is shorter than the layer count: {field.count} entries, "
                f"expected at least {n_layer}"
            )
        items = f.metadata[ck.key][:n_layer]  # only the first n_layer entries are used (§2.2)
        if ck.kind == "ratios":
            return tuple(int(v) for v in items)
        return tuple(_float_value(field.item_type, v) for v in items)
    if field.type not in accepted:
        raise ModelFileError(
            f"metadata key {ck.key} has GGUF type {field.type_name}, expected {ck.expected_type}"
        )
    if ck.kind == "float":
        return _float_value(field.type, field._value)
    return field._value


def _float_value(vtype: ValueType | None, value: float | int) -> float:
    # A FLOAT32 value stands for the shortest decimal that rounds to it (1e-6, not 9.99999997e-07), so the
    # Flash preset is recognised exactly and printed values read as written by the converter.
    if vtype == ValueType.FLOAT32:
        return float(str(np.float32(value)))
    return float(value)


def check_config(cfg: ModelConfig) -> None:
    """Internal consistency a loader relies on (values need not equal Flash; see cfg.is_flash)."""
    positive = [ck for ck in CONFIG_KEYS if ck.kind in ("u32", "u64") and not ck.optional]
    for ck in positive:
        if ck.field != "n_hash_layers" and getattr(cfg, ck.field) < 1:
            raise ModelFileError(f"{ck.key} must be at least 1, got {getattr(cfg, ck.field)}")
    rules: list[tuple[bool, str]] = [
        (cfg.n_head_kv == 1, f"attention.head_count_kv must be 1 (one shared KV row), got {cfg.n_head_kv}"),
        (cfg.value_dim == cfg.head_dim,
         f"attention.value_length must equal attention.key_length {cfg.head_dim}, got {cfg.value_dim}"),
        (cfg.n_rot % 2 == 0 and cfg.n_rot <= min(cfg.head_dim, cfg.indexer_dim),
         f"rope.dimension_count must be even and at most key_length {cfg.head_dim} and indexer.key_length "
         f"{cfg.indexer_dim}, got {cfg.n_rot}"),
        (cfg.nope_dim % 64 == 0,
         f"attention.key_length - rope.dimension_count must be a multiple of 64 (FP8 blocks), "
         f"got {cfg.head_dim} - {cfg.n_rot} = {cfg.nope_dim}"),
        (cfg.n_head % cfg.o_groups == 0,
         f"attention.head_count {cfg.n_head} must be a multiple of attention.output_group_count "
         f"{cfg.o_groups}"),
        (cfg.n_expert_used <= cfg.n_expert,
         f"expert_used_count must be at most expert_count {cfg.n_expert}, got {cfg.n_expert_used}"),
        (cfg.n_expert_shared == 1, f"expert_shared_count must be 1, got {cfg.n_expert_shared}"),
        (cfg.n_hash_layers <= cfg.n_layer,
         f"hash_layer_count must be at most block_count {cfg.n_layer}, got {cfg.n_hash_layers}"),
        (cfg.expert_group_count == 0,
         f"expert_group_count must be 0 if present, got {cfg.expert_group_count}"),
        (cfg.expert_group_used_count == 0,
         f"expert_group_used_count must be 0 if present, got {cfg.expert_group_used_count}"),
    ]  # fmt: skip
    for ok, message in rules:
        if not ok:
            raise ModelFileError(f"{ARCHITECTURE}.{message}")
    for il, ratio in enumerate(cfg.compress_ratios):
        if ratio < 0:
            raise ModelFileError(
                f"unexpected DeepSeek4 compression ratio at layer {il}: got {ratio}, expected 0 (none), "
                "4 (overlapping compressor + indexer) or another positive ratio"
            )
    for ck in CONFIG_KEYS:
        if ck.kind == "float" and not math.isfinite(getattr(cfg, ck.field)):
            raise ModelFileError(f"{ck.key} must be finite, got {getattr(cfg, ck.field)}")
    for name in ("rope_base", "rope_factor", "compress_rope_base", "rms_eps", "hc_eps"):
        if getattr(cfg, name) <= 0:
            key = next(ck.key for ck in CONFIG_KEYS if ck.field == name)
            raise ModelFileError(f"{key} must be positive, got {getattr(cfg, name)}")
    for il, clamp in enumerate(cfg.swiglu_clamp):
        if not math.isfinite(clamp) or clamp <= 0:
            raise ModelFileError(
                f"{ARCHITECTURE}.swiglu_clamp_exp[{il}] must be a positive number, got {clamp}"
            )


# ---------------------------------------------------------------------------------------------------
# Tensor inventory validation (model.md §2.3)
# ---------------------------------------------------------------------------------------------------

_EXPERT_QUANTS = (GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q4_K)


def validate_tensors(f: GGUFFile, cfg: ModelConfig) -> None:
    """Every inventory tensor is present (unless optional) with an allowed type and the expected dims."""
    for info in f.tensors.values():
        if not info.known_type:
            known = ", ".join(t.name for t in GGMLType)
            raise ModelFileError(
                f"tensor {info.name} has unknown ggml type id {info.qtype} (ds4 knows {known})"
            )
    for spec in tensor_specs(cfg):
        info = f.tensors.get(spec.name)
        if info is None:
            if spec.required:
                raise ModelFileError(f"required tensor is missing: {spec.name}")
            continue
        _check_tensor(info, spec)
    for il in range(cfg.n_layer):
        gate = f.tensors[f"blk.{il}.ffn_gate_exps.weight"].qtype
        up = f.tensors[f"blk.{il}.ffn_up_exps.weight"].qtype
        if gate != up:
            raise ModelFileError(
                f"routed gate/up experts use different quant types in layer {il}: "
                f"ffn_gate_exps is {type_name(gate)}, ffn_up_exps is {type_name(up)}"
            )


def _check_tensor(info: TensorInfo, spec: TensorSpec) -> None:
    if info.qtype not in spec.allowed:
        allowed = [spec.release] + sorted(spec.allowed - {spec.release})
        what = " or ".join(t.name for t in allowed)
        if spec.role:
            what = f"a routed expert quant type ({what})"
        raise ModelFileError(f"tensor {spec.name} has type {info.type_name}, expected {what}")
    if len(info.dims) != len(spec.dims):
        raise ModelFileError(
            f"tensor {spec.name} has {len(info.dims)} dimensions, expected {len(spec.dims)} "
            f"(GGUF dims {list(info.dims)}, expected {list(spec.dims)})"
        )
    for i, (got, want) in enumerate(zip(info.dims, spec.dims, strict=True)):
        if got != want:
            raise ModelFileError(
                f"tensor {spec.name} has dim[{i}]={got}, expected {want} "
                f"(GGUF dims {list(info.dims)}, expected {list(spec.dims)})"
            )
    block = BLOCK_GEOMETRY[GGMLType(info.qtype)][0]
    if info.dims[0] % block:
        raise ModelFileError(
            f"tensor {spec.name} has rows of {info.dims[0]} elements, not a multiple of the "
            f"{info.type_name} block size {block}"
        )


def _check_tokenizer(f: GGUFFile, cfg: ModelConfig) -> None:
    tokens = _string_array_field(f, TOKENS_KEY)
    _string_array_field(f, MERGES_KEY)
    if tokens.count > cfg.n_vocab:
        raise ModelFileError(
            f"{TOKENS_KEY} has {tokens.count} tokens, more than {ARCHITECTURE}.vocab_size {cfg.n_vocab} "
            "(ids past the embedding)"
        )


# ---------------------------------------------------------------------------------------------------
# The model file
# ---------------------------------------------------------------------------------------------------


class ModelFile(GGUFFile):
    """A ds4 GGUF: the container plus its ModelConfig, with the tensor inventory validated.

    Checked in order: container, metadata (type rules, then consistency), tokenizer keys (their count
    against vocab_size), tensor layout. validate=False reads the config but skips everything after it.
    """

    def __init__(self, path: str | os.PathLike[str], *, validate: bool = True) -> None:
        super().__init__(path)
        try:
            self.config = read_config(self)
            if validate:
                check_config(self.config)
                _check_tokenizer(self, self.config)
                validate_tensors(self, self.config)
        except BaseException:
            self.close()
            raise

    @property
    def expert_quant_bits(self) -> int:
        """Routed-expert bit width as ds4 reports it: 4 when layer 0's gate experts are Q4_K, else 2."""
        gate = self.tensors.get("blk.0.ffn_gate_exps.weight")
        return 4 if gate is not None and gate.qtype == GGMLType.Q4_K else 2

    @property
    def quant_family(self) -> str:
        """Quant mix as make-model names it: q2, q4, q8, f32, or "mixed" (layers differ in expert types)."""
        kinds = {self._layer_family(il) for il in range(self.config.n_layer)}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def _layer_family(self, il: int) -> str:
        gate = self.tensors.get(f"blk.{il}.ffn_gate_exps.weight")
        qa = self.tensors.get(f"blk.{il}.attn_q_a.weight")
        if gate is None or qa is None:
            return "unknown"
        if gate.qtype in (GGMLType.IQ2_XXS, GGMLType.Q2_K):
            return "q2"
        if gate.qtype == GGMLType.Q4_K:
            return "q4"
        return "q8" if GGMLType.Q8_0 in (gate.qtype, qa.qtype) else "f32"

    def __enter__(self) -> ModelFile:
        return self


def open_model(path: str | os.PathLike[str], *, validate: bool = True) -> ModelFile:
    """Open a ds4 GGUF memory-mapped; raises ModelFileError with one clear message on any problem."""
    return ModelFile(path, validate=validate)
