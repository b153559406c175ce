"""`mtplx chat`: an interactive K3 conversation, one user line per turn.

    line -> /command | messages += user -> render_chat(all messages) -> generate -> stream reply
         -> parse_assistant -> messages += assistant -> next line ... /exit, Ctrl-D or Ctrl-C ends

Replies go to stdout; the banner, command output and notes go to stderr. On a terminal the
readline module (where the platform has it) gives line editing and history. Ctrl-C during a
reply sets a flag that is checked after every forward and every printed token, so the reply
stops on a step boundary: no forward is cut in half and the conversation goes on. A second
Ctrl-C before that boundary quits at once (exit 130). The model state is kept from turn to
turn (`engine.session`), so a turn prefills only what the state has not seen.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TextIO

from .common import (
    CliError,
    CtrlC,
    ReplyPrinter,
    add_model_args,
    chat_defaults,
    cut_note,
    load_runtime,
    stats_line,
)

PROG = "mtplx chat"
BANNER = (f"{PROG}: /help, /exit, /reset, /thinking on|off, /stats; "
          "Ctrl-C stops a reply, Ctrl-D or Ctrl-C at the prompt quits")
HELP = """\
  /help              this help
  /exit, /quit       end the chat (so do Ctrl-D and Ctrl-C at the prompt)
  /reset             forget the conversation (the --system message stays)
  /thinking on|off   answer after a think channel, or straight away (applies to the history too)
  /stats             the last turn: prompt tokens, TTFT, tok/s; expert cache use when streaming
  //text             send "/text" to the model
Ctrl-C during a reply stops it; the part already printed stays in the conversation.
Replies may use the rest of --context unless --max-tokens is given (a model without a chat
format stops at 256 tokens: it never ends a reply itself)."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="an optional system message")
    add_model_args(p)
    p.set_defaults(max_tokens=None)  # chat: a reply may use the rest of --context


def _cache_counters(rt) -> dict | None:
    """Compute-tier lookups and hits, bytes read and read stalls summed over the tiers, since
    load; None when experts are resident."""
    if not rt.streamed:
        return None
    totals = rt.provider.stats()["totals"]
    return {"lookups": totals["compute"]["lookups"], "hits": totals["compute"]["hits"],
            "bytes_read": sum(t["bytes_read"] for t in totals.values()),
            "stall_ms": sum(t["stall_ms"] for t in totals.values())}


class Chat:
    """One conversation over a loaded runtime; replies to `out`, everything else to `err`."""

    def __init__(self, rt, args: argparse.Namespace, out: TextIO, err: TextIO):
        from ..engine.session import Session

        self.rt, self.args, self.out, self.err = rt, args, out, err
        self.thinking = not args.no_thinking
        self.session = Session(rt.model)
        self.reset()
        self.last_stats = None
        self.last_cache: dict | None = None  # compute-tier counters over the last turn

    def note(self, text: str) -> None:
        print(f"{PROG}: {text}", file=self.err, flush=True)

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.args.system}] if self.args.system \
            else []
        self.session.reset()

    def command(self, line: str) -> bool:
        """Run one `/command` line; False when it ends the chat."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name == "/thinking":
            if arg in ("on", "off"):
                self.thinking = arg == "on"
            elif arg:
                self.note(f"/thinking takes on or off, not {arg!r}")
                return True
            self.note(f"thinking {'on' if self.thinking else 'off'}")
            return True
        if name not in ("/help", "/exit", "/quit", "/reset", "/stats"):
            self.note(f"unknown command {name}; /help lists them (// sends a leading /)")
            return True
        if arg:
            self.note(f"{name} takes no argument")
            return True
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            print(HELP, file=self.err, flush=True)
        elif name == "/reset":
            self.reset()
            self.note("conversation cleared")
        elif self.last_stats is None:
            self.note("no reply yet")
        else:
            self.note(f"last turn: {stats_line(self.rt, self.last_stats)}; "
                      f"{self.session.reused} earlier prompt tok reused")
            if self.last_cache is not None:
                c = self.last_cache
                rate = f"{100 * c['hits'] / c['lookups']:.1f}%" if c["lookups"] else "n/a"
                self.note(f"cache in the last turn: {c['lookups']} lookups, {rate} hits, "
                          f"{c['bytes_read'] / 2**20:.1f} MiB read, "
                          f"{c['stall_ms']:.0f} ms waiting for reads")
        return True

    def turn(self, text: str) -> None:
        """Answer one user line, streaming the reply; the reply joins the conversation even
        when Ctrl-C or the token limit cut it short."""
        from ..engine.chat import parse_assistant, render_chat
        from ..engine.generate import GenerationStats

        tok, args = self.rt.tokenizer, self.args
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt = render_chat(tok, messages, thinking=self.thinking)
        room = args.context - len(prompt)
        if room < 1:
            self.note(f"the conversation ({len(prompt)} tokens) fills --context {args.context}; "
                      "/reset starts over")
            return
        # A reply never runs past the context the state holds.
        max_tokens = room if args.max_tokens is None else min(args.max_tokens, room)
        printer, stats, ids = ReplyPrinter(tok, self.thinking), GenerationStats(), []
        before = _cache_counters(self.rt)
        with CtrlC() as ctrl_c:
            self.out.write(printer.prefix)
            for t in self.session.generate(
                    prompt, stats=stats, stop=lambda: ctrl_c.requested, trace=self.rt.trace,
                    max_tokens=max_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed, stop_ids=tok.stop_ids,
                    prefill_chunk=args.prefill_chunk):
                ids.append(t)
                self.out.write(printer.push(t))
                self.out.flush()
                if ctrl_c.requested:
                    break
        if ctrl_c.requested:
            stats.stop_reason = "Ctrl-C"
        tail = printer.flush()
        think_open = printer.in_think
        self.out.write(tail + ("\n</think>" if think_open else "") + "\n")
        self.out.flush()
        if stats.stop_reason == "length":
            self.note(cut_note(max_tokens, "--max-tokens" if max_tokens == args.max_tokens
                               else "the rest of --context", think_open))
        reply = parse_assistant(ids, tok, thinking=self.thinking)
        self.messages = [*messages, {"role": "assistant", "content": reply["content"],
                                     "reasoning_content": reply["reasoning"]}]
        self.last_stats = stats
        after = _cache_counters(self.rt)
        self.last_cache = None if after is None else {k: after[k] - before[k] for k in after}


def chat_loop(chat: Chat, read_line: Callable[[str], str], interactive: bool) -> int:
    """Read lines with `read_line(prompt)` (input()'s contract: EOFError at the end,
    KeyboardInterrupt on Ctrl-C) until the chat ends; the exit status."""
    from ..engine.generate import NonFiniteLogits

    if interactive:
        print(BANNER, file=chat.err, flush=True)
    while True:
        try:
            line = read_line("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D, or Ctrl-C at the prompt: a clean end
            if interactive:
                print(file=chat.err, flush=True)
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            if not chat.command(text):
                return 0
            continue
        try:
            chat.turn(text[1:] if text.startswith("//") else text)
        except KeyboardInterrupt:  # the second Ctrl-C of one reply
            chat.out.write("\n")
            chat.out.flush()
            chat.note("interrupted")
            return 130
        except NonFiniteLogits as e:  # a corrupt model: say so, never an empty reply
            chat.note(f"error: {e}")
            return 1


def _stdin_line(prompt: str) -> str:
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def main(args: argparse.Namespace) -> int:
    try:
        rt = load_runtime(args)
    except CliError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    chat_defaults(args, PROG)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (importing it gives input() editing and history)
        except ImportError:  # absent on some platforms: plain input() still works
            pass
    try:
        chat = Chat(rt, args, sys.stdout, sys.stderr)
        return chat_loop(chat, input if interactive else _stdin_line, interactive)
    finally:
        rt.close()
