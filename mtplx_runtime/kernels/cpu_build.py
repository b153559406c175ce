"""Build the CPU kernel sources (`native/cpu/*.c` inside this package) into one shared library on
first use.

Every `.c` file of the source folder is compiled into `mtplx_cpu` (the C ABI is in
`native/cpu/mtplx_cpu.h`). The sources ship inside the package, so an installed wheel builds the
same library as a checkout. The library lands outside the package, in `$MTPLX_NATIVE_DIR`
(default `$XDG_CACHE_HOME/mtplx/native/`, else `~/.cache/mtplx/native/`), under a name keyed by
the names and bytes of every `.c` and `.h` file in the folder, the compile flags and the
compiler's version line, so an edited source or header or a new compiler builds a fresh library
and an unchanged one is reused without running the compiler.
The compiler writes to a temporary file in the same directory that is renamed into place, so
concurrent builders never see a half-written library. One portable build serves every CPU: the
ISA variants carry per-function target attributes and are picked at run time inside the C code.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SRC_DIR = Path(__file__).resolve().parent / "native" / "cpu"
LIBRARY = "mtplx_cpu"
# -ffp-contract=off: a*b + c stays two roundings as written; the kernels promise bit-identical
# results across ISA-independent code (e.g. codec dequant) and fused ops would break that.
# -fvisibility=hidden: only the MTPLX_API entry points (mtplx_cpu.h) are exported.
FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11", "-Wall", "-fno-strict-aliasing",
         "-ffp-contract=off", "-fvisibility=hidden")
LIBS = ("-lpthread", "-lm")


class BuildError(RuntimeError):
    """The compiler is missing or failed; the message names the command and its stderr."""


def cache_dir() -> Path:
    env = os.environ.get("MTPLX_NATIVE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mtplx" / "native"


def compiler() -> str:
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        raise BuildError(f"C compiler {cc!r} not found on PATH (set CC to choose another)")
    return cc


def compiler_version(cc: str) -> str:
    try:
        proc = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        raise BuildError(f"cannot run {cc} --version: {exc}") from exc
    return proc.stdout.splitlines()[0] if proc.stdout else proc.stderr.strip()


def sources(src_dir: Path | None = None) -> list[Path]:
    """The `.c` files compiled into the library, in a fixed order."""
    return sorted((src_dir or SRC_DIR).glob("*.c"))


def library_path(src_dir: Path | None = None, name: str = LIBRARY) -> Path:
    """Where the library built from `src_dir` (default SRC_DIR) lives for its current sources,
    headers and compiler."""
    src_dir = src_dir or SRC_DIR
    cc = compiler()
    h = hashlib.sha256()
    files = sorted(p for p in src_dir.iterdir() if p.suffix in (".c", ".h"))
    parts = [b for p in files for b in (p.name.encode(), p.read_bytes())]
    for part in (*parts, " ".join(FLAGS + LIBS).encode(), compiler_version(cc).encode()):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / f"{name}-{h.hexdigest()[:16]}.so"


def build(src_dir: Path | None = None, name: str = LIBRARY) -> Path:
    """Return the path of an up-to-date library built from every `.c` file of `src_dir`
    (default SRC_DIR), compiling if needed."""
    src_dir = src_dir or SRC_DIR
    srcs = sources(src_dir)
    if not srcs:
        raise BuildError(f"no kernel sources (*.c) in {src_dir}")
    out = library_path(src_dir, name)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    cmd = [compiler(), *FLAGS, f"-I{src_dir}", "-o", tmp, *map(str, srcs), *LIBS]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise BuildError(
                f"compiling {name} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                f"{proc.stderr.strip()}"
            )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
