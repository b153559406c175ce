"""Replay a route trace through the runtime's cache policies at many capacities.

    Trace -> steps (one MoE layer of one decode token) -> drive(policy classes) -> hits/misses
          -> Belady share, misses/token, SSD bytes/token, I/O-bound tok/s

Two drivers, both over `cache.policy` classes (never a reimplementation):
* `drive` (fast, what-if): the ExpertCache's decode DEVICE-tier decisions. A step touches its K
  keys, then places each miss: a free quota slot, else the policy's victim among keys not used
  in this step (the runtime pins hits and its loading misses), if `admit` agrees; otherwise the
  miss is served uncached. Not modelled: prefill (the runtime reads it into transient slots and
  leaves the replacement order alone), the host tier, the transient pool a refused miss borrows,
  and lookahead reads. Per-layer scope splits `capacity` total slots evenly, like ExpertCache.
* `replay_runtime` (exact): drives a real ExpertCache (1-byte slots, no I/O) with the call
  sequence StreamingExpertProvider.stream makes with lookahead off, prefill, host tier and
  transient pool included, so its counters equal a streamed run's.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
from dataclasses import dataclass, field

import numpy as np

from ..formats.modes import mode_labels
from ..offload.cache import ExpertCache
from ..offload.policy import BeladyPolicy, DecayedFrequencyPolicy, LRUPolicy, Policy
from .traces import Trace

K3_EXPERT_SHAPES = {"gate": (3072, 3584), "up": (3072, 3584), "down": (3584, 3072)}
CODEC_MODES = mode_labels()  # {"t158": ("t158", None, None), "w3": ("ct-int", 3, None), ...}


def record_bytes(codec: str, expert_shapes=None) -> int:
    """Bytes of one expert record in a bank (components + 4 KiB pads) for `codec`; K3 shapes by
    default (t158 7,741,440; W3 dense 13,418,496; MXFP4 17,547,264)."""
    from ..formats.record import padded_layout, record_components

    if codec not in CODEC_MODES:
        raise ValueError(f"codec must be one of {sorted(CODEC_MODES)}, got {codec!r}")
    mode, bits, group = CODEC_MODES[codec]
    return sum(c[3] for c in padded_layout(record_components(
        mode, expert_shapes or K3_EXPERT_SHAPES, bits, group)))


# ---- policies ----------------------------------------------------------------------------

POLICY_NAMES = ("lru", "lfu", "freq", "belady")


def make(name: str, seq: list) -> Policy:
    """A fresh policy: 'lru', 'lfu' (plain LFU: decay 1, no admission), 'freq' or 'freq:DECAY'
    (the runtime's decayed frequency with admission; default decay 0.99), 'belady' (MIN with
    bypass over `seq`, the exact keys this instance will be touched with)."""
    base, _, arg = name.partition(":")
    if base == "lru":
        return LRUPolicy()
    if base == "lfu":
        return DecayedFrequencyPolicy(1.0, admission=False)
    if base == "freq":
        return DecayedFrequencyPolicy(float(arg) if arg else 0.99, admission=True)
    if base == "belady":
        return BeladyPolicy(seq, bypass=True)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")


def drive(steps: list[list], policy: Policy, capacity: int, want_misses: bool = False):
    """Hits per step (list of ints) and, with `want_misses`, each step's missed keys.

    Online policies follow the runtime: a step's keys are looked up together and none of them
    may be evicted while the step runs. Belady's MIN is replayed without that constraint, key by
    key (farthest next use, bypass allowed): that is the offline optimum for any policy, so it
    bounds every constrained one from above at every capacity."""
    if isinstance(policy, BeladyPolicy):
        return _drive_min(steps, policy, capacity, want_misses)
    hits, missed = [], []
    for step in steps:
        for k in step:
            policy.touch(k)
        miss = [k for k in step if k not in policy]
        hits.append(len(step) - len(miss))
        if want_misses:
            missed.append(miss)
        if not miss:
            continue
        pinned = set(step)  # hits are pinned, this step's misses are loading: no victims

        def ok(k, p=pinned):
            return k not in p

        for k in miss:
            if len(policy) < capacity:
                policy.insert(k)
                continue
            victim = policy.victim(ok)
            if victim is None or not policy.admit(k, victim):
                continue  # served uncached (the runtime lends it a transient slot)
            policy.remove(victim)
            policy.insert(k)
    return hits, missed


def _drive_min(steps: list[list], policy: BeladyPolicy, capacity: int, want_misses: bool):
    hits, missed = [], []
    for step in steps:
        miss = []
        for k in step:
            policy.touch(k)
            if k in policy:
                continue
            miss.append(k)
            if len(policy) < capacity:
                policy.insert(k)
                continue
            victim = policy.victim()
            if victim is not None and policy.admit(k, victim):
                policy.remove(victim)
                policy.insert(k)
        hits.append(len(step) - len(miss))
        if want_misses:
            missed.append(miss)
    return hits, missed


@dataclass
class Result:
    """Decode counters of one (policy, capacity) over all traces; per_layer: [L] hits."""

    policy: str
    capacity: int
    hits: int = 0
    misses: int = 0
    per_layer_hits: np.ndarray | None = None
    per_layer_lookups: np.ndarray | None = None
    extra: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


def _layer_steps(trace: Trace, j: int) -> list[list[int]]:
    rows = trace.routes[trace.decode, j, :]  # [Nd, K]
    steps = rows.tolist()
    if (rows < 0).any():
        steps = [[e for e in r if e >= 0] for r in steps]
    return steps


def _global_steps(trace: Trace) -> list[list[int]]:
    """Keys j * E + e (j: layer position), one step per (decode line, layer)."""
    rows = trace.routes[trace.decode]  # [Nd, L, K]
    keys = np.where(rows >= 0, rows + trace.experts * np.arange(rows.shape[1])[None, :, None],
                    -1).reshape(-1, rows.shape[2])
    steps = keys.tolist()
    if (rows < 0).any():
        steps = [[e for e in r if e >= 0] for r in steps]
    return steps


_JOB: dict = {}  # the fork workers' view of the job (copied at fork, never pickled)


def _run_layer(j: int):
    trace, configs, ref = _JOB["trace"], _JOB["configs"], _JOB["ref"]
    steps = _layer_steps(trace, j)
    seq = [k for s in steps for k in s]
    quota_div = len(trace.layers)
    out, miss = [], None
    for c, (name, cap) in enumerate(configs):
        h, m = drive(steps, make(name, seq), cap // quota_div, want_misses=c == ref)
        out.append(sum(h))
        if c == ref:
            miss = m
    return out, miss


def _run_global(c: int):
    trace, configs, ref = _JOB["trace"], _JOB["configs"], _JOB["ref"]
    steps = _global_steps(trace)
    name, cap = configs[c]
    h, m = drive(steps, make(name, [k for s in steps for k in s]), cap, want_misses=c == ref)
    nl = len(trace.layers)
    per = np.asarray(h, np.int64).reshape(-1, nl).sum(axis=0)
    miss = None
    if c == ref:  # regroup into per-layer step lists, like _run_layer's
        miss = [[[k - j * trace.experts for k in m[i * nl + j]] for i in range(len(m) // nl)]
                for j in range(nl)]
    return per, miss


def _pool_map(fn, items, workers: int, progress=None):
    """[fn(i) for i in items], on `workers` forked processes; `progress(done, total)` after
    each item."""
    out = []
    if workers <= 1 or len(items) <= 1 or "fork" not in mp.get_all_start_methods():
        for i in items:
            out.append(fn(i))
            if progress is not None:
                progress(len(out), len(items))
        return out
    with mp.get_context("fork").Pool(min(workers, len(items))) as pool:
        for r in pool.imap(fn, items, chunksize=1):  # in order, as each one is done
            out.append(r)
            if progress is not None:
                progress(len(out), len(items))
    return out


def profile(trace: Trace, policies: list[str], capacities: list[int], scope: str = "layer",
            workers: int | None = None, ref: int = 0,
            progress=None) -> tuple[list[Result], list | None]:
    """Fast replay of the decode lines of `trace` for every (policy, capacity) with the
    `drive` semantics; 'belady' is always added. Returns results (capacity-major) and the
    missed keys of config `ref` as [L][decode line] lists (for prefetch coverage).
    `progress(done, total)` hears of each layer (scope layer) or configuration (global)."""
    if scope not in ("layer", "global"):
        raise ValueError(f"scope must be layer or global, got {scope!r}")
    names = list(dict.fromkeys([*policies, "belady"]))
    configs = [(p, int(c)) for c in capacities for p in names]
    nl = len(trace.layers)
    lookups = (trace.routes[trace.decode] >= 0).sum(axis=(0, 2)).astype(np.int64)  # [L]
    workers = workers or min(os.cpu_count() or 1, 8)
    _JOB.update(trace=trace, configs=configs, ref=ref)
    try:
        if scope == "layer":
            outs = _pool_map(_run_layer, list(range(nl)), workers, progress)
            per = np.array([o[0] for o in outs], np.int64).T  # [C, L]
            missed = [o[1] for o in outs]
        else:
            outs = _pool_map(_run_global, list(range(len(configs))), workers, progress)
            per = np.array([o[0] for o in outs], np.int64)
            missed = outs[ref][1]
    finally:
        _JOB.clear()
    results = []
    for c, (name, cap) in enumerate(configs):
        h = int(per[c].sum())
        results.append(Result(name, cap, h, int(lookups.sum()) - h, per[c], lookups))
    return results, missed


def merge(runs: list[list[Result]]) -> list[Result]:
    """Sum the results of several traces (each replayed from a cold cache)."""
    out = []
    for rs in zip(*runs):
        r0 = rs[0]
        out.append(Result(r0.policy, r0.capacity, sum(r.hits for r in rs),
                          sum(r.misses for r in rs), sum(r.per_layer_hits for r in rs),
                          sum(r.per_layer_lookups for r in rs)))
    return out


def io_figures(res: Result, decode_tokens: int, rec_bytes: int, disk_gbps: float) -> dict:
    """misses/token, SSD bytes/token and tok/s <= disk rate / bytes per token."""
    mpt = res.misses / decode_tokens if decode_tokens else 0.0
    bpt = mpt * rec_bytes
    return {"misses_per_token": mpt, "ssd_bytes_per_token": bpt,
            "io_tok_s": disk_gbps * 1e9 / bpt if bpt else math.inf}


# ---- exact replay through a real ExpertCache ---------------------------------------------

def replay_runtime(trace: Trace, *, policy: str = "lru", compute_slots: int, host_slots: int = 0,
                   transient_slots: int | None = None, scope: str = "layer", decay: float = 0.99,
                   admission: bool = True, prefill_chunk: int = 64) -> ExpertCache:
    """Replay every line of `trace` into a fresh ExpertCache with the lookup / pin / reserve /
    commit / unpin sequence StreamingExpertProvider.stream makes with lookahead 0; returns the
    cache (its `stats()` are the runtime's counters). `policy`: 'lru' | 'freq' (ExpertCache
    names); slot counts are the runtime cache's `capacity()`; transient None: max(top_k, 4)."""
    if transient_slots is None:
        transient_slots = max(trace.top_k, 4)
    cache = ExpertCache(1, compute_slots, host_slots, scope=scope, policy=policy,
                        layers=trace.layers, transient_bytes=transient_slots, decay=decay,
                        admission=admission, device="cpu", alignment=1)
    for _decode, first, n in trace.forwards(prefill_chunk):
        for j, layer in enumerate(trace.layers):
            ids = np.unique(trace.routes[first:first + n, j])  # [U] ascending, like moe.forward
            _stream(cache, [(layer, int(e)) for e in ids if e >= 0], n > 1, transient_slots)
    return cache


def _stream(cache: ExpertCache, keys: list, prefill: bool, transient_slots: int) -> None:
    """The cache calls of one `StreamingExpertProvider.stream` (lookahead off, reads land in
    order). Reserves of one demand window all happen before any commit."""
    transient = prefill and transient_slots > 0
    hits, misses = cache.lookup(keys, transient=transient)
    pinned = set(cache.pin(list(hits)))
    window = max(1, transient_slots) if transient else max(1, len(misses))
    chunks = [misses[i:i + window] for i in range(0, len(misses), window)] or [[]]
    for i, chunk in enumerate(chunks):
        for key in chunk:  # Prefetcher.demand: a full cache may still lend a one-use slot
            if cache.reserve(key, transient=transient) is None and (
                    transient or cache.reserve(key, transient=True) is None):
                raise RuntimeError(f"replay: no slot for {key} (the runtime fails here too)")
        if i == 0:
            cache.unpin([k for k in hits if k in pinned])  # hits are decoded meanwhile
        for key in chunk:
            cache.commit(key)
