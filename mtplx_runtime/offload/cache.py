"""ExpertCache: which expert records sit in which slots, the replacement order, and counters.

It does NO I/O. A caller (the prefetcher) asks `lookup`, `reserve`s a slot for each miss, fills
`buffer(ref)` with the record bytes, then `commit`s (or `abort`s). Tiers:

    compute (the slots the kernels read: GPU memory with the cuda kernels, host memory else)
        <- promote -- host (optional, pinned RAM)
    compute-tier victim -- demote -> host (else dropped)
    transient pool (optional): prefill and non-admitted misses; never evicts decode experts

Keys are ExpertKey = (layer, expert). An entry is *loading* between reserve and commit and is
never a victim then; a pinned entry (the current step's experts) is never a victim either.
Every public method takes one lock: the prefetcher commits from I/O threads. Two hooks serve
device slots: `on_slot(key, slot | None)` hears every ready key entering or leaving a compute
slot (offload/slot_table.py keeps the kernels' table with it), and `mover` copies a record
between tiers (default `slots.copy_slot`, synchronous; on the GPU an enqueue on a copy stream).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import asdict, dataclass

from .policy import Scope, _LazyHeap, make_policy
from .slots import SlotTier, copy_slot

ExpertKey = tuple[int, int]
TIERS = ("compute", "host", "transient")


@dataclass(frozen=True, slots=True)
class SlotRef:
    """Where a key's record lives: tier 'compute' | 'transient' | 'host', slot index, and
    whether the entry is transient (outside the replacement order, first to be reclaimed)."""

    key: ExpertKey
    tier: str
    slot: int
    transient: bool = False


@dataclass(slots=True)
class _Entry:
    tier: str
    slot: int
    ready: bool
    transient: bool = False  # prefill / non-admitted: outside the policy, first to go
    pins: int = 0


@dataclass(slots=True)
class TierCounters:
    """Per (layer, tier). lookups == hits + misses; host lookups happen on compute-tier misses
    only."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # entries leaving this tier to make room (demoted or dropped)
    demotions: int = 0  # compute-tier victims moved to the host tier (counted on 'compute')
    promotions: int = 0  # host hits copied up to the compute tier (counted on 'host')
    bytes_read: int = 0  # reported by the caller: record_read
    stall_ms: float = 0.0  # reported by the caller: time waiting for I/O


class _HostOrder:
    """Host-tier eviction order: fixed score given at demotion (the device policy's score)."""

    def __init__(self):
        self._heap = _LazyHeap()
        self._score: dict = {}

    def insert(self, key, score: float) -> None:
        self._score[key] = score
        self._heap.set(key, score)

    def remove(self, key) -> None:
        self._score.pop(key, None)
        self._heap.discard(key)

    def score(self, key) -> float:
        return self._score[key]

    def victim(self, eligible=None):
        return self._heap.min(eligible)

    def __contains__(self, key) -> bool:
        return key in self._score

    def __len__(self) -> int:
        return len(self._score)


class ExpertCache:
    """Expert slots in a compute tier, an optional host tier and an optional transient pool.

    record_bytes: size of one expert record (every slot holds exactly one; slots are
    `alignment`-aligned). compute_bytes / host_bytes / transient_bytes: tier budgets in bytes
    (host and transient are off at 0). scope: 'layer' (each of `layers` gets an equal share of
    the device and host slots) or 'global' (one shared capacity). policy: 'lru' or 'freq'
    (decayed frequency, `decay` per access, `admission`). device: 'cpu', 'cuda' or 'auto' (GPU
    memory when cupy sees one; the host tier is then CUDA-pinned). on_slot(key, slot | None):
    called under the lock whenever a ready key enters a compute slot (commit, promotion) or
    leaves one (eviction, demotion, a reclaimed transient entry). mover(dst_tier, dst_slot,
    src_tier, src_slot): the copy of a demotion or promotion (default `copy_slot`), called under
    the lock, so it only enqueues on a GPU.
    """

    def __init__(self, record_bytes: int, compute_bytes: int, host_bytes: int = 0, *,
                 scope: str = "layer", policy: str = "lru", layers: Iterable[int] | None = None,
                 transient_bytes: int = 0, decay: float = 0.99, admission: bool = True,
                 device: str = "auto", alignment: int = 4096,
                 on_slot: Callable[[ExpertKey, int | None], None] | None = None,
                 mover: Callable = copy_slot):
        layers = sorted(set(layers)) if layers is not None else None
        self._on_slot, self._move = on_slot, mover
        self.record_bytes = int(record_bytes)
        self.scope_kind, self.policy_name = scope, policy
        self._compute = SlotTier("compute", record_bytes, compute_bytes, alignment, device=device)
        on_gpu = self._compute.device == "cuda"
        self._host = (SlotTier("host", record_bytes, host_bytes, alignment, pinned_host=on_gpu)
                      if host_bytes > 0 else None)
        self._trans = (SlotTier("transient", record_bytes, transient_bytes, alignment,
                                device=self._compute.device) if transient_bytes > 0 else None)
        self._tiers = {"compute": self._compute, "host": self._host, "transient": self._trans}
        self._scope = Scope(scope, self._compute.num_slots,
                            lambda g: make_policy(policy, decay=decay, admission=admission),
                            layers)
        self._admission_gate = policy == "freq" and admission
        self._host_scope = (Scope(scope, self._host.num_slots, lambda g: _HostOrder(), layers)
                            if self._host is not None else None)
        self._entries: dict[ExpertKey, _Entry] = {}
        self._transients: OrderedDict = OrderedDict()  # transient keys, least recent first
        self._counters: dict = defaultdict(lambda: {t: TierCounters() for t in TIERS})
        self._lock = threading.RLock()

    # ---- queries -------------------------------------------------------------------------

    def lookup(self, keys: Iterable[ExpertKey], *, transient: bool = False
               ) -> tuple[dict[ExpertKey, SlotRef], list[ExpertKey]]:
        """Split `keys` into hits {key: SlotRef} (ready to compute from) and misses [key].

        A key still loading is a miss (wait on the prefetcher's future, do not reserve again). A
        compute-tier miss found in the host tier is promoted (host -> compute copy, counted as a
        host hit); if no compute slot can be freed the hit's ref points at the host tier.
        `transient` (prefill) lookups count but leave the replacement order untouched. Does not
        block on I/O.
        """
        hits: dict = {}
        misses: list = []
        with self._lock:
            for key in keys:
                key = (int(key[0]), int(key[1]))
                c = self._counters[key[0]]
                c["compute"].lookups += 1
                if not transient:
                    self._scope.policy(key).touch(key)
                e = self._entries.get(key)
                if e is not None and e.tier != "host":
                    if e.ready:
                        c["compute"].hits += 1
                        hits[key] = SlotRef(key, e.tier, e.slot, e.transient)
                        if e.transient:
                            self._transients.move_to_end(key)
                    else:
                        c["compute"].misses += 1
                        misses.append(key)
                    continue
                c["compute"].misses += 1
                if self._host is not None:
                    c["host"].lookups += 1
                    if e is not None:
                        c["host"].hits += 1
                        e.pins += 1  # the promoted key must not be picked as a host victim
                        hits[key] = self._promote(key, e, transient)
                        e.pins -= 1
                        continue
                    c["host"].misses += 1
                misses.append(key)
        return hits, misses

    def count_hits(self, keys: Iterable[ExpertKey], *, transient: bool = False) -> None:
        """Count `keys` as the compute-tier hits they were when a forward computed them without
        a `lookup` (a layer whose experts all held slots, its route read back afterwards): the
        counters and the replacement order as `lookup` would have left them, no promotion; a
        key that left its slot since still counts as the hit it was."""
        with self._lock:
            for key in keys:
                key = (int(key[0]), int(key[1]))
                c = self._counters[key[0]]["compute"]
                c.lookups += 1
                c.hits += 1
                if not transient:
                    self._scope.policy(key).touch(key)
                if key in self._transients:
                    self._transients.move_to_end(key)

    def __contains__(self, key) -> bool:
        with self._lock:
            return tuple(key) in self._entries

    def where(self, key: ExpertKey) -> SlotRef | None:
        """The key's current ref (any tier, loading or ready), or None."""
        with self._lock:
            e = self._entries.get(tuple(key))
            return None if e is None else SlotRef(tuple(key), e.tier, e.slot, e.transient)

    def is_loading(self, key: ExpertKey) -> bool:
        with self._lock:
            e = self._entries.get(tuple(key))
            return e is not None and not e.ready

    # ---- slot lifecycle ------------------------------------------------------------------

    def reserve(self, key: ExpertKey, *, speculative: bool = False,
                transient: bool = False) -> SlotRef | None:
        """A loading slot for a missing `key`, evicting per policy; None if none can be had.

        Victims are never pinned or loading. `speculative` (prefetch) never evicts an expert the
        policy rates hotter than `key` (nor one admission would keep); it returns None instead.
        `transient` (prefill) takes the transient pool, else a free compute slot, else evicts
        another transient entry: never a decode-set expert. A demand miss that admission
        refuses, or that finds every candidate pinned, also falls back to the transient route.
        Raises ValueError if `key` is already cached or loading.
        """
        key = (int(key[0]), int(key[1]))
        with self._lock:
            if key in self._entries:
                raise ValueError(f"reserve: {key} is already cached ({self._entries[key]})")
            placed = self._place(key, speculative, transient)
            if placed is None:
                return None
            tier, slot, is_transient = placed
            self._entries[key] = _Entry(tier, slot, ready=False, transient=is_transient)
            if is_transient:
                self._transients[key] = None
            else:
                self._scope.policy(key).insert(key)
            return SlotRef(key, tier, slot, is_transient)

    def commit(self, key: ExpertKey) -> None:
        """The record bytes are in the reserved slot: the entry becomes a hit."""
        with self._lock:
            e = self._entries.get(tuple(key))
            if e is None or e.ready:
                raise ValueError(f"commit: {tuple(key)} is not loading")
            e.ready = True
            self._entered(tuple(key), e)

    def abort(self, key: ExpertKey) -> None:
        """A load failed or was cancelled: free the reserved slot."""
        key = tuple(key)
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.ready:
                raise ValueError(f"abort: {key} is not loading")
            self._drop(key, e)

    def pin(self, keys: Iterable[ExpertKey]) -> list[ExpertKey]:
        """Pin present keys (counted) for the current step; returns the keys actually pinned."""
        done = []
        with self._lock:
            for key in keys:
                e = self._entries.get(tuple(key))
                if e is not None:
                    e.pins += 1
                    done.append(tuple(key))
        return done

    def unpin(self, keys: Iterable[ExpertKey] | None = None) -> None:
        """Undo `pin` for `keys`; None unpins everything (end of a step)."""
        with self._lock:
            if keys is None:
                for e in self._entries.values():
                    e.pins = 0
                return
            for key in keys:
                e = self._entries.get(tuple(key))
                if e is not None and e.pins > 0:
                    e.pins -= 1

    def quota(self, key: ExpertKey) -> int:
        """Device slots the key's scope group may hold (its layer's share, or the whole tier
        under global scope): the most experts of one layer that can be resident at once."""
        return self._scope.capacity(tuple(key))

    def tier(self, name: str) -> SlotTier | None:
        """The SlotTier behind 'compute', 'host' or 'transient' (None when that tier is off);
        kernels that address slots by index read the compute tier's buffer directly."""
        return self._tiers[name]

    def buffer(self, ref: SlotRef):
        """The slot's record bytes: uint8 [record_bytes], aligned; numpy, or cupy on the GPU.

        Raises KeyError when `ref` is stale (the key was evicted or moved since).
        """
        with self._lock:
            e = self._entries.get(ref.key)
            if e is None or e.tier != ref.tier or e.slot != ref.slot:
                raise KeyError(f"stale slot ref {ref}")
            return self._tiers[ref.tier].view(ref.slot)

    # ---- counters ------------------------------------------------------------------------

    def record_read(self, key: ExpertKey, nbytes: int, stall_ms: float = 0.0,
                    tier: str = "compute") -> None:
        """Account bytes read from storage for `key` and time spent waiting on them."""
        with self._lock:
            c = self._counters[int(key[0])][tier]
            c.bytes_read += int(nbytes)
            c.stall_ms += float(stall_ms)

    def stats(self) -> dict[int, dict[str, dict]]:
        """{layer: {tier: counters as a dict}} for every layer seen so far."""
        with self._lock:
            return {la: {t: asdict(c) for t, c in tiers.items()}
                    for la, tiers in sorted(self._counters.items())}

    def totals(self) -> dict[str, dict]:
        """Counters summed over layers, per tier."""
        out = {t: asdict(TierCounters()) for t in TIERS}
        for tiers in self.stats().values():
            for t, c in tiers.items():
                for k, v in c.items():
                    out[t][k] += v
        return out

    def capacity(self) -> dict[str, int]:
        return {t: (s.num_slots if s is not None else 0) for t, s in self._tiers.items()}

    # ---- internals (lock held) -----------------------------------------------------------

    def _evictable(self, key: Hashable) -> bool:
        e = self._entries.get(key)
        return e is not None and e.ready and e.pins == 0

    def _place(self, key, speculative: bool, transient: bool):
        """(tier, slot, transient?) for a new entry, evicting as needed; None if impossible."""
        if transient:
            return self._place_transient(key)
        pol = self._scope.policy(key)
        if len(pol) < self._scope.capacity(key):
            slot = self._free_compute_slot()
            if slot is not None:
                return ("compute", slot, False)
            return None if speculative else self._place_transient(key)
        victim = pol.victim(self._evictable)
        if speculative:
            if victim is None or pol.hotter(victim, key) or not pol.admit(key, victim):
                return None
        elif victim is None or (self._admission_gate and not pol.admit(key, victim)):
            return self._place_transient(key)
        self._evict_compute(victim)
        return ("compute", self._compute.alloc(), False)

    def _free_compute_slot(self) -> int | None:
        slot = self._compute.alloc()
        if slot is None:  # reclaim a compute slot lent to a transient entry
            t = self._oldest_transient("compute")
            if t is not None:
                self._drop(t, self._entries[t], count=True)
                slot = self._compute.alloc()
        return slot

    def _place_transient(self, key):
        for tier in (self._trans, self._compute):
            if tier is None:
                continue
            slot = tier.alloc()
            if slot is None:
                t = self._oldest_transient(tier.name)
                if t is not None:
                    self._drop(t, self._entries[t], count=True)
                    slot = tier.alloc()
            if slot is not None:
                return (tier.name, slot, True)
        return None

    def _oldest_transient(self, tier: str):
        for k in self._transients:
            if self._entries[k].tier == tier and self._evictable(k):
                return k
        return None

    def _entered(self, key, e: _Entry) -> None:
        if self._on_slot is not None and e.tier == "compute":
            self._on_slot(key, e.slot)

    def _left(self, key, e: _Entry) -> None:
        if self._on_slot is not None and e.tier == "compute" and e.ready:
            self._on_slot(key, None)

    def _drop(self, key, e: _Entry, count: bool = False) -> None:
        """Forget `key` and free its slot (no demotion)."""
        self._left(key, e)
        self._tiers[e.tier].release(e.slot)
        del self._entries[key]
        if e.transient:
            self._transients.pop(key, None)
            tier = "transient"
        elif e.tier == "host":
            self._host_scope.policy(key).remove(key)
            tier = "host"
        else:
            self._scope.policy(key).remove(key)
            tier = "compute"
        if count:
            self._counters[key[0]][tier].evictions += 1

    def _evict_compute(self, victim) -> None:
        """Move a compute-tier victim to the host tier if it earns a place there, else drop it."""
        e = self._entries[victim]
        c = self._counters[victim[0]]["compute"]
        c.evictions += 1
        score = self._scope.policy(victim).score(victim)
        hslot = self._host_slot_for(victim, score) if self._host is not None else None
        if hslot is None:
            self._drop(victim, e)
            return
        self._move(self._host, hslot, self._compute, e.slot)
        self._left(victim, e)
        self._scope.policy(victim).remove(victim)
        self._compute.release(e.slot)
        e.tier, e.slot = "host", hslot
        self._host_scope.policy(victim).insert(victim, score)
        c.demotions += 1

    def _host_slot_for(self, key, score: float) -> int | None:
        order = self._host_scope.policy(key)
        if len(order) >= self._host_scope.capacity(key):
            hv = order.victim(self._evictable)
            if hv is None or score < order.score(hv):
                return None  # colder than everything evictable in the host tier: drop it
            self._drop(hv, self._entries[hv], count=True)
        return self._host.alloc()

    def _promote(self, key, e: _Entry, transient: bool) -> SlotRef:
        """Copy a host-tier entry up to a compute slot; on failure leave it (host ref)."""
        placed = self._place(key, speculative=False, transient=transient)
        if placed is None:
            return SlotRef(key, "host", e.slot)
        tier, slot, is_transient = placed
        self._move(self._tiers[tier], slot, self._host, e.slot)
        self._host_scope.policy(key).remove(key)
        self._host.release(e.slot)
        e.tier, e.slot, e.transient = tier, slot, is_transient
        self._entered(key, e)
        if is_transient:
            self._transients[key] = None
        else:
            self._scope.policy(key).insert(key)
        self._counters[key[0]]["host"].promotions += 1
        return SlotRef(key, tier, slot, is_transient)
