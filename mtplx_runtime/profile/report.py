"""Profiler output: the terminal table, JSON, CSV and PNG plots (matplotlib, imported lazily).

    replay results + stats -> summary dict -> table | JSON | CSV | plots (3 PNGs)
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

from .replay import Result, io_figures

CSV_FIELDS = ("policy", "capacity", "hits", "misses", "hit_rate", "belady_share",
              "misses_per_token", "ssd_bytes_per_token", "io_tok_s")


def summarise(results: list[Result], decode_tokens: int, rec_bytes: int, disk_gbps: float,
              meta: dict, stats: dict) -> dict:
    """The whole report as plain JSON-able data; each row gets its share of Belady's hits."""
    belady = {r.capacity: r.hits for r in results if r.policy == "belady"}
    rows = []
    for r in results:
        best = belady.get(r.capacity, 0)
        row = {"policy": r.policy, "capacity": r.capacity, "hits": r.hits, "misses": r.misses,
               "hit_rate": r.hit_rate, "belady_share": r.hits / best if best else None,
               **io_figures(r, decode_tokens, rec_bytes, disk_gbps),
               "per_layer_hit_rate": (r.per_layer_hits / np.maximum(r.per_layer_lookups, 1)
                                      ).tolist()}
        if math.isinf(row["io_tok_s"]):
            row["io_tok_s"] = None  # no misses: not I/O-bound
        rows.append(row)
    return {**meta, "decode_tokens": decode_tokens, "record_bytes": rec_bytes,
            "disk_gbps": disk_gbps, "results": rows, **stats}


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(s: dict) -> str:
    """A readable table: one row per (capacity, policy), then the trace statistics."""
    out = [f"mtplx profile {s['version']}: {s['traces']} trace(s), {s['decode_tokens']} decode "
           f"tokens, {len(s['layers'])} layers x {s['experts']} experts top-{s['top_k']}, "
           f"scope {s['scope']}, {s['codec']} record {s['record_bytes']:,} B, "
           f"disk {s['disk_gbps']} GB/s",
           f"{'capacity':>9} {'policy':<10} {'hit rate':>8} {'of MIN':>7} {'miss/tok':>9} "
           f"{'SSD MB/tok':>10} {'tok/s <=':>9}"]
    for r in s["results"]:
        out.append(f"{r['capacity']:>9} {r['policy']:<10} {r['hit_rate']:>8.2%} "
                   f"{_fmt(r['belady_share'], '>7.1%')} {r['misses_per_token']:>9.1f} "
                   f"{r['ssd_bytes_per_token'] / 1e6:>10.1f} {_fmt(r['io_tok_s'], '>9.2f')}")
    ws = ", ".join(f"{w} tok: {v:.1f}" for w, v in s["working_set"].items())
    pop = s["popularity"]
    out.append(f"working set (distinct experts per layer): {ws}")
    out.append(f"popularity: top-10% share {pop['mean_skew']:.1%}, entropy "
               f"{pop['mean_entropy_bits']:.2f} bits (mean over layers)")
    reuse = s["reuse"]
    if reuse["counts"]:
        tot = sum(reuse["counts"])
        cells = ", ".join(f"<{2 * e}: {c / tot:.0%}" for e, c in
                          zip(reuse["edges"], reuse["counts"]) if c)
        out.append(f"reuse distance (tokens): {cells}; never reused {reuse['never']:.1%}")
    for d, v in s.get("prefetch_by_depth", {}).items():
        out.append(f"lookahead depth {d}: coverage {v['coverage']:.1%} of "
                   f"{s['prefetch_reference']} misses")
    return "\n".join(out)


def write_json(s: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(s, indent=1) + "\n", encoding="utf-8")


def write_csv(s: dict, path: str | Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in s["results"]:
            w.writerow(r)


def plot_paths(path: str | Path) -> list[Path]:
    """OUT.png -> [OUT.png (hit rate vs capacity), OUT-layers.png, OUT-reuse.png]."""
    p = Path(path)
    return [p, p.with_name(f"{p.stem}-layers{p.suffix}"), p.with_name(f"{p.stem}-reuse{p.suffix}")]


def plot(s: dict, path: str | Path) -> list[Path]:
    """Write the three PNGs; returns their paths. Needs matplotlib (pip install matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve, heat, reuse = plot_paths(path)
    by_pol: dict = {}
    for r in s["results"]:
        by_pol.setdefault(r["policy"], []).append((r["capacity"], r["hit_rate"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for pol, pts in by_pol.items():
        pts.sort()
        ax.plot([c for c, _ in pts], [h for _, h in pts], "k--" if pol == "belady" else "-o",
                label="Belady MIN" if pol == "belady" else pol)
    ax.set(xlabel="cache capacity (slots)", ylabel="decode hit rate", ylim=(0, 1),
           title=f"hit rate vs capacity ({s['scope']} scope)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(curve, dpi=100)
    plt.close(fig)

    first = s["results"][0]["policy"]
    rows = [r for r in s["results"] if r["policy"] == first]
    grid = np.array([r["per_layer_hit_rate"] for r in rows]).T  # [L, C]
    fig, ax = plt.subplots(figsize=(6, 5))
    im = ax.imshow(grid, aspect="auto", vmin=0, vmax=1, cmap="viridis", origin="lower")
    ax.set_xticks(range(len(rows)), [str(r["capacity"]) for r in rows])
    ax.set(xlabel="capacity (slots)", ylabel="MoE layer (position)",
           title=f"per-layer hit rate, {first}")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(heat, dpi=100)
    plt.close(fig)

    h = s["reuse"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(range(len(h["counts"])), h["counts"])
    ax.set_xticks(range(len(h["edges"])), [str(e) for e in h["edges"]], rotation=45)
    ax.set(xlabel="reuse distance >= (tokens)", ylabel="reuses",
           title="reuse-distance histogram (same layer, same expert)")
    fig.tight_layout()
    fig.savefig(reuse, dpi=100)
    plt.close(fig)
    return [curve, heat, reuse]
