"""Cold random record reads at each read depth against a raw O_DIRECT sequential read.

Writes a bank file of `--size-gib` GiB of `--record-bytes` records (default K3 t158: 7,741,440
B, FORMAT.md "Bank parts"), then, with the page cache evicted (posix_fadvise DONTNEED, checked
empty with mincore) before every run: a raw single-thread O_DIRECT sequential read of the whole
file in 8 MiB chunks, and `--records` whole records in one random order through RecordReader,
O_DIRECT (and buffered with `--buffered`), at each `--depths` read depth: exactly that many
reads in flight, the next issued as one lands. `--repeat` rounds run every configuration once,
interleaved, with the raw read at both ends of each round; lines give the median GB/s and
records/s (iops), the range, and `ratio` = median over the raw median. Cold reads on a shared VM
vary up to 2x run to run (BENCHMARKS.md "bench_io"). The file is deleted at the end.
`random_reads` and `evict` are also bench_decode's (its I/O bound).

The `reader-window` lines issue `--window` records at once at each depth, like a decode
window's misses, and say when they land: the first and the mean landing as a share of the last
(near 1: all together at the end; lower: one after another, which lets the kernels start while
the rest stream in).

Usage: python tools/bench_io.py [--size-gib 3] [--record-bytes 7741440]
                                [--depths 1,2,4,8,16,32] [--window 14]
                                [--buffered] [--records N] [--repeat 3] [--path DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mtplx_runtime.offload.bank_reader import RecordReader, aligned_buffer
from mtplx_runtime.offload.buffers import PAGE_BYTES

ROOT = Path(__file__).resolve().parents[1]
RECORD_BYTES = 7_741_440  # KIMI_K3_T158_RECORD_BYTES, 4096 x 1890 (the --record-bytes default)
CHUNK_BYTES = 8 << 20


def resident_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache: mincore over a read-only shared mapping of it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size, page = path.stat().st_size, mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap({path})")
        try:
            vec = (ctypes.c_ubyte * (-(-size // page)))()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore({path})")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * page


def evict(paths: list[Path], tries: int = 5) -> None:
    """Write back, then drop every file of `paths` from the page cache, and check with mincore
    that nothing stayed: pages still being written back cannot be dropped, and reads served from
    memory would let a run "beat" the disk (a bench_decode run right after a build did)."""
    os.sync()
    for attempt in range(tries):
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        left = sum(resident_bytes(p) for p in paths)
        if left <= 64 * 2**20:  # a few records' worth may come back from a concurrent reader
            return
        time.sleep(1.0 + attempt)  # writeback in progress: give it time
    raise SystemExit(f"{left / 2**20:.0f} MiB of {paths[0].name} ... is still in the page cache "
                     "after dropping it; cold-cache numbers would be wrong (is another process "
                     "reading it, or writeback stuck?)")


def write_bank(path: Path, n_records: int, record_bytes: int) -> None:
    """Random bytes (one 64 MiB random block repeated: ext4 does not compress), fsynced."""
    block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    left = n_records * record_bytes
    with open(path, "wb") as f:
        while left:
            left -= f.write(block[:min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())


def raw_sequential(path: Path) -> tuple[float, int]:
    evict([path])
    buf = aligned_buffer(CHUNK_BYTES)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    total, t0 = 0, time.perf_counter()
    try:
        while n := os.preadv(fd, [buf], total):
            total += n
    finally:
        os.close(fd)
    return time.perf_counter() - t0, total


def random_reads(root: Path, parts: list[tuple], extents: list[tuple[int, int]],
                 length: int, depth: int, direct: bool | str = True) -> float:
    """Seconds to read `length` bytes at each (part, absolute offset) of `extents`, in that
    order, through RecordReader over `parts` ([(file, size[, data_start])]) with exactly `depth`
    reads in flight (a read is issued the moment one lands, so
    the drive never sees fewer until the tail). The caller evicts the page cache first."""
    bufs = [aligned_buffer(length) for _ in range(depth)]
    for b in bufs:
        b.fill(1)  # fault the pages in now: the runtime's slots are long-lived, not fresh
    free: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(depth):
        free.put(i)
    futs = []
    with RecordReader(root, parts, direct=direct, read_depth=depth) as r:
        t0 = time.perf_counter()
        for part, offset in extents:
            i = free.get()  # a buffer whose read has landed: one read fewer in flight
            f = r.read_into(part, offset, length, bufs[i])
            f.add_done_callback(lambda _f, i=i: free.put(i))
            futs.append(f)
        for f in futs:
            f.result()  # raises a failed read's ReadError
        return time.perf_counter() - t0


def window_landings(root: Path, parts: list[tuple], extents: list[tuple[int, int]],
                    length: int, depth: int) -> list[float]:
    """Seconds from issuing every read of `extents` at once (a decode window's misses) to each
    one landing, in issue order, `depth` reads in flight. The caller evicts the page cache
    first."""
    bufs = [aligned_buffer(length) for _ in extents]
    for b in bufs:
        b.fill(1)
    landed = [0.0] * len(extents)
    with RecordReader(root, parts, direct=True, read_depth=depth) as r:
        t0 = time.perf_counter()
        futs = r.read_many([(p, o, length, b) for (p, o), b in zip(extents, bufs)])
        for i, f in enumerate(futs):
            f.add_done_callback(lambda _f, i=i: landed.__setitem__(i, time.perf_counter() - t0))
        for f in futs:
            f.result()
    return landed


def header(path: Path, size: int, record_bytes: int) -> str:
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
            f"cpus={os.cpu_count()} fs={fs} file_bytes={size} record_bytes={record_bytes}")


def int_list(text: str) -> list[int]:
    vals = [int(v) for v in text.split(",")]
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,4, got {text!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=3.0)
    p.add_argument("--record-bytes", type=int, default=RECORD_BYTES,
                   help="bytes per record, a multiple of 4096 (default: K3 t158)")
    p.add_argument("--depths", type=int_list, default=[1, 2, 4, 8, 16, 32],
                   help="reads in flight to sweep (RecordReader read_depth)")
    p.add_argument("--window", type=int, default=14,
                   help="records issued at once for the landing-order lines (a K3 decode "
                        "window's misses: 14 of top-16 at a 5%% hit rate); 0: none")
    p.add_argument("--buffered", action="store_true",
                   help="also run every depth buffered (page cache) instead of O_DIRECT")
    p.add_argument("--records", type=int, default=0, help="records per run (0: every record)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds; medians printed")
    p.add_argument("--path", type=Path, default=None,
                   help="directory for the bank file (default: a temp dir beside the repo)")
    args = p.parse_args(argv)
    rec = args.record_bytes
    if rec < 1 or rec % PAGE_BYTES:
        p.error(f"--record-bytes must be a positive multiple of {PAGE_BYTES}, got {rec}")
    n_records = int(args.size_gib * (1 << 30)) // rec
    if n_records < 1:
        p.error("--size-gib holds no whole record")
    tmp = Path(tempfile.mkdtemp(prefix="bench_io-", dir=args.path or ROOT.parent))
    path = tmp / "experts-t158-layer-001-of-001.bin"
    try:
        t0 = time.perf_counter()
        write_bank(path, n_records, rec)
        size = path.stat().st_size
        print(header(path, size, rec))
        print(f"# wrote {size / 1e9:.2f} GB ({n_records} records) in "
              f"{time.perf_counter() - t0:.1f} s; page cache evicted and checked empty (mincore) "
              "before every run", flush=True)
        order = np.random.default_rng(1).permutation(n_records)[:args.records or n_records]
        extents = [(0, int(i) * rec) for i in order]
        configs = [(d, n) for d in ((True, False) if args.buffered else (True,))
                   for n in args.depths]
        raws: list[float] = []
        runs: dict[tuple[bool, int], list[float]] = {c: [] for c in configs}
        windows: dict[int, list] = {n: [] for n in args.depths} if args.window else {}
        rng = np.random.default_rng(2)
        for _ in range(args.repeat):  # rounds interleave configurations: drift hits all alike
            dt, total = raw_sequential(path)
            raws.append(total / dt / 1e9)
            for direct, depth in configs:
                evict([path])
                dt = random_reads(tmp, [(path.name, size)], extents, rec, depth, direct)
                runs[direct, depth].append(len(order) * rec / dt / 1e9)
            for depth in windows:
                picks = rng.choice(n_records, size=min(args.window, n_records), replace=False)
                evict([path])
                windows[depth].append(window_landings(
                    tmp, [(path.name, size)], [(0, int(i) * rec) for i in picks], rec, depth))
            dt, total = raw_sequential(path)  # raw at both ends of a round: no position bias
            raws.append(total / dt / 1e9)
        raw = statistics.median(raws)
        print(f"raw-odirect-seq  chunk=8MiB threads=1 bytes={size} gbps={raw:.3f} "
              f"range={min(raws):.3f}-{max(raws):.3f} ratio=1.00")
        for (direct, depth), v in runs.items():
            gbps = statistics.median(v)
            # threads= kept for scripts that parse it: the reader runs one thread per read
            print(f"reader-random {'direct' if direct else 'buffered':8s} depth={depth} "
                  f"threads={depth} records={len(order)} bytes={len(order) * rec} "
                  f"gbps={gbps:.3f} iops={gbps * 1e9 / rec:.1f} "
                  f"range={min(v):.3f}-{max(v):.3f} ratio={gbps / raw:.2f}")
        for depth, rounds in windows.items():
            # when each record of a window lands, as a share of the last one's time: near 1,
            # all land together at the end; near 0.5, one after another (compute can overlap)
            firsts = [min(w) / max(w) for w in rounds]
            means = [statistics.mean(w) / max(w) for w in rounds]
            lasts = [max(w) * 1e3 for w in rounds]
            print(f"reader-window direct   depth={depth} records={len(rounds[0])} "
                  f"first_over_last={statistics.median(firsts):.2f} "
                  f"mean_over_last={statistics.median(means):.2f} "
                  f"last_ms={statistics.median(lasts):.1f} "
                  f"gbps={len(rounds[0]) * rec / statistics.median(lasts) / 1e6:.3f}")
        best = max(runs, key=lambda c: statistics.median(runs[c]))
        print(f"# best: {'direct' if best[0] else 'buffered'} depth={best[1]} "
              f"gbps={statistics.median(runs[best]):.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
