"""RecordReader: positional reads into caller buffers, O_DIRECT rules, retries, fd bound, hashes."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import CancelledError
from types import SimpleNamespace

import numpy as np
import pytest

from mtplx_runtime.artifact.manifest import Record, Sidecar, SidecarPart
from mtplx_runtime.offload.bank_reader import (
    ReadError,
    RecordHashError,
    RecordReader,
    aligned_buffer,
    from_manifest,
)
from mtplx_runtime.offload.buffers import KvikioReader, gpu_reader_unavailable_reason

PAGE = 4096
REAL_PREADV = os.preadv
REAL_OPEN = os.open


def make_parts(tmp_path, n=1, pages=64, seed=0):
    rng = np.random.default_rng(seed)
    parts, data = [], []
    for i in range(n):
        b = rng.integers(0, 256, pages * PAGE, dtype=np.uint8).tobytes()
        (tmp_path / f"part-{i:03d}.bin").write_bytes(b)
        parts.append((f"part-{i:03d}.bin", len(b)))
        data.append(b)
    return parts, data


def direct_supported(path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        os.preadv(fd, [aligned_buffer(PAGE)], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@pytest.fixture
def bank(tmp_path):
    parts, data = make_parts(tmp_path, n=2)
    return tmp_path, parts, data


def direct_modes(root, parts):
    return [True, False] if direct_supported(root / parts[0][0]) else [False]


def test_aligned_buffer_alignment():
    for align in (PAGE, 1 << 16):
        b = aligned_buffer(3 * PAGE + 5, alignment=align)
        assert b.dtype == np.uint8 and b.shape == (3 * PAGE + 5,) and b.flags.writeable
        assert b.ctypes.data % align == 0 and not b.any()
    with pytest.raises(ValueError):
        aligned_buffer(0)


def test_random_aligned_reads_match(bank):
    root, parts, data = bank
    rng = np.random.default_rng(1)
    for direct in direct_modes(root, parts) + ["auto"]:
        with RecordReader(root, parts, direct=direct) as r:
            for _ in range(20):
                part = int(rng.integers(0, 2))
                npages = int(rng.integers(1, 9))
                off = int(rng.integers(0, 64 - npages + 1)) * PAGE
                buf = aligned_buffer(npages * PAGE)
                assert r.read_into(part, off, npages * PAGE, buf).result() == npages * PAGE
                assert buf.tobytes() == data[part][off:off + npages * PAGE]
            if direct is not False:
                assert r.direct is (direct is True or direct_supported(root / parts[0][0]))


def test_buffered_reads_take_any_offset_and_buffer(bank):
    root, parts, data = bank
    with RecordReader(root, parts, direct=False) as r:
        buf = np.zeros(1000, dtype=np.uint8)
        r.read_into(1, 12345, 777, buf).result()
        assert buf[:777].tobytes() == data[1][12345:12345 + 777] and not buf[777:].any()
        ba = bytearray(100)
        r.read_into(0, 1, 100, ba).result()
        assert bytes(ba) == data[0][1:101]


def spy_preadv(monkeypatch, calls):
    def spy(fd, buffers, offset, *a):
        calls.append((offset, len(buffers)))
        return REAL_PREADV(fd, buffers, offset, *a)
    monkeypatch.setattr(os, "preadv", spy)


def test_coalesced_reads_equal_individual_with_fewer_syscalls(bank, monkeypatch):
    root, parts, data = bank
    calls: list = []
    spy_preadv(monkeypatch, calls)
    # Three runs: pages 2-5 of part 0 (given out of order), pages 10-11 of part 0, 0-2 of part 1.
    reqs = [(0, 4 * PAGE, PAGE), (0, 2 * PAGE, PAGE), (0, 3 * PAGE, PAGE), (0, 5 * PAGE, 2 * PAGE),
            (1, 0, PAGE), (0, 10 * PAGE, PAGE), (1, PAGE, 2 * PAGE), (0, 11 * PAGE, PAGE)]
    with RecordReader(root, parts, direct="auto", read_depth=2) as r:
        r.read_into(0, 0, PAGE, aligned_buffer(PAGE)).result()  # resolve "auto" before counting
        calls.clear()
        bufs = [aligned_buffer(n) for _, _, n in reqs]
        futs = r.read_many([(p, o, n, b, None) for (p, o, n), b in zip(reqs, bufs)])
        assert [f.result() for f in futs] == [n for _, _, n in reqs]
        coalesced = len(calls)
        singles = [aligned_buffer(n) for _, _, n in reqs]
        for (p, o, n), b in zip(reqs, singles):
            r.read_into(p, o, n, b).result()
    assert coalesced == 3 and len(calls) - coalesced == len(reqs)
    assert sorted(n for _, n in calls[:coalesced]) == [2, 2, 4]
    for (p, o, n), b, s in zip(reqs, bufs, singles):
        assert b.tobytes() == s.tobytes() == data[p][o:o + n]


def test_coalescing_respects_max_bytes(bank, monkeypatch):
    root, parts, data = bank
    calls: list = []
    spy_preadv(monkeypatch, calls)
    with RecordReader(root, parts, direct=False, max_coalesce_bytes=2 * PAGE) as r:
        bufs = [aligned_buffer(PAGE) for _ in range(5)]
        for f in r.read_many([(0, i * PAGE, PAGE, b) for i, b in enumerate(bufs)]):
            f.result()
    assert len(calls) == 3
    assert b"".join(b.tobytes() for b in bufs) == data[0][:5 * PAGE]


@pytest.mark.parametrize("step", [1000, PAGE + 123, 3 * PAGE])
def test_short_reads_are_completed(bank, monkeypatch, step):
    root, parts, data = bank
    calls: list = []

    def short(fd, buffers, offset, *a):
        calls.append(offset)
        return min(step, REAL_PREADV(fd, buffers, offset, *a))  # reads all, reports fewer

    for direct in direct_modes(root, parts):
        with RecordReader(root, parts, direct=direct) as r:
            r.read_into(0, 0, PAGE, aligned_buffer(PAGE)).result()
            monkeypatch.setattr(os, "preadv", short)
            calls.clear()
            buf = aligned_buffer(8 * PAGE)
            fut = r.read_into(1, 4 * PAGE, 8 * PAGE, buf)
            if direct and step < PAGE:  # no whole page ever arrives: bounded retries, then fail
                with pytest.raises(ReadError, match="under one page"):
                    fut.result()
                assert len(calls) == 4
                monkeypatch.setattr(os, "preadv", REAL_PREADV)
                continue
            assert fut.result() == 8 * PAGE
            monkeypatch.setattr(os, "preadv", REAL_PREADV)
        assert buf.tobytes() == data[1][4 * PAGE:12 * PAGE]
        progress = step - step % PAGE if direct else step
        assert len(calls) == -(-8 * PAGE // progress)


def test_eintr_and_eagain_are_retried(bank, monkeypatch):
    root, parts, data = bank
    errors = [InterruptedError(errno.EINTR, "Interrupted"), BlockingIOError(errno.EAGAIN, "x")]

    def flaky(fd, buffers, offset, *a):
        if errors:
            raise errors.pop(0)
        return REAL_PREADV(fd, buffers, offset, *a)

    with RecordReader(root, parts, direct=False, retries=3) as r:
        monkeypatch.setattr(os, "preadv", flaky)
        buf = aligned_buffer(2 * PAGE)
        r.read_into(0, PAGE, 2 * PAGE, buf).result()
    assert not errors and buf.tobytes() == data[0][PAGE:3 * PAGE]


def test_persistent_eio_raises_read_error_naming_file_and_offset(bank, monkeypatch):
    root, parts, _ = bank
    calls: list = []

    def broken(fd, buffers, offset, *a):
        calls.append(offset)
        raise OSError(errno.EIO, "Input/output error")

    with RecordReader(root, parts, direct=False, retries=2) as r:
        monkeypatch.setattr(os, "preadv", broken)
        fut = r.read_into(1, 5 * PAGE, 3 * PAGE, aligned_buffer(3 * PAGE))
        with pytest.raises(ReadError) as ei:
            fut.result()
    msg = str(ei.value)
    assert ei.value.errno == errno.EIO and len(calls) == 3
    assert "part-001.bin" in msg and str(5 * PAGE) in msg and str(3 * PAGE) in msg


def test_non_retryable_error_fails_at_once(bank, monkeypatch):
    root, parts, _ = bank
    calls: list = []

    def bad(fd, buffers, offset, *a):
        calls.append(offset)
        raise OSError(errno.EBADF, "Bad file descriptor")

    with RecordReader(root, parts, direct=False) as r:
        monkeypatch.setattr(os, "preadv", bad)
        with pytest.raises(ReadError, match="part-000.bin"):
            r.read_into(0, 0, PAGE, aligned_buffer(PAGE)).result()
    assert len(calls) == 1


def test_misaligned_direct_request_fails_before_any_syscall(bank, monkeypatch):
    root, parts, _ = bank
    calls: list = []
    monkeypatch.setattr(os, "preadv", lambda *a: calls.append(a))
    monkeypatch.setattr(os, "open", lambda *a, **k: calls.append(a))
    buf = aligned_buffer(3 * PAGE)
    odd = memoryview(bytearray(2 * PAGE))[1:]  # a slice view: never page-aligned
    for direct in (True, "auto"):
        with RecordReader(root, parts, direct=direct) as r:
            for args, what in [((0, 512, PAGE, buf), "offset 512"),
                               ((0, 0, 1000, buf), "length 1000"),
                               ((0, 0, PAGE, buf[8:]), "buffer address"),
                               ((0, 0, PAGE, odd), "buffer address")]:
                with pytest.raises(ValueError, match=what):
                    r.read_into(*args)
            with pytest.raises(ValueError, match="outside the part"):
                r.read_into(0, 64 * PAGE, PAGE, buf)
            with pytest.raises(ValueError, match="writable"):
                r.read_into(0, 0, PAGE, bytes(PAGE))
    assert calls == []


def test_sha256_mismatch_after_one_flipped_byte(tmp_path):
    parts, data = make_parts(tmp_path, n=1, pages=16)
    good = hashlib.sha256(data[0][4 * PAGE:8 * PAGE]).hexdigest()
    with RecordReader(tmp_path, parts, direct="auto", verify_sha256=True) as r:
        assert r.read_into(0, 4 * PAGE, 4 * PAGE, aligned_buffer(4 * PAGE), digest=good.upper()
                           ).result() == 4 * PAGE
        with pytest.raises(ValueError, match="no digest"):
            r.read_into(0, 0, PAGE, aligned_buffer(PAGE))
    flipped = bytearray(data[0])
    flipped[6 * PAGE + 17] ^= 0x01
    (tmp_path / parts[0][0]).write_bytes(bytes(flipped))
    with RecordReader(tmp_path, parts, direct="auto") as r:
        other = hashlib.sha256(data[0][:PAGE]).hexdigest()
        futs = r.read_many([(0, 0, PAGE, aligned_buffer(PAGE), other),
                            (0, 4 * PAGE, 4 * PAGE, aligned_buffer(4 * PAGE), good)])
        assert futs[0].result() == PAGE  # same coalesced read, its own digest still matches
        with pytest.raises(RecordHashError) as ei:
            futs[1].result()
    assert "part 0" in str(ei.value) and str(4 * PAGE) in str(ei.value)


class SeenCheck:
    """A digest Check that records the bytes it was given."""

    def __init__(self, seen, name, ok=True):
        self.seen, self.name, self.ok = seen, name, ok

    def verify(self, view):
        self.seen.append((self.name, bytes(view)))
        return None if self.ok else "do not match (test)"


def test_check_objects_run_on_the_bytes_read_and_fail_only_their_read(bank):
    """A Check digest sees exactly its request's bytes, once every byte is in; in a coalesced
    group a failing one fails its own read, not its neighbour's."""
    root, parts, data = bank
    seen: list = []
    with RecordReader(root, parts, direct="auto", read_depth=2) as r:
        futs = r.read_many([
            (0, 0, PAGE, aligned_buffer(PAGE), SeenCheck(seen, "a")),
            (0, PAGE, 2 * PAGE, aligned_buffer(2 * PAGE), SeenCheck(seen, "b", ok=False))])
        assert futs[0].result() == PAGE
        with pytest.raises(RecordHashError, match="test"):
            futs[1].result()
    assert seen == [("a", data[0][:PAGE]), ("b", data[0][PAGE:3 * PAGE])]


def test_open_file_bound_with_more_parts_than_max_open_files(tmp_path, monkeypatch):
    parts, data = make_parts(tmp_path, n=12, pages=4)
    live: set[int] = set()
    peak = [0]
    lock = threading.Lock()
    real_close = os.close

    def spy_open(path, flags, *a, **k):
        fd = REAL_OPEN(path, flags, *a, **k)
        if str(path).endswith(".bin"):
            with lock:
                live.add(fd)
                peak[0] = max(peak[0], len(live))
        return fd

    def spy_close(fd):
        with lock:
            live.discard(fd)
        real_close(fd)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "close", spy_close)
    rng = np.random.default_rng(2)
    with RecordReader(tmp_path, parts, direct="auto", read_depth=4, max_open_files=3) as r:
        reqs = [(int(rng.integers(0, 12)), int(rng.integers(0, 4)) * PAGE) for _ in range(200)]
        bufs = [aligned_buffer(PAGE) for _ in reqs]
        futs = [r.read_into(p, o, PAGE, b) for (p, o), b in zip(reqs, bufs)]
        for f in futs:
            f.result()
    assert 1 <= peak[0] <= 3 and not live
    for (p, o), b in zip(reqs, bufs):
        assert b.tobytes() == data[p][o:o + PAGE]


def test_odirect_unsupported_falls_back_with_one_log_record(bank, monkeypatch, caplog):
    root, parts, data = bank

    def no_direct(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return REAL_OPEN(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", no_direct)
    caplog.set_level(logging.INFO, logger="mtplx_runtime.artifact.manifest")
    with RecordReader(root, parts, direct="auto") as r:
        for part in (0, 1, 0):
            buf = aligned_buffer(2 * PAGE)
            r.read_into(part, 2 * PAGE, 2 * PAGE, buf).result()
            assert buf.tobytes() == data[part][2 * PAGE:4 * PAGE]
        assert r.direct is False
    records = [rec for rec in caplog.records if rec.name == "mtplx_runtime.artifact.manifest"]
    assert len(records) == 1 and "O_DIRECT" in records[0].getMessage()
    with RecordReader(root, parts, direct=True) as r:  # asked for explicitly: no silent fallback
        with pytest.raises(ReadError, match="part-000.bin"):
            r.read_into(0, 0, PAGE, aligned_buffer(PAGE)).result()


def test_concurrent_reads_from_many_threads(tmp_path):
    parts, data = make_parts(tmp_path, n=4, pages=32)
    errors: list = []
    with RecordReader(tmp_path, parts, direct="auto", read_depth=4, max_open_files=2) as r:
        def worker(seed):
            rng = np.random.default_rng(seed)
            try:
                for _ in range(40):
                    p, n = int(rng.integers(0, 4)), int(rng.integers(1, 5))
                    o = int(rng.integers(0, 32 - n + 1)) * PAGE
                    buf = aligned_buffer(n * PAGE)
                    r.read_into(p, o, n * PAGE, buf).result()
                    assert buf.tobytes() == data[p][o:o + n * PAGE]
            except Exception as e:  # surfaced below
                errors.append(e)
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


@pytest.mark.parametrize("depth", [1, 3])
def test_read_depth_reads_are_in_flight_at_once_and_no_more(bank, monkeypatch, depth):
    """preadv held until released: exactly `read_depth` reads wait inside it at once (the pool
    never runs more), and each one released lets the next queued read in."""
    root, parts, data = bank
    cond, inside, peak, go = threading.Condition(), [], [0], set()

    def held(fd, buffers, offset, *a):
        with cond:
            inside.append(offset)
            peak[0] = max(peak[0], len(inside))
            cond.notify_all()
            assert cond.wait_for(lambda: offset in go, 10)
            inside.remove(offset)
        return REAL_PREADV(fd, buffers, offset, *a)

    def wait_held(n):  # reads inside preadv not yet released
        with cond:
            assert cond.wait_for(lambda: len(set(inside) - go) == n, 10), (inside, go)
            return [o for o in inside if o not in go]

    monkeypatch.setattr(os, "preadv", held)
    # Pages 0, 2, 4, ...: never adjacent, so no two requests coalesce into one preadv.
    offsets = [i * 2 * PAGE for i in range(3 * depth)]
    bufs = [aligned_buffer(PAGE) for _ in offsets]
    with RecordReader(root, parts, direct=False, read_depth=depth) as r:
        assert r.read_depth == depth
        futs = r.read_many([(0, o, PAGE, b) for o, b in zip(offsets, bufs)])
        for _ in offsets:
            held_now = wait_held(min(depth, len(offsets) - len(go)))
            with cond:
                go.add(held_now[0])
                cond.notify_all()
        assert [f.result(10) for f in futs] == [PAGE] * len(offsets)
    assert peak[0] == depth
    assert all(b.tobytes() == data[0][o:o + PAGE] for o, b in zip(offsets, bufs))


def test_close_fails_queued_reads_and_does_not_hang(bank, monkeypatch):
    root, parts, _ = bank

    def slow(fd, buffers, offset, *a):
        time.sleep(0.02)
        return REAL_PREADV(fd, buffers, offset, *a)

    monkeypatch.setattr(os, "preadv", slow)
    r = RecordReader(root, parts, direct=False, read_depth=1)
    futs = [r.read_into(0, i * PAGE, PAGE, aligned_buffer(PAGE)) for i in range(0, 60, 2)]
    r.close()
    r.close()
    outcomes = []
    for f in futs:
        assert f.done()
        try:
            outcomes.append(f.result())
        except CancelledError:
            outcomes.append("cancelled")
    assert outcomes.count("cancelled") > 0 and outcomes[0] == PAGE
    with pytest.raises(RuntimeError, match="closed"):
        r.read_into(0, 0, PAGE, aligned_buffer(PAGE))


def test_wrong_size_symlink_and_missing_files_are_read_errors(bank):
    root, parts, _ = bank
    os.symlink(root / parts[0][0], root / "link.bin")
    cases = [([(parts[0][0], parts[0][1] + PAGE)], "expected a regular file"),
             ([("link.bin", parts[0][1])], "symlink"),
             ([("missing.bin", PAGE)], "missing.bin")]
    for bad_parts, match in cases:
        with RecordReader(root, bad_parts, direct=False) as r:
            with pytest.raises(ReadError, match=match):
                r.read_into(0, 0, PAGE, aligned_buffer(PAGE)).result()
    for name in ("../x.bin", "/abs.bin", "a/./b.bin", ""):
        with pytest.raises(ValueError, match="relative POSIX path"):
            RecordReader(root, [(name, PAGE)])


def test_a_part_whose_directory_was_swapped_for_a_link_out_is_refused(bank, tmp_path_factory):
    """A part is checked where its fd really lies: a directory of the bank replaced by a symlink
    to elsewhere after load (when artifact/open checked the paths) is refused at the open."""
    root, parts, data = bank
    (root / "sub").mkdir()
    os.replace(root / parts[0][0], root / "sub" / parts[0][0])
    with RecordReader(root, [(f"sub/{parts[0][0]}", parts[0][1])], direct=False) as r:
        assert r.read_into(0, 0, PAGE, aligned_buffer(PAGE)).result() == PAGE
    outside = tmp_path_factory.mktemp("outside")
    os.replace(root / "sub", outside / "sub")
    os.symlink(outside / "sub", root / "sub")
    with RecordReader(root, [(f"sub/{parts[0][0]}", parts[0][1])], direct=False) as r:
        with pytest.raises(ReadError, match="outside"):
            r.read_into(0, 0, PAGE, aligned_buffer(PAGE)).result()


def test_from_manifest_reads_records_with_data_start(tmp_path):
    parts, data = make_parts(tmp_path, n=2, pages=16)
    sidecar = Sidecar(alignment=PAGE, parts=[
        SidecarPart(file=parts[0][0], size=parts[0][1], sha256="0" * 64),
        SidecarPart(file=parts[1][0], size=parts[1][1], sha256="0" * 64, data_start=2 * PAGE)])
    rec = Record(layer=2, expert=1, logical_bytes=2 * PAGE, segments=[], part=1,
                 sidecar_offset=3 * PAGE, sidecar_length=2 * PAGE,
                 sha256=hashlib.sha256(data[1][5 * PAGE:7 * PAGE]).hexdigest())
    with from_manifest(tmp_path, SimpleNamespace(sidecar=sidecar), verify_sha256=True) as r:
        buf = aligned_buffer(2 * PAGE)
        assert r.read_record(rec, buf).result() == 2 * PAGE
        assert buf.tobytes() == data[1][5 * PAGE:7 * PAGE]
        rec.sha256 = "f" * 64
        with pytest.raises(RecordHashError):
            r.read_record(rec, buf).result()


def test_gpu_path_degrades_cleanly(bank):
    root, parts, _ = bank
    reason = gpu_reader_unavailable_reason()
    assert reason is None or (isinstance(reason, str) and reason)
    if reason is not None:
        with pytest.raises(RuntimeError, match="KvikioReader unavailable"):
            KvikioReader(root, parts)


def test_reader_import_does_not_import_cupy_or_kvikio():
    code = ("import sys, mtplx_runtime.offload.bank_reader; "
            "bad = [m for m in ('cupy', 'kvikio') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
