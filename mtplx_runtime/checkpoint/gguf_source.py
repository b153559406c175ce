"""open_gguf_source: the K3 GGUF Q2_K source (FORMAT.md "q2k"), validated at open.

    DIR/config.json (official nested K3 config)
    DIR/{prefix}-00001-of-0000M.gguf ... {prefix}-0000M-of-0000M.gguf   (or exactly one *.gguf)

Only headers are read at open, with our own bounded parser (pread, no mmap), so a hostile file
gets an error naming it instead of a numpy exception. Per file: magic `GGUF`, version 3;
metadata `split.no` = file number - 1, `split.count` = M, `split.tensors.count` = the total
tensor count over all files (what gguf-py and llama.cpp write; the per-file count the spec
names is also accepted); `general.alignment` u32, a power of two (default 32); every tensor 1..4
dims, GGML type BF16 (30), F32 (0) or Q2_K (10), offset a multiple of the alignment, span inside
the file, spans not overlapping. Across files: names unique; Q2_K tensors are exactly
`blk.{L}.ffn_{gate|up|down}_exps.weight` for every MoE layer L (0-based model index) with GGUF
dims (cols, rows, E) of the config's expert shapes, a layer's three in one file; the resident
text tensors match `resident_tensor_specs(cfg)` with shape = GGUF dims reversed.

Reading: expert e of a merged tensor is bytes `[start + e*S, start + (e+1)*S)`, S = bytes / E,
with one pread per projection, never the whole tensor. Codec `Q2KCodec` (formats/q2k.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..files import open_regular
from ..formats.q2k import BLOCK_BYTES, BLOCK_ELEMS, Q2KCodec
from .config import ModelConfig
from .layouts import ExpertRecord, ProjectionRecord
from .residents import check_residents
from .safetensors_io import CheckpointError, TensorInfo

CONFIG = "config.json"
GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32
# GGML type id -> (tag, bytes per block, values per block); nothing else may appear.
GGML_TYPES = {0: ("F32", 4, 1), 30: ("BF16", 2, 1), 10: ("Q2_K", BLOCK_BYTES, BLOCK_ELEMS)}
NUMPY_DTYPES = {"F32": np.dtype("<f4"), "BF16": np.dtype("<u2")}  # BF16 as raw bits
PROJECTIONS = ("gate", "up", "down")
SHARD_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")
# Bounded digit run: int() of a longer one is a ValueError (and no layer number is that long).
EXPERT_NAME = re.compile(r"blk\.(\d{1,9})\.ffn_(gate|up|down)_exps\.weight")

# Bounds on a hostile header (the K3 headers hold a ~160k-entry tokenizer, a few MB).
MAX_HEADER_BYTES = 1 << 30
MAX_COUNT = 1 << 24  # tensors, metadata entries, array entries
MAX_STRING = 1 << 24
_CHUNK = 1 << 20
# GGUF metadata value type -> struct format of a scalar; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_INTS = {0, 1, 2, 3, 4, 5, 10, 11}
_STRING, _ARRAY, _U32 = 8, 9, 4


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of a GGUF file. `dims` in GGML order (fastest first); `shape` = row-major."""

    name: str
    dtype: str  # "BF16" | "F32" | "Q2_K"
    ggml_type: int
    dims: tuple[int, ...]
    start: int  # absolute file offset
    end: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class _Cursor:
    """Sequential little-endian reads over a file with pread, bounds-checked."""

    def __init__(self, fd: int, size: int, path: Path):
        self.fd, self.size, self.path = fd, size, path
        self.pos, self._base, self._buf = 0, 0, b""

    def take(self, n: int) -> bytes:
        if n > self.size - self.pos or self.pos + n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{self.path}: truncated header: {n} bytes needed at offset "
                                  f"{self.pos}, file has {self.size}")
        lo = self.pos - self._base
        if lo < 0 or lo + n > len(self._buf):
            self._buf, self._base, lo = os.pread(self.fd, max(n, _CHUNK), self.pos), self.pos, 0
        self.pos += n
        return self._buf[lo:lo + n]

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, what: str) -> int:
        n = self.unpack("<Q")
        if n > MAX_COUNT:
            raise CheckpointError(f"{self.path}: {what} {n} exceeds the limit {MAX_COUNT}")
        return n

    def string(self, what: str) -> str:
        n = self.unpack("<Q")
        if n > MAX_STRING:
            raise CheckpointError(f"{self.path}: {what} of {n} bytes exceeds {MAX_STRING}")
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: {what} at offset {self.pos - n} is not "
                                  f"UTF-8") from None

    def value(self, vtype: int, key: str, depth: int = 0):
        """A metadata value: scalars and strings kept; arrays skipped, returned as None."""
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string(f"metadata {key!r} string")
        if vtype != _ARRAY or depth > 2:
            raise CheckpointError(f"{self.path}: metadata {key!r} has unknown value type {vtype}")
        item = self.unpack("<I")
        n = self.count(f"metadata {key!r} array length")
        if item in _SCALARS:  # fixed size: skip without reading
            step = struct.calcsize(_SCALARS[item]) * n
            if step > self.size - self.pos:
                raise CheckpointError(f"{self.path}: truncated header in metadata {key!r}")
            self.pos += step
        else:
            for _ in range(n):
                self.value(item, key, depth + 1)
        return None


class GGUFFile:
    """One GGUF file: header parsed and validated at open, data read on demand with pread."""

    def __init__(self, path: str | os.PathLike, *, root: str | os.PathLike | None = None):
        self.path = Path(path)
        self._fd = -1
        # never blocks on a FIFO; inside the source directory `root` when given
        self._fd = open_regular(self.path, root=root, error=CheckpointError, what="GGUF file")
        try:
            self.size = os.fstat(self._fd).st_size
            self._parse()
        except BaseException:
            self.close()
            raise

    def _fail(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {why}")

    def _parse(self) -> None:
        cur = _Cursor(self._fd, self.size, self.path)
        if self.size < 24 or cur.take(4) != GGUF_MAGIC:
            raise self._fail("not a GGUF file (magic 'GGUF' missing or file too short)")
        version = cur.unpack("<I")
        if version != GGUF_VERSION:
            raise self._fail(f"GGUF version {version}, expected {GGUF_VERSION}")
        n_tensors, n_kv = cur.count("tensor count"), cur.count("metadata count")
        self.metadata: dict[str, object] = {}
        types: dict[str, int] = {}
        for _ in range(n_kv):
            key = cur.string("metadata key")
            vtype = cur.unpack("<I")
            if key in self.metadata:
                raise self._fail(f"metadata key {key!r} appears twice")
            self.metadata[key], types[key] = cur.value(vtype, key), vtype
        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        a = self.alignment
        if "general.alignment" in types and types["general.alignment"] != _U32 or not (
            isinstance(a, int) and a > 0 and a & (a - 1) == 0
        ):
            raise self._fail(f"general.alignment {a!r} must be a u32 power of two")
        raw = [self._tensor_entry(cur) for _ in range(n_tensors)]
        self.data_start = -(-cur.pos // a) * a
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, gtype, offset in raw:
            if name in self.tensors:
                raise self._fail(f"tensor {name!r} appears twice")
            tag, block_bytes, block_elems = GGML_TYPES[gtype]
            if offset % a:
                raise self._fail(f"tensor {name!r}: offset {offset} is not a multiple of the "
                                 f"alignment {a}")
            n = 1
            for x in dims:
                n *= x
            start = self.data_start + offset
            t = GGUFTensor(name, tag, gtype, dims, start, start + n // block_elems * block_bytes)
            if t.end > self.size:
                raise self._fail(f"truncated: tensor {name!r} ends at {t.end}, file has "
                                 f"{self.size} bytes")
            self.tensors[name] = t
        prev = None
        for t in sorted(self.tensors.values(), key=lambda t: (t.start, t.end)):
            if prev is not None and t.start < prev.end:
                raise self._fail(f"tensor {t.name!r} overlaps tensor {prev.name!r}")
            prev = t

    def _tensor_entry(self, cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string("tensor name")
        ndims = cur.unpack("<I")
        if not 1 <= ndims <= 4:
            raise self._fail(f"tensor {name!r}: {ndims} dimensions, expected 1..4")
        dims = tuple(cur.unpack("<Q") for _ in range(ndims))
        gtype, offset = cur.unpack("<I"), cur.unpack("<Q")
        if gtype not in GGML_TYPES:
            ok = ", ".join(f"{tag} ({k})" for k, (tag, _, _) in GGML_TYPES.items())
            raise self._fail(f"tensor {name!r} has GGML type {gtype}; only {ok} are accepted")
        if any(x == 0 for x in dims) or dims[0] % GGML_TYPES[gtype][2]:
            raise self._fail(f"tensor {name!r}: dims {list(dims)} invalid for "
                             f"{GGML_TYPES[gtype][0]}")
        return name, dims, gtype, offset

    def split_value(self, key: str) -> int | None:
        v = self.metadata.get(key)
        if key in self.metadata and not (isinstance(v, int) and not isinstance(v, bool)):
            raise self._fail(f"metadata {key!r} = {v!r} is not an integer")
        return v

    def pread(self, name: str, offset: int, nbytes: int) -> bytes:
        """`nbytes` of tensor `name` from `offset` bytes into its data (one pread)."""
        t = self.tensors[name]
        if offset < 0 or nbytes < 0 or offset + nbytes > t.nbytes:
            raise self._fail(f"range [{offset}, {offset + nbytes}) outside {name!r} "
                             f"({t.nbytes} B)")
        data = os.pread(self._fd, nbytes, t.start + offset)
        if len(data) != nbytes:  # the file shrank after open
            raise self._fail(f"short read of {name!r}: {len(data)} of {nbytes} bytes")
        return data

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


class GGUFSource:
    """A validated K3 GGUF source with `Checkpoint`'s surface (layout "q2k"). `tensor_names`,
    `tensor_info` and `tensor` cover the resident BF16/F32 tensors only; experts come from
    `expert()` (or `expert_extent()` for the raw bytes). Reads are pread; thread-safe."""

    layout = "q2k"

    def __init__(self, path: Path, config: ModelConfig, files: list[GGUFFile]):
        self.path, self.config, self._files = path, config, files
        self.codec = Q2KCodec()
        self._where: dict[str, GGUFFile] = {}
        for f in files:
            for name in f.tensors:
                if name in self._where:
                    raise CheckpointError(f"{f.path}: tensor {name!r} is also in "
                                          f"{self._where[name].path.name}")
                self._where[name] = f
        self._experts = self._check_experts()
        self._residents = {n: f for n, f in self._where.items() if f.tensors[n].dtype != "Q2_K"}
        check_residents(config, self._residents, str(path))

    def _check_experts(self) -> dict[tuple[int, str], GGUFTensor]:
        cfg, found = self.config, {}
        moe = f"{cfg.first_k_dense_replace}..{cfg.num_hidden_layers - 1}"
        for name, f in self._where.items():
            t, m = f.tensors[name], EXPERT_NAME.fullmatch(name)
            if t.dtype == "Q2_K" and m is None:
                raise CheckpointError(f"{f.path}: tensor {name!r} is Q2_K but is not a routed "
                                      f"expert tensor blk.L.ffn_{{gate|up|down}}_exps.weight")
            if m is None:
                continue
            layer, proj = int(m[1]), m[2]
            if t.dtype != "Q2_K":
                raise CheckpointError(f"{f.path}: tensor {name!r} is {t.dtype}, expected Q2_K")
            if not (layer < cfg.num_hidden_layers and cfg.is_moe_layer(layer)):
                raise CheckpointError(f"{f.path}: tensor {name!r} is for layer {layer}, which "
                                      f"is not an MoE layer of the config (MoE layers {moe})")
            rows, cols = cfg.expert_shapes[proj]
            want = (cols, rows, cfg.num_experts)
            if t.dims != want:
                raise CheckpointError(f"{f.path}: tensor {name!r} has GGUF dims {list(t.dims)}, "
                                      f"the config requires {list(want)} (row-major "
                                      f"{[cfg.num_experts, rows, cols]})")
            found[layer, proj] = t
        for layer in cfg.moe_layers:
            have = [p for p in PROJECTIONS if (layer, p) in found]
            if len(have) != 3:
                lacks = [f"blk.{layer}.ffn_{p}_exps.weight" for p in PROJECTIONS if p not in have]
                raise CheckpointError(f"{self.path}: MoE layer {layer} lacks {', '.join(lacks)}")
            homes = {self._where[found[layer, p].name].path.name for p in PROJECTIONS}
            if len(homes) != 1:
                raise CheckpointError(f"{self.path}: layer {layer}'s expert tensors are split "
                                      f"over files {sorted(homes)}; they must share one file")
        return found

    # ---- the Checkpoint surface ----

    def source_files(self) -> list[Path]:
        return [f.path for f in self._files]

    def tensor_names(self) -> list[str]:
        return sorted(self._residents)

    def has_tensor(self, name: str) -> bool:
        return name in self._residents

    def tensor_info(self, name: str) -> TensorInfo:
        t = self._resident(name).tensors[name]
        return TensorInfo(name, t.dtype, t.shape, t.start, t.end)

    def tensor(self, name: str) -> np.ndarray:
        """A resident tensor as a fresh array, row-major, BF16 as uint16 bits."""
        f = self._resident(name)
        t = f.tensors[name]
        data = np.frombuffer(f.pread(name, 0, t.nbytes), dtype=NUMPY_DTYPES[t.dtype])
        return data.reshape(t.shape).copy()

    def expert_tensor(self, layer: int, proj: str) -> tuple[Path, GGUFTensor]:
        """The merged Q2_K tensor of one layer and projection, and the file holding it."""
        self.config.check_expert_key(layer, 0)
        t = self._experts[layer, proj]
        return self._where[t.name].path, t

    def expert_extent(self, layer: int, expert: int, proj: str) -> tuple[Path, int, int]:
        """(file, absolute offset, length) of one expert projection's Q2_K bytes."""
        self.config.check_expert_key(layer, expert)
        t = self._experts[layer, proj]
        size = t.nbytes // self.config.num_experts
        return self._where[t.name].path, t.start + expert * size, size

    def expert(self, layer: int, expert: int) -> ExpertRecord:
        """Routed expert `expert` of MoE layer `layer` (0-based): one pread per projection."""
        self.config.check_expert_key(layer, expert)
        projections = {}
        for proj in PROJECTIONS:
            t = self._experts[layer, proj]
            shape = self.config.expert_shapes[proj]
            (spec,) = self.codec.components(shape)
            raw = self._where[t.name].pread(t.name, expert * spec.nbytes, spec.nbytes)
            weight = np.frombuffer(raw, dtype=np.uint8).reshape(spec.shape).copy()
            projections[proj] = ProjectionRecord(self.codec, shape, {"weight": weight})
        return ExpertRecord(layer, expert, projections)

    def resident_descriptor_sha256(self) -> str:
        """Resident descriptor digest (FORMAT.md "q2k") over the BF16/F32 tensors: per file n
        (1-based) and tensor by name, u16 n, u32 name length, name, u8 ndims, u64 per GGUF dim
        (GGML order), u32 GGML type, u64 absolute start, u64 length, little-endian."""
        h = hashlib.sha256()
        for n, f in enumerate(self._files, 1):
            for name in sorted(x for x in f.tensors if f.tensors[x].dtype != "Q2_K"):
                t, raw = f.tensors[name], name.encode("utf-8")
                h.update(struct.pack("<HI", n, len(raw)) + raw + struct.pack("<B", len(t.dims)))
                h.update(struct.pack(f"<{len(t.dims)}QIQQ", *t.dims, t.ggml_type, t.start,
                                     t.nbytes))
        return h.hexdigest()

    def _resident(self, name: str) -> GGUFFile:
        try:
            return self._residents[name]
        except KeyError:
            raise KeyError(f"{self.path}: no resident tensor {name!r}") from None

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> GGUFSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_gguf_source(path: str | os.PathLike) -> GGUFSource:
    """Open and validate a GGUF source directory; errors are CheckpointError naming the file."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a GGUF source directory")
    config = ModelConfig.from_file(root / CONFIG, root=root)
    files: list[GGUFFile] = []
    try:
        for p in _shard_paths(root):
            files.append(GGUFFile(p, root=root))
        _check_split(files)
        return GGUFSource(root, config, files)
    except BaseException:
        for f in files:
            f.close()
        raise


def _shard_paths(root: Path) -> list[Path]:
    """`{prefix}-NNNNN-of-MMMMM.gguf` numbered 1..M each once, or a single `*.gguf`."""
    found = sorted(p for p in root.iterdir() if p.name.endswith(".gguf"))
    if not found:
        raise CheckpointError(f"{root}: no .gguf files")
    matches = [SHARD_NAME.fullmatch(p.name) for p in found]
    if len(found) == 1 and matches[0] is None:
        return found
    for p, m in zip(found, matches):
        if m is None:
            raise CheckpointError(f"{p}: not named like a split GGUF shard "
                                  f"(PREFIX-NNNNN-of-MMMMM.gguf) beside other .gguf files")
    first = matches[0]
    prefix, count = first[1], int(first[3])
    by_number: dict[int, Path] = {}
    for p, m in zip(found, matches):
        if m[1] != prefix or int(m[3]) != count:
            raise CheckpointError(f"{p}: does not belong to the split set "
                                  f"{prefix}-*-of-{first[3]}.gguf")
        by_number[int(m[2])] = p
    if count == 0 or set(by_number) - set(range(1, count + 1)):
        bad = sorted(set(by_number) - set(range(1, count + 1)))
        raise CheckpointError(f"{by_number[bad[0]] if bad else found[0]}: shard number outside "
                              f"1..{count}")
    missing = [n for n in range(1, count + 1) if n not in by_number]
    if missing:
        names = ", ".join(f"{prefix}-{n:05d}-of-{count:05d}.gguf" for n in missing[:8])
        raise CheckpointError(f"{root}: {len(missing)} of {count} GGUF shards missing: {names}")
    return [by_number[n] for n in range(1, count + 1)]


def _check_split(files: list[GGUFFile]) -> None:
    """split.no / split.count / split.tensors.count agree with the file set."""
    total = sum(len(f.tensors) for f in files)
    for i, f in enumerate(files):
        no, count = f.split_value("split.no"), f.split_value("split.count")
        n_tensors = f.split_value("split.tensors.count")
        if len(files) == 1 and no is None and count is None and n_tensors is None:
            return
        if no != i or count != len(files):
            raise CheckpointError(f"{f.path}: split.no {no!r} / split.count {count!r}, expected "
                                  f"{i} / {len(files)} for file {i + 1} of {len(files)}")
        if n_tensors not in (total, len(f.tensors)):
            raise CheckpointError(f"{f.path}: split.tensors.count {n_tensors!r} matches neither "
                                  f"the total tensor count {total} nor this file's "
                                  f"{len(f.tensors)}")
