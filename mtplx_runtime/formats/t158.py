"""t158: MTPLX ternary codec, 64 weights -> 13 bytes of trits + one bf16 scale (FORMAT.md "t158").

Byte layout: groups are 64 consecutive input columns of one row.
`packed` is U8 `[rows, 13 * cols/64]`; byte j of a group holds slots 5j..5j+4 as little-endian
base 3 (`b = Σ slot[5j+k] * 3^k`), slot i = trit_i + 1 for i < 64 and slot 64 is padding (0).
`scales` is U16 `[rows, cols/64]`, the bf16 bit pattern of the group scale. A weight decodes to
`(code - 1) * fp32(scale)`. Leading batch dims (e.g. experts `[E, rows, ...]`) decode the same.

The encoder is bit-exact to the MTPLX numpy reference `encode_t158`, including numpy's float32
summation order (FORMAT.md "t158", encode step 1), so re-encoding a source gives the same
bytes as the published artifact.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache

import numpy as np
import torch

from .base import (
    Codec,
    ComponentSpec,
    FormatError,
    Shape2,
    bf16_bits_to_f32,
    check_weight,
    f32_to_bf16_bits,
)

GROUP_ELEMS = 64
GROUP_BYTES = 13  # 65 slots (64 trits + 1 padding) at 5 trits per byte
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
_TAU_RATIO = np.float32(0.7)  # the reference rounds the literal to float32 before multiplying

# Trit value (code - 1) of digit k of byte b, for all 256 bytes: floor(b / 3^k) mod 3 - 1.
# Bytes 243..255 are never written but decode by the same formula (FORMAT.md "t158"), so
# decoding random bytes is deterministic.
_TRITS = ((np.arange(256)[:, None] // (3 ** np.arange(5))) % 3 - 1).astype(np.float32)  # [256, 5]


def group_sum_f32(x: np.ndarray) -> np.ndarray:
    """float32 `[N, 64]` -> `[N]`: numpy's pairwise sum of 64 contiguous float32 values.

    Spelled out instead of calling np.sum so the bytes do not depend on the numpy build: eight
    accumulators r_j = x_j + x_{j+8} + ... + x_{j+56} (left to right), then
    ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), each addition rounded to float32. numpy
    adds that to its identity +0, which only turns a -0 total into +0 (never the case for |w|).
    """
    v = np.asarray(x, dtype=np.float32).reshape(-1, 8, 8)  # [N, k, j] = x[:, 8k + j]
    r = v[:, 0, :].copy()
    for k in range(1, 8):
        r += v[:, k, :]
    left = (r[:, 0] + r[:, 1]) + (r[:, 2] + r[:, 3])
    right = (r[:, 4] + r[:, 5]) + (r[:, 6] + r[:, 7])
    return np.float32(0) + (left + right)


def encode_t158(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 `[rows, cols]` -> (packed uint8 `[rows, 13G]`, scales uint16 `[rows, G]`).

    G = cols / 64. Other float dtypes are converted to float32 first. Raises FormatError if
    cols % 64 != 0, if any input is NaN/Inf, or if a group's scale is not finite in bf16 (|w| sums
    overflow float32).
    """
    w = check_weight("t158", weight, GROUP_ELEMS)
    rows, cols = w.shape

    g = w.reshape(-1, GROUP_ELEMS)  # [N, 64], N = rows * G
    a = np.abs(g)
    # Sums that overflow give Inf scales, rejected below; the n == 0 lanes of the division are
    # discarded by the final where.
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        m = group_sum_f32(a) / np.float32(GROUP_ELEMS)  # exact division by a power of two
        tau = (_TAU_RATIO * m)[:, None]
        # |w| <= tau (ties included) is a zero trit.
        codes = np.ones(g.shape, dtype=np.uint8)
        codes[g > tau] = 2
        codes[g < -tau] = 0

        nonzero = codes != 1
        n = nonzero.sum(axis=1)
        kept = group_sum_f32(np.where(nonzero, a, np.float32(0)))  # zeros in place: same order
        s = np.where(n > 0, (kept.astype(np.float64) / n).astype(np.float32), m)
    scales = f32_to_bf16_bits(s)  # float64 -> float32 -> bf16: the reference's double rounding
    if ((scales & 0x7F80) == 0x7F80).any():
        raise FormatError("t158: a group scale overflows bf16 (|w| too large for the codec)")

    slots = np.zeros((g.shape[0], GROUP_BYTES * 5), dtype=np.uint8)  # slot 64 stays 0: padding
    slots[:, :GROUP_ELEMS] = codes
    packed = (slots.reshape(-1, GROUP_BYTES, 5) * _POW3).sum(axis=-1, dtype=np.uint8)
    return packed.reshape(rows, -1), scales.reshape(rows, -1)


def _check_pair(packed_shape: tuple, scales_shape: tuple) -> None:
    if (
        not packed_shape
        or not scales_shape
        or packed_shape[:-1] != scales_shape[:-1]
        or packed_shape[-1] != GROUP_BYTES * scales_shape[-1]
    ):
        raise FormatError(
            f"t158: packed {list(packed_shape)} does not match scales {list(scales_shape)}; "
            f"expected packed [..., 13 * G] for scales [..., G]"
        )


def _dtype_error(packed_dtype, scales_dtype) -> FormatError:
    return FormatError(
        f"t158: expected uint8 packed and uint16 scales (int16 also for torch), got "
        f"{packed_dtype} and {scales_dtype}"
    )


def decode_t158(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """packed uint8 `[..., 13G]` + scales uint16 `[..., G]` -> float32 `[..., 64G]`. Exact."""
    if packed.dtype != np.uint8 or scales.dtype != np.uint16:
        raise _dtype_error(packed.dtype, scales.dtype)
    _check_pair(packed.shape, scales.shape)
    trits = _TRITS[packed].reshape(*scales.shape, GROUP_BYTES * 5)[..., :GROUP_ELEMS]
    with np.errstate(invalid="ignore"):  # 0 * Inf = NaN is the defined result for such scales
        out = trits * bf16_bits_to_f32(scales)[..., None]  # [..., G, 64]; byte 12 digit 4 dropped
    return out.reshape(*scales.shape[:-1], -1)


def _group_sum_torch(x: torch.Tensor) -> torch.Tensor:
    """float32 `[N, 64]` -> `[N]` in `group_sum_f32`'s order (the encoder's bytes depend on it)."""
    v = x.reshape(-1, 8, 8)  # [N, k, j] = x[:, 8k + j]
    r = v[:, 0, :]
    for k in range(1, 8):
        r = r + v[:, k, :]
    left = (r[:, 0] + r[:, 1]) + (r[:, 2] + r[:, 3])
    right = (r[:, 4] + r[:, 5]) + (r[:, 6] + r[:, 7])
    return left + right


def ternarize_t158_torch(weight: torch.Tensor) -> torch.Tensor:
    """The weights t158 stores for `weight`, as float32: `decode_t158(*encode_t158(w))`, bit for
    bit, computed in torch on weight's device (the encoder's threshold, kept-mean scale and
    double rounding to bf16; FORMAT.md "t158", encode).

    weight: float `[..., cols]`, cols % 64 == 0, finite (not checked: a training step calls
    this). No gradient is defined; quantization-aware training wraps it in a straight-through
    estimator (tools/train_tiny.py).
    """
    g = weight.detach().float().reshape(-1, GROUP_ELEMS)  # [N, 64]
    a = g.abs()
    m = _group_sum_torch(a) / GROUP_ELEMS  # [N]
    tau = (torch.tensor(float(_TAU_RATIO), dtype=torch.float32, device=g.device) * m)[:, None]
    trits = (g > tau).float() - (g < -tau).float()  # [N, 64]; ties are zero
    n = (trits != 0).sum(1)  # [N]
    kept = _group_sum_torch(torch.where(trits != 0, a, torch.zeros_like(a)))
    s = torch.where(n > 0, (kept.double() / n.clamp(min=1).double()).float(), m)
    s = s.to(torch.bfloat16).float()  # round to nearest even, as f32_to_bf16_bits
    return (trits * s[:, None]).reshape(weight.shape)


@cache
def _trits_on(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_TRITS).to(device)


def decode_t158_torch(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Torch twin of `decode_t158`, bit-exact to it: uint8 `[..., 13G]` + `[..., G]` -> float32.

    `scales` holds bf16 bit patterns as uint16 or int16 (safetensors "U16" / a reinterpreting
    view). Runs on packed's device, never synchronises; a `[256, 5]` trit table gather.
    """
    if packed.dtype != torch.uint8 or scales.dtype not in (torch.uint16, torch.int16):
        raise _dtype_error(packed.dtype, scales.dtype)
    _check_pair(tuple(packed.shape), tuple(scales.shape))
    trits = _trits_on(packed.device)[packed.long()]  # [..., 13G, 5]
    trits = trits.reshape(*scales.shape, GROUP_BYTES * 5)[..., :GROUP_ELEMS]
    # Shifting left by 16 drops the int16 sign extension, leaving exactly the fp32 bits u16 << 16.
    s = (scales.view(torch.int16).to(torch.int32) << 16).view(torch.float32)
    return (trits * s[..., None]).reshape(*scales.shape[:-1], -1)


class T158Codec(Codec):
    """Components `packed` (U8 `[rows, 13G]`) then `scales` (U16 `[rows, G]`), G = cols / 64."""

    name = "t158"

    def components(self, shape: Shape2) -> list[ComponentSpec]:
        rows, cols = shape
        if cols % GROUP_ELEMS:
            raise FormatError(f"t158: cols={cols} is not a multiple of {GROUP_ELEMS}")
        groups = cols // GROUP_ELEMS
        return [
            ComponentSpec("packed", np.dtype(np.uint8), (rows, GROUP_BYTES * groups), "U8"),
            ComponentSpec("scales", np.dtype(np.uint16), (rows, groups), "U16"),
        ]

    def encode(self, weight: np.ndarray) -> dict[str, np.ndarray]:
        packed, scales = encode_t158(weight)
        return {"packed": packed, "scales": scales}

    def decode(self, parts: Mapping[str, np.ndarray], shape: Shape2) -> np.ndarray:
        self.check_parts(parts, shape)
        return decode_t158(parts["packed"], parts["scales"])
