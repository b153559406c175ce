"""What `generate`, `chat`, `serve`, `plan` and `logits` share: the model and memory flags, the
load from parsed flags, one generated turn streamed to the terminal, the stats line.

    flags (add_model_args) -> load_runtime -> engine.runtime.load -> Runtime
        -> fit_context (prompt + reply within --context) -> run_turn (stream text) -> stats_line
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from pathlib import Path

from ..engine.options import CACHE_POLICIES, DTYPES, KERNELS, LoadOptions, OptionError
from ..formats.resident_layouts import RESIDENT_DTYPES
from .model_dir import add_model_dir

DEFAULTS = LoadOptions()  # the defaults the load flags show and start from
# A model without a chat format of its own never ends a chat reply (it was not trained to
# write the end-of-message marker): chat and serve cap its replies at this many tokens.
CHATLESS_MAX_TOKENS = 256


class CliError(Exception):
    """Bad input or a missing piece: printed as one line, exit status 2."""


def add_resident_dtype(p: argparse.ArgumentParser) -> None:
    """--resident-dtype, shared by every command that loads or plans a model."""
    p.add_argument("--resident-dtype", default=None, choices=RESIDENT_DTYPES,
                   help="resident weights (attention, shared experts, latent projections, "
                        "lm_head): bf16, or quantized at load to int8 (per channel), int4 "
                        "(groups of 32) or fp8 (e4m3 per channel; fast on CUDA >= 8.9); "
                        "router, norms and embeddings stay as stored; needs --dtype bfloat16 "
                        "(default: as the model stores them, bf16 or what build-manifest "
                        "--resident-dtype wrote)")


def add_dtype(p: argparse.ArgumentParser, help: str = "compute dtype of the model") -> None:
    """--dtype, shared by every command that loads or plans a model."""
    p.add_argument("--dtype", default=DEFAULTS.dtype, choices=DTYPES,
                   help=f"{help} (default: {DEFAULTS.dtype})")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by `generate`, `chat` and `serve`: model, sampling, memory, trace. The
    load flags are LoadOptions' fields (`--memory-budget` = memory_budget), checked there."""
    d = DEFAULTS
    add_model_dir(p, "checkpoint or streaming artifact directory")
    add_dtype(p)
    add_resident_dtype(p)
    thinking = p.add_mutually_exclusive_group()
    thinking.add_argument("--no-thinking", action="store_true", default=None,
                          help="chat: answer straight away, in the response channel (default: "
                               "think first, see --thinking)")
    thinking.add_argument("--thinking", action="store_false", dest="no_thinking", default=None,
                          help="chat: think first, in the think channel (default; but chat and "
                               "generate --chat answer straight away for a model without a chat "
                               "format of its own, a chat template or K3's encoding_k3.py beside "
                               "its config: such a model was not trained to think)")
    p.add_argument("-n", "--max-tokens", type=int, default=64, metavar="N",
                   help="most tokens to generate; none: the rest of --context (chat, serve), "
                        f"at most {CHATLESS_MAX_TOKENS} for a model without a chat format, "
                        "which never ends a reply itself")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep (1 = all)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely ids (0 = all)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: a fresh one for each reply, shown in the stats "
                        "line, or returned as `seed` by serve, so that it can be repeated; "
                        "greedy decoding, --temperature 0, needs none)")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk, metavar="N",
                   help="prompt tokens per forward")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="stream experts within this budget, e.g. 24GiB (default: resident, or "
                        "MemAvailable for a streaming artifact)")
    p.add_argument("--host-budget", default="0", metavar="SIZE",
                   help="second-tier (host) cache budget")
    p.add_argument("--device-slots", type=int, default=None, metavar="N",
                   help="stream experts through N compute-tier cache slots per MoE layer "
                        "instead of a memory budget (small models, cache experiments)")
    p.add_argument("--host-slots", type=int, default=0, metavar="N",
                   help="with --device-slots: N host-tier slots per MoE layer")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="tokens of prompt + reply the memory plan reserves state for; a longer "
                        "prompt is refused (default: the longest the memory plan affords, 4,096 "
                        "to 32,768, printed; 4,096 without a plan)")
    p.add_argument("--cache-policy", default=d.cache_policy, choices=CACHE_POLICIES,
                   help="expert cache replacement policy (streaming)")
    p.add_argument("--lookahead", type=int, default=d.lookahead, metavar="D",
                   help="prefetch experts this many layers ahead (streaming; 0 = off)")
    p.add_argument("--read-depth", type=int, default=d.read_depth, metavar="N",
                   help="expert reads in flight at once, a layer's misses and the lookahead's "
                        "guesses together (streaming)")
    p.add_argument("--decode-depth", type=int, default=d.decode_depth, metavar="N",
                   help="expert reads in flight while one token decodes, at most --read-depth: "
                        "few, so records land one by one and compute as they land (streaming)")
    p.add_argument("--kernels", default=None, choices=KERNELS,
                   help="routed-expert kernels for streamed experts (default: $MTPLX_KERNELS, "
                        "else auto: cuda with a GPU, else the native cpu kernels)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the read-time integrity checks of a streaming artifact (each "
                        "record and resident shard against the manifest's SHA-256)")
    p.add_argument("--warm", default="auto", metavar="auto|off|FILE",
                   help="warm start (streaming): fill the expert cache at load with the experts "
                        "earlier runs used most, and record this run's for the next; auto keeps "
                        "the file in the user cache directory, FILE names one in an existing "
                        "directory (default: auto)")
    p.add_argument("--warm-wait", action="store_true",
                   help="finish the warm start before the first prompt: the first token comes "
                        "later, but decode runs from the full cache (by default the warm waits "
                        "for the prompt's prefill, then fills the cache during decode)")
    p.add_argument("--trace-routes", default=None, metavar="FILE",
                   help="write the route of every token (mtplx-route-trace-v1 JSON lines) to "
                        "FILE, in an existing directory")
    from ..engine.presets import add_config_arg

    add_config_arg(p)


def check_output_dir(flag: str, path: str | None) -> None:
    """A file a command writes goes into an existing directory, never one made for it: a
    missing (or non-directory) parent is a CliError naming it."""
    if path is None:
        return
    parent = Path(path).expanduser().absolute().parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise CliError(f"{flag} {path}: its directory {parent} {what} (create it, or give "
                       "another path)")


def chat_defaults(args, prog: str, err=None) -> None:
    """Fill a chat's (chat, generate --chat) unset thinking and reply length from whether the
    model has a chat format (engine.chat.chat_format_source). With one: think first, replies
    as long as the command allows. Without (a model trained on plain text, such as the tiny K3
    of `mtplx demo`): it would never close a think channel nor end a reply, so thinking is off
    and an unlimited reply stops at CHATLESS_MAX_TOKENS; said once on `err`."""
    from ..engine.chat import chat_format_source

    err = sys.stderr if err is None else err
    if chat_format_source(args.model) is not None:
        if args.no_thinking is None:
            args.no_thinking = False
        return
    changed = []
    if args.no_thinking is None:
        args.no_thinking = True
        changed.append("it answers without thinking (--thinking to think anyway)")
    if args.max_tokens is None:
        args.max_tokens = CHATLESS_MAX_TOKENS
        changed.append(f"replies stop at {CHATLESS_MAX_TOKENS} tokens (--max-tokens N)")
    what = "; ".join(changed) if changed else f"replies stop at --max-tokens {args.max_tokens}"
    print(f"{prog}: note: {args.model} has no chat format (no chat template or encoding_k3.py): "
          f"the model was trained on plain text, never to end a reply; {what}", file=err)


def cut_note(n: int, limit: str, think_open: bool) -> str:
    """What a reply cut at its token limit says: where, and which flag gives it more room."""
    where = " inside the think channel, so no answer yet" if think_open else ""
    more = ("raise --context" if limit == "the rest of --context" else "raise --max-tokens")
    if think_open:
        more += " or pass --no-thinking"
    return f"reply cut at {n} tokens ({limit}){where}: {more} for a longer reply"


# The flag of each LoadOptions field whose flag is not its name in kebab case.
FLAGS = {"cache_slots": "--device-slots", "verify": "--no-verify"}


def flag_of(field: str) -> str:
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def load_options(args) -> LoadOptions:
    """The LoadOptions of parsed flags; a bad value is a CliError naming its flag. Output
    files (--trace-routes; --warm FILE, checked there) go into existing directories only."""
    slots = None
    if args.device_slots is not None:
        slots = (args.device_slots, args.host_slots)
    elif args.host_slots:
        raise CliError("--host-slots needs --device-slots")
    for flag, path in (("--trace-routes", args.trace_routes),
                       ("--warm", None if args.warm in ("auto", "off") else args.warm)):
        check_output_dir(flag, path)
    try:
        return LoadOptions(
            dtype=args.dtype, resident_dtype=args.resident_dtype,
            memory_budget=args.memory_budget, host_budget=args.host_budget, cache_slots=slots,
            context=args.context, prefill_chunk=args.prefill_chunk, kernels=args.kernels,
            cache_policy=args.cache_policy, lookahead=args.lookahead,
            read_depth=args.read_depth, decode_depth=args.decode_depth,
            verify=not args.no_verify, warm=args.warm,
            warm_progress=lambda line: print(line, file=sys.stderr, flush=True))
    except OptionError as e:
        raise CliError(e.named(flag_of)) from None


def fit_context(prompt: list[int], args, err=None) -> tuple[list[int], int]:
    """(prompt, max_tokens) within --context tokens of prompt + reply. A prompt that leaves no
    room for one reply token is refused, or with --truncate cut from the left; a reply that
    would run past the context is shortened. Both adjustments are said on `err`."""
    err = sys.stderr if err is None else err
    room = args.context - len(prompt)
    if room < 1:
        if not args.truncate:
            raise CliError(f"the prompt has {len(prompt)} tokens and --context is {args.context} "
                           "(tokens of prompt + reply): raise --context, or pass --truncate to "
                           "keep the prompt's last tokens")
        # Room for the reply (at least one token, at most half the context), the prompt's tail
        # in the rest.
        keep = max(1, args.context - max(1, min(args.max_tokens, args.context // 2)))
        print(f"mtplx: prompt cut from {len(prompt)} to its last {keep} tokens to fit "
              f"--context {args.context} (--truncate)", file=err)
        prompt, room = prompt[-keep:], args.context - keep
    if args.max_tokens > room:
        print(f"mtplx: reply limited to {room} tokens: --context {args.context} minus the "
              f"{len(prompt)}-token prompt", file=err)
        return prompt, room
    return prompt, args.max_tokens


def note_native_build(err=None) -> None:
    """Say so when the native CPU library is about to be compiled (once per source and
    compiler; 10-20 s), so that the first run is not silent that long."""
    from ..kernels import cpu_build

    try:
        built = cpu_build.library_path().is_file()
    except cpu_build.BuildError:  # no compiler: loading says what the kernels fall back to
        return
    if not built:
        print(f"mtplx: compiling the native CPU kernels, once (kept in "
              f"{cpu_build.cache_dir()})", file=sys.stderr if err is None else err, flush=True)


def load_runtime(args):
    """`engine.runtime.load` from parsed flags, plus the route trace (--trace-routes)."""
    from ..artifact.open import is_artifact
    from ..engine.plan import PlanError
    from ..engine.runtime import load
    from ..kernels import ENV, cuda, name_of

    if args.max_tokens is not None and args.max_tokens < 0:  # None: the rest of --context
        raise CliError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    if args.top_k < 0:
        raise CliError(f"--top-k must be >= 0, got {args.top_k}")
    if not 0 <= args.temperature < math.inf or not 0 < args.top_p <= 1:  # NaN fails both
        raise CliError("--temperature must be >= 0 and --top-p in (0, 1]")
    options = load_options(args)
    streamed = (options.memory_budget is not None or options.cache_slots is not None
                or is_artifact(args.model))
    if streamed and (options.kernels != "reference" or options.verify):
        note_native_build()  # streamed records are computed, or checked (XXH3), natively
    try:
        rt = load(args.model, options)
    except (PlanError, ValueError, RuntimeError) as e:  # budget, bank/kernel mismatch, kernels
        raise CliError(str(e)) from None
    if args.warm_wait and rt.streamed and rt.provider.warm is not None:
        t0 = time.monotonic()
        rt.provider.warm.wait()
        w = rt.provider.warm.stats()
        print(f"mtplx: warm start done before the prompt: {w['records']:,} records in "
              f"{time.monotonic() - t0:.2f} s (--warm-wait)", file=sys.stderr)
    if args.context is None:
        args.context = rt.context
        if rt.plan is not None:
            print(f"mtplx: context {rt.context:,} tokens: the longest this memory plan affords "
                  "while keeping its expert cache (--context sets it)", file=sys.stderr)
    if rt.streamed and args.no_verify:
        print("mtplx: integrity checks off (--no-verify): a damaged record or shard would go "
              "unnoticed", file=sys.stderr)
    chosen_by = args.kernels or os.environ.get(ENV) or "auto"
    if rt.streamed and chosen_by == "auto" and rt.kernels.DEVICE != "cuda":
        # The one line a user on a host without a usable GPU sees about the fallback.
        print(f"mtplx: expert kernels: {name_of(rt.kernels)} (CUDA unavailable: "
              f"{cuda.unavailable_reason()})", file=sys.stderr)
    if args.trace_routes:
        from ..engine.trace import RouteTrace

        rt.trace = RouteTrace(args.trace_routes, rt.model, model_name=str(args.model),
                              record_bytes=rt.record_bytes)
    return rt


class CtrlC:
    """While a reply is generated, SIGINT asks it to stop (`requested`) instead of raising; a
    second SIGINT before it stopped raises KeyboardInterrupt. Main thread only."""

    def __enter__(self) -> CtrlC:
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


class ReplyPrinter:
    """Streams a chat reply as text (`engine.chat.ChannelText` underneath): the think channel
    shows as `<think>` ... `</think>`, the response channel bare, other XTML tags (tool calls)
    as `<tag attrs>` / `</tag>`."""

    def __init__(self, tok, thinking: bool):
        from ..engine.chat import ChannelText

        self._channels = ChannelText(tok, thinking)
        self._kind = self._channels.kind
        # the prompt opened this channel (a chat template may not have one to open)
        self.prefix = "<think>\n" if self._kind == "reasoning" else ""

    @property
    def in_think(self) -> bool:
        """The printed text is inside an open `<think>` block."""
        return self._kind == "reasoning"

    def _render(self, pieces: list[tuple[str, str]]) -> str:
        out = []
        for kind, text in pieces:
            if kind != self._kind:
                out.append("<think>\n" if kind == "reasoning" else "\n</think>\n")
                self._kind = kind
            out.append(text)
        return "".join(out)

    def push(self, t: int) -> str:
        pieces = self._channels.push(t)
        if self._channels.kind != self._kind:  # a channel switch with no text yet shows now
            pieces = [*pieces, (self._channels.kind, "")]
        return self._render(pieces)

    def flush(self) -> str:
        return self._render(self._channels.flush())


PROGRESS_MIN_TOKENS = 1024  # shorter prompts prefill in about a second: no progress lines


class PrefillProgress:
    """A per-forward hook (`generate_step`'s `trace`) that prints a long prompt's prefill
    progress to `err` at most every `every_s` seconds and once at the end, then hands each
    forward to `inner` (the route trace, if any)."""

    def __init__(self, total: int, err, inner=None, every_s: float = 2.0, clock=None):
        self.total, self.err, self.inner, self.every_s = total, err, inner, every_s
        self.clock = clock or time.monotonic
        self.start = self.last = self.clock()

    def on_forward(self, model, phase: str, first_position: int, n_tokens: int) -> None:
        if self.inner is not None:
            self.inner.on_forward(model, phase, first_position, n_tokens)
        if phase != "prefill":
            return
        done, now = first_position + n_tokens, self.clock()
        if done >= self.total or now - self.last >= self.every_s:
            rate = done / (now - self.start) if now > self.start else 0.0
            print(f"mtplx: prefill {done:,}/{self.total:,} tokens ({rate:,.0f} tok/s)",
                  file=self.err, flush=True)
            self.last = now


def run_turn(rt, args, prompt_ids: list[int], printer, out=None):
    """Generate from prompt_ids, writing printer text to `out` as produced; (ids, stats).
    A prompt of PROGRESS_MIN_TOKENS or more reports its prefill progress on stderr. Ctrl-C
    stops generation after the current forward (`stats.stop_reason` "Ctrl-C"); the text still
    ends with a newline."""
    from ..engine.generate import GenerationStats, generate_step

    out = sys.stdout if out is None else out
    stats = GenerationStats()
    ids: list[int] = []
    hook = rt.trace
    if len(prompt_ids) >= PROGRESS_MIN_TOKENS:
        hook = PrefillProgress(len(prompt_ids), sys.stderr, inner=rt.trace)
    out.write(getattr(printer, "prefix", ""))
    with CtrlC() as ctrl_c:
        for t in generate_step(rt.model, prompt_ids, max_tokens=args.max_tokens,
                               temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                               seed=args.seed, stop_ids=rt.tokenizer.stop_ids,
                               prefill_chunk=args.prefill_chunk, trace=hook, stats=stats,
                               stop=lambda: ctrl_c.requested):
            ids.append(t)
            out.write(printer.push(t))
            out.flush()
            if ctrl_c.requested:
                break
    if ctrl_c.requested:
        stats.stop_reason = "Ctrl-C"
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


def stats_line(rt, stats) -> str:
    from ..kernels import name_of

    line = stats.summary()
    if rt.streamed:
        rate = hit_rate(rt.provider)
        line += "; cache hit rate " + ("n/a" if rate is None else f"{100 * rate:.1f}%")
        line += f"; kernels {name_of(rt.provider.kernels)}"
        warm = rt.provider.warm.stats() if rt.provider.warm is not None else None
        if warm is not None and warm["planned"]:
            line += (f"; warm {warm['records']}/{warm['planned']} records "
                     f"({warm['bytes'] / 2**20:,.1f} MiB, {warm['seconds']:.2f} s)")
    if rt.trace is not None:
        line += f"; {rt.trace.lines} route lines -> {rt.trace.path}"
    return line
