"""Expert codecs: how routed-expert bytes encode weights. `get_codec(name, **params)`.

Names: "t158" (MTPLX ternary), "mxfp4" (compressed-tensors mxfp4-pack-quantized), "bf16"
(unquantized passthrough), "ct-int" (compressed-tensors pack-quantized int; params num_bits,
layout "dense" | "legacy", symmetric), "q2k" (GGUF Q2_K, read-only: the source the published t158
artifact was converted from). The codec table (`modes.py`) lists them with their bank modes and
kernels. Byte layouts: FORMAT.md at the repository root.
"""

from __future__ import annotations

from .base import Codec, ComponentSpec, FormatError
from .modes import CODEC_NAMES, get_codec

__all__ = ["Codec", "ComponentSpec", "FormatError", "get_codec", "CODEC_NAMES"]
