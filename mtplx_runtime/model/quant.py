"""Quantized resident weights: int8 per output channel, int4 in groups of 32 (FORMAT.md
"Quantized residents").

    bf16 matrix [N, K] --quantize_int8--> Int8Weight (q int8 [N, K], scale bf16 [N])
                       --quantize_int4--> Int4Weight (q 0..15 packed [N, K/2], scale + zero
                                          bf16 [K/32, N] each) --packed()--> Int4Packed
    stated tensors (an artifact built with --resident-dtype) --held--> the same weights
    linear(x, w): F.linear for a tensor, w.linear(x) for a quantized weight

The encoders are formats/resident_quant.py, shared with `mtplx build-manifest`.

Both layouts are the ones torch's weight-only matmuls take (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`, gpt-fast's int8 and int4 paths), so the fast path is a maintained
kernel; `dequantize()` is the obvious reference each is tested against. A shape the torch kernel
refuses (int4 needs N % 16 == 0, int8 K % 16 == 0; tiny fixtures have such matrices), and any
device but the CPU (no GPU kernel is wired yet), computes through the reference: same values,
slower. A model holds one copy of each matrix: an int4 one torch takes is converted to its tiled
layout at load.

Which tensors are quantized is one rule, `formats.residents.quantizable`: routing, norms, the
AttnRes mixes and everything fp32 stay as stored, so the router sees what a bf16 model gives it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..formats.resident_quant import encode_int4, encode_int8
from ..formats.residents import GROUP, RESIDENT_DTYPES, quantized_kind

__all__ = ["Int4Packed", "Int4Weight", "Int8Weight", "held", "linear", "quantize",
           "quantize_int4", "quantize_int8"]


class Int8Weight:
    """Symmetric int8 per output channel: w[n, k] ≈ q[n, k] · scale[n]."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        self.q, self.scale = q, scale  # int8 [N, K]; bf16 [N]
        self.shape, self.device, self.dtype = q.shape, q.device, scale.dtype

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 2 * self.scale.numel()

    def dequantize(self) -> torch.Tensor:
        """The reference: [N, K] in bf16 (the product is computed in fp32, rounded once)."""
        return (self.q.float() * self.scale.float()[:, None]).to(self.dtype)

    def fast(self) -> bool:
        """Whether torch's CPU int8 kernel takes this matrix: it reads the input width in steps
        of 16 and returns garbage, or crashes, for K % 16 != 0 (torch 2.13)."""
        return self.device.type == "cpu" and self.shape[1] % 16 == 0

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] bf16 -> [T, N] bf16 through torch's weight-only int8 matmul on the CPU; the
        reference dequantization and a bf16 matmul elsewhere."""
        if not self.fast():
            return F.linear(x, self.dequantize())
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.q, self.scale)
        return y.reshape(*lead, self.shape[0])


class Int4Weight:
    """Asymmetric int4 in groups of GROUP inputs: w[n, k] ≈ (q[n, k] - 8) · scale[g, n] +
    zero[g, n], g = k // GROUP, q in 0..15 (the form torch's int4 matmul computes). The stated
    layout and the reference; `packed()` is what a CPU model holds where torch's kernel takes
    the shape."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        self.q = q  # uint8 [N, K // 2]: low nibble = even k, high nibble = odd k
        self.scale, self.zero = scale, zero  # bf16 [K // GROUP, N] each
        n, half = q.shape
        self.shape, self.device, self.dtype = torch.Size((n, 2 * half)), q.device, scale.dtype

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 2 * (self.scale.numel() + self.zero.numel())

    def codes(self, rows: slice = slice(None)) -> torch.Tensor:
        """q as int32 [N, K] in 0..15 (the rows `rows`)."""
        q = self.q[rows]
        lo, hi = q & 0x0F, q >> 4
        return torch.stack([lo, hi], dim=-1).reshape(len(q), self.shape[1]).to(torch.int32)

    def dequantize(self) -> torch.Tensor:
        """The reference: [N, K] in bf16 ((q - 8) · scale + zero in fp32, rounded once)."""
        n, k = self.shape
        q = self.codes().float().view(n, k // GROUP, GROUP)
        w = (q - 8) * self.scale.float().t()[..., None] + self.zero.float().t()[..., None]
        return w.view(n, k).to(self.dtype)

    def packable(self) -> bool:
        """Whether torch's CPU int4 kernel takes this matrix (rows % 16 == 0, on the CPU)."""
        return self.device.type == "cpu" and self.shape[0] % 16 == 0

    def packed(self) -> Int4Packed:
        """The same values in torch's tiled CPU layout (its own, unstated), converted in row
        blocks so the int32 codes it takes never exist for a whole lm_head (4.7 GB in K3). The
        layout tiles 64 rows at a time, so blocks of multiples of 64 rows convert independently
        (tests/test_quant.py checks this against one whole conversion)."""
        n, k = self.shape
        out = torch.empty(n, k // 2, dtype=torch.uint8)
        step = max(_PACK_ROWS, _BLOCK // k // _PACK_ROWS * _PACK_ROWS)
        for r in range(0, n, step):
            rows = slice(r, r + step)
            out[rows] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes(rows), 1)
        return Int4Packed(out, torch.stack([self.scale, self.zero], dim=-1).contiguous(),
                          self.shape)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] bf16 -> [T, N] bf16: the reference dequantization and a bf16 matmul."""
        return F.linear(x, self.dequantize())


class Int4Packed:
    """An Int4Weight in the layout `_weight_int4pack_mm_for_cpu` reads: packed [N, K // 2]
    uint8 (tiled), scale_zero bf16 [K // GROUP, N, 2]."""

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, shape: torch.Size):
        self.packed_q, self.scale_zero = packed, scale_zero
        self.shape, self.device, self.dtype = shape, packed.device, scale_zero.dtype

    @property
    def nbytes(self) -> int:
        return self.packed_q.numel() + 2 * self.scale_zero.numel()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] bf16 -> [T, N] bf16 through torch's weight-only int4 matmul."""
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), self.packed_q,
                                                       GROUP, self.scale_zero)
        return y.reshape(*lead, self.shape[0])


# Int4Weight.packed converts rows in blocks of about this many weights: the int32 codes of one
# block, not of a whole lm_head, bound the transient memory of a load.
_BLOCK = 1 << 22
_PACK_ROWS = 64  # rows torch's CPU int4 layout tiles together (Int4Weight.packed)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """bf16 [N, K] -> Int8Weight (`formats.resident_quant.encode_int8`)."""
    return Int8Weight(*encode_int8(w))


def quantize_int4(w: torch.Tensor) -> Int4Weight:
    """bf16 [N, K] (K % GROUP == 0) -> Int4Weight in the stated layout
    (`formats.resident_quant.encode_int4`)."""
    return Int4Weight(*encode_int4(w))


def held(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None):
    """A quantized matrix as a model holds it, from its stated tensors (computed at load, or
    read from an artifact built with `--resident-dtype`): int8 without a zero; int4 with one,
    packed for torch's kernel where it takes the shape, else in the stated layout."""
    if zero is None:
        return Int8Weight(q, scale)
    w = Int4Weight(q, scale, zero)
    return w.packed() if w.packable() else w


def quantize(w: torch.Tensor, dtype: str):
    """One quantizable bf16 matrix as a model holds it in the resident dtype: int8; int4 packed
    for torch's kernel where it takes the shape, else the stated layout; int8 for a matrix
    whose input width is not a multiple of GROUP (FORMAT.md "Quantized residents")."""
    if dtype == "bf16":
        return w
    if dtype not in RESIDENT_DTYPES:
        raise ValueError(f"resident dtype must be one of {', '.join(RESIDENT_DTYPES)}, not "
                         f"{dtype!r}")
    if quantized_kind(tuple(w.shape), dtype) == "int8":
        return held(*encode_int8(w))
    return held(*encode_int4(w))


# A CPU matrix-vector product over at most this many weight bytes runs on one torch thread: a
# parallel region wakes the sleeping OpenMP workers (~70-100 us), more than splitting saves on
# a product one core does in ~100 us (BENCHMARKS.md "Small products on one thread").
ONE_THREAD_BYTES = 4 << 20


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """`F.linear(x, w)` for a tensor or a quantized weight."""
    if isinstance(w, torch.Tensor):
        if x.device.type == "cpu" and x.numel() == x.shape[-1] and \
                w.numel() * w.element_size() <= ONE_THREAD_BYTES:
            with one_thread():
                return F.linear(x, w)
        return F.linear(x, w)
    return w.linear(x)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's CPU ops on one intra-op thread inside (setting the count costs < 1 us)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
