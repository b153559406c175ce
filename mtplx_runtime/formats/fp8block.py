"""fp8-block: FP8 e4m3 weights with one float32 scale per 128 x 128 block (FORMAT.md "fp8-block"):
the expert codec of DeepSeek-V3/R1 and Kimi K2 Instruct checkpoints (`quant_method` "fp8").

Byte layout: `weight` F8_E4M3 `[rows, cols]`, one e4m3 byte per weight (carried as uint8: bit 7
the sign, bits 6..3 the exponent with bias 7, bits 2..0 the mantissa; exponent 0 is subnormal,
m/8 * 2^-6; no infinities; 0x7F and 0xFF are NaN and rejected), then `weight_scale_inv` F32
`[ceil(rows/128), ceil(cols/128)]`, one scale per block of 128 rows x 128 columns (the last
blocks of a row or column may be partial). Decode:

    W[r, c] = bf16_rne(fp32(e4m3[r, c]) * scale_inv[r // 128, c // 128])

the product in fp32, rounded once to bf16: the values the published bf16 conversion of these
checkpoints gives, and exact in both model dtypes.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .base import (
    Codec,
    ComponentSpec,
    FormatError,
    Shape2,
    bf16_bits_to_f32,
    check_weight,
    f32_to_bf16_bits,
)

BLOCK = 128  # rows and columns per scale
E4M3_MAX = 448.0
NAN_CODES = (0x7F, 0xFF)


def _e4m3_values() -> np.ndarray:
    """float32 [256]: the value of every e4m3 byte (NaN at 0x7F and 0xFF)."""
    code = np.arange(256)
    exp, man = (code >> 3) & 0xF, code & 7
    mag = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))
    out = np.where(code & 0x80, -mag, mag).astype(np.float32)
    out[list(NAN_CODES)] = np.nan
    return out


E4M3_VALUES = _e4m3_values()
# The finite non-negative values in code order (codes 0..126), ascending: the encoder's grid.
_GRID = E4M3_VALUES[:0x7F]


def scale_shape(shape: Shape2) -> tuple[int, int]:
    """`weight_scale_inv`'s shape for a `[rows, cols]` weight: (ceil(rows/128), ceil(cols/128))."""
    rows, cols = shape
    return -(-rows // BLOCK), -(-cols // BLOCK)


def _bf16(x: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


def check_scales(scale_inv: np.ndarray) -> None:
    """FormatError unless every scale is finite and its block's largest weight (448 * |s|) is
    finite in bf16: a NaN or infinite weight must never reach a matmul."""
    s = np.asarray(scale_inv, np.float32)
    with np.errstate(over="ignore"):
        peak = _bf16(np.float32(E4M3_MAX) * np.abs(s))
    bad = ~np.isfinite(peak)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise FormatError(f"fp8-block: weight_scale_inv{list(at)} = {float(s[at])!r}: a scale "
                          f"must be finite and 448 x |scale| finite in bf16")


def decode_fp8_block(weight: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """weight uint8 (e4m3 bytes) `[rows, cols]` + scale_inv float32 `[ceil(rows/128),
    ceil(cols/128)]` -> float32 `[rows, cols]` holding bf16 values (the module's formula).

    Raises FormatError on a shape mismatch, an e4m3 NaN code or a bad scale (`check_scales`)."""
    if weight.dtype != np.uint8 or weight.ndim != 2:
        raise FormatError(f"fp8-block: weight must be a 2-D uint8 (e4m3) array, got "
                          f"{weight.dtype}{list(weight.shape)}")
    if scale_inv.dtype != np.float32 or scale_inv.shape != scale_shape(weight.shape):
        raise FormatError(f"fp8-block: weight_scale_inv {scale_inv.dtype}{list(scale_inv.shape)} "
                          f"does not fit weight {list(weight.shape)}; expected float32 "
                          f"{list(scale_shape(weight.shape))} (one scale per 128 x 128 block)")
    nan = np.isin(weight, NAN_CODES)
    if nan.any():
        at = tuple(int(i) for i in np.argwhere(nan)[0])
        raise FormatError(f"fp8-block: weight{list(at)} is 0x{weight[at]:02X}, an e4m3 NaN")
    check_scales(scale_inv)
    rows, cols = weight.shape
    s = np.repeat(np.repeat(scale_inv, BLOCK, axis=0), BLOCK, axis=1)[:rows, :cols]
    return _bf16(E4M3_VALUES[weight] * s)


def e4m3_codes(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest e4m3 byte, ties to the even code, magnitudes above 448 saturated to
    448, the sign kept (what torch's float8_e4m3fn cast gives). x must not hold NaN."""
    x = np.asarray(x, np.float32)
    mag = np.minimum(np.abs(x), np.float32(E4M3_MAX))
    hi = np.minimum(np.searchsorted(_GRID, mag, side="left"), len(_GRID) - 1)  # _GRID[hi] >= mag
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = mag - _GRID[lo], _GRID[hi] - mag  # exact: both on a fine binary grid
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo).astype(np.uint8)
    return code | np.where(np.signbit(x), np.uint8(0x80), np.uint8(0))  # -0 too, as torch


def encode_fp8_block(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 `[rows, cols]` -> (weight uint8 e4m3 codes, scale_inv float32), for fixtures: per
    128 x 128 block s = max|w| / 448 (1 for an all-zero block), codes = e4m3(w / s)."""
    w = check_weight("fp8-block", weight, 1)
    if 0 in w.shape:
        raise FormatError(f"fp8-block: weight must be non-empty, got shape {list(w.shape)}")
    rows, cols = w.shape
    gr, gc = scale_shape(w.shape)
    padded = np.zeros((gr * BLOCK, gc * BLOCK), np.float32)
    padded[:rows, :cols] = np.abs(w)
    amax = padded.reshape(gr, BLOCK, gc, BLOCK).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    s = np.repeat(np.repeat(scale, BLOCK, axis=0), BLOCK, axis=1)[:rows, :cols]
    codes = e4m3_codes(w / s)
    check_scales(scale)
    return codes, scale


def parse_quantization_config(qc: Mapping) -> tuple[int, int]:
    """The block `(128, 128)` of a checkpoint's `quantization_config` (FORMAT.md "fp8-block"):
    quant_method "fp8", fmt "e4m3", weight_block_size [128, 128], activation_scheme "dynamic" or
    absent; FormatError otherwise."""
    if not isinstance(qc, Mapping):
        raise FormatError("quantization_config is not a JSON object")
    want = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}
    for key, value in want.items():
        if qc.get(key) != value:
            raise FormatError(f"quantization_config: {key} is {qc.get(key)!r}, expected {value!r}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise FormatError(f"quantization_config: activation_scheme is "
                          f"{qc['activation_scheme']!r}, expected 'dynamic' (static activation "
                          f"scales are not read)")
    return BLOCK, BLOCK


class FP8BlockCodec(Codec):
    """Components `weight` (F8_E4M3 as uint8 `[rows, cols]`), then `weight_scale_inv` (F32
    `[ceil(rows/128), ceil(cols/128)]`). Any shape; the block is fixed at 128 x 128."""

    name = "fp8-block"

    def components(self, shape: Shape2) -> list[ComponentSpec]:
        rows, cols = shape
        if rows <= 0 or cols <= 0:
            raise FormatError(f"fp8-block: shape {list(shape)} must be positive")
        return [ComponentSpec("weight", np.dtype(np.uint8), (rows, cols), "F8_E4M3"),
                ComponentSpec("weight_scale_inv", np.dtype(np.float32), scale_shape(shape),
                              "F32")]

    def encode(self, weight: np.ndarray) -> dict[str, np.ndarray]:
        codes, scale = encode_fp8_block(weight)
        return {"weight": codes, "weight_scale_inv": scale}

    def decode(self, parts: Mapping[str, np.ndarray], shape: Shape2) -> np.ndarray:
        self.check_parts(parts, shape)
        return decode_fp8_block(parts["weight"], parts["weight_scale_inv"])
