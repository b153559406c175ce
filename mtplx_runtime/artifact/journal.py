"""Bank part build journal: canonical JSON lines, torn-line-tolerant parsing, resume checks
(FORMAT.md "Build journal, resume and publication").

    <part>.journal.jsonl = header line, one line per record (ordinal 0, 1, ...), completion line

Every line is canonical compact JSON (keys sorted, `,`/`:` separators, UTF-8) plus `\\n`, and is
fsynced before the next record is written. A last line without `\\n` is a torn write: ignored.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.safetensors_io import no_duplicate_keys

JOURNAL_FORMAT = "mtplx-bank-part-journal-v1"
_HEX64 = re.compile(r"[0-9a-f]{64}")


class BuildError(RuntimeError):
    """A build that cannot start or continue; the message names the file and what to do."""


def canonical_line(obj: dict) -> bytes:
    """Canonical compact JSON (the manifest digest's rules) + newline."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8") + b"\n"


def is_hex64(x: object) -> bool:
    return isinstance(x, str) and _HEX64.fullmatch(x) is not None


@dataclass
class ParsedJournal:
    """Complete lines of a journal, with the byte offset just past each one."""

    header: dict | None = None
    header_end: int = 0
    records: list[dict] = field(default_factory=list)
    record_ends: list[int] = field(default_factory=list)
    completion: dict | None = None
    completion_end: int = 0
    torn_bytes: int = 0  # bytes after the last complete line (ignored)
    problem: str | None = None  # why parsing stopped early, if it did


def parse_journal(path: Path, max_records: int) -> ParsedJournal:
    """Parse up to the last complete line. A bad or out-of-order complete line stops the parse
    (`problem` says why); everything after it is treated like a torn tail and truncated on resume.
    A second header, a completion not on the last line or more than `max_records` records raise
    BuildError: those are not crash artefacts."""
    data = path.read_bytes()
    out = ParsedJournal()
    pos = 0
    while True:
        nl = data.find(b"\n", pos)
        if nl < 0:
            out.torn_bytes = len(data) - pos
            return out
        raw, end = data[pos:nl], nl + 1
        try:
            obj = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
        except (UnicodeDecodeError, ValueError) as e:
            out.problem = f"line at byte {pos} is not valid JSON ({e})"
            out.torn_bytes = len(data) - pos
            return out
        if out.completion is not None:
            raise BuildError(f"{path}: a line follows the completion line; the journal is not "
                             f"from a crashed build — remove the partial and journal to rebuild")
        if out.header is None:
            if not isinstance(obj, dict) or obj.get("format") != JOURNAL_FORMAT:
                raise BuildError(f"{path}: first line is not a {JOURNAL_FORMAT} header")
            out.header, out.header_end = obj, end
        elif isinstance(obj, dict) and set(obj) == {"completion"}:
            out.completion, out.completion_end = obj["completion"], end
        elif isinstance(obj, dict) and obj.get("ordinal") == len(out.records):
            if len(out.records) >= max_records:
                raise BuildError(f"{path}: more than {max_records} records journaled")
            out.records.append(obj)
            out.record_ends.append(end)
        else:
            if isinstance(obj, dict) and obj.get("format") == JOURNAL_FORMAT:
                raise BuildError(f"{path}: a second header line at byte {pos}")
            out.problem = f"line at byte {pos} is not record {len(out.records)}"
            out.torn_bytes = len(data) - pos
            return out
        pos = end


def header_mismatch(found: dict, expected: dict) -> str | None:
    """None when equal; else a short description of the first differing top-level key."""
    if found == expected:
        return None
    for key in sorted(set(found) | set(expected)):
        if found.get(key) != expected.get(key):
            return f"{key!r}: journal has {found.get(key)!r}, this build computes " \
                   f"{expected.get(key)!r}"
    return "headers differ"


def check_record_geometry(line: dict, expected_output: dict) -> str | None:
    """Compare a journaled record's output geometry (everything but the hashes) with the one
    this build computes; also require 64-hex hashes. None when it matches."""
    out = line.get("output")
    if not isinstance(out, dict):
        return "no output object"
    segs = out.get("segments")
    if not isinstance(segs, list) or len(segs) != len(expected_output["segments"]):
        return "segment list differs"
    for got, want in zip(segs, expected_output["segments"]):
        if not isinstance(got, dict) or not is_hex64(got.get("sha256")):
            return "segment without a sha256"
        if {k: v for k, v in got.items() if k != "sha256"} != want:
            return f"segment {want['component']} geometry differs"
    if not is_hex64(out.get("sha256")):
        return "record without a sha256"
    rest = {k: v for k, v in out.items() if k not in ("segments", "sha256")}
    want_rest = {k: v for k, v in expected_output.items() if k != "segments"}
    if rest != want_rest:
        return "record geometry differs"
    srcs = line.get("source_components")
    if not isinstance(srcs, list) or not all(isinstance(s, dict) and is_hex64(s.get("sha256"))
                                              for s in srcs):
        return "source components without sha256"
    return None


class JournalWriter:
    """Appends canonical lines to a journal, fsyncing after each."""

    def __init__(self, path: Path, write_all):
        self.path = path
        self._write_all = write_all  # (fd, bytes) -> None; injectable for ENOSPC tests
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def append(self, obj: dict) -> None:
        self._write_all(self.fd, canonical_line(obj))
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def truncate_file(path: Path, size: int) -> None:
    """Truncate to `size` bytes and fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
