"""bf16: unquantized passthrough codec, one bf16 per weight (FORMAT.md "bf16").

One component `weight`, safetensors "BF16" `[rows, cols]`, carried in numpy as the uint16 bit
pattern (little-endian on disk). Encoding rounds float32 to nearest-even on the bits; decoding is
exact (`u16 << 16`). Used for experts kept at full precision and as a control in tests.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .base import Codec, ComponentSpec, FormatError, Shape2, bf16_bits_to_f32, f32_to_bf16_bits


class BF16Codec(Codec):
    """Component `weight` (BF16 bits as uint16 `[rows, cols]`)."""

    name = "bf16"

    def components(self, shape: Shape2) -> list[ComponentSpec]:
        return [ComponentSpec("weight", np.dtype(np.uint16), tuple(shape), "BF16")]

    def encode(self, weight: np.ndarray) -> dict[str, np.ndarray]:
        """float32 `[rows, cols]` -> {"weight": uint16 bits}. Rejects NaN/Inf and bf16 overflow."""
        w = np.asarray(weight, dtype=np.float32)
        if w.ndim != 2:
            raise FormatError(f"bf16: weight must be 2-D [rows, cols], got shape {list(w.shape)}")
        if not np.isfinite(w).all():
            raise FormatError("bf16: weight has NaN or Inf values; the encoder needs finite inputs")
        bits = f32_to_bf16_bits(w)
        # Finite float32 values within half a bf16 ulp of the float32 maximum round up to Inf.
        if ((bits & 0x7F80) == 0x7F80).any():
            raise FormatError("bf16: a weight rounds to Inf in bf16 (|w| >= 2**128 * (1 - 2**-9))")
        return {"weight": bits}

    def decode(self, parts: Mapping[str, np.ndarray], shape: Shape2) -> np.ndarray:
        self.check_parts(parts, shape)
        return bf16_bits_to_f32(parts["weight"])
