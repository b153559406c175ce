"""Manifest v1 value rules (t158-and-streaming.md §5.3, "Value rules for every object"): JSON
objects -> manifest dataclasses, with exact key sets, JSON integers (booleans rejected), sizes and
lengths >= 1, known dtypes, shapes of integers >= 1 and normalized relative file names. Notes any
optional key written with its default value, since the digest then needs a re-serialization
(§5.4). Cross-object rules (§5.5) are in manifest_rules.py.
"""

from __future__ import annotations

from .manifest import (
    _ARTIFACT_KEYS,
    _HEX64,
    _QUANT_KEYS,
    _REC_OPT,
    _REC_REQ,
    _RES_KEYS,
    _SEG_KEYS,
    _TOP_OPT,
    _TOP_REQ,
    DTYPE_BYTES,
    EMPTY_SHA256,
    FORMAT,
    SHARD_KINDS,
    Manifest,
    ManifestError,
    Record,
    ResidentTensor,
    Segment,
    Shard,
    Sidecar,
    SidecarPart,
)


def check_name(name: object, where: str) -> str:
    """§5.3: a non-empty, normalized, relative POSIX path with no `.`/`..` and no backslash."""
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
    """Value rules of §5.3 for every object; remembers whether any optional key was written with
    its default value (then the digest needs a full re-serialization, §5.4)."""

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
        if v not in DTYPE_BYTES or type(v) is not str:
            raise ManifestError(f"{where}: unknown dtype {v!r}")
        return v

    def shape(self, v: object, where: str) -> tuple[int, ...]:
        if type(v) is not list:
            raise ManifestError(f"{where}: shape must be an array of integers >= 1, got {v!r}")
        key = tuple(v)
        hit = self._shapes.get(key)
        if hit is not None and all(type(x) is int for x in v):
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
