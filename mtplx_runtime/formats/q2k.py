"""q2k: GGML Q2_K, the routed-expert codec of the K3 GGUF source. Read only.

Byte layout (FORMAT.md "q2k"). Values are
cut into blocks of 256 in flat row-major order (a row of `cols` holds `cols / 256` blocks), each
block 84 bytes:

    bytes  0..15  sc[16]: one byte per 16-value sub-block, low nibble scale code, high nibble
                  min code
    bytes 16..79  qs[64]: 2-bit codes
    bytes 80..81  d, IEEE fp16 (little-endian)
    bytes 82..83  dmin, IEEE fp16

Value v (0..255): s = v // 16, h = v // 128, shift = 2 * ((v % 128) // 32), l = v % 32,
q = (qs[32h + l] >> shift) & 3, and

    value = fl32(fl32(d * (sc[s] & 0xF)) * q) - fl32(dmin * (sc[s] >> 4))

in float32 with d and dmin widened exactly from fp16. Both products are exact in float32 (11
significand bits times a 4-bit then a 2-bit integer), so the subtraction is the only rounding and
a fused multiply-add could not change the result; the reference still computes the terms
separately, as the spec writes it. Non-finite d/dmin decode to Inf/NaN; callers that need finite
weights (the t158 converter) check.

One component `weight`, U8 `[rows, cols / 256 * 84]`: one expert projection's bytes exactly as
the merged GGUF tensor stores them. There is no encoder: Q2_K is only ever a source.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .base import Codec, ComponentSpec, FormatError, Shape2

BLOCK_ELEMS = 256
BLOCK_BYTES = 84
_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def q2k_row_bytes(cols: int) -> int:
    """Bytes of one Q2_K row of `cols` values; FormatError unless cols is a multiple of 256."""
    if cols <= 0 or cols % BLOCK_ELEMS:
        raise FormatError(f"q2k: cols={cols} is not a positive multiple of {BLOCK_ELEMS}")
    return cols // BLOCK_ELEMS * BLOCK_BYTES


def dequantize_q2k(data: np.ndarray | bytes) -> np.ndarray:
    """Q2_K bytes (any shape, a whole number of 84-byte blocks) -> flat float32 values."""
    raw = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray,
                                                                   memoryview)) else data
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size % BLOCK_BYTES:
        raise FormatError(f"q2k: {raw.size} bytes is not a whole number of {BLOCK_BYTES}-byte "
                          f"blocks")
    blocks = raw.reshape(-1, BLOCK_BYTES)
    n = blocks.shape[0]
    sc = blocks[:, :16]
    d = blocks[:, 80:82].copy().view("<f2").astype(np.float32)  # [n, 1], exact widening
    dmin = blocks[:, 82:84].copy().view("<f2").astype(np.float32)
    dl = d * (sc & 0xF).astype(np.float32)  # [n, 16], exact
    ml = dmin * (sc >> 4).astype(np.float32)  # [n, 16], exact
    # qs[32h + l] >> 2j holds value 128h + 32j + l: [n, h, j, l] flattens to v, then [n, s, 16].
    q = (blocks[:, 16:80].reshape(n, 2, 1, 32) >> _SHIFTS) & np.uint8(3)
    q = q.reshape(n, 16, 16).astype(np.float32)
    vals = dl[:, :, None] * q  # exact
    vals -= ml[:, :, None]  # the one rounding step
    return vals.reshape(-1)


class Q2KCodec(Codec):
    """Component `weight` (U8 `[rows, cols/256*84]`, the GGUF bytes of one projection)."""

    name = "q2k"

    def components(self, shape: Shape2) -> list[ComponentSpec]:
        rows, cols = shape
        if rows <= 0:
            raise FormatError(f"q2k: rows={rows} must be positive")
        return [ComponentSpec("weight", np.dtype(np.uint8), (rows, q2k_row_bytes(cols)), "U8")]

    def encode(self, weight: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError(
            "q2k: Q2_K is a read-only source codec (the K3 GGUF experts); there is no encoder. "
            "Convert to t158 or another codec instead."
        )

    def decode(self, parts: Mapping[str, np.ndarray], shape: Shape2) -> np.ndarray:
        self.check_parts(parts, shape)
        return dequantize_q2k(parts["weight"]).reshape(shape)
