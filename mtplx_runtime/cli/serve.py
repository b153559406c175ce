"""`mtplx serve`: an OpenAI-compatible HTTP server for one model (uvicorn on uvloop).

    flags -> bind + listen on --host:--port (a taken port fails here, before any loading)
        -> --model DIR -> cli.common.load_runtime -> Engine (one worker thread) -> App (ASGI)
        [-> server/access's AccessLog with --access-log]
        -> uvicorn (uvloop, loopback by default) on that socket, over server/conn's h11 protocol
           (request read deadlines, bounded connections that keep room for complete requests)

Stopping. The first SIGINT (Ctrl-C) or SIGTERM prints one line and stops the engine: queued
requests and those without a first token get 503 with Retry-After, streams under way end with
`finish_reason` "abort" (server/app), the listener closes. Within SHUTDOWN_S seconds of the
signal the connections still open are dropped, the worker is joined and the model released
(warm-start counts written); exit status 130 after SIGINT, 0 after SIGTERM. A forward that
outlasts the deadline is not waited for (exit without releasing the model). A second signal
exits at once (128 + its number). uvicorn's own signal handling (wait for every response, then
re-raise) and its tracebacks of the tasks cancelled at the deadline are replaced and silenced.

uvicorn and uvloop come with the `server` extra and are imported only when serving, so this
module and `--help` work without them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time

from ..extras import install_hint

PROG = "mtplx serve"
SHUTDOWN_S = 5.0  # from the first signal to exit: connections dropped, the worker joined
API_KEY_ENV = "MTPLX_API_KEY"
MAX_KEY_FILE_BYTES = 4096


def add_args(p: argparse.ArgumentParser) -> None:
    from .common import add_model_args

    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (loopback; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None, metavar="KEY",
                      help="require `Authorization: Bearer KEY` on /v1/* and /metrics; other "
                           "users of the machine can read it in the process list: prefer "
                           f"--api-key-file or ${API_KEY_ENV} (default: ${API_KEY_ENV}, else "
                           "none, open to all)")
    keys.add_argument("--api-key-file", default=None, metavar="FILE",
                      help="read the API key from the first line of FILE")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: the model directory's name)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for the engine before new ones get HTTP 429")
    p.add_argument("--max-connections", type=int, default=128,
                   help="open connections; at the cap the longest-incomplete request is "
                        "dropped (408) to admit a new one, and only when every connection is "
                        "being answered do new requests get HTTP 503")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a client has to send a request's head (HTTP 408 and close "
                        "after)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a client has to send a request's body once the head is in "
                        "(HTTP 408 and close after)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body (HTTP 413 above)")
    p.add_argument("--access-log", action="store_true",
                   help="one line per request on stderr: client, method, path, status, "
                        "duration, response body bytes")
    add_model_args(p)  # --context bounds prompt + max_tokens; --max-tokens is the default
    # Defaults for requests that do not say: the rest of --context, and OpenAI's temperature.
    p.set_defaults(max_tokens=None, temperature=1.0)


def _uvicorn():
    try:
        import uvicorn
        import uvloop  # noqa: F401  (uvicorn's loop="uvloop" imports it)
    except ModuleNotFoundError as e:
        raise RuntimeError(f"serving needs the `server` extra ({e.name} is missing): "
                           f"{install_hint('server')}") from None
    return uvicorn


class _NoCancelledTracebacks(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" records for tasks cancelled at the
    shutdown deadline: a cancelled request is the deadline working, not an application bug."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


_QUIET = _NoCancelledTracebacks()


def make_server(app, *, host: str = "127.0.0.1", port: int = 0, max_connections: int = 128,
                header_timeout: float = 10.0, body_timeout: float = 30.0,
                on_stop=None, shutdown_s: float = SHUTDOWN_S):
    """A uvicorn.Server for `app` on uvloop; run with `.run()` or `.run(sockets=[sock])`
    (blocks; set `.should_exit = True` from another thread to stop it).

    uvicorn cannot time out a slow request head, so the HTTP protocol is `server.conn`'s h11
    subclass: read deadlines (408 and close), a 16 KiB head limit, and shedding of the
    longest-incomplete connection at `max_connections`; uvicorn's own 503 at the cap stays for
    when all are busy. Signals (module docstring): the first SIGINT or SIGTERM calls
    `on_stop(signum)` on the event loop and stops the server, dropping what is still open
    `shutdown_s` seconds later; `.stop_signal` and `.stop_time` (monotonic) record it."""
    uvicorn = _uvicorn()
    from ..server.conn import MAX_HEAD_BYTES, guarded_h11

    config = uvicorn.Config(app, host=host, port=port, loop="uvloop",
                            http=guarded_h11(header_timeout, body_timeout),
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                            lifespan="on", limit_concurrency=max_connections,
                            log_level="warning", access_log=False, server_header=False)
    logging.getLogger("uvicorn.error").addFilter(_QUIET)  # once: the same filter object

    class Server(uvicorn.Server):
        stop_signal: int | None = None
        stop_time: float | None = None

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield  # signals reach the main thread only (tests run servers in threads)
                return
            loop = asyncio.get_running_loop()

            def handle(signum, frame) -> None:
                # Signal context: only flags and a wake-up here, the work runs on the loop.
                if self.stop_signal is not None:
                    os._exit(128 + signum)  # the second signal: at once, no cleanup
                self.stop_signal, self.stop_time = signum, time.monotonic()
                loop.call_soon_threadsafe(self._stop)

            previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:  # uvicorn would re-raise the signal here; the caller decides the exit
                for s, h in previous.items():
                    signal.signal(s, h)

        def _stop(self) -> None:
            if on_stop is not None:
                on_stop(self.stop_signal)
            self.should_exit = True  # uvicorn: close the listener, ask connections to end
            asyncio.get_running_loop().call_later(shutdown_s, self._drop)

        def _drop(self) -> None:
            self.force_exit = True  # stop waiting; asyncio.run cancels what is left

    return Server(config)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening, for `make_server(...).run(sockets=[it])`.

    It listens at once: with SO_REUSEADDR (set, as uvicorn does, so a restart is not refused
    while old connections linger in TIME_WAIT) a socket that is only bound does not keep a second
    server off the port. Connections made before the server runs wait in the backlog. Raises
    cli.common.CliError naming host:port when the port is taken or the address is not ours."""
    from .common import CliError

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
    except OSError as e:  # taken, not a local address, a privileged port, an unknown name
        sock.close()
        hint = " (another process is listening there; stop it or choose another --port)" \
            if e.errno == errno.EADDRINUSE else ""
        raise CliError(f"cannot listen on {_host_port(host, port)}: "
                       f"{e.strerror or e}{hint}") from None
    return sock


def api_key(args: argparse.Namespace) -> str | None:
    """The API key: --api-key, the first line of --api-key-file, else $MTPLX_API_KEY; None
    when none is set. Raises cli.common.CliError for an unreadable file or an empty key."""
    from .common import CliError

    if args.api_key_file is not None:
        try:  # plain open: a pipe such as <(pass show k3) is fine
            with open(args.api_key_file, "rb") as f:
                raw = f.read(MAX_KEY_FILE_BYTES + 1)
            key = raw.decode("utf-8").split("\n", 1)[0].strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"--api-key-file {args.api_key_file}: {e}") from None
        if len(raw) > MAX_KEY_FILE_BYTES:
            raise CliError(f"--api-key-file {args.api_key_file}: over {MAX_KEY_FILE_BYTES} "
                           "bytes, not a key file")
        source = f"--api-key-file {args.api_key_file}"
    elif args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif API_KEY_ENV in os.environ:
        key, source = os.environ[API_KEY_ENV], f"${API_KEY_ENV}"
    else:
        return None
    if not key:
        raise CliError(f"{source}: the API key is empty")
    return key


def check_args(args: argparse.Namespace) -> None:
    """The serve flags that need no model; raises cli.common.CliError naming the flag."""
    from .common import CliError

    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in [0, 65535], got {args.port}")
    for flag, v in (("--max-queue", args.max_queue), ("--max-connections", args.max_connections),
                    ("--max-body-bytes", args.max_body_bytes)):
        if v < 1:
            raise CliError(f"{flag} must be >= 1, got {v}")
    for flag, t in (("--header-timeout", args.header_timeout),
                    ("--body-timeout", args.body_timeout)):
        if not 0 < t < float("inf"):  # NaN fails too
            raise CliError(f"{flag} must be a number of seconds > 0, got {t}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise CliError("--max-tokens (the default per request) must be >= 1")


def model_id(args: argparse.Namespace) -> str:
    """The id clients send as `model`: --served-model-name, else the --model directory's name
    as given (a symlink's own name, not its target's)."""
    return args.served_model_name or os.path.basename(os.path.abspath(args.model))


def build(args: argparse.Namespace, key: str | None):
    """(app, engine, runtime) from parsed flags and the API key (`api_key(args)`, read once
    by the caller: a --api-key-file pipe has nothing left to read a second time); raises
    cli.common.CliError on bad flags."""
    from ..server.app import App, ServerConfig
    from ..server.worker import Engine
    from .common import chat_defaults, load_runtime

    check_args(args)
    rt = load_runtime(args)
    chat_defaults(args, PROG)  # a model without a chat format: no thinking, bounded replies
    engine = Engine(rt, max_queue=args.max_queue, top_k=args.top_k,
                    prefill_chunk=args.prefill_chunk)
    cfg = ServerConfig(model_id=model_id(args), api_key=key,
                       max_body_bytes=args.max_body_bytes, context=args.context,
                       default_max_tokens=args.max_tokens, thinking=not args.no_thinking,
                       temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    return App(engine, cfg), engine, rt


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    from .common import CliError

    try:
        _uvicorn()
        check_args(args)
        key = api_key(args)
        sock = listen_socket(args.host, args.port)
    except (RuntimeError, CliError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    with sock:
        if args.host not in ("127.0.0.1", "::1", "localhost") and key is None:
            print(f"{PROG}: warning: listening on {args.host} without an API key",
                  file=sys.stderr)
        try:
            app, engine, rt = build(args, key)
        except CliError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        # The port is ours since listen_socket; the URL says the server is about to answer.
        port = sock.getsockname()[1]
        print(f"{PROG}: {app.cfg.model_id} on http://{_host_port(args.host, port)}/v1",
              file=sys.stderr)
        if args.access_log:
            from ..server.access import AccessLog

            app = AccessLog(app, _stderr_line)

        def stopping(signum: int) -> None:
            again = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            print(f"{PROG}: {signal.Signals(signum).name}: stopping; requests in flight are "
                  f"aborted (a second {again} quits at once)", file=sys.stderr, flush=True)
            engine.stop()

        server = make_server(app, host=args.host, port=port,
                             max_connections=args.max_connections,
                             header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                             on_stop=stopping)
        try:
            server.run(sockets=[sock])
        finally:
            left = SHUTDOWN_S - (time.monotonic() - (server.stop_time or time.monotonic()))
            if not engine.close(timeout=max(left, 0.1)):
                # A forward outlasted the deadline: the model stays in use, so it cannot be
                # released; exit without waiting for it (os._exit: no thread joins).
                print(f"{PROG}: the engine did not stop within {SHUTDOWN_S:g} s (a forward in "
                      "progress); exiting without releasing the model", file=sys.stderr,
                      flush=True)
                os._exit(130 if server.stop_signal == signal.SIGINT else 1)
            rt.close()
    return 130 if server.stop_signal == signal.SIGINT else 0
