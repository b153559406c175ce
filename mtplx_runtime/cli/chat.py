"""`mtplx chat`: an interactive K3 conversation, one user line per turn, read from stdin.

    stdin line -> messages += user -> render_chat(all messages) -> generate_step -> stream reply
               -> parse_assistant -> messages += assistant -> next line ... `/exit` or EOF ends

Each turn re-prefills the whole rendered conversation from a fresh state. Reusing the previous
turn's state is not simple: KDA layers keep a recurrent state, not a per-token cache, so the
state cannot be rolled back to the end of the prompt, and the re-rendered history differs from
the generated ids (the reply is re-rendered from its parsed channels; with thinking on, the
generation prompt's open think channel is now closed). Costs O(conversation) prefill per turn.
"""

from __future__ import annotations

import argparse
import sys

from .generate import CliError, ReplyPrinter, add_model_args, load_runtime, run_turn, stats_line

PROG = "mtplx chat"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="an optional system message")
    add_model_args(p)


def main(args: argparse.Namespace) -> int:
    from ..engine.chat import parse_assistant, render_chat
    from ..engine.generate import NonFiniteLogits

    try:
        rt = load_runtime(args)
    except CliError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    thinking = not args.no_thinking
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    try:
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line or line.strip() == "/exit":
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            prompt = render_chat(rt.tokenizer, messages, thinking=thinking)
            try:
                ids, stats = run_turn(rt, args, prompt, ReplyPrinter(rt.tokenizer, thinking))
            except NonFiniteLogits as e:  # a corrupt model: say so, never an empty reply
                print(f"{PROG}: error: {e}", file=sys.stderr)
                return 1
            reply = parse_assistant(ids, rt.tokenizer, thinking=thinking)
            messages.append({"role": "assistant", "content": reply["content"],
                             "reasoning_content": reply["reasoning"]})
            print(f"{PROG}: {stats_line(rt, stats)}", file=sys.stderr)
    finally:
        rt.close()
    return 0
