"""First-token latency and the first tokens' tok/s from a cold page cache, with and without the
warm start (offload/warm.py), on a K3-geometry slice whose experts all fit the cache.

    make_k3_slice (real 3584/3072 t158 experts, small trunk) -> build_artifact (keep)
      -> one priming run (--warm FILE) so the file holds this artifact's counts
      -> per round, the modes interleaved (order rotated each round), page cache evicted before
         each: load (warm off | warm FILE), prompt, --tokens greedy tokens

Modes: off (cold start), warm (the warm start overlapping the first prompt, as `mtplx generate`
runs it), warm_wait (load, wait for the warm to finish, then the prompt: decode from a full
cache). One line per run: load seconds, first-token latency from the prompt and from the start
of load, decode tok/s over the first --tokens tokens (tokens 2..N over their time), the kernel
bound (1 / (MoE layers x top-k x time per expert)) and the ratio to it, compute-tier misses in
decode, and what the warm read (records, MiB, seconds).

    python tools/bench_warm.py [--layers 1] [--experts 128] [--tokens 64] [--repeats 2]
                               [--kernels cpu|reference] [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_decode import commit, evict, expert_seconds, part_paths, slice_artifact

from mtplx_runtime import load, load_model
from mtplx_runtime.artifact.integrity import RECEIPTS_ENV
from mtplx_runtime.engine.generate import generate_step
from mtplx_runtime.kernels import name_of, select_backend

PROMPT = [3, 17]
MODES = ("off", "warm", "warm_wait")


def run(art: Path, paths: list[Path], mode: str, warm_file: Path, slots: int, tokens: int,
        kernels) -> dict:
    """One cold-page-cache run of `mode`: timings from the start of load."""
    evict(paths)
    t0 = time.perf_counter()
    with load(art, dtype="bfloat16", kernels=kernels, lookahead=0, cache_slots=(slots, 0),
              tokenizer=False, warm="off" if mode == "off" else warm_file) as rt:
        t_load = time.perf_counter()
        if mode == "warm_wait":
            rt.provider.warm.wait()
        t_prompt = time.perf_counter()
        stamps, misses0 = [], None
        for _ in generate_step(rt.model, PROMPT, max_tokens=tokens):
            stamps.append(time.perf_counter())
            if misses0 is None:
                misses0 = rt.provider.stats()["totals"]["compute"]["misses"]
        misses = rt.provider.stats()["totals"]["compute"]["misses"] - misses0
        warm = rt.provider.warm.stats() if rt.provider.warm is not None else None
    n = len(stamps)
    return {"load_s": t_load - t0, "ttft_s": stamps[0] - t_prompt, "first_s": stamps[0] - t0,
            "tok_s": (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else 0.0, "tokens": n,
            "decode_misses": misses, "warm": warm}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_warm.py", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1, help="MoE layers in the slice")
    ap.add_argument("--experts", type=int, default=128, help="routed experts per layer")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens generated per run")
    ap.add_argument("--repeats", type=int, default=2, help="rounds over the modes")
    ap.add_argument("--kernels", default=None, help="expert kernel backend (default: auto)")
    ap.add_argument("--dir", type=Path, default=None,
                    help="where the slice and artifact go (default: a temp dir under /work)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the slice in --dir and reuse an artifact already built there")
    a = ap.parse_args(argv)
    kernels = select_backend(a.kernels)
    if kernels.DEVICE != "cpu":
        ap.error("bench_warm runs the model on the CPU: use --kernels cpu or reference")
    cpus = len(os.sched_getaffinity(0))
    torch.set_num_threads(cpus)
    base = a.dir or Path(tempfile.mkdtemp(prefix="bench_warm_",
                                          dir="/work" if os.path.isdir("/work") else None))
    base.mkdir(parents=True, exist_ok=True)
    os.environ[RECEIPTS_ENV] = tempfile.mkdtemp(prefix="receipts_", dir=base)
    try:
        art, build_s = slice_artifact(base, a.layers, a.experts, a.keep)
        paths = part_paths(art)
        bank = sum(p.stat().st_size for p in paths)
        slots = a.experts  # the cache holds every expert of every layer
        print(f"# bench_warm commit={commit()} python={platform.python_version()} "
              f"torch={torch.__version__} numpy={np.__version__} cpus={cpus} "
              f"threads={torch.get_num_threads()} layers={a.layers} experts={a.experts} "
              f"top_k=16 bank_bytes={bank} slots_per_layer={slots} tokens={a.tokens} "
              f"prompt={len(PROMPT)} dtype=bfloat16 build_s={build_s:.0f} "
              f"kernels={name_of(kernels)} load={os.getloadavg()[0]:.2f}", flush=True)
        model = load_model(art, dtype="bfloat16")
        t_exp = expert_seconds(art, model, kernels)
        bound = 1.0 / (a.layers * model.cfg.num_experts_per_token * t_exp)
        del model
        warm_file = base / "bench.warm"
        prime = run(art, paths, "warm", warm_file, slots, a.tokens, kernels)  # writes the file
        print(f"# expert_ms={t_exp * 1e3:.2f} kernel_bound_tok_s={bound:.2f}; priming run "
              f"tok_s={prime['tok_s']:.2f} wrote {warm_file.name}", flush=True)
        for rep in range(a.repeats):
            k = rep % len(MODES)
            for mode in MODES[k:] + MODES[:k]:
                r = run(art, paths, mode, warm_file, slots, a.tokens, kernels)
                w = r["warm"]
                warm = ("-" if w is None else
                        f"{w['records']}/{w['planned']}:{w['bytes'] / 2**20:.0f}MiB:"
                        f"{w['seconds']:.2f}s")
                print(f"round={rep} mode={mode} load_s={r['load_s']:.2f} "
                      f"ttft_s={r['ttft_s']:.3f} first_token_from_load_s={r['first_s']:.2f} "
                      f"tok_s_first{r['tokens']}={r['tok_s']:.2f} "
                      f"kernel_bound_tok_s={bound:.2f} ratio={r['tok_s'] / bound:.2f} "
                      f"decode_misses={r['decode_misses']} warm={warm} "
                      f"load={os.getloadavg()[0]:.2f}", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
