"""Prefetcher (the read scheduler) and the fill pipeline against a fake slow bank and the real
ExpertCache (CPU slots, calls recorded): the read priority (demand, guesses, warm; the prompt's
hold), ordering, back-pressure, speculation cap, stale cancellation, promotion, held windows,
the fill's steps, errors, shutdown without hang; plus one run on a real artifact."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import Counter
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import numpy as np
import pytest

from mtplx_runtime.artifact.open import RecordLocation
from mtplx_runtime.offload.bank_reader import RecordHashError
from mtplx_runtime.offload.cache import ExpertCache
from mtplx_runtime.offload.fill import Fill
from mtplx_runtime.offload.prefetch import NoSlotError, Prefetcher, PrefetchError, Window

REC = 4096  # bytes per fake record
T_OUT = 10.0  # every wait in this file is bounded


def until(pred, timeout=T_OUT):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


def offset_of(key):
    return (key[0] * 1000 + key[1]) * REC


def key_of(offset):
    i = offset // REC
    return (i // 1000, i % 1000)


class Bank:
    """Record (layer, expert) at offset_of(key) of part 0; KeyError for `missing` experts, and
    `bug` experts raise TypeError (a bug in locating, not a missing record)."""

    def __init__(self, missing=(), bug=()):
        self.missing, self.bug = set(missing), set(bug)

    def locate(self, layer, expert):
        if expert in self.missing:
            raise KeyError((layer, expert))
        if expert in self.bug:
            raise TypeError("locate bug")
        return RecordLocation(0, offset_of((layer, expert)), REC, None)


def prefetcher(reader, cache, bank=None, digests=None, repack=None, **kw):
    return Prefetcher(Fill(reader, bank or Bank(), cache, digests=digests, repack=repack), **kw)


def pattern(key, n=REC):
    return np.full(n, (key[0] * 31 + key[1]) % 251, np.uint8)


class FakeReader:
    """Async reads on its own threads; optional gate holds every read until released.
    Instruments bytes in flight (max_bytes) and the order reads start; a read's future
    resolves once its bytes are in, as RecordReader's does."""

    parts = [("bank.bin", 1 << 40, 0)]

    def __init__(self, delay_s=0.0, fail=(), short=(), gated=False):
        self.delay_s, self.fail, self.short = delay_s, set(fail), set(short)
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.pool = ThreadPoolExecutor(64)
        self.lock = threading.Lock()
        self.cur_bytes = self.max_bytes = 0
        self.starts: list = []
        self.reads: Counter = Counter()
        self.on_land = lambda: None  # called as each read lands, before its future resolves

    def read_into(self, part, offset, length, buf):
        fut: Future = Future()
        key = key_of(offset)
        with self.lock:
            self.cur_bytes += length
            self.max_bytes = max(self.max_bytes, self.cur_bytes)
            self.starts.append(key)
            self.reads[key] += 1

        def run():
            try:
                self.gate.wait(T_OUT)
                time.sleep(self.delay_s)
                if key in self.fail:
                    raise OSError(errno.EIO, "Input/output error")
                n = length - 1 if key in self.short else length
                buf[:n] = pattern(key, n)
            except BaseException as e:
                with self.lock:
                    self.cur_bytes -= length
                fut.set_exception(e)
                return
            with self.lock:  # before the future: the budget frees once the bytes are in
                self.cur_bytes -= length
            self.on_land()
            fut.set_result(n)

        self.pool.submit(run)
        return fut

    def close(self):
        self.gate.set()
        self.pool.shutdown(wait=True)


class SpyCache(ExpertCache):
    """The real ExpertCache (CPU slots, one global LRU scope) recording the calls the tests
    check. `refuse`: keys reserve answers None for; `resident`: keys committed up front."""

    def __init__(self, refuse=(), resident=(), slots=512, record_bytes=REC):
        super().__init__(record_bytes, slots * record_bytes, scope="global", policy="lru",
                         device="cpu")
        self.refuse = set(refuse)
        self.aborted: list = []
        self.records: list = []
        self.reserve_calls: list = []
        for key in resident:
            super().reserve(key)
            self.commit(key)

    def reserve(self, key, *, speculative=False, transient=False):
        self.reserve_calls.append((key, speculative, transient))
        if key in self.refuse:
            return None
        return super().reserve(key, speculative=speculative, transient=transient)

    def abort(self, key):
        super().abort(key)
        self.aborted.append(tuple(key))

    def record_read(self, key, nbytes, stall_ms=0.0, tier="compute"):
        super().record_read(key, nbytes, stall_ms, tier)
        self.records.append((key, nbytes, stall_ms))

    def ready(self, key) -> bool:
        return key in self and not self.is_loading(key)

    def data(self, key):
        return self.buffer(self.where(key))


@pytest.fixture
def make():
    made = []

    def _make(reader=None, cache=None, **kw):
        reader = reader or FakeReader()
        cache = cache or SpyCache()
        kw.setdefault("max_inflight_bytes", 8 * REC)
        pf = prefetcher(reader, cache, **kw)
        made.append((pf, reader))
        return pf, reader, cache

    yield _make
    for pf, reader in made:
        reader.gate.set()
        pf.shutdown()
        reader.close()


def keys(layer, n, start=0):
    return [(layer, e) for e in range(start, start + n)]


class WaitClock:
    """The prefetch module's clock, faked: it opens the reader's gate when `wait` reads it the
    second time (the first is its deadline, the second the start of its stall), and each read
    that lands then moves it 50 ms on. So every read lands after the caller started waiting and
    the stall is a number of landings, not of scheduler delays."""

    def __init__(self, gate: threading.Event):
        self.gate, self.now, self.calls, self.lock = gate, 0.0, 0, threading.Lock()

    def monotonic(self) -> float:
        with self.lock:
            self.calls += 1
            now, open_gate = self.now, self.calls == 2
        if open_gate:
            self.gate.set()
        return now

    def land(self) -> None:
        with self.lock:
            self.now += 0.05


def test_demand_reads_land_in_slots_and_are_recorded_once(make, monkeypatch):
    from mtplx_runtime.offload import prefetch

    pf, reader, cache = make(reader=FakeReader(gated=True))
    futs = pf.demand(keys(1, 5))
    clock = WaitClock(reader.gate)
    reader.on_land = clock.land
    monkeypatch.setattr(prefetch, "time", clock)
    slots = pf.wait(futs, timeout=T_OUT)
    monkeypatch.undo()
    assert set(slots) == set(keys(1, 5))
    for k in keys(1, 5):
        assert cache.ready(k) and np.array_equal(cache.data(k), pattern(k))
    assert sorted(r[0] for r in cache.records) == keys(1, 5)
    assert all(r[1] == REC for r in cache.records)
    assert 50 <= pf.stats.stall_ms <= 5 * 50 and pf.stats.demand_reads == 5
    assert sum(r[2] for r in cache.records) == pytest.approx(pf.stats.stall_ms)
    assert pf.stats.demand_bytes == 5 * REC
    pf.wait(futs, timeout=T_OUT)  # waiting again records nothing new
    assert len(cache.records) == 5


def test_landed_groups_reads_found_done_together(make):
    """`landed` yields every read once: those done before a wait as one group, each later one
    as it lands; the stall is recorded once per wait, on the group's first read."""
    pf, reader, cache = make(reader=FakeReader(gated=True))
    first = pf.demand(keys(1, 3))
    reader.gate.set()
    until(lambda: all(f.done() for f in first.values()))
    reader.gate.clear()
    late = pf.demand(keys(1, 1, start=3))
    groups = pf.landed({**first, **late}, timeout=T_OUT)
    got = next(groups)
    assert sorted(k for k, _ in got) == keys(1, 3)
    assert all(ref == cache.where(k) for k, ref in got)
    reader.gate.set()
    assert [k for k, _ in next(groups)] == [(1, 3)]
    assert next(groups, None) is None
    assert sorted(r[0] for r in cache.records) == keys(1, 4)
    assert [k for k, _ in pf.completed(first, timeout=T_OUT)] == keys(1, 3)  # flat, no re-record
    assert len(cache.records) == 4


@pytest.mark.parametrize("limit", ["read_depth", "bytes"])
def test_demand_goes_before_queued_speculation(make, limit):
    # Either one read at a time, or a budget of two records filled by two demand reads.
    kw = ({"read_depth": 1} if limit == "read_depth"
          else {"max_inflight_bytes": 2 * REC, "read_depth": 8})
    first = [(1, 0)] if limit == "read_depth" else [(1, 0), (1, 5)]
    pf, reader, cache = make(reader=FakeReader(gated=True), speculative_fraction=1.0, **kw)
    a = pf.demand(first)
    until(lambda: sorted(reader.starts) == first)
    assert pf.speculate([(2, 0), (2, 1)]) == [(2, 0), (2, 1)]
    b = pf.demand([(1, 1)])
    assert pf.inflight()["queued_demand"] == 1 and pf.inflight()["queued_spec"] == 2
    reader.gate.set()
    pf.wait({**a, **b}, timeout=T_OUT)
    until(lambda: cache.ready((2, 1)))
    assert reader.starts[len(first):] == [(1, 1), (2, 0), (2, 1)]


class HeldReader:
    """Reads that land only on command: `read_into` returns a pending future and `land(key)`
    fills the slot and resolves it on the calling thread (where the fill's check and commit then
    run). Counts reads in flight (and their peak) under a condition, so tests wait for an exact
    count, never for time."""

    parts = [("bank.bin", 1 << 40, 0)]

    def __init__(self):
        self.cond = threading.Condition()
        self.held: dict = {}  # key -> (buffer, future), in the order reads started
        self.started: list = []  # every read's key, in the order they started
        self.peak = 0
        self.peak_by_layer: Counter = Counter()  # most reads of each layer in flight at once

    def read_into(self, part, offset, length, buf):
        fut: Future = Future()
        key = key_of(offset)
        with self.cond:
            self.held[key] = (buf, fut)
            self.started.append(key)
            self.peak = max(self.peak, len(self.held))
            now = Counter(k[0] for k in self.held)
            for layer, n in now.items():
                self.peak_by_layer[layer] = max(self.peak_by_layer[layer], n)
            self.cond.notify_all()
        return fut

    def inflight(self) -> list:
        with self.cond:
            return list(self.held)

    def wait_inflight(self, pred) -> list:
        """Block until `pred(keys in flight)` holds; returns those keys."""
        with self.cond:
            assert self.cond.wait_for(lambda: pred(list(self.held)), T_OUT), list(self.held)
            return list(self.held)

    def land(self, key) -> None:
        with self.cond:
            buf, fut = self.held.pop(key)
        buf[:REC] = pattern(key)
        fut.set_result(REC)


def test_demand_and_lookahead_reads_share_the_read_depth():
    """A layer's guesses for the next layer go first (the model hints before it computes), then
    the layer's misses: both are in flight together, up to the read depth and no further, the
    guesses held to their share so the misses start at once."""
    depth = 8
    reader, cache = HeldReader(), SpyCache()
    with prefetcher(reader, cache, read_depth=depth, speculative_fraction=0.5,
                    max_inflight_bytes=64 * REC) as pf:
        assert pf.spec_depth == 4
        guesses, misses = keys(2, 8), keys(1, 6)
        assert pf.speculate(guesses) == guesses
        on = reader.wait_inflight(lambda ks: len(ks) == 4)
        assert set(on) <= set(guesses) and pf.inflight()["queued_spec"] == 4
        futs = pf.demand(misses)
        on = reader.wait_inflight(lambda ks: len(ks) == depth)
        assert sorted(on) == sorted(guesses[:4] + misses[:4])
        assert pf.inflight() == {"inflight_bytes": depth * REC, "inflight_reads": depth,
                                 "inflight_spec_reads": 4, "checking_reads": 0, "queued_demand": 2,
                                 "queued_spec": 4, "queued_warm": 0, "spec_bytes": 8 * REC}
        # A guess lands: its place goes to the next miss, not to the next guess.
        reader.land(guesses[0])
        on = reader.wait_inflight(lambda ks: len(ks) == depth)
        assert misses[4] in on and guesses[4] not in on
        # The misses land: each freed place goes to a queued miss while one is left, then to the
        # guesses, but only up to their share.
        for key in misses:
            reader.wait_inflight(lambda ks, key=key: key in ks)
            reader.land(key)
        assert pf.wait(futs, timeout=T_OUT).keys() == set(misses)
        on = reader.wait_inflight(lambda ks: len(ks) == 4)
        assert on == guesses[1:5] and pf.inflight()["queued_spec"] == 3
        for key in guesses[1:]:
            reader.wait_inflight(lambda ks, key=key: key in ks)
            reader.land(key)  # commits and records on this thread, in the reader's callback
        assert reader.peak == depth and pf.stats.peak_inflight_reads == depth
        assert reader.peak_by_layer[2] == 4 and reader.peak_by_layer[1] == 5
        assert all(cache.ready(k) and np.array_equal(cache.data(k), pattern(k))
                   for k in guesses + misses)


def test_a_call_depth_caps_its_own_reads_below_the_read_depth():
    """A decode step's reads (demand and guesses at depth 4) never have more than 4 in flight,
    the guesses at most half of them, though the read depth is 16; a later call at the full
    depth (a prefill window) fills the reader to 16."""
    reader, cache = HeldReader(), SpyCache()
    with prefetcher(reader, cache, read_depth=16, speculative_fraction=0.5,
                    max_inflight_bytes=64 * REC) as pf:
        guesses, misses, window = keys(2, 6), keys(1, 6), keys(3, 20)
        assert pf.speculate(guesses, depth=4) == guesses
        assert sorted(reader.wait_inflight(lambda ks: len(ks) == 2)) == guesses[:2]
        futs = pf.demand(misses, depth=4)
        assert sorted(reader.wait_inflight(lambda ks: len(ks) == 4)) == sorted(
            guesses[:2] + misses[:2])
        for key in misses:  # each landing frees one of the 4 places for the next miss
            reader.wait_inflight(lambda ks, key=key: key in ks)
            assert pf.inflight()["inflight_reads"] <= 4
            reader.land(key)
        assert pf.wait(futs, timeout=T_OUT).keys() == set(misses)
        assert pf.stats.peak_inflight_reads == 4 and reader.peak_by_layer[2] == 2
        big = pf.demand(window)  # the full read depth: 4 guesses queued, 16 places
        on = reader.wait_inflight(lambda ks: len(ks) == 16)
        assert sum(k[0] == 3 for k in on) == 14  # beside the 2 guesses still held
        # queued guesses keep their depth of 4: they wait until the window has drained
        for key in guesses[:2] + window + guesses[2:]:
            reader.wait_inflight(lambda ks, key=key: key in ks)
            reader.land(key)
        assert pf.wait(big, timeout=T_OUT).keys() == set(window)
        assert pf.stats.peak_inflight_reads == 16
        with pytest.raises(ValueError, match="depth must be >= 1"):
            pf.demand(keys(4, 1), depth=0)


def test_a_guess_demanded_in_flight_gives_its_speculative_place_back():
    reader, cache = HeldReader(), SpyCache()
    with prefetcher(reader, cache, read_depth=4, speculative_fraction=0.5,
                    max_inflight_bytes=64 * REC) as pf:
        guesses = keys(3, 4)
        assert pf.speculate(guesses) == guesses and pf.spec_depth == 2
        assert reader.wait_inflight(lambda ks: len(ks) == 2) == guesses[:2]
        futs = pf.demand([guesses[0]])  # now a demand read: a guess may take its place
        assert reader.wait_inflight(lambda ks: len(ks) == 3) == guesses[:3]
        assert pf.inflight()["inflight_spec_reads"] == 2 and pf.inflight()["queued_spec"] == 1
        for key in guesses:
            reader.wait_inflight(lambda ks, key=key: key in ks)
            reader.land(key)
        assert pf.wait(futs, timeout=T_OUT).keys() == {guesses[0]}
        assert reader.peak_by_layer[3] == 3 and pf.stats.spec_used == 1


def test_reads_are_handed_over_on_the_thread_that_made_room_for_them():
    """demand hands its first reads to the reader before it returns, and a read that lands
    hands the next queued one over on the landing thread: no other thread has to wake (and
    wait for the GIL) between a free place and the drive's next read."""
    reader, cache = HeldReader(), SpyCache()
    with prefetcher(reader, cache, read_depth=2, max_inflight_bytes=64 * REC) as pf:
        misses = keys(1, 5)
        futs = pf.demand(misses)
        assert reader.inflight() == misses[:2]  # no wait: already in the reader
        for i, key in enumerate(misses):
            reader.land(key)  # resolves on this thread: the next read starts inside the call
            assert reader.inflight() == misses[i + 1:i + 3]
        assert pf.wait(futs, timeout=T_OUT).keys() == set(misses)
        guesses = keys(2, 3)
        assert pf.speculate(guesses) == guesses
        assert reader.inflight() == guesses[:1]  # the speculative share of a depth of 2
        for key in guesses:
            reader.land(key)
        assert not reader.inflight() and all(cache.ready(k) for k in guesses)


class SyncReader:
    """Completes every read inside read_into (a reader with the bytes at hand may)."""

    parts = [("bank.bin", 1 << 40, 0)]

    def read_into(self, part, offset, length, buf):
        buf[:length] = pattern(key_of(offset), length)
        fut: Future = Future()
        fut.set_result(length)
        return fut


def test_a_reader_that_completes_inside_read_into_does_not_recurse():
    """Each completion makes room for the next read; handed over by the thread already handing
    reads over, 3000 of them at depth 1 go one after another, not 3000 calls deep."""
    many = [k for layer in (1, 2, 3) for k in keys(layer, 1000)]  # 1000 a layer: offset_of
    cache = SpyCache(slots=len(many))
    with prefetcher(SyncReader(), cache, read_depth=1,
                    max_inflight_bytes=4 * REC) as pf:
        futs = pf.demand(many)
        assert all(f.done() for f in futs.values())
        assert pf.wait(futs, timeout=T_OUT).keys() == set(many)
        assert all(np.array_equal(cache.data(k), pattern(k)) for k in many)


class RefusingReader(HeldReader):
    """A HeldReader whose read_into raises at once for the keys in `refuse` (a closed reader,
    a bad request): the failure reaches the prefetcher on whichever thread handed it over."""

    def __init__(self, refuse):
        super().__init__()
        self.refuse = set(refuse)

    def read_into(self, part, offset, length, buf):
        if key_of(offset) in self.refuse:
            raise ValueError(f"refused {key_of(offset)}")
        return super().read_into(part, offset, length, buf)


def test_a_read_refused_at_hand_over_fails_its_key_and_the_pump_goes_on():
    """read_into raising fails only that read (slot aborted, PrefetchError naming it), whether
    the caller's demand handed it over or a landing did on its own thread, and the reads queued
    behind it still go."""
    misses = keys(1, 4)
    reader, cache = RefusingReader(refuse={misses[0], misses[2]}), SpyCache()
    with prefetcher(reader, cache, read_depth=1, max_inflight_bytes=64 * REC) as pf:
        futs = pf.demand(misses)  # (1, 0) refused inside demand; (1, 1) handed over after it
        assert reader.inflight() == [misses[1]]
        reader.land(misses[1])  # this landing hands over (1, 2): refused; then (1, 3)
        assert reader.inflight() == [misses[3]]
        reader.land(misses[3])
        for key in misses:
            if key in reader.refuse:
                with pytest.raises(PrefetchError, match=f"expert {key[1]}.*refused"):
                    futs[key].result(T_OUT)
            else:
                assert futs[key].result(T_OUT) == cache.where(key)
        assert sorted(cache.aborted) == [misses[0], misses[2]]
        assert pf.stats.failed_reads == 2 and pf.inflight()["inflight_reads"] == 0


def test_a_pump_that_fails_still_resolves_the_read_that_landed(monkeypatch, caplog):
    """The pump a landing runs comes before its future resolves (the drive first); should it
    raise (a bug), the landed read still resolves, the error is logged by the future's callback
    runner, and the next pump hands over what was left queued."""
    reader, cache = HeldReader(), SpyCache()
    with prefetcher(reader, cache, read_depth=1, max_inflight_bytes=64 * REC) as pf:
        futs = pf.demand(keys(1, 2))
        pick = pf._pick_locked
        monkeypatch.setattr(pf, "_pick_locked", lambda: (_ for _ in ()).throw(RuntimeError("bug")))
        reader.land((1, 0))
        assert futs[(1, 0)].result(T_OUT) == cache.where((1, 0))
        assert "bug" in caplog.text and not reader.inflight()
        monkeypatch.setattr(pf, "_pick_locked", pick)
        more = pf.demand([(1, 2)])  # the next pump: (1, 1) first, as it was queued first
        assert reader.inflight() == [(1, 1)]
        reader.land((1, 1))
        reader.land((1, 2))
        assert pf.wait({**futs, **more}, timeout=T_OUT).keys() == set(keys(1, 3))


class Gate:
    """A record check that runs until the test opens it: the bytes are in, the check is not
    done. `started` is set once it runs; `ok=False` fails it."""

    def __init__(self, ok=True):
        self.started, self.opened, self.ok = threading.Event(), threading.Event(), ok

    def verify(self, view) -> str | None:
        self.started.set()
        assert self.opened.wait(T_OUT)
        return None if self.ok else "do not match (test)"


class Checks:
    """A RecordDigests stand-in: the check of each key (`gates`), a passing one for the rest."""

    class Pass:
        def verify(self, view):
            return None

    def __init__(self, gates=None):
        self.gates = gates or {}

    def check(self, key):
        return self.gates.get(key) or self.Pass()


def land_in_thread(reader, key) -> threading.Thread:
    """Land `key` on a thread of its own: the fill's check runs there."""
    t = threading.Thread(target=reader.land, args=(key,))
    t.start()
    return t


def test_a_landed_read_gives_its_place_to_the_next_before_its_check_ends():
    """The depth counts reads at the drive: once a read's bytes are in, the next read goes
    while the first is still being checked, and the first's slot is committed only when its
    check has passed. A guess demanded while it is checked gives back no place twice."""
    first, guess = Gate(), Gate()
    reader, cache = HeldReader(), SpyCache()
    with prefetcher(reader, cache, digests=Checks({(1, 0): first, (2, 0): guess}),
                    read_depth=1, max_inflight_bytes=64 * REC) as pf:
        futs = pf.demand(keys(1, 2))
        assert reader.inflight() == [(1, 0)]
        lander = land_in_thread(reader, (1, 0))
        assert first.started.wait(T_OUT)  # its check is running: (1, 1) went to the drive before
        assert reader.inflight() == [(1, 1)]
        assert not futs[(1, 0)].done() and not cache.ready((1, 0))
        assert pf.inflight()["inflight_reads"] == 1 and pf.inflight()["checking_reads"] == 1
        first.opened.set()
        lander.join(T_OUT)
        assert futs[(1, 0)].result(T_OUT) == cache.where((1, 0)) and cache.ready((1, 0))
        assert pf.inflight()["checking_reads"] == 0
        reader.land((1, 1))
        assert pf.wait(futs, timeout=T_OUT).keys() == set(keys(1, 2))
        assert pf.speculate([(2, 0)]) == [(2, 0)]
        lander = land_in_thread(reader, (2, 0))
        assert guess.started.wait(T_OUT)
        assert pf.inflight()["inflight_spec_reads"] == 0
        more = pf.demand([(2, 0)])  # promoted while checked: its place was already given back
        assert pf.inflight()["inflight_spec_reads"] == 0 and pf.stats.spec_used == 1
        guess.opened.set()
        lander.join(T_OUT)
        assert pf.wait(more, timeout=T_OUT).keys() == {(2, 0)}
        assert pf.inflight() == {"inflight_bytes": 0, "inflight_reads": 0,
                                 "inflight_spec_reads": 0, "checking_reads": 0,
                                 "queued_demand": 0, "queued_spec": 0, "queued_warm": 0,
                                 "spec_bytes": 0}


class WarmSink:
    """What offload/warm.WarmStart hears from the prefetcher: each call, with its thread."""

    def __init__(self):
        self.calls: list = []
        self.threads: set = set()

    def landed(self, key, nbytes):
        self.calls.append(("landed", key, nbytes))
        self.threads.add(threading.current_thread())

    def failed(self, key, error):
        self.calls.append(("failed", key, type(error).__name__))
        self.threads.add(threading.current_thread())

    def finished(self, skipped):
        self.calls.append(("finished", skipped))
        self.threads.add(threading.current_thread())


def test_the_read_priority_is_demand_then_guesses_then_warm():
    """One rule orders every read: each place the drive frees goes to a queued demand read
    first, then to a queued guess, then to the warm start, each class in its own order."""
    reader, cache, sink = HeldReader(), SpyCache(), WarmSink()
    with prefetcher(reader, cache, read_depth=4, speculative_fraction=1.0,
                    max_inflight_bytes=64 * REC) as pf:
        assert pf.next_class() is None  # nothing queued
        pf.warm(keys(3, 6), sink)  # an idle drive: the warm fills the read depth at once
        assert reader.inflight() == keys(3, 4)
        assert pf.speculate(keys(2, 2)) == keys(2, 2)
        pf.demand(keys(1, 2))
        assert pf.next_class() is None  # the depth is full: nothing goes
        assert pf.inflight()["queued_warm"] == 2 and pf.inflight()["queued_spec"] == 2
        for key in keys(3, 4) + keys(1, 2) + keys(2, 2) + keys(3, 2, start=4):
            reader.land(key)
        assert reader.started == keys(3, 4) + keys(1, 2) + keys(2, 2) + keys(3, 2, start=4)
        assert sink.calls[-1] == ("finished", 0) and len(sink.calls) == 7


def test_a_queued_read_that_cannot_go_holds_back_every_lower_class():
    """A demand read waiting for its depth (1, full) keeps a guess whose own depth (4) has room
    off the drive, and a waiting guess does the same to the warm start: the classes never
    overtake each other, whatever their depths."""
    reader, cache, sink = HeldReader(), SpyCache(), WarmSink()
    with prefetcher(reader, cache, read_depth=4, speculative_fraction=1.0,
                    max_inflight_bytes=64 * REC) as pf:
        first = pf.demand([(1, 0)])
        pf.demand([(1, 1)], depth=1)  # waits: one read is at the drive
        pf.speculate(keys(2, 2), depth=4)  # would fit (1 of 4), but a demand read waits
        pf.warm(keys(3, 2), sink)  # would fit too
        assert reader.inflight() == [(1, 0)] and pf.next_class() is None
        reader.land((1, 0))  # the waiting demand read goes, then the guesses, then the warm
        assert reader.inflight() == [(1, 1), (2, 0), (2, 1), (3, 0)]
        assert pf.wait(first, timeout=T_OUT).keys() == {(1, 0)}
    reader, cache, sink = HeldReader(), SpyCache(), WarmSink()
    with prefetcher(reader, cache, read_depth=4, speculative_fraction=1.0,
                    max_inflight_bytes=64 * REC) as pf:
        pf.demand([(1, 0)])
        pf.speculate([(2, 0)], depth=1)  # waits: one read is at the drive
        pf.warm(keys(3, 2), sink)  # would fit (1 of 4), but a guess waits
        assert reader.inflight() == [(1, 0)] and pf.next_class() is None
        reader.land((1, 0))  # the guess goes first, and then the warm
        assert reader.inflight() == [(2, 0), (3, 0), (3, 1)]


def test_the_warm_waits_for_a_prompt_and_has_no_thread_of_its_own():
    """While a prompt holds it the warm issues nothing (a prompt's own reads go); released, its
    reads start on the releasing thread, to the read depth, and each landing hands over the
    next: the whole warm runs on the threads that land reads, here the test's own, and reports
    each read, then its end. A hold taken mid-warm stops new warm reads; those at the drive
    finish."""
    threads = threading.active_count()
    reader, cache, sink = HeldReader(), SpyCache(), WarmSink()
    with prefetcher(reader, cache, read_depth=2, max_inflight_bytes=64 * REC) as pf:
        pf.hold_prompt()
        assert pf.prompt_held
        pf.warm(keys(3, 5), sink)
        assert not reader.inflight() and pf.next_class() is None
        prompt = pf.demand([(1, 0)])  # the prompt's reads go while the warm waits
        assert reader.inflight() == [(1, 0)]
        reader.land((1, 0))
        assert pf.wait(prompt, timeout=T_OUT).keys() == {(1, 0)}
        assert not reader.inflight() and pf.inflight()["queued_warm"] == 5
        pf.release_prompt()
        assert not pf.prompt_held and reader.inflight() == keys(3, 2)
        reader.land((3, 0))
        assert reader.inflight() == [(3, 1), (3, 2)]
        pf.hold_prompt()  # a new prompt: what is at the drive finishes, nothing new starts
        reader.land((3, 1))
        reader.land((3, 2))
        assert not reader.inflight() and pf.next_class() is None
        pf.release_prompt()
        for key in keys(3, 2, start=3):
            reader.land(key)
        assert threading.active_count() == threads
        assert sink.threads == {threading.current_thread()}
        assert sink.calls == [("landed", k, REC) for k in keys(3, 5)] + [("finished", 0)]
        assert all(cache.ready(k) for k in keys(3, 5))
        # a warm read is recorded once, at landing (nobody waits on it), with no stall
        assert sorted(r for r in cache.records if r[0][0] == 3) == [(k, REC, 0.0)
                                                                    for k in keys(3, 5)]
        assert pf.stats.demand_reads == 1 and pf.stats.spec_issued == 0
        assert pf.stats.warm_reads == 5 and pf.stats.warm_bytes == 5 * REC


def test_the_warm_passes_over_what_is_cached_and_retries_a_transient_slot_once():
    """A warm key already cached is passed over; one in a prefill's transient slot is tried again
    once the others are done: read then if the slot has gone, else reported skipped; a key
    refused a slot is skipped; a read that fails is reported failed; a key a forward demands
    while its warm read runs shares that read."""
    reader, cache, sink = HeldReader(), SpyCache(refuse={(3, 4)}), WarmSink()
    cache.reserve((3, 0))
    cache.commit((3, 0))
    cache.reserve((3, 1), transient=True)  # a prefill is reading it
    cache.reserve((3, 5), transient=True)
    cache.commit((3, 5))
    with prefetcher(reader, cache, read_depth=1, max_inflight_bytes=64 * REC) as pf:
        pf.warm(keys(3, 6), sink)
        assert reader.inflight() == [(3, 2)]
        shared = pf.demand([(3, 2)])  # a forward needs it now: no second read
        reader.land((3, 2))
        assert pf.wait(shared, timeout=T_OUT) == {(3, 2): cache.where((3, 2))}
        assert reader.inflight() == [(3, 3)]
        cache.abort((3, 1))  # the prefill's read of it went away
        buf, fut = reader.held.pop((3, 3))
        fut.set_exception(OSError(5, "Input/output error"))
        assert reader.inflight() == [(3, 1)]  # the retry, after every other warm read
        reader.land((3, 1))
        assert sink.calls == [("landed", (3, 2), REC), ("failed", (3, 3), "PrefetchError"),
                              ("landed", (3, 1), REC),
                              ("finished", 2)]  # (3, 5) still transient, (3, 4) refused a slot
        assert reader.started == [(3, 2), (3, 3), (3, 1)] and (3, 3) not in cache
        assert cache.where((3, 5)).transient and not cache.where((3, 1)).transient


def test_a_held_window_is_claimed_once_or_released():
    """The window a hint opened is held until run_experts claims exactly its (layer, keys); a
    claim for other keys, a new reservation or shutdown closes it (unpins), once."""
    closed: list = []

    def window(name):
        return Window({}, {}, lambda: closed.append(name))

    reader, cache = HeldReader(), SpyCache()
    pf = prefetcher(reader, cache, max_inflight_bytes=64 * REC)
    a = window("a")
    pf.reserve(1, keys(1, 2), a)
    assert pf.claim(1, keys(1, 2)) is a and closed == []  # now the claimer's to close
    assert pf.claim(1, keys(1, 2)) is None  # claimed once
    pf.reserve(1, keys(1, 2), window("b"))
    assert pf.claim(1, keys(1, 3)) is None and closed == ["b"]  # other keys: released
    pf.reserve(2, keys(2, 2), window("c"))
    assert pf.claim(3, keys(2, 2)) is None and closed == ["b", "c"]  # another layer: released
    pf.reserve(2, keys(2, 2), window("d"))
    pf.reserve(3, keys(3, 2), window("e"))  # a hint whose run_experts never came
    assert closed == ["b", "c", "d"]
    pf.release_reserved()
    pf.reserve(4, keys(4, 2), window("f"))
    pf.shutdown()
    assert closed == ["b", "c", "d", "e", "f"]
    a.close()
    a.close()
    assert closed == ["b", "c", "d", "e", "f", "a"]


def test_the_fill_checks_then_repacks_then_commits_each_read_once():
    """A record's steps run in order on its landed bytes: the check sees them as read, the
    repack after it (the slot still loading), the commit last, and the slot holds the repacked
    bytes. A failed check repacks and commits nothing: the slot is aborted and the error names
    the damage; a failed repack aborts the slot too."""
    events: list = []

    class Seen:
        def __init__(self, ok=True):
            self.ok = ok

        def verify(self, view):
            events.append(("check", bytes(view[:1])[0]))
            return None if self.ok else "do not match sha256 (test)"

    def repack(buf):
        key = (1, 2) if buf[0] == pattern((1, 2))[0] else (1, 0)
        events.append(("repack", int(buf[0]), cache.is_loading(key)))
        if key == (1, 2):
            raise RuntimeError("repack bug")
        buf ^= 0xFF

    reader, cache = HeldReader(), SpyCache()
    digests = Checks({(1, 0): Seen(), (1, 1): Seen(ok=False), (1, 2): Seen()})
    with prefetcher(reader, cache, digests=digests, repack=repack,
                    max_inflight_bytes=64 * REC) as pf:
        futs = pf.demand(keys(1, 3))
        reader.land((1, 0))
        p = int(pattern((1, 0))[0])
        assert events == [("check", p), ("repack", p, True)]
        assert futs[(1, 0)].result(T_OUT) == cache.where((1, 0))
        assert np.array_equal(cache.data((1, 0)), pattern((1, 0)) ^ 0xFF)
        events.clear()
        reader.land((1, 1))
        assert events == [("check", int(pattern((1, 1))[0]))]  # no repack after a failed check
        with pytest.raises(PrefetchError, match="do not match sha256.*mtplx verify --records"
                           ) as ei:
            futs[(1, 1)].result(T_OUT)
        assert isinstance(ei.value.__cause__, RecordHashError)
        reader.land((1, 2))
        with pytest.raises(PrefetchError, match="repack bug"):
            futs[(1, 2)].result(T_OUT)
        assert cache.aborted == [(1, 1), (1, 2)] and (1, 1) not in cache and (1, 2) not in cache
        assert pf.stats.failed_reads == 2


def test_a_verified_record_without_a_digest_is_not_committed():
    """With verification on, a record the manifest gives no SHA-256 fails its read instead of
    reaching a kernel unchecked."""
    class NoDigest:
        def check(self, key):
            return None

    reader, cache = FakeReader(), SpyCache()
    with prefetcher(reader, cache, digests=NoDigest(), max_inflight_bytes=64 * REC) as pf:
        fut = pf.demand([(1, 0)])[(1, 0)]
        with pytest.raises(PrefetchError, match="gives this one no SHA-256"):
            fut.result(T_OUT)
        assert cache.aborted == [(1, 0)]
    reader.close()


def test_inflight_bytes_never_exceed_budget(make):
    budget = 3 * REC
    pf, reader, cache = make(reader=FakeReader(gated=True), max_inflight_bytes=budget,
                             read_depth=16, speculative_fraction=0.5)
    futs = {}
    for layer in range(1, 5):
        futs.update(pf.demand(keys(layer, 10)))
        pf.speculate(keys(layer + 10, 4))
    # Nothing lands while the gate is shut: three started reads fill the budget exactly.
    until(lambda: len(reader.starts) == 3)
    assert reader.cur_bytes == budget
    reader.gate.set()
    pf.wait(futs, timeout=T_OUT)
    until(lambda: pf.inflight()["inflight_reads"] == 0 and pf.inflight()["queued_spec"] == 0)
    assert reader.max_bytes <= budget
    assert 0 < pf.stats.peak_inflight_bytes <= budget
    assert reader.max_bytes == budget  # the budget is actually used, not just respected


def test_oversize_record_runs_alone(make):
    pf, reader, cache = make(max_inflight_bytes=REC // 2)
    pf.wait(pf.demand(keys(1, 3)), timeout=T_OUT)
    assert reader.max_bytes == REC


def test_speculation_capped_by_fraction_of_budget(make):
    pf, reader, cache = make(reader=FakeReader(gated=True), max_inflight_bytes=8 * REC,
                             speculative_fraction=0.25)
    assert pf.speculate(keys(3, 5)) == keys(3, 2)  # cap = 2 records, queued + running
    assert pf.speculate([(3, 4)]) == []
    reader.gate.set()
    # Both guesses must have landed: one still in flight holds its share of the cap. A landed
    # read gave its bytes back in the same locked step that committed it.
    until(lambda: cache.ready((3, 0)) and cache.ready((3, 1)))
    assert pf.speculate(keys(3, 5)) == [(3, 2), (3, 3)]  # landed ones are skipped as resident
    assert all(spec for (k, spec, _) in cache.reserve_calls if k[0] == 3)


def test_speculate_skips_resident_inflight_and_refused(make):
    cache = SpyCache(refuse={(4, 1)}, resident={(4, 0)})
    pf, reader, cache = make(reader=FakeReader(gated=True), cache=cache,
                             speculative_fraction=1.0)
    pf.demand([(4, 2)])
    assert pf.speculate([(4, 0), (4, 1), (4, 2), (4, 3)]) == [(4, 3)]
    assert pf.stats.spec_skipped == 3 and pf.stats.spec_issued == 1


def test_cancel_stale_drops_queued_speculation_only(make):
    pf, reader, cache = make(reader=FakeReader(gated=True), read_depth=1, speculative_fraction=1.0)
    a = pf.demand([(1, 0)])
    until(lambda: len(reader.starts) == 1)
    pf.speculate([(2, 0), (2, 1), (2, 2)])
    assert pf.cancel_stale({(2, 1)}) == [(2, 0), (2, 2)]
    assert cache.aborted == [(2, 0), (2, 2)]
    reader.gate.set()
    pf.wait(a, timeout=T_OUT)
    until(lambda: cache.ready((2, 1)))
    assert reader.starts == [(1, 0), (2, 1)]
    assert pf.stats.spec_cancelled == 2 and pf.stats.spec_issued == 3


def test_running_speculation_finishes_then_is_settled(make):
    pf, reader, cache = make(reader=FakeReader(gated=True), speculative_fraction=1.0)
    pf.speculate([(5, 0), (5, 1)])
    until(lambda: len(reader.starts) == 2)
    assert pf.cancel_stale(set()) == []  # both already handed to the reader
    reader.gate.set()
    # A guess is recorded just after its future resolves (after the commit): wait for that.
    until(lambda: len(cache.records) == 2)
    assert cache.ready((5, 0)) and cache.ready((5, 1)) and not cache.aborted
    assert sorted(r[0] for r in cache.records) == [(5, 0), (5, 1)]  # guesses recorded on landing
    time.sleep(0.05)  # both landed before their record: (5, 0) is used at least 50 ms later
    assert pf.note_used([(5, 0), (9, 9)]) == 1
    pf.cancel_stale(set())
    assert (pf.stats.spec_used, pf.stats.spec_wasted, pf.stats.spec_late) == (1, 1, 0)
    assert pf.stats.spec_lead_ms >= 50.0


def test_inflight_speculation_is_promoted_not_duplicated(make):
    pf, reader, cache = make(reader=FakeReader(gated=True), read_depth=1, speculative_fraction=1.0)
    pf.speculate([(6, 0), (6, 1), (6, 2)])
    until(lambda: reader.starts == [(6, 0)])
    futs = pf.demand([(6, 0), (6, 2), (6, 3)])
    assert pf.inflight()["queued_demand"] == 2  # (6,2) moved over, (6,3) new
    reader.gate.set()
    slots = pf.wait(futs, timeout=T_OUT)
    assert slots[(6, 2)] == cache.where((6, 2)) and cache.ready((6, 2))
    # (6, 1) stayed a guess: recorded after its future resolves, so wait for the record itself.
    until(lambda: (6, 1) in [r[0] for r in cache.records])
    assert cache.ready((6, 1))
    assert reader.starts == [(6, 0), (6, 2), (6, 3), (6, 1)]
    assert max(reader.reads.values()) == 1
    assert pf.stats.spec_used == 2 and pf.stats.demand_reads == 1
    # Both were demanded before landing: late, no lead time.
    assert pf.stats.spec_late == 2 and pf.stats.spec_lead_ms == 0.0
    assert sorted(r[0] for r in cache.records) == [(6, 0), (6, 1), (6, 2), (6, 3)]


@pytest.mark.parametrize("mode", ["fail", "short"])
def test_read_error_names_the_key_and_aborts_the_slot(make, mode):
    bad = (1, 3)
    reader = FakeReader(**{mode: {bad}})
    pf, reader, cache = make(reader=reader)
    futs = pf.demand([(1, 2), bad])
    with pytest.raises(PrefetchError) as ei:
        pf.wait(futs, timeout=T_OUT)
    msg = str(ei.value)
    assert ei.value.key == bad
    for part in ("layer 1", "expert 3", "bank.bin", f"offset {offset_of(bad)}"):
        assert part in msg
    assert ("short read" in msg) if mode == "short" else ("Input/output error" in msg)
    assert cache.aborted == [bad] and bad not in cache
    assert futs[(1, 2)].result(T_OUT) == cache.where((1, 2))
    until(lambda: pf.inflight()["inflight_bytes"] == 0)
    assert pf.stats.failed_reads == 1
    assert bad not in [r[0] for r in cache.records]  # only successful reads are recorded


def test_no_slot_and_unknown_record_fail_the_future(make):
    reader, cache = FakeReader(), SpyCache(refuse={(1, 1)})
    pf = prefetcher(reader, cache, Bank(missing={99}), max_inflight_bytes=4 * REC)
    try:
        futs = pf.demand([(1, 0), (1, 1), (1, 99)], transient=False)
        with pytest.raises(NoSlotError, match="layer 1, expert 1"):
            futs[(1, 1)].result(T_OUT)
        with pytest.raises(PrefetchError, match="layer 1, expert 99"):
            futs[(1, 99)].result(T_OUT)
        assert futs[(1, 0)].result(T_OUT)
        # a refused demand retried once as a transient slot
        assert ((1, 1), False, True) in cache.reserve_calls
    finally:
        pf.shutdown()
        reader.close()


def test_demand_for_a_landed_key_resolves_without_a_read(make):
    """A key already ready in the cache (a guess that landed after the caller's lookup, or one
    committed some other way) gets a resolved future and no second read."""
    pf, reader, cache = make(speculative_fraction=1.0)
    assert pf.speculate([(7, 0)]) == [(7, 0)]
    until(lambda: cache.ready((7, 0)))
    cache.reserve((7, 1))
    cache.data((7, 1))[:] = pattern((7, 1))
    cache.commit((7, 1))
    futs = pf.demand([(7, 0), (7, 1)])
    assert all(f.done() for f in futs.values())
    assert pf.wait(futs, timeout=T_OUT) == {k: cache.where(k) for k in [(7, 0), (7, 1)]}
    assert reader.reads[(7, 0)] == 1 and (7, 1) not in reader.reads
    assert pf.stats.demand_reads == 0
    assert pf.stats.spec_used == 1  # the landed guess counts as used; (7, 1) was no guess
    pf.cancel_stale(set())
    assert pf.stats.spec_wasted == 0


def test_demand_for_a_loading_key_the_prefetcher_does_not_own_is_an_error(make):
    pf, reader, cache = make()
    cache.reserve((8, 0))  # loading, but not through this prefetcher
    with pytest.raises(ValueError, match="already cached"):
        pf.demand([(8, 0)])


def test_locate_bug_is_not_swallowed(make):
    """KeyError (no such record) is a bad guess for speculate and a PrefetchError for demand;
    any other exception from the bank's locate is a bug and reaches the caller as it is."""
    reader, cache = FakeReader(), SpyCache()
    pf = prefetcher(reader, cache, Bank(missing={98}, bug={99}), max_inflight_bytes=8 * REC,
                    speculative_fraction=1.0)
    try:
        assert pf.speculate([(1, 98), (1, 0)]) == [(1, 0)]
        with pytest.raises(TypeError, match="locate bug"):
            pf.speculate([(1, 1), (1, 99), (1, 2)])
        until(lambda: cache.ready((1, 1)))  # issued before the bug: still dispatched
        assert (1, 2) not in cache
        futs = pf.demand([(2, 0), (2, 98), (2, 99)])
        with pytest.raises(PrefetchError, match="layer 2, expert 98"):
            futs[(2, 98)].result(T_OUT)
        with pytest.raises(TypeError, match="locate bug"):
            futs[(2, 99)].result(T_OUT)
        assert futs[(2, 0)].result(T_OUT) == cache.where((2, 0))
        assert (2, 98) not in cache and (2, 99) not in cache
    finally:
        pf.shutdown()
        reader.close()


def test_shutdown_mid_read_returns_promptly(make):
    pf, reader, cache = make(reader=FakeReader(gated=True), read_depth=1)
    futs = pf.demand(keys(1, 3))
    pf.speculate([(2, 0)])
    until(lambda: len(reader.starts) == 1)
    t = threading.Thread(target=pf.shutdown)
    t.start()
    t.join(T_OUT)  # a hang guard only
    assert not t.is_alive()
    assert not futs[(1, 0)].done()  # shutdown did not wait for the read still in the reader
    for k in keys(1, 3)[1:]:
        with pytest.raises(CancelledError):
            futs[k].result(T_OUT)
    assert sorted(cache.aborted) == [(1, 1), (1, 2), (2, 0)]
    with pytest.raises(RuntimeError, match="shut down"):
        pf.demand([(3, 0)])
    reader.gate.set()  # the read that was running still lands and is committed
    assert futs[(1, 0)].result(T_OUT) == cache.where((1, 0))
    assert cache.ready((1, 0))
    pf.shutdown()  # idempotent


def test_shutdown_without_cancel_drains_queue(make):
    pf, reader, cache = make(reader=FakeReader(delay_s=0.005), read_depth=1)
    futs = pf.demand(keys(1, 4))
    pf.shutdown(cancel_pending=False)
    assert all(f.done() and not f.cancelled() for f in futs.values())
    assert all(cache.ready(k) for k in keys(1, 4))


def test_user_cancelled_demand_is_dropped(make):
    pf, reader, cache = make(reader=FakeReader(gated=True), read_depth=1)
    futs = pf.demand(keys(1, 2))
    until(lambda: len(reader.starts) == 1)
    assert futs[(1, 1)].cancel()
    reader.gate.set()
    futs[(1, 0)].result(T_OUT)
    until(lambda: (1, 1) in cache.aborted)
    assert reader.starts == [(1, 0)]
    again = pf.demand([(1, 1)])  # a fresh read, not the cancelled future
    assert again[(1, 1)].result(T_OUT) == cache.where((1, 1))


def test_queued_cancelled_demand_is_replaced_by_a_new_demand(make):
    pf, reader, cache = make(reader=FakeReader(gated=True), read_depth=1)
    futs = pf.demand(keys(1, 2))
    until(lambda: len(reader.starts) == 1)
    assert futs[(1, 1)].cancel()
    again = pf.demand([(1, 1)])
    assert again[(1, 1)] is not futs[(1, 1)] and cache.aborted == [(1, 1)]
    reader.gate.set()
    assert again[(1, 1)].result(T_OUT) == cache.where((1, 1))
    assert reader.reads[(1, 1)] == 1


def test_many_concurrent_demands_complete(make):
    pf, reader, cache = make(reader=FakeReader(gated=True, delay_s=0.001), read_depth=8,
                             max_inflight_bytes=6 * REC)
    shared = keys(9, 10)
    results: dict = {}
    errors: list = []

    filed = threading.Barrier(9)

    def worker(i):
        try:
            futs = pf.demand(keys(i + 1, 25) + shared)
            filed.wait(T_OUT)
            results[i] = pf.wait(futs, timeout=T_OUT)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    filed.wait(T_OUT)  # every worker has filed its demand while the gate is shut
    reader.gate.set()
    for t in threads:
        t.join(T_OUT)
    assert not errors and all(not t.is_alive() for t in threads)
    assert all(len(r) == 35 for r in results.values())
    assert max(reader.reads.values()) == 1  # shared keys read once
    assert all(cache.ready(k) for i in range(8) for k in keys(i + 1, 25) + shared)
    assert reader.max_bytes <= 6 * REC


def test_real_reader_reads_record_bytes_into_slots(tmp_path, monkeypatch):
    """Record bytes land straight in their slots: every preadv destination is a slot, with no
    staging buffer and copy between; the fill checks each record once (SHA-256, first read)."""
    from mtplx_runtime.artifact.build import build_artifact
    from mtplx_runtime.artifact.open import open_source
    from mtplx_runtime.fixtures.tiny import make_tiny
    from mtplx_runtime.offload.bank_reader import from_manifest
    from mtplx_runtime.offload.buffers import buffer_address
    from mtplx_runtime.offload.digests import RecordDigests

    make_tiny(tmp_path / "src", "t158")
    build_artifact(tmp_path / "src", tmp_path / "out", progress=False)
    root = tmp_path / "out"
    with open_source(root) as a:
        bank = a.expert_layout
    man = bank.manifest
    parts = man.sidecar.parts
    recs = {(r.layer, r.expert): r for r in man.records}
    digests = RecordDigests(root, man, receipts=tmp_path / "receipts")

    record_bytes = max(r.sidecar_length for r in recs.values())
    cache = SpyCache(slots=len(recs), record_bytes=record_bytes)
    real_preadv, landed = os.preadv, []

    def spy(fd, buffers, offset, *a):
        landed.extend(buffer_address(b) for b in buffers)
        return real_preadv(fd, buffers, offset, *a)

    monkeypatch.setattr(os, "preadv", spy)
    with from_manifest(root, man, direct="auto", read_depth=4) as reader:
        pf = prefetcher(reader, cache, bank, digests, max_inflight_bytes=256 << 10,
                        read_depth=4, speculative_fraction=0.5)
        try:
            half = sorted(recs)[: len(recs) // 2]
            pf.wait(pf.demand(half), timeout=T_OUT)
            issued = pf.speculate(sorted(recs)[len(recs) // 2:])
            assert issued
            # Guesses are recorded just after their futures resolve: wait for the records.
            until(lambda: len(cache.records) == len(half) + len(issued))
            assert all(cache.ready(k) for k in issued)
        finally:
            pf.shutdown()
    for key in half + issued:
        r = recs[key]
        with open(root / parts[r.part].file, "rb") as f:
            f.seek(parts[r.part].data_start + r.sidecar_offset)
            want = f.read(r.sidecar_length)
        assert cache.data(key).tobytes()[: r.sidecar_length] == want
    assert not cache.aborted
    # Each record's slot was a preadv destination; besides them at most the one page the
    # reader's O_DIRECT probe reads into its own buffer.
    slots = {buffer_address(cache.data(k)) for k in half + issued}
    assert len(slots) == len(half) + len(issued) and slots <= set(landed)
    assert len(landed) - len(slots) in (0, 1)
    assert sorted((k, n) for k, n, _ in cache.records) == sorted(
        (k, recs[k].sidecar_length) for k in half + issued)
    assert digests.stats()["sha256"] == len(half) + len(issued)  # each checked, once


class ManualClock:
    """The prefetch module's clock, moved only by the test."""

    def __init__(self):
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_busy_seconds_count_only_time_with_a_read_at_the_drive(make, monkeypatch):
    from mtplx_runtime.offload import prefetch

    clock = ManualClock()
    monkeypatch.setattr(prefetch, "time", clock)
    pf, reader, cache = make(reader=FakeReader(gated=True), read_depth=4)
    clock.now += 5.0  # idle: not counted
    assert pf.busy_seconds() == 0.0
    futs = pf.demand(keys(1, 3))
    until(lambda: pf.inflight()["inflight_reads"] == 3)  # all three handed to the reader
    clock.now += 2.0
    assert pf.busy_seconds() == pytest.approx(2.0)  # the spell now running counts
    reader.gate.set()
    pf.wait(futs, timeout=T_OUT)
    until(lambda: pf.inflight()["inflight_reads"] == 0)
    clock.now += 7.0  # idle again
    assert pf.busy_seconds() == pytest.approx(2.0) == pf.stats.busy_ms / 1e3
    # A second spell adds to the first.
    reader.gate.clear()
    futs = pf.demand(keys(1, 1, start=3))
    until(lambda: pf.inflight()["inflight_reads"] == 1)
    clock.now += 0.5
    reader.gate.set()
    pf.wait(futs, timeout=T_OUT)
    until(lambda: pf.inflight()["inflight_reads"] == 0)
    assert pf.busy_seconds() == pytest.approx(2.5)
    # A read whose bytes are in is being checked, not read: that time is not the drive's.
    class SlowCheck:
        def verify(self, view):
            clock.now += 3.0  # the check of the landed bytes takes 3 s
            return None

    held = HeldReader()
    with prefetcher(held, SpyCache(), digests=Checks({(1, 0): SlowCheck()}), read_depth=1,
                    max_inflight_bytes=64 * REC) as pf2:
        futs = pf2.demand(keys(1, 1))
        clock.now += 1.0
        held.land((1, 0))
        pf2.wait(futs, timeout=T_OUT)
        assert pf2.busy_seconds() == pytest.approx(1.0) == pf2.stats.busy_ms / 1e3
