"""One-core rates of the record checks (FORMAT.md "Verifying and reading"): the native XXH3-64
(offload/digests.py's learned check) on each ISA path beside SHA-256 (hashlib, the first-read
check) and, when the `xxhash` package is installed, its XXH64 and XXH3-64 for reference.

    random records (--record-bytes each, --records of them: more than the last-level cache, so
    every hash reads from memory, as after an O_DIRECT read) -> per round, every configuration
    hashes every record once (interleaved) -> median GB/s per configuration

`--chunk-bytes` adds hot-cache lines: the same chunk hashed again and again, the rate a hash
would reach on bytes still in cache (hashing a record chunk by chunk as its reads land).

    python tools/bench_checksum.py [--record-bytes 7733248] [--records 12] [--rounds 5]
                                   [--chunk-bytes 262144]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import platform
import statistics
import time

import numpy as np

from mtplx_runtime.kernels import cpu_native


def _configs() -> dict:
    """name -> (isa to select or None, function of a bytes-like)."""
    out = {f"xxh3_native_{isa}": (isa, cpu_native.xxh3)
           for isa in cpu_native.ISAS[: cpu_native.ISAS.index(cpu_native.best_isa()) + 1]}
    out["sha256_hashlib"] = (None, lambda v: hashlib.sha256(v).digest())
    if importlib.util.find_spec("xxhash") is not None:
        import xxhash

        out["xxh64_xxhash"] = (None, xxhash.xxh64_intdigest)
        out["xxh3_xxhash"] = (None, xxhash.xxh3_64_intdigest)
    return out


def _rate(fn, views) -> float:
    t0 = time.perf_counter()
    for v in views:
        fn(v)
    return sum(v.nbytes for v in views) / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record-bytes", type=int, default=7733248)  # one K3 t158 record
    ap.add_argument("--records", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk-bytes", type=int, default=256 << 10)
    args = ap.parse_args()
    if min(args.record_bytes, args.records, args.rounds, args.chunk_bytes) < 1:
        ap.error("sizes and counts must be >= 1")
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


if __name__ == "__main__":
    main()
