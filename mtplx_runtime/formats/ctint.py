"""compressed-tensors `pack-quantized` integer weights (W2/W3/W4/W8, group 64 or 32). FORMAT.md
"ct-int".

Signed codes q in [-2^(b-1), 2^(b-1)-1] are stored as u = q + 2^(b-1), packed LSB-first along the
last axis into little-endian int32 words; every row starts a fresh word and pads with zero bits
(which decode to q_min, not 0, so rows are cut at `cols` from `weight_shape`).
* 2/4/8 bits: 32/b codes per word, code i at word i*b//32, bit i*b%32, in every ct version.
* 3 bits "dense" (ct >= 0.18): one bit stream, 32 codes in 3 words, codes 10 and 21 of each unit
  straddle a word boundary; W = ceil(3*cols/32) (pad to 32 codes, pack, truncate).
* 3 bits "legacy" (ct 0.17.x): 10 codes per word at bits 3*(i%10), bits 30-31 always zero;
  W = ceil(cols/10).
Both 3-bit layouts share the format string, so `detect_layout` tells them apart by width
(FORMAT.md "ct-int", layout detection). One scale per group of 64 consecutive columns (K3), or of
32 (Kimi K2 Thinking's INT4 experts). Zero points (asymmetric only) have the scale's shape
[rows, G] and are packed the same way along dim 0. Dequant: bf16((q - zp) * scale) computed in
fp32, rounded once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import ClassVar

import numpy as np
from packaging.version import InvalidVersion, Version

from .base import Codec, ComponentSpec, FormatError, Shape2, bf16_bits_to_f32, f32_to_bf16_bits

SUPPORTED_BITS = (2, 3, 4, 8)
LAYOUTS = ("dense", "legacy")
GROUP_SIZE = 64  # the default: K3's W3A16 g64
GROUP_SIZES = (64, 32)  # the group sizes readers accept (FORMAT.md "ct-int")
DENSE_SINCE = Version("0.18.0")  # first ct release with the dense 3-bit packing (PR #732)
BF16_EPS = 2.0**-7  # torch.finfo(torch.bfloat16).eps: ct's replacement for a zero scale


def _check_bits_layout(num_bits: int, layout: str) -> None:
    if num_bits not in SUPPORTED_BITS:
        raise FormatError(f"ct-int: num_bits {num_bits} not supported (have {SUPPORTED_BITS})")
    if layout not in LAYOUTS:
        raise FormatError(f"ct-int: layout {layout!r} is not one of {LAYOUTS}")


def code_offset(num_bits: int) -> int:
    """u = q + code_offset: 4 for 3 bits, 8 for 4 bits, 128 for 8 bits."""
    return 1 << (num_bits - 1)


def packed_width(n: int, num_bits: int, layout: str = "dense") -> int:
    """Words per packed row of n codes. `layout` matters only for 3 bits."""
    _check_bits_layout(num_bits, layout)
    if num_bits == 3 and layout == "legacy":
        return -(-n // 10)
    return -(-n * num_bits // 32)


@cache
def _unit(num_bits: int, layout: str) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """The repeat unit: (codes, words, ((word, bit offset) per code)). Dense packs 32 codes
    into num_bits words (no slack); legacy 3-bit packs 10 codes into one word."""
    codes = 10 if num_bits == 3 and layout == "legacy" else 32
    bits = [i * num_bits for i in range(codes)]
    return codes, -(-codes * num_bits // 32), tuple((b >> 5, b & 31) for b in bits)


def pack_codes(u: np.ndarray, num_bits: int, layout: str = "dense") -> np.ndarray:
    """Unsigned codes [..., n] in [0, 2^b) -> int32 words [..., packed_width(n)], per row."""
    _check_bits_layout(num_bits, layout)
    u = np.asarray(u)
    if u.dtype.kind not in "ui":
        raise FormatError(f"ct-int: codes must be integers, got {u.dtype}")
    if u.size and (u.min() < 0 or u.max() >= 1 << num_bits):
        raise FormatError(f"ct-int: {num_bits}-bit codes must lie in [0, {(1 << num_bits) - 1}]")
    lead, n = u.shape[:-1], u.shape[-1]
    n_codes, n_words, slots = _unit(num_bits, layout)
    units = -(-n // n_codes)
    # Zero-code padding to whole units; dense then truncates the surplus words (ct >= 0.18).
    padded = np.zeros((*lead, units * n_codes), np.uint32)
    padded[..., :n] = u
    g = padded.reshape(*lead, units, n_codes)
    words = np.zeros((*lead, units, n_words), np.uint32)
    for i, (w, o) in enumerate(slots):
        # uint32 << drops bits past 31; a straddling code puts its high bits in the next word.
        words[..., w] |= g[..., i] << np.uint32(o)
        if o + num_bits > 32:
            words[..., w + 1] |= g[..., i] >> np.uint32(32 - o)
    width = packed_width(n, num_bits, layout)
    return np.ascontiguousarray(words.reshape(*lead, units * n_words)[..., :width]).view(np.int32)


def unpack_codes(words: np.ndarray, num_bits: int, layout: str, n: int) -> np.ndarray:
    """int32 (or uint32) words [..., W] -> unsigned codes uint8 [..., n]. W must be
    packed_width(n); padding bits are ignored, as ct ignores them."""
    _check_bits_layout(num_bits, layout)
    words = np.asarray(words)
    if words.dtype not in (np.int32, np.uint32):
        raise FormatError(f"ct-int: packed words must be int32, got {words.dtype}")
    width = packed_width(n, num_bits, layout)
    if words.shape[-1] != width:
        raise FormatError(
            f"ct-int: {words.shape[-1]} words per row, but {n} {num_bits}-bit codes in the "
            f"{layout} layout take {width}"
        )
    lead = words.shape[:-1]
    n_codes, n_words, slots = _unit(num_bits, layout)
    units = -(-n // n_codes)
    # Logical shifts only: an arithmetic shift of a negative int32 would smear bit 31 into the
    # straddled codes, so work on the uint32 view.
    padded = np.zeros((*lead, units * n_words), np.uint32)
    padded[..., :width] = words.view(np.uint32)
    g = padded.reshape(*lead, units, n_words)
    mask = np.uint32((1 << num_bits) - 1)
    out = np.empty((*lead, units, n_codes), np.uint8)
    for i, (w, o) in enumerate(slots):
        v = g[..., w] >> np.uint32(o)
        if o + num_bits > 32:
            v |= g[..., w + 1] << np.uint32(32 - o)
        out[..., i] = v & mask
    return out.reshape(*lead, units * n_codes)[..., :n]


def pack_zero_points(zp_u: np.ndarray, num_bits: int, layout: str = "dense") -> np.ndarray:
    """Unsigned zero-point codes [rows, G] -> int32 [packed_width(rows), G], packed along dim 0
    (each column g holds the zero points of every output row for group g)."""
    return np.ascontiguousarray(pack_codes(np.asarray(zp_u).T, num_bits, layout).T)


def unpack_zero_points(words: np.ndarray, num_bits: int, layout: str, rows: int) -> np.ndarray:
    """int32 [packed_width(rows), G] -> unsigned zero-point codes uint8 [rows, G]."""
    return np.ascontiguousarray(unpack_codes(np.asarray(words).T, num_bits, layout, rows).T)


def _parse_version(version: str) -> Version:
    try:
        return Version(version)
    except InvalidVersion:
        raise FormatError(f"quantization_config.version {version!r} is not a version") from None


def detect_layout(
    packed_width: int, cols: int, version: str | None = None, *, override: str | None = None
) -> str:
    """The 3-bit layout of a `weight_packed` tensor with W words per row (FORMAT.md "ct-int").

    Width decides; `version` (quantization_config.version) breaks ties and must not contradict
    it. `override` forces a layout for hand-made checkpoints whose version is wrong, but the width
    must still fit it.
    """
    dense, legacy = packed_width == -(-3 * cols // 32), packed_width == -(-cols // 10)
    where = f"3-bit weight_packed with {packed_width} words per row for {cols} columns"
    if override is not None:
        if override not in LAYOUTS:
            raise FormatError(f"layout override {override!r} is not one of {LAYOUTS}")
        if not {"dense": dense, "legacy": legacy}[override]:
            raise FormatError(f"{where} cannot be in the {override} layout")
        return override
    if not dense and not legacy:
        raise FormatError(
            f"{where} fits neither layout (dense {-(-3 * cols // 32)}, legacy {-(-cols // 10)})"
        )
    by_version = None
    if version is not None:
        by_version = "legacy" if _parse_version(version) < DENSE_SINCE else "dense"
    if dense and legacy:
        if by_version is None:
            raise FormatError(
                f"{where} is ambiguous and quantization_config has no version; override the layout"
            )
        return by_version
    by_width = "dense" if dense else "legacy"
    if by_version not in (None, by_width):
        raise FormatError(
            f"{where} is in the {by_width} layout, but compressed-tensors {version} writes "
            f"{by_version}; if the checkpoint was made by hand, override the layout "
            f"(override={by_width!r}, `--layout {by_width}`)"
        )
    return by_width


@dataclass(frozen=True, slots=True)
class CtScheme:
    """What the runtime needs from `quantization_config`."""

    num_bits: int
    symmetric: bool
    group_size: int = GROUP_SIZE
    actorder: str | None = None
    version: str | None = None  # ct version that wrote the file; cross-checks detect_layout


def parse_quantization_config(qc: Mapping, *, allowed_bits: tuple[int, ...] = (3, 4)) -> CtScheme:
    """Apply the reading rules of FORMAT.md "ct-int" (3 bits source, 4 bits recoded).

    Every config group must describe the same weight scheme: target matching is not evaluated
    here, so two groups that disagree could both cover the experts (the tensors themselves say
    which projections are quantised).
    """
    if not isinstance(qc, Mapping):
        raise FormatError("quantization_config is not a JSON object")

    def need(what: str, got: object, want: object) -> None:
        if got != want:
            raise FormatError(f"quantization_config: {what} is {got!r}, expected {want!r}")

    need("quant_method", qc.get("quant_method"), "compressed-tensors")
    need("quantization_status", qc.get("quantization_status"), "compressed")
    for key, why in (("transform_config", "rotated"), ("sparsity_config", "sparse")):
        if qc.get(key):
            raise FormatError(f"quantization_config: non-empty {key} ({why} weights) unsupported")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise FormatError("quantization_config: config_groups is missing or empty")
    seen: dict[tuple, str] = {}
    for gname, group in groups.items():
        w = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(w, Mapping):
            raise FormatError(f"quantization_config: group {gname!r} has no weights scheme")
        need(f"{gname}.format", group.get("format") or qc.get("format"), "pack-quantized")
        need(f"{gname}.weights.type", w.get("type"), "int")
        need(f"{gname}.weights.strategy", w.get("strategy"), "group")
        if w.get("group_size") not in GROUP_SIZES:
            raise FormatError(f"quantization_config: {gname}.weights.group_size is "
                              f"{w.get('group_size')!r}, expected one of {GROUP_SIZES}")
        need(f"{gname}.weights.dynamic", w.get("dynamic", False), False)
        need(f"{gname}.input_activations", group.get("input_activations"), None)
        if w.get("num_bits") not in allowed_bits:
            raise FormatError(
                f"quantization_config: {gname}.weights.num_bits is {w.get('num_bits')!r}, "
                f"expected one of {allowed_bits}"
            )
        if not isinstance(w.get("symmetric", True), bool):
            raise FormatError(f"quantization_config: {gname}.weights.symmetric is not a boolean")
        seen[(w["num_bits"], w.get("symmetric", True), w["group_size"], w.get("actorder"))] = gname
    if len(seen) > 1:
        raise FormatError(
            f"quantization_config: config groups {sorted(seen.values())} disagree on "
            f"(num_bits, symmetric, group_size, actorder) = {sorted(seen, key=str)}; cannot "
            "tell which covers the routed experts"
        )
    num_bits, symmetric, group_size, actorder = next(iter(seen))
    version = qc.get("version")
    if version is not None:
        version = str(version)
        _parse_version(version)  # fail now rather than at layout detection
    return CtScheme(num_bits, symmetric, group_size, actorder, version)


def weight_shape_tensor(shape: Shape2) -> np.ndarray:
    """The `weight_shape` checkpoint tensor: I64 [2] = (rows, cols). Metadata, not a component."""
    return np.array(shape, dtype=np.int64)


def dequantize(
    q: np.ndarray,
    scale_bits: np.ndarray,
    zp: np.ndarray | None = None,
    g_idx: np.ndarray | None = None,
    *,
    group_size: int = GROUP_SIZE,
) -> np.ndarray:
    """Signed codes [rows, cols], BF16 scale bits [rows, G], signed zero points [rows, G] ->
    float32 [rows, cols] holding BF16 values, bit-exact with ct's BF16 path.

    (q - zp) * s is exact in fp32 (at most 11 significant bits), so one RNE rounding to BF16
    equals the library's BF16 subtract-then-multiply. `g_idx` [cols] (ct <= 0.18 actorder
    "group") maps column c to group g_idx[c]; as in ct, any -1 means "not initialised".
    """
    q, scale_bits = np.asarray(q), np.asarray(scale_bits, np.uint16)
    rows, cols = q.shape
    if scale_bits.shape != (rows, cols // group_size) or cols % group_size:
        raise FormatError(f"ct-int: scale {scale_bits.shape} does not fit codes {q.shape}")
    groups = np.arange(cols) // group_size
    if g_idx is not None and not (np.asarray(g_idx) == -1).any():
        g_idx, n_groups = np.asarray(g_idx, np.int64), cols // group_size
        # ct sorts columns by g_idx and cuts groups of group_size in that order, which equals
        # scale[g_idx[c]] only when every group has exactly group_size columns.
        fits = g_idx.shape == (cols,) and g_idx.min() >= 0 and g_idx.max() < n_groups
        if not fits or (np.bincount(g_idx, minlength=n_groups) != group_size).any():
            raise FormatError(
                f"weight_g_idx must give each of {n_groups} groups exactly {group_size} of "
                f"{cols} columns"
            )
        groups = g_idx
    d = q.astype(np.float32)  # [rows, cols]
    if zp is not None:
        d -= zp.astype(np.float32)[:, groups]
    return bf16_bits_to_f32(f32_to_bf16_bits(d * bf16_bits_to_f32(scale_bits)[:, groups]))


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to BF16 and back: what a torch BF16 op does to its fp32 result."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


def quantize(
    weight: np.ndarray, num_bits: int, symmetric: bool, group_size: int = GROUP_SIZE
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """float32 [rows, cols] -> (q int8, scale BF16 bits, zp int8 | None), per ct 0.20.1
    `calculate_qparams` + `_quantize` on a BF16 weight, rounding each step to BF16 as torch does
    (FORMAT.md "ct-int", quantiser). For fixtures only: bit-exact fixtures must come from the
    library itself.
    """
    rows, cols = weight.shape
    if cols % group_size:
        raise FormatError(f"ct-int: {cols} columns are not a multiple of group {group_size}")
    w = _bf16(np.asarray(weight, np.float32)).reshape(rows, cols // group_size, group_size)
    lo, hi = -code_offset(num_bits), code_offset(num_bits) - 1
    mn = np.minimum(w.min(-1), 0)  # the range always includes 0
    mx = np.maximum(w.max(-1), 0)
    zp = None
    with np.errstate(divide="ignore", invalid="ignore"):
        if symmetric:
            s = _bf16(np.maximum(-mn, mx) / np.float32((hi - lo) / 2))
        else:
            s = _bf16(_bf16(mx - mn) / np.float32(hi - lo))
            zp_f = np.clip(_bf16(lo - _bf16(mn / s)), lo, hi)
            # An all-zero group gives 0/0 = NaN, which torch's int8 cast turns into 0.
            zp = np.round(np.nan_to_num(zp_f, nan=0.0)).astype(np.int8)
    s = np.where(s == 0, np.float32(BF16_EPS), s)  # after the zero point, as in ct
    x = _bf16(w / s[..., None])
    if zp is not None:
        x = _bf16(x + zp[..., None])
    q = np.clip(np.round(x), lo, hi).astype(np.int8).reshape(rows, cols)
    return q, f32_to_bf16_bits(s), zp


@dataclass(frozen=True, slots=True)
class CtIntCodec(Codec):
    """compressed-tensors pack-quantized int, group 64 or 32 (G = cols / group_size).
    Components: `weight_packed` I32 [rows, W], `weight_scale` BF16 [rows, G], and
    `weight_zero_point` I32 [Wz, G] when asymmetric. The checkpoint's `weight_shape` (I64 [2]) is
    metadata: see `weight_shape_tensor`."""

    num_bits: int = 3
    layout: str = "dense"  # 3 bits only; 2/4/8-bit packing is the same in every layout
    symmetric: bool = True
    group_size: int = GROUP_SIZE
    name: ClassVar[str] = "ct-int"

    def __post_init__(self) -> None:
        _check_bits_layout(self.num_bits, self.layout)
        if self.group_size not in GROUP_SIZES:
            raise FormatError(f"ct-int: group_size {self.group_size!r} is not one of "
                              f"{GROUP_SIZES}")

    def _groups(self, shape: Shape2) -> int:
        rows, cols = shape
        if cols % self.group_size:
            raise FormatError(f"ct-int: {cols} columns are not a multiple of {self.group_size}")
        return cols // self.group_size

    def components(self, shape: Shape2) -> list[ComponentSpec]:
        rows, cols = shape
        g = self._groups(shape)
        w = packed_width(cols, self.num_bits, self.layout)
        specs = [
            ComponentSpec("weight_packed", np.dtype(np.int32), (rows, w), "I32"),
            ComponentSpec("weight_scale", np.dtype(np.uint16), (rows, g), "BF16"),
        ]
        if not self.symmetric:
            wz = packed_width(rows, self.num_bits, self.layout)
            specs.append(ComponentSpec("weight_zero_point", np.dtype(np.int32), (wz, g), "I32"))
        return specs

    def encode(self, weight: np.ndarray) -> dict[str, np.ndarray]:
        q, scale_bits, zp = quantize(weight, self.num_bits, self.symmetric, self.group_size)
        return self.encode_codes(q, scale_bits, zp)

    def encode_codes(
        self, q: np.ndarray, scale_bits: np.ndarray, zp: np.ndarray | None = None
    ) -> dict[str, np.ndarray]:
        """Pack given signed codes [rows, cols], BF16 scale bits [rows, G] and (asymmetric only)
        signed zero points [rows, G] into components."""
        q = np.asarray(q)
        g = self._groups(q.shape)
        if np.shape(scale_bits) != (q.shape[0], g):
            raise FormatError(f"ct-int: scale shape {np.shape(scale_bits)} for codes {q.shape}")
        if (zp is None) != self.symmetric:
            raise FormatError("ct-int: zero points are required iff the codec is asymmetric")
        off = code_offset(self.num_bits)
        parts = {
            "weight_packed": pack_codes(q.astype(np.int32) + off, self.num_bits, self.layout),
            "weight_scale": np.asarray(scale_bits, np.uint16).copy(),
        }
        if zp is not None:
            if np.shape(zp) != (q.shape[0], g):
                raise FormatError(f"ct-int: zero point shape {np.shape(zp)} for codes {q.shape}")
            zp_u = np.asarray(zp).astype(np.int32) + off
            parts["weight_zero_point"] = pack_zero_points(zp_u, self.num_bits, self.layout)
        return parts

    def codes(
        self, parts: Mapping[str, np.ndarray], shape: Shape2
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Components -> (signed codes int8 [rows, cols], signed zero points int8 [rows, G] or
        None when symmetric)."""
        self.check_parts(parts, shape)
        off = code_offset(self.num_bits)
        u = unpack_codes(parts["weight_packed"], self.num_bits, self.layout, shape[1])
        q = (u.astype(np.int16) - off).astype(np.int8)
        if self.symmetric:
            return q, None
        zu = unpack_zero_points(parts["weight_zero_point"], self.num_bits, self.layout, shape[0])
        return q, (zu.astype(np.int16) - off).astype(np.int8)

    def decode(self, parts: Mapping[str, np.ndarray], shape: Shape2) -> np.ndarray:
        """Reference dequant; an optional `weight_g_idx` part applies activation order."""
        q, zp = self.codes(parts, shape)
        return dequantize(q, parts["weight_scale"], zp, parts.get("weight_g_idx"),
                          group_size=self.group_size)


# ---- Exact W3 -> W4 recode (FORMAT.md "W4 recode") ----
# 3-bit words (dense | legacy) -> u3 in [0, 7] -> u4 = u3 + 4 (= q + 8, in 4..11) -> 4-bit words.
# The 4-bit packing is the same in every ct version, so the result is a standard W4A16 tensor
# (vLLM `uint4b8`, or `uint4` with zero points); scales, weight_shape and g_idx are unchanged.

# u4 = q + 8 = (u3 - 4) + 8
_W4_SHIFT = code_offset(4) - code_offset(3)


def recode_packed_w3_to_w4(words: np.ndarray, cols: int, layout: str) -> np.ndarray:
    """3-bit `weight_packed` int32 [rows, W3] in `layout` -> 4-bit int32 [rows, ceil(cols/8)].

    `cols` comes from `weight_shape`; the 3-bit width must match it (FormatError otherwise).
    """
    u3 = unpack_codes(words, 3, layout, cols)  # [rows, cols] uint8
    return pack_codes(u3 + np.uint8(_W4_SHIFT), 4)


def recode_zero_point_w3_to_w4(words: np.ndarray, rows: int, layout: str) -> np.ndarray:
    """3-bit `weight_zero_point` int32 [W3(rows), G], packed along dim 0 -> 4-bit int32
    [ceil(rows/8), G], also packed along dim 0."""
    u3 = unpack_codes(np.asarray(words).T, 3, layout, rows)  # [G, rows]
    return np.ascontiguousarray(pack_codes(u3 + np.uint8(_W4_SHIFT), 4).T)
