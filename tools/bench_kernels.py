"""CPU expert kernels per codec at K3 geometry: time per layer, GB/s and % of memory bandwidth.

One layer = 16 experts of R 3584 -> I 3072 -> R 3584 (FORMAT.md "Bank parts") stored as bank
records, and T tokens that all route to those 16 experts, so every expert runs once over all T
tokens (the prefill shape; T = 1 is decode). For each codec (t158, mxfp4, ct-int 3-bit, ct-int 4-bit
in groups of 64 and of 32, fp8-block) and T = 1, 8, 64 it times `cpu.expert_mlp` (the native
multi-token kernels behind the backend API) and reports GB/s over the layer's packed record bytes
and the share of this machine's memory bandwidth, measured in the same run by a large NumPy copy
(read + write bytes). The reference path (`reference.expert_mlp`: NumPy codec decode, then torch
matmuls) is timed at T = 1 on fewer experts and scaled to 16 (its cost is the decode, so it barely
depends on T); the line says how many experts it timed.

    python tools/bench_kernels.py [--quick] [--repeat 3] [--threads N] [--ref-experts 2]
                                  [--tokens 1,8,64] [--dtype bfloat16|float32]

The activations are in the model dtype (`--dtype`, default bfloat16 as the runtime's default
model): bf16 rows are what the backend gets from a bf16 model, and the mxfp4 kernel has a path
for them (FORMAT.md "mxfp4"); float32 times the fp32-model path.

--quick: a smoke run (smaller geometry, 2 experts, T = 1 and 8) that finishes in seconds.
The records sit in `offload.buffers.aligned_buffer` memory, as the runtime's expert slots do
(2 MiB pages where the kernel grants them).
"""

from __future__ import annotations

import argparse
import os
import time
from types import SimpleNamespace

import numpy as np
import torch

from mtplx_runtime.formats.record import record_layout
from mtplx_runtime.kernels import cpu, cpu_native, reference
from mtplx_runtime.offload.buffers import aligned_buffer

# (mode, bits, group size; None: the mode's default)
CODECS = (("t158", None, None), ("mxfp4", None, None), ("ct-int", 3, None), ("ct-int", 4, None),
          ("ct-int", 4, 32), ("fp8-block", None, None))


def make_store(mode, bits, group, shapes, experts, rng):
    """(layout, uint8 [experts, record bytes]) of random codes with sane scales."""
    layout = record_layout(SimpleNamespace(expert_shapes=shapes), mode, bits, group)
    store = aligned_buffer(experts * layout.logical_bytes).reshape(experts, -1)  # zeroed
    for s in layout.segments:
        if s.proj is None:
            continue
        seg = store[:, s.offset:s.offset + s.length]
        if s.part in ("scales", "weight_scale") and mode != "mxfp4":  # bf16 scale bits
            seg.view(np.uint16)[...] = 0x3C23  # ~0.01
        elif s.part == "weight_scale":  # E8M0 around 2^-7, never the invalid 0xFF
            seg[...] = rng.integers(115, 125, seg.shape, dtype=np.uint8)
        elif s.part == "weight_scale_inv":  # fp8-block: f32 scales
            seg.view(np.float32)[...] = 1e-4
        else:  # every code value is valid (t158 decodes 243..255 too), bar fp8's two NaNs
            seg[...] = rng.integers(0, 256, seg.shape, dtype=np.uint8)
            if mode == "fp8-block":
                seg[(seg & 0x7F) == 0x7F] = 0x7E
    return layout, store


def best_time(fn, repeat):
    """Best of `repeat` timed calls after one untimed warm-up (thread pool start, page faults)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memory_bandwidth(nbytes, repeat=5):
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return 2 * nbytes / best_time(lambda: np.copyto(dst, src), repeat)  # read + write


def layer_call(backend, layout, store, shapes, T, experts, rng, dtype=torch.bfloat16):
    R = shapes["down"][0]
    x = torch.from_numpy(rng.standard_normal((T, R)).astype(np.float32)).to(dtype)
    ids = torch.arange(experts).repeat(T, 1)  # [T, experts]: every token uses every expert
    w = torch.full((T, experts), 1.0 / experts)
    slots = {e: e for e in range(experts)}
    return lambda: backend.expert_mlp(x, ids, w, slots, store, layout, shapes)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: small geometry, seconds")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0: all cores)")
    ap.add_argument("--ref-experts", type=int, default=2, help="experts the reference times")
    ap.add_argument("--tokens", help="comma-separated token counts (default 1,8,64)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the model dtype: the activations' (bf16 rows take the mxfp4 "
                         "avx512bf16 path where the CPU has it) and the rounding the backend "
                         "applies (default bfloat16, as a bf16 model runs)")
    args = ap.parse_args(argv)
    why = cpu_native.unavailable_reason()
    if why:
        raise SystemExit(why)
    if args.quick:
        R, I, experts, tokens, repeat, bw_bytes = 512, 384, 2, (1, 8), 1, 64 << 20
    else:
        R, I, experts, tokens, repeat, bw_bytes = 3584, 3072, 16, (1, 8, 64), args.repeat, 1 << 30
    if args.tokens:
        tokens = tuple(int(t) for t in args.tokens.split(","))
        if min(tokens) < 1:
            raise SystemExit(f"--tokens {args.tokens}: every count must be >= 1")
    ref_experts = min(args.ref_experts, experts)
    shapes = {"gate": (I, R), "up": (I, R), "down": (R, I)}
    if args.threads:
        os.environ["MTPLX_CPU_THREADS"] = str(args.threads)  # read by cpu_native per call
    rng = np.random.default_rng(0)
    dtype = getattr(torch, args.dtype)
    bw = memory_bandwidth(bw_bytes)
    print(f"machine: memory bandwidth (numpy copy, read+write) {bw / 1e9:.2f} GB/s; ISA "
          f"{cpu_native.isa()}; {cpu_native.default_threads()} threads; {args.dtype} model; "
          f"layer = {experts} "
          f"experts {R}->{I}->{R}; reference timed at T=1 on {ref_experts} experts, x"
          f"{experts / ref_experts:g}")
    for mode, bits, group in CODECS:
        layout, store = make_store(mode, bits, group, shapes, experts, rng)
        name = mode + (f"-{bits}" if bits else "") + (f"-g{group}" if group else "")
        nbytes = store.nbytes  # packed record bytes of the layer
        ref = best_time(layer_call(reference, layout, store[:ref_experts], shapes, 1,
                                   ref_experts, rng, dtype), 1) * experts / ref_experts
        for T in tokens:
            sec = best_time(layer_call(cpu, layout, store, shapes, T, experts, rng, dtype),
                            repeat)
            print(f"{name:<12s} T={T:<3d} cpu {sec * 1e3:9.2f} ms/layer {nbytes / sec / 1e9:7.2f} "
                  f"GB/s {nbytes / sec / bw:7.1%} of mem bw | reference(T=1) "
                  f"{ref * 1e3:9.1f} ms/layer  speedup {ref / sec:7.1f}x")
        del store


if __name__ == "__main__":
    main()
