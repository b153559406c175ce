"""Positional record reads from bank parts straight into caller buffers (FORMAT.md "Streaming
artifact", "Reading records at run time").

    requests -> check (bounds, 4 KiB alignment) -> coalesce adjacent -> thread pool
             -> os.preadv(fd from a bounded LRU) -> caller buffers [-> digest check] -> futures

The streaming provider's reads come through the fill pipeline (offload/fill.py), which checks
the bytes itself: it asks for none here, and a read's future resolves as soon as its bytes are in.

Parts are opened O_RDONLY | O_CLOEXEC | O_NOFOLLOW, plus O_DIRECT when enabled. Bank files are
never mmapped: a page fault is synchronous I/O the prefetcher can neither overlap nor bound.
`os.preadv` releases the GIL and each pool thread has one blocking read at a time, so the
pool's size is the read depth: `read_depth` reads in flight at the drive at once.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Protocol

from mtplx_runtime.files import check_inside
from mtplx_runtime.offload.buffers import (
    PAGE_BYTES,
    aligned_buffer,
    buffer_address,
)

__all__ = ["DEFAULT_DECODE_DEPTH", "DEFAULT_READ_DEPTH", "Check", "Digest", "RecordReader",
           "ReadError", "RecordHashError", "aligned_buffer", "check_digest", "from_manifest"]

log = logging.getLogger("mtplx_runtime.artifact.manifest")

# EINTR and EAGAIN are transient by definition; EIO is retried because virtio/NVMe paths do
# report one-off EIOs under pressure. Anything else (EINVAL, EBADF, ...) fails at once.
_RETRYABLE = frozenset({errno.EINTR, errno.EAGAIN, errno.EIO})
# Reads in flight at once (RecordReader, Prefetcher, StreamingExpertProvider, --read-depth): the
# fastest of two bench_io depth sweeps (8 gave 0.9 of it, 32 no more; BENCHMARKS.md "bench_io").
DEFAULT_READ_DEPTH = 16
# Of those, the reads in flight in a one-token forward (StreamingExpertProvider: its misses and
# the lookahead's guesses). A deeper queue shares the drive among more records, so they all land
# near the end of the window and the kernels wait for the last; at 4 they land one after another
# and the kernels run on each while the rest read, at nearly the drive's full rate (BENCHMARKS.md
# "Decode read depth"). Here, not in the provider, so that options and flags import no torch.
DEFAULT_DECODE_DEPTH = 4
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024


class ReadError(OSError):
    """A bank read that failed for good; the message names the file, offset and length."""


class RecordHashError(ValueError):
    """The bytes read do not hash to the digest the request carried."""


class Check(Protocol):
    """A digest check richer than one SHA-256 (offload/digests.py RecordCheck): `verify(view)`
    -> None when the bytes are right, else why not."""

    def verify(self, view: memoryview) -> str | None: ...


Digest = str | Check  # a SHA-256 as 64 hex digits, or a Check


@dataclass(slots=True)
class _Req:
    part: int
    offset: int       # absolute byte offset in the part file
    length: int
    view: memoryview  # 1-D bytes view of the destination, exactly `length` long
    digest: Digest | None


class _FdCache:
    """LRU of open part fds, never more than `limit`. An fd a read holds is never closed under
    it: when every open fd is busy, a new part waits for one to be released."""

    def __init__(self, opener, limit: int):
        self._opener, self._limit = opener, limit
        self._fds: OrderedDict[int, int] = OrderedDict()  # part -> fd, least recent first
        self._refs: dict[int, int] = {}
        self._cond = threading.Condition()

    def acquire(self, part: int) -> int:
        with self._cond:
            while part not in self._fds:
                if len(self._fds) < self._limit:
                    # Opening under the lock keeps the bound exact; an open is microseconds.
                    self._fds[part], self._refs[part] = self._opener(part), 0
                    break
                idle = next((p for p in self._fds if self._refs[p] == 0), None)
                if idle is not None:
                    os.close(self._fds.pop(idle))
                    del self._refs[idle]
                else:
                    self._cond.wait()
            self._fds.move_to_end(part)
            self._refs[part] += 1
            return self._fds[part]

    def release(self, part: int) -> None:
        with self._cond:
            self._refs[part] -= 1
            if self._refs[part] == 0:
                self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._fds)

    def close_all(self) -> None:
        with self._cond:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._refs.clear()


def _part_entry(p) -> tuple[str, int, int]:
    """(file, size[, data_start]) -> checked (file, size, data_start)."""
    name, size, data_start = (*p, 0) if len(p) == 2 else p
    pp = PurePosixPath(name)
    if (not name or "\\" in name or "\0" in name or pp.is_absolute()
            or any(c in (".", "..") for c in name.split("/")) or str(pp) != name):
        raise ValueError(f"bank part name {name!r} is not a normalized relative POSIX path")
    if int(size) < 1 or not 0 <= int(data_start) <= int(size):
        raise ValueError(f"bank part {name!r}: bad size {size} / data_start {data_start}")
    return name, int(size), int(data_start)


class RecordReader:
    """Reads byte ranges of bank parts into caller buffers, `read_depth` reads in flight.

    `parts`: [(file name relative to `root`, size in bytes[, data_start])]; the size must match
    the file. `direct`: True = O_DIRECT, False = buffered (page cache), "auto" = O_DIRECT when one
    aligned probe read works, else buffered with one logged reason. Unless `direct` is False,
    every request must be 4 KiB-aligned (offset, length, buffer address) whatever the file system
    turns out to support, so misuse fails the same way everywhere. `verify_sha256`: every request
    must carry a digest (read_record passes the record's SHA-256). A digest given explicitly is
    always checked, in the reader thread that read the bytes. Futures from this reader cannot be
    cancelled; `close()` fails queued reads with CancelledError and waits for running ones.
    `read_depth`: reads in flight at once (one pool thread each); more requests queue here.
    """

    def __init__(self, root: str | os.PathLike, parts, *, direct: bool | str = "auto",
                 read_depth: int = DEFAULT_READ_DEPTH, max_open_files: int = 64,
                 verify_sha256: bool = False, retries: int = 3, max_coalesce_bytes: int = 32 << 20):
        if direct not in ("auto", True, False):
            raise ValueError(f"direct must be 'auto', True or False, got {direct!r}")
        if read_depth < 1 or max_open_files < 1 or retries < 0 or max_coalesce_bytes < 1:
            raise ValueError(f"read_depth ({read_depth}), max_open_files and max_coalesce_bytes "
                             "must be >= 1, retries >= 0")
        if direct is True and not hasattr(os, "O_DIRECT"):
            raise ValueError("direct=True: this platform has no O_DIRECT")
        self.root = Path(root)
        self.parts = [_part_entry(p) for p in parts]
        self.verify_sha256, self.retries = verify_sha256, retries
        self.max_coalesce_bytes = max_coalesce_bytes
        self._direct: bool | None = None if direct == "auto" else direct  # None: not probed yet
        self._aligned = direct is not False
        self._fds = _FdCache(self._open, max_open_files)
        self.read_depth = read_depth
        self._pool = ThreadPoolExecutor(read_depth, thread_name_prefix="mtplx-read")
        self._lock = threading.Lock()
        self._closed = False

    @property
    def direct(self) -> bool | None:
        """Whether reads use O_DIRECT; None until "auto" has opened its first part."""
        return self._direct

    def read_into(self, part: int, offset: int, length: int, buf, *,
                  digest: Digest | None = None) -> Future[int]:
        """Start reading `length` bytes at absolute `offset` of `part` into the first `length`
        bytes of `buf` (writable, C-contiguous; numpy array, memoryview, mmap). Returns at once;
        the future gives `length`, or raises ReadError / RecordHashError (`digest`, a SHA-256
        hex string or a Check, not matched; checked in the reader thread before the future
        resolves). Bad requests raise ValueError here, before any system call."""
        return self.read_many([(part, offset, length, buf, digest)])[0]

    def read_record(self, record, buf) -> Future[int]:
        """Read one manifest record (`.part`, `.sidecar_offset` relative to the part's
        data_start, `.sidecar_length`, `.sha256`) into `buf`; hashes checked when verify_sha256."""
        if record.sidecar_offset is None or record.sidecar_length is None:
            raise ValueError(f"record ({record.layer}, {record.expert}) has no sidecar extent")
        start = self.parts[record.part][2]
        return self.read_into(record.part, start + record.sidecar_offset, record.sidecar_length,
                              buf, digest=record.sha256 if self.verify_sha256 else None)

    def read_many(self, requests) -> list[Future[int]]:
        """Start many reads: [(part, offset, length, buf[, digest])] -> one future each, in
        order (digest as in read_into).
        Requests adjacent in the same part (next offset == previous end) share one preadv with
        an iovec per buffer, up to max_coalesce_bytes per call. All are checked before any is
        submitted."""
        reqs = [self._request(*r) for r in requests]
        futs = [Future() for _ in reqs]
        for f in futs:
            f.set_running_or_notify_cancel()  # no cancel: a coalesced read may be in flight
        order = sorted(range(len(reqs)), key=lambda i: (reqs[i].part, reqs[i].offset))
        groups: list[list[int]] = []
        for i in order:
            g = groups[-1] if groups else None
            if (g and reqs[g[-1]].part == reqs[i].part
                    and reqs[g[-1]].offset + reqs[g[-1]].length == reqs[i].offset
                    and len(g) < _IOV_MAX
                    and sum(reqs[j].length for j in g) + reqs[i].length <= self.max_coalesce_bytes):
                g.append(i)
            else:
                groups.append([i])
        with self._lock:
            if self._closed:
                raise RuntimeError("RecordReader is closed")
            for g in groups:
                gr, gf = [reqs[i] for i in g], [futs[i] for i in g]
                self._pool.submit(self._run, gr, gf).add_done_callback(partial(_on_cancel, gf))
        return futs

    def close(self) -> None:
        """Fail queued reads (CancelledError), wait for running ones, close every fd. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._fds.close_all()

    def __enter__(self) -> RecordReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------

    def _request(self, part, offset, length, buf, digest=None) -> _Req:
        if not 0 <= part < len(self.parts):
            raise IndexError(f"part {part} out of range (reader has {len(self.parts)} parts)")
        name, size, _ = self.parts[part]
        if offset < 0 or length < 1 or offset + length > size:
            raise ValueError(f"{name}: read at offset {offset} length {length} is outside the "
                             f"part ({size} B)")
        view = memoryview(buf)
        if view.readonly or not view.c_contiguous:
            raise ValueError(f"{name}: destination buffer must be writable and C-contiguous")
        view = view.cast("B") if (view.format, view.ndim) != ("B", 1) else view
        if view.nbytes < length:
            raise ValueError(f"{name}: buffer holds {view.nbytes} B, read needs {length}")
        view = view[:length]
        if self._aligned:
            addr = buffer_address(view)
            checks = (("offset", offset), ("length", length), ("buffer address", addr))
            bad = [f"{what} {v} (= {v % PAGE_BYTES} mod {PAGE_BYTES})" for what, v in checks
                   if v % PAGE_BYTES]
            if bad:
                raise ValueError(f"{name}: O_DIRECT reads need offset, length and buffer address "
                                 f"to be multiples of {PAGE_BYTES}; got {', '.join(bad)}. Use "
                                 "aligned_buffer() and 4 KiB-aligned extents, or direct=False")
        if digest is None and self.verify_sha256:
            raise ValueError(f"{name}: verify_sha256 is on but the read at offset {offset} "
                             "carries no digest")
        if isinstance(digest, str):
            digest = digest.lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"{name}: sha256 {digest!r} is not 64 hex digits")
        elif digest is not None and not callable(getattr(digest, "verify", None)):
            raise TypeError(f"{name}: digest must be a SHA-256 hex string or have verify(), "
                            f"got {type(digest).__name__}")
        return _Req(part, offset, length, view, digest)

    def _open(self, part: int) -> int:
        """Open one part (called under the fd-cache lock); resolves "auto" on first use."""
        name, size, _ = self.parts[part]
        path = self.root / name
        # O_NONBLOCK: a FIFO swapped in for a part fails the regular-file check below instead
        # of blocking the open (it changes nothing for regular files).
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = self._probe_direct(path, flags) if self._direct is None else None
            if self._direct is None:  # the probe's fd is the part's fd: one open per part
                self._direct = fd is not None
            if fd is None:
                fd = os.open(path, flags | (os.O_DIRECT if self._direct else 0))
        except ReadError:
            raise
        except OSError as e:
            hint = " (symlinks are refused)" if e.errno == errno.ELOOP else ""
            raise ReadError(e.errno, f"{path}: cannot open: {e.strerror}{hint}") from e
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            os.close(fd)
            found = f"{st.st_size} B" if stat.S_ISREG(st.st_mode) else "not a regular file"
            raise ReadError(errno.EINVAL, f"{path}: expected a regular file of {size} B, "
                            f"found {found}")
        try:  # the file this fd holds, not the path checked at load: a directory swapped since
            check_inside(fd, path, self.root, error=ReadError, what="bank part")
        except ReadError:
            os.close(fd)
            raise
        return fd

    def _probe_direct(self, path: Path, flags: int) -> int | None:
        """One O_DIRECT open and one aligned 4 KiB read: the open fd when that works, None
        (logged once) when the platform or file system does not support it."""
        if not hasattr(os, "O_DIRECT"):
            log.warning("O_DIRECT unavailable on this platform; bank reads are buffered")
            return None
        try:
            fd = os.open(path, flags | os.O_DIRECT)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            log.warning("O_DIRECT open of %s failed (%s); bank reads are buffered", path, e)
            return None
        try:
            os.preadv(fd, [aligned_buffer(PAGE_BYTES)], 0)
        except OSError as e:
            os.close(fd)
            if e.errno != errno.EINVAL:
                raise
            log.warning("O_DIRECT probe read of %s failed (%s); bank reads are buffered", path, e)
            return None
        return fd

    def _run(self, group: list[_Req], futs: list[Future]) -> None:
        """Pool task: one (possibly coalesced) read, then each request's digest check and
        result."""
        try:
            fd = self._fds.acquire(group[0].part)
            try:
                self._preadv_full(fd, group)
            finally:
                self._fds.release(group[0].part)
        except BaseException as e:
            for f in futs:
                f.set_exception(e)
            return
        for r, f in zip(group, futs):
            if r.digest is None:  # nothing to check (the fill pipeline checks its own reads)
                f.set_result(r.length)
                continue
            try:
                why = check_digest(r.digest, r.view)
            except BaseException as e:  # a failing check fails its read, never the pool
                f.set_exception(e)
                continue
            if why is not None:
                f.set_exception(RecordHashError(
                    f"{self.parts[r.part][0]}: part {r.part} bytes at offset {r.offset} length "
                    f"{r.length} {why}"))
            else:
                f.set_result(r.length)

    def _preadv_full(self, fd: int, group: list[_Req]) -> None:
        """preadv until every byte of the group is in; short reads continue where they stopped."""
        name = self.parts[group[0].part][0]
        start, total = group[0].offset, sum(r.length for r in group)
        iov, done, failures = [r.view for r in group], 0, 0
        while done < total:
            try:
                n = os.preadv(fd, iov, start + done)
            except OSError as e:
                if e.errno not in _RETRYABLE or failures >= self.retries:
                    raise ReadError(e.errno, f"{name}: read at offset {start} length {total} "
                                    f"failed at offset {start + done} after {failures + 1} "
                                    f"attempt(s): {e.strerror or e}") from e
                failures += 1
                if e.errno != errno.EINTR:
                    time.sleep(0.001 * 2 ** failures)
                continue
            if n == 0:
                raise ReadError(errno.EIO, f"{name}: unexpected end of file at offset "
                                f"{start + done} (read at offset {start} length {total})")
            if self._direct:
                n -= n % PAGE_BYTES  # resume on a page boundary; the partial page is re-read
                if n == 0:
                    failures += 1
                    if failures > self.retries:
                        raise ReadError(errno.EIO, f"{name}: O_DIRECT read at offset "
                                        f"{start + done} keeps returning under one page")
                    continue
            done += n
            while n and n >= len(iov[0]):
                n -= len(iov[0])
                iov = iov[1:]
            if n:
                iov[0] = iov[0][n:]


def check_digest(digest: Digest | None, view) -> str | None:
    """None when `view` matches `digest` (or there is none), else why not."""
    if digest is None:
        return None
    if isinstance(digest, str):
        same = hashlib.sha256(view).hexdigest() == digest
        return None if same else f"do not match sha256 {digest}"
    return digest.verify(view)


def _on_cancel(futs: list[Future], pool_future: Future) -> None:
    """close() cancelled the pool task before it ran: fail its requests instead of hanging."""
    if pool_future.cancelled():
        for f in futs:
            if not f.done():
                f.set_exception(CancelledError("RecordReader closed before this read ran"))


def from_manifest(root: str | os.PathLike, manifest, **kwargs) -> RecordReader:
    """A RecordReader over a manifest's bank parts (`manifest.sidecar.parts`: .file, .size,
    .data_start); read records with `reader.read_record(record, buf)`."""
    if manifest.sidecar is None:
        raise ValueError("manifest has no sidecar: it names no bank parts to read")
    parts = [(p.file, p.size, p.data_start) for p in manifest.sidecar.parts]
    return RecordReader(root, parts, **kwargs)
