"""The HTTP surface: a small hand-written ASGI app over `engine.Engine` (OpenAI-compatible).

    request -> auth -> bounded body -> JSON (depth-limited) -> validate (4xx + OpenAI error
        body) -> render (chat) / encode (completion) -> Engine.submit -> events -> JSON or SSE

Everything the server can refuse is refused before a 200: a stream sends its 200 only once the
engine reports the first token ("start"), so a generation that fails at once (non-finite
logits) is a 500 with an OpenAI error body; only a failure after that is an in-band error event.
When the server stops (`Engine.stop`), a request without a token yet gets 503 with Retry-After,
a non-streamed one too, and a stream that has begun ends with `finish_reason` "abort".

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus text). A concurrent `receive()` watches for `http.disconnect` and sets
the request's cancel flag, so a client that goes away frees the engine at the next token.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass

from .metrics import metrics_text
from .params import RETRY_AFTER_S, ApiError, chat_params, completion_params, error_body, parse_json
from .worker import QueueFull, Request, ShuttingDown


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry later", type_="server_error",
                    code="server_shutting_down",
                    headers=((b"retry-after", str(RETRY_AFTER_S).encode()),))


class _Gone(Exception):
    """The client disconnected while its request was queued or generating."""


@dataclass
class ServerConfig:
    model_id: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    context: int = 4096  # the server's --context: prompt + max_tokens must fit
    default_max_tokens: int | None = None  # None: the rest of the context, as vLLM does
    thinking: bool = True  # chat default when the request does not say
    temperature: float = 1.0  # defaults for requests that do not say (OpenAI's)
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh seed per sampled request


class App:
    """ASGI 3 application; `engine.rt.tokenizer` encodes prompts."""

    def __init__(self, engine, cfg: ServerConfig):
        self.engine, self.cfg, self.created = engine, cfg, int(time.time())

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        try:
            await self._route(scope, receive, send)
        except ApiError as e:
            await _json(send, e.status, error_body(e), e.headers)

    async def _route(self, scope, receive, send):
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        routes = {"/health": ("GET", False), "/metrics": ("GET", True),
                  "/v1/models": ("GET", True), "/v1/chat/completions": ("POST", True),
                  "/v1/completions": ("POST", True)}
        if path.startswith("/v1/models/") and method == "GET":
            self._auth(scope)
            if path[len("/v1/models/"):] != self.cfg.model_id:
                raise ApiError(404, f"model {path[11:]!r} not found", code="model_not_found")
            return await _json(send, 200, self._model_card())
        if path not in routes:
            raise ApiError(404, f"no route {path}", code="not_found")
        want, auth = routes[path]
        if method != want:
            raise ApiError(405, f"{path} takes {want}", code="method_not_allowed")
        if auth:
            self._auth(scope)
        if path == "/health":
            return await _json(send, 200, {"status": "ok", "model": self.cfg.model_id,
                                           "queue_depth": self.engine.depth})
        if path == "/metrics":
            body = metrics_text(self.engine).encode()
            return await _send(send, 200, body, b"text/plain; version=0.0.4; charset=utf-8")
        if path == "/v1/models":
            return await _json(send, 200, {"object": "list", "data": [self._model_card()]})
        body = await self._body(scope, receive)
        chat = path == "/v1/chat/completions"
        p = (chat_params if chat else completion_params)(body, self.cfg, self.engine.rt.tokenizer)
        await self._generate(p, chat, receive, send)

    def _model_card(self) -> dict:
        return {"id": self.cfg.model_id, "object": "model", "created": self.created,
                "owned_by": "mtplx"}

    def _auth(self, scope) -> None:
        if self.cfg.api_key is None:
            return
        got = dict(scope["headers"]).get(b"authorization", b"")
        # Constant time: how long the comparison takes tells nothing of how much matched.
        if not hmac.compare_digest(got, b"Bearer " + self.cfg.api_key.encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)",
                           code="invalid_api_key")

    async def _body(self, scope, receive) -> object:
        limit = self.cfg.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ApiError(400, "client went away", code="disconnected")
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
            if not msg.get("more_body", False):
                break
        return parse_json(b"".join(chunks))

    async def _generate(self, p: dict, chat: bool, receive, send) -> None:
        loop = asyncio.get_running_loop()
        req = Request(events=asyncio.Queue(), loop=loop, **p["request"])
        try:
            self.engine.submit(req)
        except QueueFull as e:
            raise ApiError(429, f"server busy: {e}", type_="rate_limit_error",
                           code="queue_full") from None
        except ShuttingDown:
            raise _shutting_down() from None

        async def watch():  # the only other thing a client can send now is a disconnect
            while (await receive())["type"] != "http.disconnect":
                pass
            req.cancel.set()
            req.events.put_nowait(("gone",))  # wakes the handler waiting for the next event

        watcher = asyncio.create_task(watch())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.cfg.model_id}
        if req.seed is not None:  # not OpenAI's: the seed that repeats this sampled answer
            head["seed"] = req.seed
        try:
            if p["stream"]:
                await self._stream(req, head, chat, p["include_usage"], send)
            else:
                await self._collect(req, head, chat, send)
        except (OSError, _Gone):  # the client went away: nothing more to send
            pass
        finally:
            watcher.cancel()
            req.cancel.set()  # finished: a no-op; left early: skip or stop the generation

    async def _next(self, req):
        """The next "start" | "delta" | "done" event; an "error" event raises ApiError 500, a
        "shutdown" event 503."""
        ev = await req.events.get()
        if ev[0] == "gone":
            raise _Gone
        if ev[0] == "shutdown":
            raise _shutting_down()
        if ev[0] == "error":
            raise ApiError(500, f"generation failed: {ev[1]}", type_="server_error",
                           code=ev[2])
        return ev

    async def _collect(self, req, head, chat, send) -> None:
        parts = {"content": [], "reasoning": []}
        while (ev := await self._next(req))[0] in ("start", "delta"):
            if ev[0] == "delta":
                parts[ev[1]].append(ev[2])
        _, finish, usage, _ = ev
        if finish == "abort":  # the server stopped mid-answer: a partial text is no answer
            raise _shutting_down()
        text = "".join(parts["content"])
        if chat:
            msg = {"role": "assistant", "content": text}
            if parts["reasoning"]:
                msg["reasoning_content"] = "".join(parts["reasoning"])
            choice = {"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        await _json(send, 200, {**head, "choices": [choice], "usage": usage})

    async def _stream(self, req, head, chat, include_usage, send) -> None:
        if chat:
            head = {**head, "object": "chat.completion.chunk"}
        # The 200 waits for the engine's first event ("start": the prompt ran and the first
        # token was sampled), so a request that fails at once (a corrupt model's non-finite
        # logits at prefill, a sampling error) gets a plain HTTP error, not an error in a 200.
        first = await self._next(req)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"),
                                (b"cache-control", b"no-cache")]})

        async def event(choices, **extra):
            data = json.dumps({**head, "choices": choices, **extra})
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(),
                        "more_body": True})

        def choice(delta=None, text="", finish=None):
            if chat:
                return {"index": 0, "delta": delta or {}, "finish_reason": finish,
                        "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        if chat:
            await event([choice({"role": "assistant", "content": ""})])
        try:
            ev = first
            while ev[0] in ("start", "delta"):
                if ev[0] == "delta":
                    key = "content" if ev[1] == "content" else "reasoning_content"
                    await event([choice({key: ev[2]}, text=ev[2])])
                ev = await self._next(req)
            _, finish, usage, _ = ev
            await event([choice(finish=finish)])
            if include_usage:
                await event([], usage=usage)
        except ApiError as e:  # headers are out: report in-band, as OpenAI does
            data = json.dumps(error_body(e))
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})


async def _send(send, status: int, body: bytes, ctype: bytes, headers=()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


async def _json(send, status: int, obj, headers=()) -> None:
    await _send(send, status, json.dumps(obj).encode(), b"application/json", headers)
