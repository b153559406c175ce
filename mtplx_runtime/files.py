"""Opening, reading and writing files safely: the layer under every reader and writer.

FORMAT.md "What the readers validate". A file the runtime reads must be a regular file: it is
stat-ed first and a FIFO, directory, device or socket is refused without being opened, then
opened O_NONBLOCK and re-checked with fstat, so nothing swapped in between can block either. It
is read within a size cap. A member of a model directory must stay inside that directory: the
file actually opened (not the path asked for) must resolve under the directory, whatever
symlinks sit in between; a Hugging Face cache snapshot, whose files link into its sibling
`blobs/`, is the one exception. A file that replaces another is written under a temporary
name in the same directory and renamed over it, so a reader sees the old file or the new one.

    path -> stat (lstat) -> refuse non-regular -> open O_NONBLOCK [O_NOFOLLOW] -> fstat
         -> [the opened file's real path under the root] -> fd -> bounded read | SHA-256
    data -> .NAME.XXXXXXXX.partial (O_EXCL, [fsync]) -> rename (or hard link) -> [fsync dir]

Errors are `InputError` (or the caller's subclass of it) naming the path: the base class of
every loader's error (CheckpointError, TraceError, TokenizerError, PresetError).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

__all__ = ["HASH_CHUNK", "InputError", "atomic_write", "check_inside", "fsync_dir", "inside",
           "memory_available_bytes", "open_regular", "read_fd", "read_regular", "sha256_fd",
           "sha256_file", "stat_regular"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
HASH_CHUNK = 8 << 20  # hashlib releases the GIL on updates this large: files hash in parallel


class InputError(ValueError):
    """An input (a file, a directory, a spec) that cannot be read as claimed; the message names
    it and, where there is one, the key or line. Every loader's error derives from it."""


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return what
    return "not a regular file"


def stat_regular(path: str | os.PathLike, *, follow_symlinks: bool = True,
                 error: type[Exception] = InputError, what: str = "file") -> os.stat_result:
    """The stat of `path` when it is a regular file (lstat when symlinks are refused); a FIFO,
    directory, device, socket or (refused) symlink is an `error` naming the path, and nothing
    is opened, so nothing can block."""
    try:
        st = os.stat(path) if follow_symlinks else os.lstat(path)
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except OSError as e:
        raise error(f"{path}: cannot examine the {what}: {e.strerror}") from None
    except ValueError:  # a NUL byte: no file has that name
        raise error(f"{str(path)[:200]!r}: not a file name (it holds a NUL byte)") from None
    if stat.S_ISLNK(st.st_mode):
        raise error(f"{path}: is a symlink (the {what} is read without following symlinks)")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: not a regular file ({_kind(st.st_mode)}); the {what} must be one")
    return st


def _bases(root: str | os.PathLike) -> list[str]:
    """The real directories a member of `root` may resolve into: the root, and for a Hugging
    Face cache snapshot (`.../snapshots/<rev>`) the sibling `blobs/` its files link into."""
    real = os.path.realpath(root)
    bases = [real]
    parent = os.path.dirname(real)
    blobs = os.path.join(os.path.dirname(parent), "blobs")
    if (os.path.basename(parent) == "snapshots" and os.path.isdir(blobs)
            and not os.path.islink(blobs)):
        bases.append(os.path.realpath(blobs))
    return bases


def _under(real: str, bases: list[str]) -> bool:
    return any(real.startswith(b.rstrip(os.sep) + os.sep) for b in bases)


def check_inside(fd: int, path: str | os.PathLike, root: str | os.PathLike, *,
                 error: type[Exception] = InputError, what: str = "file") -> None:
    """Refuse the open file `fd` (opened as `path`) unless it lies inside the directory `root`
    (FORMAT.md "Verifying and reading": members MUST NOT escape the artifact root). The path
    checked is the one the kernel opened (/proc/self/fd), so a symlink or directory renamed
    between a check and the open cannot slip past; without /proc, `path` is resolved and must
    still be the file `fd` holds."""
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        real = ""
    if not real.startswith(os.sep):  # no /proc (or an fd without a path): resolve the path
        real = os.path.realpath(path)
        fst = os.fstat(fd)
        try:
            st = os.stat(real)
        except OSError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != (fst.st_dev, fst.st_ino):
            raise error(f"{path}: changed while it was opened; the {what} is not read")
    if not _under(real, _bases(root)):
        raise error(f"{path}: resolves to {real}, outside {root}; the {what} must not leave "
                    "the model directory")


def inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether `path` resolves inside `root` (or a Hugging Face snapshot's blobs) now: a check
    without opening, for files that are stat-ed at one time and opened at another."""
    return _under(os.path.realpath(path), _bases(root))


def open_regular(path: str | os.PathLike, *, root: str | os.PathLike | None = None,
                 follow_symlinks: bool = True, error: type[Exception] = InputError,
                 what: str = "file") -> int:
    """A read-only fd of the regular file `path`, never blocking: the path is stat-ed first
    (lstat when symlinks are refused) and a FIFO, directory, device or socket is refused
    without opening it; the open itself is O_NONBLOCK (and O_NOFOLLOW when refusing symlinks)
    and re-checked with fstat, so a file swapped in between cannot block either. With `root`,
    the file opened must lie inside that directory (`check_inside`). Errors are `error` (an
    InputError subclass) naming the path."""
    stat_regular(path, follow_symlinks=follow_symlinks, error=error, what=what)
    flags = os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK | (0 if follow_symlinks else _O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except OSError as e:
        if not follow_symlinks and os.path.islink(path):
            raise error(f"{path}: is a symlink (the {what} is read without following "
                        "symlinks)") from None
        raise error(f"{path}: cannot open the {what}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: not a regular file ({_kind(st.st_mode)}); the {what} must be one")
        if root is not None:
            check_inside(fd, path, root, error=error, what=what)
        if _O_NONBLOCK:
            os.set_blocking(fd, True)  # no effect on regular-file reads; plain fd from here
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_fd(fd: int, *, limit: int, path: str | os.PathLike,
            error: type[Exception] = InputError, what: str = "file") -> bytes:
    """The bytes of the open regular file `fd` from its current offset, at most `limit` of
    them: a larger file is an `error` naming `path` before anything is read."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise error(f"{path}: {size} bytes exceeds the {limit}-byte size cap for the {what}")
    chunks, total = [], 0
    while chunk := os.read(fd, min(16 << 20, limit + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:  # the file grew after fstat
            raise error(f"{path}: exceeds the {limit}-byte size cap for the {what}")
    return b"".join(chunks)


def read_regular(path: str | os.PathLike, *, limit: int, root: str | os.PathLike | None = None,
                 follow_symlinks: bool = True, error: type[Exception] = InputError,
                 what: str = "file") -> bytes:
    """The bytes of the regular file `path` (`open_regular`), at most `limit` of them."""
    fd = open_regular(path, root=root, follow_symlinks=follow_symlinks, error=error, what=what)
    try:
        return read_fd(fd, limit=limit, path=path, error=error, what=what)
    finally:
        os.close(fd)


def sha256_fd(fd: int) -> tuple[int, str]:
    """(size, SHA-256 hex) of everything the open file `fd` holds, read with pread from offset
    0 (the fd's own offset is left alone, so a reader sharing it is not disturbed)."""
    h, pos = hashlib.sha256(), 0
    while chunk := os.pread(fd, HASH_CHUNK, pos):
        h.update(chunk)
        pos += len(chunk)
    return pos, h.hexdigest()


def sha256_file(path: str | os.PathLike, *, root: str | os.PathLike | None = None,
                error: type[Exception] = InputError) -> tuple[int, str]:
    """(size, SHA-256 hex) of the regular file `path` (`open_regular`)."""
    fd = open_regular(path, root=root, error=error)
    try:
        return sha256_fd(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, so the names a rename or link put there survive a power cut."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: bytes | bytearray | memoryview | Iterable,
                 *, durable: bool = False, mode: int = 0o644, replace: bool = True) -> None:
    """Write `data` (bytes-like, or an iterable of bytes-like chunks) to `path` as one step: into
    `.NAME.XXXXXXXX.partial` beside it (created exclusively with `mode`, so nothing planted at
    that name is followed or overwritten), then renamed over `path`. `durable`: fsync the file
    before the rename and the directory after (for outputs that must survive a power cut;
    caches skip it). `replace=False` publishes with a hard link instead: FileExistsError when
    `path` exists. OSError propagates, with the temporary file removed."""
    path = Path(path)
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
        try:
            fd = os.open(tmp, flags, mode)
            break
        except FileExistsError:  # another writer's temporary name: draw again
            continue
    try:
        with open(fd, "wb", closefd=True) as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(OSError):  # already renamed, or the directory is gone
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def memory_available_bytes() -> int:
    """What this machine can still give a process: MemAvailable from /proc/meminfo, else the
    physical memory. Readers bound what an input asks them to allocate against it."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
