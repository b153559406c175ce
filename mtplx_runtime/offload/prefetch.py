"""Prefetcher: the one read scheduler. Every record read into a cache slot passes through it
once, and it alone decides which read the drive gets next: demand, then guesses, then the warm
start, the warm only while no prompt holds it (`_next_class_locked`, the one rule).

    demand(keys) | speculate(keys) | warm(keys) -> the queue of that class (a slot reserved;
                                                   a warm read's when its turn comes)
        -> pump: the rule picks, within the read depth and byte budget -> fill.land, fill.read
        -> bytes in (reader thread): off the drive -> pump (the drive's next read)
           -> fill.check -> fill.transfer -> fill.repack -> fill.commit (offload/fill.py)
           -> settle: resolve

The ExpertCache owns slots and replacement, the fill pipeline the steps of one read; this
module owns the reads in flight and their order (ARCHITECTURE.md "Data path"). A read is queued
until fewer than its depth of reads are at the drive (`read_depth`, or the smaller `depth` its
demand / speculate call gave: a decode step asks for few, so its records land one after another
instead of all together at the end) and the in-flight byte budget has room. Speculation may
only hold `speculative_fraction` of the budget and of the depth, so a window's misses start at
once beside the lookahead's reads; the warm start reads at the full read depth, only when no
demand read or guess waits and no prompt's prefill holds it (`hold_prompt`, `release_prompt`),
so its reads and checks never take the drive or the cores from a prompt.
The depth and the budget count reads at the drive: a read whose bytes are in gives its place
to the next one before its check runs, so a landed record's hash does not hold the drive's
place; its slot is committed only once the check has passed.
Speculative slots come from `cache.reserve(key, speculative=True)`, so whether a guess may
displace a pinned or hotter expert is the cache's call (it answers None: skip). Reader futures
cannot be cancelled: only *queued* reads are cancelled; a read already handed to the reader
finishes and is committed (or aborted on error). Reads are handed to the reader on the thread
whose call made room or work for them (demand, speculate, release_prompt, a read landing in a
reader thread), never by waking another thread: that wake waits for the GIL, 0.6 ms per layer
measured while the model's thread computes (benchmarks log, "Reads start with the route").
A decode hint opens its layer's first window of reads early; the prefetcher holds it
(`reserve`) until that layer's run_experts `claim`s it, and releases its pins if none does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from functools import partial

from .bank_reader import DEFAULT_READ_DEPTH, RecordHashError
from .fill import Extent, Fill

__all__ = ["ExpertKey", "NoSlotError", "PrefetchError", "Prefetcher", "PrefetchStats",
           "Window"]

log = logging.getLogger("mtplx_runtime.offload.prefetch")

ExpertKey = tuple[int, int]  # (layer, expert), the model's 0-based layer index


class PrefetchError(OSError):
    """One expert's read failed for good; the message names layer, expert, file and offset.
    The slot has been aborted. The original exception is `__cause__`."""

    def __init__(self, key: ExpertKey, message: str):
        super().__init__(message)
        self.key = key


class NoSlotError(RuntimeError):
    """The cache refused a slot for a demand read (`reserve` answered None twice)."""


@dataclass(slots=True)
class PrefetchStats:
    """Counters since construction. `spec_used`: speculative reads later demanded (promoted in
    flight) or reported through `note_used`; `spec_late`: those of them still queued or reading
    when demanded; `spec_lead_ms`: summed over the others, the time from a guess landing to its
    first use (mean lead = spec_lead_ms / (spec_used - spec_late)); `spec_wasted`: speculative
    reads that landed and were settled unused by `cancel_stale`; `spec_cancelled`: dropped before
    any byte was read. The warm start's reads count apart (`warm_reads`, `warm_bytes`), also
    when a forward demands one already at the drive."""

    demand_reads: int = 0
    demand_bytes: int = 0
    warm_reads: int = 0
    warm_bytes: int = 0
    spec_issued: int = 0
    spec_bytes: int = 0
    spec_used: int = 0
    spec_late: int = 0
    spec_lead_ms: float = 0.0
    spec_wasted: int = 0
    spec_cancelled: int = 0
    spec_skipped: int = 0      # speculate() keys refused: resident, in flight, no slot, cap
    failed_reads: int = 0
    stall_ms: float = 0.0      # time callers spent blocked in wait()
    peak_inflight_bytes: int = 0  # high-water mark of bytes at the drive
    peak_inflight_reads: int = 0  # high-water mark of reads at the drive (<= read_depth)
    busy_ms: float = 0.0       # time with a read at the drive, over finished busy spells

    def as_dict(self) -> dict:
        return asdict(self)


class Window:
    """One window of a layer's experts as a forward opened it: `hits` {key: SlotRef} ready to
    compute from, `futures` {key: Future[SlotRef]} of its misses' reads, every slot pinned
    until `close()` (idempotent; a context manager)."""

    __slots__ = ("hits", "futures", "_unpin")

    def __init__(self, hits: dict, futures: dict, unpin: Callable[[], None]):
        self.hits, self.futures, self._unpin = hits, futures, unpin

    def close(self) -> None:
        unpin, self._unpin = self._unpin, None
        if unpin is not None:
            unpin()

    def __enter__(self) -> Window:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Job:
    __slots__ = ("key", "part", "offset", "length", "digest", "slot", "future", "kind", "warm",
                 "depth", "state", "recorded", "at_drive", "landing")

    def __init__(self, key, extent: Extent, slot, kind: str, depth: int, warm: bool = False):
        self.key, self.slot = key, slot
        self.part, self.offset, self.length, self.digest = extent
        self.kind = kind  # "demand" | "guess" | "warm": its place in the read priority
        self.warm = warm  # issued for the warm start (stays so once a forward demands it)
        self.depth = depth  # handed to the reader only while fewer reads than this are in it
        self.future: Future = Future()
        self.future._mtplx_job = self  # lets wait() find the read behind a caller's future
        self.state = "queued"  # queued -> running -> done
        self.recorded = False   # cache.record_read called for this read
        self.at_drive = False   # handed to the reader, bytes not all in yet (counts in the depth)
        self.landing = None     # the buffer the read lands in (fill.land), until settled


class Prefetcher:
    """Reads of expert records into cache slots, one scheduler for every class of read.

    `fill`: the fill pipeline (offload/fill.Fill: its reader, bank, cache and checks); its
    cache is `self.cache`, of which this uses `reserve(key, *, speculative, transient)`,
    `abort(key)`, `record_read(key, nbytes, stall_ms)`, `where(key)`, `is_loading(key)` and
    `key in cache`.
    `max_inflight_bytes`: bytes at the drive at once; a single record larger than the budget
    runs alone. `read_depth`: reads at the drive at once; keep it at the reader's own read depth
    so nothing queues inside the reader, where demand could not overtake it (at the reader's
    full depth, a read handed over while a reader thread still checks a landed record waits
    there for that thread: a check is short next to a read).
    `speculative_fraction`: the share of the byte budget speculation may hold (queued or
    running) and of the read depth it may hold running (at least one read; of a speculate
    call's own `depth` when it gave one).
    """

    def __init__(self, fill: Fill, *, max_inflight_bytes: int,
                 speculative_fraction: float = 0.25, read_depth: int = DEFAULT_READ_DEPTH):
        if max_inflight_bytes < 1 or read_depth < 1:
            raise ValueError(f"max_inflight_bytes ({max_inflight_bytes}) and read_depth "
                             f"({read_depth}) must be >= 1")
        if not 0.0 <= speculative_fraction <= 1.0:
            raise ValueError(f"speculative_fraction must be in [0, 1], got {speculative_fraction}")
        self.fill, self.cache = fill, fill.cache
        self.max_inflight_bytes, self.read_depth = max_inflight_bytes, read_depth
        self.speculative_fraction = speculative_fraction
        self.spec_cap_bytes = int(speculative_fraction * max_inflight_bytes)
        self.spec_depth = max(1, int(speculative_fraction * read_depth))
        self.stats = PrefetchStats()
        self._cond = threading.Condition()
        self._jobs: dict[ExpertKey, _Job] = {}  # queued or running, one per key
        self._demand_q: deque[_Job] = deque()
        self._spec_q: deque[_Job] = deque()
        # The warm start's reads, lowest class: keys located but not reserved (a slot is taken
        # only when the read goes), those held by a prefill's transient slot to retry once.
        self._warm_q: deque[tuple[ExpertKey, Extent]] = deque()
        self._warm_later: list[tuple[ExpertKey, Extent]] = []
        self._warm_retried = False
        self._warm_out = 0         # warm reads handed over, not yet reported
        self._warm_skipped = 0     # no decode slot for them
        self._warm = None          # the warm start hearing of its reads, until it finished
        self._prompt_held = False  # a prompt's prefill runs: the warm issues nothing
        self._reserved: tuple[tuple, Window] | None = None  # ((layer, keys), window)
        self._inflight_bytes = 0   # at the drive: handed to the reader, bytes not all in
        self._inflight_reads = 0
        self._checking = 0         # bytes in, not settled yet (check, repack, commit)
        self._busy_since: float | None = None  # time.monotonic() the drive last went busy
        self._spec_running = 0     # speculative reads at the drive (<= spec_depth)
        self._spec_bytes = 0       # speculative bytes queued or running (the cap counts both)
        # Speculative reads committed, not yet settled: key -> time.monotonic() at landing.
        self._landed: dict[ExpertKey, float] = {}
        self._closed = False
        self._pumping = False      # a thread is handing reads to the reader (`_pump`)

    # -- the three classes of reads ---------------------------------------------------------

    def demand(self, keys: Iterable[ExpertKey], transient: bool = False,
               depth: int | None = None) -> dict[ExpertKey, Future]:
        """Queue reads the current layer needs now (cache misses). Never blocks on I/O.

        Returns {key: Future[SlotRef]}; the future resolves after the fill's commit, or raises
        PrefetchError (read or check failed, or no record: the bank's locate raised KeyError),
        NoSlotError, CancelledError (shutdown), or whatever else locating that key raised. A
        key already being read (a guess, a warm read) shares that read; a queued guess is
        promoted ahead of all queued speculation. A key whose read already landed (a lookahead
        guess committed after the caller's cache lookup) gets a resolved future and counts as a
        used guess. `transient` is passed to `cache.reserve`. `depth`: the new reads start only
        while fewer than min(depth, read_depth) reads are in flight (default read_depth); a
        promoted guess keeps the depth it was queued with.
        """
        depth = self._depth(depth)
        out: dict[ExpertKey, Future] = {}
        landed: list[ExpertKey] = []
        wake = False  # only new or promoted work can start a read
        with self._cond:
            self._check_open()
            for key in keys:
                key = (int(key[0]), int(key[1]))
                if key in out:
                    continue
                job = self._jobs.get(key)
                if job is not None and job.future.cancelled():  # a caller cancelled it queued
                    (self._spec_q if job.kind == "guess" else self._demand_q).remove(job)
                    self._drop_queued_locked(job)
                    job = None
                if job is not None:
                    if job.kind != "demand":
                        wake |= self._promote_locked(job)
                    out[key] = job.future
                    continue
                ref = self._ready_ref(key)
                if ref is not None:
                    out[key] = Future()
                    out[key].set_result(ref)
                    landed.append(key)
                    continue
                job = self._new_job_locked(key, transient=transient, depth=depth)
                if isinstance(job, Future):  # no record or no slot: an already-failed future
                    out[key] = job
                    continue
                self._demand_q.append(job)
                self.stats.demand_reads += 1
                self.stats.demand_bytes += job.length
                out[key] = job.future
                wake = True
        if wake:
            self._pump()
        if landed:
            self.note_used(landed)
        return out

    def speculate(self, keys: Iterable[ExpertKey], depth: int | None = None
                  ) -> list[ExpertKey]:
        """Queue lookahead reads, best guess first; returns the keys actually issued. Never blocks.

        Skips keys resident (`key in cache`), already in flight, without a record (locating it
        raised KeyError: a bad guess), or refused a slot (reserve answered None). Stops at the
        first key that would push queued + running speculative bytes past
        `speculative_fraction * max_inflight_bytes`. Any other exception from locating a key
        propagates; the keys issued before it stay queued. `depth`: as for `demand`.
        """
        issued: list[ExpertKey] = []
        depth = self._depth(depth)
        try:
            with self._cond:
                self._check_open()
                self._speculate_locked(keys, issued, depth)
        finally:
            if issued:
                self._pump()
        return issued

    def warm(self, keys: Iterable[ExpertKey], sink) -> None:
        """Queue the warm start's reads (keys without a record are left out), read in this order
        whenever the rule lets the warm go; a key already cached when its turn comes is passed
        over. `sink` hears of each: `landed(key, nbytes)` or `failed(key, error)`, then
        `finished(skipped)` once every read is done, or at shutdown (offload/warm.WarmStart)."""
        located = []
        for key in keys:
            key = (int(key[0]), int(key[1]))
            try:
                located.append((key, self.fill.locate(key)))
            except KeyError:
                continue
        with self._cond:
            self._check_open()
            self._warm_q.extend(located)
            self._warm = sink
        self._pump()  # also reports a warm with nothing to read finished

    def hold_prompt(self) -> None:
        """A prompt's prefill has started: the warm start issues no new read until
        `release_prompt` (its reads already at the drive finish)."""
        with self._cond:
            self._prompt_held = True

    def release_prompt(self) -> None:
        """The prompt's reads are done: the warm start may read again (from this call)."""
        with self._cond:
            held, self._prompt_held = self._prompt_held, False
        if held:
            self._pump()

    @property
    def prompt_held(self) -> bool:
        return self._prompt_held

    def next_class(self) -> str | None:
        """Which class of read the drive would get next: 'demand', 'guess', 'warm', or None
        when none may go now (`_next_class_locked`)."""
        with self._cond:
            return self._next_class_locked()

    # -- windows held between a hint and its run_experts -----------------------------------

    def reserve(self, layer: int, keys: list[ExpertKey], window: Window) -> None:
        """Hold `window`, the reads a decode hint opened for `keys` of `layer`, until that
        layer's run_experts claims it; one held before (its run_experts never came) is
        closed."""
        with self._cond:
            held, self._reserved = self._reserved, ((int(layer), tuple(keys)), window)
        if held is not None:
            held[1].close()

    def claim(self, layer: int, keys: list[ExpertKey]) -> Window | None:
        """The window held for exactly these `keys` of `layer`, now the caller's to close; None
        when none is (a window held for other keys is closed)."""
        with self._cond:
            held, self._reserved = self._reserved, None
        if held is None:
            return None
        if held[0] == (int(layer), tuple(keys)):
            return held[1]
        held[1].close()
        return None

    def release_reserved(self) -> None:
        """Close the window held, if any: its pins go."""
        with self._cond:
            held, self._reserved = self._reserved, None
        if held is not None:
            held[1].close()

    # -- guesses ---------------------------------------------------------------------------

    def cancel_stale(self, keep: set[ExpertKey]) -> list[ExpertKey]:
        """Drop queued speculative reads whose key is not in `keep` (slot aborted, future
        cancelled); running ones finish and are committed. Speculative reads that already landed
        and are not in `keep` are settled as wasted. Call after `note_used` for the layer just
        computed. Returns the cancelled keys."""
        cancelled: list[Future] = []
        keys: list[ExpertKey] = []
        with self._cond:
            kept: deque[_Job] = deque()
            for job in self._spec_q:
                if job.key in keep:
                    kept.append(job)
                else:
                    self._drop_queued_locked(job)
                    cancelled.append(job.future)
                    keys.append(job.key)
            self._spec_q = kept
            self.stats.spec_cancelled += len(keys)
            stale = self._landed.keys() - keep
            self.stats.spec_wasted += len(stale)
            for key in stale:
                del self._landed[key]
        for f in cancelled:
            f.cancel()
        return keys

    def note_used(self, keys: Iterable[ExpertKey]) -> int:
        """Report experts the model consumed from the cache (hits); those that landed through
        speculation count as used. Returns how many did."""
        now = time.monotonic()
        with self._cond:
            used = self._landed.keys() & {(int(k[0]), int(k[1])) for k in keys}
            for key in used:
                self.stats.spec_lead_ms += (now - self._landed.pop(key)) * 1e3
            self.stats.spec_used += len(used)
        return len(used)

    # -- waiting ---------------------------------------------------------------------------

    def wait(self, futures: Mapping[ExpertKey, Future], timeout: float | None = None
             ) -> dict[ExpertKey, object]:
        """Block until every future is done; returns {key: SlotRef} or raises the first failure
        (PrefetchError names the key) / TimeoutError. See `completed` for the stall accounting."""
        return dict(self.completed(futures, timeout))

    def completed(self, futures: Mapping[ExpertKey, Future], timeout: float | None = None
                  ) -> Iterator[tuple[ExpertKey, object]]:
        """Yield (key, SlotRef) as reads land, those already done first, so the caller can
        compute each expert while the rest load. The time blocked before each yield is that read's
        stall; it goes to `stats.stall_ms` and to `cache.record_read(key, nbytes, stall_ms)`,
        called once per read. Raises the read's exception when a failed future comes up."""
        for group in self.landed(futures, timeout):
            yield from group

    def landed(self, futures: Mapping[ExpertKey, Future], timeout: float | None = None
               ) -> Iterator[list[tuple[ExpertKey, object]]]:
        """As `completed`, but every read found done at once comes as one list: reads that land
        together (a drive that completes its queue in waves) can be computed together."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = dict(futures)
        done_evt = threading.Event()
        for f in pending.values():
            f.add_done_callback(lambda _f: done_evt.set())
        while pending:
            t0 = time.monotonic()
            ready = [k for k, f in pending.items() if f.done()]
            while not ready:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{len(pending)} expert read(s) still pending, e.g. "
                                       f"{next(iter(pending))}")
                done_evt.wait(left)
                done_evt.clear()
                ready = [k for k, f in pending.items() if f.done()]
            stall_ms = (time.monotonic() - t0) * 1e3
            group = []
            for i, key in enumerate(ready):
                fut = pending.pop(key)
                self._record(key, fut, stall_ms if i == 0 else 0.0)
                group.append((key, fut.result()))  # raises PrefetchError / CancelledError / ...
            yield group

    # -- reporting and lifetime ------------------------------------------------------------

    def busy_seconds(self) -> float:
        """Seconds so far with at least one read at the drive, the spell now running included:
        the difference over an interval is how long the drive had work in it."""
        with self._cond:
            now = 0.0 if self._busy_since is None else time.monotonic() - self._busy_since
            return self.stats.busy_ms / 1e3 + now

    def inflight(self) -> dict[str, int]:
        """Snapshot: bytes and reads at the drive (all, speculative), reads in and not yet
        settled (being checked), queued demand / speculative / warm counts, speculative bytes."""
        with self._cond:
            return {"inflight_bytes": self._inflight_bytes, "inflight_reads": self._inflight_reads,
                    "inflight_spec_reads": self._spec_running, "checking_reads": self._checking,
                    "queued_demand": len(self._demand_q), "queued_spec": len(self._spec_q),
                    "queued_warm": len(self._warm_q) + len(self._warm_later),
                    "spec_bytes": self._spec_bytes}

    def shutdown(self, cancel_pending: bool = True, timeout: float = 5.0) -> None:
        """Stop taking work; close the window held; end the warm start (its sink hears
        `finished`). With `cancel_pending`, queued reads are dropped (slots aborted, futures
        cancelled) and this returns without waiting for reads already in the reader: those
        complete (commit or abort) on their own. Without it, queued demand reads and guesses are
        still handed over as room frees, and this waits (up to `timeout`) until every read is
        in. Idempotent; does not close the reader."""
        cancelled: list[Future] = []
        with self._cond:
            if self._closed:
                return
            self._closed = True
            sink, self._warm = self._warm, None
            skipped = self._warm_skipped
            self._warm_q.clear()
            self._warm_later.clear()
            if cancel_pending:
                for q in (self._demand_q, self._spec_q):
                    for job in q:
                        self._drop_queued_locked(job)
                        cancelled.append(job.future)
                    q.clear()
        self.release_reserved()
        for f in cancelled:
            f.cancel()
        if sink is not None:
            sink.finished(skipped)
        if not cancel_pending:
            self._wait_idle(timeout)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- the read priority ------------------------------------------------------------------

    def _next_class_locked(self) -> str | None:
        """The one rule of read priority: the class of the read the drive gets next. A queued
        demand read goes first, and while one waits (its depth or the budget full) no other
        read starts; then a queued guess, likewise; then the warm start, only while no prompt
        holds it. None: nothing may go now."""
        if self._demand_q:
            head = self._demand_q[0]
            return "demand" if self._fits_locked(head.length, head.depth, False) else None
        if self._spec_q:
            head = self._spec_q[0]
            return "guess" if self._fits_locked(head.length, head.depth, True) else None
        if self._warm_q and not self._prompt_held:
            length = self._warm_q[0][1].length
            return "warm" if self._fits_locked(length, self.read_depth, False) else None
        return None

    def _fits_locked(self, length: int, depth: int, guess: bool) -> bool:
        if self._inflight_reads >= depth or not self.fill.room():
            return False
        if guess and self._spec_running >= max(
                1, int(self.speculative_fraction * depth)):  # spec_depth at read_depth
            return False
        # Nothing in flight: an oversize record runs alone rather than never.
        return self._inflight_bytes == 0 or self._inflight_bytes + length <= \
            self.max_inflight_bytes

    def _pick_locked(self) -> list[_Job]:
        """Every read the rule lets go now, marked running and landed (fill.land), in order."""
        batch: list[_Job] = []
        while True:
            if self._warm_later:
                self._warm_retry_locked()
            kind = self._next_class_locked()
            if kind is None:
                break
            if kind == "warm":
                job = self._warm_job_locked()
                if job is None:  # that key needed no read: look again
                    continue
            else:
                job = (self._demand_q if kind == "demand" else self._spec_q).popleft()
                if not job.future.set_running_or_notify_cancel():  # the caller cancelled it
                    self._drop_queued_locked(job)
                    continue
            self.fill.land(job)
            job.state, job.at_drive = "running", True
            if not self._inflight_reads:
                self._busy_since = time.monotonic()
            self._inflight_bytes += job.length
            self._inflight_reads += 1
            self._spec_running += job.kind == "guess"
            batch.append(job)
        self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, self._inflight_bytes)
        self.stats.peak_inflight_reads = max(self.stats.peak_inflight_reads, self._inflight_reads)
        return batch

    def _warm_job_locked(self) -> _Job | None:
        """The warm queue's head as a read with a decode slot reserved; None when that key needs
        no read now (cached already, held in a transient slot: retried once at the end, or
        refused a slot)."""
        key, extent = self._warm_q.popleft()
        ref = self.cache.where(key)
        if ref is not None:  # a forward read it first
            if ref.transient:  # its transient slot is reused soon: a warm read needs a decode one
                self._warm_later.append((key, extent))
            return None
        slot = self.cache.reserve(key, speculative=False, transient=False)
        if slot is None:
            self._warm_skipped += 1
            return None
        job = _Job(key, extent, slot, "warm", self.read_depth, warm=True)
        job.future.set_running_or_notify_cancel()
        self._jobs[key] = job
        self._warm_out += 1
        self.stats.warm_reads += 1
        self.stats.warm_bytes += extent.length
        return job

    def _warm_retry_locked(self) -> None:
        """Once the warm queue and its reads are done, the keys passed over for a transient slot
        are tried once more; still transient then, they are skipped."""
        if self._warm_q or self._warm_out or not self._warm_later:
            return
        if self._warm_retried:
            self._warm_skipped += len(self._warm_later)
            self._warm_later.clear()
        else:
            self._warm_q.extend(self._warm_later)
            self._warm_later.clear()
            self._warm_retried = True

    def _warm_finished_locked(self):
        """The warm start's sink once its every read is done (then forgotten), else None."""
        if self._warm is None or self._warm_q or self._warm_later or self._warm_out:
            return None
        sink, self._warm = self._warm, None
        return sink

    # -- one read's way: hand-over, bytes in, fill, settle ---------------------------------

    def _pump(self) -> None:
        """Hand the reader every read the rule lets go now, on this thread. One thread pumps at
        a time: another that makes room or work meanwhile returns at once, as the pumping one
        picks again until nothing goes (so a reader that completes a read inside read_into
        does not recurse). Ends by telling a warm start with nothing left that it finished."""
        with self._cond:
            if self._pumping:
                return
            self._pumping = True
        try:
            while True:
                with self._cond:
                    batch = self._pick_locked()
                    if not batch:
                        self._pumping = False
                        sink = self._warm_finished_locked() if self._warm is not None else None
                        break
                self._hand_over(batch)
        except BaseException:
            with self._cond:
                self._pumping = False
            raise
        if sink is not None:
            sink.finished(self._warm_skipped)

    def _hand_over(self, batch: list[_Job]) -> None:
        for job in batch:  # outside the lock: a reader may complete a read synchronously
            try:
                fut = self.fill.read(job)
            except BaseException as e:
                self._read_done(job, None, e)
                continue
            fut.add_done_callback(partial(self._read_done, job))

    def _read_done(self, job: _Job, fut: Future | None, error: BaseException | None = None
                   ) -> None:
        """The read step is over (its reader thread; the pumping one when the hand-over failed):
        the rest of the record's way, top to bottom. Its place at the drive goes to the next
        read first, then the bytes are checked, transferred (staged), repacked and committed,
        then the read settles."""
        if error is None:
            try:
                n = fut.result()
                if n != job.length:
                    error = OSError(f"short read: {n} of {job.length} B")
            except BaseException as e:
                error = e
        with self._cond:
            self._leave_drive_locked(job)
        try:
            self._pump()
        except Exception:  # a bug in the hand-over: logged; the landed bytes are not at fault
            log.exception("handing reads to the reader after (%d, %d) landed failed", *job.key)
        if error is None:
            try:
                self.fill.check(job)
                self.fill.transfer(job)
                self.fill.repack(job)
                self.fill.commit(job)
            except BaseException as e:  # the slot stays loading: settle aborts it
                error = e
        self._settle(job, error)

    def _leave_drive_locked(self, job: _Job) -> None:
        """The job's place at the drive and its bytes of the budget are free."""
        job.at_drive = False
        self._checking += 1
        self._inflight_bytes -= job.length
        self._inflight_reads -= 1
        if not self._inflight_reads:
            self.stats.busy_ms += (time.monotonic() - self._busy_since) * 1e3
            self._busy_since = None
        if job.kind == "guess":
            self._spec_running -= 1

    def _settle(self, job: _Job, error: BaseException | None) -> None:
        """A read's end: the job forgotten (its slot aborted on error), what now fits handed to
        the reader, its future resolved whatever that pump raised, a warm start told."""
        with self._cond:
            self._checking -= 1
            self.fill.release(job)
            if job.kind == "guess":
                self._spec_bytes -= job.length
            if error is None:
                if job.kind == "guess":
                    self._landed[job.key] = time.monotonic()
            else:
                try:
                    self.cache.abort(job.key)
                except Exception:  # logged, not raised: the future below must still resolve
                    log.exception("cache.abort(%s) failed", job.key)
                self.stats.failed_reads += 1
            job.state = "done"
            kind = job.kind  # fixed from here: the key has left _jobs, no promotion
            sink = self._warm if job.warm else None
            del self._jobs[job.key]
            self._cond.notify_all()  # _wait_idle
        try:
            self._pump()  # a freed staging buffer may let a read go
        finally:  # resolved whatever the pump raised: a waiting caller must not hang
            if error is None:
                job.future.set_result(job.slot)
                if kind != "demand":  # nobody waits on a guess or a warm read: recorded now
                    self._record(job.key, job.future, 0.0, job)
            else:
                job.future.set_exception(self._error(job, error))
            if job.warm:
                self._warm_report(job, sink, error)

    def _warm_report(self, job: _Job, sink, error: BaseException | None) -> None:
        """Tell the warm start of its read, then (the last one) that it finished."""
        if sink is not None:
            if error is None:
                sink.landed(job.key, job.length)
            else:
                sink.failed(job.key, job.future.exception())
        with self._cond:
            self._warm_out -= 1
            self._warm_retry_locked()
            if self._warm_q:  # keys to retry: the next pump issues them
                sink = None
            else:
                sink = self._warm_finished_locked()
        if sink is not None:
            sink.finished(self._warm_skipped)
        elif self._warm_q:
            self._pump()

    # -- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Prefetcher is shut down")

    def _depth(self, depth: int | None) -> int:
        if depth is None:
            return self.read_depth
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        return min(int(depth), self.read_depth)

    def _ready_ref(self, key: ExpertKey):
        """The cache's ref for `key` when it holds it ready, else None."""
        ref = self.cache.where(key)
        return None if ref is None or self.cache.is_loading(key) else ref

    def _speculate_locked(self, keys: Iterable[ExpertKey], issued: list[ExpertKey],
                          depth: int) -> None:
        for key in keys:
            key = (int(key[0]), int(key[1]))
            if key in self._jobs or key in self.cache:
                self.stats.spec_skipped += 1
                continue
            try:
                extent = self.fill.locate(key)
            except KeyError:  # no such record: a bad guess, not an error
                self.stats.spec_skipped += 1
                continue
            if self._spec_bytes + extent.length > self.spec_cap_bytes:
                self.stats.spec_skipped += 1
                break
            slot = self.cache.reserve(key, speculative=True, transient=False)
            if slot is None:
                self.stats.spec_skipped += 1
                continue
            job = _Job(key, extent, slot, "guess", depth)
            self._jobs[key] = job
            self._spec_q.append(job)
            self._spec_bytes += extent.length
            self._landed.pop(key, None)
            self.stats.spec_issued += 1
            self.stats.spec_bytes += extent.length
            issued.append(key)

    def _new_job_locked(self, key: ExpertKey, *, transient: bool, depth: int):
        """A reserved demand job, or a failed Future when the key has no record
        (PrefetchError), no slot (NoSlotError) or locating it failed otherwise (that exception,
        unwrapped)."""
        try:
            extent = self.fill.locate(key)
        except KeyError as e:
            return _failed(key, PrefetchError(key, f"expert (layer {key[0]}, expert {key[1]}): "
                                                   f"cannot locate its record: {e}"), e)
        except Exception as e:  # a bug in locating: the caller sees it as it is, on this key
            return _failed(key, e, None)
        slot = self.cache.reserve(key, speculative=False, transient=transient)
        if slot is None and not transient:  # a full cache may still lend a one-use slot
            slot = self.cache.reserve(key, speculative=False, transient=True)
        if slot is None:
            return _failed(key, NoSlotError(f"expert (layer {key[0]}, expert {key[1]}): the "
                                            "cache has no slot for a demand read"), None)
        job = _Job(key, extent, slot, "demand", depth)
        self._jobs[key] = job
        return job

    def _promote_locked(self, job: _Job) -> bool:
        """A guess or a warm read is now needed: it becomes a demand read (a guess counts as
        used and, if queued, moves to the demand queue). True when that can start a read."""
        guess, job.kind = job.kind == "guess", "demand"
        if not guess:  # a warm read: running already, it only stops counting as the warm's
            return False
        self._spec_bytes -= job.length
        self.stats.spec_used += 1
        self.stats.spec_late += 1
        if job.state == "queued":
            self._spec_q.remove(job)
            self._demand_q.append(job)
        elif job.at_drive:
            self._spec_running -= 1  # a demand read now: frees a speculative place
        return True

    def _drop_queued_locked(self, job: _Job) -> None:
        del self._jobs[job.key]
        if job.kind == "guess":
            self._spec_bytes -= job.length
        self.cache.abort(job.key)

    def _error(self, job: _Job, cause: BaseException) -> PrefetchError:
        parts = getattr(self.fill.reader, "parts", None)
        try:
            name = parts[job.part][0]
        except (TypeError, LookupError):  # a reader without `parts`, or not this part
            name = f"part {job.part}"
        kind = {"guess": "speculative"}.get(job.kind, job.kind)
        # Damaged bytes are the bank's fault, not the read's: say how to find every bad record.
        hint = ("; the bank is damaged: `mtplx verify --records ARTIFACT` names every bad record"
                if isinstance(cause, RecordHashError) else "")
        err = PrefetchError(job.key, f"expert (layer {job.key[0]}, expert {job.key[1]}): "
                                     f"{kind} read of {name} (part {job.part}) at offset "
                                     f"{job.offset} length {job.length} failed: "
                                     f"{type(cause).__name__}: {cause}{hint}")
        err.__cause__ = cause
        return err

    def _record(self, key: ExpertKey, fut: Future, stall_ms: float, job: _Job | None = None
                ) -> None:
        """One cache.record_read per successful read: guesses and warm reads at landing,
        demand at wait."""
        job = job or getattr(fut, "_mtplx_job", None)
        with self._cond:
            self.stats.stall_ms += stall_ms
            if job is None or job.recorded or not fut.done() or fut.cancelled() \
                    or fut.exception() is not None:
                return
            job.recorded = True
            self.cache.record_read(key, job.length, stall_ms)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._inflight_reads or self._checking) and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))


def _failed(key: ExpertKey, err: BaseException, cause: BaseException | None) -> Future:
    if cause is not None:
        err.__cause__ = cause
    f: Future = Future()
    f.set_exception(err)
    return f
