"""Build the CPU kernel sources under `native/cpu/` into shared libraries on first use.

The library lands in `$MTPLX_NATIVE_DIR` (default `~/.cache/mtplx/native/`) under a name keyed by
the source bytes, the bytes of every header in `native/cpu/` (the sources include the shared
driver `expert_common.h`), the compile flags and the compiler's version line, so an edited source
or header or a new compiler builds a fresh library and an unchanged one is reused without running
the compiler.
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
# -ffp-contract=off: a*b + c stays two roundings as written; the kernels promise bit-identical
# results across ISA-independent code (e.g. codec dequant) and fused ops would break that.
FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11", "-Wall", "-fno-strict-aliasing",
         "-ffp-contract=off")
LIBS = ("-lpthread", "-lm")


class BuildError(RuntimeError):
    """The compiler is missing or failed; the message names the command and its stderr."""


def cache_dir() -> Path:
    env = os.environ.get("MTPLX_NATIVE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "mtplx" / "native"


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


def library_path(name: str, src: Path | None = None) -> Path:
    """Where the library for `native/cpu/<name>.c` lives for the current source and compiler."""
    src = src or SRC_DIR / f"{name}.c"
    cc = compiler()
    h = hashlib.sha256()
    headers = [p.read_bytes() for p in sorted(SRC_DIR.glob("*.h"))]
    for part in (src.read_bytes(), *headers, " ".join(FLAGS + LIBS).encode(),
                 compiler_version(cc).encode()):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / f"{name}-{h.hexdigest()[:16]}.so"


def build(name: str, src: Path | None = None) -> Path:
    """Return the path of an up-to-date library for `native/cpu/<name>.c`, compiling if needed."""
    src = src or SRC_DIR / f"{name}.c"
    if not src.is_file():
        raise BuildError(f"kernel source {src} not found")
    out = library_path(name, src)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    cmd = [compiler(), *FLAGS, f"-I{SRC_DIR}", "-o", tmp, str(src), *LIBS]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise BuildError(
                f"compiling {src.name} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                f"{proc.stderr.strip()}"
            )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
