"""Decode rate a memory plan can expect, before anything is downloaded: an estimate with its
inputs stated, never a measurement (`mtplx plan` prints it).

    plan (cache slots per layer) -> miss rate: uniform routes (every expert alike, no reuse) ..
        routes like synth:k3's (calibrated to K3's published LRU hit rate), replayed through LRU
    -> records per token x record bytes / drive rate (given, or measure_disk's)
    + expert kernels (measured cost per expert) + resident matrices read per token (measured rate)
    -> tok/s: reads after compute with uniform routes .. reads hidden under compute, K3-like routes

The CPU costs are what tools/bench_kernels.py and tools/bench_model.py measured on a 2-core VM
(BENCHMARKS.md "bench_kernels", "bench_model"): a machine with more cores and memory bandwidth
computes faster, so the compute terms are upper bounds there. The GPU's (one H200) span what its
first run measured (the slow end: kernels before their rewrite, ~5 ms of host work per layer)
and what the kernels and the device-resident decode path are built to reach (the fast end: 70 %
of the measured device copy rate, 0.2 ms of host per layer), and add the host's time per layer
to the compute: tools/gpu_check.py's `timing`, `residents` and `decode` lines replace them.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..engine.plan import MemoryPlan, ModelFacts, fmt_bytes, resident_bytes
from ..formats.record import align_up
from ..offload.buffers import aligned_buffer
from .replay import profile
from .traces import synthetic

DEFAULT_DISK_GBPS = 7.0  # a PCIe 4.0 NVMe drive's rated read; `mtplx profile`'s default too
K3_EXPERT_WEIGHTS = 3 * 3072 * 3584  # the expert the kernel costs were measured on
# Costs per kernel backend; a backend or codec without an entry gets the I/O bound alone.
# ms per K3 expert at one token, (fast, slow), by (bank mode, bits): bench_kernels' per-layer
# times (16 experts) at T = 1, native cpu kernels, 2 threads of a Zen 5 VM (avx512bf16, 36-39
# GB/s copy bandwidth), over its runs of d782fca and afac813. Scaled by expert size for other
# geometries.
EXPERT_MS = {"cpu": {("t158", None): (6.79 / 16, 10.36 / 16),
                     ("mxfp4", None): (7.91 / 16, 9.59 / 16),
                     ("ct-int", 3): (14.23 / 16, 16.48 / 16),
                     ("ct-int", 4): (12.12 / 16, 16.70 / 16)},
             # One H200 (4,185 GB/s device copy, measured): fast = the record's bytes at 70 % of
             # that (the decode kernels' goal, expected), slow = the first run's measured share
             # of it (t158 1.053 ms per 16 experts; mxfp4, ct-int3 5 %, ct-int4 7 % of copy).
             "cuda": {("t158", None): (7_741_440 / 0.7 / 4185e6, 1.053 / 16),
                      ("mxfp4", None): (17_547_264 / 0.7 / 4185e6, 17_547_264 / 0.05 / 4185e6),
                      ("ct-int", 3): (13_418_496 / 0.7 / 4185e6, 13_418_496 / 0.05 / 4185e6),
                      ("ct-int", 4): (17_547_264 / 0.7 / 4185e6, 17_547_264 / 0.07 / 4185e6)}}
# GB/s at which a decode token reads the resident matrices, (fast, slow), per resident dtype:
# bench_model's decode_gbps, torch on 2 threads of that VM (the reference kernels run the
# residents as the cpu ones do).
RESIDENT_GBPS = {"cpu": {"bf16": (19.1, 11.5), "int8": (17.6, 15.8), "int4": (13.5, 13.2)}}
RESIDENT_GBPS["reference"] = RESIDENT_GBPS["cpu"]
# One H200: bf16 = torch's F.linear at T=1, measured (3,877 GB/s); the quantized dtypes span the
# first run's measured speed against bf16 (int8 0.11x, fp8 0.14x, int4 1.43x) and the resident
# kernels' goal (int8, fp8 1.6x, int4 2.5x, expected), as GB/s of their own bytes (bf16's rate
# x speed / bytes ratio).
RESIDENT_GBPS["cuda"] = {"bf16": (3877.0, 3877.0), "int8": (3877 * 1.6 / 2, 3877 * 0.11 / 2),
                         "fp8": (3877 * 1.6 / 2, 3877 * 0.14 / 2),
                         "int4": (3877 * 2.5 / 4, 3877 * 1.43 / 4)}
# Host time per decoder layer per token that the GPU waits for (launches, the cache's and the
# prefetcher's work), (fast, slow) in ms: slow = the first run (~16 ms of host in an 18 ms token
# over 3 layers), fast = issue 34's goal for the device-resident path (<= 25 % of a 2.5 ms
# token on that slice, expected). Backends that compute on the host count it in their kernels.
HOST_MS_PER_LAYER = {"cuda": (0.2, 5.4)}
SYNTH_TOKENS, SYNTH_LAYERS = 1000, 2  # every layer of synth:k3 is alike: two show the rate


@dataclass(frozen=True, slots=True)
class DecodeEstimate:
    """Seconds per decode token, each as (best, worst), and the inputs they come from."""

    records_per_token: int
    record_stride: int
    disk_gbps: float
    disk_source: str
    cached_per_layer: int  # compute + host slots per MoE layer
    experts_per_layer: int
    miss_uniform: float
    miss_k3like: float
    io_s: tuple[float, float]
    expert_s: tuple[float, float] | None  # None: no measured cost for this backend and codec
    expert_source: str
    resident_read_bytes: int
    resident_s: tuple[float, float] | None
    resident_source: str
    host_s: tuple[float, float] = (0.0, 0.0)  # per token, not overlapped (HOST_MS_PER_LAYER)
    host_source: str = ""

    @property
    def compute_s(self) -> tuple[float, float] | None:
        if self.expert_s is None or self.resident_s is None:
            return None
        return tuple(e + r + h for e, r, h in zip(self.expert_s, self.resident_s, self.host_s))

    def tok_s_at(self, miss: float) -> tuple[float, float]:
        """(low, high) at one miss rate: reads after compute (slow costs), reads hidden under
        compute (fast costs); 0 misses is every expert cached. Needs compute costs."""
        c, per_miss = self.compute_s, self.records_per_token * self.record_stride / (
            self.disk_gbps * 1e9)
        return 1 / (miss * per_miss + c[1]), 1 / max(miss * per_miss, c[0])

    @property
    def tok_s(self) -> tuple[float, float]:
        """(low, high): reads after compute with uniform routes, and reads hidden under
        compute with K3-like routes; the I/O bound alone without compute costs."""
        c = self.compute_s
        low = self.io_s[1] + (c[1] if c else 0.0)
        high = max(self.io_s[0], c[0] if c else 0.0)
        return (1 / low if low else math.inf, 1 / high if high else math.inf)

    def to_dict(self) -> dict:
        d = {f: getattr(self, f) for f in self.__slots__}
        d.update(compute_s=self.compute_s, tok_s=self.tok_s)
        return d


def lru_miss_k3like(slots_per_layer: int, experts: int, top_k: int) -> float:
    """Miss rate of LRU with `slots_per_layer` on routes like synth:k3's at this geometry (the
    temporal generator with K3's calibrated skew and reuse)."""
    if slots_per_layer >= experts:
        return 0.0
    trace = synthetic("k3", tokens=SYNTH_TOKENS, layers=SYNTH_LAYERS, experts=experts,
                      top_k=top_k)
    (res, _), _ = profile(trace, ["lru"], [slots_per_layer * SYNTH_LAYERS], workers=1)
    return 1 - res.hit_rate


def estimate_decode(plan: MemoryPlan, facts: ModelFacts, disk_gbps: float = DEFAULT_DISK_GBPS,
                    disk_source: str = "default") -> DecodeEstimate:
    """The decode estimate for `plan` (the plan of `facts`) at `disk_gbps`."""
    g = facts.geometry
    cached = plan.slots_per_layer + plan.host_slots_per_layer
    n = plan.routed_layers * plan.top_k
    miss_u = 1 - min(1.0, cached / plan.experts_per_layer)
    miss_k = lru_miss_k3like(cached, plan.experts_per_layer, plan.top_k)
    per_miss = n * plan.record_stride / (disk_gbps * 1e9)
    io_s = (miss_k * per_miss, miss_u * per_miss)
    expert_s, expert_source = None, f"no measured cost of {plan.mode} on the {plan.kernels} kernels"
    scale = g.expert_weights() / K3_EXPERT_WEIGHTS
    key = (plan.mode.removesuffix("-asym"), facts.bits)  # zero points cost about nothing
    if key in EXPERT_MS.get(plan.kernels, {}):
        ms = EXPERT_MS[plan.kernels][key]
        expert_s = (n * ms[0] * scale / 1e3, n * ms[1] * scale / 1e3)
        expert_source = (f"{ms[0] * scale:.3g}-{ms[1] * scale:.3g} ms per expert "
                         + ("(one H200: 70 % of its copy rate, expected - its first run, "
                            "measured)" if plan.kernels == "cuda" else
                            f"(bench_kernels, {plan.kernels} kernels, 2 threads)"))
    # Every resident matrix is read once per decode token, but the embedding table: one row.
    embed = next((b for name, _, b in facts.residents if name == g.embedding), 0)
    read = resident_bytes(facts, plan.dtype, plan.resident_dtype) - embed
    resident_s, resident_source = None, f"no measured rate of {plan.resident_dtype} residents " \
                                         f"on {plan.kernels}"
    if plan.resident_dtype in RESIDENT_GBPS.get(plan.kernels, {}):
        fast, slow = RESIDENT_GBPS[plan.kernels][plan.resident_dtype]
        resident_s = (read / (fast * 1e9), read / (slow * 1e9))
        resident_source = _range(slow, fast, " GB/s", "{:.4g}") + (
            f" (one H200, {plan.resident_dtype}: its first run, measured - the goal, expected)"
            if plan.kernels == "cuda" else
            f" (bench_model, torch {plan.resident_dtype}, 2 threads)")
    host_s, host_source = (0.0, 0.0), ""
    if plan.kernels in HOST_MS_PER_LAYER:
        fast, slow = HOST_MS_PER_LAYER[plan.kernels]
        layers = facts.cfg.num_hidden_layers
        host_s = (layers * fast / 1e3, layers * slow / 1e3)
        host_source = f"{fast:g}-{slow:g} ms per layer x {layers} layers"
    return DecodeEstimate(n, plan.record_stride, disk_gbps, disk_source, cached,
                          plan.experts_per_layer, miss_u, miss_k, io_s, expert_s,
                          expert_source, read, resident_s, resident_source, host_s, host_source)


def _bytes(n: int) -> str:  # read rates are in GB/s: decimal units beside them
    return f"{n / 1e9:,.1f} GB" if n >= 10**8 else fmt_bytes(n)


def _range(a: float, b: float, unit: str, fmt: str = "{:.3g}") -> str:
    return fmt.format(a) + unit if math.isclose(a, b) else f"{fmt.format(a)}-{fmt.format(b)}{unit}"


def format_estimate(e: DecodeEstimate) -> str:
    low, high = e.tok_s
    rate = "no reads and no measured compute cost to bound it" if math.isinf(high) else \
        _range(low, high, " tok/s")
    out = [f"decode estimate (not a measurement): {rate}",
           f"  reads: {e.records_per_token:,} records/token x {e.record_stride:,} B at "
           f"{e.disk_gbps:g} GB/s ({e.disk_source}); miss rate {e.miss_k3like:.2f} (routes like "
           f"synth:k3's through LRU) to {e.miss_uniform:.2f} (uniform routes), "
           f"{e.cached_per_layer} of {e.experts_per_layer} experts cached per layer -> "
           f"{_range(*e.io_s, ' s/token')}"]
    if e.expert_s is not None:
        out.append(f"  expert kernels: {e.expert_source} -> {_range(*e.expert_s, ' s/token')}")
    else:
        out.append(f"  expert kernels: {e.expert_source}: not counted")
    if e.resident_s is not None:
        out.append(f"  resident matrices: {_bytes(e.resident_read_bytes)} read per token at "
                   f"{e.resident_source} -> {_range(*e.resident_s, ' s/token')}")
    else:
        out.append(f"  resident matrices: {_bytes(e.resident_read_bytes)} read per token; "
                   f"{e.resident_source}: not counted")
    if e.host_source:
        out.append(f"  host work the GPU waits for: {e.host_source} -> "
                   f"{_range(*e.host_s, ' s/token')}")
    if e.compute_s is not None:
        out.append("  every expert cached: " + _range(*e.tok_s_at(0.0), " tok/s") + "; at a "
                   f"{1 - e.miss_k3like:.0%} hit rate (K3-like routes): "
                   + _range(*e.tok_s_at(e.miss_k3like), " tok/s"))
    out.append("  low end: reads after the compute, uniform routes; high end: reads hidden "
               "under the compute, K3-like routes" + (
                   "" if e.compute_s is None else
                   "; the GPU's slow end is its first run, its fast end the goal, expected"
                   if e.host_source else
                   "; more cores and memory bandwidth than a 2-core VM compute faster"))
    return "\n".join(out)


def measure_disk(directory: str | os.PathLike, record_bytes: int, total_bytes: int = 256 << 20,
                 depth: int = 16) -> tuple[int, float]:
    """(bytes, seconds) of random whole-record reads from a scratch file of `total_bytes` written
    in `directory` (on the drive to measure) and deleted after: the file is synced and dropped
    from the page cache, then its records are read in shuffled order, `depth` in flight, with
    O_DIRECT where the file system has it. Blocks (a few seconds)."""
    stride = align_up(record_bytes)  # a bank slot: the record, 4 KiB-rounded
    n = max(depth, total_bytes // stride)
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such directory to measure the drive in")
    fd, name = tempfile.mkstemp(prefix=".mtplx-disk-", dir=directory)
    try:
        chunk = os.urandom(stride)  # incompressible, in case the drive compresses
        for _ in range(n):
            os.write(fd, chunk)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        fd = -1
        try:
            rfd = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:  # tmpfs and some others refuse O_DIRECT: dropped page cache instead
            rfd = os.open(name, os.O_RDONLY)
        try:
            order = list(range(n))
            random.Random(0).shuffle(order)
            local = threading.local()  # one aligned buffer per reading thread

            def read(i: int) -> int:
                if not hasattr(local, "buf"):
                    local.buf = aligned_buffer(stride)
                return os.preadv(rfd, [local.buf], order[i] * stride)

            t0 = time.perf_counter()
            with ThreadPoolExecutor(depth) as pool:
                got = sum(pool.map(read, range(n)))
            return got, time.perf_counter() - t0
        finally:
            os.close(rfd)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(name)
