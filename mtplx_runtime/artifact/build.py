"""Streaming artifact builder: any checkpoint -> bank parts + residents + manifest (FORMAT.md
"Streaming artifact", "Build journal, resume and publication").

    source experts -> (copy | dense repack | t158 encode) -> bank parts (journal, resume)
      -> resident shards -> official files -> index -> build-receipt.json -> expert-manifest.json

One expert record per worker is in memory at a time (one decoded fp32 projection more when
re-encoding to t158); `jobs` workers build different layers at once, so the working set is at
most `jobs` records. The manifest is written last: a directory without it is unfinished.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..checkpoint import open_checkpoint
from ..formats import FormatError
from ..formats.ctint import pack_codes, pack_zero_points, unpack_codes, unpack_zero_points
from ..formats.record import PROJECTIONS, RecordLayout, part_name, quantization_for, record_layout
from ..formats.t158 import encode_t158
from .journal import JOURNAL_FORMAT, BuildError
from .manifest import load_manifest, write_manifest
from .outputs import (
    INDEX,
    LOCK,
    MANIFEST,
    RECEIPT,
    assemble_manifest,
    copy_metadata_files,
    copy_residents,
    file_identity,
    install_bytes,
    receipt_bytes,
    source_hashes,
)
from .part import PartResult, build_part, crash_point, disk_errors, sha256_hex

KEEP_MODES = {"t158": "t158", "mxfp4": "mxfp4", "bf16": "bf16"}


@dataclass
class BuildReport:
    out: Path
    mode: str
    parts: list[str]
    records: int
    written: int  # records written by this run
    resumed: int  # records kept from an interrupted run
    adopted: int  # parts that were already complete
    manifest_sha256: str
    seconds: float
    notes: list[str] = field(default_factory=list)


def open_source(src: str | os.PathLike):
    """A checkpoint directory (`open_checkpoint`) or a GGUF Q2_K source directory."""
    root = Path(src)
    if root.is_dir() and any(p.suffix == ".gguf" for p in root.iterdir()):
        from ..checkpoint.gguf_source import open_gguf_source

        return open_gguf_source(root)
    return open_checkpoint(root)


def source_files(ckpt) -> list[Path]:
    if hasattr(ckpt, "source_files"):
        return sorted(ckpt.source_files())
    root = Path(ckpt.path)
    return sorted(p for p in root.iterdir() if p.is_file() and p.suffix in (".safetensors",))


class ExpertSource:
    """Reads a source expert and turns it into the parts of a `mode` record."""

    def __init__(self, ckpt, codec: str):
        self.ckpt = ckpt
        layout = ckpt.layout
        self.bits = None
        if codec == "t158" or layout not in (*KEEP_MODES, "w3"):
            # Q2_K (GGUF) always converts to t158; t158 -> t158 copies the records.
            self.mode = "t158"
            self.conversion = "copy" if layout == "t158" else "encode-t158"
        elif layout == "w3":
            c = ckpt.codec
            self.mode, self.bits = ("ct-int" if c.symmetric else "ct-int-asym"), c.num_bits
            self.conversion = "repack-dense" if c.num_bits == 3 and c.layout != "dense" else "copy"
        else:
            self.mode, self.conversion = KEEP_MODES[layout], "copy"
        try:
            self.layout: RecordLayout = record_layout(ckpt.config, self.mode, self.bits)
        except FormatError as e:
            raise BuildError(f"{ckpt.path}: the source's experts cannot be stored as "
                             f"{self.mode}: {e}") from None

    def source_components(self, layer: int, expert: int):
        """Journaled identity of the source bytes: per projection and component, length and
        sha256 of the bytes the source reader returns (in storage order)."""
        rec = self.ckpt.expert(layer, expert)
        comps = []
        for proj in PROJECTIONS:
            for name, arr in rec.projections[proj].parts.items():
                a = np.ascontiguousarray(arr)
                comps.append({"projection": proj, "component": name, "length": a.nbytes,
                              "sha256": sha256_hex(a.data)})
        return comps, rec

    def record_parts(self, layer: int, expert: int, rec) -> dict:
        out = {}
        for proj in PROJECTIONS:
            p = rec.projections[proj]
            if self.conversion == "encode-t158":
                packed, scales = encode_t158(p.decode())
                out[proj] = {"packed": packed, "scales": scales}
            elif self.conversion == "repack-dense":
                out[proj] = _repack_dense(p, layer, expert, proj)
            else:
                if "weight_g_idx" in p.parts:
                    raise BuildError(_g_idx_error(layer, expert, proj))
                out[proj] = p.parts
        return out


def _g_idx_error(layer: int, expert: int, proj: str) -> str:
    return (f"layer {layer} expert {expert} {proj}: activation-order weight_g_idx cannot be "
            f"stored in a ct-int bank; build with --codec t158")


def _repack_dense(p, layer: int, expert: int, proj: str) -> dict:
    """Legacy 3-bit ct words -> dense 3-bit words, lossless (codes unchanged)."""
    if "weight_g_idx" in p.parts:
        raise BuildError(_g_idx_error(layer, expert, proj))
    c, (rows, cols) = p.codec, p.shape
    out = {"weight_packed": pack_codes(unpack_codes(p.parts["weight_packed"], 3, c.layout, cols),
                                       3, "dense"),
           "weight_scale": p.parts["weight_scale"]}
    if not c.symmetric:
        zp = unpack_zero_points(p.parts["weight_zero_point"], 3, c.layout, rows)
        out["weight_zero_point"] = pack_zero_points(zp, 3, "dense")
    return out


def parse_layers(spec: str | None, moe_layers: list[int]) -> list[int]:
    """"1-5,7" -> [1, 2, 3, 4, 5, 7]; None -> every MoE layer. Each must be an MoE layer."""
    if spec is None:
        return list(moe_layers)
    out: set[int] = set()
    for item in spec.split(","):
        a, _, b = item.strip().partition("-")
        try:
            lo, hi = int(a), int(b or a)
        except ValueError:
            raise BuildError(f"--layers: {item!r} is not N or N-M") from None
        out.update(range(lo, hi + 1))
    bad = sorted(out - set(moe_layers))
    if bad or not out:
        raise BuildError(f"--layers: {bad or spec} not MoE layers (have {moe_layers[0]}.."
                         f"{moe_layers[-1]})")
    return sorted(out)


def journal_header(src: ExpertSource, layer: int, name: str, n_routed: int, files) -> dict:
    cfg, lay = src.ckpt.config, src.layout
    return {
        "format": JOURNAL_FORMAT, "layer": layer, "output_file": name,
        "source": {"path": str(Path(src.ckpt.path).resolve()), "layout": src.ckpt.layout,
                   "files": files},
        "conversion": src.conversion,
        "layout": {
            "mode": src.mode, "quantization": quantization_for(src.mode, src.bits),
            "expert_count": cfg.num_experts, "layer_count": n_routed,
            "projection_shapes": {f"{p}_proj": list(cfg.expert_shapes[p]) for p in PROJECTIONS},
            "record_bytes": lay.logical_bytes, "layer_bytes": lay.logical_bytes * cfg.num_experts,
            "segments": [{"component": s.component, "offset": s.offset, "length": s.length,
                          "dtype": s.dtype, "shape": list(s.shape)} for s in lay.segments],
        },
    }


class _Progress:
    """tqdm over bytes with a records counter; off unless asked for and stderr is a TTY."""

    def __init__(self, enabled: bool, total_records: int, total_bytes: int):
        self.bar, self.lock, self.n, self.total = None, threading.Lock(), 0, total_records
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                            desc="build", file=sys.stderr, dynamic_ncols=True)

    def __call__(self, nbytes: int) -> None:
        if self.bar is not None:
            with self.lock:
                self.n += 1
                self.bar.update(nbytes)
                self.bar.set_postfix_str(f"{self.n}/{self.total} records", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def build_artifact(src: str | os.PathLike, out: str | os.PathLike, *, codec: str = "keep",
                   layers: str | list[int] | None = None, jobs: int = 1,
                   progress: bool = True) -> BuildReport:
    """Build (or resume) the streaming artifact for `src` in `out`. Blocks.

    codec "keep" stores the source's own codec ("t158" copies records byte for byte, w3 becomes
    ct-int with 3-bit legacy words repacked dense, mxfp4 and bf16 copied); "t158" re-encodes
    every expert with encode_t158. A GGUF Q2_K source always becomes t158. Rerunning the same
    command after a crash resumes (FORMAT.md "Build journal, resume and publication").
    """
    if codec not in ("keep", "t158"):
        raise BuildError(f"codec must be 'keep' or 't158', got {codec!r}")
    if jobs < 1:
        raise BuildError(f"jobs must be >= 1, got {jobs}")
    t0, out = time.monotonic(), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with build_lock(out):
        return _build_locked(src, out, codec, layers, jobs, progress, t0)


@contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive flock on `out/.build.lock` for the whole build; a second build of the
    same directory is refused at once. The file is removed (still locked) when the build ends;
    a killed build leaves it, unlocked, and the next build takes it over (FORMAT.md "Build
    journal, resume and publication")."""
    path = out / LOCK
    while True:
        with disk_errors(path, "creating the build lock"):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BuildError(f"{out}: another mtplx build-manifest is running in this directory "
                             f"(it holds {LOCK}); wait for it to finish or use another output "
                             f"directory") from None
        except BaseException:
            os.close(fd)
            raise
        # The build that held it may have removed the file after we opened it: the lock counts
        # only on the file that is at `path` now.
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        mine = os.fstat(fd)
        if st is not None and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)
    try:
        yield
    finally:
        try:
            os.unlink(path)  # before the unlock: a waiter that opened it sees a stale inode
        except FileNotFoundError:
            pass
        os.close(fd)


def _build_locked(src, out: Path, codec: str, layers, jobs: int, progress: bool,
                  t0: float) -> BuildReport:
    with open_source(src) as ckpt:
        cfg = ckpt.config
        esrc = ExpertSource(ckpt, codec)
        layer_ids = layers if isinstance(layers, list) else parse_layers(layers, cfg.moe_layers)
        if (out / MANIFEST).exists():
            return _already_built(out, esrc, layer_ids, t0)
        n_routed = len(cfg.moe_layers)
        _refuse_foreign_parts(out, esrc.mode)
        files = [file_identity(p) for p in source_files(ckpt)]
        names = {L: part_name(esrc.mode, L, n_routed) for L in layer_ids}
        stride = esrc.layout.logical_bytes
        bar = _Progress(progress, len(layer_ids) * cfg.num_experts,
                        len(layer_ids) * cfg.num_experts * stride)

        def one(L: int) -> PartResult:
            header = journal_header(esrc, L, names[L], n_routed, files)
            return build_part(out, names[L], L, esrc.layout, cfg.num_experts, header, esrc, bar)

        try:
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                results = dict(zip(layer_ids, pool.map(one, layer_ids)))
        finally:
            bar.close()
        # Publication order (FORMAT.md "Build journal, resume and publication"): parts,
        # residents, metadata, index, receipt, manifest last.
        residents = copy_residents(ckpt, out)
        crash_point("residents")
        copy_metadata_files(ckpt, out)
        index = {"metadata": {"total_size": sum(r.length for r in residents.tensors)},
                 "weight_map": {r.tensor: r.shard for r in residents.tensors}}
        install_bytes(out / INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
        src_hashes = source_hashes(source_files(ckpt))
        manifest = assemble_manifest(cfg, esrc, ckpt, results, residents, src_hashes)
        install_bytes(out / RECEIPT,
                      receipt_bytes(ckpt, esrc, codec, out, results, manifest, src_hashes))
        crash_point("receipt")
        _install_manifest(manifest, out / MANIFEST)
    written = sum(r.written for r in results.values())
    resumed = sum(r.resumed for r in results.values())
    adopted = sum(r.adopted for r in results.values())
    return BuildReport(out, esrc.mode, [names[L] for L in layer_ids],
                       len(layer_ids) * cfg.num_experts, written, resumed, adopted,
                       manifest.manifest_sha256, time.monotonic() - t0)


def _install_manifest(manifest, path: Path) -> None:
    """`write_manifest` (temp file, fsync, rename), with a full disk named like every stage."""
    tmp = path.with_name(path.name + ".partial")
    try:
        with disk_errors(tmp, f"writing {path.name}"):
            write_manifest(manifest, path)
    except BaseException:
        if not path.exists():  # give the space back; a rerun writes it again
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise


def _refuse_foreign_parts(out: Path, mode: str) -> None:
    """Parts of another mode in `out` mean a different build was started there."""
    for p in out.glob("experts-*-layer-*"):
        if not p.name.startswith(f"experts-{mode}-layer-"):
            raise BuildError(f"{out}: holds {p.name} from a build of another codec mode; use a "
                             f"fresh output directory")


def _already_built(out: Path, esrc: ExpertSource, layer_ids: list[int],
                   t0: float) -> BuildReport:
    m = load_manifest(out / MANIFEST)
    layers = sorted({r.layer for r in m.records})
    if m.quantization.get("mode") != esrc.mode or layers != layer_ids:
        raise BuildError(f"{out / MANIFEST}: a finished artifact of mode "
                         f"{m.quantization.get('mode')!r}, layers {layers} is already here")
    parts = sorted({s.shard for r in m.records for s in r.segments})
    return BuildReport(out, esrc.mode, parts, len(m.records), 0, 0, len(parts),
                       m.manifest_sha256, time.monotonic() - t0, ["already complete"])
