"""`mtplx make-tiny OUT --layout ... [--seed N] [--w3-layout ...] [--w3-asymmetric]`: write a tiny
deterministic K3 checkpoint (fixtures.tiny) in that expert layout (its codec's published on-disk
layout)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from ..fixtures.tiny import make_tiny
from ..fixtures.tiny_weights import CODECS, W3_LAYOUTS


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, metavar="OUT",
                        help="output directory (created if missing)")
    parser.add_argument("--layout", "--codec", dest="layout", required=True, choices=CODECS,
                        help="routed-expert layout of the checkpoint to write, as `mtplx "
                             "inspect` names it (its codec's published on-disk layout; --codec: "
                             "the older spelling)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--w3-layout", choices=W3_LAYOUTS, default=None,
                        help="3-bit packing for --layout w3 (default legacy, as vellum ships)")
    parser.add_argument("--w3-asymmetric", action="store_true",
                        help="--layout w3 with zero points (weight_zero_point tensors)")
    parser.add_argument("--force", action="store_true",
                        help="replace what OUT holds (default: refuse a non-empty OUT)")


def main(args: argparse.Namespace) -> int:
    if args.layout != "w3" and (args.w3_layout is not None or args.w3_asymmetric):
        print("make-tiny: --w3-layout and --w3-asymmetric apply only to --layout w3",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not args.force:
            print(f"make-tiny: {out} exists and is not an empty directory; pass --force to "
                  "replace it", file=sys.stderr)
            return 2
        # A stale file of another codec must not survive beside the new checkpoint.
        if out.is_dir() and not out.is_symlink():
            shutil.rmtree(out)
        else:
            out.unlink()
    info = make_tiny(args.out, args.layout, seed=args.seed, w3_layout=args.w3_layout or "legacy",
                     w3_symmetric=not args.w3_asymmetric)
    cfg = info.config
    print(f"make-tiny: {info.codec} seed={info.seed} -> {info.path} "
          f"({cfg.num_hidden_layers} layers, {cfg.num_experts} experts, vocab {cfg.vocab_size})")
    return 0
