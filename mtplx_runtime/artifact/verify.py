"""Verify a streaming artifact directory against its manifest (FORMAT.md "Verifying and
reading") and the `mtplx verify ARTIFACT [--records] [--shard-hashes]` subcommand.

    expert-manifest.json --load (rules 1-14)--> descriptor (rules 15-20) --> index + safetensors
    headers (step 2) --> shard sizes/headers (step 3) --> [--records] record hashes (step 4)

Every problem is collected (not raised) and names the file and, for records, the layer/expert,
so one run lists everything that is wrong. `--shard-hashes` also covers the bank parts.
With `--records` the command also gives the read-time checks (offload/digests.py) the XXH3 of
every record whose SHA-256 matched, seeded with this user's secret as reads seed it
(offload/digests.py `fast_hash`, so both learn the same values); that hash lives in kernels/,
which artifact/ ranks below, so the caller passes it in (`record_hash`) and stores what comes
back (`record_hashes`).
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.config import load_json
from ..checkpoint.safetensors_io import CheckpointError, SafetensorsFile
from ..files import inside, open_regular, sha256_file
from .descriptor import K3_T158_DESCRIPTOR, Descriptor, descriptor_for, validate_descriptor
from .manifest import MANIFEST_NAME, Manifest, load_manifest

INDEX_NAME = "model.safetensors.index.json"
NON_TEXT_PREFIXES = ("vision_tower.", "mm_projector.")  # step 2: allowed unlisted residents


@dataclass
class VerifyReport:
    root: Path
    problems: list[str] = field(default_factory=list)
    shards_checked: int = 0
    records_checked: int = 0
    manifest: Manifest | None = None  # None when it did not load
    record_hashes: dict[int, int] = field(default_factory=dict)  # record index -> record_hash

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        state = "OK" if self.ok else f"{len(self.problems)} problem(s)"
        return (f"verify {self.root}: {state}; {self.shards_checked} shards, "
                f"{self.records_checked} records checked")


def _member(root: Path, name: str, rep: VerifyReport) -> Path | None:
    """`root/name` if it resolves under the root, or is a Hugging Face snapshot link into the
    sibling `blobs/` directory (`files.inside`); otherwise a problem and None."""
    p = root / name
    if inside(p, root):
        return p
    rep.problems.append(f"{name}: resolves to {os.path.realpath(p)}, outside the artifact root")
    return None


def _check_links(root: Path, rep: VerifyReport) -> None:
    """Every symlink among the root's entries (config, index, tokenizer files...) resolves
    inside the root: a member that leaves it is a problem even when nothing lists it."""
    for p in sorted(root.iterdir()):
        if p.is_symlink():
            _member(root, p.name, rep)


def _descriptor(m: Manifest, root: Path, rep: VerifyReport) -> Descriptor | None:
    if m.model_key == K3_T158_DESCRIPTOR.model_key:
        return K3_T158_DESCRIPTOR
    from ..checkpoint.reader import load_config

    try:
        cfg = load_config(root / "config.json", root=root)
        # An artifact built with --layers holds a subset of the routed layers, each complete.
        return descriptor_for(cfg, m.quantization["mode"], m.quantization["bits"],
                              model_key=m.model_key, layers={r.layer for r in m.records},
                              group_size=m.quantization["group_size"])
    except (CheckpointError, OSError) as e:
        rep.problems.append(f"config.json: cannot derive the record layout: {e}")
        return None


def _check_shards(m: Manifest, root: Path, rep: VerifyReport, hashes: bool) -> dict:
    """Step 3: sizes, re-read safetensors headers, optional whole-file hashes. Returns the
    parsed safetensors files' tensors {shard: {name: TensorInfo}}."""
    tensors = {}
    for s in m.shards:
        p = _member(root, s.name, rep)
        if p is None:
            continue
        rep.shards_checked += 1
        try:
            st = os.stat(p)
        except FileNotFoundError:
            rep.problems.append(f"{s.name}: missing")
            continue
        if not stat.S_ISREG(st.st_mode):
            rep.problems.append(f"{s.name}: not a regular file")
            continue
        if st.st_size != s.size:
            rep.problems.append(f"{s.name}: size {st.st_size}, manifest says {s.size}"
                                + (" (truncated)" if st.st_size < s.size else ""))
            continue
        if s.kind != "sidecar":
            try:  # never raises: a file swapped after the stat above is one more problem
                with SafetensorsFile(p, root=root) as f:
                    tensors[s.name] = f.tensors
                    # the header as parsed: hashed through the same descriptor
                    n = 8 + int.from_bytes(os.pread(f.fileno(), 8, 0), "little")
                    got = hashlib.sha256(os.pread(f.fileno(), n, 0)).hexdigest()
            except CheckpointError as e:
                rep.problems.append(f"{s.name}: bad safetensors header: {e}")
                continue
            if n != s.header_bytes or got != s.header_sha256:
                rep.problems.append(f"{s.name}: header changed (header_bytes {n} vs "
                                    f"{s.header_bytes}, header_sha256 {got} vs {s.header_sha256})")
        if hashes and s.sha256 is not None:
            try:
                if sha256_file(p, root=root, error=CheckpointError)[1] != s.sha256:
                    rep.problems.append(f"{s.name}: sha256 mismatch (whole file)")
            except CheckpointError as e:
                rep.problems.append(f"{s.name}: {e}")
    return tensors


def _check_index(m: Manifest, root: Path, rep: VerifyReport, tensors: dict,
                 desc: Descriptor | None) -> None:
    """Step 2: *.safetensors files == listed shards; index == headers; residents == index."""
    listed = {s.name for s in m.shards if s.kind != "sidecar"}
    present = {p.name for p in root.glob("*.safetensors")}
    for name in sorted(present - listed):
        rep.problems.append(f"{name}: *.safetensors file not listed in the manifest")
    for name in sorted(listed - present):
        if (root / name).exists():  # listed under a subdirectory: the glob does not see it
            continue
        rep.problems.append(f"{name}: listed safetensors shard is missing")
    if not (root / INDEX_NAME).exists() and not (root / INDEX_NAME).is_symlink():
        rep.problems.append(f"{INDEX_NAME}: missing")
        return
    try:  # a regular file, opened without blocking; bounded; deep nesting a CheckpointError
        index = load_json(root / INDEX_NAME, root=root)
    except CheckpointError as e:
        rep.problems.append(f"{INDEX_NAME}: unreadable: {e}")
        return
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict):
        rep.problems.append(f"{INDEX_NAME}: without a weight_map object")
        return
    held = {name: (shard, t) for shard, ts in tensors.items() for name, t in ts.items()}
    for name in sorted(held.keys() - wmap.keys()):
        rep.problems.append(f"{INDEX_NAME}: tensor {name!r} of {held[name][0]} is not indexed")
    for name, shard in sorted(wmap.items()):
        if name not in held or held[name][0] != shard:
            rep.problems.append(f"{INDEX_NAME}: {name!r} -> {shard!r}, but that shard does not "
                                "hold it")
    meta = index.get("metadata", {})
    if not isinstance(meta, dict):
        rep.problems.append(f"{INDEX_NAME}: metadata is not a JSON object")
        meta = {}
    total = meta.get("total_size")
    if total is not None and total != sum(t.nbytes for _, t in held.values()):
        rep.problems.append(f"{INDEX_NAME}: metadata.total_size {total} != summed tensor "
                            f"lengths {sum(t.nbytes for _, t in held.values())}")
    prefix = desc.resident_prefix if desc is not None else ""
    indexed = {n: v for n, v in held.items() if n in wmap and n.startswith(prefix)}
    listed_res = {t.tensor: t for t in m.resident_tensors}
    for name in sorted(indexed.keys() ^ listed_res.keys()):
        where = "indexed but not a manifest resident" if name in indexed else "not indexed"
        rep.problems.append(f"resident tensor {name!r}: {where}")
    for name in sorted(indexed.keys() & listed_res.keys()):
        (shard, t), r = indexed[name], listed_res[name]
        if (shard, t.start, t.nbytes, t.dtype, t.shape) != (r.shard, r.offset, r.length,
                                                            r.dtype, r.shape):
            rep.problems.append(f"resident tensor {name!r}: manifest says {r.shard}@{r.offset} "
                                f"{r.dtype}{list(r.shape)}, file has {shard}@{t.start} "
                                f"{t.dtype}{list(t.shape)}")
    for name in sorted(n for n in wmap if not n.startswith(prefix)):
        if not name.startswith(NON_TEXT_PREFIXES):
            rep.problems.append(f"{INDEX_NAME}: {name!r} is neither a resident nor a "
                                "vision_tower./mm_projector. tensor")


def _check_records(m: Manifest, root: Path, rep: VerifyReport,
                   record_hash: Callable[[bytes], int] | None) -> None:
    """Step 4: re-read every record (segment by segment) and compare its SHA-256; a record that
    matches gets `record_hash` of its bytes in rep.record_hashes."""
    fds: dict[str, int | None] = {}
    try:
        for i, r in enumerate(m.records):
            part = r.segments[0].shard
            if r.sha256 is None:
                rep.problems.append(f"{part}: record layer {r.layer} expert {r.expert} has no "
                                    "sha256 to check")
                continue
            h, bad, chunks = hashlib.sha256(), None, []
            for s in r.segments:
                if s.shard not in fds:
                    p = _member(root, s.shard, rep)
                    try:  # never blocks: a FIFO or device in a part's place is refused
                        fds[s.shard] = None if p is None else open_regular(
                            p, root=root, error=CheckpointError, what="bank part")
                    except CheckpointError as e:
                        fds[s.shard] = None
                        rep.problems.append(f"{s.shard}: cannot read records: {e}")
                fd = fds[s.shard]
                data = b"" if fd is None else os.pread(fd, s.length, s.offset)
                if len(data) != s.length:
                    bad = f"unreadable or truncated ({s.component} at {s.offset})"
                    break
                h.update(data)
                chunks.append(data)
            rep.records_checked += 1
            if bad is None and h.hexdigest() != r.sha256:
                start = r.segments[0].offset
                bad = f"sha256 mismatch (bytes [{start}, {start + r.logical_bytes}))"
            if bad is not None:
                rep.problems.append(f"{part}: record layer {r.layer} expert {r.expert}: {bad}")
            elif record_hash is not None:  # the record's bytes as the reader sees them, in order
                rep.record_hashes[i] = record_hash(chunks[0] if len(chunks) == 1
                                                   else b"".join(chunks))
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)


def verify_artifact(root: str | os.PathLike, *, records: bool = False,
                    shard_hashes: bool = False,
                    record_hash: Callable[[bytes], int] | None = None) -> VerifyReport:
    """Check the directory `root` against its `expert-manifest.json`. Never raises for a
    bad artifact: every problem is a line in the report. Blocks on file reads (whole files with
    `shard_hashes`, every record with `records`). `record_hash` (with `records`): a function of
    a record's bytes, applied to every record whose SHA-256 matches (report.record_hashes); for
    the read-time checks, offload/digests.py `fast_hash` (the seeded XXH3 they learn)."""
    root = Path(root)
    rep = VerifyReport(root)
    try:
        m = load_manifest(root / MANIFEST_NAME)
    except CheckpointError as e:
        rep.problems.append(str(e))
        return rep
    rep.manifest = m
    _check_links(root, rep)
    desc = None
    if m.authoritative:
        desc = _descriptor(m, root, rep)
        if desc is not None:
            try:
                validate_descriptor(m, desc)
            except CheckpointError as e:
                rep.problems.append(f"{MANIFEST_NAME}: {e}")
    tensors = _check_shards(m, root, rep, shard_hashes)
    if m.authoritative:
        _check_index(m, root, rep, tensors, desc)
    if records:
        _check_records(m, root, rep, record_hash)
    return rep
