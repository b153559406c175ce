"""Expert codecs: how routed-expert bytes encode weights. `get_codec(name, **params)`.

Names: "t158" (MTPLX ternary), "mxfp4" (compressed-tensors mxfp4-pack-quantized), "bf16"
(unquantized passthrough), "ct-int" (compressed-tensors pack-quantized int; params num_bits,
layout "dense" | "legacy", symmetric). Byte layouts: FORMAT.md at the repository root.
"""

from __future__ import annotations

from .base import Codec, ComponentSpec, FormatError

__all__ = ["Codec", "ComponentSpec", "FormatError", "get_codec", "CODEC_NAMES"]

CODEC_NAMES = ("t158", "mxfp4", "bf16", "ct-int")


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
    raise ValueError(f"unknown codec {name!r}; known: {', '.join(CODEC_NAMES)}")
