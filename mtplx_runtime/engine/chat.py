"""K3 chat format "XTML": render a conversation to ids, parse a generated reply.

FORMAT.md "Chat format"; follows the official `encoding_k3.py` (as reimplemented by NeMo
AutoModel, the oracle of the tests). A chat is a
list of segments; only the markers `<|open|>`, `<|close|>`, `<|sep|>`, `<|end_of_msg|>` are
special ids, every other segment is ordinary BPE with special-token text *not* recognised.
Segments are encoded one by one (BPE never merges across them), cut as the reference cuts them:

    <|open|> "message" " role" '="' "user" '"' <|sep|> content
    <|close|> "message" <|sep|> <|end_of_msg|>

Order: tool-declare, thinking-effort, the conversation, tool-choice, response-format,
generation prompt (`<|open|>message role="assistant"<|sep|><|open|>think<|sep|>`, or
`...<|open|>response<|sep|>` with thinking off). No [BOS] is added.

Thinking effort (sources disagree on the default): the thinking-effort message is added only
when an effort is given (`low|medium|high|max`), as AutoModel's `build_chat_segments` does. Its
HF-level `apply_chat_template` passes `thinking_effort="max"` by default, as llama.cpp and
batchgen do; a caller wanting that behaviour passes `thinking_effort=DEFAULT_THINKING_EFFORT`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.config import load_json
from .chat_template import TemplateChannels, parse_template_reply, render_template
from .tokenizer import Tokenizer

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
THINKING_EFFORTS = ("low", "medium", "high", "max")
DEFAULT_THINKING_EFFORT = "max"  # AutoModel's HF-level default, also llama.cpp's
# Files beside a model's config that say it was trained on a chat format: K3's own encoder (the
# release ships it instead of a template) or a Hugging Face chat template file.
CHAT_FORMAT_FILES = ("encoding_k3.py", "chat_template.jinja", "chat_template.json")


def chat_format_source(model_dir: str | os.PathLike) -> str | None:
    """What says the model in `model_dir` was trained on a chat format: one of
    CHAT_FORMAT_FILES, or `tokenizer_config.json` when it holds a `chat_template`; None when
    nothing does (a model trained on plain text, like the tiny K3 of `mtplx demo`: it neither
    thinks nor ends a reply, whatever the rendering). An unreadable tokenizer config counts as
    none (loading the tokenizer reports it)."""
    root = Path(model_dir)
    for name in CHAT_FORMAT_FILES:
        if (root / name).is_file():
            return name
    try:
        config = load_json(root / "tokenizer_config.json", root=root)  # as the loaders read it
    except (OSError, ValueError):
        return None
    return "tokenizer_config.json" if isinstance(config, dict) and config.get("chat_template") \
        else None


@dataclass(frozen=True)
class Segment:
    text: str
    control: bool = False  # a marker: encoded as its special id


Segments = list[Segment]


# ---- primitives (the reference's _text/_control/_attr/_open_tag/_close_tag) ----------------


def _text(value: Any) -> Segments:
    s = str(value)
    return [Segment(s)] if s else []


def escape_attr(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    return re.sub(r"&(amp|quot);", lambda m: "&" if m[1] == "amp" else '"', value)


def _open(tag: str, attrs: list[tuple[str, Any]] = ()) -> Segments:  # type: ignore[assignment]
    out = [Segment(OPEN, True), *_text(tag)]
    for key, value in attrs:
        out += _text(f" {key}") + _text('="') + _text(escape_attr(value)) + _text('"')
    return out + [Segment(SEP, True)]


def _close(tag: str) -> Segments:
    return [Segment(CLOSE, True), *_text(tag), Segment(SEP, True)]


def _message(attrs: list[tuple[str, Any]], body: Segments) -> Segments:
    return _open("message", attrs) + body + _close("message") + [Segment(END_OF_MSG, True)]


def _internal(kind: str, body: str) -> Segments:
    return _message([("role", "system"), ("type", kind)], _text(body.strip()))


def _json_compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _deep_sort(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _deep_sort(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [_deep_sort(v) for v in obj]
    return obj


def _content(content: Any) -> Segments:
    if content is None:
        return []
    if isinstance(content, str):
        return _text(content)
    out: Segments = []
    for part in content:
        if part.get("type") != "text":
            raise NotImplementedError(f"content part {part.get('type')!r}: text only")
        out += _text(part["text"])
    return out


# ---- messages --------------------------------------------------------------------------------


def _xtml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _arguments(raw: Any) -> tuple[dict, str | None]:
    """(arguments, json_block): a JSON-object string is parsed; an unparseable string is sent
    as one raw json block (FORMAT.md "Chat format")."""
    if raw is None:
        return {}, None
    if isinstance(raw, dict):
        return raw, None
    if not isinstance(raw, str):
        raise TypeError("tool call arguments must be a dict or a JSON object string")
    if not raw.strip():
        return {}, None
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        return {}, raw
    if not isinstance(parsed, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return parsed, None


def _tool_calls(calls: list[dict]) -> Segments:
    out = _open("tools")
    for index, call in enumerate(calls, start=1):
        fn = call.get("function", call)
        args, block = _arguments(fn.get("arguments"))
        out += _open("call", [("tool", fn["name"]), ("index", index)])
        if block is not None:
            out += _open("json", [("type", "object")]) + _text(block) + _close("json")
        else:
            for key, value in args.items():
                out += _open("argument", [("key", key), ("type", _xtml_type(value))])
                s = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
                out += _text(s) + _close("argument")
        out += _close("call")
    return out + _close("tools")


def _assistant(message: dict, thinking: bool) -> Segments:
    out: Segments = []
    if thinking:  # the think channel is structural: present even when empty
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        out += _open("think")
        if reasoning is not None and str(reasoning).strip():
            out += _text(reasoning)
        out += _close("think")
    out += _open("response") + _content(message.get("content")) + _close("response")
    if message.get("tool_calls"):
        out += _tool_calls(message["tool_calls"])
    return out


def _tool_declare(tools: Any, dynamic: bool = False) -> Segments:
    spec = _json_compact(_deep_sort(tools))
    if dynamic:
        body = (
            "## New Tools Available\n"
            "The system dynamically extends the toolset via lazy-loading.\n"
            "You have access to all existing and extended tools.\n"
            "Here are the specs for the extended tools.\n\n"
            f"```json\n{spec}\n```"
        )
    else:
        body = (
            "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
            f"```json\n{spec}\n```"
        )
    return _message([("role", "system"), ("type", "tool-declare")], _text(body))


def _order_tool_results(messages: list[dict]) -> list[dict]:
    """Sort each run of tool messages into the preceding assistant's tool_calls order by
    `tool_call_id`, naming each after its call; a run not fully matched is left as is."""
    out: list[dict] = []
    index: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") == "assistant":
            index = {}
            for pos, tc in enumerate(m.get("tool_calls") or [], start=1):
                if isinstance(tc, dict) and tc.get("id") is not None:
                    name = tc.get("function", tc).get("name")
                    index.setdefault(str(tc["id"]), (pos, name))
        if m.get("role") != "tool":
            out.append(m)
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        run = messages[i:j]
        ids = [m.get("tool_call_id", m.get("id")) for m in run]
        hits = [index.get(str(c)) if c is not None else None for c in ids]
        if all(hits):
            for k in sorted(range(len(run)), key=lambda k: (hits[k][0], k)):
                name = hits[k][1]
                if name is None:
                    out.append(run[k])
                else:  # the matched call is authoritative for the name
                    renamed = {**run[k], "tool": name}
                    if "name" in renamed:
                        renamed["name"] = name
                    out.append(renamed)
        else:
            out += run
        i = j
    return out


def build_segments(
    messages: list[dict],
    *,
    thinking: bool = True,
    tools: list[dict] | None = None,
    thinking_effort: str | None = None,
    tool_choice: str | None = None,
    response_format: dict | str | None = None,
    add_generation_prompt: bool = True,
) -> Segments:
    """The XTML segments of a chat (text only)."""
    out: Segments = []
    if tools:
        out += _tool_declare(tools)
    if thinking and thinking_effort is not None:
        if thinking_effort not in THINKING_EFFORTS:
            raise ValueError(f"thinking_effort {thinking_effort!r} not in {THINKING_EFFORTS}")
        out += _internal(
            "thinking-effort",
            "`thinking_effort` guides on how much to think in your thinking channel (not "
            "including the response channel), supported values include `low`, `medium`, "
            "`high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={thinking_effort}`.",
        )
    calls: list[dict] | None = None
    tool_index = 0
    for m in _order_tool_results(messages):
        role = m["role"]
        named = [("name", m["name"])] if m.get("name") else []
        if role == "user" or (role == "system" and not m.get("tools")):
            out += _message([("role", role), *named], _content(m.get("content")))
        elif role == "system":
            out += _tool_declare(m["tools"], dynamic=True)
        elif role == "tool":
            tool_index += 1
            name = m.get("tool", m.get("name"))
            if name is None and calls is not None and tool_index <= len(calls):
                name = calls[tool_index - 1].get("function", calls[tool_index - 1])["name"]
            if name is None:
                raise ValueError("a tool message needs `tool`/`name` or a matching tool call")
            attrs = [("role", "tool"), ("tool", name), ("index", tool_index)]
            out += _message(attrs, _content(m.get("content")))
        elif role == "assistant":
            calls, tool_index = m.get("tool_calls"), 0
            out += _message([("role", "assistant"), *named], _assistant(m, thinking))
        else:
            raise ValueError(f"unknown role {role!r}")
    if tool_choice in ("required", "none"):
        must = "MUST" if tool_choice == "required" else "MUST NOT"
        what = "call tools" if tool_choice == "required" else "call any tools"
        out += _internal(
            "tool-choice",
            f"The system is invoked with `tool_choice={tool_choice}`.\n"
            f"You {must} {what} in the next message.",
        )
    out += _response_format(response_format)
    if add_generation_prompt:
        out += _open("message", [("role", "assistant")])
        out += _open("think" if thinking else "response")
    return out


def _response_format(rf: dict | str | None) -> Segments:
    kind = rf.get("type") if isinstance(rf, dict) else rf
    head = (
        f"The system is invoked with `response_format={kind}`.\n"
        "Your response must be raw JSON data without markdown code blocks (```json) or any "
        "additional formatting."
    )
    if kind == "json_object":
        return _internal("response-format", head)
    if kind == "json_schema":
        js = rf.get("json_schema") if isinstance(rf, dict) else None
        schema = js.get("schema", js.get("json_schema", js)) if isinstance(js, dict) else js
        return _internal(
            "response-format",
            head + "\nThe JSON data must match the following schema:\n"
            f"```json\n{_json_compact(_deep_sort(schema))}\n```",
        )
    return []


def encode_segments(tok: Tokenizer, segments: Segments) -> list[int]:
    ids: list[int] = []
    for seg in segments:
        ids += [tok.special(seg.text)] if seg.control else tok.encode(seg.text, allow_special=False)
    return ids


def render_chat(tok: Tokenizer, messages: list[dict], **options: Any) -> list[int]:
    """Prompt ids of a chat: `build_segments(messages, **options)` (thinking, tools, thinking
    effort, tool choice, response format, generation prompt), encoded. A tokenizer carrying a
    model's Jinja chat template (the DeepSeek-V3 family) renders through it instead
    (engine/chat_template.py)."""
    if getattr(tok, "chat_template", None):
        return render_template(tok, messages, **options)
    return encode_segments(tok, build_segments(messages, **options))


# ---- parsing a generated reply ---------------------------------------------------------------

_MARKER_RE = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")
_ATTR_RE = re.compile(r' ([^\s=]+)="([^"]*)"')


def _events_from_ids(tok: Tokenizer, ids: list[int]) -> list[str | tuple[str]]:
    """Markers as 1-tuples, text as str; stops at the first stop id."""
    marker_of = {tok.special(m): m for m in MARKERS}
    events: list[str | tuple[str]] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            events.append(tok.decode(run))
            run.clear()

    for t in ids:
        t = int(t)
        if t in tok.stop_ids:
            break
        if t in marker_of:
            flush()
            events.append((marker_of[t],))
        elif not tok.is_special(t):
            run.append(t)  # other special ids (media, reserved) carry no reply text
    flush()
    return events


def _events_from_text(text: str) -> list[str | tuple[str]]:
    text = text.split(END_OF_MSG, 1)[0]
    return [(p,) if p in MARKERS else p for p in _MARKER_RE.split(text) if p]


def _typed(value: str, kind: str) -> Any:
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def parse_assistant(
    reply: list[int] | str, tok: Tokenizer | None = None, *, thinking: bool = True
) -> dict[str, Any]:
    """Split a generated assistant turn into `{reasoning, content, tool_calls}`.

    `reply` is ids (needs `tok`; markers are recognised only as special ids) or text (markers
    recognised by their text). It is either the continuation of the generation prompt (starting
    inside the think channel, or the response channel when `thinking=False`) or a whole rendered
    assistant message starting `<|open|>message`. Parsing stops at `<|end_of_msg|>` (and, for
    ids, at any stop id); an unfinished reply yields what is there so far. Tool calls are
    `{"name", "arguments"}` with typed arguments (a json block gives its raw string).
    """
    if not isinstance(reply, str) and getattr(tok, "chat_template", None):
        return parse_template_reply(list(reply), tok, thinking)
    if isinstance(reply, str):
        events = _events_from_text(reply)
    else:
        if tok is None:
            raise ValueError("parsing ids needs the tokenizer")
        events = _events_from_ids(tok, list(reply))
    whole = len(events) > 1 and events[0] == (OPEN,) and str(events[1]).startswith("message")
    channel = "think" if thinking else "response"
    stack: list[list] = [] if whole else [["message", {}, ""], [channel, {}, ""]]
    out: dict[str, Any] = {"reasoning": "", "content": "", "tool_calls": []}
    call: dict[str, Any] | None = None

    def finish(tag: str, attrs: dict, text: str) -> None:
        nonlocal call
        if tag == "think":
            out["reasoning"] += text
        elif tag == "response":
            out["content"] += text
        elif tag == "argument" and call is not None:
            call["arguments"][attrs.get("key", "")] = _typed(text, attrs.get("type", "string"))
        elif tag == "json" and call is not None:
            call["arguments"] = text
        elif tag == "call" and call is not None:
            out["tool_calls"].append(call)
            call = None

    i = 0
    while i < len(events):
        ev = events[i]
        if ev in ((OPEN,), (CLOSE,)):
            header = ""
            i += 1
            while i < len(events) and events[i] != (SEP,):
                header += events[i] if isinstance(events[i], str) else ""
                i += 1
            tag = header.split(" ", 1)[0]
            if ev == (OPEN,):
                attrs = {k: unescape_attr(v) for k, v in _ATTR_RE.findall(header)}
                stack.append([tag, attrs, ""])
                if tag == "call":
                    call = {"name": attrs.get("tool", ""), "arguments": {}}
            else:
                while stack:
                    frame = stack.pop()
                    finish(*frame)
                    if frame[0] == tag:
                        break
        elif isinstance(ev, str) and stack:
            stack[-1][2] += ev
        i += 1
    while stack:  # unfinished reply: keep the partial channels
        finish(*stack.pop())
    return out


class ChannelText:
    """Token ids of a generated chat reply -> (kind, text) pieces: the think channel as
    "reasoning", response and message channels as "content", other XTML tags (tool calls) as
    `<tag attrs>` / `</tag>` content. The one channel state machine of the package: the server
    keeps the kinds apart, `mtplx generate --chat` / `mtplx chat` print them with think tags.
    `thinking`: the prompt opened the think channel (the reply starts in it). A tokenizer
    carrying a Jinja chat template gets `chat_template.TemplateChannels` instead."""

    def __new__(cls, tok, thinking: bool):
        if getattr(tok, "chat_template", None):
            return TemplateChannels(tok, thinking)  # not a ChannelText: __init__ is not run
        return super().__new__(cls)

    def __init__(self, tok, thinking: bool):
        self._tok, self._dec = tok, tok.stream_decoder(skip_special=True)
        self._open, self._close, self._sep = tok.special(OPEN), tok.special(CLOSE), tok.special(SEP)
        self._header: list[int] | None = None  # ids between a marker and its <|sep|>
        self._closing = False
        self.kind = "reasoning" if thinking else "content"

    def push(self, t: int) -> list[tuple[str, str]]:
        if t in (self._open, self._close):
            self._header, self._closing = [], t == self._close
            return [(self.kind, self._dec.flush())]
        if self._header is None:
            return [(self.kind, self._dec.push(t))]
        if t != self._sep:
            self._header.append(t)
            return []
        head, self._header = self._tok.decode(self._header), None
        tag = head.split(" ", 1)[0]
        if tag == "think":
            self.kind = "content" if self._closing else "reasoning"
        elif tag in ("response", "message"):
            self.kind = "content"
        else:
            return [("content", f"</{tag}>" if self._closing else f"<{head}>")]
        return []

    def flush(self) -> list[tuple[str, str]]:
        return [(self.kind, self._dec.flush())]
