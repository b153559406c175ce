"""Everything a build writes besides bank parts: resident shards, copied metadata files, the
index, `build-receipt.json` and the manifest object (FORMAT.md "Build journal, resume and
publication").

Every file is installed through `<name>.partial` + fsync + hard link (never overwriting) +
unlink + directory fsync; when the final file already exists (a resumed build), its bytes MUST
equal what this build would write, else the build stops.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint.residents import resident_tensor_specs, unused_tensor
from ..files import HASH_CHUNK, fsync_dir, read_regular, sha256_file
from ..formats.modes import quantization_for
from ..formats.record import ALIGNMENT
from ..formats.resident_layouts import stored_tensors
from ..formats.resident_quant import encode_stored
from . import part as _part
from .journal import BuildError
from .manifest import (
    DTYPE_BYTES,
    FORMAT,
    Manifest,
    Record,
    ResidentTensor,
    Segment,
    Shard,
    Sidecar,
    SidecarPart,
)
from .manifest import (
    MANIFEST_NAME as MANIFEST,
)
from .part import disk_errors

RECEIPT = "build-receipt.json"
# Held (flock) by the running build for its whole run and removed when it ends; a killed build
# leaves it behind, harmless: the next build takes it over (FORMAT.md "Build journal").
LOCK = ".build.lock"
INDEX = "model.safetensors.index.json"
RECEIPT_FORMAT = "mtplx-build-receipt-v1"
RESIDENT_SHARD_BYTES = 4 << 30  # resident shards are cut at ~4 GiB (a bigger tensor stands alone)
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
METADATA_MAX_BYTES = 256 << 20  # the largest metadata file a build copies (a tokenizer file)
# Routed-expert tensor names of every source layout (checkpoint/layouts.py); never residents.
_EXPERT = re.compile(r"(?:language_model\.)?model\.layers\.\d+\.(?:mlp|block_sparse_moe)\."
                     r"(?:switch_mlp\.|experts\.\d+\.)")
_NOT_METADATA = {INDEX, "fixture.json", MANIFEST, RECEIPT}


def file_identity(path: Path) -> dict:
    st = os.stat(path)
    return {"name": path.name, "device": st.st_dev, "inode": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def install_chunks(path: Path, chunks) -> tuple[int, str]:
    """Install `path` from an iterable of byte chunks; returns (size, sha256). If `path`
    exists it is kept only when byte-identical to the chunks."""
    h, size = hashlib.sha256(), 0
    partial = path.with_name(path.name + ".partial")
    if path.exists():
        for c in chunks:
            h.update(c)
            size += len(c)
        if sha256_file(path) != (size, h.hexdigest()):
            raise BuildError(f"{path}: exists with different content than this build writes; "
                             f"use a fresh output directory")
        if partial.exists():  # killed between link and unlink: the partial is a spare link
            os.unlink(partial)
            fsync_dir(path.parent)
        return size, h.hexdigest()
    doing = f"writing {path.name}"
    try:
        with disk_errors(partial, doing):
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            for c in chunks:  # the chunks may read the source: not inside disk_errors
                with disk_errors(partial, doing):
                    _part.write_all(fd, c)  # late-bound: tests inject ENOSPC here
                h.update(c)
                size += len(c)
            with disk_errors(partial, doing):
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        # Not journaled: a rerun writes it again from the start, so give the space back now.
        try:
            os.unlink(partial)
        except OSError:
            pass
        raise
    with disk_errors(path, f"publishing {path.name} (hard link from the partial)"):
        os.link(partial, path)
        os.unlink(partial)
        fsync_dir(path.parent)
    return size, h.hexdigest()


def install_bytes(path: Path, data: bytes) -> tuple[int, str]:
    return install_chunks(path, [data])


@dataclass
class Residents:
    shards: list[Shard]
    tensors: list[ResidentTensor]


def resident_names(ckpt) -> list[str]:
    """The source's non-expert tensors, without those its model never runs (the DeepSeek-V3
    family's MTP modules)."""
    return sorted(n for n in ckpt.tensor_names()
                  if not _EXPERT.match(n) and not unused_tensor(ckpt.config, n))


def _stored_residents(ckpt, resident_dtype: str) -> list[tuple[str, str, tuple, str]]:
    """(stored name, dtype, shape, source tensor) of every resident the artifact holds, sorted
    by stored name: each source tensor as is, or with `resident_dtype` int8/int4 each quantizable
    text matrix as its stated tensors (FORMAT.md "Quantized residents")."""
    table = resident_tensor_specs(ckpt.config) if resident_dtype != "bf16" else {}
    out = []
    for name in resident_names(ckpt):
        info = ckpt.tensor_info(name)
        stored = (stored_tensors(name, tuple(info.shape), info.dtype, resident_dtype)
                  if name in table else {name: (info.dtype, tuple(info.shape))})
        out += [(n, dtype, shape, name) for n, (dtype, shape) in stored.items()]
    return sorted(out)


def copy_residents(ckpt, out: Path, resident_dtype: str = "bf16") -> Residents:
    """Every non-expert tensor into `resident-NNNNN-of-MMMMM.safetensors` shards (names sorted,
    header compact JSON space-padded to 8, data back to back): byte for byte, or with
    `resident_dtype` int8/int4 each quantizable text matrix replaced by its stated tensors,
    encoded one matrix at a time (`formats.resident_quant.encode_stored`)."""
    stored = _stored_residents(ckpt, resident_dtype)
    groups: list[list[tuple]] = []
    size = 0
    for t in stored:
        n = math.prod(t[2]) * DTYPE_BYTES[t[1]]
        if not groups or (size + n > RESIDENT_SHARD_BYTES and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    encoded: dict[str, dict[str, np.ndarray]] = {}  # source -> its stored tensors not yet written

    def data(name: str, dtype: str, shape: tuple, src: str) -> memoryview:
        """The stored tensor's bytes, viewed, not copied (an lm_head is GBs)."""
        if name == src and dtype == ckpt.tensor_info(src).dtype:  # kept as stored
            arr = ckpt.tensor(src)
        else:
            if src not in encoded:
                encoded[src] = encode_stored(src, ckpt.tensor(src), resident_dtype)
            arr = encoded[src].pop(name)
            if not encoded[src]:
                del encoded[src]
            if arr.shape != shape:
                raise BuildError(f"{src}: encoded {name!r} as {list(arr.shape)}, the layout says "
                                 f"{list(shape)}")
        raw = memoryview(np.ascontiguousarray(arr)).cast("B")
        if len(raw) != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise BuildError(f"{ckpt.path}: tensor {name!r} read back with a wrong size")
        return raw

    shards, tensors = [], []
    for i, group in enumerate(groups, 1):
        fname = f"resident-{i:05d}-of-{len(groups):05d}.safetensors"
        header, off, placed = {}, 0, []
        for name, dtype, shape, _ in group:
            n = math.prod(shape) * DTYPE_BYTES[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
            placed.append((name, dtype, shape, off, n))
            off += n
        raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        raw += b" " * (-len(raw) % 8)
        prefix = len(raw).to_bytes(8, "little") + raw

        def chunks(group=group, prefix=prefix):
            yield prefix
            for t in group:
                blob = data(*t)
                for k in range(0, len(blob), HASH_CHUNK):
                    yield blob[k:k + HASH_CHUNK]

        total, digest = install_chunks(out / fname, chunks())
        shards.append(Shard(fname, total, len(prefix), hashlib.sha256(prefix).hexdigest(),
                            digest))
        tensors += [ResidentTensor(name, fname, len(prefix) + o, n, dtype, shape)
                    for name, dtype, shape, o, n in placed]
    return Residents(shards, sorted(tensors, key=lambda t: t.tensor))


def copy_metadata_files(ckpt, out: Path) -> list[str]:
    """Copy config, tokenizer and generation files (every regular non-weight file of at most
    METADATA_MAX_BYTES; a symlink is followed only within the source directory or, in a Hugging
    Face snapshot, into its blobs: `files.read_regular` with a root)."""
    root, copied = Path(ckpt.path), []
    for p in sorted(root.iterdir()):
        if (not p.is_file() or p.name.startswith(".")
                or p.suffix in (".safetensors", ".gguf", ".partial") or p.name in _NOT_METADATA):
            continue
        data = read_regular(p, limit=METADATA_MAX_BYTES, root=root, error=BuildError,
                            what="metadata file")
        install_bytes(out / p.name, data)
        copied.append(p.name)
    return copied


def assemble_manifest(cfg, esrc, ckpt, results: dict, residents: Residents,
                      src_hashes: list[dict], resident_dtype: str = "bf16") -> Manifest:
    """The manifest object: resident shards, then bank parts (sidecar shards) in layer order;
    `resident_dtype` says what form `copy_residents` wrote the residents in."""
    layers = sorted(results)
    parts = [SidecarPart(results[L].name, results[L].size, results[L].sha256) for L in layers]
    shards = list(residents.shards) + [
        Shard(p.file, p.size, 0, EMPTY_SHA256, p.sha256, kind="sidecar") for p in parts]
    records = []
    for i, L in enumerate(layers):
        for o in results[L].outputs:
            segs = [Segment(s["component"], s["tensor"], s["shard"], s["offset"], s["length"],
                            s["dtype"], tuple(s["shape"])) for s in o["segments"]]
            records.append(Record(o["layer"], o["expert"], o["logical_bytes"], segs, o["sha256"],
                                  o["record_offset"], o["logical_bytes"], i))
    routed = sum(r.logical_bytes for r in records)
    res_bytes = sum(t.length for t in residents.tensors)
    return Manifest(
        format=FORMAT, model_key=f"mtplx-{cfg_model_key(cfg)}-{esrc.mode}",
        source_repo=Path(ckpt.path).resolve().name,
        source_revision=source_revision(src_hashes),
        quantization=quantization_for(esrc.mode, esrc.bits, esrc.group_size),
        artifact={"tensor_bytes": routed + res_bytes, "resident_tensor_bytes": res_bytes,
                  "routed_expert_bytes": routed, "shard_count": len(shards),
                  "record_count": len(records)},
        shards=shards, resident_tensors=residents.tensors, records=records,
        sidecar=Sidecar(ALIGNMENT, parts), resident_dtype=resident_dtype)


def cfg_model_key(cfg) -> str:
    """The model's family ("kimi-k3", "deepseek-v3", "kimi-k2"); "-custom" at other widths."""
    return cfg.family if cfg.hidden_size == 7168 else f"{cfg.family}-custom"


def source_hashes(files: list[Path]) -> list[dict]:
    out = []
    for p in files:
        size, digest = sha256_file(p)
        out.append({"name": p.name, "size": size, "sha256": digest})
    return out


def source_revision(hashes: list[dict]) -> str:
    """A content identity of the source: sha256 over its files' names, sizes and sha256s."""
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


def receipt_bytes(ckpt, esrc, codec: str, out: Path, results: dict, manifest: Manifest,
                  src_hashes: list[dict]) -> bytes:
    """`build-receipt.json`: source identity, codec, every output file's size and sha256."""
    known = {r.name: (r.size, r.sha256) for r in results.values()}
    outputs = []
    for p in sorted(out.iterdir()):
        if (p.name in (RECEIPT, MANIFEST, LOCK) or p.name.endswith(".partial")
                or not p.is_file()):
            continue
        size, digest = known.get(p.name) or sha256_file(p)
        outputs.append({"file": p.name, "size": size, "sha256": digest})
    receipt = {
        "format": RECEIPT_FORMAT,
        "source": {"path": str(Path(ckpt.path).resolve()), "layout": ckpt.layout,
                   "files": src_hashes},
        "codec": {"requested": codec, "mode": esrc.mode, "conversion": esrc.conversion,
                  "quantization": quantization_for(esrc.mode, esrc.bits, esrc.group_size),
                  "record_bytes": esrc.layout.logical_bytes},
        "outputs": outputs,
        "manifest_sha256": manifest.compute_sha256(),
    }
    return (json.dumps(receipt, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
