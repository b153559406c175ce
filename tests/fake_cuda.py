"""Stand-ins for the GPU side of the offload, for tests on a machine without one.

FakeStreams has offload/device_io.CudaStreams' methods over host memory ("device" slots are
numpy, addresses from their array interface) and checks the orderings the real streams must keep:
the copy stream runs its copies only when something waits on an event recorded after them (so a
copy enqueued but not waited for has not happened); a copy into a slot raises unless the copy
stream waited on the last launch that read the slot; a launch (`backend()`'s moe_layer) raises
unless the compute stream waited on an event recorded after the last copy into every slot its
row names. It counts host waits on compute-stream events (`host_waits`: what a forward pays).

`backend()` is a module with the CUDA backend's functions (DEVICE, unsupported, workspace,
repack, moe_layer) implemented with the reference decode on the slot bytes. Its repack inverts
every byte of a record (enqueued on the copy stream) and moe_layer inverts them back before the
reference decode, so anything that decodes a slot's bytes on the host gets garbage. moe_layer
adds the picks in ascending expert id into acc, as kernels/reference.expert_mlp does, so a
provider on it is bit-identical to the reference path.
"""

from __future__ import annotations

import ctypes
import threading
import types

import numpy as np
import torch

from mtplx_runtime.kernels import reference


class FakeEvent:
    """An event on one stream at one position of its queue (`pos`: copies enqueued, or launches
    made, before it) and, on the compute stream, `seq`: its place among everything recorded."""

    def __init__(self, streams, stream: str, pos: int, seq: int = 0):
        self.streams, self.stream, self.pos, self.seq = streams, stream, pos, seq

    def query(self) -> bool:
        with self.streams.lock:
            done = self.streams.ready or self.seq <= self.streams.done
            if done:
                self.streams.done = max(self.streams.done, self.seq)
            return done

    def synchronize(self) -> None:
        if self.stream == "copy":
            self.streams.run_copies(self.pos)
            return
        with self.streams.lock:  # a wait on work done by an event waited for before is free
            if self.seq > self.streams.done:
                self.streams.host_waits += 1
                self.streams.done = self.seq

    def elapsed_time(self, other) -> float:
        return 0.0


class FakeStreams:
    slot_memory = "cpu"

    def __init__(self):
        self.device = torch.device("cpu")
        self.lock = threading.RLock()
        self.ready = True  # what query() answers: the GPU has caught up
        self.host_waits = 0  # host waits on compute work not known to be done
        self.done = 0  # compute work up to this seq is known done on the host
        self._seq = 0
        self.log: list = []  # ("copy", dst) / ("launch", n) / ("upload",) in enqueue order
        self._copies: list = []  # the copy stream's queue: callables
        self.copy = "copy stream"
        self._ran = 0  # copies run so far
        self._written: dict[int, int] = {}  # dst address -> its last copy's queue position
        self._read: dict[int, int] = {}  # slot address -> the last launch that read it
        self._launches = 0
        self._copy_waited = 0  # the copy stream has waited for launches up to this one
        self._compute_waited = 0  # the compute stream has waited for copies up to this one

    # the CudaStreams methods
    def compute_event(self, timing: bool = False) -> FakeEvent:
        with self.lock:
            self._seq += 1
            return FakeEvent(self, "compute", self._launches, self._seq)

    def copy_event(self) -> FakeEvent:
        with self.lock:
            return FakeEvent(self, "copy", len(self._copies))

    def compute_wait(self, event) -> None:
        with self.lock:
            assert event.stream == "copy"
            self._compute_waited = max(self._compute_waited, event.pos)
        self.run_copies(event.pos)

    def copy_wait(self, event) -> None:
        with self.lock:
            assert event.stream == "compute"
            self._copy_waited = max(self._copy_waited, event.pos)

    def copy_bytes(self, dst: int, src: int, nbytes: int) -> None:
        with self.lock:
            last = self._read.get(dst, 0)
            if last > self._copy_waited:
                raise AssertionError(f"copy into {dst:#x} before launch {last} that reads it ran")
            self._copies.append(lambda: ctypes.memmove(dst, src, nbytes))
            self._written[dst] = len(self._copies)
            self.log.append(("copy", dst))

    def upload(self, dst: torch.Tensor, src: np.ndarray) -> None:
        with self.lock:
            dst.copy_(torch.from_numpy(src.copy()))
            self.log.append(("upload",))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    # the fake GPU
    def enqueue(self, fn) -> None:
        """Other work on the copy stream (a repack)."""
        with self.lock:
            self._copies.append(fn)
            self.log.append(("op",))

    def run_copies(self, upto: int) -> None:
        with self.lock:
            while self._ran < min(upto, len(self._copies)):
                self._copies[self._ran]()
                self._ran += 1

    def launch(self, addresses) -> None:
        """A kernel reading the slots at `addresses`: each one's bytes must have been copied
        behind an event the compute stream waited on."""
        with self.lock:
            self._launches += 1
            self._seq += 1
            for a in addresses:
                w = self._written.get(a, 0)
                if w > self._compute_waited:
                    raise AssertionError(f"launch {self._launches} reads {a:#x}, whose copy "
                                         f"{w} the compute stream never waited for")
                self._read[a] = self._launches
            self.log.append(("launch", self._launches))

    @property
    def launches(self) -> int:
        return self._launches


def slot_view(address: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


class Workspace:
    def __init__(self, tokens: int):
        self.tokens = tokens


def backend(streams: FakeStreams) -> types.ModuleType:
    """A kernel backend module with the CUDA backend's device contract, on `streams`."""
    mod = types.ModuleType("fake_cuda_backend")
    mod.DEVICE = "cuda"
    mod.unsupported = reference.unsupported

    def workspace(tokens, K, shapes, dtype, device):
        return Workspace(tokens)

    def repack(layout, view, stream=None):
        assert stream == streams.copy  # never the synchronous variant on a GPU slot
        streams.enqueue(lambda: np.bitwise_not(view, out=view))

    def moe_layer(x, ids, weights, slot_of, base, stride, layout, shapes, ws, out, *, acc=None,
                  beta=reference.SITU_BETA, beta_lin=reference.SITU_LINEAR_BETA):
        assert ws.tokens >= x.shape[0] and slot_of.dtype == torch.int32
        used = sorted({int(e) for e in ids[ids >= 0].tolist()})
        slots = {e: int(slot_of[e]) for e in used}
        if any(s < 0 for s in slots.values()):
            raise AssertionError(f"moe_layer: experts without a slot {slots}")
        addresses = {e: base + s * stride for e, s in slots.items()}
        streams.launch(addresses.values())
        storage = {e: ~slot_view(a, layout.logical_bytes) for e, a in addresses.items()}
        total = acc.clone() if acc is not None else torch.zeros_like(out)
        reference.expert_mlp(x, ids, weights, {e: e for e in used}, storage, layout, shapes,
                             beta=beta, beta_lin=beta_lin, acc=total)
        return out.copy_(total)

    mod.workspace, mod.repack, mod.moe_layer = workspace, repack, moe_layer
    return mod
