"""A Hugging Face `tokenizer.json` tokenizer (DeepSeek-V3/R1 ship one) behind the interface of the
tiktoken one (engine/tokenizer.py): encode, decode, decode_bytes, stream_decoder, special,
is_special, vocab_size, bos_id, eos_id, stop_ids (FORMAT.md "Tokenizers of the DeepSeek-V3
family"); `model_tokenizer` picks a model directory's tokenizer of the two.

    tokenizer.json --(the `tokenizers` library)--> model, pre-tokenizer, added tokens
    tokenizer_config.json --> bos / eos token;  generation_config.json --> more stop ids

Encoding and decoding are the `tokenizers` library's own (an optional dependency: without it a
directory with only `tokenizer.json` is a one-line error saying what to install). Special-token
text in a prompt is ordinary text unless `allow_special`, as with the tiktoken tokenizer. Byte-level
BPE vocabularies (DeepSeek's) decode to exact bytes, so a UTF-8 character split across tokens
streams correctly; other decoders decode per token to text.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..checkpoint.config import load_json
from ..files import read_regular
from .tokenizer import SpecialToken, StreamDecoder, Tokenizer, TokenizerError, load_tokenizer

MAX_TOKENIZER_BYTES = 256 * 2**20  # DeepSeek-V3's tokenizer.json is about 7.8 MB
FILE = "tokenizer.json"


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character -> the byte it stands for (the GPT-2 table:
    printable Latin-1 bytes stand for themselves, the rest map to 256, 257, ... in order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class HFTokenizer:
    """Encode/decode for a directory with `tokenizer.json`. Build with `load_tokenizer`."""

    def __init__(self, path: Path, config: dict, stop_ids: Iterable[int] = ()):
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:
            raise TokenizerError(f"{path}: reading a tokenizer.json needs the `tokenizers` "
                                 f"package (pip install tokenizers)") from None
        # a regular file inside the model directory, bounded (files.py): a FIFO cannot block it
        raw = read_regular(path, limit=MAX_TOKENIZER_BYTES, root=path.parent,
                           error=TokenizerError, what="tokenizer file")
        try:
            text = raw.decode("utf-8")
            self._special = RustTokenizer.from_str(text)  # added tokens recognised in text
            self._plain = RustTokenizer.from_str(text)
        except Exception as e:  # the library raises its own exception type for a bad file
            raise TokenizerError(f"{path}: not a valid tokenizer.json: {e}") from None
        self._plain.encode_special_tokens = True  # special-token text is ordinary text here
        added = self._special.get_added_tokens_decoder()  # {id: tokenizers.AddedToken}
        self.specials = [SpecialToken(i, t.content, t.special) for i, t in sorted(added.items())]
        self._added = {t.id: t.text for t in self.specials}
        self._by_name = {t.text: t.id for t in self.specials}
        self._skipped = frozenset(t.id for t in self.specials if t.skipped)
        self.chat_template: str | None = None  # set by the loader for a family that has one
        self.vocab_size = self._special.get_vocab_size(with_added_tokens=True)
        self._bytes = self._token_bytes()
        self.bos_id = self._config_token(config, "bos_token", path)
        self.eos_id = self._config_token(config, "eos_token", path)
        self.stop_ids = frozenset({*(t for t in (self.eos_id,) if t is not None), *stop_ids})

    def _token_bytes(self) -> list[bytes] | None:
        """Every id's bytes when the vocabulary is byte-level BPE (added tokens: their UTF-8),
        else None (decode per token through the library). Read from the parsed tokenizer, not
        the file's JSON again (DeepSeek-V3's is 7.8 MB)."""
        from tokenizers.decoders import ByteLevel

        if not isinstance(self._special.decoder, ByteLevel):
            return None
        table = _byte_decoder()
        out: list[bytes] = [b""] * self.vocab_size
        for tok, i in self._special.get_vocab(with_added_tokens=False).items():
            if 0 <= i < self.vocab_size:
                try:
                    out[i] = bytes(table[c] for c in tok)
                except KeyError:
                    return None  # not a byte-level vocabulary after all
        for i, content in self._added.items():
            out[i] = content.encode("utf-8")
        return out

    def _config_token(self, config: dict, key: str, path: Path) -> int | None:
        value = config.get(key)
        if isinstance(value, dict):  # a serialized AddedToken
            value = value.get("content")
        if value is None:
            return None
        i = self._special.token_to_id(str(value))
        if i is None:
            raise TokenizerError(f"{path.parent / 'tokenizer_config.json'}: {key} {value!r} is "
                                 f"not a token of {path.name}")
        return i

    def special(self, name: str) -> int:
        """Id of an added token by its text; KeyError if none."""
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no special token {name!r}") from None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._added

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Ids of `text` (no BOS added). Special-token text is ordinary text unless
        allow_special."""
        tk = self._special if allow_special else self._plain
        return tk.encode(text, add_special_tokens=False).ids

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        ids = [int(t) for t in ids]
        if skip_special:
            ids = [t for t in ids if t not in self._skipped]
        # An id past the tokenizer's vocabulary (the model's embedding is padded: DeepSeek-V3 has
        # 129,280 rows for 128,815 tokens) has no text, as in the tokenizers library.
        ids = [t for t in ids if 0 <= t < self.vocab_size]
        if self._bytes is None:
            return b"".join(self._special.decode([t], skip_special_tokens=False).encode()
                            for t in ids)
        return b"".join(self._bytes[t] for t in ids)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 replaced); skip_special drops added tokens marked
        special."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        """engine/tokenizer.py's incremental decoder over this tokenizer's `decode_bytes`."""
        return StreamDecoder(self, skip_special)


def generation_stop_ids(model_dir: Path) -> list[int]:
    """`eos_token_id` of `generation_config.json` (an id or a list), or [] without the file."""
    path = model_dir / "generation_config.json"
    if not path.exists():
        return []
    data = load_json(path, root=model_dir, error=TokenizerError)
    eos = data.get("eos_token_id") if isinstance(data, dict) else None
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise TokenizerError(f"{path}: eos_token_id {eos!r} is not a token id or a list of "
                             f"them")
    return ids


def load_hf_tokenizer(model_dir: str | Path) -> HFTokenizer:
    """The tokenizer of a directory holding `tokenizer.json` (+ optional tokenizer_config.json,
    generation_config.json)."""
    root = Path(model_dir)
    cfg_path = root / "tokenizer_config.json"
    config = load_json(cfg_path, root=root, error=TokenizerError) if cfg_path.exists() else {}
    if not isinstance(config, dict):
        raise TokenizerError(f"{cfg_path}: not a JSON object")
    return HFTokenizer(root / FILE, config, generation_stop_ids(root))


def model_tokenizer(model_dir: str | Path) -> Tokenizer | HFTokenizer:
    """The tokenizer of a model directory: `tiktoken.model` (engine/tokenizer.py: K3, Kimi K2)
    when there is one, else `tokenizer.json` (DeepSeek-V3/R1)."""
    root = Path(model_dir)
    if not (root / "tiktoken.model").exists() and (root / "tokenizer.json").exists():
        return load_hf_tokenizer(root)
    return load_tokenizer(root)
