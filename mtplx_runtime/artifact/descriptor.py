"""Descriptors: what model an artifact must hold (FORMAT.md "Streaming artifact: banks and
manifest v1", descriptor rules) -- the routed layers, every expert of each, the record's
components for the codec mode, and for the pinned Kimi K3 t158 artifact its published sizes and
source. `validate_descriptor` checks a structurally valid manifest against one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..formats.modes import MODES
from ..formats.record import PAD, Component, record_components
from .manifest import Manifest, ManifestError, rec


@dataclass(frozen=True, slots=True)
class Descriptor:
    """What a manifest must describe (FORMAT.md rules 15-20). None means "not pinned"."""

    model_key: str | None
    quantization: dict  # {bits, group_size, mode}
    layers: tuple[int, ...]  # 0-based model layer indices of the routed layers, in order
    experts: int
    components: tuple[Component, ...]  # without padding (writers choose it: "Bank parts")
    source_repo: str | None = None
    source_revision: str | None = None
    resident_tensor_bytes: int | None = None
    tensor_bytes: int | None = None
    # Indexed tensors with this prefix == resident_tensors (FORMAT.md "Verifying and reading").
    resident_prefix: str = ""
    allow_preserved: bool = False  # rule 20: trusted K3 descriptor only
    resident_dtype: str | None = None  # rule 15: the form of the residents, when pinned


# MTPLX KIMI_K3_EXPERT_Q1T: FORMAT.md rules 15-20 and "Bank parts".
K3_T158_DESCRIPTOR = Descriptor(
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
    resident_dtype="bf16",
)
K3_T158_RECORD_BYTES = 7_741_440


def descriptor_for(cfg, mode: str, bits: int | None = None, *, model_key: str | None = None,
                   source_repo: str | None = None, source_revision: str | None = None,
                   layers=None, resident_dtype: str | None = None) -> Descriptor:
    """Descriptor for one of our artifacts: `cfg` (ModelConfig) gives the routed layers, expert
    count and projection shapes; `mode` a bank mode with a codec; `bits` defaults per mode.
    `layers` narrows the routed layers for an artifact built with `--layers` (each must be an
    MoE layer of `cfg`; every expert of each is still required). `resident_dtype` pins the form
    of the residents (FORMAT.md "Quantized residents"); None accepts any."""
    if layers is None:
        layers = cfg.moe_layers
    elif not set(layers) <= set(cfg.moe_layers):
        raise ManifestError(f"layers {sorted(set(layers) - set(cfg.moe_layers))} are not MoE "
                            f"layers of this config ({cfg.moe_layers})")
    if mode not in MODES or MODES[mode].codec is None:
        raise ManifestError(f"unknown codec mode {mode!r}; have "
                            f"{sorted(m for m, row in MODES.items() if row.codec)}")
    spec = MODES[mode]
    bits = spec.bits[0] if bits is None and len(spec.bits) == 1 else bits
    if bits not in spec.bits:
        raise ManifestError(f"mode {mode}: bits must be one of {spec.bits}, got {bits!r}")
    comps = record_components(mode, cfg.expert_shapes, bits)
    return Descriptor(model_key=model_key,
                      quantization={"bits": bits, "group_size": spec.group_size, "mode": mode},
                      layers=tuple(sorted(layers)), experts=cfg.num_experts,
                      components=tuple(comps), source_repo=source_repo,
                      source_revision=source_revision, resident_dtype=resident_dtype)


_ROUTED = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.(?:switch_mlp|experts)\.")


def validate_descriptor(m: Manifest, d: Descriptor) -> None:
    """FORMAT.md rules 15-20 against `d` (run validate_structure first). Raises ManifestError."""
    if m.quantization != d.quantization:
        raise ManifestError(f"quantization {m.quantization} != expected {d.quantization}")
    for key in ("model_key", "source_repo", "source_revision", "resident_dtype"):
        want = getattr(d, key)
        if want is not None and getattr(m, key) != want:
            raise ManifestError(f"{key} {getattr(m, key)!r} != expected {want!r}")
    if len(m.records) != len(d.layers) * d.experts:
        raise ManifestError(f"{len(m.records)} records, expected {len(d.layers)} layers x "
                            f"{d.experts} experts")
    rb = _check_layout(m, d)
    a = m.artifact
    for key, want in (("routed_expert_bytes", len(d.layers) * d.experts * rb),
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


def _segments(r) -> list[Component]:
    return [(s.component, s.dtype, tuple(s.shape), s.length) for s in r.segments]


def _check_layout(m: Manifest, d: Descriptor) -> int:
    """Rules 16-17: records are the descriptor's keys in order; each one's components (its
    segments without pads) are the descriptor's, and every record has the first record's
    segments (one layout per artifact, padded or not as rule 2 allows). Returns the record
    bytes."""
    first = _segments(m.records[0]) if m.records else []
    comps = [c for c in first if c[0] != PAD]
    if m.records and comps != [(c, dt, tuple(sh), n) for c, dt, sh, n in d.components]:
        raise ManifestError(f"{rec(m.records[0])}: components {_show(comps)} do not match the "
                            f"descriptor's {_show(d.components)}")
    rb = m.records[0].logical_bytes if m.records else 0
    i = 0
    for layer in d.layers:
        for e in range(d.experts):
            r = m.records[i]
            i += 1
            if r.layer != layer or r.expert != e:
                raise ManifestError(f"{rec(r)}: expected (layer {layer}, expert {e}) here")
            if r.logical_bytes != rb or _segments(r) != first:
                raise ManifestError(f"{rec(r)}: segments {_show(_segments(r))} differ from the "
                                    f"first record's {_show(first)}: every record of an "
                                    "artifact has one layout")
    return rb


def _show(segments) -> list:
    return [(c, t, list(sh), n) for c, t, sh, n in segments]
