"""The fill pipeline: a record's way from its bank part into a cache slot, one function per step.

    locate  the record's extent in the bank and its check (offload/digests)
    land    the buffer the bytes go to: the slot itself (host slots; a device slot read by
            kvikio), or a pinned staging buffer (device slots without kvikio)
    read    reader.read_into: O_DIRECT/preadv (offload/bank_reader), kvikio (offload/device_io)
    check   the record's digest on host bytes: SHA-256 first, a learned XXH3 after
    transfer  staged: the checked bytes into the device slot, enqueued on the copy stream after
            the last kernel launch that read the slot (offload/device_io.Staging)
    repack  the kernel backend's own layout of the record, in its slot, for a backend that has
            one (the CUDA kernels' t158 and ct-int3: kernels/cuda.py `repack`, enqueued on the
            same copy stream)
    commit  the cache entry becomes a hit (on the GPU the slot table's entry, with the copy
            stream's event the layer's next launch waits on); staged, this thread then waits
            until the copy has left the staging buffer, which goes back to the pool

The prefetcher (offload/prefetch.py) runs these steps in this order for every read, whatever
the reader and the tier: `land` and `read` when the drive has room for the read, the last three
on the reader's thread once the bytes are in, after it has handed the drive its next read. Only
`commit` makes a slot a hit, and only after its bytes passed `check`: no kernel ever reads bytes
that were not checked (with verification on), and on the GPU no kernel runs before the copy
and repack it reads have (the event `commit` records, offload/slot_table.py).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

import numpy as np

from .bank_reader import Digest, RecordHashError, check_digest

__all__ = ["Extent", "Fill"]

ExpertKey = tuple[int, int]  # (layer, expert), the model's 0-based layer index


class Extent(NamedTuple):
    """Where one record's bytes are (part, absolute offset, length) and how they are checked
    (None: not checked)."""

    part: int
    offset: int
    length: int
    check: Digest | None


class Fill:
    """The steps that put one record into its reserved cache slot (module docstring).

    reader: `read_into(part, offset, length, buf) -> Future[int]` resolving once the bytes are
    in `buf` (RecordReader, device_io.DeviceReader), with `parts` [(file, ...)] for messages.
    bank: `locate(layer, expert)` -> .part, .offset (absolute), .length; KeyError for no record
    (artifact.open.BankExpertLayout). cache: the ExpertCache whose slots are filled.
    digests: offload.digests.RecordDigests, or None to read unchecked. staging: a
    device_io.Staging when the slots are device memory read through host staging. repack:
    `repack(buf)` lays a checked record's bytes out in place, in its slot, the way the kernels
    read them (None: as stored); `buf` is the slot's view (numpy, or cupy for device slots).
    A step is called for one job (the prefetcher's read: key, part, offset, length, digest,
    slot, landing) at a time; `room`, `land` and `release` under the prefetcher's lock.
    """

    def __init__(self, reader, bank, cache, *, digests=None, staging=None,
                 repack: Callable[[object], None] | None = None):
        self.reader, self.bank, self.cache = reader, bank, cache
        self.digests, self.staging, self._repack = digests, staging, repack

    def locate(self, key: ExpertKey) -> Extent:
        """The record's extent and check; KeyError when the bank holds no such record."""
        loc = self.bank.locate(*key)
        check = self.digests.check(key) if self.digests is not None else None
        return Extent(loc.part, loc.offset, loc.length, check)

    def room(self) -> bool:
        """Whether a read can land now: a staged read needs a free staging buffer."""
        return self.staging is None or self.staging.free() > 0

    def land(self, job) -> None:
        """Set `job.landing`, the buffer its read goes to (call only when `room()`)."""
        job.landing = (self.staging.take() if self.staging is not None
                       else self.cache.buffer(job.slot))

    def read(self, job) -> Future:
        """Start reading the record into `job.landing`: a future resolving once its bytes are
        in. Raises what the reader raises for a bad request."""
        if job.landing.nbytes < job.length:
            raise ValueError(f"slot buffer holds {job.landing.nbytes} B, record needs "
                             f"{job.length}")
        return self.reader.read_into(job.part, job.offset, job.length, job.landing)

    def check(self, job) -> None:
        """Raise RecordHashError (naming the part, offset and length) unless the landed bytes
        are the record's; ValueError for a record to check that has no digest."""
        if job.digest is None:
            if self.digests is not None:
                raise ValueError("records are verified, but the manifest gives this one no "
                                 "SHA-256")
            return
        host = job.landing[:job.length]
        if not isinstance(host, np.ndarray):  # a copy back would cross PCIe a second time
            raise ValueError("records are verified, but this one was read into device memory "
                             "(kvikio): verified reads go through host staging")
        why = check_digest(job.digest, memoryview(host))
        if why is not None:
            raise RecordHashError(f"{self.reader.parts[job.part][0]}: part {job.part} bytes at "
                                  f"offset {job.offset} length {job.length} {why}")

    def transfer(self, job) -> None:
        """Staged: the checked bytes into the device slot, enqueued (nothing else: the read
        landed there)."""
        if self.staging is not None:
            self.staging.place(job.landing[:job.length],
                               self.cache.buffer(job.slot)[:job.length], job.slot.slot)

    def repack(self, job) -> None:
        """The backend's layout of the checked bytes, in place in the slot (nothing without a
        repack)."""
        if self._repack is not None:
            self._repack(self.cache.buffer(job.slot)[:job.length])

    def commit(self, job) -> None:
        """The slot is a hit for every lookup from now on; staged, then wait (this thread) until
        its copy has left the staging buffer, so `release` hands back a free one."""
        self.cache.commit(job.key)
        if self.staging is not None:
            self.staging.drain(job.landing)

    def release(self, job) -> None:
        """The job's landing is free again (its staging buffer back to the pool)."""
        if self.staging is not None and job.landing is not None:
            self.staging.give(job.landing)
        job.landing = None
