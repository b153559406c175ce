"""`mtplx serve`: an OpenAI-compatible HTTP server for one model (uvicorn on uvloop).

    --model DIR -> cli.generate.load_runtime -> Engine (one worker thread) -> App (ASGI)
        -> uvicorn (uvloop, loopback by default) over server/conn's h11 protocol (request read
           deadlines, bounded connections that keep room for complete requests)

uvicorn and uvloop come with the `server` extra and are imported only when serving, so this
module and `--help` work without them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROG = "mtplx serve"


def add_args(p: argparse.ArgumentParser) -> None:
    from .generate import add_model_args

    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* and /metrics")
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
    add_model_args(p)  # --context bounds prompt + max_tokens; --max-tokens is the default


def _uvicorn():
    try:
        import uvicorn
        import uvloop  # noqa: F401  (uvicorn's loop="uvloop" imports it)
    except ModuleNotFoundError as e:
        raise RuntimeError(f"serving needs the `server` extra ({e.name} is missing): "
                           "pip install 'mtplx_runtime[server]'") from None
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


def build(args: argparse.Namespace):
    """(app, engine, runtime) from parsed flags; raises cli.generate.CliError on bad flags."""
    from ..server.app import App, ServerConfig
    from ..server.engine import Engine
    from .generate import CliError, load_runtime

    for flag, v in (("--max-queue", args.max_queue), ("--max-connections", args.max_connections),
                    ("--max-body-bytes", args.max_body_bytes)):
        if v < 1:
            raise CliError(f"{flag} must be >= 1, got {v}")
    for flag, t in (("--header-timeout", args.header_timeout),
                    ("--body-timeout", args.body_timeout)):
        if not 0 < t < float("inf"):  # NaN fails too
            raise CliError(f"{flag} must be a number of seconds > 0, got {t}")
    if args.max_tokens < 1:
        raise CliError("--max-tokens (the default per request) must be >= 1")
    rt = load_runtime(args)
    engine = Engine(rt, max_queue=args.max_queue, top_k=args.top_k,
                    prefill_chunk=args.prefill_chunk)
    cfg = ServerConfig(model_id=args.served_model_name or Path(args.model).resolve().name,
                       api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                       context=args.context, default_max_tokens=args.max_tokens,
                       thinking=not args.no_thinking)
    return App(engine, cfg), engine, rt


def main(args: argparse.Namespace) -> int:
    from .generate import CliError

    try:
        _uvicorn()
        app, engine, rt = build(args)
    except (RuntimeError, CliError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "::1", "localhost") and args.api_key is None:
        print(f"{PROG}: warning: listening on {args.host} without --api-key", file=sys.stderr)
    print(f"{PROG}: {app.cfg.model_id} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        make_server(app, host=args.host, port=args.port, max_connections=args.max_connections,
                    header_timeout=args.header_timeout, body_timeout=args.body_timeout).run()
    finally:
        engine.close()
        rt.close()
    return 0
