"""The GPU side of the offload: the streams and events that order slot writes against the
kernels, reads into device slots for the fill pipeline (offload/fill.py), and a route's ids
handed to the host without a wait.

    staged (the default):  RecordReader (O_DIRECT/preadv) -> pinned staging buffer -> check
                           -> copy stream: wait for the slot's guard, cudaMemcpyAsync -> slot,
                              repack -> commit (the copy stream's event, which the layer's
                              next launch waits on) -> the staging buffer back once its copy ran
    kvikio (GPUDirect Storage, records not verified): guard and copy stream synchronized ->
                           CuFile.pread into the slot -> commit

`device_reads` picks one of the two once and says which on stderr. GDS writes the slot by DMA
outside any stream, so its guard is a host wait on the reader's thread; it is chosen only where
kvikio really reads with GDS (its compat mode reads with POSIX through a bounce buffer, one
thread, a sync per chunk) and records are not verified (a check never copies a record back
from the device: verified reads are checked in their staging buffer). `CudaStreams` is the
one place that touches CUDA streams: torch's current stream computes, one copy stream writes
every compute slot (staged records, repacks, tier moves: one stream, so they stay in order),
and events order the two.
Tests drive every path here with a fake of its methods. Nothing here imports cupy or kvikio at
module import: the CPU build never needs them.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ..formats.record import align_up
from .buffers import KvikioReader, buffer_address, gpu_reader_unavailable_reason
from .slots import SlotTier

__all__ = ["CudaStreams", "DeviceReader", "HostIds", "Staging", "device_reads", "gds_status",
           "tier_mover"]

log = logging.getLogger(__name__)


def device_address(buf) -> int:
    """The address of a cupy array's first byte, or of a host buffer (numpy, memoryview)."""
    data = getattr(buf, "data", None)
    ptr = getattr(data, "ptr", None)
    return int(ptr) if ptr is not None else buffer_address(memoryview(buf))


class CudaStreams:
    """Compute on torch's current stream, every compute-slot write on one copy stream, CUDA
    events between them (the methods the slot table, the staging and the provider use; a test
    fake has the same). `slot_memory`: where the compute tier lives ("cuda": cupy memory)."""

    slot_memory = "cuda"

    def __init__(self, device: str | torch.device = "cuda"):
        self.device = torch.device(device)
        self.copy = torch.cuda.Stream(self.device)  # torch's pool streams are non-blocking

    def compute_event(self, timing: bool = False) -> torch.cuda.Event:
        """An event recorded now on the compute stream (torch's current one)."""
        e = torch.cuda.Event(enable_timing=timing)
        e.record(torch.cuda.current_stream(self.device))
        return e

    def copy_event(self) -> torch.cuda.Event:
        """An event recorded now on the copy stream: after every copy enqueued so far."""
        e = torch.cuda.Event()
        e.record(self.copy)
        return e

    def compute_wait(self, event) -> None:
        """The compute stream's later work waits for `event` (no host wait)."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def copy_wait(self, event) -> None:
        """The copy stream's later work waits for `event` (no host wait)."""
        self.copy.wait_event(event)

    def copy_bytes(self, dst: int, src: int, nbytes: int) -> None:
        """cudaMemcpyAsync(dst, src) on the copy stream, addresses of device or pinned host
        memory (the direction from unified addressing). Returns at once."""
        import cupy

        rt = cupy.cuda.runtime
        rt.memcpyAsync(dst, src, nbytes, rt.memcpyDefault, self.copy.cuda_stream)

    def upload(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """dst (device) <- src (host) on the compute stream, from a pinned snapshot of src that
        torch's host allocator keeps until the copy ran: src may change at once."""
        dst.copy_(torch.from_numpy(src).pin_memory(), non_blocking=True)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned host tensor `t` is being copied into on the compute stream: read it only
        after an event recorded later on that stream."""
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out


class HostIds:
    """One layer's route on its way to the host: `ids` [T, K] and the lookahead's `predicted`
    {layer: ids [T, K']} copied into pinned host memory on the compute stream, and the event
    after those copies. `taken`: the provider has used it (waited on, or accounted later)."""

    __slots__ = ("layer", "ids", "predicted", "event", "taken")

    def __init__(self, streams, layer: int, ids: torch.Tensor, predicted):
        self.layer = int(layer)
        self.ids = streams.to_host(ids)
        self.predicted = {int(t): streams.to_host(p) for t, p in predicted.items()}
        self.event = streams.compute_event()
        self.taken = False

    def ready(self) -> bool:
        """Whether the copies have landed (never blocks)."""
        return bool(self.event.query())

    def wait(self) -> None:
        """Block until the copies have landed: the one host wait a layer may cost."""
        self.event.synchronize()


class Staging:
    """The pinned host buffers staged reads land in (one record each), and their way into a
    device slot (`place`): enqueued on the copy stream after the slot's guard. A buffer goes
    back to the pool (`give`) only once its copy has run (`drain`, on the reader thread that
    placed it). `take` / `give` / `free` hold a small lock of their own."""

    def __init__(self, count: int, nbytes: int, streams, table):
        self.streams, self.table = streams, table
        # One page-aligned slot per buffer, CUDA-pinned where cupy has a device (async copies).
        tier = SlotTier("staging", nbytes, count * align_up(nbytes), pinned_host=True)
        self._free = [tier.view(i) for i in range(count)]
        self._copies: dict[int, object] = {}  # buffer address -> event after its copy
        self._lock = threading.Lock()

    def free(self) -> int:
        with self._lock:
            return len(self._free)

    def take(self):
        with self._lock:
            return self._free.pop()

    def give(self, buf) -> None:
        self.drain(buf)  # a copy still reading it (a failed fill after its transfer)
        with self._lock:
            self._free.append(buf)

    def place(self, host, dev, slot: int) -> None:
        """Enqueue the copy of the checked bytes `host` (a staging buffer) into compute slot
        `slot` (`dev`, its view): after the last kernel launch that read the slot (its guard,
        waited for on the copy stream), never before. Returns at once."""
        guard = self.table.guard(slot)
        if guard is not None:
            self.streams.copy_wait(guard)
        self.streams.copy_bytes(device_address(dev), device_address(host), host.nbytes)
        event = self.streams.copy_event()
        with self._lock:
            self._copies[device_address(host)] = event

    def drain(self, host) -> None:
        """Block until the copy out of staging buffer `host` has run (no-op if none)."""
        with self._lock:
            event = self._copies.pop(device_address(host), None)
        if event is not None:
            event.synchronize()


def tier_mover(streams, table):
    """The ExpertCache's `mover` for a GPU compute tier: a demotion (compute -> pinned host) or
    promotion (host -> compute) enqueued on the copy stream, a promotion after the guard of its
    compute slot; the cache's `on_slot` hook then records the copy event its layer's next launch
    waits on. One stream keeps a slot's copies in the order they were enqueued."""

    def move(dst, dst_slot: int, src, src_slot: int) -> None:
        if dst.name == "compute":
            guard = table.guard(dst_slot)
            if guard is not None:
                streams.copy_wait(guard)
        streams.copy_bytes(dst.address(dst_slot), src.address(src_slot), dst.record_bytes)

    return move


class DeviceReader:
    """kvikio reads straight into device slots: `read_into(part, offset, length, dev_buf) ->
    Future[int]` (the RecordReader contract, whose parts it reads), each on one of `threads`
    threads: wait for the slot's guard and for the copy stream (a demotion may still be reading
    the slot), `CuFile.pread`, resolve once the bytes are in. kvikio's own pool gets `threads`
    threads too."""

    def __init__(self, reader, *, table, streams, tier, threads: int):
        self.reader, self.table, self.streams, self.tier = reader, table, streams, tier
        self.parts = reader.parts
        self._kvikio = KvikioReader(reader.root, [p[:2] for p in reader.parts])
        _kvikio_threads(threads)
        self._kvikio_lock = threading.Lock()  # KvikioReader opens files lazily, unlocked
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mtplx-devread")

    def read_into(self, part: int, offset: int, length: int, buf) -> Future[int]:
        if getattr(buf, "nbytes", length) < length:
            raise ValueError(f"destination holds {buf.nbytes} B, the read needs {length}")
        return self._pool.submit(self._read, part, offset, length, buf)

    def _read(self, part, offset, length, buf) -> int:
        # GDS writes by DMA outside any stream: both waits are on this thread.
        guard = self.table.guard(self.tier.slot_at(device_address(buf)))
        for event in (guard, self.streams.copy_event()):
            if event is not None:
                event.synchronize()
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


def gds_status() -> tuple[bool, str]:
    """(True, "GPUDirect Storage") where kvikio reads with GDS; else (False, why not). Asks
    kvikio whether it prefers its compat mode, then cuFile whether GDS is available
    (`kvikio.cufile_driver` must be imported on its own). Never raises."""
    try:
        import kvikio.defaults
    except Exception as e:  # missing, or a broken install (no libcufile): the reason is all
        return False, f"kvikio is not available ({type(e).__name__}: {e})"
    try:
        preferred = getattr(kvikio.defaults, "is_compat_mode_preferred", None)
        compat = bool(preferred() if preferred is not None else kvikio.defaults.compat_mode())
    except Exception as e:
        return False, f"kvikio's compat mode is unknown ({type(e).__name__}: {e})"
    if compat:
        return False, ("kvikio runs in its compat mode here (POSIX reads through a bounce "
                       "buffer): no GPUDirect Storage")
    try:
        import kvikio.cufile_driver as drv

        get = getattr(drv, "get", None)
        gds = get("is_gds_available") if get is not None else \
            drv.DriverProperties().is_gds_available
    except Exception as e:
        return False, f"cuFile cannot say whether GDS is available ({type(e).__name__}: {e})"
    if gds is not True:
        return False, "cuFile reports no GPUDirect Storage"
    return True, "GPUDirect Storage"


def _kvikio_threads(n: int) -> None:
    """kvikio's thread pool at `n` threads (its default is 1: one read at a time)."""
    import kvikio.defaults as d

    if hasattr(d, "set"):
        d.set("num_threads", n)
    else:  # releases before the set() interface
        d.num_threads_reset(n)


def device_reads(reader, *, staging_bytes: int, table, streams, tier, threads: int,
                 verified: bool, use_kvikio: bool | str = "auto"):
    """How records reach device slots, chosen once and said once on stderr: (DeviceReader over
    `reader`, None) for kvikio, else (`reader`, Staging of `threads` buffers of `staging_bytes`:
    one per read in flight). kvikio only for records not `verified` (a check on the host would
    copy each record back from the device): use_kvikio "auto" where it reads with GPUDirect
    Storage; True whatever its mode (RuntimeError with the reason when it cannot be used);
    False never. `tier`: the compute SlotTier."""
    if use_kvikio not in (True, False, "auto"):
        raise ValueError(f"use_kvikio must be True, False or 'auto', got {use_kvikio!r}")
    why = gpu_reader_unavailable_reason() if use_kvikio else "kvikio off"
    if why is None and verified:
        why = "records are verified, on the host"
    if use_kvikio is True and why is not None:
        raise RuntimeError(f"use_kvikio=True but {why}")
    mode = "asked for"
    if use_kvikio == "auto" and why is None:
        gds, mode = gds_status()
        if not gds:
            why = mode
    if why is None:
        log.warning("device reads: kvikio (%s), %d threads", mode, threads)
        return DeviceReader(reader, table=table, streams=streams, tier=tier,
                            threads=threads), None
    log.warning("device reads: O_DIRECT into pinned host buffers, checked there, copied to the "
                "GPU on a copy stream (%s)", why)
    return reader, Staging(threads, staging_bytes, streams, table)

