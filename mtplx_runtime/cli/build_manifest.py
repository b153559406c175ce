"""`mtplx build-manifest SRC OUT`: build (or resume) a streaming artifact from a checkpoint.

Rerunning the same command after a crash, a full disk or Ctrl-C continues where the journal
ends; asking a finished OUT for more layers extends it (FORMAT.md "Build journal, resume and
publication").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..formats.resident_layouts import RESIDENT_DTYPES
from .model_dir import add_model_dir

BANK_CODECS = ("keep", "t158")


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_dir(parser, "source checkpoint directory (safetensors or GGUF Q2_K)", dest="src",
                  path=True)
    parser.add_argument("out", type=Path, metavar="OUT", help="artifact directory (created)")
    parser.add_argument("--bank-codec", "--codec", dest="bank_codec", choices=BANK_CODECS,
                        default="keep",
                        help="expert codec of the bank to write: keep the source's (default), or "
                             "re-encode to t158; a GGUF Q2_K source always becomes t158 "
                             "(--codec: the older spelling)")
    parser.add_argument("--layers", default=None, metavar="SPEC",
                        help="MoE layers to build, e.g. 1-5,7 (default: all); more layers than "
                             "a finished OUT holds extend it")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="layers built in parallel; memory holds at most N records (default 1)")
    parser.add_argument("--resident-dtype", default="bf16", choices=RESIDENT_DTYPES,
                        help="resident matrices (attention, shared experts, latent projections, "
                             "lm_head) as stored (bf16, default) or quantized into the artifact: "
                             "int8 per channel, int4 in groups of 32, fp8 (e4m3) per channel; "
                             "loading it reads them as they are, no quantization pass")
    parser.add_argument("--no-progress", "--quiet", dest="no_progress", action="store_true",
                        help="no progress on stderr (default: a bar on a terminal, else a line "
                             "every 5 s)")


def main(args: argparse.Namespace) -> int:
    from ..artifact.build import build_artifact
    from ..artifact.journal import BuildError
    from ..artifact.open import is_artifact

    if is_artifact(args.src):
        print(f"mtplx build-manifest: error: {args.src} is a streaming artifact already "
              f"(expert-manifest.json), and build-manifest reads a checkpoint: run it with "
              f"`mtplx generate {args.src}`, check it with `mtplx verify {args.src}`",
              file=sys.stderr)
        return 2
    try:
        r = build_artifact(args.src, args.out, codec=args.bank_codec, layers=args.layers,
                           jobs=args.jobs, progress=not args.no_progress,
                           resident_dtype=args.resident_dtype)
    except BuildError as e:
        print(f"mtplx build-manifest: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mtplx build-manifest: interrupted; every finished record is kept: rerun the same "
              "command to resume", file=sys.stderr)
        return 130
    note = f" ({', '.join(r.notes)})" if r.notes else ""
    residents = "" if args.resident_dtype == "bf16" else f", {args.resident_dtype} residents"
    print(f"build-manifest: {r.mode}{residents} {len(r.parts)} parts, {r.records} records "
          f"({r.written} written, {r.resumed} resumed, {r.adopted} parts adopted) -> {r.out} "
          f"manifest {r.manifest_sha256[:12]} in {r.seconds:.1f}s{note}")
    return 0
