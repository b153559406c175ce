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
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..checkpoint import open_checkpoint
from ..files import fsync_dir
from ..formats import FormatError
from ..formats.ctint import pack_codes, pack_zero_points, unpack_codes, unpack_zero_points
from ..formats.modes import quantization_for
from ..formats.record import PROJECTIONS, RecordLayout, part_name, record_layout
from ..formats.resident_layouts import RESIDENT_DTYPES
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
    resident_names,
    source_hashes,
)
from .part import (
    BuildStopped,
    PartResult,
    build_part,
    check_stop,
    crash_point,
    disk_errors,
    sha256_hex,
)

KEEP_MODES = {"t158": "t158", "mxfp4": "mxfp4", "bf16": "bf16", "fp8": "fp8-block"}


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
        self.bits = self.group_size = None  # None: the mode's default
        if codec == "t158" or layout not in (*KEEP_MODES, "w3"):
            # Q2_K (GGUF) always converts to t158; t158 -> t158 copies the records.
            self.mode = "t158"
            self.conversion = "copy" if layout == "t158" else "encode-t158"
        elif layout == "w3":
            c = ckpt.codec
            self.mode, self.bits = ("ct-int" if c.symmetric else "ct-int-asym"), c.num_bits
            self.group_size = c.group_size
            self.conversion = "repack-dense" if c.num_bits == 3 and c.layout != "dense" else "copy"
        else:
            self.mode, self.conversion = KEEP_MODES[layout], "copy"
        try:
            self.layout: RecordLayout = record_layout(ckpt.config, self.mode, self.bits,
                                                      self.group_size)
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
            "mode": src.mode,
            "quantization": quantization_for(src.mode, src.bits, src.group_size),
            "expert_count": cfg.num_experts, "layer_count": n_routed,
            "projection_shapes": {f"{p}_proj": list(cfg.expert_shapes[p]) for p in PROJECTIONS},
            "record_bytes": lay.logical_bytes, "layer_bytes": lay.logical_bytes * cfg.num_experts,
            "segments": [{"component": s.component, "offset": s.offset, "length": s.length,
                          "dtype": s.dtype, "shape": list(s.shape)} for s in lay.segments],
        },
    }


class Progress:
    """Build progress on `stream` (default stderr): a tqdm bar on a terminal; elsewhere (a log,
    nohup, CI) one plain line every `interval_s` seconds with records done/total, GB written by
    this run, its rate and the ETA. Thread-safe: workers report records as they become durable.
    `clock` is injectable so tests drive time; `disable` prints nothing.
    """

    def __init__(self, stream=None, interval_s: float = 5.0, clock=time.monotonic,
                 disable: bool = False):
        self.stream = sys.stderr if stream is None else stream
        self.interval_s, self.clock, self.disable = interval_s, clock, disable
        self.lock, self.bar = threading.Lock(), None
        self.total = self.record_bytes = self.done = self.written_bytes = 0
        self.t0 = self.last = 0.0

    def start(self, total_records: int, record_bytes: int) -> None:
        self.total, self.record_bytes = total_records, record_bytes
        self.done = self.written_bytes = 0
        if self.disable:
            return
        self.t0 = self.last = self.clock()
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_records * record_bytes, unit="B", unit_scale=True,
                            unit_divisor=1024, desc="build", file=self.stream,
                            dynamic_ncols=True)

    def __call__(self, records: int, written_bytes: int) -> None:
        """`records` more are durable, `written_bytes` of them written by this run (records kept
        from an earlier run count as done, not as written)."""
        if self.disable:
            return
        with self.lock:
            self.done += records
            self.written_bytes += written_bytes
            if self.bar is not None:
                self.bar.update(records * self.record_bytes)
                self.bar.set_postfix_str(f"{self.done}/{self.total} records", refresh=False)
                return
            now = self.clock()
            if now - self.last >= self.interval_s:
                self.last = now
                print(self.line(now), file=self.stream, flush=True)

    def line(self, now: float) -> str:
        rate = self.written_bytes / (now - self.t0) if now > self.t0 else 0.0
        left = (self.total - self.done) * self.record_bytes
        if rate > 0:
            s = round(left / rate)
            eta = f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
        else:
            eta = "?"
        return (f"build-manifest: {self.done}/{self.total} records, "
                f"{self.written_bytes / 1e9:.2f} GB written, {rate / 1e6:.1f} MB/s, ETA {eta}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def build_artifact(src: str | os.PathLike, out: str | os.PathLike, *, codec: str = "keep",
                   layers: str | list[int] | None = None, jobs: int = 1,
                   progress: bool | Progress = True,
                   resident_dtype: str = "bf16") -> BuildReport:
    """Build (or resume, or extend) the streaming artifact for `src` in `out`. Blocks.

    codec "keep" stores the source's own codec ("t158" copies records byte for byte, w3 becomes
    ct-int with 3-bit legacy words repacked dense, mxfp4 and bf16 copied); "t158" re-encodes
    every expert with encode_t158. A GGUF Q2_K source always becomes t158. Rerunning the same
    command after a crash, a full disk or Ctrl-C resumes; asking for more layers than a finished
    `out` holds extends it (FORMAT.md "Build journal, resume and publication"). `progress`: True
    for the default Progress on stderr, False for none, or a Progress to report to.
    `resident_dtype` "int8" | "int4" stores the quantizable resident matrices quantized (FORMAT.md
    "Quantized residents"; the bytes a bf16 artifact quantized at load holds), "bf16" as they are.
    KeyboardInterrupt stops every worker at its next record boundary before it propagates.
    """
    if codec not in ("keep", "t158"):
        raise BuildError(f"codec must be 'keep' or 't158', got {codec!r}")
    if jobs < 1:
        raise BuildError(f"jobs must be >= 1, got {jobs}")
    if resident_dtype not in RESIDENT_DTYPES:
        raise BuildError(f"resident dtype must be one of {', '.join(RESIDENT_DTYPES)}, got "
                         f"{resident_dtype!r}")
    t0, out = time.monotonic(), Path(out)
    if not isinstance(progress, Progress):
        progress = Progress(disable=not progress)
    # SRC and the arguments are checked before OUT is created: a mistake leaves nothing behind.
    with open_source(src) as ckpt:
        esrc = ExpertSource(ckpt, codec)
        if resident_dtype != "bf16" and any(ckpt.tensor_info(n).dtype == "F8_E4M3"
                                            for n in resident_names(ckpt)):
            raise BuildError(f"{src}: its resident matrices are FP8 (dequantized to bf16 at "
                             f"load), which --resident-dtype {resident_dtype} does not re-encode "
                             f"at build; build with bf16 residents and give --resident-dtype "
                             f"{resident_dtype} when loading")
        moe = ckpt.config.moe_layers
        layer_ids = sorted(layers) if isinstance(layers, list) else parse_layers(layers, moe)
        out.mkdir(parents=True, exist_ok=True)
        with build_lock(out):
            return _build_locked(ckpt, esrc, out, codec, layer_ids, jobs, progress, t0,
                                 resident_dtype)


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


def _build_locked(ckpt, esrc: ExpertSource, out: Path, codec: str, layer_ids: list[int],
                  jobs: int, progress: Progress, t0: float, resident_dtype: str) -> BuildReport:
    cfg = ckpt.config
    extending = (out / MANIFEST).exists()
    if extending:
        finished = _finished_manifest(out, esrc.mode, layer_ids, resident_dtype)
        if {r.layer for r in finished.records} == set(layer_ids):
            parts = sorted({s.shard for r in finished.records for s in r.segments})
            return BuildReport(out, esrc.mode, parts, len(finished.records), 0, 0, len(parts),
                               finished.manifest_sha256, time.monotonic() - t0,
                               ["already complete"])
    n_routed = len(cfg.moe_layers)
    _refuse_foreign_parts(out, esrc.mode)
    files = [file_identity(p) for p in source_files(ckpt)]
    names = {L: part_name(esrc.mode, L, n_routed) for L in layer_ids}
    progress.start(len(layer_ids) * cfg.num_experts, esrc.layout.logical_bytes)
    stop = threading.Event()

    def one(L: int) -> PartResult:
        check_stop(stop, out / names[L])  # a queued layer started after a failure: skip it
        header = journal_header(esrc, L, names[L], n_routed, files)
        try:
            return build_part(out, names[L], L, esrc.layout, cfg.num_experts, header, esrc,
                              progress, stop)
        except BaseException:
            stop.set()  # the other workers end at their next record boundary
            raise

    try:
        results = _run_parts(one, layer_ids, jobs, stop)
    finally:
        progress.close()
    # Publication order (FORMAT.md "Build journal, resume and publication"): parts,
    # residents, metadata, index, receipt, manifest last.
    residents = copy_residents(ckpt, out, resident_dtype)
    crash_point("residents")
    copy_metadata_files(ckpt, out)
    index = {"metadata": {"total_size": sum(r.length for r in residents.tensors)},
             "weight_map": {r.tensor: r.shard for r in residents.tensors}}
    install_bytes(out / INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    src_hashes = source_hashes(source_files(ckpt))
    manifest = assemble_manifest(cfg, esrc, ckpt, results, residents, src_hashes,
                                 resident_dtype)
    receipt = receipt_bytes(ckpt, esrc, codec, out, results, manifest, src_hashes)
    if extending:
        # The old receipt describes the smaller artifact; readers never need it, and until the
        # new manifest replaces the old one the old artifact stays valid.
        _unlink_if_present(out / RECEIPT)
    install_bytes(out / RECEIPT, receipt)
    crash_point("receipt")
    _install_manifest(manifest, out / MANIFEST)
    written = sum(r.written for r in results.values())
    resumed = sum(r.resumed for r in results.values())
    adopted = sum(r.adopted for r in results.values())
    return BuildReport(out, esrc.mode, [names[L] for L in layer_ids],
                       len(layer_ids) * cfg.num_experts, written, resumed, adopted,
                       manifest.manifest_sha256, time.monotonic() - t0,
                       ["extended"] if extending else [])


def _run_parts(one, layer_ids: list[int], jobs: int, stop: threading.Event) -> dict:
    """`one(L)` for every layer on `jobs` threads. The first failure, or Ctrl-C landing in this
    (main) thread, sets `stop`: the other workers end at their next record boundary, queued
    layers never start, and the first real failure in layer order is raised."""
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = [pool.submit(one, L) for L in layer_ids]
        wait(futures, return_when=FIRST_EXCEPTION)
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
    first = next((e for e in errors if not isinstance(e, BuildStopped)), None)
    if first is not None:
        raise first
    return {L: f.result() for L, f in zip(layer_ids, futures)}


def _unlink_if_present(path: Path) -> None:
    with disk_errors(path, "removing it"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        fsync_dir(path.parent)


def _install_manifest(manifest, path: Path) -> None:
    """`write_manifest` (temp file, fsync, rename; a failed write removes the temp file, an old
    manifest when extending stays), with a full disk named like every stage."""
    with disk_errors(path, f"writing {path.name}"):
        write_manifest(manifest, path)


def _refuse_foreign_parts(out: Path, mode: str) -> None:
    """Parts of another mode in `out` mean a different build was started there."""
    for p in out.glob("experts-*-layer-*"):
        if not p.name.startswith(f"experts-{mode}-layer-"):
            raise BuildError(f"{out}: holds {p.name} from a build of another codec mode; use a "
                             f"fresh output directory")


def format_layers(layers: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3,5" (the --layers syntax)."""
    runs: list[list[int]] = []
    for L in sorted(layers):
        if runs and L == runs[-1][1] + 1:
            runs[-1][1] = L
        else:
            runs.append([L, L])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _finished_manifest(out: Path, mode: str, layer_ids: list[int], resident_dtype: str):
    """The manifest of the finished artifact in `out`. It can be extended (same mode and
    resident dtype, every finished layer asked for again); anything else is refused naming the
    command to use."""
    m = load_manifest(out / MANIFEST)
    have_mode = m.quantization.get("mode")
    layers = sorted({r.layer for r in m.records})
    if have_mode != mode:
        raise BuildError(f"{out}: holds a finished {have_mode} artifact and this build makes "
                         f"{mode}; use a fresh output directory")
    if m.resident_dtype != resident_dtype:
        raise BuildError(f"{out}: holds a finished artifact with {m.resident_dtype} residents and "
                         f"this build writes {resident_dtype} ones; use --resident-dtype "
                         f"{m.resident_dtype} to extend it, else a fresh output directory")
    missing = sorted(set(layers) - set(layer_ids))
    if missing:
        union = format_layers(sorted(set(layers) | set(layer_ids)))
        raise BuildError(f"{out}: holds a finished artifact of layers {format_layers(layers)} "
                         f"and --layers {format_layers(layer_ids)} leaves out "
                         f"{format_layers(missing)}; to extend it use --layers {union}, else "
                         f"use a fresh output directory")
    return m
