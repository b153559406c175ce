"""Request validation for the OpenAI-style endpoints: JSON body -> engine Request fields.

Every problem is an `ApiError` (HTTP 4xx with an OpenAI error body naming the parameter); nothing
unvalidated reaches the engine, and a field the server cannot honour (`response_format` other
than text, `logit_bias`) is refused rather than ignored. Defaults are OpenAI's (temperature 1,
top_p 1, `model` optional); a sampled request without a seed gets a fresh one, which the response
returns as `seed` so the request can be repeated. Thinking is on unless the request turns it off
with `"thinking": false`, `"chat_template_kwargs": {"thinking": false}` or `"reasoning_effort":
"none"`; `reasoning_effort` low|medium|high|max also sets the K3 thinking effort.
"""

from __future__ import annotations

import json
import math

from ..engine.chat import THINKING_EFFORTS
from ..engine.generate import fresh_seed, is_greedy

# Stop sequences: as many as OpenAI takes, each short enough that holding back a partial match
# delays little text (the matcher itself is linear in the text whatever their length).
MAX_STOPS = 4
MAX_STOP_BYTES = 1024  # UTF-8 bytes of one stop sequence
RETRY_AFTER_S = 30  # what a 503 from a stopping server asks clients to wait (a restart loads)
# Deepest JSON nesting a body may have. Real requests (messages, tool schemas) stay far below;
# a deeper body is refused before anything walks it recursively (render_chat, json.dumps).
MAX_JSON_DEPTH = 64
ROLES = ("system", "user", "assistant", "tool")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error",
                 headers: tuple[tuple[bytes, bytes], ...] = ()):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type_)
        self.headers = headers  # extra response headers (Retry-After)


def error_body(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _number(body: dict, name: str, default, low, high, *, integer=False, low_open=False):
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool):
        raise _bad(name, f"{name} must be {'an integer' if integer else 'a number'}")
    if isinstance(v, float) and not math.isfinite(v):  # NaN passes every comparison below
        raise _bad(name, f"{name} must be a finite number")
    if (v <= low if low_open else v < low) or (high is not None and v > high):
        side = "(" if low_open else "["
        raise _bad(name, f"{name} must be in {side}{low}, {high if high is not None else 'inf'}]")
    return v


def parse_json(raw: bytes) -> object:
    """The request body as JSON; malformed, or nested deeper than MAX_JSON_DEPTH, is a 400.

    Python's json accepts NaN and Infinity literals (and turns 1e999 into inf); `_number`
    refuses those where a number is wanted."""
    try:
        body = json.loads(raw)
        deep = _too_deep(body, MAX_JSON_DEPTH)
    except RecursionError:  # the C decoder's own guard, about a thousand levels down
        deep = True
    except (UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if deep:
        raise ApiError(400, f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep",
                       code="invalid_json")
    return body


def _too_deep(obj, limit: int) -> bool:
    """Whether `obj` nests lists/objects more than `limit` levels (iterative: no recursion)."""
    level = [obj] if isinstance(obj, (list, dict)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c)
                 if isinstance(v, (list, dict))]
    return False


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and len(stop) <= MAX_STOPS
            and all(isinstance(s, str) and s for s in stop)):
        raise _bad("stop", f"stop must be a non-empty string or a list of up to {MAX_STOPS}")
    for s in stop:
        if len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES:
            raise _bad("stop", f"a stop sequence may be at most {MAX_STOP_BYTES} bytes "
                               "(UTF-8); this one has "
                               f"{len(s.encode('utf-8', 'surrogatepass'))}")
    return stop


def _max_tokens(body: dict, cfg) -> int | None:
    # max_completion_tokens is the newer OpenAI name for the same cap.
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    n = _number(body, name, cfg.default_max_tokens, 1, None, integer=True)
    if n is not None and n > cfg.context:
        raise ApiError(400, f"{name} is {n}, more than the server's --context of {cfg.context} "
                            "tokens (prompt + reply): lower it, or start the server with a "
                            "larger --context", param=name, code="context_length_exceeded")
    return n


def _unsupported(body: dict) -> None:
    """Refuse fields this server would otherwise ignore: the client must not think they held."""
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise _bad("response_format", 'response_format: only {"type": "text"} is supported '
                                      "(no JSON mode or schemas)")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "logit_bias is not supported")


def _common(body, cfg) -> dict:
    """Fields shared by both endpoints; checks `model`, sampling, stop, n, stream."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if model is not None:  # optional: this server has one model
        if not isinstance(model, str):
            raise _bad("model", "model must be a string")
        if model != cfg.model_id:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{cfg.model_id!r}", param="model", code="model_not_found")
    if _number(body, "n", 1, 1, 1, integer=True) != 1:
        raise _bad("n", "n must be 1")
    _unsupported(body)
    stop = _stops(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", "stream must be a boolean")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("stream_options", "stream_options must be an object")
    skip = body.get("skip_special_tokens", True)
    if not isinstance(skip, bool):
        raise _bad("skip_special_tokens", "skip_special_tokens must be a boolean")
    temperature = float(_number(body, "temperature", cfg.temperature, 0, 2))
    seed = _number(body, "seed", cfg.seed, -(2 ** 63), 2 ** 63 - 1, integer=True)
    if is_greedy(temperature):
        seed = None  # greedy draws nothing
    elif seed is None:
        seed = fresh_seed()  # chosen here so that the response can return it
    request = {
        "max_tokens": _max_tokens(body, cfg),
        "temperature": temperature,
        "top_p": float(_number(body, "top_p", cfg.top_p, 0, 1, low_open=True)),
        "seed": seed,
        "frequency_penalty": float(_number(body, "frequency_penalty", 0.0, -2, 2)),
        "presence_penalty": float(_number(body, "presence_penalty", 0.0, -2, 2)),
        "stop": stop,
        "skip_special": skip,
    }
    return {"stream": stream, "include_usage": bool(opts.get("include_usage")),
            "request": request}


def _check_length(p: dict, cfg, param: str) -> dict:
    r = p["request"]
    n = len(r["prompt_ids"])
    if n == 0:
        raise _bad(param, "the prompt encodes to no tokens")
    if r["max_tokens"] is None:  # not asked: the rest of the context (the prompt must fit)
        if n >= cfg.context:
            raise ApiError(400, f"the prompt has {n} tokens; the server's --context is "
                                f"{cfg.context} (tokens of prompt + reply), which leaves no room "
                                "for a reply: shorten the prompt or start the server with a "
                                "larger --context", param=param, code="context_length_exceeded")
        r["max_tokens"] = cfg.context - n
    if n + r["max_tokens"] > cfg.context:
        # cfg.context is the server's --context (what the memory plan reserved), not the
        # model's own limit: name the setting so the operator knows what to raise.
        raise ApiError(400, f"the prompt has {n} tokens and max_tokens asks for "
                            f"{r['max_tokens']}; the server's --context is {cfg.context} "
                            "(tokens of prompt + reply): shorten the prompt, lower max_tokens, "
                            "or start the server with a larger --context", param=param,
                       code="context_length_exceeded")
    return p


def _thinking(body: dict, cfg) -> tuple[bool, str | None]:
    thinking = body.get("thinking")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise _bad("chat_template_kwargs", "chat_template_kwargs must be an object")
        thinking = kwargs.get("thinking", thinking)
    if thinking is not None and not isinstance(thinking, bool):
        raise _bad("thinking", "thinking must be a boolean")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("none", *THINKING_EFFORTS):
            raise _bad("reasoning_effort", f"reasoning_effort must be one of none, "
                                           f"{', '.join(THINKING_EFFORTS)}")
        if effort == "none":
            return False, None
        return (True if thinking is None else thinking), effort
    return (cfg.thinking if thinking is None else thinking), None


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "messages must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"messages[{i}]", f"messages[{i}] must be an object with a role in "
                                         f"{', '.join(ROLES)}")
        c = m.get("content")
        parts_ok = isinstance(c, list) and all(
            isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str)
            for x in c)
        if not (c is None or isinstance(c, str) or parts_ok):
            raise _bad(f"messages[{i}].content", "content must be a string or a list of text "
                                                 "parts")
    return msgs


def chat_params(body, cfg, tok) -> dict:
    from ..engine.chat import render_chat

    p = _common(body, cfg)
    msgs = _messages(body)
    thinking, effort = _thinking(body, cfg)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools", "tools must be a list")
    try:
        ids = render_chat(tok, msgs, thinking=thinking, thinking_effort=effort, tools=tools)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise _bad("messages", f"cannot render the chat: {e}") from None
    p["request"].update(prompt_ids=ids, chat=True, thinking=thinking)
    return _check_length(p, cfg, "messages")


def completion_params(body, cfg, tok) -> dict:
    from ..engine.tokenizer import TokenizerError

    p = _common(body, cfg)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        try:
            ids = tok.encode(prompt)
        except TokenizerError as e:  # the model's pre-tokenizer cannot split this text
            raise _bad("prompt", f"cannot encode the prompt: {e}") from None
    elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tok.vocab_size
            for t in prompt):
        ids = list(prompt)
    else:
        raise _bad("prompt", "prompt must be a string, a list of token ids, or a list of one "
                             "of those (batches are not supported)")
    if body.get("echo"):
        raise _bad("echo", "echo is not supported")
    p["request"].update(prompt_ids=ids)
    return _check_length(p, cfg, "prompt")
