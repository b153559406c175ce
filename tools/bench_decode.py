"""Streamed decode of a K3-geometry slice from a cold disk, against its I/O and compute bounds.

    make_k3_slice (real 3584/3072 t158 experts, small trunk) -> build_artifact (keep)
      -> raw O_DIRECT sequential read of a bank part (disk rate, cold)
      -> one expert at T=1 through the chosen kernel backend on its record bytes (compute rate)
      -> per lookahead in (0, 1) and read-time verification off / on: evict page cache,
         mtplx_runtime.load with --slots-per-layer cache slots per MoE layer, prefill, decode
         --tokens greedy tokens

One line per configuration (verify=off: --no-verify; verify=sha256: the default read-time
check on a fresh receipt directory, so every record's first read is checked against its manifest
SHA-256; verify=xxh3: the same again after that run, so the records it read are checked with
their learned XXH3, the steady state of a long-running user): decode tok/s, compute-tier hit
rate, SSD bytes per decoded token (demand + speculative reads), stall share (time forwards
blocked on reads / decode time), the I/O bound (raw disk rate / bytes per token), the compute
bound (1 / (MoE layers x top-k x time per expert)), tok/s as a ratio of the smaller bound, the
check share (seconds the reader threads spent hashing in decode, summed over threads, / decode
time: the cost if none of it overlapped anything) and the record checks passed by XXH3 alone /
by SHA-256. Before each measurement the bank is written back (sync) and dropped from the page
cache (posix_fadvise DONTNEED), and mincore checks it really left (the run stops otherwise). A
configuration whose decode beats its own I/O bound is marked INVALID=ratio_above_1 and the run
exits 1: a bound the run beats was measured wrong, it is not a result.

`--routes TRACE` replays a recorded route trace (FORMAT.md "Route traces"; the trained model's
is tests/data/kjv-routes.jsonl) instead of the slice's random routers, whose picks are nearly
uniform: decode step i of every MoE layer uses the trace's route of line i, each trace expert
standing for 16 / top-k slice experts (a bundle read and evicted together), slice layer j taking
trace layer j mod L. Lookahead is 0 only: the slice's routers cannot guess a replayed route.

    python tools/bench_decode.py [--layers 2] [--experts 896] [--tokens 8]
                                 [--slots-per-layer 32] [--kernels auto|reference|cpu|cuda]
                                 [--repeats 1] [--dir DIR] [--keep] [--config NAME|PATH]
                                 [--routes TRACE]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from mtplx_runtime import load, load_model
from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.artifact.integrity import RECEIPTS_ENV
from mtplx_runtime.artifact.manifest import MANIFEST_NAME, load_manifest
from mtplx_runtime.engine.generate import GenerationStats, generate_step
from mtplx_runtime.engine.presets import PresetError, add_config_arg, parse_args
from mtplx_runtime.engine.trace import read_trace
from mtplx_runtime.fixtures.k3_slice import make_k3_slice
from mtplx_runtime.kernels import name_of, select_backend
from mtplx_runtime.offload.buffers import aligned_buffer
from mtplx_runtime.offload.provider import StreamingExpertProvider

PROMPT = [3, 17]
SLICE_TOP_K = 16  # make_k3_slice keeps K3's top-k
CHUNK = 8 * 2**20
RAW_READ_BYTES = 2 * 2**30


def part_paths(art: Path) -> list[Path]:
    m = load_manifest(art / MANIFEST_NAME)
    return [art / p.file for p in m.sidecar.parts]


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
    """Write back, then drop every bank part from the page cache, and check with mincore that
    nothing stayed: pages still being written back cannot be dropped, and reads served from
    memory would let decode "beat" the disk (a run right after a build did: ratio 1.83)."""
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
    raise SystemExit(f"bench_decode: {left / 2**20:.0f} MiB of the bank is still in the page "
                     "cache after dropping it; cold-cache numbers would be wrong (is another "
                     "process reading it, or writeback stuck?)")


def raw_disk_bps(paths: list[Path]) -> float:
    """Cold sequential O_DIRECT read of (up to RAW_READ_BYTES of) the first bank part (buffered
    where the file system has no O_DIRECT, e.g. tmpfs, as the runtime's reader then is)."""
    evict(paths)
    buf = aligned_buffer(CHUNK)
    try:
        fd = os.open(paths[0], os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(paths[0], os.O_RDONLY)
    try:
        size = min(os.fstat(fd).st_size // CHUNK * CHUNK, RAW_READ_BYTES)
        done, t0 = 0, time.perf_counter()
        while done < size:
            n = os.preadv(fd, [memoryview(buf)], done)
            if n <= 0:
                break
            done += n
        return done / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def expert_seconds(art: Path, model, kernels, repeats: int = 5) -> float:
    """Median time of one expert at T=1 the way the runtime computes it: the kernel backend's
    expert_mlp on the record bytes as read into a slot (host slots: the cpu / reference path)."""
    cfg = model.cfg
    with StreamingExpertProvider(art, cfg, model.dtype, compute_bytes=1, lookahead=0,
                                 kernels="reference") as prov:
        buf = aligned_buffer(prov.stride_bytes)
        part, off, length, check = prov.locate((cfg.moe_layers[0], 0))
        prov.reader.read_into(part, off, length, buf, digest=check).result()
        layout = prov.layout
    args = dict(shapes=cfg.expert_shapes, beta=cfg.activation_situ_beta,
                beta_lin=cfg.activation_situ_linear_beta)
    r = torch.randn(1, cfg.routed_expert_hidden_size).to(model.dtype)
    ids, w = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        kernels.expert_mlp(r, ids, w, {0: 0}, {0: buf}, layout, **args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def snapshot(provider) -> dict:
    st = provider.stats()
    dev, pf = st["totals"]["compute"], st["prefetch"]
    return {"hits": dev["hits"], "lookups": dev["lookups"], "stall_ms": st["stall_ms"],
            "bytes": pf["demand_bytes"] + pf["spec_bytes"],
            "check_s": (st["checks"] or {}).get("seconds", 0.0)}


def trace_routes(path: Path, layers: int, experts: int,
                 top_k: int = SLICE_TOP_K) -> list[list[torch.Tensor]]:
    """The decode routes of a trace mapped onto the slice: per decode line, per slice MoE layer
    j, ids [1, top_k] (ascending) of trace layer j mod L, trace expert e standing for slice
    experts e * (experts // E) + 0 .. top_k / K - 1."""
    header, lines = read_trace(path)
    E, k = header["experts"], header["top_k"]
    if top_k % k or (experts // E) < top_k // k:
        raise ValueError(f"{path}: top-{k} of {E} experts does not map onto top-{top_k} of "
                         f"{experts}")
    bundle, stride = top_k // k, experts // E
    src = [str(header["layers"][j % len(header["layers"])]) for j in range(layers)]
    return [[torch.tensor([sorted(e * stride + i for e in line["routes"][la]
                                  for i in range(bundle))]) for la in src]
            for line in lines if line["phase"] == "decode"]


def replay_step(model, state, routes: list[torch.Tensor], tok: int) -> torch.Tensor:
    """One decode forward with every MoE layer's experts forced to `routes`."""
    for moe, ids in zip(model.moe_blocks(), routes):
        moe.forced_ids = ids
    return model.decode(tok, state)


def run_config(art: Path, paths: list[Path], lookahead: int, slots: int, tokens: int,
               kernels, verify: bool, routes: list | None = None) -> dict:
    evict(paths)
    with load(art, dtype="bfloat16", kernels=kernels, lookahead=lookahead,
              cache_slots=(slots, 0), tokenizer=False, verify=verify) as rt:
        stats, before = GenerationStats(), None
        if routes is None:
            for _ in generate_step(rt.model, PROMPT, max_tokens=tokens + 1, stats=stats):
                if before is None:  # prefill done, no decode forward yet
                    before = snapshot(rt.provider)
        else:
            state = rt.model.new_state()
            logits = rt.model.prefill(PROMPT, state)[-1]
            before = snapshot(rt.provider)
            for step in routes[:tokens]:
                t0 = time.perf_counter()
                logits = replay_step(rt.model, state, step, int(logits.argmax()))
                stats.decode_s += time.perf_counter() - t0
                stats.decode_forwards += 1
        after = snapshot(rt.provider)
        checks = rt.provider.stats()["checks"] or {}
    d = {k: after[k] - before[k] for k in after}
    n = stats.decode_forwards
    return {"tokens": n, "decode_s": stats.decode_s,
            "tok_s": n / stats.decode_s,
            "hit_rate": d["hits"] / d["lookups"] if d["lookups"] else 0.0,
            "bytes_per_token": d["bytes"] / n,
            "stall_share": d["stall_ms"] / 1e3 / stats.decode_s,
            "check_share": d["check_s"] / stats.decode_s,
            "checks": "/".join(str(checks.get(k, 0)) for k in ("xxh3", "sha256"))}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_decode.py", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2, help="MoE layers in the slice")
    ap.add_argument("--experts", type=int, default=896, help="routed experts per layer")
    ap.add_argument("--tokens", type=int, default=8, help="decode steps timed per config")
    ap.add_argument("--slots-per-layer", type=int, default=32, help="compute-tier cache slots")
    ap.add_argument("--kernels", default=None, help="expert kernel backend (default: auto)")
    ap.add_argument("--dir", type=Path, default=None,
                    help="where the slice and artifact go (default: a temp dir under /work)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds over every configuration (the disk's rate drifts between runs)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the slice in --dir and reuse an artifact already built there")
    ap.add_argument("--routes", type=Path, default=None,
                    help="replay this route trace's decode routes (lookahead 0 only)")
    add_config_arg(ap)  # of a preset's keys only `kernels` is a flag here
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    try:
        a = parse_args(ap, argv)
    except PresetError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    kernels = select_backend(a.kernels)
    if kernels.DEVICE != "cpu":
        ap.error("bench_decode runs the model on the CPU: use --kernels cpu or reference")
    try:
        routes = None if a.routes is None else trace_routes(a.routes, a.layers, a.experts)
    except (OSError, ValueError) as e:  # TraceError is a ValueError
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    cpus = len(os.sched_getaffinity(0))  # a run pinned with taskset gets what it was given
    torch.set_num_threads(cpus)
    base = a.dir or Path(tempfile.mkdtemp(prefix="bench_decode_",
                                          dir="/work" if os.path.isdir("/work") else None))
    src, art = base / "src", base / "art"
    try:
        t0 = time.perf_counter()
        if not (a.keep and (art / MANIFEST_NAME).is_file()):
            make_k3_slice(src, moe_layers=a.layers, experts=a.experts)
            build_artifact(src, art, codec="keep", progress=False)
            if not a.keep:
                shutil.rmtree(src)
        build_s = time.perf_counter() - t0
        paths = part_paths(art)
        bank = sum(p.stat().st_size for p in paths)
        print(f"# bench_decode commit={commit()} python={platform.python_version()} "
              f"torch={torch.__version__} numpy={np.__version__} cpus={cpus} "
              f"threads={torch.get_num_threads()} layers={a.layers} experts={a.experts} top_k=16 "
              f"bank_bytes={bank} slots_per_layer={a.slots_per_layer} tokens={a.tokens} "
              f"prompt={len(PROMPT)} dtype=bfloat16 build_s={build_s:.0f} "
              f"kernels={name_of(kernels)}"
              + ("" if routes is None else f" routes={a.routes.name}:{len(routes)}"), flush=True)
        disk = raw_disk_bps(paths)
        model = load_model(art, dtype="bfloat16")
        t_exp = expert_seconds(art, model, kernels)
        k = model.cfg.num_experts_per_token
        del model
        compute_bound = 1.0 / (a.layers * k * t_exp)
        print(f"# raw_odirect_seq_gbps={disk / 1e9:.3f} expert_ms={t_exp * 1e3:.1f} "
              f"(one t158 expert, T=1, bf16 model) compute_bound_tok_s={compute_bound:.3f}",
              flush=True)
        beaten = 0
        for rep in range(a.repeats):
            if rep:  # the disk's rate drifts: measure it again before every round
                disk = raw_disk_bps(paths)
                print(f"# round={rep} raw_odirect_seq_gbps={disk / 1e9:.3f}", flush=True)
            for la in (0, 1) if routes is None else (0,):
                # A fresh receipt directory per round and lookahead: "sha256" learns, "xxh3"
                # reuses; odd rounds move "off" last so no configuration always runs first.
                os.environ[RECEIPTS_ENV] = tempfile.mkdtemp(prefix="receipts_", dir=base)
                order = ("off", "sha256", "xxh3") if rep % 2 == 0 else ("sha256", "xxh3", "off")
                for verify in order:
                    r = run_config(art, paths, la, a.slots_per_layer, a.tokens, kernels,
                                   verify != "off", routes)
                    io_bound = (disk / r["bytes_per_token"] if r["bytes_per_token"]
                                else float("inf"))
                    ratio = r["tok_s"] / min(io_bound, compute_bound)
                    beaten += ratio > 1.0
                    print(f"round={rep} lookahead={la} verify={verify} tok_s={r['tok_s']:.3f} "
                          f"hit_rate={r['hit_rate']:.3f} "
                          f"bytes_per_token={r['bytes_per_token']:.0f} "
                          f"stall_share={r['stall_share']:.3f} io_bound_tok_s={io_bound:.3f} "
                          f"compute_bound_tok_s={compute_bound:.3f} ratio={ratio:.2f} "
                          f"check_share={r['check_share']:.3f} "
                          f"checks_xxh3/sha256={r['checks']}"
                          + (" INVALID=ratio_above_1" if ratio > 1.0 else ""), flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    if beaten:  # a decode faster than its own bound means the bound was wrong, not a result
        print(f"bench_decode: error: {beaten} configuration(s) beat their I/O bound (ratio > 1): "
              "the disk's rate moved between the raw read and the run, or reads were served "
              "from memory; those lines are not results", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
