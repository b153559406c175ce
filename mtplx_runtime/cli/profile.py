"""`mtplx profile TRACE...`: replay route traces through the cache policies, print the table.

    traces -> replay.profile (every policy x capacity, plus Belady) -> stats -> table/JSON/CSV/PNG
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from ..extras import install_hint

PROG = "mtplx profile"


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _capacities(text: str) -> list[int]:
    caps = _csv(text)
    if not caps or not all(c.isdecimal() for c in caps):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated slot counts (integers >= 0, e.g. 64,128), got {text!r}")
    return [int(c) for c in caps]


def _budgets(text: str) -> list[int]:
    from ..engine.plan import PlanError, parse_bytes

    if not _csv(text):
        raise argparse.ArgumentTypeError(f"expected comma-separated byte sizes (e.g. "
                                         f"8GiB,16GiB), got {text!r}")
    try:
        return [parse_bytes(b) for b in _csv(text)]
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _policies(text: str) -> list[str]:
    from ..profile.replay import POLICY_NAMES, make

    names = _csv(text)
    for name in names:
        try:
            make(name, [])  # building one is the check: it parses and range-checks freq:DECAY
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                f"{e} ({', '.join(POLICY_NAMES)}; freq:DECAY with 0 < DECAY <= 1)") from None
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated policies, got {text!r}")
    return names


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return v


def _workers(text: str) -> int:
    if not text.isdecimal():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help="route trace (mtplx JSONL, plain text lists, .npy [N,L,K]) or "
                        "synth:uniform|zipf|temporal|k3,tokens=N,layers=L,experts=E,top_k=K,"
                        "alpha=A,locality=P,seed=S")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--capacity", type=_capacities,
                     help="total cache slots (all layers together), comma-separated (default: "
                          "layers x 1, 2, 4, 8 top-k, at most all experts)")
    cap.add_argument("--capacity-bytes", type=_budgets,
                     help="device cache budgets (e.g. 8GiB,16GiB), in 4 KiB-aligned slots of "
                          "one record")
    p.add_argument("--scope", choices=("layer", "global"), default="layer",
                   help="per-layer quotas (capacity split evenly) or one shared cache")
    p.add_argument("--policy", type=_policies, default=["lru", "lfu", "freq"],
                   help="lru, lfu, freq[:DECAY], belady (Belady's MIN is always added)")
    p.add_argument("--disk-gbps", type=_positive, default=7.0, help="drive read rate, GB/s")
    p.add_argument("--record-codec", "--codec", dest="record_codec",
                   choices=("t158", "w3", "mxfp4"),
                   help="price each miss as a K3 record of this codec (t158 7.74 MB, w3 13.4 "
                        "MB, mxfp4 17.5 MB; --codec: the older spelling) (default: the traces' "
                        "record_bytes, else t158)")
    p.add_argument("--prefill-chunk", type=int, default=64,
                   help="prefill chunk the trace was recorded with (prefill read counting)")
    p.add_argument("--workers", type=_workers, default=0,
                   help="replay processes (0: CPU count)")
    p.add_argument("--plot", metavar="OUT.png",
                   help="write OUT.png (hit rate), OUT-io.png (tok/s), OUT-layers.png and "
                        "OUT-reuse.png; needs matplotlib (the `profile` extra): without it the "
                        "table is still printed and the command exits 1")
    p.add_argument("--json", metavar="OUT.json", help="write the full report as JSON")
    p.add_argument("--csv", metavar="OUT.csv", help="write one row per (capacity, policy)")


def _record_bytes(traces, codec: str | None) -> tuple[int, str | None]:
    """(bytes one miss reads, codec name or None when they come from the traces' headers)."""
    from ..engine.trace import TraceError
    from ..profile.replay import record_bytes

    if codec is not None:
        return record_bytes(codec), codec
    found = {tr.record_bytes for tr in traces}
    if len(found) > 1:
        names = ", ".join(f"{tr.name} {tr.record_bytes}" for tr in traces)
        raise TraceError(f"the traces disagree on record_bytes ({names}); pass --record-codec "
                         f"to price them all alike")
    (rec,) = found
    return (record_bytes("t158"), "t158") if rec is None else (rec, None)


class Progress:
    """`progress(done, total)` for a long replay: one line on `err` (`text` formatted with done
    and total) once `after_s` have passed, then every `every_s` seconds, so a replay that ends
    quickly says nothing and a long one is never silent."""

    def __init__(self, text: str, err, after_s: float = 2.0, every_s: float = 5.0, clock=None):
        self.text, self.err, self.every_s = text, err, every_s
        self.clock = clock or time.monotonic
        self.start = self.clock()
        self.next = self.start + after_s

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if now >= self.next and done < total:
            print(f"{PROG}: {self.text.format(done=done, total=total)} "
                  f"({now - self.start:.0f} s)", file=self.err, flush=True)
            self.next = now + self.every_s


def run(args, err=None) -> dict:
    """Everything but printing and plotting: the report as a dict (also written to --json and
    --csv), progress of a long replay on `err` (default stderr). Bad traces raise TraceError."""
    from ..engine.trace import TraceError
    from ..formats.record import align_up
    from ..profile import report, stats
    from ..profile.replay import merge, profile
    from ..profile.traces import load

    err = sys.stderr if err is None else err
    t0 = time.perf_counter()
    traces = [load(s) for s in args.traces]
    first = traces[0]
    for tr in traces:
        if tr.layers != first.layers or tr.experts != first.experts:
            raise TraceError(f"{tr.name}: layers/experts differ from {first.name}")
        if not tr.decode.any():
            raise TraceError(f"{tr.name}: no decode lines to replay")
    rec, codec = _record_bytes(traces, args.record_codec)
    nl, k = len(first.layers), first.top_k
    if args.capacity_bytes:
        # The runtime gives each record a 4 KiB-aligned slot (engine/plan.py record_stride).
        caps = [b // align_up(rec) for b in args.capacity_bytes]
    elif args.capacity:
        caps = args.capacity
    else:
        caps = sorted({nl * min(k * m, first.experts) for m in (1, 2, 4, 8)})
    runs, missed = [], None
    for i, tr in enumerate(traces):
        unit = "layers" if args.scope == "layer" else "configurations"
        hook = Progress(f"replaying {tr.name} ({int(tr.decode.sum()):,} decode tokens x "
                        f"{len(tr.layers)} layers) through {len(args.policy) + 1} policies x "
                        f"{len(caps)} capacities: {{done}}/{{total}} {unit}", err)
        res, m = profile(tr, args.policy, caps, args.scope, workers=args.workers or None,
                         progress=hook)
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

    meta = {"version": version("mtplx_runtime"), "traces": len(traces),
            "trace_names": [tr.name for tr in traces], "layers": first.layers,
            "experts": first.experts, "top_k": k, "scope": args.scope, "codec": codec}
    s = report.summarise(results, decode_tokens, rec, args.disk_gbps, meta, st)
    s["elapsed_s"] = time.perf_counter() - t0
    if args.json:
        report.write_json(s, args.json)
    if args.csv:
        report.write_csv(s, args.csv)
    return s


def main(args) -> int:
    """0, or 2 for a bad trace, or 1 when --plot cannot plot (the table is printed first)."""
    from ..engine.trace import TraceError
    from ..profile import report

    try:
        s = run(args)
    except TraceError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(report.table(s))
    print(f"({s['elapsed_s']:.1f} s)")
    if args.plot:
        if not report.can_plot():
            print(f"{PROG}: error: --plot needs matplotlib: {install_hint('profile')}",
                  file=sys.stderr)
            return 1
        print("plots: " + " ".join(str(p) for p in report.plot(s, args.plot)))
    return 0
