"""Warm start: which experts the runs of an artifact used, kept across runs and read back into the
expert cache at the next load (FORMAT.md "Warm-start file").

    run:   run_experts(layer, ids [T, K]) -> add: one count per (token, expert) pick
    close: previous counts * DECAY + this run's -> <key>.warm, tmp + rename
    load:  file valid for this artifact? -> plan: per layer the hottest records up to the layer's
           cache quota, sorted by (part, offset) -> the prefetcher's warm reads -> landed /
           failed / finished reported back here

The file is a hint, never a source of bytes: warm records are read by the prefetcher and the
fill pipeline like any miss, so the read-time checks apply, and a missing, stale or hostile file
only means a cold start. This module only chooses the keys, keeps the counts and tallies what
the prefetcher reports; the prefetcher decides when each warm read goes (offload/prefetch.py):
after every demand read and guess, at the read depth, and none while a prompt's prefill holds
it, whose reads and checks would otherwise take the drive and the cores from the prompt and
make the first token wait for most of the warm (BENCHMARKS.md "bench_warm").
"""

from __future__ import annotations

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
    """The warm start of one streamed run: counts this run's expert uses (`add`) and on `close`
    writes them, merged, to the file at `path`; `plan` picks what to warm from the file's counts.
    The prefetcher reads those records and reports each here (`landed`, `failed`, then
    `finished`, from its reader threads); `wait` blocks until the warm finished, `stats` says
    what was warmed. `progress(line)` gets a line every few seconds of a long warm and one at
    its end."""

    def __init__(self, manifest: Manifest, path: Path, *,
                 progress: Callable[[str], None] | None = None):
        self.path, self.progress = Path(path), progress
        self._manifest = manifest
        self._previous = read_counts(self.path, manifest)
        self._run = np.zeros(len(manifest.records), dtype=np.float64)
        # layer -> record index of each expert id (-1: no record), for counting picks.
        width = 1 + max((r.expert for r in manifest.records), default=0)
        self._rows: dict[int, np.ndarray] = {}
        for i, r in enumerate(manifest.records):
            self._rows.setdefault(r.layer, np.full(width, -1, dtype=np.int64))[r.expert] = i
        self.planned: list[tuple[int, int]] = []  # what `plan` chose, in read order
        self._lock = threading.Lock()  # reports come from the prefetcher's reader threads
        self._done = threading.Event()
        self._t0 = self._last = time.monotonic()
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

    def plan(self, quota: Callable[[int], int], global_scope: bool,
             where: Callable[[tuple[int, int]], tuple]) -> list[tuple[int, int]]:
        """The keys to warm, in `where(key)` order ((part, offset): one pass through each part);
        [] without a valid file. `quota(layer)`: the cache slots of a layer (of all layers under
        `global_scope`), as `pick` takes them. Kept as `planned`; the warm's clock starts here."""
        keys: list[tuple[int, int]] = []
        if self._previous is not None:
            chosen = pick(self._previous, self._manifest, quota, global_scope)
            keys = sorted(((self._manifest.records[i].layer, self._manifest.records[i].expert)
                           for i in chosen), key=where)
        with self._lock:
            self.planned = keys
            self._stats["planned"] = len(keys)
            self._t0 = self._last = time.monotonic()
        return keys

    def landed(self, key: tuple[int, int], nbytes: int) -> None:
        """One warm read is in its slot, checked (the prefetcher's report)."""
        self._report("records", nbytes)

    def failed(self, key: tuple[int, int], error: BaseException) -> None:
        """One warm read failed: a warning; the forward that needs the record reads it again
        and fails loudly."""
        log.warning("warm start: %s", error)
        self._report("failed", 0)

    def finished(self, skipped: int) -> None:
        """Every warm read is done (or the prefetcher shut down): `skipped` records found no
        decode slot (held in a prefill's transient slot, or refused one)."""
        with self._lock:
            if self._done.is_set():
                return
            s = self._stats
            s["skipped"], s["seconds"] = skipped, time.monotonic() - self._t0
            line = (self._line(s["planned"], s["planned"])
                    if self.progress is not None and s["seconds"] >= PROGRESS_EVERY_S else None)
            self._done.set()
        if line is not None:
            self.progress(line)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the warm has finished (or stopped); False on timeout."""
        return self._done.wait(timeout)

    def stats(self) -> dict:
        """file, found (a valid file was read), planned / records warmed / bytes / failed
        reads / skipped (no decode slot: still in a prefill's transient slot at the end, or
        refused one) / seconds (so far, while it runs), and done."""
        with self._lock:
            done = self._done.is_set()
            seconds = self._stats["seconds"] if done else time.monotonic() - self._t0
            return {**self._stats, "seconds": seconds, "done": done}

    def close(self) -> None:
        """Write the counts when this run used any expert (after the prefetcher's shutdown)."""
        if self._run.any():
            write_counts(self.path, self._manifest, self.counts())

    def _report(self, field: str, nbytes: int) -> None:
        with self._lock:
            if self._done.is_set():  # a read that was in flight at shutdown
                return
            s = self._stats
            s[field] += 1
            s["bytes"] += nbytes
            now = time.monotonic()
            s["seconds"] = now - self._t0
            line = None
            if self.progress is not None and now - self._last >= PROGRESS_EVERY_S:
                line, self._last = self._line(s["records"] + s["failed"], s["planned"]), now
        if line is not None:
            self.progress(line)

    def _line(self, done: int, total: int) -> str:
        s = self._stats
        rate = s["bytes"] / s["seconds"] / 2**30 if s["seconds"] > 0 else math.inf
        return (f"mtplx: warm start {done:,}/{total:,} records ({s['bytes'] / 2**30:.2f} GiB, "
                f"{rate:.2f} GiB/s)")
