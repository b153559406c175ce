"""Compile-check every `mtplx_runtime/kernels/native/*.cu` with nvcc for sm_80 and sm_90 (no GPU
needed).

Each file is compiled to a cubin with `-Xptxas -v`; the per-kernel register and spill counts are
parsed from ptxas' report. Every codec a file instantiates (`MTPLX_KERNELS(prefix, ...)`) must
yield its decode GEMV, grouped GEMM and combine entry points. Prints one line per file and arch;
exits 1 on a compile error, a missing entry point or any spill (a spill in these kernels is a
performance bug worth stopping for).

    python tools/check_cuda.py [--nvcc PATH] [--arch sm_80 --arch sm_90]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

NATIVE = Path(__file__).resolve().parent.parent / "mtplx_runtime" / "kernels" / "native"
ARCHS = ("sm_80", "sm_90")
_FUNC = re.compile(r"Compiling entry function '(\w+)'|Function properties for (\w+)")
_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_CODEC = re.compile(r"^MTPLX_KERNELS\((\w+),", re.M)
# entry points per codec (kernels/native/grouped.cuh; kernels/cuda.py SUFFIXES, COMBINE)
SUFFIXES = ("gate_up", "down_combine", "gate_up_grouped", "down_grouped")
COMBINE = "mtplx_combine"


def expected_kernels(src: Path) -> set[str]:
    """Entry points a .cu file must define: four per MTPLX_KERNELS codec, plus the combine."""
    prefixes = _CODEC.findall(src.read_text())
    return {f"{p}_{s}" for p in prefixes for s in SUFFIXES} | ({COMBINE} if prefixes else set())


def parse_ptxas(text: str) -> dict[str, dict[str, int]]:
    """ptxas -v output -> {kernel: {"registers": n, "spill_bytes": stores + loads}}."""
    out: dict[str, dict[str, int]] = {}
    name = None
    for line in text.splitlines():
        if m := _FUNC.search(line):
            name = m.group(1) or m.group(2)
            out.setdefault(name, {"registers": 0, "spill_bytes": 0})
        elif name and (m := _SPILL.search(line)):
            out[name]["spill_bytes"] += int(m.group(1)) + int(m.group(2))
        elif name and (m := _REGS.search(line)):
            out[name]["registers"] = int(m.group(1))
    return out


def check(nvcc: str, src: Path, arch: str, tmp: Path) -> tuple[bool, str]:
    cmd = [nvcc, f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-std=c++17", f"-I{NATIVE}",
           "-o", str(tmp / f"{src.stem}.{arch}.cubin"), str(src)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    text = p.stdout + p.stderr
    if p.returncode:
        return False, f"{src.name} {arch} FAIL: compile error\n{text.strip()}"
    kernels = parse_ptxas(text)
    if not kernels:
        return False, f"{src.name} {arch} FAIL: no kernels reported by ptxas"
    missing = sorted(expected_kernels(src) - set(kernels))
    if missing:
        return False, f"{src.name} {arch} FAIL: missing entry points {', '.join(missing)}"
    spills = {k: v["spill_bytes"] for k, v in kernels.items() if v["spill_bytes"]}
    desc = ", ".join(f"{k} {v['registers']} regs {v['spill_bytes']} B spill"
                     for k, v in sorted(kernels.items()))
    return not spills, f"{src.name} {arch} {'FAIL: spills' if spills else 'ok'}: {desc}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    ap.add_argument("--arch", action="append", help="default: sm_80 and sm_90")
    args = ap.parse_args(argv)
    if not Path(args.nvcc).exists():
        print(f"check_cuda: nvcc not found ({args.nvcc})", file=sys.stderr)
        return 2
    sources = sorted(NATIVE.glob("*.cu"))
    if not sources:
        print(f"check_cuda: no .cu files in {NATIVE}", file=sys.stderr)
        return 2
    ok = True
    with tempfile.TemporaryDirectory() as d:
        for src in sources:
            for arch in args.arch or ARCHS:
                good, line = check(args.nvcc, src, arch, Path(d))
                ok &= good
                print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
