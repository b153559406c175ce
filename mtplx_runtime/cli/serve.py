"""`mtplx serve`: an OpenAI-compatible HTTP server for one model (uvicorn on uvloop).

    flags -> bind + listen on --host:--port (a taken port fails here, before any loading)
        -> --model DIR -> cli.generate.load_runtime -> Engine (one worker thread) -> App (ASGI)
        [-> server/access's AccessLog with --access-log]
        -> uvicorn (uvloop, loopback by default) on that socket, over server/conn's h11 protocol
           (request read deadlines, bounded connections that keep room for complete requests)

uvicorn and uvloop come with the `server` extra and are imported only when serving, so this
module and `--help` work without them.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys

from ..extras import install_hint

PROG = "mtplx serve"


def add_args(p: argparse.ArgumentParser) -> None:
    from .generate import add_model_args

    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (loopback; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* and /metrics (default: "
                        "none, open to all)")
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
    p.set_defaults(max_tokens=None)  # a request without max_tokens gets the rest of --context


def _uvicorn():
    try:
        import uvicorn
        import uvloop  # noqa: F401  (uvicorn's loop="uvloop" imports it)
    except ModuleNotFoundError as e:
        raise RuntimeError(f"serving needs the `server` extra ({e.name} is missing): "
                           f"{install_hint('server')}") from None
    return uvicorn


def make_server(app, *, host: str = "127.0.0.1", port: int = 0, max_connections: int = 128,
                header_timeout: float = 10.0, body_timeout: float = 30.0):
    """A uvicorn.Server for `app` on uvloop; run with `.run()` or `.run(sockets=[sock])`
    (blocks; set `.should_exit = True` from another thread to stop it).

    uvicorn cannot time out a slow request head, so the HTTP protocol is `server.conn`'s h11
    subclass: read deadlines (408 and close) and shedding of the longest-incomplete connection
    at `max_connections`; uvicorn's own 503 at the cap stays for when all are busy."""
    uvicorn = _uvicorn()
    from ..server.conn import guarded_h11

    config = uvicorn.Config(app, host=host, port=port, loop="uvloop",
                            http=guarded_h11(header_timeout, body_timeout),
                            lifespan="on", limit_concurrency=max_connections,
                            log_level="warning", access_log=False, server_header=False)
    return uvicorn.Server(config)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening, for `make_server(...).run(sockets=[it])`.

    It listens at once: with SO_REUSEADDR (set, as uvicorn does, so a restart is not refused
    while old connections linger in TIME_WAIT) a socket that is only bound does not keep a second
    server off the port. Connections made before the server runs wait in the backlog. Raises
    cli.generate.CliError naming host:port when the port is taken or the address is not ours."""
    from .generate import CliError

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


def check_args(args: argparse.Namespace) -> None:
    """The serve flags that need no model; raises cli.generate.CliError naming the flag."""
    from .generate import CliError

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


def build(args: argparse.Namespace):
    """(app, engine, runtime) from parsed flags; raises cli.generate.CliError on bad flags."""
    from ..server.app import App, ServerConfig
    from ..server.worker import Engine
    from .generate import load_runtime

    check_args(args)
    rt = load_runtime(args)
    engine = Engine(rt, max_queue=args.max_queue, top_k=args.top_k,
                    prefill_chunk=args.prefill_chunk)
    cfg = ServerConfig(model_id=model_id(args), api_key=args.api_key,
                       max_body_bytes=args.max_body_bytes, context=args.context,
                       default_max_tokens=args.max_tokens, thinking=not args.no_thinking)
    return App(engine, cfg), engine, rt


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    from .generate import CliError

    try:
        _uvicorn()
        check_args(args)
        sock = listen_socket(args.host, args.port)
    except (RuntimeError, CliError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    with sock:
        if args.host not in ("127.0.0.1", "::1", "localhost") and args.api_key is None:
            print(f"{PROG}: warning: listening on {args.host} without --api-key",
                  file=sys.stderr)
        try:
            app, engine, rt = build(args)
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
        try:
            make_server(app, host=args.host, port=port, max_connections=args.max_connections,
                        header_timeout=args.header_timeout,
                        body_timeout=args.body_timeout).run(sockets=[sock])
        finally:
            engine.close()
            rt.close()
    return 0
