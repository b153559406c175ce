"""`mtplx generate`: continue a prompt (or answer it as a one-message chat), streaming text.

    --model DIR -> tokenizer + model (+ streaming provider sized by the memory plan)
        -> prompt ids -> generate_step -> text to stdout as produced; one stats line to stderr

Routed experts stream from disk when `--memory-budget` is given or DIR is a streaming artifact
(`expert-manifest.json`): `plan.make_plan` splits the budget into device/host cache slots and
`streaming.StreamingExpertProvider` is attached to the model. Without a budget an artifact gets
the memory the OS reports available (MemAvailable). Otherwise experts are decoded once and kept
resident (tiny models, tests). `load_runtime`, `run_turn` and `ReplyPrinter` are shared with
`mtplx chat` (`chat_cli`).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

PROG = "mtplx generate"


class CliError(Exception):
    """Bad input or a missing piece: printed as one line, exit status 2."""


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by `generate` and `chat`: model, sampling, memory, trace."""
    p.add_argument("--model", required=True, help="checkpoint or streaming artifact directory")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--no-thinking", action="store_true",
                   help="chat: render with thinking off (answer in the response channel)")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep (1 = all)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely ids (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens per forward")
    p.add_argument("--memory-budget", default=None,
                   help="stream experts within this budget, e.g. 24GiB (default: resident, or "
                        "MemAvailable for a streaming artifact)")
    p.add_argument("--host-budget", default="0", help="second-tier (host) cache budget")
    p.add_argument("--context", type=int, default=4096,
                   help="longest sequence the memory plan reserves state for")
    p.add_argument("--cache-policy", default="lru", choices=("lru", "freq"),
                   help="expert cache replacement policy (streaming)")
    p.add_argument("--lookahead", type=int, default=1,
                   help="prefetch experts this many layers ahead (streaming; 0 = off)")
    p.add_argument("--kernels", default=None, choices=("auto", "reference", "cpu", "cuda"),
                   help="routed-expert kernels for streamed experts (default: $MTPLX_KERNELS, "
                        "else auto: cuda with a GPU, else the native cpu kernels)")
    p.add_argument("--trace-routes", default=None, metavar="FILE",
                   help="write the route of every token (mtplx-route-trace-v1 JSON lines)")
    from ..engine.presets import add_config_arg

    add_config_arg(p)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true",
                   help="render the prompt as a one-user-message chat and parse the reply")
    add_model_args(p)


@dataclass
class Runtime:
    """What a generation run needs, loaded once."""

    tok: object  # tokenizer.Tokenizer
    model: object  # model.kimi_k3.KimiK3
    provider: object | None = None  # the streaming provider, None when resident
    trace: object | None = None  # trace.RouteTrace
    plan: object | None = None  # plan.MemoryPlan when streaming

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if self.provider is not None:
            self.provider.close()


def _mem_available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise CliError("cannot read MemAvailable; give --memory-budget")


def _attach_streaming(args, model, kernels):
    """(provider, plan): the streaming provider sized by the memory plan, attached to model."""
    from ..artifact.manifest import MANIFEST_NAME
    from ..engine.plan import PlanError, make_plan
    from ..offload import provider as streaming

    if not (Path(args.model) / MANIFEST_NAME).is_file():
        raise CliError(f"{args.model} is not a streaming artifact (no {MANIFEST_NAME}); build "
                       "one with `mtplx build-manifest`, or drop --memory-budget")
    budget = args.memory_budget or _mem_available_bytes()
    # load_model opened the artifact: reuse its manifest instead of parsing it twice more.
    manifest = getattr(model.checkpoint, "manifest", None)
    try:
        plan = make_plan(args.model, memory_budget=budget, host_budget=args.host_budget,
                         context=args.context, dtype=args.dtype,
                         prefill_chunk=args.prefill_chunk, manifest=manifest)
    except PlanError as e:
        raise CliError(str(e)) from None
    try:
        provider = streaming.StreamingExpertProvider(
            args.model, model.cfg, model.dtype,
            device_bytes=plan.device_slots * plan.record_stride,
            host_bytes=plan.host_slots * plan.record_stride,
            policy=args.cache_policy, lookahead=args.lookahead, manifest=manifest,
            kernels=kernels)
    except ValueError as e:  # a bank the chosen kernels cannot run, or an inconsistent bank
        raise CliError(str(e)) from None
    streaming.attach(model, provider)
    return provider, plan


def _kernels(name: str | None):
    """The kernel backend module for --kernels (select_backend's errors as CliError)."""
    from ..kernels import select_backend

    try:
        return select_backend(name)
    except (ValueError, RuntimeError) as e:
        raise CliError(str(e)) from None


def _record_bytes(model_dir: str) -> int | None:
    """Logical bytes of one expert record, for the trace header; None if it cannot be told."""
    from ..engine.plan import PlanError, facts_from_dir

    try:
        return facts_from_dir(model_dir).record_bytes
    except (PlanError, ValueError, OSError, KeyError):
        return None


def load_runtime(args) -> Runtime:
    """Tokenizer, model, optional streaming provider and route trace from parsed flags."""
    from ..artifact.manifest import MANIFEST_NAME
    from ..engine.tokenizer import load_tokenizer
    from ..model.kimi_k3 import load_model

    for flag, v, low in (("--max-tokens", args.max_tokens, 0), ("--top-k", args.top_k, 0),
                         ("--prefill-chunk", args.prefill_chunk, 1),
                         ("--lookahead", args.lookahead, 0), ("--context", args.context, 1)):
        if v < low:
            raise CliError(f"{flag} must be >= {low}, got {v}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise CliError("--temperature must be >= 0 and --top-p in (0, 1]")
    tok = load_tokenizer(args.model)
    streamed = args.memory_budget is not None or (Path(args.model) / MANIFEST_NAME).is_file()
    if not streamed and args.kernels not in (None, "auto", "reference"):
        raise CliError(f"--kernels {args.kernels} runs on streamed experts: give a streaming "
                       "artifact (mtplx build-manifest) or drop --kernels")
    kernels = _kernels(args.kernels) if streamed else None
    from ..kernels import ENV, cuda, name_of

    chosen_by = args.kernels or os.environ.get(ENV) or "auto"
    if kernels is not None and chosen_by == "auto" and kernels.DEVICE != "cuda":
        # The one line a user on a host without a usable GPU sees about the fallback.
        print(f"mtplx: expert kernels: {name_of(kernels)} (CUDA unavailable: "
              f"{cuda.unavailable_reason()})", file=sys.stderr)
    # With the CUDA kernels the resident tensors (attention, router, shared experts...) live on
    # the GPU too, next to the expert slots; every other backend runs the model on the CPU.
    on_gpu = kernels is not None and kernels.DEVICE == "cuda"
    model = load_model(args.model, dtype=args.dtype, device="cuda" if on_gpu else "cpu")
    rt = Runtime(tok, model)
    if streamed:
        rt.provider, rt.plan = _attach_streaming(args, model, kernels)
    if args.trace_routes:
        from ..engine.trace import RouteTrace

        record = rt.plan.record_bytes if rt.plan is not None else _record_bytes(args.model)
        rt.trace = RouteTrace(args.trace_routes, model, model_name=str(args.model),
                              record_bytes=record)
    return rt


class ReplyPrinter:
    """Streams a chat reply as text: the think channel shows as `<think>` ... `</think>`, the
    response channel bare, other XTML tags (tool calls) as `<tag attrs>` / `</tag>`."""

    def __init__(self, tok, thinking: bool):
        from ..engine.chat import CLOSE, OPEN, SEP

        self._tok, self._dec = tok, tok.stream_decoder(skip_special=True)
        self._open, self._close, self._sep = tok.special(OPEN), tok.special(CLOSE), tok.special(SEP)
        self._header: list[int] | None = None  # ids between a marker and its <|sep|>
        self._closing = False
        self.prefix = "<think>\n" if thinking else ""  # the prompt opened this channel

    def push(self, t: int) -> str:
        if t in (self._open, self._close):
            self._header, self._closing = [], t == self._close
            return self._dec.flush()
        if self._header is None:
            return self._dec.push(t)
        if t != self._sep:
            self._header.append(t)
            return ""
        head, self._header = self._tok.decode(self._header), None
        tag = head.split(" ", 1)[0]
        if tag == "think":
            return "\n</think>\n" if self._closing else "<think>\n"
        if tag in ("response", "message"):
            return ""
        return f"</{tag}>" if self._closing else f"<{head}>"

    def flush(self) -> str:
        return self._dec.flush()


def run_turn(rt: Runtime, args, prompt_ids: list[int], printer, out=None):
    """Generate from prompt_ids, writing printer text to `out` as produced; (ids, stats)."""
    from ..engine.generate import GenerationStats, generate_step

    out = sys.stdout if out is None else out
    stats = GenerationStats()
    ids: list[int] = []
    out.write(getattr(printer, "prefix", ""))
    for t in generate_step(rt.model, prompt_ids, max_tokens=args.max_tokens,
                           temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                           seed=args.seed, stop_ids=rt.tok.stop_ids,
                           prefill_chunk=args.prefill_chunk, trace=rt.trace, stats=stats):
        ids.append(t)
        out.write(printer.push(t))
        out.flush()
    out.write(printer.flush() + "\n")
    out.flush()
    return ids, stats


def hit_rate(provider) -> float | None:
    """Cache hit rate from `provider.stats()` (a dict or an object; `hit_rate`, or hits and
    misses); None when it tells neither."""
    s = provider.stats()
    get = s.get if isinstance(s, dict) else (lambda k, d=None: getattr(s, k, d))
    rate = get("hit_rate", None)
    if rate is None:
        hits, misses = get("hits", None), get("misses", None)
        if hits is not None and misses is not None and hits + misses:
            rate = hits / (hits + misses)
    return None if rate is None else float(rate)


def stats_line(rt: Runtime, stats) -> str:
    from ..kernels import name_of

    line = stats.summary()
    if rt.provider is not None:
        rate = hit_rate(rt.provider)
        line += "; cache hit rate " + ("n/a" if rate is None else f"{100 * rate:.1f}%")
        line += f"; kernels {name_of(rt.provider.kernels)}"
    if rt.trace is not None:
        line += f"; {rt.trace.lines} route lines -> {rt.trace.path}"
    return line


def main(args: argparse.Namespace) -> int:
    from ..engine.chat import parse_assistant, render_chat

    try:
        rt = load_runtime(args)
    except CliError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        thinking = not args.no_thinking
        if args.chat:
            prompt = render_chat(rt.tok, [{"role": "user", "content": args.prompt}],
                                 thinking=thinking)
            printer = ReplyPrinter(rt.tok, thinking)
        else:
            prompt = rt.tok.encode(args.prompt)
            printer = rt.tok.stream_decoder()
        if not prompt:
            print(f"{PROG}: error: the prompt encodes to no tokens", file=sys.stderr)
            return 2
        ids, stats = run_turn(rt, args, prompt, printer)
        if args.chat:
            reply = parse_assistant(ids, rt.tok, thinking=thinking)
            print(f"[reply: {len(reply['reasoning'])} chars reasoning, "
                  f"{len(reply['content'])} chars content, {len(reply['tool_calls'])} tool calls]",
                  file=sys.stderr)
        print(f"{PROG}: {stats_line(rt, stats)}", file=sys.stderr)
    finally:
        rt.close()
    return 0
