"""One model, one worker thread: requests queue FIFO and stream text back to asyncio.

    HTTP handler -> Engine.submit(Request) -> FIFO queue -> worker thread: generate_step
        -> token -> channel text (think / response) -> stop-sequence filter
        -> loop.call_soon_threadsafe(asyncio.Queue.put_nowait, Event) -> HTTP handler

The worker owns the model (and its streaming provider) alone, so nothing in the model needs to be
thread-safe. A request's `cancel` flag is checked after every forward (prefill chunks included):
a client that goes away frees the engine at the next one. `Engine.stop` (server shutdown) ends
the running generation the same way and answers every queued request at once. Any exception
inside one generation becomes an "error" event for that request only; the worker keeps serving.
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
# "content" or "reasoning"; ("done", finish_reason, usage dict, seconds) with finish_reason
# "stop", "length" or "abort" (the server stopped after "start"); ("error", message, code) with
# code "model_error" (non-finite logits: a corrupt model) or "engine_error"; ("shutdown",): the
# server stopped before the request's first token (HTTP 503).


class QueueFull(Exception):
    """The engine's queue holds `max_queue` requests already (HTTP 429)."""


class ShuttingDown(Exception):
    """The engine is stopping and takes no more requests (HTTP 503)."""


@dataclass
class Request:
    """One generation. `prompt_ids` are already rendered (chat) or encoded (completion)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh one (generate_step)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    skip_special: bool = True  # drop special ids (`"special": true`) from completion text
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
    """Completion text: every id as content (special ids skipped unless `skip_special` is
    False, as HF's and vLLM's `skip_special_tokens`)."""

    def __init__(self, tok, skip_special: bool = True):
        self._dec = tok.stream_decoder(skip_special=skip_special)

    def push(self, t: int) -> list[tuple[str, str]]:
        return [("content", self._dec.push(t))]

    def flush(self) -> list[tuple[str, str]]:
        return [("content", self._dec.flush())]


class StopFilter:
    """Ends the text at the first stop sequence to complete, in time linear in the text.

    Text is held back while it may be the start of a stop sequence; once one completes, `hit`
    is set and the text from that occurrence on is dropped. "First" is the earliest end (of
    occurrences ending at the same character, the longest), so the result never depends on how
    the text was cut into pieces. Each stop runs a Knuth-Morris-Pratt matcher whose state is the
    longest text tail that is a prefix of it: that is also how much to hold back, so each
    character costs amortised O(stops), whatever the stops' lengths. Stop sequences do not span
    channels."""

    def __init__(self, stops: list[str], emit):
        self.stops, self.emit, self.hit = [s for s in stops if s], emit, False
        self._fail = [_failure(s) for s in self.stops]
        self._kind, self._buf = "content", ""
        self._state = [0] * len(self.stops)  # matched prefix length per stop

    def push(self, kind: str, text: str) -> None:
        if self.hit or not text:
            return
        if kind != self._kind:
            self.flush()
            self._kind = kind
        buf = self._buf + text  # held back (shorter than the longest stop) + the new text
        for j in range(len(self._buf), len(buf)):
            ch, done = buf[j], 0  # done: the longest stop that this character completes
            for i, s in enumerate(self.stops):
                k, fail = self._state[i], self._fail[i]
                while k and s[k] != ch:
                    k = fail[k - 1]
                k = k + 1 if s[k] == ch else 0
                if k == len(s):
                    done, k = max(done, k), fail[k - 1]
                self._state[i] = k
            if done:
                self.hit, self._buf = True, buf[:j + 1 - done]
                self.flush()
                return
        keep = max(self._state, default=0)
        if len(buf) > keep:
            self.emit(self._kind, buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]

    def flush(self) -> None:
        """Emit what is held back (the text ended or changes channel): no stop can complete."""
        if self._buf:
            self.emit(self._kind, self._buf)
        self._buf = ""
        self._state = [0] * len(self.stops)


def _failure(s: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper prefix of s[:i + 1] that is
    also its suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


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

    `submit` never blocks: it raises QueueFull past `max_queue` waiting requests, ShuttingDown
    once `stop` was called. `stop` (any thread, returns at once) answers every queued request
    ("shutdown") and ends the running one after its current forward ("done" with "abort", or
    "shutdown" before its first token); `close` stops and joins the worker.
    """

    def __init__(self, runtime, *, max_queue: int = 64, top_k: int = 0, prefill_chunk: int = 64):
        self.rt, self.top_k, self.prefill_chunk = runtime, top_k, prefill_chunk
        self.max_queue = max_queue
        self.counters = Counters()
        self.running: Request | None = None
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # makes the checks + put in submit and the drain in stop
        self._stopping = threading.Event()  # atomic with each other
        self._thread = threading.Thread(target=self._worker, name="mtplx-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting (not counting the one running)."""
        return self._queue.qsize()

    def submit(self, req: Request) -> None:
        with self._lock:
            if self._stopping.is_set():
                raise ShuttingDown("the server is shutting down")
            if self._queue.qsize() >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are waiting already")
            self._queue.put(req)

    def stop(self) -> None:
        """Take no more requests, answer the queued ones, end the running one at its next
        forward. Does not wait."""
        with self._lock:
            self._stopping.set()
            while True:
                try:
                    req = self._queue.get_nowait()
                except queue.Empty:
                    break
                if req is not None:
                    req.emit("shutdown")
            self._queue.put(None)  # wakes an idle worker, which then ends

    def close(self, timeout: float = 10.0) -> bool:
        """`stop`, then wait up to `timeout` s for the worker (its forward in progress) to end;
        whether it has."""
        self.stop()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _worker(self) -> None:
        while (req := self._queue.get()) is not None:
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

    def _run(self, req: Request) -> None:
        from ..engine.generate import GenerationStats, generate_step

        tok, c = self.rt.tokenizer, self.counters
        text = ChannelText(tok, req.thinking) if req.chat else PlainText(tok, req.skip_special)
        stop = StopFilter(req.stop, lambda kind, s: req.emit("delta", kind, s))
        stats = GenerationStats()
        c.requests += 1
        finish = "length"
        t0 = time.perf_counter()

        def halted() -> bool:  # the client left, or the server is stopping
            return req.cancel.is_set() or self._stopping.is_set()

        gen = generate_step(self.rt.model, req.prompt_ids, max_tokens=req.max_tokens,
                            temperature=req.temperature, top_p=req.top_p, top_k=self.top_k,
                            seed=req.seed, frequency_penalty=req.frequency_penalty,
                            presence_penalty=req.presence_penalty, stop_ids=tok.stop_ids,
                            prefill_chunk=self.prefill_chunk, trace=self.rt.trace, stats=stats,
                            stop=halted)
        started = cut = False
        try:
            for t in gen:
                if not started:
                    started = True
                    req.emit("start")
                for kind, s in text.push(t):
                    stop.push(kind, s)
                if stop.hit:
                    finish = "stop"
                    break
                if halted():  # before the next forward (generate_step asks after each one)
                    cut = True
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
        if cut or stats.stop_reason == "stopped":  # the server is stopping
            if not started:  # nothing was sent: the client gets a 503
                req.emit("shutdown")
                return
            finish = "abort"
        if not stop.hit:
            for kind, s in text.flush():
                stop.push(kind, s)
            stop.flush()
            if finish != "abort":
                finish = "stop" if stop.hit or stats.stop_reason == "stop" else "length"
        usage = {"prompt_tokens": stats.prompt_tokens,
                 "completion_tokens": stats.generated_tokens,
                 "total_tokens": stats.prompt_tokens + stats.generated_tokens}
        req.emit("done", finish, usage, time.perf_counter() - t0)
