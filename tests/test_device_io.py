"""The staged path to device slots (pread -> pinned staging -> check -> copy stream -> slot) through
the fill pipeline, the prefetcher and the slot table, driven without a GPU on fake streams
(tests/fake_cuda.py: copies run only once an event after them is waited for; a copy into a slot
a launch read raises unless the copy stream waited for that launch). Checked here: the check sees
the staged bytes before the copy is enqueued; the table names the slot only at commit and the
next launch waits for the copy; a slot a launch read is rewritten only after that launch; a
staging buffer is reused only once its copy ran; how `device_reads` chooses kvikio or staging."""

import contextlib
import hashlib
import logging

import numpy as np
import pytest
from fake_cuda import FakeStreams

from mtplx_runtime.artifact.open import RecordLocation
from mtplx_runtime.offload import device_io
from mtplx_runtime.offload.bank_reader import RecordReader
from mtplx_runtime.offload.cache import ExpertCache
from mtplx_runtime.offload.device_io import Staging, device_reads, gds_status, tier_mover
from mtplx_runtime.offload.fill import Fill
from mtplx_runtime.offload.prefetch import Prefetcher, PrefetchError
from mtplx_runtime.offload.slot_table import SlotTable

PAGE = 4096
T_OUT = 10.0
RECORDS = 6


@pytest.fixture
def part(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, RECORDS * PAGE, dtype=np.uint8)
    (tmp_path / "part0.bin").write_bytes(data.tobytes())
    return tmp_path, data


class Bank:
    """Expert e of any layer is page e of part0.bin."""

    def locate(self, layer, expert):
        if not 0 <= expert < RECORDS:
            raise KeyError((layer, expert))
        return RecordLocation(0, expert * PAGE, PAGE, None)


class Digests:
    """Each record's SHA-256, noting which bytes the check saw; `bad` keys get a wrong one."""

    def __init__(self, data, log, bad=()):
        self.data, self.log, self.bad = data, log, set(bad)

    def check(self, key):
        digests = self

        class Check:
            def verify(self, view):
                digests.log.append(("check", bytes(view[:8])))
                want = ("0" * 64 if key in digests.bad else
                        hashlib.sha256(digests.data[key[1] * PAGE:(key[1] + 1) * PAGE]).hexdigest())
                return None if hashlib.sha256(view).hexdigest() == want else "do not match"

        return Check()


def record(data, e):
    return data[e * PAGE:(e + 1) * PAGE]


@contextlib.contextmanager
def staged(root, data, *, staging=2, read_depth=2, slots=4, bad=(), repack=None):
    """(prefetcher, table, streams): a prefetcher filling "device" slots (host memory standing
    in) through `staging` staging buffers, on fake streams whose log the digest checks share;
    shut down and its reader closed at the end."""
    streams = FakeStreams()
    table = SlotTable([1, 2], RECORDS, streams)
    reader = RecordReader(root, [("part0.bin", data.nbytes)], direct=False, read_depth=read_depth)
    cache = ExpertCache(PAGE, slots * PAGE, scope="global", layers=[1, 2], device="cpu",
                        on_slot=table.on_slot, mover=tier_mover(streams, table))
    reader, stage = device_reads(reader, staging_bytes=PAGE, table=table, streams=streams,
                                 tier=cache.tier("compute"), threads=staging, verified=True,
                                 use_kvikio=False)
    fill = Fill(reader, Bank(), cache, digests=Digests(data, streams.log, bad), staging=stage,
                repack=repack)
    pf = Prefetcher(fill, max_inflight_bytes=64 * PAGE, read_depth=read_depth)
    try:
        yield pf, table, streams
    finally:
        pf.shutdown()
        reader.close()


def test_staged_reads_are_checked_then_copied_and_named_at_commit(part):
    root, data = part
    with staged(root, data) as (pf, table, streams):
        tier = pf.cache.tier("compute")
        assert isinstance(pf.fill.staging, Staging) and pf.fill.staging.free() == 2
        ref = pf.wait(pf.demand([(1, 1)]), timeout=T_OUT)[(1, 1)]
        assert ref.slot == 0 and table.slot((1, 1)) == 0
        # the check saw the staged bytes, then the copy into the slot was enqueued
        assert streams.log == [("check", record(data, 1)[:8].tobytes()), ("copy", tier.address(0))]
        assert pf.fill.staging.free() == 2  # its copy ran: the buffer is back
        with table.launch(1) as slot_of:  # the fake raises unless the copy was waited for
            streams.launch([tier.address(int(slot_of[1]))])
        assert np.array_equal(tier.view(0), record(data, 1))


def test_a_slot_a_launch_read_is_rewritten_only_after_that_launch(part):
    root, data = part
    with staged(root, data, slots=2) as (pf, table, streams):
        tier = pf.cache.tier("compute")
        pf.wait(pf.demand([(1, 0), (1, 1)]), timeout=T_OUT)
        with table.launch(1) as slot_of:
            streams.launch([tier.address(int(slot_of[e])) for e in (0, 1)])
        # two more records evict both: each copy must wait for the launch (the fake raises)
        refs = pf.wait(pf.demand([(2, 2), (2, 3)]), timeout=T_OUT)
        assert table.slot((1, 0)) == table.slot((1, 1)) == -1
        with table.launch(2) as slot_of:
            streams.launch([tier.address(int(slot_of[e])) for e in (2, 3)])
        for key, r in refs.items():
            assert np.array_equal(tier.view(r.slot), record(data, key[1]))


def test_a_staged_record_that_fails_its_check_never_reaches_the_slot(part):
    root, data = part
    with staged(root, data, bad={(1, 2)}) as (pf, table, streams):
        with pytest.raises(PrefetchError, match="part0.bin.*do not match"):
            pf.wait(pf.demand([(1, 2)]), timeout=T_OUT)
        assert not [e for e in streams.log if e[0] == "copy"]
        assert (1, 2) not in pf.cache and table.slot((1, 2)) == -1
        assert pf.fill.staging.free() == 2
        pf.wait(pf.demand([(1, 0)]), timeout=T_OUT)
        assert streams.log[-1][0] == "copy" and table.slot((1, 0)) >= 0


def test_one_staging_buffer_is_reused_only_after_its_copy_ran(part, monkeypatch):
    """With one staging buffer a second read is not handed over (however deep the reader) until
    the first one's copy has left the buffer: every slot ends with its own record."""
    root, data = part
    with staged(root, data, staging=1, read_depth=4) as (pf, table, streams):
        inflight: list = []
        real = pf.fill.read

        def read(job):
            inflight.append(pf.inflight()["inflight_reads"])
            return real(job)

        monkeypatch.setattr(pf.fill, "read", read)
        refs = pf.wait(pf.demand([(1, e) for e in range(4)]), timeout=T_OUT)
        assert inflight == [1, 1, 1, 1] and pf.stats.peak_inflight_reads == 1
        streams.run_copies(10**9)
        tier = pf.cache.tier("compute")
        for key, r in refs.items():
            assert np.array_equal(tier.view(r.slot), record(data, key[1]))


def test_repack_follows_the_copy_and_precedes_the_commit(part):
    """The backend's repack is enqueued behind the record's copy, and the table names the slot
    only after it; a record that fails its check is never repacked."""
    root, data = part
    seen = []

    def repack(view):
        seen.append((table.slot((1, len(seen) + 1)), streams.log[-1][0]))

    with staged(root, data, read_depth=1, bad={(1, 3)}, repack=repack) as (pf, table, streams):
        pf.wait(pf.demand([(1, 1)]), timeout=T_OUT)
        assert seen == [(-1, "copy")]
        with pytest.raises(PrefetchError, match="do not match"):
            pf.wait(pf.demand([(1, 3)]), timeout=T_OUT)
        assert len(seen) == 1


def test_device_reads_chooses_staging_unless_kvikio_really_has_gds(part, monkeypatch, caplog):
    root, data = part
    rr = RecordReader(root, [("part0.bin", data.nbytes)], direct=False)
    streams = FakeStreams()
    table = SlotTable([1], RECORDS, streams)
    kw = dict(staging_bytes=PAGE, table=table, streams=streams, tier=None, threads=2)
    monkeypatch.setattr(device_io, "gpu_reader_unavailable_reason", lambda: "kvikio unavailable")
    with pytest.raises(RuntimeError, match="use_kvikio=True but kvikio unavailable"):
        device_reads(rr, verified=False, use_kvikio=True, **kw)
    # kvikio imports but reads in compat mode: staged, said once on stderr (a warning)
    monkeypatch.setattr(device_io, "gpu_reader_unavailable_reason", lambda: None)
    monkeypatch.setattr(device_io, "gds_status", lambda: (False, "kvikio runs in compat mode"))
    with caplog.at_level(logging.WARNING, logger=device_io.__name__):
        reader, staging = device_reads(rr, verified=False, **kw)
    assert reader is rr and staging.free() == 2
    assert [r.getMessage() for r in caplog.records] == [
        "device reads: O_DIRECT into pinned host buffers, checked there, copied to the GPU on a "
        "copy stream (kvikio runs in compat mode)"]
    # GDS but verified records: still staged (no copy back from the device to check them)
    monkeypatch.setattr(device_io, "gds_status", lambda: (True, "GPUDirect Storage"))
    reader, staging = device_reads(rr, verified=True, **kw)
    assert reader is rr and staging is not None
    with pytest.raises(RuntimeError, match="verified"):
        device_reads(rr, verified=True, use_kvikio=True, **kw)
    rr.close()


def test_staging_buffers_are_page_aligned_and_apart_for_any_record_size():
    """A record stride that is no multiple of 4 KiB (a bank of another writer) still gets one
    page-aligned buffer per read in flight, each its own memory."""
    streams = FakeStreams()
    staging = Staging(3, PAGE + 100, streams, SlotTable([1], RECORDS, streams))
    bufs = [staging.take() for _ in range(3)]
    assert [b.nbytes for b in bufs] == [PAGE + 100] * 3
    starts = sorted(device_io.device_address(b) for b in bufs)
    assert all(a % PAGE == 0 for a in starts)
    assert all(b - a >= PAGE + 100 for a, b in zip(starts, starts[1:]))


def test_a_check_of_device_memory_is_refused():
    """Verification never copies a record back from the device."""

    class DeviceBytes:
        nbytes = PAGE

        def __getitem__(self, s):
            return self

    class Job:
        digest, landing, length, part, offset = object(), DeviceBytes(), PAGE, 0, 0

    fill = Fill(None, Bank(), None, digests=object())
    with pytest.raises(ValueError, match="device memory"):
        fill.check(Job())


def test_gds_status_never_raises():
    ok, why = gds_status()
    assert isinstance(ok, bool) and why
