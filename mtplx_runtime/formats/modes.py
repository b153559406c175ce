"""The codec table: one row per bank mode and per source-only codec, the one list every codec
fact is read from (FORMAT.md "Expert codecs", "Bank parts").

A row names the mode (a manifest's `quantization.mode`), the codec that encodes and decodes its
projections (its class, imported on first use, holds the reference decode), the manifest
quantization it allows (bits, group size), its components per projection in record order, and
the kernels that run it: the native CPU library's codec (the C enum's name, checked when the
library loads) and the CUDA kernels per bit width. The rest is read from here: `get_codec` and
`CODEC_NAMES`, `mode_codec` and `quantization_for` (record layouts, manifests, descriptors),
`cpu_native.CODECS`, `cpu.NATIVE_MODES` (and through it the memory plan's decoding check), the
profiler's codec names; tests/test_modes.py checks `cuda.KERNELS` and FORMAT.md against it.

    row -> codec class (lazy) -> components -> record layout (record.py)
        -> cpu / cuda kernel names -> the backends that run its records
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .base import Codec, FormatError


@dataclass(frozen=True, slots=True)
class CudaKernel:
    """One CUDA kernel family of a mode (kernels/native/*.cu, entry points `{prefix}_...`)."""

    bits: int | None  # the quantization.bits it runs; None: every bits of its mode
    source: str  # file under kernels/native/
    prefix: str  # kernel name prefix (native/experts.cuh)
    group: int | None = None  # the group size it runs; None: the mode's first


@dataclass(frozen=True, slots=True)
class Mode:
    """One row of the codec table. A row with `bits` is a bank mode; one without is a codec that
    is only ever a source (q2k). A bank mode without a codec (affine) is one a manifest may
    declare but nothing here can read."""

    name: str  # quantization.mode (bank modes), else the codec's name
    codec: str | None  # get_codec's name; None: no codec reads it
    codec_class: str | None  # "module.Class" inside formats/
    bits: tuple[int, ...] = ()  # quantization.bits it allows; (): not a bank mode
    groups: tuple[int, ...] = ()  # quantization.group_size it allows, the default first; (): any
    parts: tuple[str, ...] = ()  # component names per projection, in record order
    params: tuple[tuple[str, object], ...] = ()  # fixed codec parameters of the mode
    bits_param: str | None = None  # the codec parameter that quantization.bits sets
    group_param: str | None = None  # the one quantization.group_size sets (several groups)
    cpu: str | None = None  # the native CPU library's codec; None: the reference decode runs it
    cuda: tuple[CudaKernel, ...] = ()
    label: str = ""  # its name in `mtplx profile --codec` ("{bits}" filled in); "": the mode's
    section: str = ""  # the FORMAT.md section that defines its bytes

    @property
    def group_size(self) -> int | None:
        """The default quantization.group_size (None: any)."""
        return self.groups[0] if self.groups else None

    def allows(self, bits: int, group_size: int) -> bool:
        """Whether a manifest's quantization {bits, group_size} fits the mode (FORMAT.md rule 2)."""
        return bits in self.bits and (not self.groups or group_size in self.groups)

    def names(self) -> tuple[str, ...]:
        """The record's component names (without pads): gate, up, down, each `parts`."""
        return tuple(f"{p}_proj.{x}" for p in ("gate", "up", "down") for x in self.parts)


# the CUDA ct-int kernels read one scale per 64 columns, ct-int4 also one per 32 (Kimi K2 Thinking)
_CTINT_CUDA = (CudaKernel(3, "ctint.cu", "ctint3", 64),
               CudaKernel(4, "ctint.cu", "ctint4", 64),
               CudaKernel(4, "ctint.cu", "ctint4g32", 32))
# ct-int banks always hold the dense 3-bit layout; group 64 (K3) or 32 (Kimi K2 Thinking)
_CTINT = dict(codec="ct-int", codec_class="ctint.CtIntCodec", bits=(3, 4), groups=(64, 32),
              bits_param="num_bits", group_param="group_size", cpu="ct-int", section="ct-int")

ROWS: tuple[Mode, ...] = (
    # FORMAT.md rule 2: t158's components are the published artifact's
    Mode("t158", "t158", "t158.T158Codec", (2,), (64,), ("packed", "scales"), cpu="t158",
         cuda=(CudaKernel(None, "t158.cu", "t158"),), section="t158"),
    Mode("mxfp4", "mxfp4", "mxfp4.MXFP4Codec", (4,), (32,), ("weight_packed", "weight_scale"),
         cpu="mxfp4", cuda=(CudaKernel(None, "mxfp4.cu", "mxfp4"),), section="mxfp4"),
    Mode("ct-int", parts=("weight_packed", "weight_scale"),
         params=(("layout", "dense"), ("symmetric", True)), cuda=_CTINT_CUDA, label="w{bits}",
         **_CTINT),
    Mode("ct-int-asym", parts=("weight_packed", "weight_scale", "weight_zero_point"),
         params=(("layout", "dense"), ("symmetric", False)), label="w{bits}-asym", **_CTINT),
    # a bf16 weight needs no decode: no packed format for a kernel to work on
    Mode("bf16", "bf16", "bf16.BF16Codec", (16,), (1,), ("weight",), section="bf16"),
    # group 128: the 128 x 128 block of one scale
    Mode("fp8-block", "fp8-block", "fp8block.FP8BlockCodec", (8,), (128,),
         ("weight", "weight_scale_inv"), cpu="fp8-block",
         cuda=(CudaKernel(None, "fp8block.cu", "fp8block"),), section="fp8-block"),
    # the published manifest format's affine mode: accepted by the structure rules only
    Mode("affine", None, None, (2, 4), (), ("weight", "scales", "biases")),
    Mode("q2k", "q2k", "q2k.Q2KCodec", section="q2k"),
)

# Bank modes by name: what `quantization.mode` may be (FORMAT.md rule 2).
MODES: dict[str, Mode] = {m.name: m for m in ROWS if m.bits}
# Codec names in table order (get_codec's names).
CODEC_NAMES: tuple[str, ...] = tuple(dict.fromkeys(m.codec for m in ROWS if m.codec))
_CLASSES = {m.codec: m.codec_class for m in ROWS if m.codec}


def get_codec(name: str, **params) -> Codec:
    """A codec instance of `name` (one of CODEC_NAMES). The class's module is imported here, on
    first use, so one codec's dependencies never burden another."""
    if name not in _CLASSES:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(CODEC_NAMES)}")
    module, cls = _CLASSES[name].rsplit(".", 1)
    return getattr(importlib.import_module(f".{module}", __package__), cls)(**params)


def mode_row(mode: str) -> Mode:
    """The table row of bank mode `mode`, or FormatError."""
    if mode not in MODES:
        raise FormatError(f"unknown codec mode {mode!r}; have {', '.join(MODES)}")
    return MODES[mode]


def mode_codec(mode: str, bits: int | None = None, group_size: int | None = None) -> Codec:
    """The codec whose components a bank record of `mode` holds. `bits` (quantization.bits) is
    required where the mode allows several, else None or the one it allows; `group_size` None
    means the mode's default."""
    row = mode_row(mode)
    if row.codec is None:
        raise FormatError(f"no record layout for codec mode {mode!r}: no codec reads it")
    if (bits is not None or row.bits_param) and bits not in row.bits:
        raise FormatError(f"mode {mode}: bits must be one of {row.bits}, got {bits!r}")
    if group_size is not None and group_size not in row.groups:
        raise FormatError(f"mode {mode}: group_size must be one of {row.groups}, got "
                          f"{group_size!r}")
    params = dict(row.params)
    if row.bits_param:
        params[row.bits_param] = bits
    if row.group_param:
        params[row.group_param] = group_size or row.group_size
    return get_codec(row.codec, **params)


def quantization_for(mode: str, bits: int | None = None, group_size: int | None = None) -> dict:
    """The manifest `quantization` object of one of our modes: exactly {bits, group_size, mode}."""
    mode_codec(mode, bits, group_size)  # validates mode, bits and group
    row = MODES[mode]
    return {"bits": bits if bits is not None else row.bits[0],
            "group_size": group_size or row.group_size, "mode": mode}


def mode_labels() -> dict[str, tuple[str, int | None, int | None]]:
    """{name: (mode, bits, group_size)} for every bank mode with a codec: one name per bits
    (`label`, e.g. ct-int 3 is "w3"; the mode's name where it allows one bits, bits None) and per
    group size ("-g32" added past the default, group None)."""
    out: dict[str, tuple[str, int | None, int | None]] = {}
    for m in MODES.values():
        if m.codec is None:
            continue
        for b in m.bits:
            name = m.label.format(bits=b) if len(m.bits) > 1 else m.label or m.name
            bits = b if len(m.bits) > 1 else None
            out[name] = (m.name, bits, None)
            out.update({f"{name}-g{g}": (m.name, bits, g) for g in m.groups[1:]})
    return out


def native_modes(backend: str) -> frozenset[str]:
    """The bank modes whose records `backend` ("cpu" or "cuda") runs with kernels of its own."""
    if backend not in ("cpu", "cuda"):
        raise ValueError(f"backend must be 'cpu' or 'cuda', got {backend!r}")
    return frozenset(m.name for m in MODES.values() if getattr(m, backend))


def cpu_codecs() -> tuple[str, ...]:
    """The native CPU library's codecs in table order: its C enum (kernels/native/cpu/mtplx_cpu.h)
    in the same order, checked by name when the library loads."""
    return tuple(dict.fromkeys(m.cpu for m in ROWS if m.cpu))


def cuda_kernels() -> dict[tuple[str, int | None, int], tuple[str, str]]:
    """{(mode, bits or None, columns per scale group): (source, prefix)}: the CUDA kernels by
    bank mode, in the form of kernels/cuda.py's KERNELS."""
    return {(m.name, k.bits, k.group or m.group_size): (k.source, k.prefix)
            for m in MODES.values() for k in m.cuda}


def cuda_key(mode: str, bits: int | None, group_size: int | None) -> tuple[str, int | None, int]:
    """The `cuda_kernels` key of a bank of `mode` at `bits` and `group_size` (None: the mode's
    default); bits is None unless the mode has kernels per bits."""
    row = mode_row(mode)
    per_bits = any(k.bits is not None for k in row.cuda)
    return mode, bits if per_bits else None, group_size or row.group_size


def cuda_gap(mode: str, bits: int | None, group_size: int | None) -> str | None:
    """Why no CUDA kernel runs a bank of `mode` at `bits` and `group_size` (None: the mode's
    default), or None when one does: what kernels/cuda.py's `unsupported` says of its records
    first, and what `mtplx plan` says of a GPU plan without reading a record."""
    kernels = cuda_kernels()
    key = cuda_key(mode, bits, group_size)
    if key in kernels:
        return None
    groups = sorted(g for m, b, g in kernels if (m, b) == key[:2])
    if not groups:
        return (f"no CUDA kernel for bank mode {mode!r}{f' bits {bits}' if bits else ''}; use "
                "the cpu or reference backend")
    # the kernels read one scale per group of these many columns
    return (f"no CUDA kernel for bank mode {mode!r} with scale groups of {key[2]} columns (the "
            f"CUDA kernels read groups of {' or '.join(map(str, groups))}); use the cpu or "
            "reference backend")
