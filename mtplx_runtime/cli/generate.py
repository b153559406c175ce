"""`mtplx generate`: continue a prompt (or answer it as a one-message chat), streaming text.

    --model DIR -> engine.runtime.load (tokenizer, model, expert provider, memory plan)
        -> prompt ids -> generate_step -> text to stdout as produced; one stats line to stderr

Ctrl-C stops generation at the next forward: the text's line is ended and the stats line
printed (exit status 130); a second Ctrl-C quits at once. Sampling without `--seed` draws a
fresh seed, which the stats line shows.

Routed experts stream from disk when `--memory-budget` is given or DIR is a streaming artifact
(`expert-manifest.json`): the memory plan splits the budget into cache slots (without a budget
an artifact gets the memory the OS reports available, MemAvailable). Otherwise experts are
decoded once and kept resident (tiny models, tests). The load, the turn and the stats line are
`cli/common`'s, shared with `mtplx chat` and `mtplx serve`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import (
    CliError,
    ReplyPrinter,
    add_model_args,
    chat_defaults,
    cut_note,
    fit_context,
    load_runtime,
    run_turn,
    stats_line,
)

PROG = "mtplx generate"


def add_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="prompt text ('-': read it from standard input)")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt text from FILE")
    p.add_argument("--chat", action="store_true",
                   help="render the prompt as a one-user-message chat and parse the reply")
    p.add_argument("--truncate", action="store_true",
                   help="cut a prompt that does not fit --context from the left (its start) "
                        "instead of refusing it")
    p.add_argument("--keep-special-tokens", action="store_true",
                   help="print special tokens the model generates (e.g. <|reserved_token_9|>) "
                        "instead of skipping them")
    add_model_args(p)


def prompt_text(args) -> str:
    """The prompt: --prompt TEXT, --prompt - (standard input) or --prompt-file FILE."""
    if args.prompt_file is not None:
        try:
            return Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"--prompt-file {args.prompt_file}: {e}") from None
    return sys.stdin.read() if args.prompt == "-" else args.prompt


def main(args: argparse.Namespace) -> int:
    from ..engine.chat import parse_assistant, render_chat
    from ..engine.generate import NonFiniteLogits

    try:
        text = prompt_text(args)
        rt = load_runtime(args)
    except CliError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.chat:
            chat_defaults(args, PROG)
        thinking = not args.no_thinking
        if args.chat:
            prompt = render_chat(rt.tokenizer, [{"role": "user", "content": text}],
                                 thinking=thinking)
            printer = ReplyPrinter(rt.tokenizer, thinking)
        else:
            prompt = rt.tokenizer.encode(text)
            printer = rt.tokenizer.stream_decoder(skip_special=not args.keep_special_tokens)
        if not prompt:
            print(f"{PROG}: error: the prompt encodes to no tokens", file=sys.stderr)
            return 2
        requested = args.max_tokens
        try:
            prompt, args.max_tokens = fit_context(prompt, args)
        except CliError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        try:
            ids, stats = run_turn(rt, args, prompt, printer)
        except NonFiniteLogits as e:  # a corrupt model: say so, never "empty text, exit 0"
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 1
        if args.chat:
            reply = parse_assistant(ids, rt.tokenizer, thinking=thinking)
            print(f"[reply: {len(reply['reasoning'])} chars reasoning, "
                  f"{len(reply['content'])} chars content, {len(reply['tool_calls'])} tool calls]",
                  file=sys.stderr)
            if stats.stop_reason == "length":
                limit = ("--max-tokens" if args.max_tokens == requested
                         else "the rest of --context")
                print(f"{PROG}: {cut_note(args.max_tokens, limit, printer.in_think)}",
                      file=sys.stderr)
        print(f"{PROG}: {stats_line(rt, stats)}", file=sys.stderr)
    finally:
        rt.close()
    return 130 if stats.stop_reason == "Ctrl-C" else 0
