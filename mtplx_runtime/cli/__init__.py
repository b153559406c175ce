"""`mtplx` command line: a table of subcommands, and `--config` presets applied before parsing.

Each subcommand lives in its own module exposing `add_args(parser)` and `main(args) -> int`; one
that adds `--config` (engine/presets.py) gets a preset's values as its defaults, here.
Subcommand modules keep torch and every GPU library out of their top-level imports, so `--help`
works (and is fast) on any machine. This module imports nothing heavier at its top than the
standard library: numpy and the rest load inside `main`, where a Ctrl-C is one line, not an
import traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .. import __version__
from . import model_dir

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("mtplx_runtime.cli.demo",
             "stream text from a tiny K3 through a small expert cache and print the cache stats"),
    "generate": ("mtplx_runtime.cli.generate",
                 "generate from a prompt (or a one-message chat), streaming text; stats to stderr"),
    "chat": ("mtplx_runtime.cli.chat",
             "interactive chat; each turn prefills only what the model state has not seen"),
    "make-tiny": ("mtplx_runtime.cli.make_tiny", "write a tiny deterministic K3 checkpoint"),
    "inspect": ("mtplx_runtime.cli.inspect",
                "summarise a checkpoint (K3, K2, DeepSeek-V3): layout, codec, experts"),
    "logits": ("mtplx_runtime.cli.logits",
               "reference forward of a token list, logits to a .npy file"),
    "profile": ("mtplx_runtime.cli.profile",
                "replay route traces through the cache policies: hit rate vs capacity, Belady"),
    "serve": ("mtplx_runtime.cli.serve",
              "OpenAI-compatible HTTP server for one model (loopback by default)"),
    "plan": ("mtplx_runtime.cli.plan",
             "memory plan for a budget: residents, state, cache slots; refuse below the minimum"),
    "recode-w4": ("mtplx_runtime.cli.recode_w4",
                  "recode a W3 checkpoint to W4 losslessly (for vLLM)"),
    "build-manifest": ("mtplx_runtime.cli.build_manifest",
                       "build or resume a streaming artifact (bank parts + manifest)"),
    "verify": ("mtplx_runtime.cli.verify",
               "check an artifact directory against its expert manifest"),
}


class DefaultsHelp(argparse.RawDescriptionHelpFormatter):
    """Every option's default at the end of its help, unless its help already says it; an
    epilog (a subcommand's examples) kept as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.required or action.default is argparse.SUPPRESS:
            return text
        d = action.default
        shown = ("none" if d is None else "off" if d is False else "on" if d is True
                 else ",".join(map(str, d)) if isinstance(d, (list, tuple)) else "%(default)s")
        return f"{text} (default: {shown})"


def _build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `mtplx` parser and its subparsers by name."""
    parser = argparse.ArgumentParser(
        prog="mtplx",
        description="mtplx_runtime: run Kimi K3, Kimi K2 and DeepSeek-V3/R1 with routed experts "
                    "streamed from disk",
    )
    parser.add_argument("--version", action="version", version=f"mtplx_runtime {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    subs = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = subs[name] = sub.add_parser(name, help=help_text, description=help_text,
                                        formatter_class=DefaultsHelp)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_args(p)
    return parser, subs


def build_parser() -> argparse.ArgumentParser:
    return _build()[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse `mtplx` argv; a subcommand with `--config` gets its preset's values as defaults
    (flags given on the command line win). Raises presets.PresetError."""
    from ..engine import presets

    argv = sys.argv[1:] if argv is None else list(argv)
    parser, subs = _build()
    cmd = _command(argv)
    rest = argv[argv.index(cmd) + 1:] if cmd is not None else []
    return presets.parse_args(parser, argv, owner=subs.get(cmd), owner_argv=rest,
                              prog=f"mtplx {cmd}")


def _command(argv: list[str]) -> str | None:
    """The subcommand word: the top-level parser has no option taking a value, so it is the
    first word that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C wherever the subcommand does not handle it itself: parsing the flags imports
        # torch (a second or more), loading a model takes minutes. One line, never a traceback;
        # on a terminal the line starts below the echoed ^C.
        cmd = _command(argv)
        print(("\n" if sys.stderr.isatty() else "")
              + ("mtplx" if cmd is None else f"mtplx {cmd}") + ": interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    from ..checkpoint.safetensors_io import CheckpointError
    from ..engine.presets import PresetError
    from ..formats.base import FormatError

    # torch's OpenMP workers spin after every op by libgomp's default and crowd the native expert
    # kernels' threads off the cores: all-cached decode took 40.3 ms per token with them sleeping
    # against 50.1 (medians of 3, BENCHMARKS.md "bench_peers"). A default only, set before any
    # subcommand loads torch.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        args = parse_args(argv)
    except PresetError as e:
        print(f"mtplx {_command(argv)}: error: {e}", file=sys.stderr)
        return 2
    why = model_dir.resolve(args)
    if why is not None:
        print(f"mtplx {args.command}: error: {why}", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(args._module).main(args) or 0)
    except BrokenPipeError:
        # The reader of our output left (`mtplx inspect DIR | head`): stop quietly, as Unix
        # tools do; stdout goes to /dev/null so the exit-time flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (FormatError, CheckpointError, OSError) as e:
        # Bad input and I/O failures end the command with their message, not a traceback;
        # anything else is a bug and keeps its traceback.
        print(f"mtplx {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
