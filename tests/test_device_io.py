"""The staged path to device slots (pread -> pinned staging -> check -> copy into the slot) through
the fill pipeline and the prefetcher, and SlotGuard, driven without a GPU: the "device" slots are
host arrays and the copy is a host copy, so the ordering (check before the copy, guard wait
before the copy, commit after it), the staging pool's bound and the error paths are checked
here."""

import hashlib

import numpy as np
import pytest

from mtplx_runtime.artifact.open import RecordLocation
from mtplx_runtime.offload.bank_reader import RecordReader
from mtplx_runtime.offload.buffers import aligned_buffer
from mtplx_runtime.offload.cache import ExpertCache
from mtplx_runtime.offload.device_io import SlotGuard, Staging, device_reads, kvikio_mode
from mtplx_runtime.offload.fill import Fill
from mtplx_runtime.offload.prefetch import Prefetcher, PrefetchError

PAGE = 4096
T_OUT = 10.0


class Event:
    """A CUDA event stand-in: records when it was waited on, relative to the copies."""

    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("wait")


@pytest.fixture
def part(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 4 * PAGE, dtype=np.uint8)
    (tmp_path / "part0.bin").write_bytes(data.tobytes())
    return tmp_path, data


class Bank:
    """Expert e of layer 1 is page e of part0.bin."""

    def locate(self, layer, expert):
        if not 0 <= expert < 4:
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


def staged(root, data, log, *, staging=2, read_depth=2, bad=()):
    """A prefetcher filling "device" slots (host memory) through `staging` staging buffers."""
    guard = SlotGuard()

    def to_device(host, dev):
        log.append("copy")
        np.copyto(dev, host)

    reader = RecordReader(root, [("part0.bin", data.nbytes)], direct=False, read_depth=read_depth)
    reader, stage = device_reads(reader, staging_bytes=PAGE, guard=guard, threads=staging,
                                 use_kvikio=False, to_device=to_device)
    cache = ExpertCache(PAGE, 4 * PAGE, scope="global", device="cpu")
    fill = Fill(reader, Bank(), cache, digests=Digests(data, log, bad), staging=stage)
    return Prefetcher(fill, max_inflight_bytes=64 * PAGE, read_depth=read_depth), guard, reader


def test_staged_reads_are_checked_in_staging_then_copied_after_the_guard(part):
    root, data = part
    log: list = []
    pf, guard, reader = staged(root, data, log)
    assert isinstance(pf.fill.staging, Staging) and pf.fill.staging.free() == 2
    try:
        guard.mark([pf.cache.tier("compute").view(0)], Event(log))  # a kernel reads slot 0
        ref = pf.wait(pf.demand([(1, 1)]), timeout=T_OUT)[(1, 1)]
        assert ref.slot == 0  # the first free slot
        # the check saw the staged bytes before any copy; the guard was waited on before the copy
        assert log == [("check", data[PAGE:PAGE + 8].tobytes()), "wait", "copy"]
        assert np.array_equal(pf.cache.buffer(ref), data[PAGE:2 * PAGE])
        assert pf.fill.staging.free() == 2  # the staging buffer came back
        refs = pf.wait(pf.demand([(1, 0), (1, 2), (1, 3)]), timeout=T_OUT)
        for key, r in refs.items():
            assert np.array_equal(pf.cache.buffer(r), data[key[1] * PAGE:(key[1] + 1) * PAGE])
        assert log.count("wait") == 1 and log.count("copy") == 4
    finally:
        pf.shutdown()
        reader.close()


def test_a_staged_record_that_fails_its_check_never_reaches_the_slot(part):
    root, data = part
    log: list = []
    pf, guard, reader = staged(root, data, log, bad={(1, 2)})
    try:
        with pytest.raises(PrefetchError, match="part0.bin.*do not match"):
            pf.wait(pf.demand([(1, 2)]), timeout=T_OUT)
        assert "copy" not in log and (1, 2) not in pf.cache  # checked, refused, slot aborted
        assert pf.fill.staging.free() == 2
        ref = pf.wait(pf.demand([(1, 0)]), timeout=T_OUT)[(1, 0)]
        assert np.array_equal(pf.cache.buffer(ref), data[:PAGE]) and log[-1] == "copy"
    finally:
        pf.shutdown()
        reader.close()


def test_reads_wait_in_the_prefetcher_for_a_free_staging_buffer(part, monkeypatch):
    """With one staging buffer a second read is not handed over (however deep the reader) until
    the first one's bytes are in their slot and its buffer is back."""
    root, data = part
    log: list = []
    pf, guard, reader = staged(root, data, log, staging=1, read_depth=4)
    inflight: list = []
    real = pf.fill.read

    def read(job):
        inflight.append(pf.inflight()["inflight_reads"])
        return real(job)

    monkeypatch.setattr(pf.fill, "read", read)
    try:
        refs = pf.wait(pf.demand([(1, 0), (1, 1), (1, 2), (1, 3)]), timeout=T_OUT)
        assert len(refs) == 4 and inflight == [1, 1, 1, 1] and log.count("copy") == 4
        assert pf.stats.peak_inflight_reads == 1
    finally:
        pf.shutdown()
        reader.close()


def test_repack_runs_on_the_slot_after_the_copy(part):
    """The kernel backend's repack sees the record in its device slot after the copy and before
    the read resolves; a record that fails its check is never repacked."""
    root, data = part
    log: list = []
    guard = SlotGuard()

    def to_device(host, dev):
        log.append("copy")
        np.copyto(dev, host)

    def repack(slot):
        log.append(("repack", bytes(slot[:4])))

    reader = RecordReader(root, [("part0.bin", data.nbytes)], direct=False, read_depth=1)
    reader, stage = device_reads(reader, staging_bytes=PAGE, guard=guard, threads=1,
                                 use_kvikio=False, to_device=to_device)
    cache = ExpertCache(PAGE, 4 * PAGE, scope="global", device="cpu")
    fill = Fill(reader, Bank(), cache, digests=Digests(data, log, bad={(1, 2)}), staging=stage,
                repack=repack)
    pf = Prefetcher(fill, max_inflight_bytes=64 * PAGE, read_depth=1)
    try:
        pf.wait(pf.demand([(1, 1)]), timeout=T_OUT)
        assert log == [("check", data[PAGE:PAGE + 8].tobytes()), "copy",
                       ("repack", data[PAGE:PAGE + 4].tobytes())]
        with pytest.raises(PrefetchError, match="do not match"):
            pf.wait(pf.demand([(1, 2)]), timeout=T_OUT)
        assert [e for e in log if e[0] == "repack"] == [log[2]]
    finally:
        pf.shutdown()
        reader.close()


def test_guard_waits_once_per_mark():
    log = []
    guard = SlotGuard()
    bufs = aligned_buffer(2 * PAGE).reshape(2, PAGE)
    guard.mark(bufs, Event(log))
    guard.wait(bufs[0])
    guard.wait(bufs[0])
    assert log == ["wait"]
    guard.wait(bufs[1])
    assert log == ["wait", "wait"]


def test_kvikio_demanded_but_missing_is_a_clear_error(part, monkeypatch):
    import mtplx_runtime.offload.device_io as dio

    monkeypatch.setattr(dio, "gpu_reader_unavailable_reason", lambda: "kvikio unavailable (x)")
    root, data = part
    rr = RecordReader(root, [("part0.bin", data.nbytes)], direct=False)
    with pytest.raises(RuntimeError, match="use_kvikio=True but kvikio unavailable"):
        device_reads(rr, staging_bytes=PAGE, guard=SlotGuard(), threads=2, use_kvikio=True)
    reader, staging = device_reads(rr, staging_bytes=PAGE, guard=SlotGuard(), threads=2)
    assert reader is rr and staging.free() == 2  # auto: staged, one buffer per read in flight
    rr.close()
    assert kvikio_mode()  # the real probe never raises
