"""The device slot table: which compute slot holds each expert of each MoE layer, on the host and
on the GPU, and the CUDA events that order slot writes against the kernels that read the slots.

    cache: a key enters a compute slot (commit, promotion)  -> enter: host row, the slot's owner
           layer, the row marked dirty, the copy stream's event the layer's next launch waits on
         | a key leaves one (eviction, demotion, reclaim)   -> leave: host row, dirty
    provider, one layer's expert launch -> launch(layer): a dirty row copied to the device, the
           compute stream waits on the layer's copies, the kernels read the row (`moe_layer`'s
           slot_of), the launch's event recorded
    fill / cache, before writing a compute slot -> guard(slot): the last launch event of the
           layer that owned the slot; the write waits on it (on the copy stream)

Every method takes one lock and `launch` holds it from the row's copy to the event's record, so a
key that leaves its slot either left before the row went to the device (the kernels never read
it) or after the launch's event was recorded (the slot's next write waits for that event). The
cache calls `enter` / `leave` under its own lock (cache lock, then this one; `launch` never takes
the cache's). The GPU side goes through a streams object (offload/device_io.CudaStreams; tests
pass a fake that logs): `device`, `upload(dst, src)`, `copy_event()`, `compute_event()`,
`compute_wait(event)`.

Shape legend: L MoE layers, E experts per layer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

import numpy as np
import torch

__all__ = ["SlotTable"]

ExpertKey = tuple[int, int]


class SlotTable:
    """slot_of[layer, expert] for the kernels: int32, -1 = no compute slot (FORMAT-free: slot
    indices of the compute tier). `layers`: the MoE layers (one row each), `experts`: E."""

    def __init__(self, layers: Iterable[int], experts: int, streams):
        self.layers = sorted(set(int(la) for la in layers))
        self.experts = int(experts)
        self.streams = streams
        self._index = {la: i for i, la in enumerate(self.layers)}
        self.host = np.full((len(self.layers), self.experts), -1, dtype=np.int32)  # [L, E]
        self.device = torch.full(self.host.shape, -1, dtype=torch.int32,
                                 device=streams.device)  # [L, E]
        self._resident = [0] * len(self.layers)  # experts with a slot, per row
        self._dirty: set[int] = set()  # layers whose device row is stale
        self._copied: dict[int, object] = {}  # layer -> copy event its next launch waits on
        self._launched: dict[int, object] = {}  # layer -> its last launch's event
        self._owner: dict[int, int] = {}  # compute slot -> layer of the last key it held
        self._lock = threading.Lock()
        self.uploads = 0  # rows copied to the device so far

    def _cell(self, key: ExpertKey) -> tuple[int, int] | None:
        i = self._index.get(int(key[0]))
        e = int(key[1])
        return None if i is None or not 0 <= e < self.experts else (i, e)

    # ---- the cache's side ------------------------------------------------------------------

    def enter(self, key: ExpertKey, slot: int) -> None:
        """`key` is readable in compute slot `slot` once the copy stream's work enqueued so far
        (its copy, its repack) has run: the layer's next launch waits for that."""
        cell = self._cell(key)
        if cell is None:
            return
        i, e = cell
        with self._lock:
            self._resident[i] += self.host[i, e] < 0
            self.host[i, e] = slot
            self._owner[int(slot)] = int(key[0])
            self._dirty.add(int(key[0]))
            # Recorded under the lock: events are recorded in the order the entries change, so
            # the latest one covers every copy of the layer enqueued before it.
            self._copied[int(key[0])] = self.streams.copy_event()

    def leave(self, key: ExpertKey) -> None:
        """`key` no longer has a compute slot (its slot may be refilled after `guard`)."""
        cell = self._cell(key)
        if cell is None:
            return
        i, e = cell
        with self._lock:
            if self.host[i, e] >= 0:
                self._resident[i] -= 1
                self.host[i, e] = -1
                self._dirty.add(int(key[0]))

    def on_slot(self, key: ExpertKey, slot: int | None) -> None:
        """The cache's hook: `key` entered compute slot `slot`, or left its slot (None)."""
        if slot is None:
            self.leave(key)
        else:
            self.enter(key, slot)

    def guard(self, slot: int):
        """The event a write into compute slot `slot` must wait for: the last expert launch of
        the layer whose key held it last (None: no launch read it)."""
        with self._lock:
            owner = self._owner.get(int(slot))
            return None if owner is None else self._launched.get(owner)

    # ---- the provider's side ---------------------------------------------------------------

    def slot(self, key: ExpertKey) -> int:
        """The key's compute slot, -1 for none (the host row)."""
        cell = self._cell(key)
        return -1 if cell is None else int(self.host[cell])

    def fully_resident(self, layer: int) -> bool:
        """Whether every expert of `layer` holds a compute slot: its route needs no read."""
        i = self._index.get(int(layer))
        return i is not None and self._resident[i] == self.experts

    @contextlib.contextmanager
    def launch(self, layer: int, *, whole: bool = False) -> Iterator[torch.Tensor | None]:
        """Around one layer's expert launches: yields the layer's device row slot_of [E] int32
        (copied from the host row first if it changed, on the compute stream), with the compute
        stream waiting on the layer's slot copies; records the launch's event at the end (also
        when the launch raised: a kernel may have been enqueued). whole: yield None instead,
        launching nothing, unless every expert of the layer holds a slot."""
        layer = int(layer)
        i = self._index[layer]
        with self._lock:
            if whole and self._resident[i] != self.experts:
                yield None
                return
            if layer in self._dirty:
                self.streams.upload(self.device[i], self.host[i])
                self._dirty.discard(layer)
                self.uploads += 1
            copied = self._copied.pop(layer, None)
            if copied is not None:
                self.streams.compute_wait(copied)
            try:
                yield self.device[i]
            finally:
                self._launched[layer] = self.streams.compute_event()
