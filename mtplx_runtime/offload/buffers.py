"""Page-aligned host buffers and the optional GPU read path (FORMAT.md "Reading
records at run time").

O_DIRECT needs buffer addresses on 4 KiB boundaries; Python `bytes`/`bytearray` give no such
guarantee, anonymous `mmap` memory always does. kvikio and cupy are optional (the `gpu` extra):
they are imported only inside functions, never at module import, and availability is decided by
`cupy.is_available()`, never by probing with calls that raise on a host without a driver.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

import numpy as np

PAGE_BYTES = 4096
HUGE_PAGE_BYTES = 2 << 20  # x86-64 transparent huge page


def buffer_address(buf) -> int:
    """Address of the first byte of a C-contiguous buffer (numpy array, memoryview, mmap)."""
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8).__array_interface__["data"][0]


def aligned_buffer(nbytes: int, alignment: int = PAGE_BYTES) -> np.ndarray:
    """A zeroed uint8 array [nbytes] backed by anonymous mmap memory, `alignment`-aligned.

    Allocate once and reuse (pool them): each call maps fresh pages. The array keeps the
    mapping alive; it is released when the last view is garbage-collected.
    """
    if nbytes <= 0:
        raise ValueError(f"aligned_buffer: nbytes must be >= 1, got {nbytes}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"aligned_buffer: alignment must be a power of two, got {alignment}")
    # mmap is page-aligned; over-allocate only for alignments beyond the page size.
    slack = max(0, alignment - mmap.PAGESIZE)
    # Private, not mmap's default shared mapping: only private anonymous memory can get
    # transparent huge pages. Expert slots are streamed through by the kernels, and 2 MiB pages
    # (asked for where THP is in "madvise" mode) spare them TLB misses.
    m = mmap.mmap(-1, nbytes + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes + slack >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            m.madvise(mmap.MADV_HUGEPAGE)
    arr = np.frombuffer(m, dtype=np.uint8)
    skip = (-buffer_address(arr)) % alignment
    return arr[skip:skip + nbytes]


def gpu_reader_unavailable_reason() -> str | None:
    """None when cupy and kvikio import and cupy sees a device; else why the GPU reader is off.

    Never raises: a missing package, a missing libcufile (kvikio raises a non-ImportError at
    import) or a host without a CUDA driver all come back as the reason. The broad catches below
    are that contract: a broken GPU install must not break the CPU path.
    """
    try:
        import cupy
    except ImportError as e:
        return f"cupy is not installed ({e})"
    except Exception as e:
        return f"cupy failed to import: {type(e).__name__}: {e}"
    try:
        if not cupy.is_available():
            return "cupy.is_available() is False (no CUDA driver or device)"
    except Exception as e:
        return f"cupy.is_available() failed: {type(e).__name__}: {e}"
    try:
        import kvikio  # noqa: F401
    except ImportError as e:
        return f"kvikio is not installed ({e})"
    except Exception as e:
        return f"kvikio failed to import: {type(e).__name__}: {e}"
    return None


class KvikioReader:
    """Record reads straight into cupy device buffers through kvikio `CuFile.pread` (GDS or its
    POSIX compatibility mode). Constructed only where `gpu_reader_unavailable_reason()` is None;
    elsewhere the constructor raises RuntimeError with the reason. Leave KVIKIO_COMPAT_MODE unset
    or AUTO: OFF can hang the CuFile constructor.
    """

    def __init__(self, root: str | os.PathLike, parts: list[tuple[str, int]]):
        reason = gpu_reader_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"KvikioReader unavailable: {reason}; use RecordReader instead")
        import kvikio

        self._kvikio = kvikio
        self.root = Path(root)
        self.parts = [(str(p[0]), int(p[1])) for p in parts]
        self._files: dict[int, object] = {}

    def read_into(self, part: int, offset: int, length: int, dev_buf):
        """Start reading `length` bytes at `offset` of `part` into the cupy array `dev_buf`
        (at least `length` bytes). Returns kvikio's IOFuture; `.get()` blocks and gives bytes read.
        """
        name, size = self.parts[part]
        if offset < 0 or length <= 0 or offset + length > size:
            raise ValueError(f"{name}: read [{offset}, +{length}) outside the part ({size} B)")
        if dev_buf.nbytes < length:
            raise ValueError(f"device buffer holds {dev_buf.nbytes} B, read needs {length}")
        f = self._files.get(part)
        if f is None:
            f = self._files[part] = self._kvikio.CuFile(self.root / name, "r")
        return f.pread(dev_buf, length, offset)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> KvikioReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
