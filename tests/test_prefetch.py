"""Prefetcher against a fake slow bank and a fake cache: ordering, back-pressure, speculation cap,
stale cancellation, promotion, errors, shutdown without hang; plus one run on a real artifact."""

from __future__ import annotations

import errno
import threading
import time
from collections import Counter
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import numpy as np
import pytest

from mtplx_runtime.offload.prefetch import NoSlotError, Prefetcher, PrefetchError

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


def locate(key):
    return 0, offset_of(key), REC, None


def pattern(key, n=REC):
    return np.full(n, (key[0] * 31 + key[1]) % 251, np.uint8)


class FakeReader:
    """Async reads on its own threads; optional gate holds every read until released.
    Instruments bytes in flight (max_bytes) and the order reads start."""

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

    def read_into(self, part, offset, length, buf, sha256=None):
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
            with self.lock:  # before set_result: the budget frees on completion
                self.cur_bytes -= length
            fut.set_result(n)

        self.pool.submit(run)
        return fut

    def close(self):
        self.gate.set()
        self.pool.shutdown(wait=True)


class FakeCache:
    """Slots without limit unless `capacity`; records every call. Double reserve is a bug."""

    def __init__(self, refuse=(), capacity=None, resident=()):
        self.lock = threading.Lock()
        self.refuse, self.capacity = set(refuse), capacity
        self.reserved: dict = {}
        self.resident: dict = {k: None for k in resident}
        self.aborted: list = []
        self.promoted: list = []
        self.records: list = []
        self.reserve_calls: list = []

    def reserve(self, key, *, speculative=False, transient=False):
        with self.lock:
            self.reserve_calls.append((key, speculative, transient))
            assert key not in self.reserved, f"{key} reserved twice"
            if key in self.resident or key in self.refuse:
                return None
            if self.capacity is not None and len(self.reserved) >= self.capacity:
                return None
            slot = ("slot", key)
            self.reserved[key] = np.zeros(REC, np.uint8)
            return slot

    def buffer(self, slot):
        return self.reserved[slot[1]]

    def commit(self, key):
        with self.lock:
            self.resident[key] = self.reserved.pop(key)

    def abort(self, key):
        with self.lock:
            self.reserved.pop(key)
            self.aborted.append(key)

    def promote(self, key):
        self.promoted.append(key)

    def record_read(self, key, nbytes, stall_ms):
        with self.lock:
            self.records.append((key, nbytes, stall_ms))

    def __contains__(self, key):
        return key in self.resident


@pytest.fixture
def make():
    made = []

    def _make(reader=None, cache=None, **kw):
        reader = reader or FakeReader()
        cache = cache or FakeCache()
        kw.setdefault("max_inflight_bytes", 8 * REC)
        pf = Prefetcher(reader, locate, cache, **kw)
        made.append((pf, reader))
        return pf, reader, cache

    yield _make
    for pf, reader in made:
        reader.gate.set()
        pf.shutdown()
        reader.close()


def keys(layer, n, start=0):
    return [(layer, e) for e in range(start, start + n)]


def test_demand_reads_land_in_slots_and_are_recorded_once(make):
    pf, reader, cache = make(reader=FakeReader(gated=True))
    futs = pf.demand(keys(1, 5))
    threading.Timer(0.2, reader.gate.set).start()
    slots = pf.wait(futs, timeout=T_OUT)
    assert set(slots) == set(keys(1, 5))
    for k in keys(1, 5):
        assert np.array_equal(cache.resident[k], pattern(k))
    assert sorted(r[0] for r in cache.records) == keys(1, 5)
    assert all(r[1] == REC for r in cache.records)
    assert pf.stats.stall_ms > 50 and pf.stats.demand_reads == 5
    assert sum(r[2] for r in cache.records) == pytest.approx(pf.stats.stall_ms)
    assert pf.stats.demand_bytes == 5 * REC
    pf.wait(futs, timeout=T_OUT)  # waiting again records nothing new
    assert len(cache.records) == 5


@pytest.mark.parametrize("limit", ["threads", "bytes"])
def test_demand_goes_before_queued_speculation(make, limit):
    # Either one read at a time, or a budget of two records filled by two demand reads.
    kw = {"threads": 1} if limit == "threads" else {"max_inflight_bytes": 2 * REC, "threads": 8}
    first = [(1, 0)] if limit == "threads" else [(1, 0), (1, 5)]
    pf, reader, cache = make(reader=FakeReader(gated=True), speculative_fraction=1.0, **kw)
    a = pf.demand(first)
    until(lambda: sorted(reader.starts) == first)
    assert pf.speculate([(2, 0), (2, 1)]) == [(2, 0), (2, 1)]
    b = pf.demand([(1, 1)])
    assert pf.inflight()["queued_demand"] == 1 and pf.inflight()["queued_spec"] == 2
    reader.gate.set()
    pf.wait({**a, **b}, timeout=T_OUT)
    until(lambda: (2, 1) in cache.resident)
    assert reader.starts[len(first):] == [(1, 1), (2, 0), (2, 1)]


def test_inflight_bytes_never_exceed_budget(make):
    budget = 3 * REC
    pf, reader, cache = make(reader=FakeReader(delay_s=0.003), max_inflight_bytes=budget,
                             threads=16, speculative_fraction=0.5)
    futs = {}
    for layer in range(1, 5):
        futs.update(pf.demand(keys(layer, 10)))
        pf.speculate(keys(layer + 10, 4))
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
    until(lambda: (3, 1) in cache.resident)
    assert pf.speculate(keys(3, 5)) == [(3, 2), (3, 3)]  # landed ones are skipped as resident
    assert all(spec for (k, spec, _) in cache.reserve_calls if k[0] == 3)


def test_speculate_skips_resident_inflight_and_refused(make):
    cache = FakeCache(refuse={(4, 1)}, resident={(4, 0)})
    pf, reader, cache = make(reader=FakeReader(gated=True), cache=cache,
                             speculative_fraction=1.0)
    pf.demand([(4, 2)])
    assert pf.speculate([(4, 0), (4, 1), (4, 2), (4, 3)]) == [(4, 3)]
    assert pf.stats.spec_skipped == 3 and pf.stats.spec_issued == 1


def test_cancel_stale_drops_queued_speculation_only(make):
    pf, reader, cache = make(reader=FakeReader(gated=True), threads=1, speculative_fraction=1.0)
    a = pf.demand([(1, 0)])
    until(lambda: len(reader.starts) == 1)
    pf.speculate([(2, 0), (2, 1), (2, 2)])
    assert pf.cancel_stale({(2, 1)}) == [(2, 0), (2, 2)]
    assert cache.aborted == [(2, 0), (2, 2)]
    reader.gate.set()
    pf.wait(a, timeout=T_OUT)
    until(lambda: (2, 1) in cache.resident)
    assert reader.starts == [(1, 0), (2, 1)]
    assert pf.stats.spec_cancelled == 2 and pf.stats.spec_issued == 3


def test_running_speculation_finishes_then_is_settled(make):
    pf, reader, cache = make(reader=FakeReader(gated=True), speculative_fraction=1.0)
    pf.speculate([(5, 0), (5, 1)])
    until(lambda: len(reader.starts) == 2)
    assert pf.cancel_stale(set()) == []  # both already handed to the reader
    reader.gate.set()
    until(lambda: (5, 0) in cache.resident and (5, 1) in cache.resident)
    assert not cache.aborted
    assert sorted(r[0] for r in cache.records) == [(5, 0), (5, 1)]  # guesses recorded on landing
    assert pf.note_used([(5, 0), (9, 9)]) == 1
    pf.cancel_stale(set())
    assert (pf.stats.spec_used, pf.stats.spec_wasted) == (1, 1)


def test_inflight_speculation_is_promoted_not_duplicated(make):
    pf, reader, cache = make(reader=FakeReader(gated=True), threads=1, speculative_fraction=1.0)
    pf.speculate([(6, 0), (6, 1), (6, 2)])
    until(lambda: reader.starts == [(6, 0)])
    futs = pf.demand([(6, 0), (6, 2), (6, 3)])
    assert pf.inflight()["queued_demand"] == 2  # (6,2) moved over, (6,3) new
    reader.gate.set()
    slots = pf.wait(futs, timeout=T_OUT)
    assert slots[(6, 2)] == ("slot", (6, 2))
    until(lambda: (6, 1) in cache.resident)
    assert reader.starts == [(6, 0), (6, 2), (6, 3), (6, 1)]
    assert max(reader.reads.values()) == 1
    assert pf.stats.spec_used == 2 and pf.stats.demand_reads == 1
    assert cache.promoted == [(6, 0), (6, 2)]
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
    assert cache.aborted == [bad] and bad not in cache.resident
    assert futs[(1, 2)].result(T_OUT) == ("slot", (1, 2))
    until(lambda: pf.inflight()["inflight_bytes"] == 0)
    assert pf.stats.failed_reads == 1
    assert bad not in [r[0] for r in cache.records]  # only successful reads are recorded


def test_no_slot_and_unknown_record_fail_the_future(make):
    def picky_locate(key):
        if key[1] == 99:
            raise KeyError(key)
        return locate(key)

    reader, cache = FakeReader(), FakeCache(refuse={(1, 1)})
    pf = Prefetcher(reader, picky_locate, cache, max_inflight_bytes=4 * REC)
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


def test_shutdown_mid_read_returns_promptly(make):
    pf, reader, cache = make(reader=FakeReader(gated=True), threads=1)
    futs = pf.demand(keys(1, 3))
    pf.speculate([(2, 0)])
    until(lambda: len(reader.starts) == 1)
    t = threading.Thread(target=pf.shutdown)
    t0 = time.monotonic()
    t.start()
    t.join(2.0)
    assert not t.is_alive() and time.monotonic() - t0 < 2.0
    for k in keys(1, 3)[1:]:
        with pytest.raises(CancelledError):
            futs[k].result(T_OUT)
    assert sorted(cache.aborted) == [(1, 1), (1, 2), (2, 0)]
    with pytest.raises(RuntimeError, match="shut down"):
        pf.demand([(3, 0)])
    reader.gate.set()  # the read that was running still lands and is committed
    assert futs[(1, 0)].result(T_OUT) == ("slot", (1, 0))
    assert (1, 0) in cache.resident
    pf.shutdown()  # idempotent


def test_shutdown_without_cancel_drains_queue(make):
    pf, reader, cache = make(reader=FakeReader(delay_s=0.005), threads=1)
    futs = pf.demand(keys(1, 4))
    pf.shutdown(cancel_pending=False)
    assert all(f.done() and not f.cancelled() for f in futs.values())
    assert len(cache.resident) == 4


def test_user_cancelled_demand_is_dropped(make):
    pf, reader, cache = make(reader=FakeReader(gated=True), threads=1)
    futs = pf.demand(keys(1, 2))
    until(lambda: len(reader.starts) == 1)
    assert futs[(1, 1)].cancel()
    reader.gate.set()
    futs[(1, 0)].result(T_OUT)
    until(lambda: (1, 1) in cache.aborted)
    assert reader.starts == [(1, 0)]
    again = pf.demand([(1, 1)])  # a fresh read, not the cancelled future
    assert again[(1, 1)].result(T_OUT) == ("slot", (1, 1))


def test_queued_cancelled_demand_is_replaced_by_a_new_demand(make):
    pf, reader, cache = make(reader=FakeReader(gated=True), threads=1)
    futs = pf.demand(keys(1, 2))
    until(lambda: len(reader.starts) == 1)
    assert futs[(1, 1)].cancel()
    again = pf.demand([(1, 1)])
    assert again[(1, 1)] is not futs[(1, 1)] and cache.aborted == [(1, 1)]
    reader.gate.set()
    assert again[(1, 1)].result(T_OUT) == ("slot", (1, 1))
    assert reader.reads[(1, 1)] == 1


def test_many_concurrent_demands_complete(make):
    pf, reader, cache = make(reader=FakeReader(gated=True, delay_s=0.001), threads=8,
                             max_inflight_bytes=6 * REC)
    shared = keys(9, 10)
    results: dict = {}
    errors: list = []

    def worker(i):
        try:
            futs = pf.demand(keys(i + 1, 25) + shared)
            results[i] = pf.wait(futs, timeout=T_OUT)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    until(lambda: len(reader.starts) > 0)
    time.sleep(0.05)  # let every worker file its demand while the gate is shut
    reader.gate.set()
    for t in threads:
        t.join(T_OUT)
    assert not errors and all(not t.is_alive() for t in threads)
    assert all(len(r) == 35 for r in results.values())
    assert max(reader.reads.values()) == 1  # shared keys read once
    assert len(cache.resident) == 8 * 25 + 10
    assert reader.max_bytes <= 6 * REC


def test_real_reader_reads_record_bytes_into_slots(tmp_path):
    from mtplx_runtime.artifact.build import build_artifact
    from mtplx_runtime.artifact.manifest import load_manifest
    from mtplx_runtime.fixtures.tiny import make_tiny
    from mtplx_runtime.offload.buffers import aligned_buffer
    from mtplx_runtime.offload.reader import from_manifest

    make_tiny(tmp_path / "src", "t158")
    build_artifact(tmp_path / "src", tmp_path / "out", progress=False)
    root = tmp_path / "out"
    man = load_manifest(root / "expert-manifest.json")
    parts = man.sidecar.parts
    recs = {(r.layer, r.expert): r for r in man.records}

    def real_locate(key):
        r = recs[key]
        return r.part, parts[r.part].data_start + r.sidecar_offset, r.sidecar_length, r.sha256

    class SlotCache:
        def __init__(self):
            self.bufs, self.committed, self.records = {}, set(), []

        def reserve(self, key, *, speculative=False, transient=False):
            self.bufs[key] = aligned_buffer(recs[key].sidecar_length)
            return key

        def buffer(self, slot):
            return self.bufs[slot]

        def commit(self, key):
            self.committed.add(key)

        def abort(self, key):
            raise AssertionError(f"unexpected abort of {key}")

        def record_read(self, key, nbytes, stall_ms):
            self.records.append((key, nbytes))

    cache = SlotCache()
    with from_manifest(root, man, direct="auto", threads=4) as reader:
        pf = Prefetcher(reader, real_locate, cache, max_inflight_bytes=256 << 10, threads=4,
                        speculative_fraction=0.5)
        try:
            half = sorted(recs)[: len(recs) // 2]
            pf.wait(pf.demand(half), timeout=T_OUT)
            issued = pf.speculate(sorted(recs)[len(recs) // 2:])
            assert issued
            until(lambda: set(issued) <= cache.committed)
        finally:
            pf.shutdown()
    for key in half + issued:
        r = recs[key]
        with open(root / parts[r.part].file, "rb") as f:
            f.seek(parts[r.part].data_start + r.sidecar_offset)
            want = f.read(r.sidecar_length)
        assert cache.bufs[key].tobytes()[: r.sidecar_length] == want
    assert sorted(cache.records) == sorted((k, recs[k].sidecar_length) for k in half + issued)
