"""Expert manifest v1 (`mtplx-expert-manifest-v1`): objects, parsing, canonical JSON, digest, and
the hostile-input-safe load and atomic write. Spec t158-and-streaming.md §5.3 (objects and value
rules) and §5.4 (`manifest_sha256`); FORMAT.md "Streaming artifact: banks and manifest v1".

    file --(size cap, O_NOFOLLOW, no duplicate keys)--> dict --_parse--> Manifest
         --validate_structure (§5.5 rules 1-14, manifest_rules.py)--> digest recomputed, compared

The digest is taken over our own re-serialization with defaults dropped (§5.4), never over the
input bytes; for a canonical input the two coincide, which the loader uses as its fast path.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.safetensors_io import CheckpointError, no_duplicate_keys

FORMAT = "mtplx-expert-manifest-v1"
MANIFEST_NAME = "expert-manifest.json"
MAX_MANIFEST_BYTES = 128 * 2**20  # §5.3 MAX_MANIFEST_BYTES
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # header_sha256 of a sidecar shard
SHARD_KINDS = ("safetensors", "preserved-safetensors", "sidecar")
DTYPE_BYTES = {"BOOL": 1, "I8": 1, "U8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4,
               "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_HEX64 = re.compile(r"[0-9a-f]{64}")

_TOP_REQ = {"format", "model_key", "source_repo", "source_revision", "quantization", "artifact",
            "shards", "resident_tensors", "records"}
_TOP_OPT = {"sidecar", "manifest_sha256"}
_ARTIFACT_KEYS = {"tensor_bytes", "resident_tensor_bytes", "routed_expert_bytes", "shard_count",
                  "record_count"}
_QUANT_KEYS = {"bits", "group_size", "mode"}
_SEG_KEYS = frozenset({"component", "tensor", "shard", "offset", "length", "dtype", "shape"})
_REC_REQ = {"layer", "expert", "logical_bytes", "segments"}
_REC_OPT = {"sha256", "sidecar_offset", "sidecar_length", "part"}
_RES_KEYS = {"tensor", "shard", "offset", "length", "dtype", "shape"}


class ManifestError(CheckpointError):
    """A manifest that breaks §5.3-§5.5; the message names the object and the rule."""


@dataclass(slots=True)
class Segment:
    """One component of a record: `length` bytes at absolute `offset` of bank part `shard`."""

    component: str  # e.g. "gate_proj.packed"; "pad" for alignment padding (tensor "")
    tensor: str
    shard: str
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(slots=True)
class Record:
    """One expert of one layer: contiguous segments at `sidecar_offset` of `sidecar.parts[part]`."""

    layer: int  # the model's 0-based layer index (routed layers start at 1 for K3)
    expert: int
    logical_bytes: int
    segments: list[Segment]
    sha256: str | None = None
    sidecar_offset: int | None = None  # relative to the part's data_start
    sidecar_length: int | None = None
    part: int = 0


@dataclass(slots=True)
class Shard:
    name: str
    size: int
    header_bytes: int  # safetensors prefix 8 + N; 0 for kind "sidecar"
    header_sha256: str
    sha256: str | None = None
    kind: str = "safetensors"


@dataclass(slots=True)
class ResidentTensor:
    tensor: str
    shard: str
    offset: int  # absolute in the shard file, >= its header_bytes
    length: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(slots=True)
class SidecarPart:
    file: str
    size: int
    sha256: str
    data_start: int = 0


@dataclass(slots=True)
class Sidecar:
    alignment: int
    parts: list[SidecarPart]


@dataclass(slots=True)
class Manifest:
    """A parsed manifest (§5.3). `from_dict` checks value rules only; `validate_structure` in
    manifest_rules.py checks the cross-object rules (§5.5)."""

    format: str
    model_key: str
    source_repo: str
    source_revision: str
    quantization: dict  # exactly {bits, group_size, mode}
    artifact: dict  # exactly {tensor_bytes, resident_tensor_bytes, routed_expert_bytes, ...}
    shards: list[Shard]
    resident_tensors: list[ResidentTensor]
    records: list[Record]
    sidecar: Sidecar | None = None
    manifest_sha256: str | None = None
    _canonical: bool = field(default=True, repr=False, compare=False)  # no explicit defaults

    @classmethod
    def from_dict(cls, d: object) -> Manifest:
        """Value rules of §5.3 (manifest_values.py); raises ManifestError."""
        from .manifest_values import _Parser

        return _Parser().manifest(d)

    def to_dict(self) -> dict:
        """The serialized form with optional defaults dropped (§5.4)."""
        d = {
            "format": self.format, "model_key": self.model_key, "source_repo": self.source_repo,
            "source_revision": self.source_revision, "quantization": dict(self.quantization),
            "artifact": dict(self.artifact),
            "shards": [_shard_dict(s) for s in self.shards],
            "resident_tensors": [
                {"tensor": t.tensor, "shard": t.shard, "offset": t.offset, "length": t.length,
                 "dtype": t.dtype, "shape": list(t.shape)} for t in self.resident_tensors],
            "records": [_record_dict(r) for r in self.records],
        }
        if self.sidecar is not None:
            d["sidecar"] = _sidecar_dict(self.sidecar)
        if self.manifest_sha256 is not None:
            d["manifest_sha256"] = self.manifest_sha256
        return d

    def canonical_bytes(self) -> bytes:
        """The digest input: canonical JSON of `to_dict()` without `manifest_sha256` (§5.4)."""
        d = self.to_dict()
        d.pop("manifest_sha256", None)
        return canonical_json(d)

    def compute_sha256(self) -> str:
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    @property
    def authoritative(self) -> bool:
        """Any `sidecar`-kind shard makes a manifest authoritative (§5.5 rules 12-14)."""
        return any(s.kind == "sidecar" for s in self.shards)


def canonical_json(obj: object) -> bytes:
    """§5.4: keys sorted at every level, `,`/`:` separators, UTF-8 with non-ASCII kept."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def _shard_dict(s: Shard) -> dict:
    d = {"name": s.name, "size": s.size, "header_bytes": s.header_bytes,
         "header_sha256": s.header_sha256}
    if s.sha256 is not None:
        d["sha256"] = s.sha256
    if s.kind != "safetensors":
        d["kind"] = s.kind
    return d


def _record_dict(r: Record) -> dict:
    d = {"layer": r.layer, "expert": r.expert, "logical_bytes": r.logical_bytes,
         "segments": [{"component": s.component, "tensor": s.tensor, "shard": s.shard,
                       "offset": s.offset, "length": s.length, "dtype": s.dtype,
                       "shape": list(s.shape)} for s in r.segments]}
    if r.sha256 is not None:
        d["sha256"] = r.sha256
    if r.sidecar_offset is not None:
        d["sidecar_offset"] = r.sidecar_offset
    if r.sidecar_length is not None:
        d["sidecar_length"] = r.sidecar_length
    if r.part:  # writers MUST omit part 0 (§5.3)
        d["part"] = r.part
    return d


def _sidecar_dict(sc: Sidecar) -> dict:
    if len(sc.parts) == 1 and sc.parts[0].data_start == 0:  # legacy single-part form (§5.3)
        p = sc.parts[0]
        return {"file": p.file, "alignment": sc.alignment, "size": p.size, "sha256": p.sha256}
    parts = []
    for p in sc.parts:
        pd = {"file": p.file, "size": p.size, "sha256": p.sha256}
        if p.data_start:
            pd["data_start"] = p.data_start
        parts.append(pd)
    return {"alignment": sc.alignment, "parts": parts}


_ABSENT = object()


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def parse_manifest_bytes(raw: bytes, *, where: str = "manifest",
                         require_digest: bool = True) -> Manifest:
    """Parse, structure-check (§5.5 1-14) and digest-check (§5.4) manifest bytes."""
    from .rules import validate_structure

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(f"{where}: not UTF-8: {e}") from None
    gc_was_enabled = gc.isenabled()
    gc.disable()  # millions of acyclic containers: collection passes only cost time (3-4x)
    try:
        try:
            d = json.loads(text, parse_constant=_reject_constant)
        except ValueError as e:
            raise ManifestError(f"{where}: not valid JSON: {e}") from None
        claimed = d.pop("manifest_sha256", _ABSENT) if isinstance(d, dict) else _ABSENT
        if claimed is _ABSENT:
            claimed = None
        elif claimed is None:  # an explicit null is not "absent" (§5.3: lowercase hex)
            raise ManifestError(f"{where}: manifest_sha256 must be 64 lowercase hex "
                                "characters, got None")
        m = Manifest.from_dict(d)
        if claimed is not None:
            if type(claimed) is not str or not _HEX64.fullmatch(claimed):
                raise ManifestError(f"{where}: manifest_sha256 must be 64 lowercase hex "
                                    f"characters, got {claimed!r}")
            m.manifest_sha256 = claimed
        validate_structure(m)
        # Fast path: the parsed dict re-serializes to the input bytes, so the input held no
        # duplicate key and, with no explicit defaults, its canonical form is the digest input.
        body = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        if claimed is None:
            same = text.rstrip("\n") == body
        else:
            k = body.find('"model_key":')
            same = text.rstrip("\n") == f'{body[:k]}"manifest_sha256":"{claimed}",{body[k:]}'
        if not same:
            try:
                json.loads(text, object_pairs_hook=no_duplicate_keys)
            except ValueError as e:
                raise ManifestError(f"{where}: {e}") from None
        try:
            digest = (hashlib.sha256(body.encode("utf-8")).hexdigest() if m._canonical
                      else m.compute_sha256())
        except UnicodeEncodeError as e:  # a lone surrogate escape (\ud800) has no UTF-8 form
            raise ManifestError(f"{where}: a string is not encodable as UTF-8: {e}") from None
    finally:
        if gc_was_enabled:
            gc.enable()
    if claimed is None:
        if require_digest:
            raise ManifestError(f"{where}: manifest_sha256 is missing (required, §5.4)")
    elif claimed != digest:
        raise ManifestError(f"{where}: manifest_sha256 mismatch: file says {claimed}, "
                            f"content hashes to {digest}")
    return m


def load_manifest(path: str | os.PathLike, *, require_digest: bool = True) -> Manifest:
    """Read a manifest file safely (§5.3): no symlink follow, a regular file of at most
    128 MiB, UTF-8 JSON without duplicate keys; value and structure rules, digest recomputed."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ManifestError(f"{path}: file not found") from None
    except OSError as e:
        if path.is_symlink():
            raise ManifestError(f"{path}: is a symlink (manifests are read without following "
                                "symlinks)") from None
        raise ManifestError(f"{path}: cannot open: {e}") from None
    try:
        st = os.fstat(fd)
        import stat

        if not stat.S_ISREG(st.st_mode):
            raise ManifestError(f"{path}: not a regular file")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{path}: {st.st_size} bytes exceeds the {MAX_MANIFEST_BYTES}-byte "
                                "manifest size cap")
        chunks, total = [], 0
        while chunk := os.read(fd, min(16 * 2**20, MAX_MANIFEST_BYTES + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > MAX_MANIFEST_BYTES:  # the file grew after fstat
                raise ManifestError(f"{path}: exceeds the {MAX_MANIFEST_BYTES}-byte size cap")
    finally:
        os.close(fd)
    return parse_manifest_bytes(b"".join(chunks), where=str(path), require_digest=require_digest)


def write_manifest(manifest: Manifest, path: str | os.PathLike) -> str:
    """Set `manifest_sha256` and write canonical compact JSON + "\\n" atomically (temp file,
    fsync, rename, fsync of the directory). Returns the digest. Structure-checks first."""
    from .rules import validate_structure

    validate_structure(manifest)
    manifest.manifest_sha256 = None
    manifest.manifest_sha256 = manifest.compute_sha256()
    data = canonical_json(manifest.to_dict()) + b"\n"
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path}: {len(data)} bytes would exceed the manifest size cap")
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return manifest.manifest_sha256
