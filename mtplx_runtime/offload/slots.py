"""Slot tiers: one big aligned buffer carved into fixed-size record slots, with a free list.

A tier holds `capacity_bytes // slot_bytes` slots, where `slot_bytes` is `record_bytes` rounded
up to `alignment` (4 KiB: O_DIRECT and GPU copies want page-aligned slot starts, FORMAT.md
extents are 4 KiB-aligned too). Backends: numpy uint8 on the host (anonymous mmap memory,
page-aligned; CUDA-pinned when `pinned_host`) or cupy on the GPU. cupy is imported only inside
functions, never at module import, so the CPU path works without it. A tier does no I/O and
keeps no policy: the ExpertCache decides which slot holds what.
"""

from __future__ import annotations

import numpy as np

from .buffers import PAGE_BYTES, aligned_buffer


def cuda_unavailable_reason() -> str | None:
    """None when cupy imports and sees a device; else why not. Never raises."""
    try:
        import cupy

        if not cupy.is_available():
            return "cupy.is_available() is False (no CUDA driver or device)"
    except ImportError as e:
        return f"cupy is not installed ({e})"
    except Exception as e:  # a broken install: the CPU path must keep working
        return f"cupy failed: {type(e).__name__}: {e}"
    return None


def _align_view(raw, nbytes: int, alignment: int, address: int):
    skip = (-address) % alignment
    return raw[skip:skip + nbytes]


class SlotTier:
    """`num_slots` slots of `record_bytes` each, `slot_bytes` apart, in one aligned buffer.

    device: 'cpu' (numpy), 'cuda' (cupy device memory) or 'auto' (cuda when available).
    `pinned_host` pins a host tier with CUDA (cupy) when a GPU is present; it degrades to plain
    page-aligned memory otherwise. Not thread-safe on its own: the ExpertCache holds its lock.
    """

    def __init__(self, name: str, record_bytes: int, capacity_bytes: int,
                 alignment: int = PAGE_BYTES, pinned_host: bool = False, device: str = "cpu"):
        if record_bytes <= 0:
            raise ValueError(f"{name}: record_bytes must be >= 1, got {record_bytes}")
        if capacity_bytes < 0:
            raise ValueError(f"{name}: capacity_bytes must be >= 0, got {capacity_bytes}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{name}: alignment must be a power of two, got {alignment}")
        if device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"{name}: device must be cpu, cuda or auto, got {device!r}")
        if device == "auto":
            device = "cuda" if cuda_unavailable_reason() is None else "cpu"
        self.name = name
        self.record_bytes = int(record_bytes)
        self.alignment = int(alignment)
        self.slot_bytes = -(-self.record_bytes // alignment) * alignment
        self.num_slots = int(capacity_bytes) // self.slot_bytes
        self.device = device
        self.pinned = False
        total = self.num_slots * self.slot_bytes
        if total == 0:
            self.data = np.zeros(0, dtype=np.uint8)
        elif device == "cuda":
            self.data = self._cuda_buffer(total)
        elif pinned_host and cuda_unavailable_reason() is None:
            self.data = self._pinned_buffer(total)
            self.pinned = True
        else:
            self.data = aligned_buffer(total, alignment)
        # Free list as a stack, lowest slot on top, so tests see a deterministic order.
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._is_free = np.ones(self.num_slots, dtype=bool)

    def _cuda_buffer(self, total: int):
        import cupy

        raw = cupy.empty(total + self.alignment, dtype=cupy.uint8)
        return _align_view(raw, total, self.alignment, raw.data.ptr)

    def _pinned_buffer(self, total: int) -> np.ndarray:
        import cupy

        mem = cupy.cuda.alloc_pinned_memory(total + self.alignment)
        raw = np.frombuffer(mem, dtype=np.uint8, count=total + self.alignment)
        return _align_view(raw, total, self.alignment, raw.__array_interface__["data"][0])

    @property
    def used_count(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self) -> int | None:
        """A free slot index, or None when the tier is full."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = False
        return slot

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"{self.name}: slot {slot} out of range [0, {self.num_slots})")
        if self._is_free[slot]:
            raise ValueError(f"{self.name}: slot {slot} released twice")
        self._is_free[slot] = True
        self._free.append(slot)

    def address(self, slot: int) -> int:
        """The address of the slot's first byte (device memory for a cuda tier)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"{self.name}: slot {slot} out of range [0, {self.num_slots})")
        base = (self.data.data.ptr if self.device == "cuda"
                else self.data.__array_interface__["data"][0])
        return int(base) + slot * self.slot_bytes

    def slot_at(self, address: int) -> int:
        """The slot whose first byte is at `address` (ValueError for any other address)."""
        if self.num_slots:
            slot, rest = divmod(address - self.address(0), self.slot_bytes)
            if not rest and 0 <= slot < self.num_slots:
                return slot
        raise ValueError(f"{self.name}: address {address:#x} is no slot's start")

    def view(self, slot: int):
        """The slot's first `record_bytes` bytes, uint8, starting on an `alignment` boundary."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"{self.name}: slot {slot} out of range [0, {self.num_slots})")
        start = slot * self.slot_bytes
        return self.data[start:start + self.record_bytes]


def copy_slot(dst: SlotTier, dst_slot: int, src: SlotTier, src_slot: int) -> None:
    """Copy one record between tiers (host<->device or same backend). Blocks until done."""
    d, s = dst.view(dst_slot), src.view(src_slot)
    if dst.device == "cuda" and src.device == "cuda":
        d[...] = s
    elif dst.device == "cuda":
        d.set(s)
    elif src.device == "cuda":
        s.get(out=d)
    else:
        np.copyto(d, s)
