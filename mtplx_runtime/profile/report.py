"""Profiler output: the terminal table, JSON, CSV and PNG plots (matplotlib, imported lazily).

    replay results + stats -> summary dict -> table | JSON | CSV | figures -> plots (4 PNGs)

The figure builders return matplotlib `Figure`s made without pyplot (no global figure registry,
no backend switch), so tests can read their axes and `plot` only saves them.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import math
from pathlib import Path

import numpy as np

from ..files import atomic_write
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


def record_label(s: dict) -> str:
    """'t158 record 7,741,440 B', or 'trace record 4,096 B' when the traces' headers priced it."""
    return f"{s['codec'] or 'trace'} record {s['record_bytes']:,} B"


def trace_label(s: dict) -> str:
    """The first trace's file name (or synth spec), '+N more' for several."""
    names = s["trace_names"]
    more = f" +{len(names) - 1} more" if len(names) > 1 else ""
    return f"{Path(names[0]).name}{more}"


def reuse_shares(reuse: dict) -> list[tuple[str, float]]:
    """(bin label, share of decode selections) per reuse-distance bin, then ('never reused',
    share): the bins the table prints and the reuse plot draws; the shares sum to 1."""
    n = reuse["selections"]
    bins = [(str(e) if e == 1 else f"{e}-{2 * e - 1}", c / n)
            for e, c in zip(reuse["edges"], reuse["counts"])]
    return [*bins, ("never reused", reuse["never"])]


def table(s: dict) -> str:
    """A readable table: one row per (capacity, policy), then the trace statistics."""
    out = [f"mtplx profile {s['version']}: {s['traces']} trace(s), {s['decode_tokens']} decode "
           f"tokens, {len(s['layers'])} layers x {s['experts']} experts top-{s['top_k']}, "
           f"scope {s['scope']}, {record_label(s)}, disk {s['disk_gbps']} GB/s",
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
    if s["reuse"]["selections"]:
        cells = ", ".join(f"{label}: {v:.1%}" for label, v in reuse_shares(s["reuse"]))
        out.append(f"reuse distance (tokens; share of selections): {cells}")
    for d, v in s.get("prefetch_by_depth", {}).items():
        out.append(f"lookahead depth {d}: coverage {v['coverage']:.1%} of "
                   f"{s['prefetch_reference']} misses")
    return "\n".join(out)


def write_json(s: dict, path: str | Path) -> None:
    atomic_write(path, (json.dumps(s, indent=1) + "\n").encode())


def write_csv(s: dict, path: str | Path) -> None:
    fh = io.StringIO(newline="")
    w = csv.DictWriter(fh, CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in s["results"]:
        w.writerow(r)
    atomic_write(path, fh.getvalue().encode())


# ---- plots -------------------------------------------------------------------------------

def can_plot() -> bool:
    """Whether matplotlib (the `profile` extra) is importable."""
    return importlib.util.find_spec("matplotlib") is not None


def plot_paths(path: str | Path) -> list[Path]:
    """OUT.png -> [OUT.png (hit rate), OUT-io.png (tok/s), OUT-layers.png, OUT-reuse.png]."""
    p = Path(path)
    return [p.with_name(f"{p.stem}{tag}{p.suffix}") for tag in ("", "-io", "-layers", "-reuse")]


def figures(s: dict) -> list:
    """The four figures of `plot_paths`, in that order."""
    return [hit_rate_figure(s), io_figure(s), layers_figure(s), reuse_figure(s)]


def plot(s: dict, path: str | Path) -> list[Path]:
    """Write the four PNGs of `plot_paths`; returns their paths. Needs matplotlib."""
    paths = plot_paths(path)
    for fig, p in zip(figures(s), paths):
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=100)
        atomic_write(p, png.getbuffer())
    return paths


def _curves(s: dict, key: str) -> dict[str, list[tuple[int, float]]]:
    """{policy: [(capacity, row[key]), ...] by capacity}; capacity 0 (no place on a log axis)
    and missing values (tok/s of a run without misses) are left out."""
    out: dict = {}
    for r in s["results"]:
        if r["capacity"] > 0 and r[key] is not None:
            out.setdefault(r["policy"], []).append((r["capacity"], r[key]))
    return {pol: sorted(pts) for pol, pts in out.items()}


def capacity_label(s: dict) -> str:
    nl = len(s["layers"])
    how = (f"split evenly over the {nl} layers" if s["scope"] == "layer"
           else f"one cache shared by the {nl} layers")
    return f"cache capacity: total slots, {how}"


def _capacity_axis(ax, s: dict) -> None:
    """Log-2 capacity axis (the default capacities double) ticked at the replayed ones."""
    from matplotlib.ticker import NullLocator

    caps = sorted({r["capacity"] for r in s["results"] if r["capacity"] > 0})
    ax.set_xscale("log", base=2)
    ax.set_xticks(caps, [str(c) for c in caps])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(capacity_label(s))


def _policy_lines(ax, curves: dict) -> None:
    for pol, pts in curves.items():
        xs, ys = [c for c, _ in pts], [v for _, v in pts]
        if pol == "belady":  # the bound every policy is measured against: thick, black, dashed
            ax.plot(xs, ys, color="black", linestyle="--", linewidth=2.5, marker="D",
                    label="Belady MIN (optimal)", zorder=3)
        else:
            ax.plot(xs, ys, marker="o", label=pol)
    ax.legend()
    ax.grid(True, alpha=0.3)


def _figure(**kw):
    from matplotlib.figure import Figure

    return Figure(layout="constrained", **kw)


def _title(s: dict, what: str) -> str:
    return f"{what}\n{trace_label(s)}\n{record_label(s)}"


def hit_rate_figure(s: dict):
    """Decode hit rate vs capacity per policy, Belady's MIN marked."""
    fig = _figure(figsize=(7, 4.5))
    ax = fig.subplots()
    _policy_lines(ax, _curves(s, "hit_rate"))
    _capacity_axis(ax, s)
    ax.set(ylabel="decode hit rate", ylim=(0, 1))
    ax.set_title(_title(s, "decode hit rate"), fontsize=9)
    return fig


def io_figure(s: dict):
    """I/O-bound decode tok/s (disk rate / SSD bytes per token) vs capacity per policy."""
    fig = _figure(figsize=(7, 4.5))
    ax = fig.subplots()
    _policy_lines(ax, _curves(s, "io_tok_s"))
    _capacity_axis(ax, s)
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    for axis_fmt in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis_fmt(FuncFormatter(lambda v, _pos: f"{v:g}"))  # 200, not 2 x 10^2
    ax.set_ylabel(f"decode tok/s <= {s['disk_gbps']} GB/s / SSD bytes per token")
    ax.set_title(_title(s, "I/O-bound decode tok/s (runs without misses left out)"), fontsize=9)
    return fig


def layers_figure(s: dict):
    """Per-layer decode hit rate, one heatmap per policy ([layer, capacity] cells, values
    printed), layers labelled with the trace's layer indices."""
    pols = list(dict.fromkeys(r["policy"] for r in s["results"]))
    caps = sorted({r["capacity"] for r in s["results"]})
    by = {(r["policy"], r["capacity"]): r["per_layer_hit_rate"] for r in s["results"]}
    nl = len(s["layers"])
    fig = _figure(figsize=(1.2 + len(pols) * (0.5 + 0.55 * len(caps)), 1.6 + 0.28 * nl))
    axes = fig.subplots(1, len(pols), sharey=True, squeeze=False)[0]
    for ax, pol in zip(axes, pols):
        grid = np.array([by[(pol, c)] for c in caps]).T  # [L, C]
        im = ax.imshow(grid, aspect="auto", vmin=0, vmax=1, cmap="viridis", origin="lower")
        for (j, c), v in np.ndenumerate(grid):
            # viridis is dark below ~0.6: white text there, black above
            ax.text(c, j, f"{v:.0%}", ha="center", va="center", fontsize=7,
                    color="white" if v < 0.6 else "black")
        ax.set_xticks(range(len(caps)), [str(c) for c in caps], rotation=45)
        ax.set(title="Belady MIN (optimal)" if pol == "belady" else pol, xlabel="total slots")
    axes[0].set_yticks(range(nl), [str(la) for la in s["layers"]])
    axes[0].set_ylabel("MoE layer")
    fig.colorbar(im, ax=list(axes), label="decode hit rate")
    fig.suptitle(_title(s, f"per-layer decode hit rate, {s['scope']} scope"), fontsize=9)
    return fig


def reuse_figure(s: dict):
    """Reuse-distance shares of the first trace's decode selections, the table's bins."""
    shares = reuse_shares(s["reuse"])
    fig = _figure(figsize=(7, 4))
    ax = fig.subplots()
    colors = ["tab:blue"] * (len(shares) - 1) + ["tab:gray"]  # 'never reused' set apart
    ax.bar(range(len(shares)), [v for _, v in shares], color=colors)
    ax.set_xticks(range(len(shares)), [label for label, _ in shares], rotation=45)
    from matplotlib.ticker import PercentFormatter

    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set(xlabel="tokens since the same layer last used the same expert",
           ylabel="share of decode selections")
    ax.set_title(f"reuse distance\n{Path(s['trace_names'][0]).name}", fontsize=9)
    return fig
