"""Routed experts of a streaming artifact: records in raw bank parts, located by the manifest.

FORMAT.md "Streaming artifact: banks and manifest v1". The manifest (already digest- and
structure-checked by `load_manifest`) is checked here against the config: the record layout of
its codec mode for the config's expert shapes (`formats.record.record_layout`), every expert of
each routed layer it holds (FORMAT.md rules 15-20; the pinned K3 descriptor for `kimi-k3-q1t`),
and each record's segments contiguous from its part's `data_start + sidecar_offset`. Bank parts
are checked at open with lstat (a regular file of the manifest's size, not a symlink; nothing is
opened, so a FIFO cannot block) and opened on their first read (O_NOFOLLOW).

    (layer, expert) -> manifest record -> ONE os.pread of the whole record
        -> [sha256 checked if asked] -> record_parts (pads skipped) -> ExpertRecord
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import NamedTuple

from ..checkpoint.config import ModelConfig
from ..checkpoint.layouts import ExpertLayout, ExpertRecord, ProjectionRecord, is_expert_tensor
from ..checkpoint.reader import Checkpoint, open_checkpoint
from ..checkpoint.safetensors_io import CheckpointError, open_regular, stat_regular
from ..formats import FormatError
from ..formats.modes import mode_codec
from ..formats.record import RecordLayout, layout_of, record_components, record_parts
from .descriptor import K3_T158_DESCRIPTOR, descriptor_for, validate_descriptor
from .manifest import MANIFEST_NAME, Manifest, ManifestError, Record, load_manifest


class RecordLocation(NamedTuple):
    """Where one record's bytes are: bank part index, absolute offset in it, length, digest."""

    part: int
    offset: int
    length: int
    sha256: str | None


class RecordHashError(CheckpointError):
    """A record's bytes do not hash to the manifest's `sha256`."""


class BankExpertLayout(ExpertLayout):
    """Experts stored as bank records. `name` is "bank-{mode}"; `codec` the mode's codec (ct-int
    modes: the dense layout). Reads are positional, so threads may read at once."""

    def __init__(self, cfg: ModelConfig, root: Path, manifest: Manifest, *,
                 verify_sha256: bool = False):
        self._cfg, self._root, self._manifest = cfg, root, manifest
        self.verify_sha256 = verify_sha256
        where = root / MANIFEST_NAME
        mode, bits = manifest.quantization["mode"], manifest.quantization["bits"]
        try:
            self.codec = mode_codec(mode, bits)
            self._components = record_components(mode, cfg.expert_shapes, bits)
        except (ManifestError, FormatError) as e:
            raise CheckpointError(f"{where}: codec mode {mode!r} (bits {bits}) cannot hold the "
                                  f"config's experts: {e}") from None
        self.name = f"bank-{mode}"
        self.mode = mode
        if manifest.sidecar is None:
            raise CheckpointError(f"{where}: the manifest has no sidecar object, so it names no "
                                  f"bank parts to read records from")
        self._check_descriptor(where)
        # The layout the bank's records declare (all alike, rule 17): padded or not.
        first = manifest.records[0].segments if manifest.records else []
        self._layout: RecordLayout = layout_of(
            mode, bits, [(g.component, g.dtype, g.shape, g.length) for g in first])
        self._records: dict[tuple[int, int], Record] = {}
        self._check_records(where)
        self.layers = sorted({r.layer for r in manifest.records})
        for p in manifest.sidecar.parts:  # stat, not open: readers open what they read
            _check_part(root / p.file, p.size)
        self._fds: dict[int, int] = {}  # part -> fd, opened on first read

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    @property
    def root(self) -> Path:
        return self._root

    @property
    def layout(self) -> RecordLayout:
        """The record layout of the bank's mode for the config's expert shapes (built once)."""
        return self._layout

    def locate(self, layer: int, expert: int) -> RecordLocation:
        """Where one record's bytes are: KeyError when the artifact holds no such record."""
        r = self._records[int(layer), int(expert)]
        start = self._manifest.sidecar.parts[r.part].data_start
        return RecordLocation(r.part, start + r.sidecar_offset, r.sidecar_length, r.sha256)

    def _check_descriptor(self, where: Path) -> None:
        m, cfg = self._manifest, self._cfg
        layers = sorted({r.layer for r in m.records})
        try:
            if m.model_key == K3_T158_DESCRIPTOR.model_key:
                desc = K3_T158_DESCRIPTOR
            else:
                desc = descriptor_for(cfg, m.quantization["mode"], m.quantization["bits"],
                                      layers=layers)
            validate_descriptor(m, desc)
        except ManifestError as e:
            raise CheckpointError(f"{where}: does not match config.json: {e}") from None
        if [(c, dt, tuple(sh), n) for c, dt, sh, n in desc.components] != self._components:
            raise CheckpointError(f"{where}: the record components of {desc.model_key} do not "
                                  f"fit the config's expert shapes {cfg.expert_shapes}")

    def _check_records(self, where: Path) -> None:
        """Segments contiguous from the record start in the record's own part (one read each);
        for authoritative manifests rule 14 already holds, others are checked here."""
        parts = self._manifest.sidecar.parts
        for r in self._manifest.records:
            if r.sidecar_offset is None:
                raise CheckpointError(f"{where}: record (layer {r.layer}, expert {r.expert}) has "
                                      f"no sidecar extent")
            p = parts[r.part]
            pos = p.data_start + r.sidecar_offset
            for s in r.segments:
                if s.shard != p.file or s.offset != pos:
                    raise CheckpointError(
                        f"{where}: record (layer {r.layer}, expert {r.expert}) segment "
                        f"{s.component} is at {s.shard!r} offset {s.offset}, expected "
                        f"{p.file!r} offset {pos} (records must be contiguous in one part)")
                pos += s.length
            self._records[r.layer, r.expert] = r

    def _record(self, layer: int, expert: int) -> Record:
        try:
            return self._records[layer, expert]
        except KeyError:
            raise CheckpointError(f"{self._root}: the artifact holds no record for layer {layer} "
                                  f"(it holds routed layers {self.layers})") from None

    def read_bytes(self, layer: int, expert: int, *, verify_sha256: bool | None = None) -> bytes:
        """The record's raw bytes with one positional read; sha256 checked when asked (or when
        the layout was opened with verify_sha256)."""
        r = self._record(layer, expert)
        p = self._manifest.sidecar.parts[r.part]
        offset = p.data_start + r.sidecar_offset
        if r.part not in self._fds:
            self._fds[r.part] = _open_part(self._root / p.file, p.size)
        data = os.pread(self._fds[r.part], r.sidecar_length, offset)
        if len(data) != r.sidecar_length:
            raise CheckpointError(f"{self._root / p.file}: short read of record (layer {layer}, "
                                  f"expert {expert}): {len(data)} of {r.sidecar_length} bytes at "
                                  f"offset {offset}")
        verify = self.verify_sha256 if verify_sha256 is None else verify_sha256
        if verify:
            if r.sha256 is None:
                raise RecordHashError(f"{self._root}: record (layer {layer}, expert {expert}) has "
                                      f"no sha256 in the manifest to verify against")
            got = hashlib.sha256(data).hexdigest()
            if got != r.sha256:
                raise RecordHashError(f"{self._root / p.file}: record (layer {layer}, expert "
                                      f"{expert}) at offset {offset} hashes to {got}, the manifest "
                                      f"says {r.sha256}")
        return data

    def read(self, layer: int, expert: int, *, verify_sha256: bool | None = None) -> ExpertRecord:
        data = self.read_bytes(layer, expert, verify_sha256=verify_sha256)
        parts = record_parts(self._layout, data)
        shapes = self._cfg.expert_shapes
        return ExpertRecord(layer, expert, {
            proj: ProjectionRecord(self.codec, shapes[proj], comps)
            for proj, comps in parts.items()})

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def _check_part(path: Path, size: int) -> None:
    """A bank part must be a regular file (not a symlink, FIFO or device) of the manifest's size;
    checked with lstat so nothing is opened (opening a FIFO would block)."""
    st = stat_regular(path, follow_symlinks=False, what="bank part")
    if st.st_size != size:
        raise CheckpointError(f"{path}: bank part is {st.st_size} bytes; the manifest says {size} "
                              "bytes")


def _open_part(path: Path, size: int) -> int:
    """lstat, then O_NOFOLLOW | O_NONBLOCK and fstat (`open_regular`): a FIFO or device put in
    a part's place after open time fails at once instead of blocking the read."""
    fd = open_regular(path, follow_symlinks=False, what="bank part")
    size_now = os.fstat(fd).st_size
    if size_now != size:
        os.close(fd)
        raise CheckpointError(f"{path}: bank part is {size_now} bytes; the manifest says {size} "
                              "bytes")
    return fd


def open_artifact(path: str | os.PathLike, *, manifest: Manifest | None = None,
                  verify_sha256: bool = False) -> Checkpoint:
    """Open a streaming artifact: its manifest (parsed here once, unless given), the resident
    shards through the checkpoint reader (in the form of the manifest's `resident_dtype`), the
    bank checked against config and manifest. The returned Checkpoint's `experts` is the
    BankExpertLayout (`locate`, `layout`, `manifest`)."""
    root = Path(path)
    if manifest is None:
        manifest = load_manifest(root / MANIFEST_NAME)  # ManifestError is a CheckpointError

    def bank(config: ModelConfig, where: dict) -> BankExpertLayout:
        _check_manifest_residents(manifest, where, root)
        return BankExpertLayout(config, root, manifest, verify_sha256=verify_sha256)

    return open_checkpoint(root, experts=bank, resident_dtype=manifest.resident_dtype)


def open_source(path: str | os.PathLike, *, verify_sha256: bool = False) -> Checkpoint:
    """Any model directory: a streaming artifact (it holds expert-manifest.json) or a checkpoint
    the reader accepts."""
    root = Path(path)
    if is_artifact(root):
        return open_artifact(root, verify_sha256=verify_sha256)
    return open_checkpoint(root)


def is_artifact(path: str | os.PathLike) -> bool:
    """Whether `path` holds an expert manifest (a symlink in its place counts: load refuses it)."""
    m = Path(path) / MANIFEST_NAME
    return m.exists() or m.is_symlink()


def _check_manifest_residents(manifest: Manifest, where: dict, root: Path) -> None:
    """Each manifest resident tensor is where the shard headers put it (same shard, absolute
    extent, dtype, shape); no routed-expert tensor sits beside the bank."""
    for t in manifest.resident_tensors:
        holder = where.get(t.tensor)
        if holder is None or holder.path.name != t.shard:
            raise CheckpointError(f"{root / MANIFEST_NAME}: resident tensor {t.tensor!r} is not "
                                  f"in {t.shard} according to the index")
        info = holder.tensors[t.tensor]
        if (info.start, info.nbytes, info.dtype, info.shape) != (t.offset, t.length, t.dtype,
                                                                  tuple(t.shape)):
            raise CheckpointError(
                f"{holder.path}: tensor {t.tensor!r} is {info.dtype}{list(info.shape)} at "
                f"[{info.start}, {info.end}), {MANIFEST_NAME} says {t.dtype}{list(t.shape)} at "
                f"[{t.offset}, {t.offset + t.length})")
    for name, shard in where.items():
        if is_expert_tensor(name):
            raise CheckpointError(f"{shard.path}: routed-expert tensor {name!r} beside the "
                                  f"bank parts of a streaming artifact")
