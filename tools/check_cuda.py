"""Compile-check every `mtplx_runtime/kernels/native/*.cu` with nvcc for sm_80 and sm_90 (no GPU
needed).

Each file is compiled to a cubin with `-Xptxas -v` (the files and architectures in parallel);
the per-kernel registers, stack frame and spills are parsed from ptxas' report. Every codec a
file instantiates (`MTPLX_EXPERT_KERNELS(prefix, ...)`, `MTPLX_RESIDENT(prefix, ...)`) must
yield its entry points (kernels/cuda.py and kernels/cuda_residents.py launch them by these
names). Prints one line per file and arch; exits 1 on a compile error, a missing entry point,
any spill or any stack frame (local memory in these kernels is a performance bug worth stopping
for: a register array indexed at run time, say).

    python tools/check_cuda.py [--nvcc PATH] [--arch sm_80 --arch sm_90]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NATIVE = Path(__file__).resolve().parent.parent / "mtplx_runtime" / "kernels" / "native"
ARCHS = ("sm_80", "sm_90")
_FUNC = re.compile(r"Compiling entry function '(\w+)'|Function properties for (\w+)")
_REGS = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_EXPERT = re.compile(r"^MTPLX_EXPERT_KERNELS\((\w+),", re.M)
_RESIDENT = re.compile(r"^MTPLX_RESIDENT\((\w+),", re.M)
_REPACK = re.compile(r'^extern "C" __global__ void __launch_bounds__\(\d+\) (\w+_repack)\(', re.M)
# entry points per codec (native/experts.cuh MTPLX_EXPERT_VARIANT, native/residents.cu)
EXPERT_SUFFIXES = tuple(f"{k}_{v}" for k in ("gate_up", "down")
                        for v in ("bf16x1", "bf16x4", "f32"))
RESIDENT_SUFFIXES = ("gemv_x1", "gemv_x4")


def expected_kernels(src: Path) -> set[str]:
    """Entry points a .cu file must define: six per expert codec, two per resident kind, and the
    repack kernels it declares."""
    text = src.read_text()
    return ({f"{p}_{s}" for p in _EXPERT.findall(text) for s in EXPERT_SUFFIXES}
            | {f"{p}_{s}" for p in _RESIDENT.findall(text) for s in RESIDENT_SUFFIXES}
            | set(_REPACK.findall(text)))


def parse_ptxas(text: str) -> dict[str, dict[str, int]]:
    """ptxas -v output -> {kernel: {"registers": n, "spill_bytes": stores + loads,
    "stack_bytes": frame}}."""
    out: dict[str, dict[str, int]] = {}
    name = None
    for line in text.splitlines():
        if m := _FUNC.search(line):
            name = m.group(1) or m.group(2)
            out.setdefault(name, {"registers": 0, "spill_bytes": 0, "stack_bytes": 0})
        elif name and (m := _FRAME.search(line)):
            out[name]["stack_bytes"] = int(m.group(1))
            out[name]["spill_bytes"] += int(m.group(2)) + int(m.group(3))
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
    bad = sorted(k for k, v in kernels.items() if v["spill_bytes"] or v["stack_bytes"])
    desc = ", ".join(f"{k} {v['registers']} regs" + (
        f" {v['stack_bytes']} B stack {v['spill_bytes']} B spill" if k in bad else "")
        for k, v in sorted(kernels.items()))
    return not bad, f"{src.name} {arch} {'FAIL: local memory' if bad else 'ok'}: {desc}"


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
    with tempfile.TemporaryDirectory() as d, ThreadPoolExecutor() as pool:
        jobs = [pool.submit(check, args.nvcc, src, arch, Path(d))
                for src in sources for arch in args.arch or ARCHS]
        results = [j.result() for j in jobs]
    for _, line in results:
        print(line)
    ok = all(good for good, _ in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
