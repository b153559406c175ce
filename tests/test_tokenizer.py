"""K3 tokenizer (FORMAT.md "Tokenizer"): file parsing, special ids, pre-tokenizer, slicing,
special-text handling, decode with skip, streaming detokenisation.

Two vocabularies: the tiny fixture's (written by `fixtures.tokenizer.write_tokenizer`, ASCII
split) and a synthetic K3-like one (fixture ranks plus whole-word tokens, config declaring K3's
`pat_str`), whose special ids sit at n_ranks + k exactly as K3's 163584.. do.
"""

from __future__ import annotations

import base64
import functools
import json

import pytest
import regex
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from mtplx_runtime.engine import tokenizer as tkz
from mtplx_runtime.engine.tokenizer import (
    K3_PAT_STR,
    K3_PAT_STR_NO_INTERSECTION,
    load_tokenizer,
    read_ranks,
    split_long_text,
)
from mtplx_runtime.fixtures import tokenizer as fx

# Words the K3-like vocabulary holds as single tokens, so chat layouts have K3-like id counts.
K3_LIKE_WORDS = [
    "message", " role", '="', '"', "user", "assistant", "system", "think", "response",
    "Hi", " type", "tools", "call", " tool", " index", "argument", " key", " name", "json",
]  # fmt: skip


def _write_ranks(path, ranks: dict[bytes, int]) -> None:
    lines = [
        f"{base64.b64encode(t).decode()} {r}\n"
        for t, r in sorted(ranks.items(), key=lambda x: x[1])
    ]
    path.write_text("".join(lines))


def write_k3_like(out_dir, pat_str: str | None = K3_PAT_STR) -> int:
    """A K3-shaped tokenizer dir: fixture ranks + every substring of K3_LIKE_WORDS (so each word
    BPE-merges to one token), specials at n_ranks + k named as in K3's tokenizer_config."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = fx.build_tiny_ranks()
    for word in K3_LIKE_WORDS:
        b = word.encode()
        subs = sorted({b[i:j] for i in range(len(b)) for j in range(i + 1, len(b) + 1)}, key=len)
        for s in subs:
            ranks.setdefault(s, len(ranks))
    _write_ranks(out_dir / "tiktoken.model", ranks)
    cfg = fx.tokenizer_config(len(ranks))
    if pat_str is not None:
        cfg["pat_str"] = pat_str
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    return len(ranks)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_tok")
    fx.write_tokenizer(d)
    return load_tokenizer(d)


@pytest.fixture(scope="module")
def k3like(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3_tok")
    write_k3_like(d)
    return load_tokenizer(d)


CORPUS = [
    "Hello World! I'm here; DON'T panic, we'll see. They've gone, you'd know, it's OK's.",
    "中文字符和English混合ab中文 漢字abc 々〇 가나다 カタカナ ひらがな",
    "Ünïcödé ΑΒΓδεζ Привет МИР ǅungla ǈj NAÏVE café\u0301 e\u0301e\u0300",
    "digits 1 12 123 1234 12345678 ٣٤٥ ５６７ 3.14159 -42",
    "punct !!! ... ??? --> ===\n\n\r\n  (x) [y] {z} <|open|> `code` $$ %% && ||",
    "lines\n\n\nand   spaces   \t\ttabs\r\r\n end  ",
    "mixed CamelCase iPhone HTTPServer getHTTPResponse ABCdef abcDEF 'S 'LL",
    "  leading and trailing   \n",
]


def _tiktoken_pieces(pat: str, text: str, max_len: int = 40) -> list[str]:
    """The pieces tiktoken's own regex engine splits `text` into. Probe vocabulary: every
    substring of the text up to max_len bytes, ranked by length, so BPE merges each piece into
    exactly one token and never across pieces."""
    b = text.encode()
    subs = {b[i:j] for i in range(len(b)) for j in range(i + 1, min(len(b), i + max_len) + 1)}
    toks = sorted(subs | {bytes([i]) for i in range(256)}, key=lambda t: (len(t), t))
    ranks = {t: r for r, t in enumerate(toks)}
    enc = tiktoken.Encoding("probe", pat_str=pat, mergeable_ranks=ranks, special_tokens={})
    return [enc.decode_single_token_bytes(t).decode() for t in enc.encode_ordinary(text)]


# ---- files, special ids ---------------------------------------------------------------------


def test_tiny_fixture_loads(tiny):
    n = fx.TARGET_RANKS
    assert (tiny.n_ranks, tiny.vocab_size) == (n, n + 256)
    for k, name in fx.NAMED_SPECIALS.items():
        assert tiny.special(name) == n + k == fx.special_id(name, n)
    assert tiny.special(f"<|reserved_token_{n + 8}|>") == n + 8
    assert tiny.bos_id == n + 0
    assert tiny.stop_ids == {n + 2, n + 1}  # <|end_of_msg|> and [EOS], both
    with pytest.raises(KeyError):
        tiny.special("<|im_end|>")  # K3 has no <|im_*|> tokens


def test_k3_like_layout_mirrors_k3(k3like):
    n = k3like.n_ranks
    assert k3like.pat_str == K3_PAT_STR
    # K3: 163584 [BOS], 163585 [EOS], 163586 <|end_of_msg|>, ..., 163839 [PAD]
    offsets = {"[BOS]": 0, "[EOS]": 1, "<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4}
    offsets |= {"<|sep|>": 5, "[EOT]": 9, "<|media_pad|>": 21, "<osagent_mode>": 65, "[PAD]": 255}
    for name, k in offsets.items():
        assert k3like.special(name) == n + k
    assert k3like.stop_ids == {n + 1, n + 2}
    for w in K3_LIKE_WORDS:
        assert len(k3like.encode(w)) == 1, w


def test_k3_defaults_without_config(tmp_path):
    """No tokenizer_config.json: K3's named table and K3's pat_str."""
    _write_ranks(tmp_path / "tiktoken.model", fx.build_tiny_ranks())
    tok = load_tokenizer(tmp_path)
    n = tok.n_ranks
    assert tok.pat_str == K3_PAT_STR
    assert (tok.special("[BOS]"), tok.special("<|end_of_msg|>"), tok.special("[PAD]")) == (
        n,
        n + 2,
        n + 255,
    )
    assert tok.decode([n + 3, n + 2], skip_special=True) == "<|open|>"


def test_config_pat_str_is_used(tmp_path):
    fx.write_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.pat_str == fx.PAT_STR  # the fixture declares its own pre-tokenizer
    assert tok.decode(tok.encode(CORPUS[0])) == CORPUS[0]
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["pat_str"]  # as in K3's release: no pattern declared means K3's
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(tmp_path).pat_str == K3_PAT_STR


def test_rewritten_file_is_not_stale(tmp_path):
    """The rank file is parsed on every load (tiktoken's loader caches by path)."""
    ranks = fx.build_tiny_ranks()
    _write_ranks(tmp_path / "tiktoken.model", ranks)
    assert load_tokenizer(tmp_path).vocab_size == len(ranks) + 256
    ranks[b"zzzz"] = len(ranks)
    ranks[b"zzzzz"] = len(ranks)
    _write_ranks(tmp_path / "tiktoken.model", ranks)
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == len(ranks) + 256 and tok.special("[BOS]") == len(ranks)


def test_read_ranks_rejects_bad_files(tmp_path):
    p = tmp_path / "tiktoken.model"
    p.write_text("YQ== 0\nYg== 2\n")
    with pytest.raises(ValueError, match="ranks"):
        read_ranks(p)
    p.write_text("YQ== 0\nnot-a-line\n")
    with pytest.raises(ValueError, match=":2:"):
        read_ranks(p)


# ---- encode / decode ------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny", "k3like"])
def test_round_trip(which, request):
    tok = request.getfixturevalue(which)
    for text in CORPUS:
        ids = tok.encode(text)
        assert all(0 <= t < tok.n_ranks for t in ids)
        assert tok.decode(ids) == text


@pytest.mark.parametrize("which", ["tiny", "k3like"])
def test_special_text_not_recognised_by_default(which, request):
    tok = request.getfixturevalue(which)
    text = "a<|open|>b<|end_of_msg|>[BOS]"
    plain = tok.encode(text)
    assert all(t < tok.n_ranks for t in plain) and tok.decode(plain) == text
    op, eom, bos = tok.special("<|open|>"), tok.special("<|end_of_msg|>"), tok.special("[BOS]")
    assert tok.encode(text, allow_special=True) == [
        *tok.encode("a"), op, *tok.encode("b"), eom, bos
    ]  # fmt: skip


def test_decode_skip_special_keeps_xtml_markers(tiny):
    s = tiny.special
    ids = [s("[BOS]"), s("<|open|>"), *tiny.encode("x"), s("<|sep|>"), s("<|close|>")]
    ids += [s("<|end_of_msg|>"), s("[EOS]"), tiny.n_ranks + 100]
    assert tiny.decode(ids, skip_special=True) == "<|open|>x<|sep|><|close|>"
    assert tiny.decode(ids) == (
        f"[BOS]<|open|>x<|sep|><|close|><|end_of_msg|>[EOS]<|reserved_token_{tiny.n_ranks + 100}|>"
    )


# ---- pre-tokenizer --------------------------------------------------------------------------


def test_tiktoken_supports_class_intersection():
    """tiktoken's engine reads `&&` as intersection: "ab中文" is two pieces. Were `&&` a
    literal/union, the letter classes would swallow Han and give one piece."""
    assert "&&" in K3_PAT_STR and "&&" not in K3_PAT_STR_NO_INTERSECTION
    assert _tiktoken_pieces(K3_PAT_STR, "ab中文 Cd") == ["ab", "中文", " Cd"]


@pytest.mark.parametrize("text", CORPUS)
def test_pattern_equivalence_on_corpus(text):
    reference = regex.findall(K3_PAT_STR, text, flags=regex.V1)  # V1: `&&` is intersection
    assert "".join(reference) == text
    assert regex.findall(K3_PAT_STR_NO_INTERSECTION, text) == reference
    assert _tiktoken_pieces(K3_PAT_STR, text) == reference
    assert _tiktoken_pieces(K3_PAT_STR_NO_INTERSECTION, text) == reference


_CHARS = st.sampled_from(list("aZ ǅ\n\r\t'0٣５中漢々〇가カé\u0301!.-_\"ΑβЖ ")) | st.characters(
    codec="utf-8"
)


@settings(max_examples=300, deadline=None)
@given(st.text(_CHARS, max_size=40))
def test_pattern_equivalence_random(text):
    assert regex.findall(K3_PAT_STR_NO_INTERSECTION, text) == regex.findall(
        K3_PAT_STR, text, flags=regex.V1
    )


def test_k3_split_examples(k3like):
    pieces = regex.findall(K3_PAT_STR, "Hello 中文 I'M 12345\n\n", flags=regex.V1)
    assert pieces == ["Hello", " ", "中文", " I'M", " ", "123", "45", "\n\n"]
    assert k3like.decode(k3like.encode("Hello 中文 I'M 12345\n\n")) == "Hello 中文 I'M 12345\n\n"


# ---- long inputs ----------------------------------------------------------------------------


def test_split_long_text_limits():
    text = "aaaaaaa bb" + " " * 9 + "cccccccccccc\n" + "d" * 30
    pieces = list(split_long_text(text, max_chars=20, max_run=5))
    assert "".join(pieces) == text
    for p in pieces:
        assert len(p) <= 20
        assert all(len(run) <= 5 for run in regex.findall(r"\s+|\S+", p))
    assert list(split_long_text("")) == []
    assert list(split_long_text("abc")) == ["abc"]


def test_encode_uses_slices(tiny, monkeypatch):
    small = functools.partial(split_long_text, max_chars=16, max_run=6)
    monkeypatch.setattr(tkz, "split_long_text", small)
    text = "the model reads one token at a time   and writes"
    expected = [t for piece in small(text) for t in tiny._enc.encode_ordinary(piece)]
    assert tiny.encode(text) == expected
    assert tiny.decode(expected) == text


def test_default_slice_limits(tiny):
    assert (tkz.MAX_ENCODE_CHARS, tkz.MAX_RUN_CHARS) == (400_000, 25_000)
    text = "ab" * 12_600  # one 25,200-char non-whitespace run: cut at 25,000
    pieces = list(split_long_text(text))
    assert [len(p) for p in pieces] == [25_000, 200]
    assert tiny.encode(text) == tiny.encode(pieces[0]) + tiny.encode(pieces[1])


# ---- streaming detokenisation ---------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny", "k3like"])
def test_stream_decoder_never_splits_characters(which, request):
    tok = request.getfixturevalue(which)
    text = "héllo 中文字 🙂 ok ΑΒΓ\n"
    ids = tok.encode(text)
    # the vocabularies are ASCII-trained: multi-byte characters span several tokens
    assert any(len(tok.decode_bytes([t]).decode("utf-8", "ignore")) == 0 for t in ids)
    dec = tok.stream_decoder()
    chunks = [dec.push(t) for t in ids]
    assert "" in chunks and not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) + dec.flush() == text


def test_stream_decoder_specials_and_flush(tiny):
    s = tiny.special
    dec = tiny.stream_decoder(skip_special=True)
    out = "".join(dec.push(t) for t in [s("[BOS]"), *tiny.encode("a"), s("<|open|>"),
                                        s("<|end_of_msg|>")])
    assert out == "a<|open|>"
    partial = "中".encode()[:2]
    assert "".join(dec.push(t) for t in tiny.encode("x") + [partial[0], partial[1]]) == "x"
    assert dec.flush() == "\ufffd"


# ---- hostile files (FORMAT.md "What the readers validate"): TokenizerError naming file and key --


def _tiny_dir(tmp_path, **changes):
    """The fixture tokenizer with `tokenizer_config.json` changed: `key=value` replaces,
    `key_=value` merges entries into the object at `key`."""
    fx.write_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for k, v in changes.items():
        if k.endswith("_"):
            cfg[k[:-1]].update(v)
        else:
            cfg[k] = v
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


N = fx.TARGET_RANKS


@pytest.mark.parametrize("changes, match", [
    ({"added_tokens_decoder": []}, "added_tokens_decoder must be an object"),
    ({"added_tokens_decoder": {str(N + 70): "s"}}, r"added_tokens_decoder\['\d+'\]: must be"),
    ({"added_tokens_decoder": {str(N + 1): {"special": True}}}, "non-empty string content"),
    ({"added_tokens_decoder": {"x1": {"content": "a"}}}, "the id must be a decimal integer"),
    ({"added_tokens_decoder_": {str(N + 9): {"content": "<|end_of_msg|>"}}}, "not unique"),
    ({"added_tokens_decoder_": {str(N + 300): {"content": "x"}}}, r"ids \[812\] are not special"),
    ({"added_tokens_decoder": {str(N): {"content": "[BOS]"}, str(N + 1): {"content": "[EOS]"}}},
     "names no <|end_of_msg|>"),
    ({"bos_token": {}}, "bos_token None is not one of the special tokens"),
    ({"eos_token": "<|im_end|>"}, "eos_token '<|im_end|>' is not one of the special tokens"),
    ({"eos_token": [1]}, "eos_token"),
    ({"pat_str": 5}, "pat_str must be a non-empty string"),
    ({"pat_str": "("}, "pat_str is not a usable pattern"),
    ({"pat_str": "[A-Za-z]+"}, "pat_str split a"),  # drops spaces and punctuation
])
def test_bad_tokenizer_config_is_refused_naming_the_key(tmp_path, changes, match):
    d = _tiny_dir(tmp_path, **changes)
    with pytest.raises(tkz.TokenizerError, match=match) as e:
        load_tokenizer(d)
    assert "tokenizer_config.json" in str(e.value)


def test_an_unknown_pattern_is_loud_and_one_that_drops_text_fails_encode(tmp_path, caplog):
    # Both cover the probe text. The first backtracks past the regex engine's limit on a long
    # run of 'a's (an error from deep inside tiktoken); the second matches nothing there, so
    # tiktoken returns no pieces at all (the text would vanish).
    for pat, why in [(r"(?:a|aa)+(?=\s|$)(?!x)|\s+|[^\s]", "pat_str cannot split this text"),
                     (r"(?:[^a\s]|a(?!aaaa))+|\s+", "pat_str split")]:
        tok = load_tokenizer(_tiny_dir(tmp_path, pat_str=pat))
        assert "pat_str is not a pre-tokenizer this runtime knows" in caplog.text
        assert tok.decode(tok.encode("a banana")) == "a banana"
        with pytest.raises(tkz.TokenizerError, match=f"tokenizer_config.json: {why}"):
            tok.encode("a" * 5000 + "b")


def test_rank_files_the_encoder_could_not_use_are_refused(tmp_path):
    ranks = fx.build_tiny_ranks()
    del ranks[b"\x07"]
    ordered = sorted(ranks, key=ranks.get)
    _write_ranks(tmp_path / "tiktoken.model", {t: i for i, t in enumerate(ordered)})
    with pytest.raises(tkz.TokenizerError, match=r"no rank for byte 0x07.*256 single bytes"):
        load_tokenizer(tmp_path)  # tiktoken once panicked at the first encode instead
    p = tmp_path / "tiktoken.model"
    p.write_text("YQ== 0\nYQ== 1\n")
    with pytest.raises(tkz.TokenizerError, match=":2: token b'a' has a rank already"):
        read_ranks(p)
    p.write_text("YQ== +1\n")
    with pytest.raises(tkz.TokenizerError, match=":1: not a `base64 rank` line"):
        read_ranks(p)
    with open(p, "wb") as f:  # sparse: the size cap refuses it before reading
        f.truncate(tkz.MAX_RANKS_BYTES + 1)
    with pytest.raises(tkz.TokenizerError, match="size cap for the tokenizer file"):
        read_ranks(p)


def test_special_ids_elsewhere_than_k3s_are_loud(tmp_path, caplog):
    dec = {str(N + k): {"content": name, "special": True}
           for k, name in fx.NAMED_SPECIALS.items()}
    dec[str(N + 3)], dec[str(N + 4)] = dec[str(N + 4)], dec[str(N + 3)]  # <|open|>, <|close|>
    tok = load_tokenizer(_tiny_dir(tmp_path, added_tokens_decoder=dec))
    assert tok.special("<|open|>") == N + 4
    assert "are not where K3 has them" in caplog.text and "<|open|>" in caplog.text
