"""Exact, lossless W3 -> W4 recode of compressed-tensors pack-quantized tensors. FORMAT.md,
"W4 recode".

  3-bit words (dense | legacy) -> u3 in [0, 7] -> u4 = u3 + 4 (= q + 8, in 4..11) -> 4-bit words

The 4-bit packing (8 codes per word, code 8k+j at bits 4j) is the same in every ct version, so
the result is a standard W4A16 tensor (vLLM `uint4b8`, or `uint4` with zero points). Scales,
`weight_shape` and `weight_g_idx` are unchanged; q - zp is unchanged because both shift by 4.
"""

from __future__ import annotations

import numpy as np

from .ctint import code_offset, pack_codes, unpack_codes

# u4 = q + 8 = (u3 - 4) + 8
_SHIFT = code_offset(4) - code_offset(3)


def recode_packed_w3_to_w4(words: np.ndarray, cols: int, layout: str) -> np.ndarray:
    """3-bit `weight_packed` int32 [rows, W3] in `layout` -> 4-bit int32 [rows, ceil(cols/8)].

    `cols` comes from `weight_shape`; the 3-bit width must match it (FormatError otherwise).
    """
    u3 = unpack_codes(words, 3, layout, cols)  # [rows, cols] uint8
    return pack_codes(u3 + np.uint8(_SHIFT), 4)


def recode_zero_point_w3_to_w4(words: np.ndarray, rows: int, layout: str) -> np.ndarray:
    """3-bit `weight_zero_point` int32 [W3(rows), G], packed along dim 0 -> 4-bit int32
    [ceil(rows/8), G], also packed along dim 0."""
    u3 = unpack_codes(np.asarray(words).T, 3, layout, rows)  # [G, rows]
    return np.ascontiguousarray(pack_codes(u3 + np.uint8(_SHIFT), 4).T)
