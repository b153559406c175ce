"""One-core rates of the record checks (FORMAT.md "Verifying and reading"): the native XXH3-64
on each ISA path, with seed 0 and with a seed (`_seeded`: offload/digests.py's learned check
hashes with the user's secret seed, which derives a secret for the long-input loop), beside
SHA-256 (hashlib, the first-read check) and, when the `xxhash` package is installed, its XXH64
and XXH3-64 (seed 0 and seeded) for reference.

    random records (--record-bytes each, --records of them: more than the last-level cache, so
    every hash reads from memory, as after an O_DIRECT read) -> per round, every configuration
    hashes every record once (interleaved) -> median GB/s per configuration

`--chunk-bytes` adds hot-cache lines: the same chunk hashed again and again, the rate a hash
would reach on bytes still in cache (hashing a record chunk by chunk as its reads land).
`--part FILE` (a bank part) also times the two ways a reader thread could check a record read
with O_DIRECT: read it whole then hash it, or read and hash --chunk-bytes at a time (each chunk
hashed on its own: the cost of a streaming hash, not its value), at random 4 KiB-aligned
offsets, the two interleaved, medians over --rounds x 4 records each.

    python tools/bench_checksum.py [--record-bytes 7741440] [--records 12] [--rounds 5]
                                   [--chunk-bytes 262144] [--part FILE]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import mmap
import os
import platform
import statistics
import time

import numpy as np

from mtplx_runtime.kernels import cpu_native

SEED = 0x9E3779B97F4A7C15  # any nonzero seed: the rate does not depend on its value


def _configs() -> dict:
    """name -> (isa to select or None, function of a bytes-like)."""
    out = {}
    for isa in cpu_native.ISAS[: cpu_native.ISAS.index(cpu_native.best_isa()) + 1]:
        out[f"xxh3_native_{isa}"] = (isa, cpu_native.xxh3)
        out[f"xxh3_native_{isa}_seeded"] = (isa, functools.partial(cpu_native.xxh3, seed=SEED))
    out["sha256_hashlib"] = (None, lambda v: hashlib.sha256(v).digest())
    if importlib.util.find_spec("xxhash") is not None:
        import xxhash

        out["xxh64_xxhash"] = (None, xxhash.xxh64_intdigest)
        out["xxh3_xxhash"] = (None, xxhash.xxh3_64_intdigest)
        out["xxh3_xxhash_seeded"] = (None, functools.partial(xxhash.xxh3_64_intdigest,
                                                             seed=SEED))
    return out


def _rate(fn, views) -> float:
    t0 = time.perf_counter()
    for v in views:
        fn(v)
    return sum(v.nbytes for v in views) / (time.perf_counter() - t0) / 1e9


def _read_then_hash(fd: int, view: memoryview, offset: int, chunk: int) -> tuple[float, float]:
    """(read s, hash s) of one record at `offset`: whole (chunk 0) or chunk by chunk."""
    steps = [(0, len(view))] if chunk == 0 else [(s, min(chunk, len(view) - s))
                                                 for s in range(0, len(view), chunk)]
    read_s = hash_s = 0.0
    for start, n in steps:
        v = view[start:start + n]
        t0 = time.perf_counter()
        os.preadv(fd, [v], offset + start)
        t1 = time.perf_counter()
        cpu_native.xxh3(v, SEED)  # as offload/digests.py checks: seeded
        read_s, hash_s = read_s + t1 - t0, hash_s + time.perf_counter() - t1
    return read_s, hash_s


def _part_lines(path: str, record_bytes: int, chunk: int, rounds: int) -> list[str]:
    n = record_bytes - record_bytes % 4096
    buf = mmap.mmap(-1, n)  # page-aligned, as O_DIRECT needs
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        slots = os.fstat(fd).st_size // n
        rng = np.random.default_rng()
        got: dict[str, list[tuple[float, float]]] = {"whole": [], "chunked": []}
        for i in range(4 * rounds):
            for mode in ("whole", "chunked") if i % 2 else ("chunked", "whole"):
                offset = int(rng.integers(0, slots)) * n
                got[mode].append(_read_then_hash(fd, view, offset, chunk if mode == "chunked"
                                                 else 0))
    finally:
        os.close(fd)
    lines = []
    for mode, r in got.items():
        read_s = statistics.median(x for x, _ in r)
        hash_s = statistics.median(h for _, h in r)
        lines.append(f"part_read={mode} chunk_bytes={chunk if mode == 'chunked' else n} "
                     f"read_ms={read_s * 1e3:.2f} hash_ms={hash_s * 1e3:.3f} "
                     f"hash_gbps={n / hash_s / 1e9:.2f} "
                     f"total_ms={statistics.median(x + h for x, h in r) * 1e3:.2f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record-bytes", type=int, default=7741440)  # one K3 t158 record
    ap.add_argument("--records", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk-bytes", type=int, default=256 << 10)
    ap.add_argument("--part", help="a bank part to read records from with O_DIRECT")
    args = ap.parse_args()
    if min(args.record_bytes, args.records, args.rounds, args.chunk_bytes) < 1:
        ap.error("sizes and counts must be >= 1")
    if args.part and (args.chunk_bytes % 4096 or args.record_bytes < 4096):
        ap.error("--part: --chunk-bytes must be a multiple of 4096, --record-bytes >= 4096")
    data = np.random.default_rng(0).integers(0, 256, args.record_bytes * args.records,
                                             dtype=np.uint8)
    records = [memoryview(data[i * args.record_bytes:(i + 1) * args.record_bytes])
               for i in range(args.records)]
    chunk = memoryview(data[: args.chunk_bytes])
    hot = [chunk] * max(1, args.record_bytes // args.chunk_bytes)
    configs = _configs()
    rates: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, (isa, fn) in configs.items():
            if isa is not None:
                cpu_native.set_isa(isa)
            rates.setdefault(f"{name} memory", []).append(_rate(fn, records))
            rates.setdefault(f"{name} hot", []).append(_rate(fn, hot))
    cpu_native.set_isa(None)
    print(f"# bench_checksum python={platform.python_version()} numpy={np.__version__} "
          f"best_isa={cpu_native.best_isa()} load={os.getloadavg()[0]:.2f} "
          f"record_bytes={args.record_bytes} records={args.records} rounds={args.rounds} "
          f"chunk_bytes={args.chunk_bytes}")
    for key, r in rates.items():
        name, where = key.split()
        print(f"hash={name} bytes={where} gbps={statistics.median(r):.2f} "
              f"min={min(r):.2f} max={max(r):.2f}")
    if args.part:
        for line in _part_lines(args.part, args.record_bytes, args.chunk_bytes, args.rounds):
            print(line)


if __name__ == "__main__":
    main()
