"""DeepSeek V4 tokenizer built from the GGUF vocabulary (product.md §1.1, §1.2, §3.4).

The GGUF carries `tokenizer.ggml.tokens` (GPT-2 byte-level strings, plus literal special tokens), the
`tokenizer.ggml.merges` ranks and `tokenizer.ggml.token_type`. We feed them to a HF `tokenizers` BPE model
with the DeepSeek V4 ("joyai-llm") pre-tokenizer: three isolating regex splits followed by the byte-level
mapping, exactly the configuration of the official `tokenizer.json`.

Two modes:
  * `encode(text)`       plain BPE; special strings in the text are ordinary text (CLI/eval user text).
  * `encode_chat(text)`  the 7 engine specials become single ids wherever they start; the spans in
                         between are plain BPE (how the server tokenizes a rendered prompt).

Decoding works on raw bytes (`token_bytes`), since one token can hold part of a UTF-8 character;
`StreamDecoder` turns a token stream into text without ever emitting half a character.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Sequence
from functools import cached_property
from itertools import chain
from os import PathLike
from typing import Any

import regex
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from ds4.errors import ModelFileError

# --------------------------------------------------------------------------------------------
# Special tokens (product.md §1.1): looked up by their literal vocab string.
# --------------------------------------------------------------------------------------------

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"  # no angle brackets: `<｜DSML｜invoke` is `<` + DSML + `invoke`

SPECIALS: tuple[str, ...] = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, DSML)

# GGUF token types (llama.cpp convention); control/user-defined entries are stored literally.
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
_LITERAL_TYPES = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
_FULLWIDTH_BAR = "\uff5c"  # any vocab entry containing it is literal text (ds4_token_text)

# --------------------------------------------------------------------------------------------
# Pre-tokenizer: the three Split regexes of the official tokenizer.json (behavior "Isolated"), in order.
# --------------------------------------------------------------------------------------------

PRETOKENIZE_DIGITS = "\\p{N}{1,3}"
# CJK unified ideographs U+4E00..U+9FA5, Hiragana U+3040..U+309F, Katakana U+30A0..U+30FF.
PRETOKENIZE_CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
PRETOKENIZE_WORDS = "|".join(
    (
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+",  # one ASCII punct glued to a word
        "[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+",  # a word with an optional leading non-letter
        " ?[\\p{P}\\p{S}]+[\r\n]*",  # punctuation runs keep their trailing newlines
        "\\s*[\r\n]+",
        "\\s+(?!\\S)",
        "\\s+",
    )
)
PRETOKENIZE_PATTERNS: tuple[str, ...] = (PRETOKENIZE_DIGITS, PRETOKENIZE_CJK, PRETOKENIZE_WORDS)


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to U+0100 upwards."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_OF_CHAR: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}
# Text -> byte-level string: UTF-8 bytes read as Latin-1 (one char per byte), then mapped per byte.
_BYTE_LEVEL_TABLE = str.maketrans(_bytes_to_unicode())


def byte_level(text: str) -> str:
    """The GPT-2 byte-level form of `text` (what the ByteLevel pre-tokenizer feeds to BPE)."""
    return text.encode("utf-8").decode("latin-1").translate(_BYTE_LEVEL_TABLE)


def _byte_level() -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)


# The first two splits isolate disjoint character sets, so one alternation does both; re.split with a
# group then yields gap, isolated, gap, isolated, ..., gap. The third split runs inside each gap: its
# alternatives match every character except the few (controls, format chars) that fall in no branch,
# which the "Isolated" behaviour keeps as gap pieces of their own.
_ISOLATE_RE = regex.compile("(" + PRETOKENIZE_DIGITS + "|" + PRETOKENIZE_CJK + ")")
_WORDS_RE = regex.compile(PRETOKENIZE_WORDS)
_PIECE_CACHE_MAX = 1 << 20


def _split_words(gap: str) -> list[str]:
    pieces = _WORDS_RE.findall(gap)
    if sum(map(len, pieces)) == len(gap):
        return pieces
    pieces, pos = [], 0  # rare: some characters matched no branch; keep them as their own pieces
    for m in _WORDS_RE.finditer(gap):
        if m.start() > pos:
            pieces.append(gap[pos : m.start()])
        pieces.append(m.group())
        pos = m.end()
    if pos < len(gap):
        pieces.append(gap[pos:])
    return pieces


def pretokenize(text: str) -> list[str]:
    """Split text into the pieces BPE works on, exactly as the official Split x3 pre-tokenizer does."""
    pieces: list[str] = []
    for i, seg in enumerate(_ISOLATE_RE.split(text)):
        if i % 2:
            pieces.append(seg)
        elif seg:
            pieces.extend(_split_words(seg))
    return pieces


class TokenizerError(ModelFileError):
    """A vocabulary that cannot be used (missing special, bad merge, duplicate entry)."""


def _as_strs(items: Sequence[str | bytes]) -> list[str]:
    """GGUF string arrays may come as bytes; decode them (the common all-str case is one cheap pass)."""
    if all(type(x) is str for x in items):
        return list(items)  # type: ignore[arg-type]
    return [x.decode("utf-8") if isinstance(x, bytes | bytearray) else x for x in items]


class Tokenizer:
    """BPE tokenizer over a GGUF vocabulary; ids are positions in `tokens`."""

    def __init__(
        self,
        tokens: Sequence[str | bytes],
        merges: Sequence[str | bytes],
        token_types: Sequence[int] | None = None,
    ) -> None:
        self.tokens: list[str] = _as_strs(tokens)
        self.token_types: list[int] | None = list(token_types) if token_types is not None else None
        if self.token_types is not None and len(self.token_types) != len(self.tokens):
            raise TokenizerError(
                f"token_types has {len(self.token_types)} entries, expected {len(self.tokens)} (one a token)"
            )
        self._id_of: dict[str, int] = {tok: i for i, tok in enumerate(self.tokens)}
        if len(self._id_of) != len(self.tokens):
            first = {}
            for i, tok in enumerate(self.tokens):
                if first.setdefault(tok, i) != i:
                    raise TokenizerError(f"duplicate vocab entry {tok!r} at ids {first[tok]} and {i}")
        self._special_ids: dict[str, int] = {s: self._require(s) for s in SPECIALS}
        self._merges = self._parse_merges(self._id_of, merges)
        # The BPE model alone: one pre-tokenized piece, already in byte-level form, is one word.
        self._bpe_model = models.BPE(
            vocab=self._id_of, merges=self._merges, fuse_unk=False, byte_fallback=False
        )
        self._piece_ids: dict[str, list[int]] = {}  # piece -> ids; pieces repeat a lot (words, indentation)
        # Rendered-chat scan: any of the 7 specials, leftmost first (none is a prefix of another).
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")
        self._bytes_cache: list[bytes | None] = [None] * len(self.tokens)

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source: str | PathLike[str] | Any) -> Tokenizer:
        """Build from a GGUF path, or from an opened model file offering tokens()/merges()/token_types()."""
        if isinstance(source, str | PathLike):
            # Lazy import: ds4.gguf sits above the text layer; only this convenience constructor needs it.
            from ds4.gguf import GGUFFile

            with GGUFFile(source) as f:  # only the vocab arrays are read; no tensor data is touched
                return cls.from_gguf(f)
        for name in ("tokens", "merges"):
            if not callable(getattr(source, name, None)):
                raise TypeError(
                    f"from_gguf needs a path or a model file with .{name}(), got {type(source)!r}"
                )
        types = source.token_types() if callable(getattr(source, "token_types", None)) else None
        return cls(source.tokens(), source.merges(), types)

    def _require(self, text: str) -> int:
        tid = self._id_of.get(text)
        if tid is None:
            raise TokenizerError(f"special token {text!r} is missing from the GGUF vocabulary")
        return tid

    @staticmethod
    def _parse_merges(vocab: dict[str, int], merges: Sequence[str | bytes]) -> list[tuple[str, str]]:
        pairs = [m.partition(" ") for m in _as_strs(merges)]
        # A clear error naming the first bad merge (HF would only say "merge token out of vocabulary").
        for rank, (left, sep, right) in enumerate(pairs):
            if not (sep and left in vocab and right in vocab and left and right):
                raise TokenizerError(
                    f"merge #{rank} {left + sep + right!r} is not 'A B' with A and B in the vocabulary"
                )
        return [(left, right) for left, _, right in pairs]

    def hf_pipeline(self) -> _HFTokenizer:
        """The whole plain-mode pipeline in HF `tokenizers` (Split x3 + ByteLevel + BPE), as in the official
        tokenizer.json. `encode` computes the same ids faster; this is kept as its in-process reference."""
        splits = [
            pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in PRETOKENIZE_PATTERNS
        ]
        hf = _HFTokenizer(
            models.BPE(vocab=self._id_of, merges=self._merges, fuse_unk=False, byte_fallback=False)
        )
        hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, _byte_level()])
        hf.decoder = decoders.ByteLevel()
        return hf

    # ---- special ids --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def bos_id(self) -> int:
        return self._special_ids[BOS]

    @property
    def eos_id(self) -> int:
        return self._special_ids[EOS]

    @property
    def user_id(self) -> int:
        return self._special_ids[USER]

    @property
    def assistant_id(self) -> int:
        return self._special_ids[ASSISTANT]

    @property
    def think_start_id(self) -> int:
        return self._special_ids[THINK_START]

    @property
    def think_end_id(self) -> int:
        return self._special_ids[THINK_END]

    @property
    def dsml_id(self) -> int:
        return self._special_ids[DSML]

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self._special_ids.values())

    def token_id(self, text: str) -> int | None:
        """The id of an exact vocab string (GPT-2 byte-encoded form for ordinary tokens)."""
        return self._id_of.get(text)

    # ---- encoding -----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Plain BPE: special strings inside `text` are ordinary text."""
        return self._encode_pieces(pretokenize(text)) if text else []

    def encode_chat(self, rendered: str) -> list[int]:
        """Rendered-chat tokenization: each of the 7 specials is one id, the spans between are plain BPE."""
        ids: list[int] = []
        # re.split with a capture group alternates text, special, text, special, ..., text.
        for i, piece in enumerate(self._special_re.split(rendered)):
            if i % 2:
                ids.append(self._special_ids[piece])
            elif piece:
                ids.extend(self.encode(piece))
        return ids

    def _encode_pieces(self, pieces: list[str]) -> list[int]:
        cache = self._piece_ids
        missing = [p for p in set(pieces) if p not in cache]
        if missing:
            if len(cache) + len(missing) > _PIECE_CACHE_MAX:
                # Bound memory by starting a fresh dict (never clearing one in use, so that a concurrent
                # caller holding the old dict still finds every piece it filled in).
                cache = self._piece_ids = {}
            tokenize = self._bpe_model.tokenize
            for piece in missing:
                cache[piece] = [t.id for t in tokenize(byte_level(piece))]
        return list(chain.from_iterable(map(cache.__getitem__, pieces)))

    # ---- decoding -----------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (possibly a partial UTF-8 sequence)."""
        if not 0 <= token_id < len(self.tokens):
            raise IndexError(f"token id {token_id} out of range [0, {len(self.tokens)})")
        cached = self._bytes_cache[token_id]
        if cached is None:
            cached = self._bytes_cache[token_id] = self._compute_bytes(token_id)
        return cached

    def _compute_bytes(self, token_id: int) -> bytes:
        text = self.tokens[token_id]
        literal = _FULLWIDTH_BAR in text or (
            self.token_types is not None and self.token_types[token_id] in _LITERAL_TYPES
        )
        if not literal:
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in text)
            except KeyError:
                pass  # not a byte-level string: keep the entry as literal text
        return text.encode("utf-8")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.token_bytes(i) for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a token sequence; invalid or truncated UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns only complete UTF-8 characters; `flush()` the rest."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """Emit what is still held (an incomplete character becomes U+FFFD) and reset."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    @property
    def pending(self) -> bool:
        """True while bytes of an incomplete character are held back."""
        return bool(self._utf8.getstate()[0])


# --------------------------------------------------------------------------------------------
# --dump-tokens (product.md §3.4)
# --------------------------------------------------------------------------------------------


def format_token_dump(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """`[id, id, ...]`, then per token: id right-aligned in 6 columns, two spaces, raw vocab string."""
    lines = ["[" + ", ".join(str(i) for i in ids) + "]"]
    lines += [f"{i:6d}  {tokenizer.tokens[i]}" for i in ids]
    return "\n".join(lines) + "\n"


def dump_tokens(model_path: str | PathLike[str] | Any, text: str, *, chat: bool = False) -> str:
    """The `--dump-tokens` report. Only the vocabulary is read.

    chat=False (the CLI's `--dump-tokens`): the text is tokenized exactly as written with rendered-chat
    tokenization (specials recognised, no template). chat=True first wraps it in the CLI chat template
    (§1.4: BOS, <｜User｜>, text, <｜Assistant｜>, </think>; no system prompt, thinking off).
    """
    tok = model_path if isinstance(model_path, Tokenizer) else Tokenizer.from_gguf(model_path)
    if chat:
        from ds4.chat import encode_chat_prompt  # the template lives one module up

        ids = encode_chat_prompt(tok, "", text, "none")
    else:
        ids = tok.encode_chat(text)
    return format_token_dump(tok, ids)
