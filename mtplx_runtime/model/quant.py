"""Quantized resident weights: int8 per output channel, int4 in groups of 32, fp8 (e4m3) per
output channel (FORMAT.md "Quantized residents").

    bf16 matrix [N, K] --quantize_int8--> Int8Weight (q int8 [N, K], scale bf16 [N])
                       --quantize_int4--> Int4Weight (q 0..15 packed [N, K/2], scale + zero
                                          bf16 [K/32, N] each) --packed()--> Int4Packed
                       --quantize_fp8---> Fp8Weight (q float8_e4m3fn [N, K], scale fp32 [N])
    stated tensors (an artifact built with --resident-dtype) --held--> the same weights
    linear(x, w): F.linear for a tensor (a small one-token product on one thread),
                  w.linear(x) for a quantized weight

The encoders are formats/resident_quant.py, shared with `mtplx build-manifest`.

The fast paths are the project's CUDA GEMV for a decode step's few rows (kernels/cuda_residents:
dequantized in registers, tensor-core sums) and torch's maintained kernels for the rest;
`dequantize()` is the obvious reference each is tested against. `kernel_for` is the one place
that says which kernel a matrix gets from its kind, device, compute capability, shape and the
number of input rows: up to `cuda_residents.MAX_T` rows on a GPU cupy drives, the GEMV (N % 16;
K % 16, int4 K % 32); otherwise int8 `_weight_int8pack_mm` (CPU: K % 16 == 0; CUDA: any shape),
int4 `_weight_int4pack_mm_for_cpu` (N % 16 == 0) or, on CUDA >= 8.0 without cupy,
`_weight_int4pack_mm` (N % 8 == 0), fp8 `_scaled_mm` rowwise on CUDA >= 8.9 (N, K % 16 == 0).
Anything else computes through the reference dequantization: same values, slower; a device
without the kernel is said once in the log. A model holds one copy of each matrix: an int4 one
torch's kernel takes is converted to that kernel's tiled layout when it is made on its device
(at load); where the GEMV runs, int4 stays in the stated layout, which the GEMV reads.

Which tensors are quantized is one rule, `formats.resident_layouts.quantizable`: routing, norms, the
AttnRes mixes and everything fp32 stay as stored, so the router sees what a bf16 model gives it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..formats.resident_layouts import GROUP, RESIDENT_DTYPES, quantized_kind
from ..formats.resident_quant import encode_fp8, encode_int4, encode_int8
from ..kernels import cuda_residents

__all__ = ["GEMV", "KERNEL_OPS", "ONE_THREAD_BYTES", "REFERENCE", "Fp8Weight", "Int4Packed",
           "Int4Weight", "Int8Weight", "device_kernel", "gemv_runs", "held", "kernel_for",
           "linear", "one_thread", "quantize", "quantize_fp8", "quantize_int4", "quantize_int8",
           "scaled_mm_rowwise", "shape_refusal"]

log = logging.getLogger(__name__)

# kernel name -> the torch op it calls (kernel_for asks torch whether the device has it)
KERNEL_OPS = {"int8pack_cpu": "_weight_int8pack_mm", "int8pack_cuda": "_weight_int8pack_mm",
              "int4pack_cpu": "_weight_int4pack_mm_for_cpu",
              "int4pack_cuda": "_weight_int4pack_mm", "scaled_mm": "_scaled_mm"}
REFERENCE = "reference"
GEMV = "mtplx_gemv"  # kernels/cuda_residents, up to cuda_residents.MAX_T input rows


def _registered(op: str, device_type: str) -> bool:
    """Whether this torch build has `op` for the device type (a CPU build has no CUDA kernels)."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key)


def device_kernel(kind: str, device_type: str, capability: tuple[int, int] | None,
                  registered=_registered) -> tuple[str, str]:
    """(kernel, "") for a quantized matrix of `kind` ("int8" | "int4" | "fp8") on a device of
    `device_type` with CUDA compute `capability` (None off CUDA), or (REFERENCE, why) where the
    device has none: int4 on CUDA needs mma.sync bf16 (>= 8.0), fp8 needs fp8 tensor cores
    (>= 8.9), and torch must have the op there (`registered(op, device_type)`; tests pass
    their own)."""
    cuda, cap = device_type == "cuda", capability or (0, 0)
    if kind == "int8":
        name, why = ("int8pack_cuda" if cuda else "int8pack_cpu"), ""
    elif kind == "int4":
        name = "int4pack_cuda" if cuda else "int4pack_cpu"
        why = "int4 on CUDA needs compute capability >= 8.0" if cuda and cap < (8, 0) else ""
    elif kind == "fp8":
        name = "scaled_mm"
        why = "" if cuda and cap >= (8, 9) else \
            "fp8 matmuls need a CUDA device of compute capability >= 8.9"
    else:
        raise ValueError(f"quantized kind must be int8, int4 or fp8, not {kind!r}")
    if not why and not registered(KERNEL_OPS[name], device_type):
        why = f"torch {torch.__version__} has no {device_type} {KERNEL_OPS[name]}"
    return (REFERENCE, why) if why else (name, "")


def shape_refusal(kernel: str, shape: tuple[int, int]) -> str:
    """Why `kernel` cannot take an [N, K] matrix ("" if it can): torch's CPU int8 kernel reads
    the input width in steps of 16 and miscomputes, or crashes, for K % 16 != 0 (torch 2.13);
    the int4 layouts tile rows by 16 (CPU) or 8 (CUDA); `_scaled_mm` checks N, K % 16 == 0."""
    n, k = shape
    if kernel == "int8pack_cpu" and k % 16:
        return f"the CPU int8 kernel needs K % 16 == 0 (K = {k})"
    rows = {"int4pack_cpu": 16, "int4pack_cuda": 8}.get(kernel)
    if rows and n % rows:
        return f"the int4 kernel needs N % {rows} == 0 (N = {n})"
    if kernel == "scaled_mm" and (n % 16 or k % 16):
        return f"_scaled_mm needs N and K % 16 == 0 ([{n}, {k}])"
    return ""


@functools.cache
def gemv_runs() -> bool:
    """Whether cupy drives a GPU here, so the CUDA GEMV of kernels/cuda_residents can run."""
    return cuda_residents.unavailable_reason() is None


def _gemv_takes(kind: str, device_type: str, shape: tuple[int, int], gemv: bool | None) -> bool:
    if device_type != "cuda" or cuda_residents.refusal(kind, shape):
        return False
    return gemv_runs() if gemv is None else gemv


def kernel_for(kind: str, device_type: str, capability: tuple[int, int] | None,
               shape: tuple[int, int], registered=_registered, tokens: int | None = None,
               gemv: bool | None = None) -> tuple[str, str]:
    """The one selection: (kernel, "") or (REFERENCE, why) for a quantized [N, K] matrix of
    `kind` on that device, multiplying `tokens` input rows (None: any number, the kernel of a
    prefill chunk). Up to cuda_residents.MAX_T rows on CUDA, the GEMV where it runs and takes
    the shape (`gemv`: whether cupy drives a GPU, None: ask); otherwise torch's kernels
    (`device_kernel`, then `shape_refusal`). int4 where the GEMV takes it is held in the stated
    layout, which torch's int4 kernel cannot read: more rows dequantize (the reference)."""
    takes = _gemv_takes(kind, device_type, shape, gemv)
    if takes and tokens is not None and tokens <= cuda_residents.MAX_T:
        return GEMV, ""
    if takes and kind == "int4":
        return REFERENCE, f"int4 is held for the CUDA GEMV; over {cuda_residents.MAX_T} rows " \
                          "dequantize"
    name, why = device_kernel(kind, device_type, capability, registered)
    if name != REFERENCE:
        why = shape_refusal(name, shape)
    return (REFERENCE, why) if why else (name, "")


def _kernel(kind: str, device: torch.device, shape: torch.Size) -> str:
    """kernel_for on a tensor's device; a device without the kernel (not a refused shape) is
    said once in the log."""
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    name, why = device_kernel(kind, device.type, cap)
    if name == REFERENCE:
        _say_once(kind, device.type, why)
    return kernel_for(kind, device.type, cap, tuple(shape))[0]


@functools.cache
def _say_once(kind: str, device_type: str, why: str) -> None:
    log.warning("%s residents on %s compute through the reference dequantization (correct, "
                "slower): %s", kind, device_type, why)


class Int8Weight:
    """Symmetric int8 per output channel: w[n, k] ≈ q[n, k] · scale[n]."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        self.q, self.scale = q, scale  # int8 [N, K]; bf16 [N]
        self.shape, self.device, self.dtype = q.shape, q.device, scale.dtype
        self.kernel = _kernel("int8", self.device, self.shape)
        self.gemv = _gemv_takes("int8", self.device.type, tuple(self.shape), None)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 2 * self.scale.numel()

    def dequantize(self) -> torch.Tensor:
        """The reference: [N, K] in bf16 (the product is computed in fp32, rounded once)."""
        return (self.q.float() * self.scale.float()[:, None]).to(self.dtype)

    def fast(self) -> bool:
        """Whether torch's int8 kernel takes this matrix on its device (`kernel_for`)."""
        return self.kernel != REFERENCE

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] bf16 -> [T, N] bf16: the CUDA GEMV for a few rows, else torch's weight-only
        int8 matmul (fp32 inside), else the reference dequantization and a bf16 matmul."""
        lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
        if self.gemv and x2.shape[0] <= cuda_residents.MAX_T:
            y = cuda_residents.gemv("int8", self.q, self.scale, None, x2)
        elif self.fast():
            y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scale)
        else:
            return F.linear(x, self.dequantize())
        return y.reshape(*lead, self.shape[0])


class Int4Weight:
    """Asymmetric int4 in groups of GROUP inputs: w[n, k] ≈ (q[n, k] - 8) · scale[g, n] +
    zero[g, n], g = k // GROUP, q in 0..15 (the form torch's int4 matmuls compute). The stated
    layout and the reference; `packed()` is what a model holds where a torch kernel takes the
    shape on the weight's device."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        self.q = q  # uint8 [N, K // 2]: low nibble = even k, high nibble = odd k
        self.scale, self.zero = scale, zero  # bf16 [K // GROUP, N] each
        n, half = q.shape
        self.shape, self.device, self.dtype = torch.Size((n, 2 * half)), q.device, scale.dtype
        self.kernel = _kernel("int4", self.device, self.shape)
        self.gemv = _gemv_takes("int4", self.device.type, tuple(self.shape), None)

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
        """Whether a torch int4 kernel takes this matrix on its device (`kernel_for`)."""
        return self.kernel != REFERENCE

    def packed(self) -> Int4Packed:
        """The same values in the tiled layout of the device's torch kernel (torch's own,
        unstated). CPU: converted in row blocks so the int32 codes it takes never exist for a
        whole lm_head (4.7 GB in K3); the layout tiles 64 rows at a time, so blocks of
        multiples of 64 rows convert independently (tests/test_quant.py checks this against one
        whole conversion). CUDA: torch takes the uint8 codes with even k in the HIGH nibble."""
        n, k = self.shape
        scale_zero = torch.stack([self.scale, self.zero], dim=-1).contiguous()  # [K/G, N, 2]
        if self.kernel == "int4pack_cuda":
            swapped = ((self.q & 0x0F) << 4) | (self.q >> 4)  # [N, K/2] even k high
            tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)  # k-tiles per 16-byte load
            packed = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), tiles)
            return Int4Packed(packed, scale_zero, self.shape, self.kernel)
        out = torch.empty(n, k // 2, dtype=torch.uint8)
        step = max(_PACK_ROWS, _BLOCK // k // _PACK_ROWS * _PACK_ROWS)
        for r in range(0, n, step):
            rows = slice(r, r + step)
            out[rows] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes(rows), 1)
        return Int4Packed(out, scale_zero, self.shape, self.kernel)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] bf16 -> [T, N] bf16: the CUDA GEMV for a few rows (where it takes the
        matrix), else the reference dequantization and a bf16 matmul."""
        lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
        if self.gemv and x2.shape[0] <= cuda_residents.MAX_T:
            y = cuda_residents.gemv("int4", self.q, self.scale, self.zero, x2)
            return y.reshape(*lead, self.shape[0])
        return F.linear(x, self.dequantize())


class Int4Packed:
    """An Int4Weight in the layout its kernel reads: `_weight_int4pack_mm_for_cpu` (packed
    [N, K // 2] uint8, tiled) or `_weight_int4pack_mm` (int32 [N/8, K/(16 t), 32, t/2] for t
    inner k-tiles); scale_zero bf16 [K // GROUP, N, 2] for both."""

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, shape: torch.Size,
                 kernel: str):
        self.packed_q, self.scale_zero, self.kernel = packed, scale_zero, kernel
        self.shape, self.device, self.dtype = shape, packed.device, scale_zero.dtype

    @property
    def nbytes(self) -> int:
        return self.packed_q.numel() * self.packed_q.element_size() + 2 * self.scale_zero.numel()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] bf16 -> [T, N] bf16 through torch's weight-only int4 matmul."""
        lead = x.shape[:-1]
        op = getattr(torch.ops.aten, KERNEL_OPS[self.kernel])
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # the CUDA kernel reads rows densely
        y = op(x2, self.packed_q, GROUP, self.scale_zero)
        return y.reshape(*lead, self.shape[0])


class Fp8Weight:
    """Symmetric float8_e4m3fn per output channel: w[n, k] ≈ q[n, k] · scale[n], scale fp32
    (the rowwise scale dtype `_scaled_mm` takes)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        self.q, self.scale = q, scale  # float8_e4m3fn [N, K]; fp32 [N]
        self.shape, self.device, self.dtype = q.shape, q.device, torch.bfloat16
        self.kernel = _kernel("fp8", self.device, self.shape)
        self.gemv = _gemv_takes("fp8", self.device.type, tuple(self.shape), None)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """The reference: [N, K] (the rows `rows`) in bf16 (q · scale in fp32, rounded once)."""
        return (self.q[rows].float() * self.scale[rows, None]).to(self.dtype)

    def fast(self) -> bool:
        """Whether `_scaled_mm` takes this matrix on its device (`kernel_for`)."""
        return self.kernel != REFERENCE

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] bf16 -> [T, N] bf16. A few rows: the CUDA GEMV (bf16 x, e4m3 weights, fp32
        sums times the row scale). Fast: `scaled_mm_rowwise`, which also rounds x to e4m3
        (FORMAT.md "Quantized residents" bounds the difference). Reference: bf16 matmuls with the
        matrix dequantized a block of rows at a time, so no whole bf16 lm_head is ever made."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.gemv and x2.shape[0] <= cuda_residents.MAX_T:
            y = cuda_residents.gemv("fp8", self.q, self.scale, None, x2)
        elif self.fast():
            y = scaled_mm_rowwise(x2, self.q, self.scale)
        else:
            step = max(1, _BLOCK // self.shape[1])
            y = torch.cat([F.linear(x2, self.dequantize(slice(r, r + step)))
                           for r in range(0, self.shape[0], step)], dim=-1)
        return y.reshape(*lead, self.shape[0])


def scaled_mm_rowwise(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] bf16, q float8_e4m3fn [N, K], scale fp32 [N] -> [T, N] bf16 through
    `torch._scaled_mm` with rowwise scales: x is quantized per row by the weights' own encoder
    (`encode_fp8`: scale max|x_t| / 448) and the product accumulates in fp32. Runs wherever
    torch has `_scaled_mm` (the CPU build too, which is how tests check it without a GPU)."""
    xq, sx = encode_fp8(x)  # [T, K] e4m3, [T] fp32
    return torch._scaled_mm(xq, q.t(), sx[:, None], scale[None, :], out_dtype=torch.bfloat16)


# Int4Weight.packed and Fp8Weight.linear work in row blocks of about this many weights: one
# block's temporaries, not a whole lm_head's, bound the transient memory.
_BLOCK = 1 << 22
_PACK_ROWS = 64  # rows torch's CPU int4 layout tiles together (Int4Weight.packed)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """bf16 [N, K] -> Int8Weight (`formats.resident_quant.encode_int8`)."""
    return Int8Weight(*encode_int8(w))


def quantize_int4(w: torch.Tensor) -> Int4Weight:
    """bf16 [N, K] (K % GROUP == 0) -> Int4Weight in the stated layout
    (`formats.resident_quant.encode_int4`)."""
    return Int4Weight(*encode_int4(w))


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """bf16 [N, K] -> Fp8Weight (`formats.resident_quant.encode_fp8`)."""
    return Fp8Weight(*encode_fp8(w))


def held(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None):
    """A quantized matrix as a model holds it, from its stated tensors on their device (computed
    at load, or read from an artifact built with `--resident-dtype`): fp8 by its codes' dtype;
    int8 without a zero; int4 with one, packed for the device's torch kernel where it takes
    the shape, else in the stated layout."""
    if q.dtype == torch.float8_e4m3fn:
        return Fp8Weight(q, scale)
    if zero is None:
        return Int8Weight(q, scale)
    w = Int4Weight(q, scale, zero)
    return w.packed() if w.packable() else w


def quantize(w: torch.Tensor, dtype: str):
    """One quantizable bf16 matrix as a model holds it in the resident dtype: int8; fp8; int4
    packed for the device's torch kernel where it takes the shape, else the stated layout;
    int8 for a matrix whose input width is not a multiple of GROUP (FORMAT.md "Quantized
    residents")."""
    if dtype == "bf16":
        return w
    if dtype not in RESIDENT_DTYPES:
        raise ValueError(f"resident dtype must be one of {', '.join(RESIDENT_DTYPES)}, not "
                         f"{dtype!r}")
    kind = quantized_kind(tuple(w.shape), dtype)
    encode = {"int8": encode_int8, "int4": encode_int4, "fp8": encode_fp8}[kind]
    return held(*encode(w))


# A CPU matrix-vector product over at most this many weight bytes runs on one torch thread: a
# parallel region wakes the sleeping OpenMP workers, which costs more than splitting saves up to
# a few MiB (one thread took 0.27-0.79x the time of two up to 8 MiB, two won from 21 MiB on a
# quiet run: BENCHMARKS.md "Small products on one thread").
ONE_THREAD_BYTES = 8 << 20


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
