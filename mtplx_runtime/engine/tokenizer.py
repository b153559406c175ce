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
The tiny fixture declares its simpler ASCII split that way.

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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import tiktoken

from ..checkpoint.config import load_json
from ..files import read_regular

NUM_SPECIAL_IDS = 256
MAX_RANKS_BYTES = 256 * 2**20  # K3's tiktoken.model is about 2.4 MB
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


def read_ranks(path: str | Path, *, root: str | Path | None = None) -> dict[bytes, int]:
    """Parse a tiktoken BPE file (`base64 rank` per line) without tiktoken's path-keyed cache."""
    ranks: dict[bytes, int] = {}
    # A regular file opened without blocking (a FIFO or directory is a ValueError naming it).
    raw = read_regular(path, limit=MAX_RANKS_BYTES, root=root, error=ValueError,
                       what="tokenizer file")
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not a `base64 rank` line") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once")
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
    ):
        self.n_ranks = len(ranks)
        self.pat_str = pat_str
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
        # Both end-of-turn and end-of-document stop generation (FORMAT.md "Tokenizer").
        self.stop_ids = frozenset({self.special(END_OF_MSG), self.special(EOS), self.eos_id})

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
            if allow_special:
                out.extend(self._enc.encode(piece, allowed_special="all"))
            else:
                out.extend(self._enc.encode(piece, disallowed_special=()))
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


def _config_specials(config: dict, n_ranks: int) -> list[SpecialToken]:
    decoder = config.get("added_tokens_decoder")
    if decoder is None:
        named = {n_ranks + k: (v, v not in K3_NOT_SKIPPED) for k, v in K3_NAMED_SPECIALS.items()}
    else:
        named = {int(i): (d["content"], bool(d.get("special", True))) for i, d in decoder.items()}
    last = n_ranks + NUM_SPECIAL_IDS
    outside = sorted(i for i in named if not n_ranks <= i < last)
    if outside:
        raise ValueError(f"added tokens {outside} are not special ids {n_ranks}..{last - 1}")
    out = [
        SpecialToken(i, *named.get(i, (f"<|reserved_token_{i}|>", True)))
        for i in range(n_ranks, last)
    ]
    if len({s.text for s in out}) != len(out):
        raise ValueError("special token names are not unique")
    return out


def _token_name(value: object, default: str) -> str:
    if value is None:
        return default
    if isinstance(value, dict):  # serialized AddedToken
        return str(value["content"])
    return str(value)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Tokenizer of a model directory (`tiktoken.model` + optional `tokenizer_config.json`)."""
    root = Path(model_dir)
    ranks = read_ranks(root / "tiktoken.model")
    cfg_path = root / "tokenizer_config.json"
    config = load_json(cfg_path) if cfg_path.exists() else {}  # ValueError naming the file
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_path}: not a JSON object")
    return Tokenizer(
        ranks,
        _config_specials(config, len(ranks)),
        pat_str=config.get("pat_str") or K3_PAT_STR,
        bos=_token_name(config.get("bos_token"), "[BOS]"),
        eos=_token_name(config.get("eos_token"), EOS),
        name=f"tiktoken:{root.name}",
    )
