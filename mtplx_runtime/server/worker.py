"""One model, one worker thread: requests queue FIFO and stream text back to asyncio.

    HTTP handler -> Engine.submit(Request) -> FIFO queue -> worker thread: generate_step
        -> token -> channel text (think / response) -> stop-sequence filter
        -> loop.call_soon_threadsafe(asyncio.Queue.put_nowait, Event) -> HTTP handler

The worker owns the model (and its streaming provider) alone, so nothing in the model needs to be
thread-safe. A request's `cancel` flag is checked between tokens: a client that goes away frees
the engine at the next token. Any exception inside one generation becomes an "error" event for
that request only; the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..engine.chat import ChannelText

log = logging.getLogger("mtplx_runtime.server.worker")

# Events put on a request's asyncio queue: ("start",) once the first token is sampled (the
# prompt ran and sampling works: a stream may send its 200 now); ("delta", kind, text) with kind
# "content" or "reasoning"; ("done", finish_reason, usage dict, seconds); ("error", message,
# code) with code "model_error" (non-finite logits: a corrupt model) or "engine_error".


class QueueFull(Exception):
    """The engine's queue holds `max_queue` requests already (HTTP 429)."""


@dataclass
class Request:
    """One generation. `prompt_ids` are already rendered (chat) or encoded (completion)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    chat: bool = False  # split the think channel from the response (chat completions)
    thinking: bool = False  # chat: the prompt opened the think channel
    cancel: threading.Event = field(default_factory=threading.Event)
    events: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def emit(self, *event) -> None:
        """Hand an event to the asyncio side (called from the worker thread)."""
        if self.loop is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.events.put_nowait, event)
            except RuntimeError:  # the loop closed between the check and the call
                pass


class PlainText:
    """Completion text: every id as content."""

    def __init__(self, tok):
        self._dec = tok.stream_decoder()

    def push(self, t: int) -> list[tuple[str, str]]:
        return [("content", self._dec.push(t))]

    def flush(self) -> list[tuple[str, str]]:
        return [("content", self._dec.flush())]


class StopFilter:
    """Holds back text that may be the start of a stop sequence; `hit` once one is seen (the
    stop text and all after it are dropped). Stop sequences do not span channels."""

    def __init__(self, stops: list[str], emit):
        self.stops, self.emit, self.hit = [s for s in stops if s], emit, False
        self._kind, self._buf = "content", ""

    def push(self, kind: str, text: str) -> None:
        if self.hit or not text:
            return
        if kind != self._kind:
            self.flush()
            self._kind = kind
        self._buf += text
        cut = min((i for i in (self._buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self._buf = True, self._buf[:cut]
            self.flush()
            return
        # Keep the longest tail that is a proper prefix of some stop sequence.
        keep = max((n for s in self.stops for n in range(1, len(s))
                    if self._buf.endswith(s[:n])), default=0)
        if len(self._buf) > keep:
            self.emit(self._kind, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]

    def flush(self) -> None:
        if self._buf:
            self.emit(self._kind, self._buf)
        self._buf = ""


@dataclass
class Counters:
    """Engine totals for /metrics (written by the worker, read by the server)."""

    requests: int = 0
    cancelled: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_forwards: int = 0
    last_decode_tok_s: float = 0.0
    last_prefill_tok_s: float = 0.0


class Engine:
    """Owns `runtime` (an `engine.runtime.Runtime`) on one worker thread.

    `submit` never blocks: it raises QueueFull past `max_queue` waiting requests. `close` stops
    the worker after the current token and cancels everything queued.
    """

    def __init__(self, runtime, *, max_queue: int = 64, top_k: int = 0, prefill_chunk: int = 64):
        self.rt, self.top_k, self.prefill_chunk = runtime, top_k, prefill_chunk
        self.max_queue = max_queue
        self.counters = Counters()
        self.running: Request | None = None
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # makes the depth check + put in submit atomic
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._worker, name="mtplx-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting (not counting the one running)."""
        return self._queue.qsize()

    def submit(self, req: Request) -> None:
        with self._lock:
            if self._stop.is_set():
                raise QueueFull("the engine is shutting down")
            if self._queue.qsize() >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are waiting already")
            self._queue.put(req)

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self.running is not None:
            self.running.cancel.set()
        self._queue.put(None)
        self._thread.join(timeout)

    def _worker(self) -> None:
        while not self._stop.is_set():
            req = self._queue.get()
            if req is None:
                break
            if req.cancel.is_set():
                self.counters.cancelled += 1
                continue
            self.running = req
            try:
                self._run(req)
            except Exception as e:  # the one broad catch: a failed generation must not stop
                # the server; the client gets the error, the log keeps the traceback
                log.exception("generation failed")
                self.counters.failed += 1
                from ..engine.generate import NonFiniteLogits  # torch: imported on use

                code = "model_error" if isinstance(e, NonFiniteLogits) else "engine_error"
                req.emit("error", f"{type(e).__name__}: {e}", code)
            finally:
                self.running = None
        while True:  # shutting down: tell every waiter
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                return
            if req is not None:
                req.emit("error", "the server is shutting down", "engine_error")

    def _run(self, req: Request) -> None:
        from ..engine.generate import GenerationStats, generate_step

        tok, c = self.rt.tokenizer, self.counters
        text = ChannelText(tok, req.thinking) if req.chat else PlainText(tok)
        stop = StopFilter(req.stop, lambda kind, s: req.emit("delta", kind, s))
        stats = GenerationStats()
        c.requests += 1
        finish = "length"
        t0 = time.perf_counter()
        gen = generate_step(self.rt.model, req.prompt_ids, max_tokens=req.max_tokens,
                            temperature=req.temperature, top_p=req.top_p, top_k=self.top_k,
                            seed=req.seed, stop_ids=tok.stop_ids,
                            prefill_chunk=self.prefill_chunk, trace=self.rt.trace, stats=stats)
        try:
            for t in gen:
                if req.cancel.is_set():
                    break
                if stats.generated_tokens == 1:
                    req.emit("start")
                for kind, s in text.push(t):
                    stop.push(kind, s)
                if stop.hit:
                    finish = "stop"
                    break
        finally:
            gen.close()
            c.prompt_tokens += stats.prompt_tokens
            c.generated_tokens += stats.generated_tokens
            c.prefill_s += stats.prefill_s
            c.decode_s += stats.decode_s
            c.decode_forwards += stats.decode_forwards
            c.last_prefill_tok_s, c.last_decode_tok_s = stats.prefill_tok_s, stats.decode_tok_s
        if req.cancel.is_set():
            c.cancelled += 1
            return
        if not stop.hit:
            for kind, s in text.flush():
                stop.push(kind, s)
            stop.flush()
            finish = "stop" if stop.hit or stats.stop_reason == "stop" else "length"
        usage = {"prompt_tokens": stats.prompt_tokens,
                 "completion_tokens": stats.generated_tokens,
                 "total_tokens": stats.prompt_tokens + stats.generated_tokens}
        req.emit("done", finish, usage, time.perf_counter() - t0)
