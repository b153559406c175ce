"""Expert manifest v1 (`mtplx-expert-manifest-v1`), the one module that knows the document: its
objects, the value rules (exact key sets, JSON integers, known dtypes, normalized names), the
structure rules that tie shards, records and bank parts together, canonical JSON and the digest,
the hostile-input-safe load and the atomic write. FORMAT.md "Streaming artifact: banks and
manifest v1". What model an artifact must hold is artifact/descriptor.py.

    file --(size cap, O_NOFOLLOW, no duplicate keys)--> dict --_Parser--> Manifest
         --validate_structure--> digest recomputed, compared

The digest is taken over our own re-serialization with defaults dropped (FORMAT.md "Manifest file"),
never over the input bytes; for a canonical input the two coincide, which the loader uses as its
fast path."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.safetensors_io import CheckpointError, no_duplicate_keys, read_regular
from ..formats.modes import MODES
from ..formats.record import ALIGNMENT, PAD
from ..formats.resident_layouts import RESIDENT_DTYPES

FORMAT = "mtplx-expert-manifest-v1"
MANIFEST_NAME = "expert-manifest.json"
MAX_MANIFEST_BYTES = 128 * 2**20  # FORMAT.md "Manifest file"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # header_sha256 of a sidecar shard
SHARD_KINDS = ("safetensors", "preserved-safetensors", "sidecar")
DTYPE_BYTES = {"BOOL": 1, "I8": 1, "U8": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_HEX64 = re.compile(r"[0-9a-f]{64}")

_TOP_REQ = {"format", "model_key", "source_repo", "source_revision", "quantization", "artifact",
            "shards", "resident_tensors", "records"}
_TOP_OPT = {"sidecar", "manifest_sha256", "resident_dtype"}
_ARTIFACT_KEYS = {"tensor_bytes", "resident_tensor_bytes", "routed_expert_bytes", "shard_count",
                  "record_count"}
_QUANT_KEYS = {"bits", "group_size", "mode"}
_SEG_KEYS = frozenset({"component", "tensor", "shard", "offset", "length", "dtype", "shape"})
_REC_REQ = {"layer", "expert", "logical_bytes", "segments"}
_REC_OPT = {"sha256", "sidecar_offset", "sidecar_length", "part"}
_RES_KEYS = {"tensor", "shard", "offset", "length", "dtype", "shape"}


class ManifestError(CheckpointError):
    """A manifest that breaks FORMAT.md "Manifest file" or "Manifest rules"; the message names
    the object and the rule."""


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
    """A parsed manifest (FORMAT.md "Manifest file"). `from_dict` checks value rules only;
    `validate_structure` (below) checks the cross-object rules (FORMAT.md "Manifest rules")."""

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
    # The form of the resident tensors: "bf16" as published (omitted), or the quantized form of
    # `mtplx build-manifest --resident-dtype int8|int4` (FORMAT.md "Quantized residents").
    resident_dtype: str = "bf16"
    _canonical: bool = field(default=True, repr=False, compare=False)  # no explicit defaults

    @classmethod
    def from_dict(cls, d: object) -> Manifest:
        """Value rules (`_Parser` below); raises ManifestError."""
        return _Parser().manifest(d)

    def to_dict(self) -> dict:
        """The serialized form with optional defaults dropped (FORMAT.md "Manifest file")."""
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
        if self.resident_dtype != "bf16":
            d["resident_dtype"] = self.resident_dtype
        if self.manifest_sha256 is not None:
            d["manifest_sha256"] = self.manifest_sha256
        return d

    def canonical_bytes(self) -> bytes:
        """The digest input: canonical JSON of `to_dict()` without `manifest_sha256`."""
        d = self.to_dict()
        d.pop("manifest_sha256", None)
        return canonical_json(d)

    def compute_sha256(self) -> str:
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    @property
    def authoritative(self) -> bool:
        """Any `sidecar`-kind shard makes a manifest authoritative (FORMAT.md rules 12-14)."""
        return any(s.kind == "sidecar" for s in self.shards)


def canonical_json(obj: object) -> bytes:
    """Canonical JSON (FORMAT.md "Manifest file"): keys sorted at every level, `,`/`:`
    separators, UTF-8 with non-ASCII kept."""
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
    if r.part:  # writers MUST omit part 0 (FORMAT.md "Manifest file")
        d["part"] = r.part
    return d


def _sidecar_dict(sc: Sidecar) -> dict:
    if len(sc.parts) == 1 and sc.parts[0].data_start == 0:  # the legacy single-part form
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
    """Parse, structure-check (FORMAT.md rules 1-14) and digest-check manifest bytes."""
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
        except RecursionError:
            raise ManifestError(f"{where}: not valid JSON: nested too deeply") from None
        claimed = d.pop("manifest_sha256", _ABSENT) if isinstance(d, dict) else _ABSENT
        if claimed is _ABSENT:
            claimed = None
        elif claimed is None:  # an explicit null is not "absent" (lowercase hex is required)
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
            raise ManifestError(f"{where}: manifest_sha256 is missing (required)")
    elif claimed != digest:
        raise ManifestError(f"{where}: manifest_sha256 mismatch: file says {claimed}, "
                            f"content hashes to {digest}")
    return m


def load_manifest(path: str | os.PathLike, *, require_digest: bool = True) -> Manifest:
    """Read a manifest file safely: no symlink follow, a regular file of at most
    128 MiB, UTF-8 JSON without duplicate keys; value and structure rules, digest recomputed."""
    path = Path(path)
    # lstat first, then O_NOFOLLOW | O_NONBLOCK and fstat: a FIFO in its place never blocks.
    raw = read_regular(path, limit=MAX_MANIFEST_BYTES, follow_symlinks=False,
                       error=ManifestError, what="manifest")
    return parse_manifest_bytes(raw, where=str(path), require_digest=require_digest)


def write_manifest(manifest: Manifest, path: str | os.PathLike) -> str:
    """Set `manifest_sha256` and write canonical compact JSON + "\\n" atomically (temp file,
    fsync, rename, fsync of the directory). Returns the digest. Structure-checks first."""
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


# ---- Value rules: JSON objects -> dataclasses ----


def check_name(name: object, where: str) -> str:
    """A non-empty, normalized, relative POSIX path with no `.`/`..` and no backslash."""
    if not isinstance(name, str) or not name:
        raise ManifestError(f"{where}: file name must be a non-empty string, got {name!r}")
    if "\\" in name:
        raise ManifestError(f"{where}: file name {name!r} contains a backslash")
    if name.startswith("/"):
        raise ManifestError(f"{where}: file name {name!r} is an absolute path")
    if "\x00" in name:
        raise ManifestError(f"{where}: file name {name!r} contains a NUL byte")
    for part in name.split("/"):
        if part in ("", ".", ".."):
            raise ManifestError(
                f"{where}: file name {name!r} is not normalized (empty, '.' or '..' component)")
    return name


class _Parser:
    """Value rules for every object (FORMAT.md "Manifest file"); remembers whether any optional
    key was written with its default value (then the digest needs a full re-serialization)."""

    def __init__(self) -> None:
        self.canonical = True
        self._names: set[str] = set()  # file names already checked (92 parts, 500k uses)
        self._shapes: dict[tuple, tuple] = {}

    def keys(self, d: object, where: str, req: set, opt: set = frozenset()) -> dict:
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: expected a JSON object, got {type(d).__name__}")
        if not req <= d.keys() <= (req | opt):
            unknown = sorted(d.keys() - req - opt)
            if unknown:
                raise ManifestError(f"{where}: unknown key(s) {unknown}")
            raise ManifestError(f"{where}: missing key(s) {sorted(req - d.keys())}")
        return d

    @staticmethod
    def int_(v: object, where: str, lo: int = 0) -> int:
        if type(v) is not int:
            what = "a boolean" if isinstance(v, bool) else type(v).__name__
            raise ManifestError(f"{where}: must be a JSON integer, got {what} {v!r}")
        if v < lo:
            raise ManifestError(f"{where}: must be >= {lo}, got {v}")
        return v

    @staticmethod
    def str_(v: object, where: str) -> str:
        if type(v) is not str:
            raise ManifestError(f"{where}: must be a string, got {v!r}")
        return v

    @staticmethod
    def hex64(v: object, where: str) -> str:
        if type(v) is not str or not _HEX64.fullmatch(v):
            raise ManifestError(f"{where}: must be 64 lowercase hex characters, got {v!r}")
        return v

    def name(self, v: object, where: str) -> str:
        if type(v) is str and v in self._names:
            return v
        self._names.add(check_name(v, where))
        return v

    @staticmethod
    def dtype(v: object, where: str) -> str:
        if type(v) is not str or v not in DTYPE_BYTES:
            raise ManifestError(f"{where}: unknown dtype {v!r}")
        return v

    def shape(self, v: object, where: str) -> tuple[int, ...]:
        if type(v) is not list:
            raise ManifestError(f"{where}: shape must be an array of integers >= 1, got {v!r}")
        if not all(type(x) is int for x in v):  # before hashing: a list or {} is unhashable
            for x in v:
                self.int_(x, f"{where} shape", 1)
        key = tuple(v)
        hit = self._shapes.get(key)
        if hit is not None:
            return hit
        for x in v:
            self.int_(x, f"{where} shape", 1)
        self._shapes[key] = key
        return key

    def manifest(self, d: object) -> Manifest:
        d = self.keys(d, "manifest", _TOP_REQ, _TOP_OPT)
        q = self.keys(d["quantization"], "quantization", _QUANT_KEYS)
        a = self.keys(d["artifact"], "artifact", _ARTIFACT_KEYS)
        for k in _ARTIFACT_KEYS:
            self.int_(a[k], f"artifact.{k}")
        quant = {"bits": self.int_(q["bits"], "quantization.bits", 1),
                 "group_size": self.int_(q["group_size"], "quantization.group_size", 1),
                 "mode": self.str_(q["mode"], "quantization.mode")}
        if d["format"] != FORMAT:
            raise ManifestError(f"manifest: format {d['format']!r} is not {FORMAT!r}")
        for k in ("shards", "resident_tensors", "records"):
            if type(d[k]) is not list:
                raise ManifestError(f"manifest: {k} must be an array")
        digest = d.get("manifest_sha256")
        resident_dtype = d.get("resident_dtype", "bf16")
        if resident_dtype not in RESIDENT_DTYPES:
            raise ManifestError(f"manifest: resident_dtype {resident_dtype!r} is not one of "
                                f"{list(RESIDENT_DTYPES)}")
        if "resident_dtype" in d and resident_dtype == "bf16":
            self.canonical = False
        return Manifest(
            format=FORMAT,
            model_key=self.str_(d["model_key"], "model_key"),
            source_repo=self.str_(d["source_repo"], "source_repo"),
            source_revision=self.str_(d["source_revision"], "source_revision"),
            quantization=quant, artifact={k: a[k] for k in _ARTIFACT_KEYS},
            shards=[self.shard(s, i) for i, s in enumerate(d["shards"])],
            resident_tensors=[self.resident(t, i) for i, t in enumerate(d["resident_tensors"])],
            records=[self.record(r, i) for i, r in enumerate(d["records"])],
            sidecar=None if "sidecar" not in d else self.sidecar(d["sidecar"]),
            manifest_sha256=None if digest is None else self.hex64(digest, "manifest_sha256"),
            resident_dtype=resident_dtype,
            _canonical=self.canonical,
        )

    def shard(self, d: object, i: int) -> Shard:
        w = f"shards[{i}]"
        d = self.keys(d, w, {"name", "size", "header_bytes", "header_sha256"}, {"sha256", "kind"})
        kind = d.get("kind", "safetensors")
        if "kind" in d and kind == "safetensors":
            self.canonical = False
        if kind not in SHARD_KINDS:
            raise ManifestError(f"{w}: kind {kind!r} is not one of {SHARD_KINDS}")
        s = Shard(self.name(d["name"], f"{w}.name"), self.int_(d["size"], f"{w}.size", 1),
                  self.int_(d["header_bytes"], f"{w}.header_bytes"),
                  self.hex64(d["header_sha256"], f"{w}.header_sha256"),
                  None if "sha256" not in d else self.hex64(d["sha256"], f"{w}.sha256"), kind)
        if kind == "sidecar" and (s.header_bytes != 0 or s.header_sha256 != EMPTY_SHA256):
            raise ManifestError(f"{w} ({s.name}): a sidecar shard needs header_bytes 0 and "
                                "header_sha256 = sha256('')")
        if kind != "sidecar" and s.header_bytes < 1:
            raise ManifestError(f"{w} ({s.name}): header_bytes must be >= 1 for {kind}")
        return s

    def resident(self, d: object, i: int) -> ResidentTensor:
        w = f"resident_tensors[{i}]"
        d = self.keys(d, w, _RES_KEYS)
        return ResidentTensor(self.str_(d["tensor"], f"{w}.tensor"),
                              self.name(d["shard"], f"{w}.shard"),
                              self.int_(d["offset"], f"{w}.offset"),
                              self.int_(d["length"], f"{w}.length", 1),
                              self.dtype(d["dtype"], f"{w}.dtype"),
                              self.shape(d["shape"], f"{w}.shape"))

    def record(self, d: object, i: int) -> Record:
        w = f"records[{i}]"
        d = self.keys(d, w, _REC_REQ, _REC_OPT)
        segs = d["segments"]
        if type(segs) is not list or not segs:
            raise ManifestError(f"{w}: segments must be a non-empty array")
        out, names = [], self._names
        for j, sd in enumerate(segs):
            # Hot path (500k segments for K3): all checks inline; the slow path explains.
            if type(sd) is dict and sd.keys() == _SEG_KEYS:
                off, n, sh, shard, dt = (sd["offset"], sd["length"], sd["shape"], sd["shard"],
                                         sd["dtype"])
                if (type(off) is int and type(n) is int and off >= 0 and n >= 1
                        and type(shard) is str and shard in names and type(dt) is str
                        and dt in DTYPE_BYTES and type(sd["component"]) is str
                        and type(sd["tensor"]) is str and type(sh) is list and len(sh) == 2
                        and type(sh[0]) is int and type(sh[1]) is int and sh[0] > 0 < sh[1]):
                    out.append(Segment(sd["component"], sd["tensor"], shard, off, n, dt,
                                       (sh[0], sh[1])))
                    continue
            out.append(self.segment(sd, f"{w}.segments[{j}]"))
        r = Record(self.int_(d["layer"], f"{w}.layer"), self.int_(d["expert"], f"{w}.expert"),
                   self.int_(d["logical_bytes"], f"{w}.logical_bytes", 1), out)
        if "sha256" in d:
            r.sha256 = self.hex64(d["sha256"], f"{w}.sha256")
        if "sidecar_offset" in d:
            r.sidecar_offset = self.int_(d["sidecar_offset"], f"{w}.sidecar_offset")
        if "sidecar_length" in d:
            r.sidecar_length = self.int_(d["sidecar_length"], f"{w}.sidecar_length", 1)
        if "part" in d:
            r.part = self.int_(d["part"], f"{w}.part")
            if r.part == 0:
                self.canonical = False
        return r

    def segment(self, d: object, w: str) -> Segment:
        if type(d) is not dict or d.keys() != _SEG_KEYS:
            self.keys(d, w, set(_SEG_KEYS))
        off, n = d["offset"], d["length"]
        if type(off) is not int or type(n) is not int or off < 0 or n < 1:
            self.int_(off, f"{w}.offset")
            self.int_(n, f"{w}.length", 1)
        comp, tensor = d["component"], d["tensor"]
        if type(comp) is not str or type(tensor) is not str:
            raise ManifestError(f"{w}: component and tensor must be strings")
        return Segment(comp, tensor, self.name(d["shard"], f"{w}.shard"), off, n,
                       self.dtype(d["dtype"], f"{w}.dtype"), self.shape(d["shape"], w))

    def sidecar(self, d: object) -> Sidecar:
        if isinstance(d, dict) and "parts" not in d:  # legacy single-part form
            d = self.keys(d, "sidecar", {"file", "alignment", "size", "sha256"})
            parts = [{"file": d["file"], "size": d["size"], "sha256": d["sha256"]}]
        else:
            d = self.keys(d, "sidecar", {"alignment", "parts"})
            parts = d["parts"]
            if type(parts) is not list or not parts:
                raise ManifestError("sidecar: parts must be a non-empty array")
            if len(parts) == 1 and isinstance(parts[0], dict) and not parts[0].get("data_start"):
                self.canonical = False  # would serialize in the legacy form
        out = []
        for i, p in enumerate(parts):
            w = f"sidecar.parts[{i}]"
            p = self.keys(p, w, {"file", "size", "sha256"}, {"data_start"})
            if p.get("data_start", 1) == 0:
                self.canonical = False
            out.append(SidecarPart(self.name(p["file"], f"{w}.file"),
                                   self.int_(p["size"], f"{w}.size", 1),
                                   self.hex64(p["sha256"], f"{w}.sha256"),
                                   self.int_(p.get("data_start", 0), f"{w}.data_start")))
        return Sidecar(self.int_(d["alignment"], "sidecar.alignment", 1), out)


# ---- Structure rules: shards, records and bank parts agree ----

MAX_SHARDS, MAX_RECORDS, MAX_RESIDENTS, MAX_PARTS = 4096, 100_000, 1_000_000, 1024
# A segment's tensor is "{prefix}{layer}.mlp.switch_mlp.experts.{expert}.{component}" (the
# builder's formats.record.tensor_name), "" for a pad segment (FORMAT.md rule 7).
EXPERT_TENSOR_PREFIX = "model.layers."


def rec(r) -> str:
    return f"record (layer {r.layer}, expert {r.expert})"


def _check_pads(r, names: tuple[str, ...]) -> None:
    """Components in mode order, each optional `pad` only where FORMAT.md rule 2 allows it."""
    got, rel, prev = [], 0, None
    for s in r.segments:
        if s.component == PAD:
            if prev is None or prev == PAD or rel % ALIGNMENT == 0:
                raise ManifestError(f"{rec(r)}: pad segment not directly after a component "
                                    "whose end is not 4096-aligned")
            want = -rel % ALIGNMENT
            if s.dtype != "U8" or len(s.shape) != 1 or s.tensor != "" or s.length != want:
                raise ManifestError(f"{rec(r)}: pad segment must be U8, 1-D, tensor \"\", and "
                                    f"exactly {want} bytes so the next component is "
                                    "aligned")
        else:
            got.append(s.component)
        prev, rel = s.component, rel + s.length
    if tuple(got) != names:
        raise ManifestError(f"{rec(r)}: components {got} are not, in order, {list(names)}")


def validate_structure(m: Manifest) -> None:
    """FORMAT.md rules 1-14 (plus the codec-mode extension of rule 2). Raises ManifestError."""
    a, q = m.artifact, m.quantization
    if a["shard_count"] > MAX_SHARDS or a["shard_count"] != len(m.shards):
        raise ManifestError(f"artifact.shard_count {a['shard_count']} != {len(m.shards)} shards "
                            f"(or above {MAX_SHARDS})")
    if a["record_count"] > MAX_RECORDS or a["record_count"] != len(m.records):
        raise ManifestError(f"artifact.record_count {a['record_count']} != {len(m.records)} "
                            f"records (or above {MAX_RECORDS})")
    if len(m.resident_tensors) > MAX_RESIDENTS:
        raise ManifestError(f"{len(m.resident_tensors)} resident tensors exceed {MAX_RESIDENTS}")
    mode = MODES.get(q["mode"])
    if mode is None:
        raise ManifestError(f"quantization.mode {q['mode']!r} is not supported; have "
                            f"{sorted(MODES)}")
    if q["bits"] not in mode.bits or mode.group_size not in (None, q["group_size"]):
        raise ManifestError(f"quantization {q} is invalid for mode {q['mode']!r}: bits "
                            f"{mode.bits}, group_size {mode.group_size}")
    shards = {}
    for s in m.shards:
        if s.name in shards:
            raise ManifestError(f"shard {s.name!r} listed twice")
        if s.kind != "sidecar" and s.header_bytes > s.size:
            raise ManifestError(f"shard {s.name!r}: header_bytes {s.header_bytes} > size {s.size}")
        shards[s.name] = s
    if a["tensor_bytes"] != a["resident_tensor_bytes"] + a["routed_expert_bytes"]:
        raise ManifestError("artifact.tensor_bytes != resident_tensor_bytes + routed_expert_bytes")
    _check_residents(m, shards)
    _check_records(m, shards, mode.names())
    _check_sidecar(m)
    if m.authoritative:
        _check_authoritative(m, shards)
    elif any(s.kind == "preserved-safetensors" for s in m.shards):
        raise ManifestError("preserved-safetensors shards are allowed only in an authoritative "
                            "manifest (rule 20)")


def _check_residents(m: Manifest, shards: dict) -> None:
    prev, total = None, 0
    for t in m.resident_tensors:
        if prev is not None and t.tensor <= prev:
            raise ManifestError(f"resident tensor {t.tensor!r}: names not sorted and unique")
        prev = t.tensor
        s = shards.get(t.shard)
        if s is None or s.kind != "safetensors":
            raise ManifestError(f"resident tensor {t.tensor!r}: shard {t.shard!r} is not a "
                                "listed shard of kind safetensors")
        if t.length != DTYPE_BYTES[t.dtype] * _prod(t.shape):
            raise ManifestError(f"resident tensor {t.tensor!r}: length {t.length} != {t.dtype} "
                                f"x {list(t.shape)}")
        if t.offset < s.header_bytes or t.offset + t.length > s.size:
            raise ManifestError(f"resident tensor {t.tensor!r}: [{t.offset}, "
                                f"{t.offset + t.length}) is outside the data of {t.shard!r}")
        total += t.length
    if total != m.artifact["resident_tensor_bytes"]:
        raise ManifestError(f"resident tensor lengths sum to {total}, artifact says "
                            f"{m.artifact['resident_tensor_bytes']}")


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _check_records(m: Manifest, shards: dict, names: tuple[str, ...]) -> None:
    nbytes: dict[tuple, int] = {}
    prev, total = (-1, -1), 0
    for r in m.records:
        key = (r.layer, r.expert)
        if key <= prev:
            what = "duplicate" if key == prev else "not sorted by (layer, expert)"
            raise ManifestError(f"{rec(r)}: records {what}")
        prev, n = key, 0
        for s in r.segments:
            want = nbytes.get((s.dtype, s.shape))
            if want is None:
                want = nbytes[(s.dtype, s.shape)] = DTYPE_BYTES[s.dtype] * _prod(s.shape)
            if s.length != want:
                raise ManifestError(f"{rec(r)} segment {s.component}: length {s.length} != "
                                    f"{s.dtype} x {list(s.shape)} = {want} bytes")
            sh = shards.get(s.shard)
            if sh is None:
                raise ManifestError(f"{rec(r)} segment {s.component}: shard {s.shard!r} is "
                                    "not listed")
            if s.offset + s.length > sh.size:
                raise ManifestError(f"{rec(r)} segment {s.component}: ends at "
                                    f"{s.offset + s.length}, past {s.shard!r} ({sh.size} B)")
            n += s.length
        if n != r.logical_bytes:
            raise ManifestError(f"{rec(r)}: segments sum to {n} bytes, logical_bytes is "
                                f"{r.logical_bytes}")
        if (r.sidecar_offset is None) != (r.sidecar_length is None):
            raise ManifestError(f"{rec(r)}: sidecar_offset and sidecar_length must appear "
                                "together")
        if r.sidecar_length is not None and r.sidecar_length != r.logical_bytes:
            raise ManifestError(f"{rec(r)}: sidecar_length {r.sidecar_length} != logical_bytes")
        if len(r.segments) != len(names) or any(
                s.component != c for s, c in zip(r.segments, names)):
            _check_pads(r, names)
        total += r.logical_bytes
    if total != m.artifact["routed_expert_bytes"]:
        raise ManifestError(f"record logical_bytes sum to {total}, artifact.routed_expert_bytes "
                            f"is {m.artifact['routed_expert_bytes']}")
    for r in m.records:  # rule 7, last: the other rules explain a moved record better
        stem = f"{EXPERT_TENSOR_PREFIX}{r.layer}.mlp.switch_mlp.experts.{r.expert}."
        for s in r.segments:
            want = "" if s.component == PAD else stem + s.component
            if s.tensor != want:
                raise ManifestError(f"{rec(r)} segment {s.component}: tensor {s.tensor[:80]!r} "
                                    f"is not {want!r} (rule 7)")


def _check_sidecar(m: Manifest) -> None:
    sc = m.sidecar
    if sc is None:
        if any(r.sidecar_offset is not None for r in m.records):
            raise ManifestError("a record has sidecar_offset but there is no sidecar object")
        return
    if sc.alignment & (sc.alignment - 1):
        raise ManifestError(f"sidecar.alignment {sc.alignment} is not a power of two")
    if not 1 <= len(sc.parts) <= MAX_PARTS or len({p.file for p in sc.parts}) != len(sc.parts):
        raise ManifestError(f"sidecar: needs 1..{MAX_PARTS} parts with unique files")
    for p in sc.parts:
        if p.data_start % sc.alignment or p.data_start >= p.size:
            raise ManifestError(f"sidecar part {p.file!r}: data_start {p.data_start} not aligned "
                                f"to {sc.alignment} or not below size {p.size}")
    last_end = [0] * len(sc.parts)
    for r in m.records:
        if r.sidecar_offset is None:
            raise ManifestError(f"{rec(r)}: no sidecar_offset/sidecar_length")
        if r.sha256 is None:
            raise ManifestError(f"{rec(r)}: sha256 is required for a record in a bank part "
                                "(rule 11)")
        if not 0 <= r.part < len(sc.parts):
            raise ManifestError(f"{rec(r)}: part {r.part} is outside 0..{len(sc.parts) - 1}")
        p = sc.parts[r.part]
        if r.sidecar_offset % sc.alignment:
            raise ManifestError(f"{rec(r)}: sidecar_offset {r.sidecar_offset} is not a multiple "
                                f"of the alignment {sc.alignment}")
        end = p.data_start + r.sidecar_offset + r.sidecar_length
        if end > p.size:
            raise ManifestError(f"{rec(r)}: ends at {end}, past part {p.file!r} ({p.size} B); "
                                "a record must not straddle parts")
        if p.data_start + r.sidecar_offset < last_end[r.part]:
            raise ManifestError(f"{rec(r)}: overlaps the previous record in part {p.file!r} "
                                "(or records are out of order)")
        last_end[r.part] = end


def _check_authoritative(m: Manifest, shards: dict) -> None:
    sc = m.sidecar
    if sc is None:
        raise ManifestError("authoritative manifest (sidecar shards) without a sidecar object")
    side = {s.name: s for s in m.shards if s.kind == "sidecar"}
    if len(side) != len(sc.parts):
        raise ManifestError(f"{len(side)} sidecar shards but {len(sc.parts)} sidecar parts")
    for p in sc.parts:
        s = side.get(p.file)
        if s is None or s.size != p.size or s.sha256 != p.sha256 or s.sha256 is None:
            raise ManifestError(f"sidecar part {p.file!r}: no sidecar shard with the same name, "
                                "size and sha256")
    used = {t.shard for t in m.resident_tensors}
    st = {s.name for s in m.shards if s.kind == "safetensors"}
    if st != used:
        raise ManifestError(f"safetensors shards {sorted(st ^ used)} are not referenced by "
                            "resident tensors (or referenced but not listed)")
    for s in m.shards:
        if s.kind != "sidecar" and s.sha256 is None:
            raise ManifestError(f"shard {s.name!r}: sha256 is required in an authoritative "
                                "manifest")
    for r in m.records:  # rule 14
        p = sc.parts[r.part]
        pos = p.data_start + r.sidecar_offset
        for s in r.segments:
            if s.shard != p.file or s.offset != pos:
                raise ManifestError(f"{rec(r)} segment {s.component}: expected {p.file!r} at "
                                    f"offset {pos}, got {s.shard!r} at {s.offset}")
            pos += s.length
