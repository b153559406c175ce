"""`mtplx recode-w4 SRC DST`: recode a W3 compressed-tensors checkpoint to W4 losslessly
(checkpoint.recode_w4), in the layout stock vLLM loads."""

from __future__ import annotations

import argparse
import sys

from ..checkpoint.recode_w4 import recode_checkpoint
from ..checkpoint.safetensors_io import CheckpointError


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC", help="W3A16 g64 compressed-tensors checkpoint folder")
    parser.add_argument("dst", metavar="DST", help="new, empty folder for the W4 checkpoint")
    parser.add_argument("--layout", choices=("dense", "legacy"), default=None,
                        help="force the 3-bit layout when quantization_config.version contradicts "
                             "the packed widths (hand-made checkpoints only)")
    parser.add_argument("--no-progress", "--quiet", dest="quiet", action="store_true",
                        help="no per-shard progress on stderr (both spellings, as "
                             "build-manifest)")


def main(args: argparse.Namespace) -> int:
    try:
        r = recode_checkpoint(args.src, args.dst, progress=not args.quiet, layout=args.layout)
    except CheckpointError as e:
        print(f"mtplx recode-w4: error: {e}{_what_it_is(args.src)}", file=sys.stderr)
        return 2
    print(f"recode-w4: {r.shards} shards, {r.recoded} tensors recoded from the {r.layout} 3-bit "
          f"layout, {r.copied} copied; {r.bytes_in:,} -> {r.bytes_out:,} B", file=sys.stderr)
    return 0


def _what_it_is(src: str) -> str:
    """What `src` holds when it is no W3 checkpoint, and what to do, for the error line."""
    from ..artifact.open import is_artifact
    from ..checkpoint import open_checkpoint

    if is_artifact(src):
        return ("; it is a streaming artifact: recode-w4 reads the W3A16 checkpoint it was "
                "built from")
    try:
        with open_checkpoint(src) as ckpt:
            layout = ckpt.layout
            bits = getattr(ckpt.codec, "num_bits", None)
    except (CheckpointError, OSError):
        return ""  # the reader cannot say more than the error already does
    if layout == "w3" and bits != 3:
        return f"; its experts are already W{bits}: nothing to recode"
    return (f"; its routed experts are {layout}, not W3: recode-w4 recodes a W3A16 g64 "
            f"compressed-tensors checkpoint (for other codecs, `mtplx build-manifest` streams "
            f"them as they are)")
