"""Expert codecs: how routed-expert bytes encode weights. `get_codec(name, **params)`.

Names: "t158" (MTPLX ternary), "mxfp4" (compressed-tensors mxfp4-pack-quantized), "bf16"
(unquantized passthrough), "ct-int" (compressed-tensors pack-quantized int; params num_bits,
layout "dense" | "legacy", symmetric), "q2k" (GGUF Q2_K, read-only: the source the published t158
artifact was converted from). Byte layouts: FORMAT.md at the repository root.
"""

from __future__ import annotations

from .base import Codec, ComponentSpec, FormatError

__all__ = ["Codec", "ComponentSpec", "FormatError", "get_codec", "CODEC_NAMES"]

CODEC_NAMES = ("t158", "mxfp4", "bf16", "ct-int", "q2k")


def get_codec(name: str, **params) -> Codec:
    """Return a codec instance. Imports lazily so one codec's dependencies never burden another."""
    if name == "t158":
        from .t158 import T158Codec

        return T158Codec(**params)
    if name == "mxfp4":
        from .mxfp4 import MXFP4Codec

        return MXFP4Codec(**params)
    if name == "bf16":
        from .bf16 import BF16Codec

        return BF16Codec(**params)
    if name == "ct-int":
        from .ctint import CtIntCodec

        return CtIntCodec(**params)
    if name == "q2k":
        from .q2k import Q2KCodec

        return Q2KCodec(**params)
    raise ValueError(f"unknown codec {name!r}; known: {', '.join(CODEC_NAMES)}")
