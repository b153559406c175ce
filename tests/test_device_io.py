"""DeviceReader's staged path (pread -> host staging -> copy into the slot) and SlotGuard, driven
without a GPU: the "device" slots are host arrays and the copy is a host copy, so the ordering
(guard wait before the copy, future resolved after it) and the error paths are checked here."""

import hashlib

import numpy as np
import pytest

from mtplx_runtime.offload.bank_reader import RecordHashError, RecordReader
from mtplx_runtime.offload.buffers import aligned_buffer
from mtplx_runtime.offload.device_io import DeviceReader, SlotGuard, kvikio_mode

PAGE = 4096


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


def reader_for(root, data, **kw):
    rr = RecordReader(root, [("part0.bin", data.nbytes)], direct=False)
    log = []

    def to_device(host, dev):
        log.append("copy")
        np.copyto(dev, host)

    return DeviceReader(rr, staging_bytes=2 * PAGE, use_kvikio=False, threads=2,
                        to_device=to_device, **kw), log


def test_staged_reads_land_in_the_slot_after_the_guard(part):
    root, data = part
    guard = SlotGuard()
    dr, log = reader_for(root, data, guard=guard)
    slots = aligned_buffer(4 * PAGE).reshape(2, 2 * PAGE)
    guard.mark([slots[1]], Event(log))  # a kernel still reads slot 1
    try:
        assert "staged" in dr.mode and not dr.kvikio
        assert dr.read_into(0, PAGE, 2 * PAGE, slots[1]).result() == 2 * PAGE
        assert log == ["wait", "copy"]  # the event is waited on before the slot is written
        assert np.array_equal(slots[1], data[PAGE:3 * PAGE])
        digest = hashlib.sha256(data[:PAGE].tobytes()).hexdigest()
        def on_read():
            log.append("read")

        assert dr.read_into(0, 0, PAGE, slots[0], digest=digest, on_read=on_read).result() == PAGE
        # slot 0 had no kernel: no wait; slot 1's is gone. The drive is done before the copy.
        assert log == ["wait", "copy", "read", "copy"]
        assert np.array_equal(slots[0][:PAGE], data[:PAGE])
        futs = [dr.read_into(0, i * PAGE, PAGE, slots[i % 2]) for i in range(4)]
        assert [f.result() for f in futs] == [PAGE] * 4
    finally:
        dr.close()


def test_staged_read_errors_reach_the_future(part):
    root, data = part
    dr, log = reader_for(root, data)
    slot = aligned_buffer(2 * PAGE)
    try:
        with pytest.raises(RecordHashError):
            dr.read_into(0, 0, PAGE, slot, digest="0" * 64).result()
        with pytest.raises(ValueError, match="outside the part"):
            dr.read_into(0, 3 * PAGE, 2 * PAGE, slot).result()
        with pytest.raises(ValueError, match="destination holds"):
            dr.read_into(0, 0, 2 * PAGE, slot[:PAGE])
        assert log == []  # nothing was copied into the slot
        assert dr.read_into(0, 0, PAGE, slot).result() == PAGE  # staging buffers came back
    finally:
        dr.close()


def test_prepare_runs_once_the_bytes_are_in_the_slot(part):
    """The kernel backend's repack sees the slot after the copy and before the read resolves;
    a record that fails its check is never prepared."""
    root, data = part
    rr = RecordReader(root, [("part0.bin", data.nbytes)], direct=False)
    log = []

    def to_device(host, dev):
        log.append("copy")
        np.copyto(dev, host)

    def prepare(dev):
        log.append(("prepare", bytes(dev[:4]) == data[:4].tobytes()))

    dr = DeviceReader(rr, staging_bytes=2 * PAGE, use_kvikio=False, threads=1,
                      to_device=to_device, prepare=prepare)
    slot = aligned_buffer(2 * PAGE)
    try:
        assert dr.read_into(0, 0, PAGE, slot).result() == PAGE
        assert log == ["copy", ("prepare", True)]
        with pytest.raises(RecordHashError):
            dr.read_into(0, 0, PAGE, slot, digest="0" * 64).result()
        assert log == ["copy", ("prepare", True)]
    finally:
        dr.close()


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
        DeviceReader(rr, staging_bytes=PAGE, use_kvikio=True)
    rr.close()
    assert kvikio_mode()  # the real probe never raises
