"""The record layout of a bank mode: which components one routed expert's record holds, in what
order, at which offsets (FORMAT.md "Streaming artifact: banks and manifest v1").

One record = one expert of one routed layer = gate, up, down components in the mode codec's
order, contiguous from the record start. This project writes every component 4 KiB-aligned: a
component whose length is not a multiple of 4096 is followed by an explicit `pad` segment
(tensor "", U8 [n], zero bytes), so a record's `logical_bytes` (its stride in the part) is a
multiple of 4096 (K3 t158 needs no padding). Other writers may leave pads out; `layout_of`
takes a record's layout as its manifest declares it. Codec modes extend the manifest's
`quantization.mode`: the bank modes of the codec table (`modes.py`).

    mode + expert shapes -> components -> padded segments -> RecordLayout (what we write)
    manifest record segments -> RecordLayout (what a bank holds: layout_of)
    RecordLayout + {proj: {component: array}} <-> record bytes (record_bytes / record_parts)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .base import ST_DTYPES, Codec, FormatError
from .modes import mode_codec

ALIGNMENT = 4096  # record alignment in a bank part; our writer's component alignment (O_DIRECT)
PAD = "pad"  # the component name of a padding segment
PROJECTIONS = ("gate", "up", "down")  # record order
PROJ_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def part_name(mode: str, layer: int, n_routed: int) -> str:
    """`experts-{mode}-layer-{L:03d}-of-{N:03d}.bin`; L the 0-based model layer index."""
    return f"experts-{mode}-layer-{layer:03d}-of-{n_routed:03d}.bin"


def tensor_name(layer: int, expert: int, proj: str, part: str) -> str:
    return f"model.layers.{layer}.mlp.switch_mlp.experts.{expert}.{PROJ_NAMES[proj]}.{part}"


@dataclass(frozen=True, slots=True)
class SegmentLayout:
    """One segment of a record; `offset` is relative to the record start."""

    component: str  # "{gate_proj|up_proj|down_proj}.{part}" or "pad"
    proj: str | None  # "gate" | "up" | "down"; None for padding
    part: str | None  # codec component name; None for padding
    offset: int
    length: int
    dtype: str  # safetensors tag ("U8" for padding)
    shape: tuple[int, ...]

    def tensor(self, layer: int, expert: int) -> str:
        return "" if self.proj is None else tensor_name(layer, expert, self.proj, self.part)


@dataclass(frozen=True, slots=True)
class RecordLayout:
    mode: str
    bits: int | None
    segments: tuple[SegmentLayout, ...]
    logical_bytes: int  # also the record stride in its part

    @property
    def codec(self) -> Codec:
        return mode_codec(self.mode, self.bits)


def record_layout(cfg, mode: str, bits: int | None = None) -> RecordLayout:
    """The (layer- and expert-independent) segment layout this project writes for one record of
    `mode` for the expert shapes of `cfg` (a ModelConfig, or anything with `expert_shapes`): the
    component list of the mode with its `pad` segments."""
    try:
        components = padded_layout(record_components(mode, cfg.expert_shapes, bits))
    except FormatError as e:
        raise FormatError(f"expert shapes {cfg.expert_shapes} cannot be stored as {mode}: "
                          f"{e}") from None
    return layout_of(mode, bits, components)


def layout_of(mode: str, bits: int | None, segments) -> RecordLayout:
    """The RecordLayout of segments `[(component, dtype, shape, length)]` laid out back to back
    from the record start: this project's padded layout, or the one a manifest's records declare
    (pads optional, FORMAT.md "Bank parts"; the manifest rules have checked them)."""
    segs: list[SegmentLayout] = []
    off = 0
    for component, dtype, shape, length in segments:
        proj, part = (None, None) if component == PAD else component.split(".", 1)
        proj = proj and proj.removesuffix("_proj")
        segs.append(SegmentLayout(component, proj, part, off, length, dtype, tuple(shape)))
        off += length
    return RecordLayout(mode, bits, tuple(segs), off)


def first_misaligned(layout: RecordLayout, alignment: int | None = None) -> SegmentLayout | None:
    """The first component whose offset in the record is not a multiple of `alignment` (None:
    of its dtype's element size), or None. Kernels that address components in place need
    this; an unpadded layout from another writer may break it."""
    for s in layout.segments:
        if s.proj is not None and s.offset % (alignment or np.dtype(ST_DTYPES[s.dtype]).itemsize):
            return s
    return None


def record_bytes(layout: RecordLayout, parts: dict[str, dict[str, np.ndarray]]) -> bytes:
    """Serialize `{proj: {component: array}}` into one record (padding zero-filled)."""
    buf = bytearray(layout.logical_bytes)
    for s in layout.segments:
        if s.proj is None:
            continue
        a = np.ascontiguousarray(parts[s.proj][s.part])
        if a.nbytes != s.length or tuple(a.shape) != s.shape:
            raise FormatError(f"{s.component}: array {a.dtype}{list(a.shape)} does not match "
                              f"the record layout {s.dtype}{list(s.shape)}")
        buf[s.offset:s.offset + s.length] = a.tobytes()
    return bytes(buf)


def record_parts(layout: RecordLayout, data: bytes | memoryview) -> dict[str, dict]:
    """Inverse of `record_bytes`: `{proj: {component: array}}` (fresh arrays, BF16 as uint16)."""
    out: dict[str, dict[str, np.ndarray]] = {p: {} for p in PROJECTIONS}
    for s in layout.segments:
        if s.proj is not None:
            raw = np.frombuffer(data, np.uint8, s.length, s.offset)
            out[s.proj][s.part] = raw.view(ST_DTYPES[s.dtype]).reshape(s.shape).copy()
    return out


# One expected segment: (component, dtype, shape, length).
Component = tuple[str, str, tuple[int, ...], int]


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
        if comp[3] % ALIGNMENT:
            n = -comp[3] % ALIGNMENT
            out.append((PAD, "U8", (n,), n))
    return out
