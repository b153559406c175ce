"""Per-expert time of the CPU t158 kernels at K3 geometry, one line per configuration.

K3 expert (spec §3): gate/up t158 [3072, 3584], down [3584, 3072], T = 1, top-16 experts per
token. Compares (a) the reference path the runtime uses today (NumPy `decode_t158` of all three
projections, then float32 matmuls and SiTU-GLU) with (b) `cpu_t158.expert_mlp` per ISA path and
thread count. Bandwidth is packed + scale bytes (7,741,440 per expert) over time, against this
machine's memory bandwidth measured in the same run by a large NumPy copy (read + write bytes).

    python tools/bench_kernels.py [--experts 16] [--repeat 3] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mtplx_runtime.formats.t158 import decode_t158
from mtplx_runtime.kernels import cpu_t158

HIDDEN, INTER, BETA, BETA_LIN = 3584, 3072, 4.0, 25.0


def expert(rng):
    def proj(rows, cols):
        packed = rng.integers(0, 243, (rows, 13 * cols // 64), dtype=np.uint8)
        packed[:, 12::13] %= 81
        scales = (rng.uniform(0.005, 0.05, (rows, cols // 64)).astype(np.float32)
                  .view(np.uint32) >> 16).astype(np.uint16)
        return packed, scales
    return proj(INTER, HIDDEN), proj(INTER, HIDDEN), proj(HIDDEN, INTER)


def reference(gate, up, down, x):
    g, u = decode_t158(*gate) @ x, decode_t158(*up) @ x
    h = BETA * np.tanh(g / BETA) / (1 + np.exp(-g)) * (BETA_LIN * np.tanh(u / BETA_LIN))
    return decode_t158(*down) @ h.astype(np.float32)


def per_expert(fn, experts, x, repeat):
    """Best-of-`repeat` mean seconds per expert over all experts (each visited once per pass)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for e in experts:
            fn(*e, x)
        best = min(best, (time.perf_counter() - t0) / len(experts))
    return best


def memory_bandwidth(nbytes=1 << 30, repeat=5):
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best  # bytes read + bytes written


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", default="")
    args = ap.parse_args(argv)
    ok, why = cpu_t158.available()
    if not ok:
        raise SystemExit(why)
    rng = np.random.default_rng(0)
    experts = [expert(rng) for _ in range(args.experts)]
    nbytes = sum(p.nbytes + s.nbytes for p, s in experts[0])
    x = rng.standard_normal(HIDDEN).astype(np.float32)
    bw = memory_bandwidth()
    print(f"machine: memory bandwidth (numpy copy, read+write) {bw / 1e9:.2f} GB/s; "
          f"best ISA {cpu_t158.best_isa()}; {cpu_t158.default_threads()} threads; "
          f"{nbytes} packed bytes per expert, {args.experts} experts")
    ref_t = per_expert(reference, experts[: max(1, args.experts // 4)], x, 1)
    print(f"reference  numpy decode+matmul  threads=-  {ref_t * 1e3:8.2f} ms/expert  "
          f"{nbytes / ref_t / 1e9:6.2f} GB/s  {nbytes / ref_t / bw:6.1%} of mem bw  speedup 1.00x")
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted(
        {1, cpu_t158.default_threads()})
    for isa in cpu_t158.ISAS[: cpu_t158.ISAS.index(cpu_t158.best_isa()) + 1]:
        cpu_t158.set_isa(isa)
        for t in threads:
            def run(gate, up, down, x, t=t):
                return cpu_t158.expert_mlp(gate, up, down, x, BETA, BETA_LIN, threads=t)
            sec = per_expert(run, experts, x, args.repeat)
            print(f"cpu_t158   {isa:<20s}  threads={t}  {sec * 1e3:8.2f} ms/expert  "
                  f"{nbytes / sec / 1e9:6.2f} GB/s  {nbytes / sec / bw:6.1%} of mem bw  "
                  f"speedup {ref_t / sec:.2f}x")
    cpu_t158.set_isa(None)


if __name__ == "__main__":
    main()
