"""Reads into GPU expert slots, guarded by the CUDA events of the kernels that read them.

    prefetcher -> DeviceReader.read_into(part, offset, length, device slot)
        guard.wait(slot)            the last kernel that read the slot has finished
        kvikio:  CuFile.pread(slot) GDS where the system has it, kvikio's POSIX compat mode else
        staging: RecordReader (O_DIRECT/pread) -> pinned host buffer -> copy stream -> slot
        prepare(slot)               the kernel backend's one-time repack (kernels/cuda.py)

Both paths resolve the returned future only once the bytes are in the slot (and prepared), so
the cache's commit (and a kernel launch after it) never sees a half-written record. The staging
path reuses the RecordReader's checks, retries and digest checks; kvikio reads are checked on a
host copy of the slot (a device-to-host copy per record: on this path read-time checking costs PCIe
bandwidth until a device-side check exists).
Nothing here imports cupy or kvikio at module import: the CPU build never needs them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from .bank_reader import Digest, RecordHashError, check_digest
from .buffers import (
    KvikioReader,
    aligned_buffer,
    buffer_address,
    gpu_reader_unavailable_reason,
)

log = logging.getLogger(__name__)


def device_address(buf) -> int:
    """The address of a cupy array's first byte, or of a host buffer (numpy, memoryview)."""
    data = getattr(buf, "data", None)
    ptr = getattr(data, "ptr", None)
    return int(ptr) if ptr is not None else buffer_address(memoryview(buf))


class SlotGuard:
    """The CUDA event recorded after the last kernel launch that read each slot (keyed by the
    slot's address). A read into a slot first waits for that event: the cache may hand a slot to
    a new record as soon as the kernel is enqueued, long before it has run."""

    def __init__(self):
        self._events: dict[int, object] = {}
        self._lock = threading.Lock()

    def mark(self, buffers, event) -> None:
        """`event` (anything with `synchronize()`) follows the last read of every buffer."""
        with self._lock:
            for b in buffers:
                self._events[device_address(b)] = event

    def wait(self, buf) -> None:
        """Block until the last kernel that read `buf` has finished (no-op if none did)."""
        with self._lock:
            event = self._events.pop(device_address(buf), None)
        if event is not None:
            event.synchronize()


def kvikio_mode() -> str:
    """Whether kvikio reads with GPUDirect Storage or its POSIX compat mode (never raises)."""
    try:
        import kvikio.defaults

        compat = bool(kvikio.defaults.is_compat_mode_preferred())
    except Exception as e:  # API differences between releases: the mode is only reported
        return f"mode unknown ({type(e).__name__})"
    return "compat mode (POSIX reads + bounce buffers)" if compat else "GPUDirect Storage"


class DeviceReader:
    """`read_into(part, offset, length, buf, *, digest=None) -> Future[int]` into device slots,
    the RecordReader contract (which it wraps) for cupy destinations.

    use_kvikio: True, False or "auto" (kvikio when cupy sees a GPU and kvikio imports: the
    offload.buffers.KvikioReader). staging_bytes: the largest read (one record); `threads`
    staging buffers of that size are allocated, pinned when cupy can. `to_device(host_view,
    dev_buf)` copies and returns when the bytes have landed (default: cupy `set` on a dedicated
    copy stream, then that stream's synchronize); tests pass a host copy to drive the staging
    path without a GPU. `prepare(dev_buf)`, when given, runs once a record's bytes are in the
    slot and checked, before its read resolves, and returns when done (the CUDA backend's
    `prepare_slot`: records of some codecs are repacked in place for the kernels).
    """

    def __init__(self, reader, *, staging_bytes: int, guard: SlotGuard | None = None,
                 use_kvikio: bool | str = "auto", threads: int = 4,
                 to_device: Callable | None = None, prepare: Callable | None = None):
        if use_kvikio not in (True, False, "auto"):
            raise ValueError(f"use_kvikio must be True, False or 'auto', got {use_kvikio!r}")
        self.reader, self.guard = reader, guard or SlotGuard()
        why = gpu_reader_unavailable_reason() if use_kvikio else "kvikio off"
        ok = why is None
        if use_kvikio is True and not ok:
            raise RuntimeError(f"use_kvikio=True but {why}")
        self.kvikio = ok
        self._kvikio = KvikioReader(reader.root, [p[:2] for p in reader.parts]) if ok else None
        self._kvikio_lock = threading.Lock()  # KvikioReader opens files lazily, unlocked
        self.mode = (f"kvikio: {kvikio_mode()}" if ok else
                     f"staged: pread -> pinned host buffer -> copy stream ({why})")
        log.info("device reads: %s", self.mode)
        self._to_device = to_device or _stream_copy()
        self._prepare = prepare
        self._staging: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(0 if ok else threads):
            self._staging.put(_host_buffer(staging_bytes))
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mtplx-devread")

    def read_into(self, part: int, offset: int, length: int, buf, *,
                  digest: Digest | None = None,
                  on_read: Callable[[], None] | None = None) -> Future[int]:
        """RecordReader.read_into into device memory: `on_read` once the bytes are off the
        drive (in staging, or on the device through kvikio), before the check and the copy."""
        if getattr(buf, "nbytes", length) < length:
            raise ValueError(f"destination holds {buf.nbytes} B, the read needs {length}")
        run = self._kvikio_read if self.kvikio else self._staged_read
        return self._pool.submit(run, part, offset, length, buf, digest, on_read)

    def _staged_read(self, part, offset, length, buf, digest, on_read) -> int:
        host = self._staging.get()  # never blocks: one buffer per pool thread
        try:
            view = host[:length]
            self.reader.read_into(part, offset, length, view, digest=digest,
                                  on_read=on_read).result()
            self.guard.wait(buf)
            self._to_device(view, buf[:length])
        finally:
            self._staging.put(host)
        if self._prepare is not None:
            self._prepare(buf)
        return length

    def _kvikio_read(self, part, offset, length, buf, digest, on_read) -> int:
        self.guard.wait(buf)
        with self._kvikio_lock:
            future = self._kvikio.read_into(part, offset, length, buf[:length])
        got = future.get()
        if got != length:
            raise OSError(f"part {part}: kvikio read {got} of {length} B at offset {offset}")
        if on_read is not None:
            on_read()
        if digest is not None:
            why = check_digest(digest.lower() if isinstance(digest, str) else digest,
                               memoryview(buf[:length].get()).cast("B"))
            if why is not None:
                raise RecordHashError(f"part {part} bytes at offset {offset} length {length} "
                                      f"{why}")
        if self._prepare is not None:
            self._prepare(buf)
        return length

    @property
    def direct(self):
        return self.reader.direct

    def close(self) -> None:
        """Finish running reads, drop queued ones, close kvikio files and the wrapped reader."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._kvikio is not None:
            self._kvikio.close()
        self.reader.close()


def _host_buffer(nbytes: int):
    """A page-aligned staging buffer, CUDA-pinned when cupy has a device (async-copy capable)."""
    from .slots import SlotTier, cuda_unavailable_reason

    if cuda_unavailable_reason() is None:
        return SlotTier("staging", nbytes, nbytes, pinned_host=True).view(0)
    return aligned_buffer(nbytes)


def _stream_copy() -> Callable:
    """host -> device copy on a per-thread non-blocking stream, returning once it has landed."""
    local = threading.local()

    def copy(host, dev) -> None:
        import cupy

        stream = getattr(local, "stream", None)
        if stream is None:
            stream = local.stream = cupy.cuda.Stream(non_blocking=True)
        dev.set(host, stream=stream)
        stream.synchronize()

    return copy
