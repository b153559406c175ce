"""Lazy, hostile-input-safe safetensors reading and a small streaming writer.

A safetensors file is `u64 header_len (LE) | JSON header | data`; the header maps each tensor
name to `{dtype, shape, data_offsets: [begin, end)}` relative to the data section, plus an
optional `__metadata__` string map. We parse the header ourselves (instead of `safetensors`'
mmap loader) so that nothing but the header is read until a tensor is asked for, BF16 can come
back as uint16 bits, and every malformation gets an error that names the file.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..files import InputError, atomic_write, open_regular
from ..formats.base import ST_DTYPES

# The safetensors reference implementation refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000

class CheckpointError(InputError):
    """A checkpoint file or directory that cannot be read as claimed; the message names the file."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors tag
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    end: int  # absolute file offset one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """`json.loads` hook: a repeated key is an error (JSON silently keeps the last one)."""
    seen: dict = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"duplicate key {k!r}")
        seen[k] = v
    return seen


class SafetensorsFile:
    """One safetensors file: header parsed and validated at open, tensors read on demand."""

    def __init__(self, path: str | os.PathLike, *, root: str | os.PathLike | None = None):
        """`root`: the model directory the file belongs to, which it must not leave (symlinks
        included; FORMAT.md "What the readers validate")."""
        self.path = Path(path)
        self._fd = -1
        self._fd = open_regular(self.path, root=root, error=CheckpointError,
                                what="safetensors file")
        try:
            self.size = os.fstat(self._fd).st_size
            self.metadata, self.tensors = self._parse_header()
        except BaseException:
            self.close()
            raise

    def _fail(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {why}")

    def _parse_header(self) -> tuple[dict[str, str], dict[str, TensorInfo]]:
        if self.size < 8:
            raise self._fail(f"truncated: {self.size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(os.pread(self._fd, 8, 0), "little")
        if n > MAX_HEADER_BYTES:
            raise self._fail(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
        if 8 + n > self.size:
            raise self._fail(f"truncated: header claims {n} bytes, file has {self.size - 8}")
        raw = os.pread(self._fd, n, 8)
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
        except (UnicodeDecodeError, ValueError) as e:
            raise self._fail(f"header is not valid JSON: {e}") from None
        except RecursionError:
            raise self._fail("header is not valid JSON: nested too deeply") from None
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise self._fail("__metadata__ must map strings to strings")
        data_start = 8 + n
        tensors = {name: self._tensor_info(name, spec, data_start) for name, spec in header.items()}
        # Tensors must tile the data section exactly: no overlaps, no holes, nothing past EOF.
        pos = data_start
        for t in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
            if t.start != pos:
                kind = "overlaps another tensor" if t.start < pos else "leaves a hole before it"
                raise self._fail(f"tensor {t.name!r} {kind} (offset {t.start - data_start})")
            pos = t.end
        if pos != self.size:
            if pos > self.size:
                raise self._fail(f"truncated: data ends at {pos}, file has {self.size} bytes")
            raise self._fail(f"{self.size - pos} trailing bytes after the last tensor")
        return metadata, tensors

    def _tensor_info(self, name: str, spec: object, data_start: int) -> TensorInfo:
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
            raise self._fail(f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
        dtype, shape, offs = spec["dtype"], spec["shape"], spec["data_offsets"]
        if type(dtype) is not str or dtype not in ST_DTYPES:
            raise self._fail(f"tensor {name!r}: unknown dtype {dtype!r}")
        ints = lambda xs: isinstance(xs, list) and all(  # noqa: E731
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs
        )
        if not ints(shape) or not ints(offs) or len(offs) != 2 or offs[0] > offs[1]:
            raise self._fail(f"tensor {name!r}: bad shape {shape!r} or data_offsets {offs!r}")
        want = int(np.prod(shape, dtype=object)) * ST_DTYPES[dtype].itemsize
        if offs[1] - offs[0] != want:
            raise self._fail(
                f"tensor {name!r}: {dtype}{shape} needs {want} bytes, data_offsets span "
                f"{offs[1] - offs[0]}"
            )
        return TensorInfo(name, dtype, tuple(shape), data_start + offs[0], data_start + offs[1])

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise self._fail(f"no tensor {name!r}") from None

    def read_bytes(self, name: str) -> bytes:
        return self.read_range(name, 0, self.info(name).nbytes)

    def read_range(self, name: str, offset: int, nbytes: int) -> bytes:
        """`nbytes` bytes of tensor `name` starting `offset` bytes into its data (one pread)."""
        t = self.info(name)
        if offset < 0 or nbytes < 0 or offset + nbytes > t.nbytes:
            raise self._fail(f"range [{offset}, {offset + nbytes}) outside {name!r} ({t.nbytes} B)")
        data = os.pread(self._fd, nbytes, t.start + offset)
        if len(data) != nbytes:  # the file shrank after open
            raise self._fail(f"short read of {name!r}: {len(data)} of {nbytes} bytes")
        return data

    def read(self, name: str) -> np.ndarray:
        """The tensor as a fresh numpy array (BF16 as uint16 bits)."""
        t = self.info(name)
        arr = np.frombuffer(self.read_bytes(name), dtype=ST_DTYPES[t.dtype])
        return arr.reshape(t.shape).copy()

    def fileno(self) -> int:
        """The descriptor every read goes through (integrity checks hash through it too)."""
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            os.close(fd)


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, tuple[str, np.ndarray]] | Iterable[tuple[str, str, np.ndarray]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `{name: (st_dtype, array)}` in name order, atomically (`files.atomic_write`:
    temporary file, fsync, rename).

    The header is compact JSON space-padded to a multiple of 8 so the data section starts
    8-aligned, as the safetensors library writes it.
    """
    items = sorted(
        ((n, d, a) for n, (d, a) in tensors.items())
        if isinstance(tensors, Mapping)
        else tensors
    )
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    off = 0
    for name, st_dtype, arr in items:
        want = ST_DTYPES[st_dtype]
        if arr.dtype.itemsize != want.itemsize:
            raise ValueError(f"{name}: array dtype {arr.dtype} does not fit safetensors {st_dtype}")
        header[name] = {"dtype": st_dtype, "shape": list(arr.shape),
                        "data_offsets": [off, off + arr.nbytes]}
        off += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    data = (np.ascontiguousarray(arr).astype(ST_DTYPES[st_dtype], copy=False).tobytes()
            for _, st_dtype, arr in items)  # one tensor's bytes at a time
    atomic_write(path, itertools.chain([len(raw).to_bytes(8, "little"), raw], data),
                 durable=True)
