"""mxfp4: compressed-tensors "mxfp4-pack-quantized", the official K3 expert codec.

Byte layout (FORMAT.md "mxfp4"): `weight_packed` U8
`[rows, cols/2]`, byte k of a row holds column 2k in the low nibble and 2k+1 in the high nibble; a
nibble is E2M1 (bit 3 = sign, `nibble & 7` indexes 0, .5, 1, 1.5, 2, 3, 4, 6). `weight_scale` U8
`[rows, cols/32]` holds one E8M0 byte e per 32 consecutive columns, scale 2^(e - 127).
W[r, c] = E2M1 * scale, exact in bf16. E8M0 0xFF (NaN in OCP MX) is rejected.

The encoder reproduces compressed-tensors 0.20.1 on float32 input byte for byte (the MXFP4A16
preset: `calculate_qparams` -> `generate_mx_scales`, then `MXFP4PackedCompressor.compress`), so
values that are already E2M1 times a power of two survive a round trip unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache

import numpy as np
import torch

from .base import Codec, ComponentSpec, FormatError, Shape2, check_weight

GROUP_ELEMS = 32
E8M0_NAN = 0xFF
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)
# Nibble -> value; nibble 8 is -0.0, which compressed-tensors writes for small negatives.
_NIBBLE_VALUES = np.concatenate([_E2M1, -_E2M1])
# E8M0 byte -> 2^(e - 127), exact in float32 (e = 0 is the subnormal 2^-127); 0xFF -> NaN, as in
# OCP MX, but decoders reject it before it is ever looked up.
_E8M0_SCALES = np.append(np.ldexp(1.0, np.arange(255) - 127), np.nan).astype(np.float32)
# Rounding edges of |x| on the E2M1 grid, as compressed-tensors' `cast_to_fp4` applies them:
# round half to even, so a tie goes down at 0.25, 1.25, 2.5, 5 and up at 0.75, 1.75, 3.5.
_EDGES_EXCLUSIVE = np.array([0.25, 1.25, 2.5, 5.0], dtype=np.float32)  # passed when |x| > edge
_EDGES_INCLUSIVE = np.array([0.75, 1.75, 3.5], dtype=np.float32)  # passed when |x| >= edge


def encode_mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 `[rows, cols]` -> uint8 (weight_packed `[rows, cols/2]`, weight_scale `[rows, G]`).

    G = cols / 32. Per group, as compressed-tensors does it: amax = max |w| is rounded to a power
    of two on its float32 bits (`round_to_power_2`: up when the significand is >= 1.75, else
    down); the E8M0 exponent is that power minus 2 (= floor(log2 6)), clamped at 0 (2^-127). Then
    each w / scale is clamped to +-6 and rounded to the nearest E2M1 value, ties as `_EDGES_*`.
    The sign bit is set iff w / scale < 0: small negatives become -0 (nibble 8), -0.0 becomes +0.

    Raises FormatError if cols % 32 != 0, on NaN/Inf, or when a group's amax >= 1.75 * 2^127
    (that needs E8M0 0xFF; compressed-tensors silently writes a wrapped exponent there).
    """
    w = check_weight("mxfp4", weight, GROUP_ELEMS)
    rows, cols = w.shape

    g = w.reshape(rows, -1, GROUP_ELEMS)  # [rows, G, 32]
    amax = np.abs(g).max(axis=-1)
    # Adding a quarter of the mantissa range (2^21) carries into the exponent iff mantissa >= .75.
    p2_exp = ((amax.view(np.uint32) + np.uint32(1 << 21)) >> np.uint32(23)).astype(np.int32)
    if (p2_exp == 0xFF).any():
        raise FormatError("mxfp4: a group has |w| >= 1.75 * 2**127, which needs E8M0 0xFF (NaN)")
    scale_e = np.maximum(p2_exp - 2, 0).astype(np.uint8)  # amax 0 or tiny -> e = 0, as the library

    x = g / _E8M0_SCALES[scale_e][..., None]  # exact: division by a power of two
    mag = np.minimum(np.abs(x), np.float32(6))
    code = np.searchsorted(_EDGES_EXCLUSIVE, mag, side="left") + np.searchsorted(
        _EDGES_INCLUSIVE, mag, side="right"
    )  # E2M1 magnitude code 0..7 = number of edges passed
    nibbles = (code.astype(np.uint8) | ((x < 0).astype(np.uint8) << 3)).reshape(rows, cols)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return packed, scale_e


def _check_pair(packed_shape: tuple, scale_shape: tuple) -> None:
    if (
        not packed_shape
        or not scale_shape
        or packed_shape[:-1] != scale_shape[:-1]
        or packed_shape[-1] != (GROUP_ELEMS // 2) * scale_shape[-1]
    ):
        raise FormatError(
            f"mxfp4: weight_packed {list(packed_shape)} does not match weight_scale "
            f"{list(scale_shape)}; expected packed [..., 16 * G] for scale [..., G]"
        )


def _dtype_error(packed_dtype, scale_dtype) -> FormatError:
    return FormatError(f"mxfp4: expected uint8 packed and scale, got {packed_dtype}, {scale_dtype}")


def _nan_scale_error() -> FormatError:
    return FormatError("mxfp4: weight_scale holds E8M0 0xFF (NaN), which a checkpoint must not use")


def decode_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """weight_packed uint8 `[..., cols/2]` + weight_scale uint8 `[..., cols/32]` -> float32.

    Output `[..., cols]`, exact. Raises FormatError on E8M0 0xFF.
    """
    if packed.dtype != np.uint8 or scale.dtype != np.uint8:
        raise _dtype_error(packed.dtype, scale.dtype)
    _check_pair(packed.shape, scale.shape)
    if (scale == E8M0_NAN).any():
        raise _nan_scale_error()
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1)  # [..., cols/2, 2]: low = even col
    values = _NIBBLE_VALUES[nibbles].reshape(*scale.shape, GROUP_ELEMS)
    with np.errstate(over="ignore"):  # e >= 253 times 4 or 6 is +-Inf, as in the library's bf16
        out = values * _E8M0_SCALES[scale][..., None]
    return out.reshape(*scale.shape[:-1], -1)


@cache
def _tables_on(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(_NIBBLE_VALUES).to(device), torch.from_numpy(_E8M0_SCALES).to(device)


def decode_mxfp4_torch(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Torch twin of `decode_mxfp4`, bit-exact to it; leading batch dims such as `[E, rows, ...]`.

    Blocks: the 0xFF check reads one flag back from the device (a sync on CUDA).
    """
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise _dtype_error(packed.dtype, scale.dtype)
    _check_pair(tuple(packed.shape), tuple(scale.shape))
    if bool((scale == E8M0_NAN).any()):
        raise _nan_scale_error()
    values_t, scales_t = _tables_on(packed.device)
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).long()  # [..., cols/2, 2]
    values = values_t[nibbles].reshape(*scale.shape, GROUP_ELEMS)
    return (values * scales_t[scale.long()][..., None]).reshape(*scale.shape[:-1], -1)


class MXFP4Codec(Codec):
    """Components `weight_packed` (U8 `[rows, cols/2]`), then `weight_scale` (U8 `[rows, cols/32]`).

    Takes no parameters: group size 32 and E2M1 values are fixed by the format.
    """

    name = "mxfp4"

    def components(self, shape: Shape2) -> list[ComponentSpec]:
        rows, cols = shape
        if cols % GROUP_ELEMS:
            raise FormatError(f"mxfp4: cols={cols} is not a multiple of {GROUP_ELEMS}")
        return [
            ComponentSpec("weight_packed", np.dtype(np.uint8), (rows, cols // 2), "U8"),
            ComponentSpec("weight_scale", np.dtype(np.uint8), (rows, cols // GROUP_ELEMS), "U8"),
        ]

    def encode(self, weight: np.ndarray) -> dict[str, np.ndarray]:
        packed, scale = encode_mxfp4(weight)
        return {"weight_packed": packed, "weight_scale": scale}

    def decode(self, parts: Mapping[str, np.ndarray], shape: Shape2) -> np.ndarray:
        self.check_parts(parts, shape)
        return decode_mxfp4(parts["weight_packed"], parts["weight_scale"])
