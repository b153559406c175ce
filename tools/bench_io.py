"""Cold random record reads through RecordReader against a raw O_DIRECT sequential read.

Writes a bank file of `--size-gib` GiB (K3 t158 geometry: 7,741,440-byte records,
FORMAT.md "Bank parts"), then, with the page cache evicted (posix_fadvise DONTNEED) before every
run: a raw single-thread O_DIRECT sequential read of the whole file in 8 MiB chunks, and
`--records` whole records in one random order through RecordReader, O_DIRECT and buffered, at
each `--threads` count (2 x threads reads in flight). `--repeat` rounds run every configuration
once, interleaved, with the raw read at both ends of each round; lines give the median GB/s, the
range, and `ratio` = median over the raw median. Cold reads on a shared VM vary up to 2x run to
run (BENCHMARKS.md "bench_io"). The file is deleted at the end.

Usage: python tools/bench_io.py [--size-gib 3] [--threads 1,2,4,8] [--records N] [--repeat 3]
                                [--path DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

from mtplx_runtime.offload.reader import RecordReader, aligned_buffer

ROOT = Path(__file__).resolve().parents[1]
RECORD_BYTES = 7_741_440  # KIMI_K3_T158_RECORD_BYTES, 4096 x 1890
CHUNK_BYTES = 8 << 20


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_bank(path: Path, n_records: int) -> None:
    """Random bytes (one 64 MiB random block repeated: ext4 does not compress), fsynced."""
    block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    left = n_records * RECORD_BYTES
    with open(path, "wb") as f:
        while left:
            left -= f.write(block[:min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())


def raw_sequential(path: Path) -> tuple[float, int]:
    evict(path)
    buf = aligned_buffer(CHUNK_BYTES)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    total, t0 = 0, time.perf_counter()
    try:
        while n := os.preadv(fd, [buf], total):
            total += n
    finally:
        os.close(fd)
    return time.perf_counter() - t0, total


def reader_random(path: Path, order: np.ndarray, direct: bool, threads: int) -> float:
    evict(path)
    size = path.stat().st_size
    bufs = [aligned_buffer(RECORD_BYTES) for _ in range(2 * threads)]
    with RecordReader(path.parent, [(path.name, size)], direct=direct, threads=threads) as r:
        inflight: deque = deque()
        t0 = time.perf_counter()
        for i, rec in enumerate(order):
            if len(inflight) == len(bufs):
                inflight.popleft().result()
            inflight.append(r.read_into(0, int(rec) * RECORD_BYTES, RECORD_BYTES,
                                        bufs[i % len(bufs)]))
        for f in inflight:
            f.result()
        dt = time.perf_counter() - t0
        assert r.direct is direct
    return dt


def header(path: Path, size: int) -> str:
    fs = "?"
    best = ""
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, mnt, fstype = line.split()[:3]
        if str(path).startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best):
            best, fs = mnt, f"{fstype}:{dev}"
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip() or "?"
    except OSError:
        commit = "?"
    return (f"# bench_io commit={commit} python={platform.python_version()} "
            f"numpy={np.__version__} kernel={platform.release()} machine={platform.machine()} "
            f"cpus={os.cpu_count()} fs={fs} file_bytes={size} record_bytes={RECORD_BYTES}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=3.0)
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--records", type=int, default=0, help="records per run (0: every record)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds; medians printed")
    p.add_argument("--path", type=Path, default=None,
                   help="directory for the bank file (default: a temp dir beside the repo)")
    args = p.parse_args(argv)
    n_records = int(args.size_gib * (1 << 30)) // RECORD_BYTES
    threads = [int(t) for t in args.threads.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench_io-", dir=args.path or ROOT.parent))
    path = tmp / "experts-t158-layer-001-of-001.bin"
    try:
        t0 = time.perf_counter()
        write_bank(path, n_records)
        size = path.stat().st_size
        print(header(path, size))
        print(f"# wrote {size / 1e9:.2f} GB ({n_records} records) in "
              f"{time.perf_counter() - t0:.1f} s; page cache evicted before every run", flush=True)
        order = np.random.default_rng(1).permutation(n_records)[:args.records or n_records]
        configs = [(d, t) for d in (True, False) for t in threads]
        raws: list[float] = []
        runs: dict[tuple[bool, int], list[float]] = {c: [] for c in configs}
        for _ in range(args.repeat):  # rounds interleave configurations: drift hits all alike
            dt, total = raw_sequential(path)
            raws.append(total / dt / 1e9)
            for direct, t in configs:
                dt = reader_random(path, order, direct, t)
                runs[direct, t].append(len(order) * RECORD_BYTES / dt / 1e9)
            dt, total = raw_sequential(path)  # raw at both ends of a round: no position bias
            raws.append(total / dt / 1e9)
        raw = statistics.median(raws)
        print(f"raw-odirect-seq  chunk=8MiB threads=1 bytes={size} gbps={raw:.3f} "
              f"range={min(raws):.3f}-{max(raws):.3f} ratio=1.00")
        for (direct, t), v in runs.items():
            gbps = statistics.median(v)
            print(f"reader-random {'direct' if direct else 'buffered':8s} threads={t} "
                  f"records={len(order)} bytes={len(order) * RECORD_BYTES} gbps={gbps:.3f} "
                  f"range={min(v):.3f}-{max(v):.3f} ratio={gbps / raw:.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
