"""The K3 tokenizer: tiktoken BPE + 256 reserved special ids (FORMAT.md "Tokenizer").

A model directory holds `tiktoken.model` (one `base64(token_bytes) rank` line per rank) and,
optionally, `tokenizer_config.json`. Special ids are `n_ranks + k` for k in 0..255: named from
the config's `added_tokens_decoder` (else from K3's table below), the rest
`<|reserved_token_{id}|>`. For K3 that is 163,584 ranks and ids 163584..163839.

    tiktoken.model --(parsed here, no tiktoken cache)--> ranks
    tokenizer_config.json --> special names, `special` flags, bos/eos, optional `pat_str`
    ranks + specials + pat_str --> tiktoken.Encoding

Pre-tokenizer. `tokenizer_config.json` MAY carry a `pat_str` field (an extension of this
runtime; the release has none). Without it the directory is read as K3 and `K3_PAT_STR` is used.
The tiny fixture declares its simpler ASCII split that way (`FIXTURE_PAT_STR`). Any other pattern
loads with a warning (the model was not trained on its split); one that does not cover a probe
text (it skips characters, or gives up backtracking) is refused, and every encode checks that
its pieces still cover the whole input, so text is never dropped silently.

The files are validated as strictly as the manifest (FORMAT.md "What the readers validate"):
TokenizerError names the file and the key or line; sizes are bounded before anything is built.

K3's `pat_str` intersects character classes (`[A&&[^\\p{Han}]]`). tiktoken's engine (fancy-regex
on the Rust `regex` crate) supports `&&`: tests/test_tokenizer.py probes tiktoken's actual split
and compares it with Python `regex` in V1 mode. `K3_PAT_STR_NO_INTERSECTION` is the same
language without `&&`, for engines that lack it. Derivation: the general categories
L{u,l,t,m,o}, M, N, P, S, Z, C partition every code point, so for A = Lu|Lt|Lm|Lo|M the
complement of A is Ll|N|P|S|Z|C and `A && [^Han]` = not(not-A or Han) =
`[^\\p{Ll}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}\\p{Han}]`; likewise B = Ll|Lm|Lo|M gives
`[^\\p{Lu}\\p{Lt}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}\\p{Han}]`. The equivalence is tested on a varied
corpus (Han, kana, Latin/Greek/Cyrillic case, titlecase, marks, contractions, digits,
punctuation runs, CR/LF runs).

Long inputs are encoded in slices of <= 400,000 characters, each split so that no run of
whitespace or non-whitespace exceeds 25,000 characters, as NeMo AutoModel does.
"""

from __future__ import annotations

import base64
import codecs
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import tiktoken

from ..checkpoint.config import load_json, short_repr
from ..files import InputError, read_regular

log = logging.getLogger(__name__)

NUM_SPECIAL_IDS = 256
# K3's tiktoken.model is about 2.4 MB and 163,584 ranks; tiktoken holds ~450 B per rank, so the
# bounds keep a hostile file under ~250 MB of memory.
MAX_RANKS_BYTES = 16 * 2**20
MAX_RANKS = 1 << 19
MAX_PAT_CHARS = 4096
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

_AND = "&" * 2  # class intersection, kept out of literal text so tools do not mangle it
_CONTRACTION = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
_K3_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}" + _AND + r"[^\p{Han}]]"
_K3_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}" + _AND + r"[^\p{Han}]]"
_NI_UPPER = r"[^\p{Ll}\p{N}\p{P}\p{S}\p{Z}\p{C}\p{Han}]"
_NI_LOWER = r"[^\p{Lu}\p{Lt}\p{N}\p{P}\p{S}\p{Z}\p{C}\p{Han}]"


def _k3_pattern(upper: str, lower: str) -> str:
    return "|".join(
        [
            r"[\p{Han}]+",
            r"[^\r\n\p{L}\p{N}]?" + upper + "*" + lower + "+" + _CONTRACTION,
            r"[^\r\n\p{L}\p{N}]?" + upper + "+" + lower + "*" + _CONTRACTION,
            r"\p{N}{1,3}",
            r" ?[^\s\p{L}\p{N}]+[\r\n]*",
            r"\s*[\r\n]+",
            r"\s+(?!\S)",
            r"\s+",
        ]
    )


K3_PAT_STR = _k3_pattern(_K3_UPPER, _K3_LOWER)  # the literal text of tokenization_kimi.py
K3_PAT_STR_NO_INTERSECTION = _k3_pattern(_NI_UPPER, _NI_LOWER)
# The tiny fixtures' split: ASCII-only GPT-2 style, read alike by Python's `re` (training) and
# tiktoken's fancy-regex (encoding). K3's real pattern needs `&&` class intersection.
FIXTURE_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"""
# The pre-tokenizers this runtime knows for the tiktoken family (K3): any other is used loudly.
KNOWN_PAT_STRS = {K3_PAT_STR: "K3's", K3_PAT_STR_NO_INTERSECTION: "K3's (without &&)",
                  FIXTURE_PAT_STR: "the tiny fixtures'"}
# Text every pre-tokenizer must split into pieces that cover it: letters of several scripts
# and cases, marks, digits, punctuation runs, every kind of whitespace and line end.
PROBE_TEXT = ("Hello, World! It's 2024: naïve café ÆØÅ ΣΑΣ Привет 中文字符 カタカナ 한국어 "
              "e\u0301 \u00a0\t\r\n\n  x\u3000y 12345 3.14 --> (a+b)*c; 🙂 \u200b end.\n")

# Named special ids as offsets from the first special id (FORMAT.md "Tokenizer"); used when a
# directory has no tokenizer_config.json. Offsets, not ids, so any rank count maps them like K3.
K3_NAMED_SPECIALS: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}
# XTML markers are special ids with `"special": false`: skip_special keeps them.
K3_NOT_SKIPPED = frozenset({"<|open|>", "<|close|>", "<|sep|>"})
END_OF_MSG = "<|end_of_msg|>"
EOS = "[EOS]"
# End of turn (K3's `<|end_of_msg|>`, Kimi K2's `<|im_end|>`) and end of document stop generation.
IM_END = "<|im_end|>"  # Kimi K2's end of turn, at the id where K3 has <|end_of_msg|>
STOP_NAMES = (END_OF_MSG, IM_END, EOS)


class TokenizerError(InputError):
    """A tokenizer file that cannot be used as claimed; the message names the file and the key
    or line (a ValueError, like every loader's error)."""


def read_ranks(path: str | Path, *, root: str | Path | None = None) -> dict[bytes, int]:
    """Parse a tiktoken BPE file (`base64 rank` per line) without tiktoken's path-keyed cache:
    ranks 0..n-1 each once (n <= MAX_RANKS), distinct non-empty tokens, every single byte
    among them (tiktoken's encoder panics on a piece it cannot reduce to ranked tokens)."""
    ranks: dict[bytes, int] = {}
    # A regular file opened without blocking (a FIFO or directory is refused, naming it).
    raw = read_regular(path, limit=MAX_RANKS_BYTES, root=root, error=TokenizerError,
                       what="tokenizer file")
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            tok = base64.b64decode(fields[0], validate=True) if len(fields) == 2 else b""
        except ValueError:
            tok = b""
        if not tok or not (fields[1].isdigit() and len(fields[1]) <= 9):
            raise TokenizerError(f"{path}:{n}: not a `base64 rank` line")
        if tok in ranks:
            raise TokenizerError(f"{path}:{n}: token {tok[:40]!r} has a rank already")
        if len(ranks) == MAX_RANKS:
            raise TokenizerError(f"{path}:{n}: more than {MAX_RANKS} ranks")
        ranks[tok] = int(fields[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: no rank for byte 0x{missing[0]:02x} ({len(missing)} of "
                             "the 256 single bytes missing); a byte-level BPE ranks them all")
    return ranks


def split_long_text(
    text: str, max_chars: int = MAX_ENCODE_CHARS, max_run: int = MAX_RUN_CHARS
) -> Iterator[str]:
    """Slices of <= max_chars characters, each cut so no whitespace/non-whitespace run exceeds
    max_run (FORMAT.md "Tokenizer")."""
    for i in range(0, len(text), max_chars):
        s = text[i : i + max_chars]
        run, is_space, start = 0, s[:1].isspace(), 0
        for j, ch in enumerate(s):
            now = ch.isspace()
            if now != is_space:
                run, is_space = 1, now
            else:
                run += 1
                if run > max_run:
                    yield s[start:j]
                    start, run = j, 1
        yield s[start:]


@dataclass(frozen=True)
class SpecialToken:
    id: int
    text: str
    skipped: bool  # `"special": true` in the config: dropped by decode(skip_special=True)


class Tokenizer:
    """Encode/decode for one model directory. Build with `load_tokenizer`."""

    def __init__(
        self,
        ranks: dict[bytes, int],
        specials: list[SpecialToken],
        pat_str: str,
        bos: str = "[BOS]",
        eos: str = EOS,
        name: str = "k3",
        source: str = "",
    ):
        self.n_ranks = len(ranks)
        self.pat_str = pat_str
        self.source = source or name  # what errors name: the file the pattern came from
        self.specials = specials
        self._by_name = {s.text: s.id for s in specials}
        self._skipped = frozenset(s.id for s in specials if s.skipped)
        self._enc = tiktoken.Encoding(
            name=name,
            pat_str=pat_str,
            mergeable_ranks=ranks,
            special_tokens=dict(self._by_name),
            explicit_n_vocab=self.n_ranks + len(specials),
        )
        self.bos_id = self.special(bos)
        self.eos_id = self.special(eos)
        # A Jinja chat template (the DeepSeek-V3 family's Kimi K2), set by the loader; K3 chats
        # are rendered natively (engine/chat.py).
        self.chat_template: str | None = None
        # Both end-of-turn and end-of-document stop generation (FORMAT.md "Tokenizer").
        self.stop_ids = frozenset({*(self._by_name[n] for n in STOP_NAMES if n in self._by_name),
                                   self.eos_id})

    @property
    def vocab_size(self) -> int:
        return self.n_ranks + len(self.specials)

    def special(self, name: str) -> int:
        """Id of a special token by its text (e.g. "<|open|>", "[BOS]"); KeyError if none."""
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no special token {name!r}") from None

    def is_special(self, token_id: int) -> bool:
        return token_id >= self.n_ranks

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """BPE ids of `text`. Special-token text is ordinary text unless allow_special."""
        out: list[int] = []
        for piece in split_long_text(text):
            try:
                ids = self._enc.encode(piece, allowed_special="all" if allow_special else set(),
                                       disallowed_special=())
            except ValueError as e:  # the regex engine's: e.g. its backtracking limit
                raise TokenizerError(f"{self.source}: pat_str cannot split this text: {e}"
                                     ) from None
            # A pre-tokenizer that skips characters (or gives up backtracking silently) yields
            # pieces that do not cover the text: refuse rather than compute on other text.
            got, want = len(self._enc.decode_bytes(ids)), len(piece.encode("utf-8", "replace"))
            if got != want:
                raise TokenizerError(f"{self.source}: pat_str split a {len(piece)}-character "
                                     f"text into pieces covering {got} of its {want} bytes; "
                                     "the pre-tokenizer cannot encode this text")
            out.extend(ids)
        return out

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        ids = [int(t) for t in ids]
        if skip_special:
            ids = [t for t in ids if t not in self._skipped]
        return self._enc.decode_bytes(ids)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 replaced). skip_special drops special ids marked
        `special: true` and keeps `<|open|>`, `<|close|>`, `<|sep|>`."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)


class StreamDecoder:
    """Incremental detokenisation: `push(id)` returns the text that is complete so far, holding
    back the bytes of a UTF-8 character split across tokens; `flush()` ends the stream."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.decode_bytes([token_id], self._skip))

    def flush(self) -> str:
        """Text for any held-back bytes (an incomplete character becomes U+FFFD); resets."""
        return self._utf8.decode(b"", final=True)


def _config_specials(config: dict, n_ranks: int, where: Path) -> list[SpecialToken]:
    """The 256 special ids after the ranks, named from `added_tokens_decoder` (an object of
    decimal id -> {"content": name, "special": bool}) or, without one, K3's table."""
    decoder = config.get("added_tokens_decoder")
    if decoder is None:
        named = {n_ranks + k: (v, v not in K3_NOT_SKIPPED) for k, v in K3_NAMED_SPECIALS.items()}
    else:
        if not isinstance(decoder, dict):
            raise TokenizerError(f"{where}: added_tokens_decoder must be an object of id -> "
                                 f"token, got {type(decoder).__name__}")
        named = {}
        for i, d in decoder.items():
            key = f"added_tokens_decoder[{i[:20]!r}]"
            if not (i.isdigit() and len(i) <= 9):
                raise TokenizerError(f"{where}: {key}: the id must be a decimal integer")
            if not (isinstance(d, dict) and isinstance(d.get("content"), str) and d["content"]
                    and isinstance(d.get("special", True), bool)):
                raise TokenizerError(f"{where}: {key}: must be an object with a non-empty "
                                     "string content and an optional boolean special")
            named[int(i)] = (d["content"], d.get("special", True))
    last = n_ranks + NUM_SPECIAL_IDS
    outside = sorted(i for i in named if not n_ranks <= i < last)
    if outside:
        raise TokenizerError(f"{where}: added_tokens_decoder: ids {outside[:8]} are not special "
                             f"ids {n_ranks}..{last - 1}")
    out = [
        SpecialToken(i, *named.get(i, (f"<|reserved_token_{i}|>", True)))
        for i in range(n_ranks, last)
    ]
    if len({s.text for s in out}) != len(out):
        raise TokenizerError(f"{where}: added_tokens_decoder: special token names are not "
                             "unique")
    moved = [v for k, v in K3_NAMED_SPECIALS.items() if named.get(n_ranks + k, (None,))[0] != v]
    # Kimi K2's names differ by design: its chats render through its own template.
    if moved and named.get(n_ranks + 2, (None,))[0] != IM_END:
        log.warning("%s: special tokens %s are not where K3 has them (first special id + %s; "
                    "missing or at another id): this runtime runs K3's chat format with K3's "
                    "ids", where, moved[:4],
                    [k for k, v in K3_NAMED_SPECIALS.items() if v in moved][:4])
    return out


def _token_name(config: dict, key: str, default: str, names: set[str], where: Path) -> str:
    """The special token `config[key]` names (a string or a serialized AddedToken)."""
    value = config.get(key)
    if value is None:
        value = default
    elif isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str) or value not in names:
        raise TokenizerError(f"{where}: {key} {short_repr(value)} is not one of the special tokens")
    return value


def _pattern(config: dict, where: Path) -> str:
    """The pre-tokenizer: K3's without a `pat_str`; any other than the known ones is used with
    a warning (the model's own split is the one it was trained on)."""
    pat = config.get("pat_str")
    if pat is None:
        return K3_PAT_STR
    if not isinstance(pat, str) or not pat or len(pat) > MAX_PAT_CHARS:
        raise TokenizerError(f"{where}: pat_str must be a non-empty string of at most "
                             f"{MAX_PAT_CHARS} characters, got {short_repr(pat)}")
    if pat not in KNOWN_PAT_STRS:
        log.warning("%s: pat_str is not a pre-tokenizer this runtime knows (%s): text will be "
                    "split as it says, not as K3 splits it", where,
                    ", ".join(KNOWN_PAT_STRS.values()))
    return pat


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Tokenizer of a model directory. Kinds by file: `tiktoken.model` (+ optional
    `tokenizer_config.json`): the K3 family's tiktoken BPE. Raises TokenizerError (a
    ValueError) naming the file and key; every file is read inside the directory."""
    return _load_tiktoken(Path(model_dir))


def _load_tiktoken(root: Path) -> Tokenizer:
    ranks = read_ranks(root / "tiktoken.model", root=root)
    cfg_path = root / "tokenizer_config.json"
    config = (load_json(cfg_path, root=root, error=TokenizerError)
              if os.path.lexists(cfg_path) else {})
    if not isinstance(config, dict):
        raise TokenizerError(f"{cfg_path}: not a JSON object")
    specials = _config_specials(config, len(ranks), cfg_path)
    names = {s.text for s in specials}
    # the stop ids: an end of turn (K3's chat format or Kimi K2's) and the end of document
    for need in ((END_OF_MSG, IM_END), (EOS,)):
        if not names & set(need):
            raise TokenizerError(f"{cfg_path}: added_tokens_decoder names no "
                                 f"{' or '.join(need)} (a stop token of K3's or Kimi K2's chat "
                                 "format)")
    pat_str = _pattern(config, cfg_path)
    bos = _token_name(config, "bos_token", "[BOS]", names, cfg_path)
    eos = _token_name(config, "eos_token", EOS, names, cfg_path)
    try:
        tok = Tokenizer(ranks, specials, pat_str=pat_str, bos=bos, eos=eos,
                        name=f"tiktoken:{root.name}", source=str(cfg_path))
    except ValueError as e:  # tiktoken's: a pat_str its regex engine cannot compile
        raise TokenizerError(f"{cfg_path}: pat_str is not a usable pattern: {e}") from None
    tok.encode(PROBE_TEXT)  # a pattern that skips characters fails here, at load
    return tok
