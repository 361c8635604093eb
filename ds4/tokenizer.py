"""DeepSeek V4 tokenizer built from the GGUF vocabulary (product.md §1.1, §1.2, §3.4).

The GGUF carries `tokenizer.ggml.tokens` (GPT-2 byte-level strings, plus literal special tokens), the
`tokenizer.ggml.merges` ranks and `tokenizer.ggml.token_type`. We feed them to a HF `tokenizers` BPE model
with the DeepSeek V4 ("joyai-llm") pre-tokenizer: three isolating regex splits followed by the byte-level
mapping, exactly the configuration of the official `tokenizer.json`.

Two modes:
  * `encode(text)`       plain BPE; special strings in the text are ordinary text (CLI/eval user text).
  * `encode_chat(text)`  the 7 engine specials become single ids wherever they start; the spans in
                         between are plain BPE (how the server tokenizes a rendered prompt).

Speed: `encode` computes the same ids as that HF pipeline (`hf_pipeline()`, tested against it and against
the official tokenizer.json) without its per-piece overhead: the Split x3 pre-tokenizer runs in Python
(`pretokenize`; long texts take a single stdlib-`re` pass, see the fast pre-tokenizer below), each distinct
piece goes once through HF's BPE model (64 pieces a call, joined by a separator that provably never merges)
and is cached as packed ids, so a text costs one regex pass, one dict lookup per piece and one bytes join.
`python tools/tok_speed.py` measures it (cold, fresh process, and warm).

Decoding works on raw bytes (`token_bytes`), since one token can hold part of a UTF-8 character;
`StreamDecoder` turns a token stream into text without ever emitting half a character.
"""

from __future__ import annotations

import codecs
import functools
import re
from array import array
from collections.abc import Iterable, Sequence
from functools import cached_property
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
_WORD_BRANCHES = (
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+",  # one ASCII punct glued to a word
    "[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+",  # a word with an optional leading non-letter
    " ?[\\p{P}\\p{S}]+[\r\n]*",  # punctuation runs keep their trailing newlines
    "\\s*[\r\n]+",
    "\\s+(?!\\S)",
    "\\s+",
)
PRETOKENIZE_WORDS = "|".join(_WORD_BRANCHES)
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
# Text -> byte-level string: the UTF-8 bytes decoded through a 256-character table. codecs.charmap_decode
# is one C loop (about 10x faster than str.translate with a dict). The second table sends 0xFF, a byte
# valid UTF-8 never contains, to a space, a character no byte-level string contains: many pieces joined
# with b"\xff" then convert in one call and split back apart on " ".
_BYTE_LEVEL_CHARS = "".join(_bytes_to_unicode()[b] for b in range(256))
_BYTE_LEVEL_CHARS_SEP = _BYTE_LEVEL_CHARS[:0xFF] + " "


def byte_level(text: str) -> str:
    """The GPT-2 byte-level form of `text` (what the ByteLevel pre-tokenizer feeds to BPE)."""
    return codecs.charmap_decode(text.encode("utf-8"), "strict", _BYTE_LEVEL_CHARS)[0]


def _byte_level_many(texts: list[str]) -> list[str]:
    """[byte_level(t) for t in texts], converted in one call."""
    if not texts:
        return []
    joined = b"\xff".join([t.encode("utf-8") for t in texts])
    return codecs.charmap_decode(joined, "strict", _BYTE_LEVEL_CHARS_SEP)[0].split(" ")


def _byte_level() -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)


# ---- The generic pre-tokenizer (any text; the reference for the fast path below) ------------------------
# The first two splits isolate disjoint character sets, so one alternation does both; re.split with a
# group then yields gap, isolated, gap, isolated, ..., gap. The third split runs inside each gap: its
# alternatives match every character except the few (controls, format chars) that fall in no branch,
# which the "Isolated" behaviour keeps as gap pieces of their own.
_ISOLATE_RE = regex.compile("(" + PRETOKENIZE_DIGITS + "|" + PRETOKENIZE_CJK + ")")
_WORDS_RE = regex.compile(PRETOKENIZE_WORDS)


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


def _pretokenize_generic(text: str) -> list[str]:
    pieces: list[str] = []
    for i, seg in enumerate(_ISOLATE_RE.split(text)):
        if i % 2:
            pieces.append(seg)
        elif seg:
            pieces.extend(_split_words(seg))
    return pieces


# ---- The fast pre-tokenizer for long texts: one stdlib `re` pass over classes cut to the text's alphabet --
# The `regex` module spends ~0.8 us a piece on prose with the \p{..} classes; stdlib `re` is faster per
# match but has no \p{..}, and the same classes spelled out as ranges make it scan hundreds of astral
# ranges per character (4x slower). A regex only ever asks whether a character OF THE TEXT is in a class,
# so intersecting every class with any superset of the text's alphabet changes no match. The superset is
# the whole 256-code-point blocks that hold the text's characters (so all texts of one script share one
# compiled pattern; block 0, ASCII + Latin-1, is always in), classified with the very `regex` classes of
# the generic path (so both agree by construction, whatever Unicode version `regex` carries). The three
# splits fold into one alternation:
#   * the digit and CJK branches come first and every other class excludes their characters, so no word
#     branch runs into an isolated character; `(?!\S)` must also accept one next (a gap's end, originally);
#   * a last branch takes the characters no other branch matches (controls, format, unassigned: "unmatched",
#     when not followed by a letter or mark, which `[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+` would take):
#     the stretch "Isolated" keeps as a piece of its own.
# On the 1.33 MB novel: ~0.10 s of CPU, against ~0.25 s for the generic path.
_CJK_CLASS = PRETOKENIZE_CJK.removesuffix("+")
_CLASS_RES = {
    name: regex.compile(pattern)
    for name, pattern in (
        ("N", "\\p{N}"),
        ("C", _CJK_CLASS),
        ("L", "\\p{L}"),
        ("M", "\\p{M}"),
        ("P", "\\p{P}"),
        ("S", "\\p{S}"),
        ("W", "\\s"),  # the generic pattern's \s, whose members `regex` decides
    )
}
# Shorter texts take the generic path (a millisecond or so). A pattern for a new alphabet costs about
# 1 ms a block to classify plus a compile, so beyond block 0 (Latin-1, compiled once) it is built only for
# texts long enough to repay it; once built, any text of that alphabet above _FAST_MIN_CHARS uses it.
_FAST_MIN_CHARS = 4096
_FAST_COMPILE_MIN_CHARS = 1 << 15
_FAST_MAX_ASTRAL_BLOCKS = 8  # `re` checks astral class members one range at a time: keep them few
_FAST_RES: dict[frozenset[int], re.Pattern[str]] = {}
_FAST_RES_MAX = 32
_PIECE_CACHE_MAX = 1 << 20
_BPE_GROUP = 64  # pieces per BPE call (see Tokenizer._add_grouped)
# Cached ids are packed as 4-byte integers (the array typecode of that size on this platform).
_ID_BYTES = 4
_ID_TYPE = next(code for code in "IL" if array(code).itemsize == _ID_BYTES)


@functools.lru_cache(maxsize=1024)
def _block_classes(block: int) -> dict[str, str]:
    """For code points [block*256, block*256 + 256): the body of each class of the folded pattern."""
    chars = set(map(chr, range(block << 8, (block + 1) << 8)))
    of = {name: set(r.findall("".join(sorted(chars)))) for name, r in _CLASS_RES.items()}
    iso = of["N"] | of["C"]  # isolated by the first two splits: no other class may hold them
    lead = chars - {"\r", "\n"} - of["L"] - of["P"] - of["S"] - iso  # [^\r\n\p{L}\p{P}\p{S}] in a gap
    members = {
        "digit": of["N"],
        "cjk": of["C"] - of["N"],
        "letter": (of["L"] | of["M"]) - iso,
        "punct": (of["P"] | of["S"]) - iso,
        "space": of["W"] - iso,
        "lead": lead,
        "nonspace": chars - of["W"] - iso,  # \S in a gap
        "unmatched": lead - of["M"] - of["W"],  # starts no branch of the generic pattern
    }
    return {name: _class_body(m) for name, m in members.items()}


def _class_body(chars: Iterable[str]) -> str:
    """The inside of a `re` character class matching exactly `chars` (consecutive code points as ranges)."""
    cps = sorted(map(ord, chars))
    parts, start = [], 0
    for i in range(1, len(cps) + 1):
        if i == len(cps) or cps[i] != cps[i - 1] + 1:
            lo, hi = re.escape(chr(cps[start])), re.escape(chr(cps[i - 1]))
            parts.append(lo if start == i - 1 else f"{lo}-{hi}")
            start = i
    return "".join(parts)


def _fast_words_re(blocks: frozenset[int]) -> re.Pattern[str]:
    """The folded pre-tokenizer for texts whose characters all lie in block 0 and `blocks`."""
    pattern = _FAST_RES.get(blocks)
    if pattern is not None:
        return pattern
    per_block = [_block_classes(b) for b in sorted(blocks | {0})]
    # "[^\s\S]" matches nothing: a class with no member in these blocks.
    c = {
        name: f"[{body}]" if (body := "".join(pb[name] for pb in per_block)) else "[^\\s\\S]"
        for name in per_block[0]
    }
    branches = (
        c["digit"] + "{1,3}",
        c["cjk"] + "+",
        _WORD_BRANCHES[0],  # ASCII only: kept as is
        c["lead"] + "?" + c["letter"] + "+",
        " ?" + c["punct"] + "+[\r\n]*",
        c["space"] + "*[\r\n]+",
        c["space"] + "+(?!" + c["nonspace"] + ")",
        c["space"] + "+",
        "(?:" + c["unmatched"] + "(?!" + c["letter"] + "))+",
    )
    pattern = re.compile("|".join(branches))
    if len(_FAST_RES) >= _FAST_RES_MAX:
        _FAST_RES.clear()
    _FAST_RES[blocks] = pattern
    return pattern


def _text_blocks(text: str) -> frozenset[int] | None:
    """The 256-code-point blocks above block 0 holding a character of `text`; None if the fast path
    should not be used (too many astral blocks, or lone surrogates, which have no UTF-8 form)."""
    try:
        text.encode("latin-1")  # a memcpy when every character is in block 0, the common case
        return frozenset()
    except UnicodeEncodeError:
        pass
    blocks = frozenset(ord(c) >> 8 for c in set(text))
    if sum(b >= 0x100 for b in blocks) > _FAST_MAX_ASTRAL_BLOCKS or not blocks.isdisjoint(range(0xD8, 0xE0)):
        return None
    return blocks - {0}


def _pretokenize_fast(text: str) -> list[str] | None:
    blocks = _text_blocks(text)
    return None if blocks is None else _fast_words_re(blocks).findall(text)


def pretokenize(text: str) -> list[str]:
    """Split text into the pieces BPE works on, exactly as the official Split x3 pre-tokenizer does."""
    if len(text) >= _FAST_MIN_CHARS:
        blocks = _text_blocks(text)
        if blocks is not None and (not blocks or blocks in _FAST_RES or len(text) >= _FAST_COMPILE_MIN_CHARS):
            return _fast_words_re(blocks).findall(text)
    return _pretokenize_generic(text)


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
        # The BPE model alone: one pre-tokenized piece, already in byte-level form, is one word. Its own
        # word cache is off: `_piece_ids` caches pieces, and the grouped calls below never repeat.
        self._bpe_model = models.BPE(
            vocab=self._id_of, merges=self._merges, fuse_unk=False, byte_fallback=False, cache_capacity=0
        )
        self._bpe_separator = self._find_bpe_separator()
        self._piece_ids: dict[str, bytes] = {}  # piece -> packed ids; pieces repeat (words, indentation)
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

    def _find_bpe_separator(self) -> tuple[bytes, int] | None:
        """A byte valid UTF-8 never holds whose byte-level character is a vocab entry found in no other
        entry, with that entry's id; None if there is none.

        Such a symbol never merges: a merge (A, B) needs A, B and A+B in the vocabulary, so one involving
        it would put its character inside another entry. Merges therefore never cross it, and BPE of pieces
        joined by it is, exactly, each piece's BPE with the separator's id in between (the merges inside
        each piece are the same ones, in the same relative order). Pieces never contain it (they are UTF-8).
        """
        everything = "\n".join(self.tokens)
        for byte in (0xC0, 0xC1, *range(0xF5, 0x100)):
            char = _BYTE_LEVEL_CHARS[byte]
            sep_id = self._id_of.get(char)
            if sep_id is not None and everything.count(char) == 1:
                return bytes([byte]), sep_id
        return None

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
        # A cached piece holds its ids packed as bytes, so a whole text is one bytes join and one array
        # conversion (on the novel ~0.12 s against ~0.17 s for chaining per-piece lists of ints).
        try:
            packed = b"".join(map(self._piece_ids.__getitem__, pieces))
        except KeyError:
            cache = self._add_pieces(pieces)
            packed = b"".join(map(cache.__getitem__, pieces))
        return array(_ID_TYPE, packed).tolist()

    def _add_pieces(self, pieces: list[str]) -> dict[str, bytes]:
        """BPE for the pieces not cached yet; returns a cache that holds all of `pieces`."""
        cache = self._piece_ids
        missing = set(pieces).difference(cache)
        if len(cache) + len(missing) > _PIECE_CACHE_MAX:
            # Bound memory by starting a fresh dict (never clearing one in use, so that a concurrent
            # caller holding the old dict still finds every piece it filled in).
            cache = self._piece_ids = {}
            missing = set(pieces)
        words = list(missing)
        if self._bpe_separator is None:
            tokenize = self._bpe_model.tokenize
            for piece, word in zip(words, _byte_level_many(words), strict=True):
                cache[piece] = array(_ID_TYPE, [t.id for t in tokenize(word)]).tobytes()
        else:
            self._add_grouped(words, cache, *self._bpe_separator)
        return cache

    def _add_grouped(self, words: list[str], cache: dict[str, bytes], sep: bytes, sep_id: int) -> None:
        """BPE of `words` in groups joined by the separator (see _find_bpe_separator), into `cache`.

        Each `tokenize` call costs ~5 us beyond its merges, as much as the merges of a typical piece, so
        one call per _BPE_GROUP pieces halves the cold cost (26k distinct pieces in the 1.33 MB novel:
        ~0.12 s instead of ~0.27 s). Measured and not kept: skipping BPE for pieces that are one vocab entry
        (BPE(t) == [t] holds for all 127,997 normal entries of this vocab, but only 7% of the novel's
        distinct pieces are one: no gain showed); one call for all pieces (a 250k-symbol word: slower);
        sorting pieces (no gain); threads (tokenize holds the GIL).
        """
        tokenize = self._bpe_model.tokenize
        utf8 = [w.encode("utf-8") for w in words]
        for k in range(0, len(words), _BPE_GROUP):
            joined = codecs.charmap_decode(sep.join(utf8[k : k + _BPE_GROUP]), "strict", _BYTE_LEVEL_CHARS)[0]
            ids = [t.id for t in tokenize(joined)]
            ids.append(sep_id)  # every piece now ends at a separator
            packed = array(_ID_TYPE, ids).tobytes()
            start = 0
            for piece in words[k : k + _BPE_GROUP]:
                end = ids.index(sep_id, start)
                cache[piece] = packed[_ID_BYTES * start : _ID_BYTES * end]
                start = end + 1
            if start != len(ids):  # a separator id inside a piece's tokens: the invariant above broke
                raise AssertionError(f"BPE group of {len(ids)} ids split at {start}: separator merged")

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
