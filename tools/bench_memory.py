"""Planned against measured peak RSS of `mtplx generate` across memory budgets, on a K3-geometry
slice (real 3584/3072 t158 experts, 1 MoE layer by default).

    make_k3_slice -> build_artifact (keep) -> per budget (the plan's minimum, then more slots,
      then the whole bank): a fresh interpreter runs `mtplx generate --memory-budget B`
      (default --prefill-chunk, a prompt of a few windows) and reads its own VmHWM, inside a
      fresh memory cgroup with no limit when this process may make one (root), whose peak also
      counts the page cache, page tables and kernel memory the process causes

One line per budget: the budget, compute slots and prefill pool the plan gives, the planned peak
(budget less slack and the kernel headroom: every planned byte in use), the measured peak RSS,
measured / planned, the reserve and what it had to cover (unplanned: measured less every planned
item but the reserve; RUNTIME_BASELINE_BYTES in engine/plan.py estimates it), the cgroup's peak
and what it held above the RSS peak (`cgroup_extra`, which the plan's KERNEL_HEADROOM_BYTES
covers; `kmem`: the kernel-memory part of the cgroup's peak), the compute-tier hit rate and
decode tok/s. A run whose RSS or cgroup peak exceeds its budget is marked OVER_BUDGET and the
run exits 1. VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork + exec.

    python tools/bench_memory.py [--experts 128] [--tokens 32] [--context 256]
                                 [--kernels auto|reference|cpu] [--dir DIR] [--keep]
                                 [--cgroup-root /sys/fs/cgroup | --no-cgroup] [--drop-caches]
                                 [--hard-limit]

`--drop-caches` (root) empties the whole page cache before each run, so the libraries the run
maps are read again and charged to its cgroup, as on a host that just booted: a page is charged
to the cgroup that first reads it, and with the libraries cached by an earlier process the
cgroup's peak can be below the RSS. Pages other running processes map stay cached.
`--hard-limit` gives each run's cgroup its budget as the limit, as a deployment's memory limit
would: `limit_hits` counts the times it had to reclaim to stay under, and a run it kills is OOM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_decode import commit  # tools/ is on sys.path when this script runs
from bench_peers import CgroupError, MemoryCgroup, in_cgroup

from mtplx_runtime.artifact.build import build_artifact
from mtplx_runtime.artifact.manifest import MANIFEST_NAME
from mtplx_runtime.engine.plan import fmt_bytes, make_plan
from mtplx_runtime.fixtures.k3_slice import make_k3_slice
from mtplx_runtime.kernels import name_of, select_backend

TOP_K = 16  # make_k3_slice keeps K3's top-k
PROMPT = "the word of the lord came unto him saying " * 8  # ~70 tokens: two prefill chunks
MiB = 2**20

# The child: `mtplx generate` as the CLI runs it, then its own peak RSS (kB in /proc).
CHILD = """
import json, sys
from mtplx_runtime.cli import main
rc = main(sys.argv[1:])
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"rc": rc, "peak_rss_bytes": int(hwm.split()[1]) * 1024}), file=sys.stderr)
"""


def run_generate(art: Path, budget: int, a, kernels: str) -> dict:
    """One `mtplx generate` in a fresh interpreter: its peak RSS, hit rate and decode tok/s, and
    with a cgroup root the peak of a fresh cgroup it ran in (`cgroup_peak`, `kmem_peak`)."""
    argv = [sys.executable, "-c", CHILD, "generate", str(art), "--prompt", PROMPT,
            "--max-tokens", str(a.tokens), "--memory-budget", str(budget), "--context",
            str(a.context), "--kernels", kernels]
    cg = (MemoryCgroup(f"mtplx_memory_{os.getpid()}_{time.monotonic_ns()}", a.cgroup_root)
          if a.cgroup_root else None)
    try:
        if cg:
            cg.set_limit(budget if a.hard_limit else None)
        if a.drop_caches:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3")
        out = subprocess.run(argv, capture_output=True, text=True, timeout=1800,
                             preexec_fn=in_cgroup(cg.procs_file()) if cg else None)
        peaks = ({"cgroup_peak": cg.peak(), "kmem_peak": cg.kmem_peak(),
                  "limit_hits": cg.limit_hits(), "oom": cg.oom_kills()} if cg else {})
    finally:
        if cg:
            cg.remove()
    if peaks.get("oom"):
        return peaks | {"peak_rss_bytes": 0, "hit": "?", "decode": "?"}
    lines = out.stderr.strip().splitlines()
    if out.returncode != 0 or not lines or not lines[-1].startswith("{"):
        raise SystemExit(f"bench_memory: generate at {budget:,} B failed:\n{out.stderr[-3000:]}")
    res = json.loads(lines[-1]) | peaks
    stats = next((ln for ln in lines if ln.startswith("mtplx generate: prompt")), "")
    res["hit"] = _field(stats, "cache hit rate ")
    res["decode"] = _field(stats, "decode ")
    return res


def cgroup_root(arg: str | None) -> str | None:
    """The cgroup mount to run children under, or None (with the reason) where none can be made."""
    if arg is None:
        return None
    try:
        MemoryCgroup(f"mtplx_memory_probe_{os.getpid()}", arg).remove()
    except (CgroupError, OSError) as e:
        print(f"# bench_memory: no cgroup peaks ({e}); RSS only", flush=True)
        return None
    return arg


def _field(line: str, key: str) -> str:
    """The word after `key` in the generate stats line ("?" when absent)."""
    i = line.find(key)
    return line[i + len(key):].split()[0].rstrip(",;") if i >= 0 else "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_memory.py", description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128, help="experts of the one MoE layer")
    ap.add_argument("--tokens", type=int, default=32, help="tokens to generate per run")
    ap.add_argument("--context", type=int, default=256, help="--context of each run")
    ap.add_argument("--kernels", default="auto", choices=("auto", "reference", "cpu"))
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp)")
    ap.add_argument("--keep", action="store_true", help="keep the slice artifact")
    ap.add_argument("--cgroup-root", default="/sys/fs/cgroup",
                    help="memory cgroup mount the runs go under (needs root)")
    ap.add_argument("--no-cgroup", dest="cgroup_root", action="store_const", const=None,
                    help="RSS peaks only")
    ap.add_argument("--hard-limit", action="store_true",
                    help="each run's cgroup limited to its budget, as a deployment's memory "
                         "limit: a run the limit kills is marked OOM")
    ap.add_argument("--drop-caches", action="store_true",
                    help="empty the page cache before each run (root; see the module docstring)")
    a = ap.parse_args(argv)
    a.cgroup_root = cgroup_root(a.cgroup_root)
    if a.hard_limit and not a.cgroup_root:
        ap.error("--hard-limit needs a memory cgroup (root, --cgroup-root)")
    if a.experts < 2 * TOP_K:
        ap.error(f"--experts must be >= {2 * TOP_K}")
    kernels = name_of(select_backend(a.kernels))
    work = a.dir or Path(tempfile.mkdtemp(prefix="bench_memory."))
    art = work / "art"
    try:
        t0 = time.perf_counter()
        if not (art / MANIFEST_NAME).is_file():
            make_k3_slice(work / "src", moe_layers=1, experts=a.experts, top_k=TOP_K)
            build_artifact(work / "src", art, codec="keep", progress=False)
            shutil.rmtree(work / "src")
        kw = dict(context=a.context, kernels=kernels, prefill_chunk=64)  # generate's default
        base = make_plan(art, memory_budget="1TiB", **kw)
        stride = base.record_stride
        # The minimum, a quarter and a half of the bank in slots, and the whole bank: the minimum
        # less its working set plus every record.
        budgets = [base.minimum_budget + n * stride for n in (0, a.experts // 4 - TOP_K,
                                                               a.experts // 2 - TOP_K)]
        budgets.append(base.minimum_budget + (a.experts - TOP_K) * stride)
        print(f"# bench_memory commit={commit()} python={platform.python_version()} "
              f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.2f} experts={a.experts} "
              f"top_k={TOP_K} record_bytes={base.record_bytes} kernels={kernels} "
              f"context={a.context} prefill_chunk=64 tokens={a.tokens} "
              f"minimum={fmt_bytes(base.minimum_budget)} runtime_baseline="
              f"{fmt_bytes(base.runtime_baseline)} build_s={time.perf_counter() - t0:.0f}",
              flush=True)
        over = False
        for budget in budgets:
            p = make_plan(art, memory_budget=budget, **kw)
            r = run_generate(art, budget, a, kernels)
            if r.get("oom"):
                over = True
                print(f"budget={budget / MiB:.0f}MiB slots={p.compute_slots}/{p.total_records} "
                      f"OOM (killed by the cgroup limit {budget / MiB:.0f}MiB)", flush=True)
                continue
            peak, planned = r["peak_rss_bytes"], p.planned_peak_bytes
            unplanned = peak - (planned - p.items["reserve"])  # what the reserve must cover
            cg_peak = r.get("cgroup_peak")
            cg = (f"cgroup_peak={cg_peak / MiB:.0f}MiB "
                  f"cgroup_extra={(cg_peak - peak) / MiB:.0f}MiB "
                  f"headroom={p.items['headroom'] / MiB:.0f}MiB " if cg_peak else "")
            if r.get("kmem_peak") is not None:
                cg += f"kmem={r['kmem_peak'] / MiB:.0f}MiB "
            if a.hard_limit:
                cg += f"limit_hits={r['limit_hits']} "
            high = max(peak, cg_peak or 0)
            flag = " OVER_BUDGET" if high > budget else ""
            over |= high > budget
            print(f"budget={budget / MiB:.0f}MiB slots={p.compute_slots}/{p.total_records} "
                  f"pool={p.transient_slots} planned={planned / MiB:.0f}MiB "
                  f"measured={peak / MiB:.0f}MiB ratio={peak / planned:.2f} "
                  f"reserve={p.items['reserve'] / MiB:.0f}MiB "
                  f"unplanned={unplanned / MiB:.0f}MiB {cg}hit={r['hit']} "
                  f"decode_tok_s={r['decode']} load={os.getloadavg()[0]:.2f}{flag}", flush=True)
        return 1 if over else 0
    finally:
        if not a.keep and a.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
