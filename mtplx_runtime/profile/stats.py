"""Working-set, popularity and prefetch statistics of a route trace (decode lines), vectorised.

* unique experts per window: mean distinct experts one layer uses in W consecutive tokens;
* reuse distance: tokens since the same layer last used the same expert (a time gap, not the
  LRU stack distance), as a power-of-two histogram, plus the share never reused;
* skew: share of a layer's selections taken by its top 10 % experts; entropy (bits) of a
  layer's selection distribution and its ratio to log2(E);
* prefetch quality of the recorded lookahead guesses against one replay's misses: coverage =
  missed keys that were guessed / misses (on lines with a guess at that depth); waste = guessed
  keys the layer did not use / guessed keys that were misses (None when none was). Guesses of
  resident experts are not reads in the runtime, so waste is an upper bound.
"""

from __future__ import annotations

import numpy as np

from .traces import Trace


def _decode_keys(trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token index, layer position, expert) of every decode selection, flat."""
    rows = trace.routes[trace.decode]  # [Nd, L, K]
    tok, lay, _ = np.indices(rows.shape)
    ok = rows >= 0
    return tok[ok], lay[ok], rows[ok].astype(np.int64)


def _prev_use(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(token, token of the same layer's previous use of the same expert or -1) per decode
    selection, in (layer, expert, token) order: one sort serves every window and the reuse
    histogram."""
    tok, lay, exp = _decode_keys(trace)
    key = lay * trace.experts + exp
    order = np.lexsort((tok, key))
    k, t = key[order], tok[order]
    prev = np.full(t.shape, -1, np.int64)
    same = k[1:] == k[:-1]
    prev[1:][same] = t[:-1][same]
    return t, prev


def working_set(trace: Trace, windows=(1, 16, 256), _prev=None) -> dict:
    """{W: mean distinct experts per layer per full window of W decode tokens}."""
    t, prev = _prev or _prev_use(trace)
    n, nl = int(trace.decode.sum()), len(trace.layers)
    out = {}
    for w in windows:
        full = n // w
        if full == 0:
            continue
        # A selection is its window's first use of that expert iff its previous use is earlier.
        first = (t < full * w) & (prev < (t // w) * w)
        out[int(w)] = float(first.sum() / (full * nl))
    return out


def reuse_histogram(trace: Trace, _prev=None) -> dict:
    """{"edges": [1, 2, 4, ...], "counts": [...], "never": share of selections not reused,
    "selections": decode selections}: counts[i] = reuses with distance d, edges[i] <= d <
    2 * edges[i]; the last bin holds the largest distance. A key's first use is the one
    selection per key without a reuse distance, so sum(counts) + never * selections ==
    selections."""
    t, prev = _prev or _prev_use(trace)
    if t.size == 0:
        return {"edges": [], "counts": [], "never": 0.0, "selections": 0}
    dist = (t - prev)[prev >= 0]  # >= 1: a layer uses an expert at most once per token
    bins = np.floor(np.log2(dist)).astype(np.int64) if dist.size else np.zeros(0, np.int64)
    counts = np.bincount(bins) if dist.size else np.zeros(0, np.int64)
    return {"edges": [1 << i for i in range(len(counts))], "counts": [int(c) for c in counts],
            "never": float(1.0 - dist.size / t.size), "selections": int(t.size)}


def popularity(trace: Trace, top_share: float = 0.10) -> dict:
    """Per layer: skew (share of selections by the top `top_share` of experts), entropy in
    bits and entropy / log2(E)."""
    _, lay, exp = _decode_keys(trace)
    nl, e = len(trace.layers), trace.experts
    counts = np.bincount(lay * e + exp, minlength=nl * e).reshape(nl, e)  # [L, E]
    total = counts.sum(axis=1, keepdims=True).clip(min=1)
    top = max(1, int(np.ceil(top_share * e)))
    skew = np.sort(counts, axis=1)[:, ::-1][:, :top].sum(axis=1) / total[:, 0]
    p = counts / total
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log2(p), 0.0).sum(axis=1)
    norm = ent / np.log2(e) if e > 1 else np.zeros(nl)
    return {"layers": list(trace.layers), "skew": skew.tolist(), "entropy_bits": ent.tolist(),
            "entropy_ratio": norm.tolist(),
            "mean_skew": float(skew.mean()) if nl else 0.0,
            "mean_entropy_bits": float(ent.mean()) if nl else 0.0}


def prefetch_quality(trace: Trace, missed: list | None) -> list[dict]:
    """One row per (layer, depth) with guesses: coverage and waste against `missed` ([L][decode
    line] missed expert ids, from `replay.profile`), plus recall (guessed / used)."""
    if not trace.predicted or missed is None:
        return []
    pos = {la: j for j, la in enumerate(trace.layers)}
    dec_index = np.cumsum(trace.decode) - 1  # line -> decode line number
    rows = []
    for (layer, depth), (lines, guesses) in sorted(trace.predicted.items()):
        j = pos.get(layer)
        if j is None:
            continue
        n_miss = n_cov = n_used = n_hit = n_wasted = 0
        for line, guess in zip(lines.tolist(), guesses):
            if not trace.decode[line]:
                continue
            used = {int(e) for e in trace.routes[line, j] if e >= 0}
            miss = set(missed[j][int(dec_index[line])])
            g = set(guess)
            n_miss += len(miss)
            n_cov += len(miss & g)
            n_used += len(used)
            n_hit += len(used & g)
            n_wasted += len(g - used)
        rows.append({"layer": layer, "depth": depth, "misses": n_miss,
                     "coverage": n_cov / n_miss if n_miss else 0.0,
                     "waste": n_wasted / n_cov if n_cov else None,  # None: no useful read
                     "recall": n_hit / n_used if n_used else 0.0})
    return rows


def prefetch_by_depth(rows: list[dict]) -> dict:
    """{depth: {"coverage", "recall"}} weighted by misses, over layers."""
    out: dict = {}
    for r in rows:
        d = out.setdefault(r["depth"], {"misses": 0, "covered": 0.0})
        d["misses"] += r["misses"]
        d["covered"] += r["coverage"] * r["misses"]
    return {k: {"coverage": v["covered"] / v["misses"] if v["misses"] else 0.0}
            for k, v in sorted(out.items())}
