"""Chats of models that ship a Jinja chat template (the DeepSeek-V3 family: DeepSeek-V3/R1 in
`tokenizer_config.json`, Kimi K2 there or in `chat_template.jinja`), rendered as transformers'
`apply_chat_template(..., sanitize_control_tokens=True)` renders them (FORMAT.md "Chat templates of
the DeepSeek-V3 family"); K3's own format is engine/chat.py.

    messages (control-token text marked) -> sandboxed Jinja render -> text
      -> template pieces with added tokens recognised, marked user text as plain text -> ids

Rendering needs jinja2 (an optional dependency, installed with transformers); without it a chat
is a one-line error naming the package. Control tokens are the tokenizer's special added tokens
plus the non-special ones the template writes literally; in message content, tool definitions and
template arguments they are ordinary text, so a user cannot forge a turn. A reply splits into
reasoning and content at the `<think>` / `</think>` tokens.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from ..checkpoint.config import MAX_JSON_BYTES, load_json
from ..files import read_regular
from .tokenizer import TokenizerError

# Private-use markers around control-token text found in caller strings (stripped first, so a
# caller cannot forge them).
_START, _END = "\U000f0000", "\U000f0001"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TEMPLATE_FILE = "chat_template.jinja"


def read_chat_template(model_dir: str | Path) -> str | None:
    """The chat template of a model directory: `tokenizer_config.json`'s `chat_template` (a
    string, or the entry named "default" of a list), else `chat_template.jinja`, else None."""
    root = Path(model_dir)
    cfg_path = root / "tokenizer_config.json"
    if cfg_path.exists():
        cfg = load_json(cfg_path, root=root, error=TokenizerError)
        tpl = cfg.get("chat_template") if isinstance(cfg, dict) else None
        if isinstance(tpl, list):
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            tpl = named.get("default")
        if tpl is not None:
            if not isinstance(tpl, str):
                raise TokenizerError(f"{cfg_path}: chat_template is not a string")
            return tpl
    path = root / TEMPLATE_FILE
    if path.exists():
        raw = read_regular(path, limit=MAX_JSON_BYTES, root=root, error=TokenizerError,
                           what="chat template")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{path}: not UTF-8 text: {e}") from None
    return None


@cache
def _compile(template: str):
    """The template in transformers' sandboxed environment (trim_blocks, lstrip_blocks,
    loopcontrols, its `tojson`, `raise_exception` and `strftime_now`)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError("rendering this model's chat template needs jinja2 "
                         "(pip install jinja2)") from None

    def raise_exception(message):  # a template refusing the chat it was given
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        ast = env.parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"the model's chat template, line {e.lineno}: {e.message}") from None
    literal = {n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
    literal |= {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
    return env.from_string(template), "\0".join(literal)


def control_tokens(tok, template: str) -> tuple[str, ...]:
    """Added tokens that are turn structure: every special one, and the non-special ones the
    template writes literally (not whitespace)."""
    _, literal = _compile(template)
    return tuple(s.text for s in tok.specials
                 if s.skipped or (s.text in literal and not s.text.isspace()))


def _mark(obj: Any, pattern: re.Pattern) -> Any:
    """Caller strings with each control token wrapped in the markers (dict keys untouched)."""
    if isinstance(obj, str):
        obj = obj.replace(_START, "").replace(_END, "")
        return pattern.sub(lambda m: _START + m[0] + _END, obj)
    if isinstance(obj, dict):
        return {k: _mark(v, pattern) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_mark(v, pattern) for v in obj]
    return obj


def render_template(tok, messages: list[dict], *, thinking: bool = True,
                    tools: list | None = None, add_generation_prompt: bool = True,
                    **options: Any) -> list[int]:
    """Prompt ids of a chat through `tok.chat_template`. `thinking` is passed to the template as
    `thinking` (templates without thinking switches ignore it); other `options` (K3's
    `thinking_effort`) mean nothing to these templates and are dropped. A template that refuses
    the chat (its `raise_exception`) is a ValueError with its message; one that does not parse,
    a TokenizerError naming the line."""
    template = tok.chat_template
    compiled, _ = _compile(template)
    tokens = sorted(control_tokens(tok, template), key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, tokens)) or "(?!)")
    specials = {f"{k}_token": tok.decode([i]) for k, i in (("bos", tok.bos_id), ("eos", tok.eos_id))
                if i is not None}
    from jinja2 import TemplateError  # jinja2 is there: _compile imported it

    try:
        text = compiled.render(messages=_mark(messages, pattern), tools=_mark(tools, pattern),
                               add_generation_prompt=add_generation_prompt,
                               thinking=thinking, **specials)
    except TemplateError as e:  # raise_exception, or an undefined name the chat lacks
        raise ValueError(f"the model's chat template cannot render this chat: {e}") from None
    # [template text, marked token, template text, ...]; a lone marker (a template split one)
    # is dropped but still separates what is around it.
    pieces = re.split(f"{_START}({pattern.pattern}){_END}|[{_START}{_END}]", text)
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if piece:
            ids += tok.encode(piece, allow_special=i % 2 == 0)
    return ids


def _think_ids(tok) -> tuple[int | None, int | None]:
    def one(name: str) -> int | None:
        try:
            return tok.special(name)
        except KeyError:
            return None
    return one(THINK_OPEN), one(THINK_CLOSE)


def opens_think(tok, thinking: bool) -> bool:
    """Whether a generation prompt of this template ends inside `<think>` (the reply starts in
    the reasoning channel), tried on a one-message chat."""
    open_id, _ = _think_ids(tok)
    if open_id is None:
        return False
    ids = render_template(tok, [{"role": "user", "content": "?"}], thinking=thinking)
    while ids and not tok.decode(ids[-1:]).strip():  # "<think>\n": the newline after it
        ids.pop()
    return bool(ids) and ids[-1] == open_id


class TemplateChannels:
    """Token ids of a template chat's reply -> (kind, text) pieces, `engine.chat.ChannelText`'s
    contract: "reasoning" between `<think>` and `</think>` (from the start when the prompt
    opened it), "content" elsewhere; the markers themselves print as nothing."""

    def __init__(self, tok, thinking: bool):
        self._dec = tok.stream_decoder(skip_special=True)
        self._open, self._close = _think_ids(tok)
        self.kind = "reasoning" if opens_think(tok, thinking) else "content"

    def push(self, t: int) -> list[tuple[str, str]]:
        if t in (self._open, self._close):
            piece = [(self.kind, self._dec.flush())]
            self.kind = "reasoning" if t == self._open else "content"
            return piece
        return [(self.kind, self._dec.push(t))]

    def flush(self) -> list[tuple[str, str]]:
        return [(self.kind, self._dec.flush())]


def parse_template_reply(ids: list[int], tok, thinking: bool) -> dict[str, Any]:
    """A generated reply as `{reasoning, content, tool_calls}` (engine.chat.parse_assistant's
    form; tool calls are not parsed out of these templates' text: empty)."""
    channels, out = TemplateChannels(tok, thinking), {"reasoning": "", "content": "",
                                                       "tool_calls": []}
    for t in ids:
        if int(t) in tok.stop_ids:
            break
        for kind, text in channels.push(int(t)):
            out[kind] += text
    for kind, text in channels.flush():
        out[kind] += text
    return out
