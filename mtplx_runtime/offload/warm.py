"""Warm start: which experts the runs of an artifact used, kept across runs and read back into the
expert cache at the next load (FORMAT.md "Warm-start file").

    run:   run_experts(layer, ids [T, K]) -> add: one count per (token, expert) pick
    close: previous counts * DECAY + this run's -> <key>.warm, tmp + rename
    load:  file valid for this artifact? -> per layer the hottest records up to the layer's cache
           quota -> sorted by (part, offset) -> demand reads from a background thread, a few
           outstanding at a time

The file is a hint, never a source of bytes: warm records are read by the prefetcher and reader
like any miss, so the read-time checks apply, and a missing, stale or hostile file only means a
cold start. Warming runs beside the first prompt: it keeps one read depth of reads outstanding
and refills as each lands, so the reader stays busy and a forward's own demand reads queue
behind no warm read, only wait for one in flight to finish; a forward that needs a record being
warmed shares that read. While a prefill runs (the provider's `prefill_hold_until`) the warm
issues no new read: its reads and their checks would take the drive and the cores from the
prompt, and the first token would wait for most of the warm (BENCHMARKS.md "bench_warm").
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..artifact.integrity import receipt_path
from ..artifact.manifest import Manifest
from ..files import InputError, atomic_write, read_regular

__all__ = ["WarmStart", "warm_path", "read_counts", "write_counts", "pick"]

MAGIC = b"MTPLXWRM"
VERSION = 1
SUFFIX = ".warm"
HEADER_BYTES = 8 + 4 + 4 + 32 + 8  # magic, version, reserved, artifact digest, record count
DECAY = 0.5  # weight of the earlier runs' counts when a run's are merged in: old habits fade
PROGRESS_EVERY_S = 2.0
STOP_POLL_S = 0.2
log = logging.getLogger(__name__)


def artifact_digest(manifest: Manifest) -> bytes:
    """The 32-byte identity a warm file is written for: the manifest's SHA-256."""
    return bytes.fromhex(manifest.manifest_sha256 or manifest.compute_sha256())


def warm_path(root: str | os.PathLike, manifest: Manifest, warm: str | os.PathLike
              ) -> Path | None:
    """Where the warm file of the artifact at `root` lives: 'off' -> None; 'auto' -> beside the
    integrity receipts (`artifact.integrity.receipt_path`, suffix `.warm`); else the path given."""
    if warm == "off":
        return None
    if warm == "auto":
        return receipt_path(root, manifest, SUFFIX)
    return Path(warm)


def read_counts(path: Path, manifest: Manifest) -> np.ndarray | None:
    """The use counts of `path`, float64 [records] in manifest order; None (with a warning
    naming the file and the reason) when there is no such file or it does not hold counts of
    this artifact. Never raises for what the file holds."""
    n = len(manifest.records)
    if not os.path.lexists(path):
        return None
    try:
        data = read_regular(path, limit=HEADER_BYTES + 8 * n, follow_symlinks=False,
                            what="warm-start file")
    except InputError as e:  # too big, not a regular file, a symlink, unreadable
        log.warning("ignoring the warm-start file: %s; starting cold", e)
        return None
    why = None
    if len(data) < HEADER_BYTES or data[:8] != MAGIC:
        why = "not a warm-start file"
    elif int.from_bytes(data[8:12], "little") != VERSION:
        why = f"format version {int.from_bytes(data[8:12], 'little')}, this reader knows {VERSION}"
    elif data[16:48] != artifact_digest(manifest):
        why = "written for another artifact (or an earlier build of this one)"
    elif int.from_bytes(data[48:56], "little") != n or len(data) != HEADER_BYTES + 8 * n:
        why = f"does not hold {n} counts"
    if why is None:
        counts = np.frombuffer(data, dtype="<f8", offset=HEADER_BYTES).astype(np.float64)
        if not np.all(np.isfinite(counts) & (counts >= 0)):
            why = "holds a negative or non-finite count"
    if why is not None:
        log.warning("ignoring the warm-start file %s: %s; starting cold", path, why)
        return None
    return counts


def write_counts(path: Path, manifest: Manifest, counts: np.ndarray) -> bool:
    """Write `counts` (float64 [records]) atomically; False (with a warning) when the file
    cannot be written: a read-only cache directory only means the next run starts cold."""
    body = (MAGIC + VERSION.to_bytes(4, "little") + bytes(4) + artifact_digest(manifest)
            + len(counts).to_bytes(8, "little") + counts.astype("<f8").tobytes())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, body)
    except OSError as e:
        log.warning("cannot write the warm-start file %s (%s): the next run starts cold", path, e)
        return False
    return True


def pick(counts: np.ndarray, manifest: Manifest, quota: Callable[[int], int],
         global_scope: bool) -> list[int]:
    """Record indices to warm: per layer the `quota(layer)` hottest (ties: manifest order), or
    under global scope the `quota` hottest of all, which is one shared capacity. Unused records
    fill what room is left, so a budget that holds every record gets every record."""
    order = sorted(range(len(counts)), key=lambda i: -counts[i])  # stable: manifest order
    taken: list[int] = []
    room: dict[int, int] = {}
    for i in order:
        group = -1 if global_scope else manifest.records[i].layer
        if group not in room:
            room[group] = quota(manifest.records[i].layer)
        if room[group] > 0:
            room[group] -= 1
            taken.append(i)
    return taken


class WarmStart:
    """The warm start of one StreamingExpertProvider: counts this run's expert uses (`add`),
    warms the cache from the file at `path` on a background thread (`start`, `wait`), and on
    `close` writes the merged counts back. `progress(line)` gets a line every few seconds
    of a long warm and one at its end. `stats()` says what was warmed."""

    def __init__(self, provider, path: Path, *, progress: Callable[[str], None] | None = None):
        self.provider, self.path, self.progress = provider, Path(path), progress
        manifest = provider.manifest
        self._manifest = manifest
        self._previous = read_counts(self.path, manifest)
        self._run = np.zeros(len(manifest.records), dtype=np.float64)
        # layer -> record index of each expert id (-1: no record), for counting picks.
        width = 1 + max((r.expert for r in manifest.records), default=0)
        self._rows: dict[int, np.ndarray] = {}
        for i, r in enumerate(manifest.records):
            self._rows.setdefault(r.layer, np.full(width, -1, dtype=np.int64))[r.expert] = i
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats = {"file": str(self.path), "found": self._previous is not None,
                       "planned": 0, "records": 0, "bytes": 0, "failed": 0, "skipped": 0,
                       "seconds": 0.0}

    # ---- counting ------------------------------------------------------------------------

    def add(self, layer: int, ids: torch.Tensor) -> None:
        """Count one use per pick of `ids` [T, K] (-1: no pick) of MoE layer `layer`."""
        rows = self._rows.get(int(layer))
        if rows is None:
            return
        e = ids.numpy(force=True).ravel()  # [T * K]; numpy filtering is cheaper than torch's
        rec = rows[e[(e >= 0) & (e < len(rows))]]
        np.add.at(self._run, rec[rec >= 0], 1.0)  # add.at: an expert picked by several tokens

    def counts(self) -> np.ndarray:
        """What `close` writes: the earlier runs' counts * DECAY plus this run's."""
        old = self._previous if self._previous is not None else 0.0
        return old * DECAY + self._run

    # ---- warming -------------------------------------------------------------------------

    def plan(self) -> list[tuple[int, int]]:
        """The keys a warm reads, in (part, offset) order; [] without a valid file."""
        if self._previous is None:
            return []
        cache = self.provider.cache
        chosen = pick(self._previous, self._manifest, lambda la: cache.quota((la, 0)),
                      cache.scope_kind == "global")
        keys = [(self._manifest.records[i].layer, self._manifest.records[i].expert)
                for i in chosen]
        bank = self.provider.bank
        return sorted(keys, key=lambda k: bank.locate(*k)[:2])

    def start(self) -> None:
        """Begin warming on a background thread (nothing to do: done at once)."""
        keys = self.plan()
        self._stats["planned"] = len(keys)
        if not keys:
            self._done.set()
            return
        self._thread = threading.Thread(target=self._warm, args=(keys,), daemon=True,
                                        name="mtplx-warm")
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the warm has finished (or stopped); False on timeout."""
        return self._done.wait(timeout)

    def stats(self) -> dict:
        """file, found (a valid file was read), planned / records warmed / bytes / failed
        reads / skipped (still in a prefill's transient slot at the end) / seconds, and done."""
        return {**self._stats, "done": self._done.is_set()}

    def stop(self) -> None:
        """Issue no further warm reads (those already queued go on until cancelled)."""
        self._stop.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop, join the warm thread (call after the prefetcher's shutdown has cancelled its
        queued reads) and write the counts when this run used any expert."""
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._run.any():
            write_counts(self.path, self._manifest, self.counts())

    def _warm(self, keys: list[tuple[int, int]]) -> None:
        p = self.provider
        t0 = last = time.monotonic()
        # One read depth outstanding: nothing of the warm's waits in the prefetcher's queue, so a
        # forward's demand read is the next one dispatched.
        limit = p.prefetcher.read_depth
        todo = collections.deque(keys)
        # A record a prefill holds in a transient slot is tried again after the others: the
        # transient pool reuses its slot soon, and a warm read must land in a decode slot.
        later: list[tuple[int, int]] = []
        retried = False
        pending: dict[concurrent.futures.Future, tuple[int, int]] = {}
        try:
            while True:
                if self._stop.is_set():
                    return
                held = p.prefill_hold_until - time.monotonic()  # a prompt's reads go first
                while held <= 0 and len(pending) < limit and todo:
                    key = todo.popleft()
                    ref = p.cache.where(key)
                    if ref is not None:  # a forward read it first
                        if ref.transient:
                            later.append(key)
                        continue
                    try:
                        pending[p.prefetcher.demand([key])[key]] = key
                    except RuntimeError:  # the prefetcher shut down between checks
                        return
                if not pending:
                    if held > 0 and (todo or later):
                        self._stop.wait(min(held, STOP_POLL_S))
                        continue
                    if todo:
                        continue
                    if later and not retried:
                        todo.extend(later)
                        later, retried = [], True
                        continue
                    self._stats["skipped"] = len(later)
                    break
                # woken now and then to see a stop (close) while reads run
                # (a held warm wakes when the hold may end, to refill)
                wake = min(STOP_POLL_S, held) if held > 0 else STOP_POLL_S
                done, _ = concurrent.futures.wait(pending, timeout=wake,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
                for fut in done:
                    key = pending.pop(fut)
                    if fut.cancelled():  # shutdown cancelled the queued reads
                        return
                    if fut.exception() is not None:
                        # The forward that needs this record reads it again and fails loudly.
                        self._stats["failed"] += 1
                        log.warning("warm start: %s", fut.exception())
                        continue
                    # The prefetcher's one cache.record_read per read; the future is done, so
                    # nothing waits and no stall is counted.
                    next(p.prefetcher.completed({key: fut}))
                    self._stats["records"] += 1
                    self._stats["bytes"] += p.bank.locate(*key).length
                now = time.monotonic()
                self._stats["seconds"] = now - t0
                if self.progress is not None and now - last >= PROGRESS_EVERY_S:
                    self.progress(self._line(len(keys) - len(todo) - len(pending), len(keys)))
                    last = now
            if self.progress is not None and time.monotonic() - t0 >= PROGRESS_EVERY_S:
                self.progress(self._line(len(keys), len(keys)))
        finally:
            self._stats["seconds"] = time.monotonic() - t0
            self._done.set()

    def _line(self, done: int, total: int) -> str:
        s = self._stats
        rate = s["bytes"] / s["seconds"] / 2**30 if s["seconds"] > 0 else math.inf
        return (f"mtplx: warm start {done:,}/{total:,} records ({s['bytes'] / 2**30:.2f} GiB, "
                f"{rate:.2f} GiB/s)")
