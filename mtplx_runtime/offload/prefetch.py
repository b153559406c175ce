"""Prefetcher: moves expert records from the bank straight into cache slots, demand first.

    demand(keys) / speculate(keys) -> reserve slot -> queue (demand | speculative)
        -> pump (read depth, byte budget, demand first) -> reader.read_into(slot buffer)
        -> bytes in (on_read): off the drive -> pump
        -> completion (after the reader's check): commit|abort -> pump

The ExpertCache owns slots and replacement; this module owns only the in-flight reads
(ARCHITECTURE.md "Packages"). A read is queued until fewer than its depth of reads are in flight
(`read_depth`, or the smaller `depth` its demand / speculate call gave: a decode step asks for
few, so its records land one after another instead of all together at the end) and the
in-flight byte budget has room; queued demand reads always go before queued speculation, and
speculation may only hold `speculative_fraction` of the budget and of the depth, so a window's
misses start at once beside the lookahead's reads instead of queueing behind them.
The depth and the budget count reads at the drive: a read whose bytes are in gives its place
to the next one before its check runs (on_read), so a landed record's hash does not hold the
drive's place; its slot is committed only once the check has passed.
Speculative slots come from `cache.reserve(key, speculative=True)`, so whether a guess may
displace a pinned or hotter expert is the cache's call (it answers None: skip). Reader futures
cannot be cancelled: only *queued* reads are cancelled; a read already handed to the reader
finishes and is committed (or aborted on error) by its completion callback. Reads are handed to
the reader on the thread whose call made room or work for them (demand, speculate, a completion
in a reader thread), never by waking another thread: that wake waits for the GIL, 0.6 ms per
layer measured while the model's thread computes (BENCHMARKS.md "Reads start with the
route")."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from functools import partial

from .bank_reader import DEFAULT_READ_DEPTH, Digest, RecordHashError

__all__ = ["ExpertKey", "PrefetchError", "NoSlotError", "Prefetcher", "PrefetchStats"]

log = logging.getLogger("mtplx_runtime.offload.prefetch")

ExpertKey = tuple[int, int]  # (layer, expert), the model's 0-based layer index
# locate(key) -> (part index, absolute byte offset in the part file, length in bytes, digest|None);
# KeyError when the key has no record. Any other exception is a bug and is not swallowed.
Locate = Callable[[ExpertKey], tuple[int, int, int, "Digest | None"]]


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
    any byte was read."""

    demand_reads: int = 0
    demand_bytes: int = 0
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


class _Job:
    __slots__ = ("key", "part", "offset", "length", "digest", "slot", "future", "speculative",
                 "depth", "state", "recorded", "at_drive")

    def __init__(self, key, part, offset, length, digest, slot, speculative, depth):
        self.key, self.part, self.offset, self.length = key, part, offset, length
        self.digest, self.slot, self.speculative = digest, slot, speculative
        self.depth = depth  # handed to the reader only while fewer reads than this are in it
        self.future: Future = Future()
        self.future._mtplx_job = self  # lets wait() find the read behind a caller's future
        self.state = "queued"  # queued -> running -> done
        self.recorded = False   # cache.record_read called for this read
        self.at_drive = False   # handed to the reader, bytes not all in yet (counts in the depth)


class Prefetcher:
    """Background reads of expert records into cache slots under a bounded in-flight byte budget.

    `reader`: `read_into(part, offset, length, buf, digest=None, on_read=None) -> Future[int]`
    (RecordReader): `on_read()` once the bytes are in, before the check; a reader that never
    calls it keeps the read's place at the drive until the future resolves.
    `locate(key)`: (part, absolute offset, length, digest | None) of one record, the digest a
    SHA-256 or a reader Check; KeyError when the key has no record.
    `cache`: an ExpertCache; this uses `reserve(key, *, speculative, transient)`, `buffer(ref)`,
    `commit(key)`, `abort(key)`, `record_read(key, nbytes, stall_ms)`, `where(key)`,
    `is_loading(key)` and `key in cache`.
    `max_inflight_bytes`: bytes at the drive at once; a single record larger than the budget
    runs alone. `read_depth`: reads at the drive at once; keep it at the reader's own read depth
    so nothing queues inside the reader, where demand could not overtake it (at the reader's
    full depth, a read handed over while a reader thread still checks a landed record waits
    there for that thread: a check is short next to a read).
    `speculative_fraction`: the share of the byte budget speculation may hold (queued or
    running) and of the read depth it may hold running (at least one read; of a speculate
    call's own `depth` when it gave one).
    """

    def __init__(self, reader, locate: Locate, cache, *, max_inflight_bytes: int,
                 speculative_fraction: float = 0.25, read_depth: int = DEFAULT_READ_DEPTH):
        if max_inflight_bytes < 1 or read_depth < 1:
            raise ValueError(f"max_inflight_bytes ({max_inflight_bytes}) and read_depth "
                             f"({read_depth}) must be >= 1")
        if not 0.0 <= speculative_fraction <= 1.0:
            raise ValueError(f"speculative_fraction must be in [0, 1], got {speculative_fraction}")
        self.reader, self.locate, self.cache = reader, locate, cache
        self.max_inflight_bytes, self.read_depth = max_inflight_bytes, read_depth
        self.speculative_fraction = speculative_fraction
        self.spec_cap_bytes = int(speculative_fraction * max_inflight_bytes)
        self.spec_depth = max(1, int(speculative_fraction * read_depth))
        self.stats = PrefetchStats()
        self._cond = threading.Condition()
        self._jobs: dict[ExpertKey, _Job] = {}  # queued or running, one per key
        self._demand_q: deque[_Job] = deque()
        self._spec_q: deque[_Job] = deque()
        self._inflight_bytes = 0   # at the drive: handed to the reader, bytes not all in
        self._inflight_reads = 0
        self._checking = 0         # bytes in, completion (the reader's check) still to come
        self._busy_since: float | None = None  # time.monotonic() the drive last went busy
        self._spec_running = 0     # speculative reads at the drive (<= spec_depth)
        self._spec_bytes = 0       # speculative bytes queued or running (the cap counts both)
        # Speculative reads committed, not yet settled: key -> time.monotonic() at landing.
        self._landed: dict[ExpertKey, float] = {}
        self._closed = False
        self._pumping = False      # a thread is handing reads to the reader (`_pump`)

    # -- public API -------------------------------------------------------------------------

    def demand(self, keys: Iterable[ExpertKey], transient: bool = False,
               depth: int | None = None) -> dict[ExpertKey, Future]:
        """Queue reads the current layer needs now (cache misses). Never blocks on I/O.

        Returns {key: Future[SlotRef]}; the future resolves after `cache.commit(key)`, or raises
        PrefetchError (read failed or no record: `locate` raised KeyError), NoSlotError,
        CancelledError (shutdown), or whatever else `locate` raised for that key. A key
        already being read (demand or speculative) shares that read; a speculative one is
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
                    (self._spec_q if job.speculative else self._demand_q).remove(job)
                    self._drop_queued_locked(job)
                    job = None
                if job is not None:
                    if job.speculative:
                        self._promote_locked(job)
                        wake = True
                    out[key] = job.future
                    continue
                ref = self._ready_ref(key)
                if ref is not None:
                    out[key] = Future()
                    out[key].set_result(ref)
                    landed.append(key)
                    continue
                job = self._new_job_locked(key, speculative=False, transient=transient,
                                           depth=depth)
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

    def _ready_ref(self, key: ExpertKey):
        """The cache's ref for `key` when it holds it ready, else None."""
        ref = self.cache.where(key)
        return None if ref is None or self.cache.is_loading(key) else ref

    def speculate(self, keys: Iterable[ExpertKey], depth: int | None = None
                  ) -> list[ExpertKey]:
        """Queue lookahead reads, best guess first; returns the keys actually issued. Never blocks.

        Skips keys resident (`key in cache`), already in flight, without a record (`locate`
        raised KeyError: a bad guess), or refused a slot (reserve answered None). Stops at the
        first key that would push queued + running speculative bytes past
        `speculative_fraction * max_inflight_bytes`. Any other exception from `locate` propagates;
        the keys issued before it stay queued. `depth`: as for `demand`.
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

    def _speculate_locked(self, keys: Iterable[ExpertKey], issued: list[ExpertKey],
                          depth: int) -> None:
        for key in keys:
            key = (int(key[0]), int(key[1]))
            if key in self._jobs or key in self.cache:
                self.stats.spec_skipped += 1
                continue
            try:
                part, offset, length, digest = self.locate(key)
            except KeyError:  # no such record: a bad guess, not an error
                self.stats.spec_skipped += 1
                continue
            if self._spec_bytes + length > self.spec_cap_bytes:
                self.stats.spec_skipped += 1
                break
            slot = self.cache.reserve(key, speculative=True, transient=False)
            if slot is None:
                self.stats.spec_skipped += 1
                continue
            job = _Job(key, part, offset, length, digest, slot, speculative=True, depth=depth)
            self._jobs[key] = job
            self._spec_q.append(job)
            self._spec_bytes += length
            self._landed.pop(key, None)
            self.stats.spec_issued += 1
            self.stats.spec_bytes += length
            issued.append(key)

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

    def busy_seconds(self) -> float:
        """Seconds so far with at least one read at the drive, the spell now running included:
        the difference over an interval is how long the drive had work in it."""
        with self._cond:
            now = 0.0 if self._busy_since is None else time.monotonic() - self._busy_since
            return self.stats.busy_ms / 1e3 + now

    def inflight(self) -> dict[str, int]:
        """Snapshot: bytes and reads at the drive (all, speculative), reads in and being
        checked, queued demand / speculative counts."""
        with self._cond:
            return {"inflight_bytes": self._inflight_bytes, "inflight_reads": self._inflight_reads,
                    "inflight_spec_reads": self._spec_running, "checking_reads": self._checking,
                    "queued_demand": len(self._demand_q), "queued_spec": len(self._spec_q),
                    "spec_bytes": self._spec_bytes}

    def shutdown(self, cancel_pending: bool = True, timeout: float = 5.0) -> None:
        """Stop taking work. With `cancel_pending`, queued reads are dropped (slots aborted,
        futures cancelled) and this returns without waiting for reads already in the reader:
        those complete (commit or abort) from their callbacks. Without it, queued reads are
        still handed over as room frees, and this waits (up to `timeout`) until every read is
        in. Idempotent; does not close the reader."""
        cancelled: list[Future] = []
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if cancel_pending:
                for q in (self._demand_q, self._spec_q):
                    for job in q:
                        self._drop_queued_locked(job)
                        cancelled.append(job.future)
                    q.clear()
        for f in cancelled:
            f.cancel()
        if not cancel_pending:
            self._wait_idle(timeout)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

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

    def _new_job_locked(self, key: ExpertKey, *, speculative: bool, transient: bool,
                        depth: int):
        """A reserved job, or a failed Future when the key has no record (PrefetchError), no
        slot (NoSlotError) or `locate` failed otherwise (that exception, unwrapped)."""
        try:
            part, offset, length, digest = self.locate(key)
        except KeyError as e:
            return _failed(key, PrefetchError(key, f"expert (layer {key[0]}, expert {key[1]}): "
                                                   f"cannot locate its record: {e}"), e)
        except Exception as e:  # a bug in locate: the caller sees it as it is, on this key
            return _failed(key, e, None)
        slot = self.cache.reserve(key, speculative=speculative, transient=transient)
        if slot is None and not transient:  # a full cache may still lend a one-use slot
            slot = self.cache.reserve(key, speculative=speculative, transient=True)
        if slot is None:
            return _failed(key, NoSlotError(f"expert (layer {key[0]}, expert {key[1]}): the "
                                            "cache has no slot for a demand read"), None)
        job = _Job(key, part, offset, length, digest, slot, speculative, depth)
        self._jobs[key] = job
        return job

    def _promote_locked(self, job: _Job) -> None:
        """A speculative read is now needed: count it used and, if queued, move it to demand."""
        job.speculative = False
        self._spec_bytes -= job.length
        self.stats.spec_used += 1
        self.stats.spec_late += 1
        if job.state == "queued":
            self._spec_q.remove(job)
            self._demand_q.append(job)
        elif job.at_drive:
            self._spec_running -= 1  # a demand read now: frees a speculative place

    def _drop_queued_locked(self, job: _Job) -> None:
        del self._jobs[job.key]
        if job.speculative:
            self._spec_bytes -= job.length
        self.cache.abort(job.key)

    def _fits_locked(self, job: _Job) -> bool:
        if self._inflight_reads >= job.depth:
            return False
        if job.speculative and self._spec_running >= max(
                1, int(self.speculative_fraction * job.depth)):  # spec_depth at read_depth
            return False
        # Nothing in flight: an oversize record runs alone rather than never.
        return self._inflight_bytes == 0 or self._inflight_bytes + job.length <= \
            self.max_inflight_bytes

    def _pick_locked(self) -> list[_Job]:
        """Jobs to hand to the reader now: demand in order; speculation only when no demand read
        is waiting (a queued demand read blocks all queued speculation)."""
        batch: list[_Job] = []
        for q in (self._demand_q, self._spec_q):
            while q and self._fits_locked(q[0]):
                job = q.popleft()
                if not job.future.set_running_or_notify_cancel():  # the caller cancelled it
                    self._drop_queued_locked(job)
                    continue
                job.state, job.at_drive = "running", True
                if not self._inflight_reads:
                    self._busy_since = time.monotonic()
                self._inflight_bytes += job.length
                self._inflight_reads += 1
                self._spec_running += job.speculative
                batch.append(job)
            if q:
                break
        self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, self._inflight_bytes)
        self.stats.peak_inflight_reads = max(self.stats.peak_inflight_reads, self._inflight_reads)
        return batch

    def _pump(self) -> None:
        """Hand the reader every queued read that fits now, on this thread. One thread pumps at
        a time: another that makes room or work meanwhile returns at once, as the pumping one
        picks again until nothing fits (so a reader that completes a read inside read_into does
        not recurse)."""
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
                        return
                self._hand_over(batch)
        except BaseException:
            with self._cond:
                self._pumping = False
            raise

    def _hand_over(self, batch: list[_Job]) -> None:
        for job in batch:  # outside the lock: a reader may complete a read synchronously
            try:
                buf = self.cache.buffer(job.slot)
                if buf.nbytes < job.length:
                    raise ValueError(f"slot buffer holds {buf.nbytes} B, record needs "
                                     f"{job.length}")
                fut = self.reader.read_into(job.part, job.offset, job.length, buf,
                                            digest=job.digest,
                                            on_read=partial(self._on_read, job))
            except BaseException as e:
                self._finish(job, None, e)
                continue
            fut.add_done_callback(lambda f, job=job: self._finish(job, f, None))

    def _off_drive_locked(self, job: _Job) -> bool:
        """The job's place at the drive and its bytes of the budget are free (once): True if
        this call freed them."""
        if not job.at_drive:
            return False
        job.at_drive = False
        self._inflight_bytes -= job.length
        self._inflight_reads -= 1
        if not self._inflight_reads:
            self.stats.busy_ms += (time.monotonic() - self._busy_since) * 1e3
            self._busy_since = None
        if job.speculative:
            self._spec_running -= 1
        return True

    def _on_read(self, job: _Job) -> None:
        """The reader has every byte (its thread, before the check): the next read goes to
        the drive while this one is checked."""
        with self._cond:
            if self._off_drive_locked(job):
                self._checking += 1
        try:
            self._pump()
        except Exception:  # a bug in the hand-over: logged; the landed bytes are not at fault
            log.exception("handing reads to the reader after (%d, %d) landed failed", *job.key)

    def _finish(self, job: _Job, fut: Future | None, error: BaseException | None) -> None:
        """Completion (a reader thread; the pumping one when the hand-over failed): commit or
        abort, free the budget if on_read has not, hand the reader what now fits, resolve."""
        if error is None:
            try:
                n = fut.result()
                if n != job.length:
                    error = OSError(f"short read: {n} of {job.length} B")
            except BaseException as e:
                error = e
        with self._cond:
            if not self._off_drive_locked(job):
                self._checking -= 1
            if job.speculative:
                self._spec_bytes -= job.length
            if error is None:
                try:
                    self.cache.commit(job.key)
                except BaseException as e:  # resolve the future whatever the cache does
                    error = e
            if error is None:
                if job.speculative:
                    self._landed[job.key] = time.monotonic()
            else:
                try:
                    self.cache.abort(job.key)
                except Exception:  # logged, not raised: the future below must still resolve
                    log.exception("cache.abort(%s) failed", job.key)
                self.stats.failed_reads += 1
            job.state = "done"
            spec = job.speculative  # fixed from here: the key has left _jobs, no promotion
            del self._jobs[job.key]
            self._cond.notify_all()  # _wait_idle
        try:
            self._pump()  # the freed place first: the drive gets its next read before any caller
        finally:  # resolved whatever the pump raised: a waiting caller must not hang
            if error is None:
                job.future.set_result(job.slot)
                if spec:  # nobody waits on a guess: its bytes are recorded now
                    self._record(job.key, job.future, 0.0, job)
            else:
                job.future.set_exception(self._error(job, error))

    def _error(self, job: _Job, cause: BaseException) -> PrefetchError:
        parts = getattr(self.reader, "parts", None)
        try:
            name = parts[job.part][0]
        except (TypeError, LookupError):  # a reader without `parts`, or not this part
            name = f"part {job.part}"
        kind = "speculative" if job.speculative else "demand"
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
        """One cache.record_read per successful read: guesses at landing, demand at wait."""
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

