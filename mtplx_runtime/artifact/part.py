"""Bank record layout per codec mode: component order, 4 KiB-aligned offsets, padding segments,
and bank part names (FORMAT.md "Bank parts").

One record = one expert of one routed layer = gate, up, down components in codec order. Every
component starts 4 KiB-aligned inside the record; a component whose length is not a multiple of
4096 is followed by an explicit `pad` segment (tensor "", U8 [n], zero bytes), so segments are
contiguous and cover `logical_bytes` exactly. K3 t158 needs no padding. A record's stride in
its part is its `logical_bytes`, itself a multiple of 4096.

    source ExpertRecord -> parts per projection (mode codec) -> record_bytes (+ zero pads)
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..files import fsync_dir, sha256_file
from ..formats.record import RecordLayout, record_bytes
from .journal import (
    BuildError,
    JournalWriter,
    check_record_geometry,
    header_mismatch,
    parse_journal,
    truncate_file,
)

# ---- Writing one bank part: journal, resume, publication (FORMAT.md "Build journal") ----

_CRASH = {"after": int(os.environ.get("MTPLX_BUILD_CRASH_AFTER", "0") or 0), "count": 0}
_CRASH_LOCK = threading.Lock()


def crash_point(what: str) -> None:
    """Test hook: with MTPLX_BUILD_CRASH_AFTER=N, the N-th crash point SIGKILLs the process
    (simulates power loss at every interesting step of a build; tests/test_builder_crash.py)."""
    if not _CRASH["after"]:
        return
    with _CRASH_LOCK:
        _CRASH["count"] += 1
        if _CRASH["count"] == _CRASH["after"]:
            os.kill(os.getpid(), signal.SIGKILL)


def write_all(fd: int, data: bytes, offset: int | None = None) -> None:
    """Write every byte (positional when `offset` is given). Tests monkeypatch this to inject
    ENOSPC."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
        view = view[n:]
        if offset is not None:
            offset += n


def _write(fd: int, data: bytes, offset: int | None = None) -> None:
    write_all(fd, data, offset)  # late-bound so a monkeypatched write_all is seen


# Errors a full or failing output disk raises; the build stops with a message naming the file
# and saying how to resume (FORMAT.md "Build journal, resume and publication").
DISK_ERRORS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.EIO: "I/O error"}


@contextmanager
def disk_errors(path: Path, doing: str) -> Iterator[None]:
    """Turn ENOSPC / EDQUOT / EIO raised inside into a BuildError naming `path` (the file being
    written) and saying that rerunning the same command resumes. Wrap only output writes: a
    source read failing is not the output disk's fault."""
    try:
        yield
    except OSError as err:
        why = DISK_ERRORS.get(err.errno)
        if why is None:
            raise
        raise BuildError(f"{path}: {why} while {doing}; free space and rerun the same command "
                         f"to resume") from err


def sha256_hex(data) -> str:
    return hashlib.sha256(data).hexdigest()


class PartSource(Protocol):
    """What `build_part` needs from the source: per expert, the source components' hashes
    (journaled, re-checked on resume) and the record's parts in the bank mode."""

    def source_components(self, layer: int, expert: int) -> tuple[list[dict], object]: ...

    def record_parts(self, layer: int, expert: int, handle: object) -> dict: ...


class BuildStopped(Exception):
    """A part build that saw the stop flag (Ctrl-C, or another part failed) between records: its
    partial and journal end at a record boundary, so rerunning the same command resumes."""


def check_stop(stop: threading.Event | None, path: Path) -> None:
    if stop is not None and stop.is_set():
        raise BuildStopped(f"{path}: stopped at a record boundary")


@dataclass
class PartResult:
    name: str
    size: int
    sha256: str
    outputs: list[dict]  # journal `output` objects, one per expert
    written: int = 0  # records written by this run
    resumed: int = 0  # records kept from an earlier run
    adopted: bool = False  # the final part existed and re-verified


def expected_output(layout: RecordLayout, name: str, layer: int, expert: int) -> dict:
    """The journal `output` object of one record without hashes."""
    base = expert * layout.logical_bytes
    return {
        "layer": layer, "expert": expert, "shard": name, "record_offset": base,
        "logical_bytes": layout.logical_bytes,
        "segments": [{"component": s.component, "tensor": s.tensor(layer, expert), "shard": name,
                      "offset": base + s.offset, "length": s.length, "dtype": s.dtype,
                      "shape": list(s.shape)} for s in layout.segments],
    }


def hashed_output(layout: RecordLayout, name: str, layer: int, expert: int, rec: bytes) -> dict:
    out = expected_output(layout, name, layer, expert)
    for seg, s in zip(out["segments"], layout.segments):
        seg["sha256"] = sha256_hex(rec[s.offset:s.offset + s.length])
    out["sha256"] = sha256_hex(rec)
    return out


def build_part(out_dir: Path, name: str, layer: int, layout: RecordLayout, n_experts: int,
               header: dict, source: PartSource, on_progress=lambda records, written_bytes: None,
               stop: threading.Event | None = None) -> PartResult:
    """Write (or resume, or adopt) bank part `name` in `out_dir`. Blocks; one record in memory.

    `on_progress(records, written_bytes)` is called as records become durable (written_bytes 0
    for records kept from an earlier run or an adopted part). `stop` is checked between records:
    once set, BuildStopped is raised with the partial and journal at a record boundary.
    Raises BuildError when the existing state cannot be continued safely (header mismatch,
    source changed, stray files) or the disk is full (partial + journal stay resumable).
    """
    final, stride = out_dir / name, layout.logical_bytes
    partial = out_dir / (name + ".partial")
    jpath = out_dir / (name + ".journal.jsonl")
    if final.exists():
        result = _adopt(final, partial, jpath, layer, layout, n_experts, header, source, stop)
        on_progress(n_experts, 0)
        return result
    have_p, have_j = partial.exists(), jpath.exists()
    if have_j and not have_p:
        raise BuildError(f"{jpath}: journal without {partial.name}; remove the journal to rebuild")
    if have_p and not have_j:
        st = partial.stat()
        if st.st_size or st.st_nlink != 1:
            raise BuildError(f"{partial}: a non-empty or linked partial without a journal; remove "
                             f"it to rebuild")
    if not have_p:
        with disk_errors(partial, "creating it"):
            os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
            fsync_dir(out_dir)
    outputs: list[dict] = []
    running = hashlib.sha256()
    parsed = parse_journal(jpath, n_experts) if have_j else None
    if parsed is not None and parsed.header is not None:
        why = header_mismatch(parsed.header, header)
        if why:
            raise BuildError(f"{jpath}: journal header differs from this build ({why}); rerun the "
                             f"original command, or remove {partial.name} and the journal")
        good_end = _rescan(parsed, partial, layer, layout, name, source, outputs, running, stop)
        with disk_errors(jpath, "truncating it to the last good record"):
            truncate_file(jpath, good_end)
    elif have_j:
        with disk_errors(jpath, "truncating a torn header"):
            truncate_file(jpath, 0)  # crashed before the header line was complete
    with disk_errors(partial, "truncating it to the last good record"):
        truncate_file(partial, len(outputs) * stride)
    resumed = len(outputs)
    if resumed:
        on_progress(resumed, 0)
    with disk_errors(jpath, "opening it"):
        journal = JournalWriter(jpath, _write)
    try:
        with disk_errors(partial, "opening it"):
            fd = os.open(partial, os.O_WRONLY | os.O_CLOEXEC)
    except BaseException:
        journal.close()
        raise
    try:
        if parsed is None or parsed.header is None:
            with disk_errors(jpath, "writing the journal header"):
                journal.append(header)
                # The journal's directory entry must survive a power loss as well as its line:
                # a partial without its journal is refused on resume.
                fsync_dir(out_dir)
        for e in range(resumed, n_experts):
            check_stop(stop, partial)
            src_components, handle = source.source_components(layer, e)
            rec = record_bytes(layout, source.record_parts(layer, e, handle))
            doing = f"writing record {e} ({e} of {n_experts} records are durable)"
            with disk_errors(partial, doing):
                _write(fd, rec, e * stride)
                os.fsync(fd)
            crash_point("record")
            outputs.append(hashed_output(layout, name, layer, e, rec))
            with disk_errors(jpath, doing):
                journal.append({"ordinal": e, "source_components": src_components,
                                "output": outputs[-1]})
            running.update(rec)
            crash_point("journal")
            on_progress(1, stride)
        with disk_errors(partial, "truncating it to its final size"):
            os.ftruncate(fd, n_experts * stride)
            os.fsync(fd)
    except BaseException:
        journal.close()
        raise
    finally:
        os.close(fd)
    with disk_errors(partial, "reading it back"):
        size, digest = sha256_file(partial)
    if size != n_experts * stride or digest != running.hexdigest():
        journal.close()
        raise BuildError(f"{partial}: durable readback hash {digest} ({size} B) differs from the "
                         f"hash of the records written; the disk returned different bytes")
    try:
        with disk_errors(jpath, "writing the completion line"):
            journal.append({"completion": {"record_count": n_experts, "size": size,
                                           "sha256": digest}})
    finally:
        journal.close()
    crash_point("completion")
    with disk_errors(final, "publishing it (hard link from the partial)"):
        try:
            os.link(partial, final)
        except FileExistsError:
            raise BuildError(f"{final}: already exists; refusing to overwrite") from None
        crash_point("link")
        os.unlink(partial)
        fsync_dir(out_dir)
    return PartResult(name, size, digest, outputs, n_experts - resumed, resumed)


def _verify_record(data: bytes, line: dict) -> bool:
    out = line["output"]
    if sha256_hex(data) != out["sha256"]:
        return False
    base = out["record_offset"]
    return all(sha256_hex(data[s["offset"] - base:s["offset"] - base + s["length"]]) == s["sha256"]
               for s in out["segments"])


def _check_source(line: dict, layer: int, e: int, source: PartSource, path: Path) -> None:
    got, _ = source.source_components(layer, e)
    if got != line.get("source_components"):
        raise BuildError(f"{path}: record {e}: source hash changed since it was journaled; the "
                         f"source is not the one this part was started from")


def _rescan(parsed, partial: Path, layer: int, layout: RecordLayout, name: str,
            source: PartSource, outputs: list, running, stop: threading.Event | None) -> int:
    """Re-verify journaled records in order; keep the good prefix. Returns the journal offset
    just past the last good record (or the header). Stopping here changes nothing on disk."""
    good_end = parsed.header_end
    stride = layout.logical_bytes
    with open(partial, "rb", buffering=0) as f:
        for e, line in enumerate(parsed.records):
            check_stop(stop, partial)
            if check_record_geometry(line, expected_output(layout, name, layer, e)):
                break
            _check_source(line, layer, e, source, partial)
            f.seek(e * stride)
            data = f.read(stride)
            if len(data) != stride or not _verify_record(data, line):
                break  # the first mismatch stops the scan (FORMAT.md "Build journal")
            outputs.append(line["output"])
            running.update(data)
            good_end = parsed.record_ends[e]
    return good_end


def _adopt(final: Path, partial: Path, jpath: Path, layer: int, layout: RecordLayout,
           n_experts: int, header: dict, source: PartSource,
           stop: threading.Event | None) -> PartResult:
    """Accept an already published part only after full re-verification (FORMAT.md "Build
    journal")."""
    def fail(why: str) -> BuildError:
        return BuildError(f"{final}: exists but cannot be adopted: {why}; remove it (and its "
                          f"journal) to rebuild")

    if partial.exists() and not os.path.samefile(partial, final):
        raise fail(f"a different {partial.name} exists")
    if not jpath.exists():
        raise fail("its journal is missing")
    parsed = parse_journal(jpath, n_experts)
    if parsed.header is None or header_mismatch(parsed.header, header):
        raise fail("its journal header differs from this build")
    if parsed.completion is None or len(parsed.records) != n_experts or parsed.torn_bytes:
        raise fail("its journal is not header + all records + completion")
    stride, name = layout.logical_bytes, final.name
    if final.stat().st_size != n_experts * stride:
        raise fail(f"size {final.stat().st_size}, expected {n_experts * stride}")
    running = hashlib.sha256()
    with open(final, "rb", buffering=0) as f:
        for e, line in enumerate(parsed.records):
            check_stop(stop, final)  # re-verifying only reads: nothing to undo
            if check_record_geometry(line, expected_output(layout, name, layer, e)):
                raise fail(f"record {e} geometry differs")
            _check_source(line, layer, e, source, final)
            data = f.read(stride)
            if not _verify_record(data, line):
                raise fail(f"record {e} hash mismatch")
            running.update(data)
    completion = {"record_count": n_experts, "size": n_experts * stride,
                  "sha256": running.hexdigest()}
    if parsed.completion != completion:
        raise fail("completion line does not match the re-hashed part")
    if partial.exists():
        os.unlink(partial)  # crashed between link and unlink
        fsync_dir(final.parent)
    return PartResult(name, completion["size"], completion["sha256"],
                      [line["output"] for line in parsed.records], adopted=True)
