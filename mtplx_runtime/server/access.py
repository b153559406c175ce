"""The access log (`mtplx serve --access-log`): one line per request, as ASGI middleware.

    2025-05-01T12:00:00 127.0.0.1:51234 POST /v1/completions 200 1.532s 412B

Fields: the request's start (local time), client address, method, target as sent (still
percent-encoded, so a path cannot break the line), status, seconds from the complete head to
the end of the answer, response body bytes. Status is `-` when the client went away before any
answer, and 408 when the connection layer (server/conn) dropped a request whose body was late.
Requests the connection layer refuses before they reach the app (a late or malformed head,
uvicorn's 503 at the connection cap) have no line.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .conn import CLOSED_WITH


def _client(scope) -> str:
    client = scope.get("client")
    if not client:
        return "-"
    host, port = client
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _target(scope) -> str:
    raw, query = scope["raw_path"], scope["query_string"]
    return (raw + b"?" + query if query else raw).decode("latin-1")


class AccessLog:
    """ASGI 3 middleware: runs `app` and hands one line per HTTP request to `write` (a callable
    taking a str, called on the event loop thread)."""

    def __init__(self, app, write: Callable[[str], None]):
        self.app, self.write = app, write

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, t0 = time.strftime("%Y-%m-%dT%H:%M:%S"), time.perf_counter()
        # uvicorn drops what the app sends after a disconnect: count only what went out.
        st = {"status": None, "bytes": 0, "gone": False, "logged": False}
        head = scope["method"] == "HEAD"  # uvicorn sends no body for HEAD

        def log() -> None:
            st["logged"] = True
            status, size = scope.get(CLOSED_WITH) or (st["status"] or "-", st["bytes"])
            self.write(f"{started} {_client(scope)} {scope['method']} {_target(scope)} "
                       f"{status} {time.perf_counter() - t0:.3f}s {size}B")

        async def watched_receive():
            msg = await receive()
            if msg["type"] == "http.disconnect":
                st["gone"] = True
            return msg

        async def counted_send(msg):
            if not st["gone"]:
                if msg["type"] == "http.response.start":
                    st["status"] = msg["status"]
                elif msg["type"] == "http.response.body":
                    st["bytes"] += 0 if head else len(msg.get("body", b""))
                    if not msg.get("more_body", False):
                        log()  # before the last bytes go out: logged once answered
            await send(msg)

        try:
            await self.app(scope, watched_receive, counted_send)
        except Exception:
            if st["status"] is None and not st["gone"]:  # uvicorn answers it with a 500
                st["status"] = 500
            raise
        finally:
            if not st["logged"]:  # the client left, or the app failed or returned early
                log()
