"""Read-time integrity of a streaming artifact's resident shards, and the receipt directory
that remembers what was checked (FORMAT.md "Verifying and reading": the receipt directory).

    load -> for each resident shard with a manifest SHA-256, through the descriptor its
            tensors will be read from:
              signed receipt matches the open file's identity? -> trusted, not re-read
              else hash the open file -> mismatch: IntegrityError naming the file
                                      -> match: write a signed receipt for the next load
         -> residents read -> the open files' identities unchanged since? (`confirm`)

Records are checked where they are read (offload/digests.py), so only the resident shards need
this pass. Hashing ~100 GiB of K3 residents takes about a minute, so a verified shard leaves a
*receipt*: its device, inode, size, mtime and ctime. Any write to the file changes its ctime
(which no user tool can set back), so a shard whose identity still matches its receipt holds
the bytes that were hashed. The hash is taken through the descriptor the tensors are read from,
so a file renamed over the shard's path during the load changes nothing that is read.

Receipts live in `$MTPLX_RECEIPT_DIR`, else `$XDG_CACHE_HOME/mtplx/receipts`, else
`~/.cache/mtplx/receipts`: one JSON file per artifact directory and manifest digest. What a
receipt (or a learned record checksum) says is trusted only because no one else can write it:
the directory must belong to this user and be writable by no one else, and every receipt is
signed with a per-user key kept there (`secret.key`, 0600), so whoever can write the artifact
cannot forge one; the same key seeds the records' learned XXH3 (`record_seed`). A directory that
fails the check is not used: every load hashes again.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import stat
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.safetensors_io import CheckpointError
from ..files import InputError, atomic_write, open_regular, read_fd, read_regular, sha256_fd
from .manifest import Manifest

__all__ = ["IntegrityError", "ShardAdmission", "admit_shards", "receipt_key", "receipt_path",
           "receipts_dir", "record_seed", "sign"]

RECEIPTS_ENV = "MTPLX_RECEIPT_DIR"
RESIDENT_KINDS = ("safetensors", "preserved-safetensors")  # "sidecar" shards are bank files
KEY_NAME = "secret.key"
KEY_BYTES = 32
_MAX_RECEIPT_BYTES = 16 << 20  # a few hundred bytes per shard; K3 has 64 shards
log = logging.getLogger(__name__)
_refused: set[str] = set()  # receipt directories already warned about in this process


class IntegrityError(CheckpointError):
    """Bytes on disk do not hash to the manifest's SHA-256; the message names the file."""


@dataclass(slots=True)
class ShardAdmission:
    """What `admit_shards` did: shard names hashed now, trusted by receipt, or without a
    manifest digest to check against (left as they are, named in a warning); `identities`:
    the identity of each checked shard's open file when it was admitted."""

    hashed: list[str] = field(default_factory=list)
    trusted: list[str] = field(default_factory=list)
    unverifiable: list[str] = field(default_factory=list)
    identities: dict[str, list[int]] = field(default_factory=dict)

    def confirm(self, root: str | os.PathLike, files: Mapping[str, int]) -> None:
        """After the residents were read: each checked shard's open file (`files`: name ->
        descriptor) still has the identity it was admitted with, so no write landed between
        the check and the reads. Raises IntegrityError naming the file."""
        for name, ident in self.identities.items():
            if name in files and _identity(os.fstat(files[name])) != ident:
                raise IntegrityError(f"{Path(root) / name}: the resident shard changed while it "
                                     "was loaded; load again")


def receipts_dir() -> Path:
    if os.environ.get(RECEIPTS_ENV):
        return Path(os.environ[RECEIPTS_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mtplx" / "receipts"


def receipt_path(root: str | os.PathLike, manifest: Manifest, suffix: str,
                 receipts: Path | None = None) -> Path:
    """The receipt file of one artifact directory and manifest digest, ending in `suffix`."""
    receipts = receipts_dir() if receipts is None else Path(receipts)
    real = os.path.realpath(root)
    key = hashlib.sha256(f"{real}\0{manifest.manifest_sha256}".encode()).hexdigest()[:32]
    return receipts / f"{key}{suffix}"


def _refuse(receipts: Path, why: str) -> None:
    if str(receipts) not in _refused:
        _refused.add(str(receipts))
        log.warning("not using the receipt directory %s (%s): integrity checks hash everything "
                    "on every load", receipts, why)


def _private(st: os.stat_result) -> str | None:
    """Why a directory or key file with this stat could be written by someone else, or None."""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def receipt_key(receipts: Path | None = None) -> bytes | None:
    """The per-user key that signs receipts and learned record checksums, from (or made in) a
    receipt directory that only this user can write; None, with one warning, when the directory
    cannot be made or fails that check (receipts are then neither read nor written)."""
    receipts = receipts_dir() if receipts is None else Path(receipts)
    try:
        receipts.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(receipts)
    except OSError as e:
        _refuse(receipts, e.strerror or str(e))
        return None
    why = "not a directory" if not stat.S_ISDIR(st.st_mode) else _private(st)
    if why is not None:
        _refuse(receipts, why)
        return None
    path = receipts / KEY_NAME
    if not os.path.lexists(path):
        try:  # hard-link publication: two processes making it at once agree on the winner's
            atomic_write(path, os.urandom(KEY_BYTES), mode=0o600, replace=False)
        except FileExistsError:
            pass
        except OSError as e:
            _refuse(receipts, f"cannot write {KEY_NAME}: {e.strerror or e}")
            return None
    try:
        fd = open_regular(path, follow_symlinks=False, what="receipt key")
        try:
            st = os.fstat(fd)
            key = read_fd(fd, limit=KEY_BYTES, path=path, what="receipt key")
        finally:
            os.close(fd)
    except InputError as e:
        _refuse(receipts, str(e))
        return None
    why = _private(st) or (f"{KEY_NAME} is readable by group or others"
                           if st.st_mode & 0o077 else None)
    if why is None and len(key) != KEY_BYTES:
        why = f"{KEY_NAME} holds {len(key)} bytes, not {KEY_BYTES}"
    if why is not None:
        _refuse(receipts, why)
        return None
    return key


def record_seed(key: bytes) -> int:
    """The secret seed (u64) of the learned record checksums' XXH3 (offload/digests.py), from
    the receipt key: keyed BLAKE2b under its own `person`, so it tells nothing of the tags or
    receipts that key signs. Whoever cannot read the key cannot compute a record's seeded XXH3,
    so cannot craft other bytes with the same value."""
    mac = hashlib.blake2b(key=key, digest_size=8, person=b"mtplx-xxh3-seed")
    return int.from_bytes(mac.digest(), "little")


def sign(key: bytes, *parts: bytes, size: int = 32) -> bytes:
    """Keyed BLAKE2b of `parts` (each length-prefixed, so no two part lists collide)."""
    h = hashlib.blake2b(key=key, digest_size=size)
    for p in parts:
        h.update(len(p).to_bytes(8, "little") + p)
    return h.digest()


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def admit_shards(root: str | os.PathLike, manifest: Manifest,
                 files: Mapping[str, int] | None = None, *, receipts: Path | None = None,
                 threads: int = 2) -> ShardAdmission:
    """Check every resident shard of the artifact at `root` against `manifest` before use.

    `files`: shard name -> the open descriptor its tensors will be read through (the
    checkpoint reader's: `Checkpoint.shard_fds()`); identity and hash are taken through it, so
    what is checked is what is read. A shard without one is opened here (inside `root`).
    Raises IntegrityError naming the first damaged shard (and suggesting `mtplx verify`).
    Blocks for the hashing; a shard whose signed receipt matches is not read at all."""
    root = Path(root)
    real = os.path.realpath(root)
    key = receipt_key(receipts)
    receipt = receipt_path(root, manifest, ".json", receipts)
    known = {} if key is None else _read_receipt(receipt, key, real, manifest.manifest_sha256)
    out, todo, opened = ShardAdmission(), [], {}
    fds = dict(files or {})
    try:
        for s in manifest.shards:
            if s.kind not in RESIDENT_KINDS:
                continue
            if s.sha256 is None:
                out.unverifiable.append(s.name)
                continue
            if s.name not in fds:
                fds[s.name] = opened[s.name] = open_regular(
                    root / s.name, root=root, error=IntegrityError, what="resident shard")
            ident = _identity(os.fstat(fds[s.name]))
            out.identities[s.name] = ident
            if known.get(s.name) == ident:
                out.trusted.append(s.name)
            else:
                todo.append(s)
        if out.unverifiable:
            log.warning("%s: %d resident shard(s) have no SHA-256 in the manifest and are not "
                        "checked: %s", root, len(out.unverifiable),
                        ", ".join(out.unverifiable[:4]))
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="mtplx-admit") as pool:
            digests = list(pool.map(lambda s: sha256_fd(fds[s.name])[1], todo))
        for s, got in zip(todo, digests, strict=True):
            if got != s.sha256:
                raise IntegrityError(
                    f"{root / s.name}: resident shard hashes to {got}, the manifest says "
                    f"{s.sha256}: the file is damaged or was changed; `mtplx verify "
                    f"--shard-hashes {root}` checks every file (--no-verify skips this check)")
            if _identity(os.fstat(fds[s.name])) != out.identities[s.name]:
                raise IntegrityError(f"{root / s.name}: the resident shard changed while it was "
                                     "hashed; load again")
            out.hashed.append(s.name)
    finally:
        for fd in opened.values():
            os.close(fd)
    if todo and key is not None:
        _write_receipt(receipt, key, real, manifest.manifest_sha256,
                       {n: out.identities[n] for n in (*out.trusted, *out.hashed)})
    return out


def _receipt_mac(key: bytes, body: dict) -> str:
    return sign(key, b"mtplx-receipt", json.dumps(body, sort_keys=True).encode()).hex()


def _read_receipt(path: Path, key: bytes, real: str, digest: str | None
                  ) -> dict[str, list[int]]:
    """{shard: identity} of a receipt this user signed for this directory and manifest; {}
    when there is none, it is unreadable or its signature does not match (a damaged or forged
    receipt only costs a re-hash)."""
    if not os.path.lexists(path):
        return {}
    try:  # never blocks: a FIFO or device planted in the receipt directory is refused
        data = json.loads(read_regular(path, limit=_MAX_RECEIPT_BYTES, follow_symlinks=False,
                                       what="integrity receipt"))
    except (ValueError, RecursionError):  # InputError is a ValueError
        return {}
    if not isinstance(data, dict) or not isinstance(data.get("mac"), str):
        return {}
    body = {k: v for k, v in data.items() if k != "mac"}
    if not hmac.compare_digest(data["mac"], _receipt_mac(key, body)):
        log.warning("ignoring the integrity receipt %s: its signature does not match", path)
        return {}
    if body.get("root") != real or body.get("manifest") != digest:
        return {}
    shards = body.get("shards")
    if not isinstance(shards, dict):
        return {}
    return {k: v for k, v in shards.items() if isinstance(v, list) and len(v) == 5}


def _write_receipt(path: Path, key: bytes, real: str, digest: str | None,
                   shards: dict[str, list[int]]) -> None:
    """Best effort: a read-only cache directory only means the next load hashes again."""
    body = {"root": real, "manifest": digest, "shards": shards}
    try:
        atomic_write(path, json.dumps({**body, "mac": _receipt_mac(key, body)}).encode(),
                     mode=0o600)
    except OSError as e:
        log.warning("cannot write the integrity receipt %s (%s): the next load hashes the "
                    "resident shards again", path, e)
