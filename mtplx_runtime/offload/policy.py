"""Replacement policies over expert keys, with no slot storage (pure bookkeeping).

The ExpertCache and the profiler's trace replay share this code, so a hit rate measured offline
is the hit rate the runtime gets. A policy tracks the access history of every key it is told
about (`touch`) and an eviction order over its *members* (the keys resident under it, `insert` /
`remove`). `victim(eligible)` names the coldest eligible member; `admit(key, victim)` says whether
a miss may replace it; `score(key)` is a time-invariant hotness (higher is hotter) usable to
compare any two keys, resident or not.

    trace -> touch -> (member? hit : victim -> admit -> remove/insert)

Scope: per layer (one policy per layer, each with its own slot quota) or global (one policy,
one shared capacity); `Scope` maps a key to its policy and quota, `replay` simulates a trace.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

Key = Hashable  # ExpertKey = (layer, expert)
Eligible = Callable[[Key], bool] | None


def _eligible_fn(eligible) -> Callable[[Key], bool]:
    """None -> every member; a callable as is; a container -> membership test."""
    if eligible is None:
        return lambda k: True
    if callable(eligible):
        return eligible
    return eligible.__contains__


class _LazyHeap:
    """Min-heap of (priority, key) with lazy deletion: O(log n) set, discard, min."""

    def __init__(self):
        self._heap: list = []
        self._seq_of: dict = {}  # key -> seq of its live heap entry
        self._seq = 0  # tie-breaker: keys are never compared

    def set(self, key, prio) -> None:
        self._seq += 1
        self._seq_of[key] = self._seq
        heapq.heappush(self._heap, (prio, self._seq, key))

    def discard(self, key) -> None:
        self._seq_of.pop(key, None)

    def __contains__(self, key) -> bool:
        return key in self._seq_of

    def __len__(self) -> int:
        return len(self._seq_of)

    def min(self, eligible) -> Key | None:
        """Lowest-priority key passing `eligible`; skipped live entries are pushed back."""
        ok = _eligible_fn(eligible)
        skipped, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._seq_of.get(entry[2]) != entry[1]:
                continue  # stale: removed or re-prioritised since
            skipped.append(entry)
            if ok(entry[2]):
                found = entry[2]
                break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._seq_of) + 64:  # compact stale entries
            self._heap = [e for e in self._heap if self._seq_of.get(e[2]) == e[1]]
            heapq.heapify(self._heap)
        return found


class Policy:
    """Common interface. Subclasses keep history in `touch` and members in `insert`/`remove`."""

    def touch(self, key: Key) -> None:
        """Record one access of `key` (hit or miss). Advances the policy clock."""
        raise NotImplementedError

    def insert(self, key: Key) -> None:
        """`key` becomes resident under this policy (a victim candidate)."""
        raise NotImplementedError

    def remove(self, key: Key) -> None:
        """`key` is no longer resident; its access history is kept."""
        raise NotImplementedError

    def score(self, key: Key) -> float:
        """Time-invariant hotness: compare two keys' scores at any moment; -inf if never seen."""
        raise NotImplementedError

    def victim(self, eligible=None) -> Key | None:
        """Coldest member for which `eligible` (callable or container; None = all) holds."""
        raise NotImplementedError

    def admit(self, key: Key, victim: Key | None) -> bool:
        """May a miss on `key` replace `victim` (None: a free slot)? Default: always."""
        return True

    def hotter(self, a: Key, b: Key) -> bool:
        """True when `a` is strictly hotter than `b`."""
        return self.score(a) > self.score(b)

    def __contains__(self, key: Key) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class LRUPolicy(Policy):
    """Least recently used. score = clock tick of the last touch (one tick per touch)."""

    def __init__(self):
        self._order: OrderedDict = OrderedDict()  # members, least recent first
        self._last: dict = {}
        self._clock = 0

    def touch(self, key):
        self._clock += 1
        self._last[key] = self._clock
        if key in self._order:
            self._order.move_to_end(key)

    def insert(self, key):
        self._order[key] = None
        self._order.move_to_end(key)  # a newcomer is the most recent member

    def remove(self, key):
        self._order.pop(key, None)

    def score(self, key):
        return float(self._last.get(key, -math.inf))

    def victim(self, eligible=None):
        ok = _eligible_fn(eligible)
        for key in self._order:
            if ok(key):
                return key
        return None

    def __contains__(self, key):
        return key in self._order

    def __len__(self):
        return len(self._order)


class DecayedFrequencyPolicy(Policy):
    """Exponentially decayed access count with optional admission (TinyLFU-style).

    The clock advances one tick per touch; an access t ticks ago weighs decay**t, so
    score_now(k) = sum_i decay**(now - t_i). It is stored normalised to tick 0 in log form,
    log sum_i exp(t_i * a) with a = -ln(decay), which ranks keys identically at every tick and
    cannot overflow. decay=1 is plain LFU. Ties evict the least recently touched.
    With `admission`, a miss replaces a victim only if its score is at least the victim's, so
    a first-seen expert does not evict a hotter one. History is kept for non-members too.
    """

    def __init__(self, decay: float = 0.99, admission: bool = True):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.admission = admission
        self._a = -math.log(decay)
        self._log: dict = {}  # key -> log normalised score
        self._last: dict = {}  # key -> tick of the last touch (tie-break)
        self._members = _LazyHeap()
        self._clock = 0

    def touch(self, key):
        self._clock += 1
        t = self._clock * self._a
        old = self._log.get(key)
        self._log[key] = t if old is None else float(max(old, t) + math.log1p(
            math.exp(-abs(old - t))))
        self._last[key] = self._clock
        if key in self._members:
            self._members.set(key, self._prio(key))

    def _prio(self, key):
        return (self._log.get(key, -math.inf), self._last.get(key, 0))

    def insert(self, key):
        self._members.set(key, self._prio(key))

    def remove(self, key):
        self._members.discard(key)

    def score(self, key):
        return self._log.get(key, -math.inf)

    def victim(self, eligible=None):
        return self._members.min(eligible)

    def admit(self, key, victim):
        if victim is None or not self.admission:
            return True
        # Small relative slack so equal counts built from different ticks compare as equal.
        return self.score(key) >= self.score(victim) - 1e-12 * max(1.0, abs(self.score(victim)))

    def __contains__(self, key):
        return key in self._members

    def __len__(self):
        return len(self._members)


class BeladyPolicy(Policy):
    """Belady's MIN: evict the member whose next use is farthest in the future.

    Needs the whole future: `trace` is the exact sequence of keys that will be touched on this
    instance (per-layer scope: that layer's subsequence); `touch` must follow it. With `bypass`
    (the optimum when a miss may go uncached) a miss whose next use is later than the victim's
    is not admitted. score = -(next use index), so sooner is hotter.
    """

    def __init__(self, trace: Sequence[Key], bypass: bool = True):
        self.bypass = bypass
        self._trace = list(trace)
        n = len(self._trace)
        self._next = [n] * n  # index of the next occurrence of trace[i] after i (n = never)
        seen: dict = {}
        for i in range(n - 1, -1, -1):
            self._next[i] = seen.get(self._trace[i], n)  # n: never used again
            seen[self._trace[i]] = i
        self._first = seen  # first occurrence of each key
        self._nextuse: dict = {}
        self._pos = 0
        self._members = _LazyHeap()

    def touch(self, key):
        if self._pos >= len(self._trace) or self._trace[self._pos] != key:
            raise ValueError(f"BeladyPolicy: touch({key!r}) at {self._pos} does not follow the "
                             "trace")
        self._nextuse[key] = self._next[self._pos]
        self._pos += 1
        if key in self._members:
            self._members.set(key, -self._nextuse[key])

    def _next_of(self, key) -> int:
        if key in self._nextuse:
            return self._nextuse[key]
        first = self._first.get(key)
        return 2 * len(self._trace) if first is None or first < self._pos else first

    def insert(self, key):
        self._members.set(key, -self._next_of(key))

    def remove(self, key):
        self._members.discard(key)

    def score(self, key):
        return float(-self._next_of(key))

    def victim(self, eligible=None):
        return self._members.min(eligible)

    def admit(self, key, victim):
        return victim is None or not self.bypass or self._next_of(key) < self._next_of(victim)

    def __contains__(self, key):
        return key in self._members

    def __len__(self):
        return len(self._members)


POLICIES = {"lru": lambda **kw: LRUPolicy(),
            "freq": lambda decay=0.99, admission=True, **kw: DecayedFrequencyPolicy(decay,
                                                                                   admission)}


def make_policy(name: str, **kw) -> Policy:
    """'lru' or 'freq' (kw: decay, admission). Belady needs a trace: build it directly."""
    if name not in POLICIES:
        raise ValueError(f"unknown cache policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name](**kw)


class Scope:
    """Maps a key to its policy and slot quota.

    kind 'layer': one policy per layer in `layers`, quota `capacity // len(layers)` each (or a
    {layer: slots} dict as `capacity`); kind 'global': one policy, quota `capacity`.
    `factory(group)` builds a policy; group is the layer for 'layer', None for 'global'.
    """

    def __init__(self, kind: str, capacity: int | dict, factory: Callable[[Hashable], Policy],
                 layers: Iterable[int] | None = None):
        if kind not in ("layer", "global"):
            raise ValueError(f"scope must be 'layer' or 'global', got {kind!r}")
        self.kind = kind
        if kind == "global":
            if isinstance(capacity, dict):
                raise ValueError("global scope takes one integer capacity")
            self.quota = {None: int(capacity)}
        else:
            if isinstance(capacity, dict):
                self.quota = {int(k): int(v) for k, v in capacity.items()}
            else:
                if not layers:
                    raise ValueError("per-layer scope needs the list of layers")
                layers = list(layers)
                self.quota = {int(la): int(capacity) // len(layers) for la in layers}
        self.policies = {g: factory(g) for g in self.quota}

    def group(self, key) -> Hashable:
        if self.kind == "global":
            return None
        if key[0] not in self.quota:
            raise KeyError(f"layer {key[0]} is not in this cache's layers")
        return key[0]

    def policy(self, key) -> Policy:
        return self.policies[self.group(key)]

    def capacity(self, key) -> int:
        return self.quota[self.group(key)]

    def full(self, key) -> bool:
        return len(self.policy(key)) >= self.capacity(key)


@dataclass(slots=True)
class ReplayStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bypassed: int = 0  # misses not admitted (or nothing evictable)
    per_layer: dict = field(default_factory=dict)  # layer -> [hits, misses]

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


def replay(steps: Iterable[Iterable[Key]], scope: Scope) -> ReplayStats:
    """Simulate a route trace: `steps` is a sequence of steps, each the keys it touches in order.

    Keys already touched in the current step are pinned (never victims), like the runtime's
    per-step pins. A miss is inserted when its group has room, else it replaces the policy's
    victim if admitted; otherwise it is served without caching (bypassed).
    """
    st = ReplayStats()
    for step in steps:
        pinned: set = set()
        for key in step:
            pol = scope.policy(key)
            pol.touch(key)
            row = st.per_layer.setdefault(key[0], [0, 0])
            pinned.add(key)
            if key in pol:
                st.hits += 1
                row[0] += 1
                continue
            st.misses += 1
            row[1] += 1
            if len(pol) < scope.capacity(key):
                pol.insert(key)
                continue
            victim = pol.victim(lambda k, p=pinned: k not in p)
            if victim is None or not pol.admit(key, victim):
                st.bypassed += 1
                continue
            pol.remove(victim)
            pol.insert(key)
            st.evictions += 1
    return st
