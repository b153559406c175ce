"""`mtplx profile TRACE...`: replay route traces through the cache policies, print the table.

    traces -> replay.profile (every policy x capacity, plus Belady) -> stats -> table/JSON/CSV/PNG
"""

from __future__ import annotations

import argparse
import sys
import time


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help="route trace (mtplx JSONL, plain text lists, .npy [N,L,K]) or "
                        "synth:uniform|zipf|temporal,tokens=N,layers=L,experts=E,top_k=K,"
                        "alpha=A,locality=P,seed=S")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--capacity", type=_csv,
                     help="total cache slots, comma-separated (default: layers x 1, 2, 4, 8 "
                          "top-k)")
    cap.add_argument("--capacity-bytes", type=_csv,
                     help="device cache budgets (e.g. 8GiB,16GiB), in records of --codec")
    p.add_argument("--scope", choices=("layer", "global"), default="layer",
                   help="per-layer quotas (capacity split evenly) or one shared cache")
    p.add_argument("--policy", type=_csv, default=["lru", "lfu", "freq"],
                   help="lru, lfu, freq[:DECAY], belady (Belady's MIN is always added)")
    p.add_argument("--disk-gbps", type=float, default=7.0, help="drive read rate, GB/s")
    p.add_argument("--codec", choices=("t158", "w3", "mxfp4"), default="t158",
                   help="K3 record size for SSD bytes (t158 7.74 MB, w3 13.4 MB, mxfp4 17.5 MB)")
    p.add_argument("--prefill-chunk", type=int, default=64,
                   help="prefill chunk the trace was recorded with (prefill read counting)")
    p.add_argument("--workers", type=int, default=0, help="replay processes (0: CPU count)")
    p.add_argument("--plot", metavar="OUT.png",
                   help="write OUT.png, OUT-layers.png, OUT-reuse.png (needs matplotlib)")
    p.add_argument("--json", metavar="OUT.json", help="write the full report as JSON")
    p.add_argument("--csv", metavar="OUT.csv", help="write one row per (capacity, policy)")


def run(args) -> dict:
    """Everything but printing: the report as a dict (also written to --json/--csv/--plot)."""
    from ..engine.plan import parse_bytes
    from ..profile import report, stats
    from ..profile.replay import merge, profile, record_bytes
    from ..profile.traces import load

    t0 = time.perf_counter()
    traces = [load(s) for s in args.traces]
    first = traces[0]
    for tr in traces[1:]:
        if tr.layers != first.layers or tr.experts != first.experts:
            raise ValueError(f"{tr.name}: layers/experts differ from {first.name}")
    rec = record_bytes(args.codec)
    nl, k = len(first.layers), first.top_k
    if args.capacity_bytes:
        caps = [parse_bytes(b) // rec for b in args.capacity_bytes]
    elif args.capacity:
        caps = [int(c) for c in args.capacity]
    else:
        caps = [nl * k * m for m in (1, 2, 4, 8) if k * m <= first.experts]
    if not caps or min(caps) < 0:
        raise ValueError(f"capacities must be >= 0, got {caps}")
    runs, missed = [], None
    for i, tr in enumerate(traces):
        res, m = profile(tr, args.policy, caps, args.scope, workers=args.workers or None)
        runs.append(res)
        if i == 0:
            missed = m
    results = merge(runs)
    decode_tokens = int(sum(int(tr.decode.sum()) for tr in traces))
    pf = stats.prefetch_quality(first, missed)
    prev = stats._prev_use(first)
    st = {"working_set": stats.working_set(first, _prev=prev),
          "reuse": stats.reuse_histogram(first, _prev=prev),
          "popularity": stats.popularity(first), "prefetch": pf,
          "prefetch_by_depth": stats.prefetch_by_depth(pf),
          "prefetch_reference": f"{results[0].policy}@{results[0].capacity}"}
    from importlib.metadata import version

    meta = {"version": version("mtplx_runtime"), "traces": len(traces), "layers": first.layers,
            "experts": first.experts, "top_k": k, "scope": args.scope, "codec": args.codec}
    s = report.summarise(results, decode_tokens, rec, args.disk_gbps, meta, st)
    s["elapsed_s"] = time.perf_counter() - t0
    if args.json:
        report.write_json(s, args.json)
    if args.csv:
        report.write_csv(s, args.csv)
    if args.plot:
        s["plots"] = [str(p) for p in report.plot(s, args.plot)]
    return s


def main(args) -> int:
    from ..profile.report import table

    try:
        s = run(args)
    except ValueError as e:
        print(f"mtplx profile: {e}", file=sys.stderr)
        return 2
    print(table(s))
    print(f"({s['elapsed_s']:.1f} s)")
    return 0
