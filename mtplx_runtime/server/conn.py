"""The connection layer under `mtplx serve`: request read deadlines and room for complete requests.

uvicorn's h11 protocol has no deadline for reading a request: `timeout_keep_alive` runs only
between requests (armed after a response, cancelled by the next byte), a fresh connection is
never timed out, and the app sees a request only once its head is complete. So a client that
trickles header bytes (or declares Content-Length 1000 and sends 9) holds its connection for as
long as it likes, and `limit_concurrency` counts it: enough of them and every complete request
gets 503. The protection therefore sits in the protocol, as a subclass of uvicorn's
`H11Protocol` that `serve.make_server` hands to uvicorn (`Config(http=...)`):

    connection (or first byte after a keep-alive response)
        -> head phase: the request head must be complete within `header_timeout`
        -> body phase: the body must be complete within `body_timeout` of the head
        -> answering (no deadline: a long generation or stream is not a slow request)
        -> idle between requests: uvicorn's `timeout_keep_alive`
    a deadline missed: 408 with an OpenAI error body and `connection: close` (a connection that
    sent nothing, or is idle between requests, is just closed)

Request heads are at most MAX_HEAD_BYTES: h11 enforces its limit only on a head still
incomplete in its buffer, so a larger head that arrives in one read would pass; the bytes each
head took are counted here and a larger one is a 400, as h11's own.

Closing after an error response (400 for a bad or oversized head, 408, 503 below): closing a
socket with unread client bytes sends a reset, which can destroy the response in the client's
buffer before it reads it. So the write side is shut (a FIN after the response) and what the
client still sends is read and dropped until it closes, or for at most LINGER_S.

Server stopping (uvicorn's `shutdown` of each connection): a half-sent request gets 503 and the
connection closes, so no shutdown waits out a trickler's deadline; the rest is uvicorn's (idle
connections close, one being answered closes after its response).

Connection cap (`--max-connections`, uvicorn's `limit_concurrency`): uvicorn answers 503 to a
request arriving while the open connections reach the cap. Admission keeps a slot free for
complete requests instead: when a new connection brings the count to the cap, the connection
that has been incomplete the longest (still sending its head or body, or idle between requests)
is shed (408 as above) until one slot is free again. A connection whose request is being
answered is never shed, so 503 remains only for when the cap is full of real requests. Oldest
first means a burst of new connections sheds the tricklers that have held on longest, and a
client that connected a moment ago has the most time to finish its request.
"""

from __future__ import annotations

import heapq
import itertools
import json

from .params import RETRY_AFTER_S, ApiError, error_body

# Scope key set on a request whose body was late (or that was shed mid-body): (status, body
# bytes) of the response written here, which the app never sees (server/access logs it).
CLOSED_WITH = "mtplx.closed_with"
MAX_HEAD_BYTES = 16 * 1024  # a request head (request line + headers); h11's own default
LINGER_S = 2.0  # after an error response: the most time spent draining the client's bytes


def _response(status: int, reason: bytes, message: str, code: str, extra: bytes = b"") -> bytes:
    """A complete `connection: close` response with an OpenAI error body."""
    body = json.dumps(error_body(ApiError(status, message, code=code))).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"%sconnection: close\r\n\r\n" % (status, reason, len(body), extra)) + body


def _timeout_response(message: str) -> bytes:
    return _response(408, b"Request Timeout", message, "request_timeout")


def guarded_h11(header_timeout: float, body_timeout: float) -> type:
    """uvicorn's H11Protocol with request read deadlines and shedding at the connection cap
    (module docstring); pass as `uvicorn.Config(http=...)` with `limit_concurrency` set."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    if not (header_timeout > 0 and body_timeout > 0):
        raise ValueError(f"timeouts must be > 0, got {header_timeout}, {body_timeout}")
    late = {"head": _timeout_response(f"request head not received within {header_timeout:g} s"),
            "body": _timeout_response(f"request body not received within {body_timeout:g} s")}
    began = itertools.count()  # a ticket per request start: uvloop's clock is per iteration
    shed = _timeout_response("incomplete request dropped to make room for complete ones (the "
                             "server is at its connection limit)")
    stopping = _response(503, b"Service Unavailable", "the server is shutting down; retry later",
                         "server_shutting_down", b"retry-after: %d\r\n" % RETRY_AFTER_S)

    class HeadLimitedConnection(h11.Connection):
        """h11's server side with MAX_HEAD_BYTES on complete heads too: the bytes a head took
        are those fed in, less those still buffered, since the previous message ended."""

        _fed = 0  # bytes handed to receive_data
        _head_from = 0  # where the current head began, in those bytes

        def receive_data(self, data: bytes) -> None:
            self._fed += len(data)
            super().receive_data(data)

        def next_event(self):
            event = super().next_event()
            if isinstance(event, (h11.Request, h11.EndOfMessage)):
                at = self._fed - len(self.trailing_data[0])  # once per message: a small copy
                if isinstance(event, h11.Request) and at - self._head_from > MAX_HEAD_BYTES:
                    raise h11.RemoteProtocolError(f"request head over {MAX_HEAD_BYTES} bytes")
                self._head_from = at
            return event

    class GuardedH11Protocol(H11Protocol):
        _timer = None
        _phase: str | None = None  # "head" | "body" | None (answering or idle)
        _since = 0  # ticket of the current request's (or idle spell's) start: shedding order
        _draining = False  # an error response was sent: what arrives now is dropped

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.conn = HeadLimitedConnection(h11.SERVER, MAX_HEAD_BYTES)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._since = next(began)
            self._arm("head", header_timeout)
            self._admit()

        def data_received(self, data: bytes) -> None:
            if not self._draining:
                super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            """h11 refused the head (malformed, or over MAX_HEAD_BYTES): 400, then linger."""
            self.transport.write(_response(400, b"Bad Request", f"invalid HTTP request: {msg}",
                                           "invalid_request"))
            self._linger()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may parse a pipelined head (handle_events)
            if self._phase is None:
                self._since = next(began)  # idle from now (or answering the next)
            self._track()

        def shutdown(self) -> None:
            if self._partial():  # the server is stopping: a half-sent request gets 503
                return self._close(stopping)
            super().shutdown()

        # -- phases ----------------------------------------------------------------------

        def _track(self) -> None:
            """Follow h11's view of the client: which deadline (if any) applies now."""
            if self.transport.is_closing():
                return self._disarm()
            state, cycle = self.conn.their_state, self.cycle
            if state is h11.IDLE:  # before a head: a fresh connection or between requests
                if self._phase == "head":
                    return  # keeps the deadline it started with
                if self.conn.trailing_data[0]:  # part of a next head arrived
                    self._since = next(began)
                    return self._arm("head", header_timeout)
                return self._disarm()  # idle: uvicorn's keep-alive timeout applies
            answering = cycle is not None and cycle.response_started \
                and not cycle.response_complete
            if state is h11.SEND_BODY and not answering:
                if self._phase != "body":
                    self._arm("body", body_timeout)
                return None
            return self._disarm()

        def _arm(self, phase: str, seconds: float) -> None:
            self._disarm()
            self._phase = phase
            self._timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._phase = None, None

        def _expired(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                self._close(late[self._phase])

        def _partial(self) -> bool:
            """Whether the client has sent part of a request that no response answered yet."""
            if self._phase == "head":
                return bool(self.conn.trailing_data[0])
            cycle = self.cycle
            return self._phase == "body" and cycle is not None and not cycle.response_started

        def _close(self, response: bytes) -> None:
            """`response` if a request is half-sent (else nothing), then close. The app, if it
            was reading the body, sees a disconnect; its late reply is dropped by uvicorn."""
            if self._partial():
                self.transport.write(response)
                if self._phase == "body":
                    body = len(response) - response.index(b"\r\n\r\n") - 4
                    self.cycle.scope[CLOSED_WITH] = (int(response[9:12]), body)
                self.connections.discard(self)
                return self._linger()
            self._disarm()
            self.connections.discard(self)
            self.transport.close()

        def _linger(self) -> None:
            """Close once the response is out: FIN now, the client's bytes drained until it
            closes (eof_received) or LINGER_S (module docstring)."""
            self._disarm()
            self._draining = True
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # as connection_lost: the app sees a disconnect now
                cycle.message_event.set()
            self.flow.resume_reading()
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._timer = self.loop.call_later(LINGER_S, self.transport.close)

        # -- admission -------------------------------------------------------------------

        def _sheddable(self) -> bool:
            if self.transport is None or self.transport.is_closing():
                return False
            return self._phase is not None or self.conn.their_state is h11.IDLE

        def _admit(self) -> None:
            """Keep one slot under the cap free for complete requests (module docstring)."""
            limit = self.limit_concurrency
            excess = 0 if limit is None else len(self.connections) - limit + 1
            if excess <= 0:
                return
            others = (p for p in self.connections
                      if p is not self and isinstance(p, GuardedH11Protocol) and p._sheddable())
            for victim in heapq.nsmallest(excess, others, key=lambda p: p._since):
                victim._close(shed)

    return GuardedH11Protocol
