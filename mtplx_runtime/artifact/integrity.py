"""Read-time integrity of a streaming artifact's resident shards (FORMAT.md "Verifying and
reading").

    load -> for each resident shard with a manifest SHA-256:
              receipt matches the file's identity? -> trusted, not re-read
              else hash the whole file -> mismatch: IntegrityError naming the file
                                       -> match: write a receipt for the next load

Records are checked where they are read (offload/bank_reader.py hashes every record read against its
manifest SHA-256), so only the resident shards need this pass. Hashing ~100 GiB of K3 residents
takes about a minute, so a verified shard leaves a *receipt*: its device, inode, size, mtime and
ctime. Any write to the file changes its ctime (which no user tool can set back), so a shard
whose identity still matches its receipt holds the bytes that were hashed. Receipts live in
`$MTPLX_RECEIPT_DIR`, else `$XDG_CACHE_HOME/mtplx/receipts`, else `~/.cache/mtplx/receipts`,
one JSON file per artifact directory and manifest digest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.safetensors_io import CheckpointError
from ..files import read_regular
from .manifest import Manifest

__all__ = ["IntegrityError", "ShardAdmission", "admit_shards", "receipt_path", "receipts_dir"]

RECEIPTS_ENV = "MTPLX_RECEIPT_DIR"
RESIDENT_KINDS = ("safetensors", "preserved-safetensors")  # "sidecar" shards are bank files
_CHUNK = 8 << 20
_MAX_RECEIPT_BYTES = 16 << 20  # a few hundred bytes per shard; K3 has 64 shards
log = logging.getLogger(__name__)


class IntegrityError(CheckpointError):
    """Bytes on disk do not hash to the manifest's SHA-256; the message names the file."""


@dataclass(slots=True)
class ShardAdmission:
    """What `admit_shards` did: shard names hashed now, trusted by receipt, or without a
    manifest digest to check against (left as they are, named in a warning)."""

    hashed: list[str] = field(default_factory=list)
    trusted: list[str] = field(default_factory=list)
    unverifiable: list[str] = field(default_factory=list)


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


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)  # hashlib releases the GIL: files hash in parallel threads
    return h.hexdigest()


def admit_shards(root: str | os.PathLike, manifest: Manifest, *,
                 receipts: Path | None = None, threads: int = 2) -> ShardAdmission:
    """Check every resident shard of the artifact at `root` against `manifest` before use.
    Raises IntegrityError naming the first damaged shard (and suggesting `mtplx verify`).
    Blocks for the hashing; a shard whose receipt matches is not read at all."""
    root = Path(root)
    real = os.path.realpath(root)
    receipt = receipt_path(root, manifest, ".json", receipts)
    known = _read_receipt(receipt, real, manifest.manifest_sha256)
    out, todo, seen = ShardAdmission(), [], {}
    for s in manifest.shards:
        if s.kind not in RESIDENT_KINDS:
            continue
        if s.sha256 is None:
            out.unverifiable.append(s.name)
            continue
        ident = _identity(os.stat(root / s.name))
        seen[s.name] = ident
        if known.get(s.name) == ident:
            out.trusted.append(s.name)
        else:
            todo.append(s)
    if out.unverifiable:
        log.warning("%s: %d resident shard(s) have no SHA-256 in the manifest and are not "
                    "checked: %s", root, len(out.unverifiable), ", ".join(out.unverifiable[:4]))
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="mtplx-admit") as pool:
        digests = list(pool.map(lambda s: _file_sha256(root / s.name), todo))
    for s, got in zip(todo, digests, strict=True):
        if got != s.sha256:
            raise IntegrityError(
                f"{root / s.name}: resident shard hashes to {got}, the manifest says {s.sha256}: "
                f"the file is damaged or was changed; `mtplx verify --shard-hashes {root}` "
                "checks every file (--no-verify skips this check)")
        out.hashed.append(s.name)
    if todo:
        _write_receipt(receipt, real, manifest.manifest_sha256,
                       {**{n: known[n] for n in out.trusted}, **{s.name: seen[s.name]
                                                                 for s in todo}})
    return out


def _read_receipt(path: Path, real: str, digest: str | None) -> dict[str, list[int]]:
    """{shard: identity} of a receipt written for this directory and manifest; {} when there is
    none or it is unreadable (a damaged receipt only costs a re-hash)."""
    if not os.path.lexists(path):
        return {}
    try:  # never blocks: a FIFO or device planted in the receipt directory is refused
        data = json.loads(read_regular(path, limit=_MAX_RECEIPT_BYTES, follow_symlinks=False,
                                       what="integrity receipt"))
    except (ValueError, RecursionError):  # CheckpointError is a ValueError
        return {}
    if not isinstance(data, dict) or data.get("root") != real or data.get("manifest") != digest:
        return {}
    shards = data.get("shards")
    if not isinstance(shards, dict):
        return {}
    return {k: v for k, v in shards.items() if isinstance(v, list) and len(v) == 5}


def _write_receipt(path: Path, real: str, digest: str | None,
                   shards: dict[str, list[int]]) -> None:
    """Best effort: a read-only cache directory only means the next load hashes again."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"root": real, "manifest": digest, "shards": shards}))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot write the integrity receipt %s (%s): the next load hashes the "
                    "resident shards again", path, e)
        with contextlib.suppress(OSError):  # nothing was written, or nowhere to write it
            tmp.unlink()
