"""Manifest validation: structure rules (t158-and-streaming.md §5.5 rules 1-14) and descriptor
checks (§5.5 rules 15-20) for the pinned Kimi K3 t158 artifact and for our own artifacts of any
geometry and codec mode. FORMAT.md "Streaming artifact: banks and manifest v1".

Codec modes extend `quantization.mode` (our extension, same three keys): t158, mxfp4, ct-int,
ct-int-asym, bf16 (and the reference's affine). A record holds gate, up, down in that order, each
as the codec's components named `{gate|up|down}_proj.{part}`; every component starts 4 KiB-aligned
inside the record, so a component whose length is not a multiple of 4096 is followed by one
explicit `pad` segment (tensor "", U8, 1-D) of exactly the missing bytes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from .manifest import DTYPE_BYTES, Manifest, ManifestError

ALIGN = 4096  # record and component alignment inside bank parts (§3, §5.2)
PAD = "pad"
PROJECTIONS = ("gate", "up", "down")
MAX_SHARDS, MAX_RECORDS, MAX_RESIDENTS, MAX_PARTS = 4096, 100_000, 1_000_000, 1024


@dataclass(frozen=True, slots=True)
class Mode:
    bits: tuple[int, ...]  # allowed quantization.bits
    group_size: int | None  # None: any
    parts: tuple[str, ...]  # per-projection component suffixes, in record order

    def names(self) -> tuple[str, ...]:
        return tuple(f"{p}_proj.{x}" for p in PROJECTIONS for x in self.parts)


MODES: dict[str, Mode] = {
    "t158": Mode((2,), 64, ("packed", "scales")),  # §5.5 rule 2: the published form
    "mxfp4": Mode((4,), 32, ("weight_packed", "weight_scale")),
    "ct-int": Mode((3, 4), 64, ("weight_packed", "weight_scale")),
    "ct-int-asym": Mode((3, 4), 64, ("weight_packed", "weight_scale", "weight_zero_point")),
    "bf16": Mode((16,), 1, ("weight",)),
    "affine": Mode((2, 4), None, ("weight", "scales", "biases")),  # reference only
}

# One expected segment: (component, dtype, shape, length).
Component = tuple[str, str, tuple[int, ...], int]


def mode_codec(mode: str, bits: int | None = None):
    """The codec whose components a bank record of `mode` holds (ct-int: always dense)."""
    from ..formats import get_codec

    if mode in ("t158", "mxfp4", "bf16"):
        return get_codec(mode)
    if mode in ("ct-int", "ct-int-asym"):
        if bits not in (3, 4):
            raise ManifestError(f"mode {mode}: bits must be 3 or 4, got {bits!r}")
        return get_codec("ct-int", num_bits=bits, layout="dense", symmetric=mode == "ct-int")
    raise ManifestError(f"no record layout for codec mode {mode!r}")


def quantization_for(mode: str, bits: int | None = None) -> dict:
    """The manifest `quantization` object of one of our modes: exactly {bits, group_size, mode}."""
    mode_codec(mode, bits)  # validates mode and bits
    spec = MODES[mode]
    return {"bits": bits if len(spec.bits) > 1 else spec.bits[0], "group_size": spec.group_size,
            "mode": mode}


def record_components(mode: str, expert_shapes: Mapping,
                      bits: int | None = None) -> list[Component]:
    """The record's components for `mode` WITHOUT padding, gate then up then down.

    `expert_shapes` maps "gate"/"up"/"down" (or "gate_proj"...) to `(rows, cols)`. `bits` is
    needed only for ct-int modes (3 or 4; 3-bit always in the dense layout in banks)."""
    codec = mode_codec(mode, bits)
    out = []
    for p in PROJECTIONS:
        shape = expert_shapes[p] if p in expert_shapes else expert_shapes[f"{p}_proj"]
        for c in codec.components(tuple(shape)):
            out.append((f"{p}_proj.{c.name}", c.st_dtype, tuple(c.shape), c.nbytes))
    return out


def padded_layout(components: list[Component]) -> list[Component]:
    """`components` with a `pad` segment after each one whose length is not 4096-aligned."""
    out = []
    for comp in components:
        out.append(comp)
        if comp[3] % ALIGN:
            n = -comp[3] % ALIGN
            out.append((PAD, "U8", (n,), n))
    return out


@dataclass(frozen=True, slots=True)
class Descriptor:
    """What a manifest must describe (§5.5 rules 15-20). None means "not pinned"."""

    model_key: str | None
    quantization: dict  # {bits, group_size, mode}
    layers: tuple[int, ...]  # 0-based model layer indices of the routed layers, in order
    experts: int
    components: tuple[Component, ...]  # without padding
    source_repo: str | None = None
    source_revision: str | None = None
    resident_tensor_bytes: int | None = None
    tensor_bytes: int | None = None
    resident_prefix: str = ""  # §5.6: indexed tensors with this prefix == resident_tensors
    allow_preserved: bool = False  # rule 20: trusted K3 descriptor only

    @property
    def layout(self) -> list[Component]:
        return padded_layout(list(self.components))

    @property
    def record_bytes(self) -> int:
        return sum(c[3] for c in self.layout)

    @property
    def routed_expert_bytes(self) -> int:
        return len(self.layers) * self.experts * self.record_bytes


K3_T158_DESCRIPTOR = Descriptor(  # §3 and §5.5 rules 15-20 (MTPLX KIMI_K3_EXPERT_Q1T)
    model_key="kimi-k3-q1t",
    quantization={"bits": 2, "group_size": 64, "mode": "t158"},
    layers=tuple(range(1, 93)),
    experts=896,
    components=(
        ("gate_proj.packed", "U8", (3072, 728), 2_236_416),
        ("gate_proj.scales", "U16", (3072, 56), 344_064),
        ("up_proj.packed", "U8", (3072, 728), 2_236_416),
        ("up_proj.scales", "U16", (3072, 56), 344_064),
        ("down_proj.packed", "U8", (3584, 624), 2_236_416),
        ("down_proj.scales", "U16", (3584, 48), 344_064),
    ),
    source_repo="GrEarl/Kimi-K3-GGUF",
    source_revision="0169245d3ea1473a3f9f03bca821d855df5fb2a3",
    resident_tensor_bytes=113_509_540_864,
    tensor_bytes=751_651_922_944,
    resident_prefix="language_model.",
    allow_preserved=True,
)
K3_T158_RECORD_BYTES = 7_741_440


def descriptor_for(cfg, mode: str, bits: int | None = None, *, model_key: str | None = None,
                   source_repo: str | None = None, source_revision: str | None = None,
                   layers=None) -> Descriptor:
    """Descriptor for one of our artifacts: `cfg` (ModelConfig) gives the routed layers, expert
    count and projection shapes; `mode` one of MODES except affine; `bits` defaults per mode.
    `layers` narrows the routed layers for an artifact built with `--layers` (each must be an
    MoE layer of `cfg`; every expert of each is still required)."""
    if layers is None:
        layers = cfg.moe_layers
    elif not set(layers) <= set(cfg.moe_layers):
        raise ManifestError(f"layers {sorted(set(layers) - set(cfg.moe_layers))} are not MoE "
                            f"layers of this config ({cfg.moe_layers})")
    if mode not in MODES or mode == "affine":
        raise ManifestError(f"unknown codec mode {mode!r}; have {sorted(set(MODES) - {'affine'})}")
    spec = MODES[mode]
    bits = spec.bits[0] if bits is None and len(spec.bits) == 1 else bits
    if bits not in spec.bits:
        raise ManifestError(f"mode {mode}: bits must be one of {spec.bits}, got {bits!r}")
    comps = record_components(mode, cfg.expert_shapes, bits)
    return Descriptor(model_key=model_key,
                      quantization={"bits": bits, "group_size": spec.group_size, "mode": mode},
                      layers=tuple(sorted(layers)), experts=cfg.num_experts,
                      components=tuple(comps), source_repo=source_repo,
                      source_revision=source_revision)


def _rec(r) -> str:
    return f"record (layer {r.layer}, expert {r.expert})"


def _check_pads(r, names: tuple[str, ...]) -> None:
    """Components in mode order, each optional `pad` only where §5.5-ext allows it."""
    got, rel, prev = [], 0, None
    for s in r.segments:
        if s.component == PAD:
            if prev is None or prev == PAD or rel % ALIGN == 0:
                raise ManifestError(f"{_rec(r)}: pad segment not directly after a component "
                                    "whose end is not 4096-aligned")
            if s.dtype != "U8" or len(s.shape) != 1 or s.tensor != "" or s.length != -rel % ALIGN:
                raise ManifestError(f"{_rec(r)}: pad segment must be U8, 1-D, tensor \"\", and "
                                    f"exactly {-rel % ALIGN} bytes so the next component is "
                                    "aligned")
        else:
            got.append(s.component)
        prev, rel = s.component, rel + s.length
    if tuple(got) != names:
        raise ManifestError(f"{_rec(r)}: components {got} are not, in order, {list(names)}")


def validate_structure(m: Manifest) -> None:
    """§5.5 rules 1-14 (plus the codec-mode extension of rule 2). Raises ManifestError."""
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
            raise ManifestError(f"{_rec(r)}: records {what}")
        prev, n = key, 0
        for s in r.segments:
            want = nbytes.get((s.dtype, s.shape))
            if want is None:
                want = nbytes[(s.dtype, s.shape)] = DTYPE_BYTES[s.dtype] * _prod(s.shape)
            if s.length != want:
                raise ManifestError(f"{_rec(r)} segment {s.component}: length {s.length} != "
                                    f"{s.dtype} x {list(s.shape)} = {want} bytes")
            sh = shards.get(s.shard)
            if sh is None:
                raise ManifestError(f"{_rec(r)} segment {s.component}: shard {s.shard!r} is "
                                    "not listed")
            if s.offset + s.length > sh.size:
                raise ManifestError(f"{_rec(r)} segment {s.component}: ends at "
                                    f"{s.offset + s.length}, past {s.shard!r} ({sh.size} B)")
            n += s.length
        if n != r.logical_bytes:
            raise ManifestError(f"{_rec(r)}: segments sum to {n} bytes, logical_bytes is "
                                f"{r.logical_bytes}")
        if (r.sidecar_offset is None) != (r.sidecar_length is None):
            raise ManifestError(f"{_rec(r)}: sidecar_offset and sidecar_length must appear "
                                "together")
        if r.sidecar_length is not None and r.sidecar_length != r.logical_bytes:
            raise ManifestError(f"{_rec(r)}: sidecar_length {r.sidecar_length} != logical_bytes")
        if len(r.segments) != len(names) or any(
                s.component != c for s, c in zip(r.segments, names)):
            _check_pads(r, names)
        total += r.logical_bytes
    if total != m.artifact["routed_expert_bytes"]:
        raise ManifestError(f"record logical_bytes sum to {total}, artifact.routed_expert_bytes "
                            f"is {m.artifact['routed_expert_bytes']}")


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
            raise ManifestError(f"{_rec(r)}: no sidecar_offset/sidecar_length")
        if not 0 <= r.part < len(sc.parts):
            raise ManifestError(f"{_rec(r)}: part {r.part} is outside 0..{len(sc.parts) - 1}")
        p = sc.parts[r.part]
        if r.sidecar_offset % sc.alignment:
            raise ManifestError(f"{_rec(r)}: sidecar_offset {r.sidecar_offset} is not a multiple "
                                f"of the alignment {sc.alignment}")
        end = p.data_start + r.sidecar_offset + r.sidecar_length
        if end > p.size:
            raise ManifestError(f"{_rec(r)}: ends at {end}, past part {p.file!r} ({p.size} B); "
                                "a record must not straddle parts")
        if p.data_start + r.sidecar_offset < last_end[r.part]:
            raise ManifestError(f"{_rec(r)}: overlaps the previous record in part {p.file!r} "
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
                raise ManifestError(f"{_rec(r)} segment {s.component}: expected {p.file!r} at "
                                    f"offset {pos}, got {s.shard!r} at {s.offset}")
            pos += s.length


_ROUTED = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.(?:switch_mlp|experts)\.")


def validate_descriptor(m: Manifest, d: Descriptor) -> None:
    """§5.5 rules 15-20 against `d` (run validate_structure first). Raises ManifestError."""
    if m.quantization != d.quantization:
        raise ManifestError(f"quantization {m.quantization} != expected {d.quantization}")
    for key in ("model_key", "source_repo", "source_revision"):
        want = getattr(d, key)
        if want is not None and getattr(m, key) != want:
            raise ManifestError(f"{key} {getattr(m, key)!r} != expected {want!r}")
    if len(m.records) != len(d.layers) * d.experts:
        raise ManifestError(f"{len(m.records)} records, expected {len(d.layers)} layers x "
                            f"{d.experts} experts")
    layout = [(c, dt, tuple(sh), n) for c, dt, sh, n in d.layout]
    rb = d.record_bytes
    i = 0
    for layer in d.layers:
        for e in range(d.experts):
            r = m.records[i]
            i += 1
            if r.layer != layer or r.expert != e:
                raise ManifestError(f"{_rec(r)}: expected (layer {layer}, expert {e}) here")
            if r.logical_bytes != rb or len(r.segments) != len(layout) or any(
                    (s.component, s.dtype, s.shape, s.length) != want
                    for s, want in zip(r.segments, layout)):
                got = [(s.component, s.dtype, list(s.shape), s.length) for s in r.segments]
                raise ManifestError(f"{_rec(r)}: segments {got} do not match the descriptor "
                                    f"layout {[(c, t, list(s), n) for c, t, s, n in layout]}")
    a = m.artifact
    for key, want in (("routed_expert_bytes", d.routed_expert_bytes),
                      ("resident_tensor_bytes", d.resident_tensor_bytes),
                      ("tensor_bytes", d.tensor_bytes)):
        if want is not None and a[key] != want:
            raise ManifestError(f"artifact.{key} {a[key]} != expected {want}")
    routed = set(d.layers)
    for t in m.resident_tensors:
        hit = _ROUTED.search(t.tensor)
        if hit and int(hit.group(1)) in routed:
            raise ManifestError(f"resident tensor {t.tensor!r} is a routed expert")
    if not d.allow_preserved and any(s.kind == "preserved-safetensors" for s in m.shards):
        raise ManifestError("preserved-safetensors shards are allowed only for the trusted K3 "
                            "descriptor (rule 20)")
