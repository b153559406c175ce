"""`mtplx recode-w4 SRC DST`: recode a W3 compressed-tensors checkpoint to W4 losslessly
(checkpoint.recode_w4), in the layout stock vLLM loads."""

from __future__ import annotations

import argparse
import sys

from ..checkpoint.recode_w4 import recode_checkpoint


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
    r = recode_checkpoint(args.src, args.dst, progress=not args.quiet, layout=args.layout)
    print(f"recode-w4: {r.shards} shards, {r.recoded} tensors recoded from the {r.layout} 3-bit "
          f"layout, {r.copied} copied; {r.bytes_in:,} -> {r.bytes_out:,} B", file=sys.stderr)
    return 0
