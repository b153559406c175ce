"""Read-time record checks (FORMAT.md "Verifying and reading"): SHA-256 against the manifest
until a record's XXH3 is known, XXH3 from then on.

    a record read for the first time:  SHA-256 == manifest's?  -> pass, learn XXH3 of the bytes
    a record whose XXH3 is known:      XXH3 == learned?        -> pass
                                       else SHA-256 == manifest's? -> pass, relearn (stale value)
                                       else                    -> damaged (RecordHashError)

XXH3-64 (kernels/native/cpu/checksum.c) hashes a record from memory at about 20 GB/s on one core
where SHA-256 manages about 2, so a record re-read from disk costs a tenth of the hashing; the
first read of a record pays SHA-256 unless `mtplx verify --records` already learned it
(`learn`). A learned value only ever comes from bytes whose SHA-256 matched, and a mismatch is
settled by SHA-256, so a stale learned value costs one re-hash and never fails a read.

XXH3 is no cryptographic hash: whoever knows its seed can craft other bytes with a record's
value. So it runs with a secret seed (artifact/integrity.py `record_seed`, from this user's
receipt key), and what is kept is not the XXH3 itself but a *tag*: the receipt key's keyed
BLAKE2b of (this file's name, record index, XXH3). Whoever can write bank parts, but not read
this user's receipt key, can neither compute the value their bytes must hit nor make a tag pass
(artifact/integrity.py says who may write and read there). Tags persist beside the integrity
receipts: one file per artifact directory and manifest digest, `MAGIC`, the record count (u64),
then one u64 per manifest record in manifest order (0 = not learned). Without a usable receipt
directory the key, hence seed and tags, is random per process, and nothing is read or written.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..artifact.integrity import receipt_key, receipt_path, record_seed
from ..artifact.manifest import Manifest
from ..files import InputError, atomic_write, read_regular
from ..kernels import cpu_native

__all__ = ["RecordCheck", "RecordDigests", "fast_hash"]

# Tags of the seeded XXH3. Earlier versions' files are ignored, so each record pays SHA-256 once
# more: `MTPLXXHK` (tags of the unseeded XXH3) and `MTPLXXH3` (the unseeded XXH3 itself).
MAGIC = b"MTPLXXHS"
EARLIER = (b"MTPLXXHK", b"MTPLXXH3")
SUFFIX = ".xxh3"  # files of the earlier XXH64 checks (.xxh64) are not read
SAVE_EVERY = 1024  # newly learned values between saves, so a killed process keeps most of them
log = logging.getLogger(__name__)


def fast_hash(receipts: Path | None = None) -> Callable[[object], int] | None:
    """The hash the learned values of RecordDigests(..., receipts=receipts) are of: the native
    XXH3-64 of a bytes-like, seeded with this user's secret (`record_seed`). None without the
    native library or without a usable receipt directory (nothing learned could be kept).
    `mtplx verify --records` hands it to artifact/verify, which may not import kernels/."""
    if cpu_native.unavailable_reason() is not None:
        return None
    key = receipt_key(receipts)
    return None if key is None else functools.partial(cpu_native.xxh3, seed=record_seed(key))


class RecordCheck:
    """The check of one record read: `verify(view)` -> None when the bytes are the record's,
    else why not (the reader raises RecordHashError with it)."""

    __slots__ = ("_owner", "_index")

    def __init__(self, owner: RecordDigests, index: int):
        self._owner, self._index = owner, index

    def verify(self, view) -> str | None:
        return self._owner._verify(self._index, view)


class RecordDigests:
    """The digests of every record of one artifact: its manifest SHA-256s and the XXH3 values
    learned so far. `check(key)` -> RecordCheck (KeyError for a key without a record); `learn`
    takes values hashed by a caller that checked the SHA-256 itself; `save()` writes the learned
    values (best effort); `stats()` counts the checks by kind. Without the
    native library every read is SHA-256-checked (`fast_unavailable` says why)."""

    def __init__(self, root: str | os.PathLike, manifest: Manifest, *,
                 receipts: Path | None = None):
        self._sha = [r.sha256 for r in manifest.records]
        self._keys = [(r.layer, r.expert) for r in manifest.records]
        self._index = {k: i for i, k in enumerate(self._keys)}
        self._path = receipt_path(root, manifest, SUFFIX, receipts)
        self._values = np.zeros(len(self._sha), dtype=np.uint64)  # tags; 0 = not learned
        self._lock = threading.Lock()
        self._counts = {"xxh3": 0, "sha256": 0, "relearned": 0, "seconds": 0.0}
        self._unsaved = 0
        self.fast_unavailable = cpu_native.unavailable_reason()
        key = receipt_key(receipts) if self.fast_unavailable is None else None
        self._persist = key is not None  # a directory only this user can write
        key = key or os.urandom(32)  # else this process's own: values die with it
        self._seed = record_seed(key)
        self._mac = hashlib.blake2b(key=key, digest_size=8, person=b"mtplx-xxh3")
        self._mac.update(self._path.name.encode())
        if self._persist:
            self._load()
        elif self.fast_unavailable is not None:
            log.warning("records are checked with SHA-256 only (slower): %s",
                        self.fast_unavailable)

    @property
    def path(self) -> Path:
        return self._path

    def check(self, key: tuple[int, int]) -> RecordCheck | None:
        """The check for record `key`; None when the manifest gives it no SHA-256."""
        i = self._index[int(key[0]), int(key[1])]
        return RecordCheck(self, i) if self._sha[i] is not None else None

    def learned(self) -> int:
        return int(np.count_nonzero(self._values))

    def learn(self, values: dict[int, int]) -> None:
        """Take {manifest record index: `fast_hash(receipts)` of its bytes} for records whose
        bytes the caller found to match their manifest SHA-256 (`mtplx verify --records`);
        `save()` keeps them."""
        if self.fast_unavailable is not None:
            return
        with self._lock:
            for i, v in values.items():
                self._values[i] = self._tag(i, v)
            self._unsaved += len(values)

    def stats(self) -> dict[str, float]:
        """Checks passed by XXH3 alone, checks that hashed SHA-256, learned values corrected,
        and the seconds of hashing (summed over reader threads)."""
        with self._lock:
            return dict(self._counts)

    def save(self) -> None:
        """Write the learned values atomically; a cache directory that cannot be written (or is
        not private) only means the next process learns them again."""
        with self._lock:
            if not self._unsaved or not self._persist:
                self._unsaved = 0
                return
            values, self._unsaved = self._values.copy(), 0
        try:
            atomic_write(self._path, MAGIC + np.uint64(len(values)).tobytes()
                         + values.astype("<u8").tobytes(), mode=0o600)
        except OSError as e:
            log.warning("cannot write the record checksums %s (%s): the next load checks "
                        "records with SHA-256 again", self._path, e)

    # -- internals -----------------------------------------------------------------------

    def _tag(self, i: int, fast: int) -> int:
        """The kept form of record `i`'s XXH3: keyed, never 0 (0 means not learned)."""
        mac = self._mac.copy()
        mac.update(i.to_bytes(8, "little") + fast.to_bytes(8, "little"))
        return int.from_bytes(mac.digest(), "little") or 1

    def _load(self) -> None:
        n = len(self._values)
        if not os.path.lexists(self._path):  # nothing learned yet
            return
        try:
            data = read_regular(self._path, limit=16 + 8 * n, follow_symlinks=False,
                                what="record checksum file")
        except InputError as e:
            log.warning("ignoring the record checksums %s: %s", self._path, e)
            return
        if data[:8] in EARLIER:  # expected once after an upgrade: said, not warned
            log.info("record checksums %s are an earlier version's: each record is checked by "
                     "SHA-256 once more and learned again", self._path)
            return
        if (len(data) != 16 + 8 * n or data[:8] != MAGIC
                or int.from_bytes(data[8:16], "little") != n):
            log.warning("ignoring the record checksums %s: not %d values of this artifact",
                        self._path, n)
            return
        self._values[:] = np.frombuffer(data, dtype="<u8", offset=16)

    def _verify(self, i: int, view) -> str | None:
        t0 = time.perf_counter()
        known = int(self._values[i])
        fast = cpu_native.xxh3(view, self._seed) if self.fast_unavailable is None else 0
        tag = self._tag(i, fast) if self.fast_unavailable is None else 0
        if known and tag == known:
            with self._lock:
                self._counts["xxh3"] += 1
                self._counts["seconds"] += time.perf_counter() - t0
            return None
        sha = self._sha[i]
        same = hashlib.sha256(view).hexdigest() == sha
        with self._lock:
            self._counts["seconds"] += time.perf_counter() - t0
        if not same:
            return f"do not match sha256 {sha}"
        with self._lock:
            self._counts["sha256"] += 1
            if tag:
                self._counts["relearned"] += bool(known)
                self._values[i] = tag
                self._unsaved += 1
            due = self._unsaved >= SAVE_EVERY
        if known:
            log.warning("record (layer %d, expert %d): its learned XXH3 was stale (the SHA-256 "
                        "matches); relearned", *self._keys[i])
        if due:
            self.save()
        return None
