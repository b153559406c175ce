"""Reads into GPU expert slots, for the fill pipeline (offload/fill.py), guarded by the CUDA
events of the kernels that read the slots.

    staged (no kvikio): RecordReader (O_DIRECT/preadv) -> pinned staging buffer -> check
                        -> repack -> commit: guard.wait(slot), copy on a copy stream -> slot
    kvikio:             guard.wait(slot) -> CuFile.pread into the slot (GDS where the system has
                        it, kvikio's POSIX compat mode else) -> check on a host copy -> commit

`device_reads` picks one of the two once. Either way the cache's commit (and a kernel launch
after it) comes only once the bytes are in the slot, so a kernel never sees a half-written
record. kvikio reads are checked on a host copy of the slot (a device-to-host copy per record:
on that path read-time checking costs PCIe bandwidth until a device-side check exists).
Nothing here imports cupy or kvikio at module import: the CPU build never needs them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from .buffers import (
    KvikioReader,
    aligned_buffer,
    buffer_address,
    gpu_reader_unavailable_reason,
)

__all__ = ["DeviceReader", "SlotGuard", "Staging", "device_reads", "kvikio_mode"]

log = logging.getLogger(__name__)


def device_address(buf) -> int:
    """The address of a cupy array's first byte, or of a host buffer (numpy, memoryview)."""
    data = getattr(buf, "data", None)
    ptr = getattr(data, "ptr", None)
    return int(ptr) if ptr is not None else buffer_address(memoryview(buf))


class SlotGuard:
    """The CUDA event recorded after the last kernel launch that read each slot (keyed by the
    slot's address). A write into a slot first waits for that event: the cache may hand a slot
    to a new record as soon as the kernel is enqueued, long before it has run."""

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


class Staging:
    """The pinned host buffers staged reads land in (one record each), and their way into a
    device slot (`place`). `take`/`give` are not locked: the prefetcher calls them under its
    own lock. `to_device(host_view, dev_buf)` copies and returns when the bytes have landed
    (default: cupy `set` on a per-thread non-blocking copy stream, then its synchronize); tests
    pass a host copy to drive the staged path without a GPU."""

    def __init__(self, count: int, nbytes: int, guard: SlotGuard,
                 to_device: Callable | None = None):
        self.guard = guard
        self._to_device = to_device or _stream_copy()
        self._free = [_host_buffer(nbytes) for _ in range(count)]

    def free(self) -> int:
        return len(self._free)

    def take(self):
        return self._free.pop()

    def give(self, buf) -> None:
        self._free.append(buf)

    def place(self, host, dev) -> None:
        """Copy the checked bytes `host` into the device slot `dev` once no kernel reads it."""
        self.guard.wait(dev)
        self._to_device(host, dev)


class DeviceReader:
    """kvikio reads straight into device slots: `read_into(part, offset, length, dev_buf) ->
    Future[int]` (the RecordReader contract, whose parts it reads), each on one of `threads`
    threads: wait for the slot's guard, `CuFile.pread`, resolve once the bytes are in."""

    def __init__(self, reader, *, guard: SlotGuard, threads: int):
        self.reader, self.guard = reader, guard
        self.parts = reader.parts
        self._kvikio = KvikioReader(reader.root, [p[:2] for p in reader.parts])
        self._kvikio_lock = threading.Lock()  # KvikioReader opens files lazily, unlocked
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mtplx-devread")

    def read_into(self, part: int, offset: int, length: int, buf) -> Future[int]:
        if getattr(buf, "nbytes", length) < length:
            raise ValueError(f"destination holds {buf.nbytes} B, the read needs {length}")
        return self._pool.submit(self._read, part, offset, length, buf)

    def _read(self, part, offset, length, buf) -> int:
        self.guard.wait(buf)
        with self._kvikio_lock:
            future = self._kvikio.read_into(part, offset, length, buf[:length])
        got = future.get()
        if got != length:
            raise OSError(f"part {part}: kvikio read {got} of {length} B at offset {offset}")
        return length

    @property
    def direct(self):
        return self.reader.direct

    @property
    def read_depth(self) -> int:
        return self.reader.read_depth

    def close(self) -> None:
        """Finish running reads, drop queued ones, close kvikio files and the wrapped reader."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._kvikio.close()
        self.reader.close()


def device_reads(reader, *, staging_bytes: int, guard: SlotGuard, threads: int,
                 use_kvikio: bool | str = "auto", to_device: Callable | None = None):
    """How records reach device slots, chosen once: (DeviceReader over `reader`, None) when
    kvikio can read (use_kvikio True or "auto"), else (`reader`, Staging of `threads` buffers of
    `staging_bytes`: one per read in flight). use_kvikio=True without kvikio is a RuntimeError
    with the reason."""
    if use_kvikio not in (True, False, "auto"):
        raise ValueError(f"use_kvikio must be True, False or 'auto', got {use_kvikio!r}")
    why = gpu_reader_unavailable_reason() if use_kvikio else "kvikio off"
    if use_kvikio is True and why is not None:
        raise RuntimeError(f"use_kvikio=True but {why}")
    if why is None:
        log.info("device reads: kvikio: %s", kvikio_mode())
        return DeviceReader(reader, guard=guard, threads=threads), None
    log.info("device reads: staged: pread -> pinned host buffer -> copy stream (%s)", why)
    return reader, Staging(threads, staging_bytes, guard, to_device)


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
