"""Matrix-vector products (one token) on one torch thread against all of them, per weight size.

`model.quant.linear` runs a CPU product of one input row over at most `ONE_THREAD_BYTES` of
weights on one thread: a parallel region wakes torch's sleeping OpenMP workers (the `mtplx`
command sets OMP_WAIT_POLICY=PASSIVE, so they sleep between ops), which costs more than the split
saves on a small product. This prints, per bf16 weight shape, the median time of `F.linear` at 1
thread and at `--threads`, the two interleaved in rounds so load moves both alike, and which one
the rule picks.

Usage: OMP_WAIT_POLICY=PASSIVE python tools/bench_threads.py [--threads 2] [--rounds 7]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mtplx_runtime.model.quant import ONE_THREAD_BYTES  # noqa: E402  (after the path fix)

# K3-sized and toy-trunk-sized weights [N, K]: KDA/MLA low-rank projections, the slice's shared
# expert and latent projections, then K3's own shared expert, dense MLP and attention outputs.
SHAPES = [(64, 256), (768, 256), (3072, 256), (256, 3072), (3584, 256), (1024, 1024),
          (2048, 2048), (1536, 7168), (4096, 4096), (7168, 4096), (6144, 7168), (16384, 7168)]


def per_call_us(fn, budget_s: float = 0.05) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget_s or n < 3:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    print(f"# bench_threads torch={torch.__version__} threads={a.threads} rounds={a.rounds} "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')} "
          f"one_thread_bytes={ONE_THREAD_BYTES} load={os.getloadavg()[0]:.2f}")
    for n, k in SHAPES:
        w = torch.randn(n, k).bfloat16()
        x = torch.randn(1, k).bfloat16()
        times: dict[int, list[float]] = {1: [], a.threads: []}
        for _ in range(a.rounds):
            for t in times:
                torch.set_num_threads(t)
                times[t].append(per_call_us(functools.partial(F.linear, x, w)))
        one, many = (statistics.median(times[t]) for t in (1, a.threads))
        nbytes = w.numel() * w.element_size()
        print(f"threads shape={n}x{k} weight_mib={nbytes / 2**20:.2f} one_us={one:.1f} "
              f"threads{a.threads}_us={many:.1f} one_over_many={one / many:.2f} "
              f"rule={'one' if nbytes <= ONE_THREAD_BYTES else 'all'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
