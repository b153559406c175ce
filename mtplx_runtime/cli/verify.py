"""`mtplx verify ARTIFACT [--records] [--shard-hashes]`: check an artifact against its manifest
(artifact.verify); each problem on its own line, then a summary; exit 1 when any is found.
`--records` also stores the XXH3 of every record that matched its SHA-256 for the read-time
checks (offload.digests), so later loads skip SHA-256 on those records."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..artifact.verify import verify_artifact
from ..offload.digests import RecordDigests, fast_hash
from .model_dir import add_model_dir


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_dir(parser, "artifact directory holding expert-manifest.json", dest="artifact")
    parser.add_argument("--records", action="store_true",
                        help="re-read every record and compare its SHA-256 (records that match "
                        "get their XXH3 stored for the read-time checks)")
    parser.add_argument("--shard-hashes", action="store_true",
                        help="hash every whole file (resident shards and bank parts)")


def main(args: argparse.Namespace) -> int:
    from ..artifact.manifest import MANIFEST_NAME

    root = Path(args.artifact)
    if not (root / MANIFEST_NAME).exists():
        # Not an artifact: say what it is and what to run instead of listing a missing file.
        if (root / "config.json").is_file():
            why = (f"a checkpoint (config.json, no {MANIFEST_NAME}): verify checks a streaming "
                   f"artifact against its manifest; `mtplx build-manifest {root} OUT` builds "
                   f"one, `mtplx inspect {root}` summarises the checkpoint")
        else:
            why = (f"not a streaming artifact (no {MANIFEST_NAME}): give the directory "
                   "`mtplx build-manifest` wrote")
        print(f"mtplx verify: error: {root} is {why}", file=sys.stderr)
        return 2
    rep = verify_artifact(args.artifact, records=args.records, shard_hashes=args.shard_hashes,
                          record_hash=fast_hash() if args.records else None)
    for line in rep.problems:
        print(line)
    if rep.record_hashes:
        digests = RecordDigests(args.artifact, rep.manifest)
        digests.learn(rep.record_hashes)
        digests.save()
        print(f"stored the XXH3 of {len(rep.record_hashes)} verified records for read-time "
              f"checks: {digests.path}")
    print(rep.summary())
    if not args.records:
        print("records were not re-hashed (sizes and layout only): `mtplx verify --records` "
              "reads every record and compares its SHA-256")
    return 0 if rep.ok else 1
