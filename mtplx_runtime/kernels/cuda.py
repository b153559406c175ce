"""CUDA routed-expert kernels: native/*.cu through cupy (NVRTC), compiled lazily.

Importing this module never touches cupy; every entry point checks shapes, dtypes and devices
before a launch, and raises one clear RuntimeError when cupy or a GPU is missing.

    moe_layer(x, ids, weights, slot_of, base, stride, ...)   the device interface: device
        tensors only, no host sync, two launches (plus a few torch ops that group the pairs by
        expert when T > DECODE_MAX_T), capturable in a CUDA graph
      {codec}_gate_up: h [T*K, I] = SiTU-GLU(gate x, up x)   per expert, 128 rows per block
      {codec}_down:    y [T*K, R] = down h; out [T, R] = acc (or 0) + sum_k w * y, k ascending
    expert_mlp(x, ids, weights, slots, storage, ...)          the backend contract shared with
        reference and cpu, built on moe_layer
    repack(layout, view)                                      the in-place repack a record
        needs once it lands in a device slot (t158, ct-int3; nothing for the others)

The kernels run tensor-core MMAs with the weights dequantized in registers (native/gemv.cuh,
codecs.cuh); native/README.md has the layouts, the roofline and the measurements.
Shape legend: T tokens, R latent (3584), I expert width (3072), K top-k (16), E experts.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch

from ..extras import install_hint
from ..formats.modes import MODES, cuda_gap, cuda_kernels, cuda_key
from ..formats.record import first_misaligned
from .reference import SITU_BETA, SITU_LINEAR_BETA, check_acc

NATIVE = Path(__file__).resolve().parent / "native"
DEVICE = "cuda"  # where inputs, slots and results live (StreamingExpertProvider reads it)
# (bank mode, bits or None, columns per scale group) -> (source file, kernel prefix): the codec
# table's cuda column; the packed and scale components of each mode it runs.
KERNELS = cuda_kernels()
COMPONENTS = {m.name: m.parts[:2] for m in MODES.values() if m.cuda}
# kernel prefix -> its slot repack (codecs whose records the kernels read in another order)
REPACKS = {"t158": "t158_repack", "ctint3": "ctint3_repack"}
# modes whose packed component is the [rows, cols] weight itself (one byte per weight)
DENSE_BYTES = ("fp8-block",)
# Up to this many tokens the kernels group a layer's (token, expert) pairs themselves (one warp
# ballot per block); above it `route` sorts them on the device first.
DECODE_MAX_T = 32
X1_MAX_T = 8  # up to this many tokens per expert, the kernels built for passes of 8 suffice
BLOCK_ROWS = 128  # MTPLX_BLOCK_ROWS: rows of a matrix per block
THREADS = 128
LUT_BYTES = 256 * 16 * 8  # t158's table in shared memory (gemv.cuh MTPLX_LUT_BYTES)
XS_STRIDE_BYTES = 68 * 8  # one staged activation vector (gemv.cuh MTPLX_XS_STRIDE)
REPACK_BAND_MAX_BYTES = 48 << 10  # t158_repack stages a band of 16 rows (16 * 15 * G bytes)


def unavailable_reason() -> str | None:
    """None when cupy imports and sees a GPU; otherwise why not. Never raises."""
    try:
        import cupy
    except Exception as e:  # missing or broken install
        if isinstance(e, ModuleNotFoundError) and e.name == "cupy":
            return f"cupy is not installed (the gpu extra: {install_hint('gpu')})"
        return f"cupy failed to import ({type(e).__name__}: {e})"
    try:
        if not cupy.is_available():
            return "cupy found no CUDA device (no GPU or no driver)"
    except Exception as e:
        return f"cupy could not query CUDA ({type(e).__name__}: {e})"
    return None


def require() -> None:
    why = unavailable_reason()
    if why:
        raise RuntimeError(f"CUDA kernels unavailable: {why}; use MTPLX_KERNELS=cpu or reference")


@cache
def module(source: str):
    """The cupy RawModule of native/`source` (compiled by NVRTC on first use, cached on disk)."""
    import cupy

    code = (NATIVE / source).read_text()
    return cupy.RawModule(code=code, options=("--std=c++17", f"-I{NATIVE}"))


def kernel(source: str, name: str, shared_bytes: int = 0):
    """Entry point `name` of native/`source`, allowed `shared_bytes` of dynamic shared memory
    (above the 48 KiB default it must be raised per function, once), on cupy's current device.
    Looked up once: a launch does not rebuild the handle or query the driver."""
    import cupy

    return _kernel(source, name, shared_bytes, cupy.cuda.runtime.getDevice())


@cache
def _kernel(source: str, name: str, shared_bytes: int, device: int):
    fn = module(source).get_function(name)
    if shared_bytes > fn.max_dynamic_shared_size_bytes:
        fn.max_dynamic_shared_size_bytes = shared_bytes
    return fn


class _Handle:
    """A raw CUDA stream handle behind the CUDA stream protocol (cupy Stream.from_external)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


@cache
def _cupy_stream(handle: int):
    import cupy

    return cupy.cuda.Stream.from_external(_Handle(handle))


def stream(device: torch.device):
    """torch's current stream on `device` as a cupy stream: kernels launch on it, so they order
    with torch's own work and are captured with it into a CUDA graph."""
    return _cupy_stream(torch.cuda.current_stream(device).cuda_stream)


def _layout_key(layout) -> tuple[str, int | None, int]:
    return cuda_key(layout.mode, layout.bits, layout.group_size)


def unsupported(layout) -> str | None:
    """Why this backend cannot run records of `layout` (None: it can). Checked at load."""
    why = cuda_gap(layout.mode, layout.bits, layout.group_size)
    if why is not None:
        return why
    s = first_misaligned(layout, 16)
    if s is not None:  # the kernels load components with 8- and 16-byte vector loads
        return (f"the CUDA kernels need every record component 16-byte aligned; {s.component} "
                f"starts at record offset {s.offset} (an unpadded bank); use the cpu or "
                "reference backend, or rebuild the bank with `mtplx build-manifest`")
    for s in layout.segments:
        if s.proj is not None and s.part == COMPONENTS[layout.mode][0]:
            rows, cols = projection_shape(layout, s.proj)
            if rows % 16:
                return (f"the CUDA kernels need rows of every projection in multiples of 16 (one "
                        f"MMA tile); {s.component} has {rows}")
            if cols % 16:  # fp8-block: a lane loads 16 whole columns of a row
                return (f"the CUDA kernels need columns of every projection in multiples of 16; "
                        f"{s.component} has {cols}")
            if layout.mode == "t158" and 16 * 15 * (cols // 64) > REPACK_BAND_MAX_BYTES:
                return f"t158 rows of {cols} columns exceed the CUDA repack's shared memory"
    return None


def projection_shape(layout, proj: str) -> tuple[int, int]:
    """[rows, cols] of projection `proj` from the record layout: fp8-block's weight component,
    else the scale component (one scale per group of the layout's columns, one row per row)."""
    packed, scale = COMPONENTS[layout.mode]
    part = packed if layout.mode in DENSE_BYTES else scale
    seg = next(s for s in layout.segments if s.proj == proj and s.part == part)
    if layout.mode in DENSE_BYTES:
        return tuple(seg.shape)
    return seg.shape[0], seg.shape[1] * _layout_key(layout)[2]


def kernel_key(layout) -> tuple[str, int | None, int]:
    why = unsupported(layout)
    if why:
        raise NotImplementedError(why)
    return _layout_key(layout)


def segment_offsets(layout) -> dict[str, int]:
    """{"gate.packed", "gate.scale", ...}: byte offsets inside the record, each 16-aligned."""
    packed, scale = COMPONENTS[layout.mode]
    out = {}
    for s in layout.segments:
        if s.part in (packed, scale):
            assert s.offset % 16 == 0, f"{s.component} at {s.offset} is not 16-byte aligned"
            out[f"{s.proj}.{'packed' if s.part == packed else 'scale'}"] = s.offset
    return out


@cache
def _record_kernels(layout) -> tuple[str, str, Mapping[str, int]]:
    """(source, prefix, segment_offsets) for records of `layout`: checked (`kernel_key`) and
    computed once per layout, not on every launch and fill."""
    source, prefix = KERNELS[kernel_key(layout)]
    return source, prefix, MappingProxyType(segment_offsets(layout))


# ---- Slots: the repack when a record lands --------------------------------------------------

def repack(layout, view, stream=None) -> None:
    """Repack the record in device slot `view` (cupy uint8, the record's bytes as read) in place
    into the layout the kernels read (native/codecs.cuh: t158 by bands of 16 rows, ct-int3 by
    groups; same size). Once per fill, after the record's check and before any kernel reads it:
    a second call would scramble it. A no-op for mxfp4, ct-int4 and fp8-block. The fill pipeline
    calls it for every record (offload/fill.py).
    stream None: the bytes must have landed (the stream that wrote them synchronized); it runs
    on a non-blocking stream of the calling thread and returns when done. stream (a
    torch.cuda.Stream): enqueued there after whatever wrote the bytes on that stream (the fill's
    copy stream), and returns at once: the caller's event after it orders the kernels."""
    require()
    source, prefix, off = _record_kernels(layout)
    entry = REPACKS.get(prefix)
    if entry is None:
        return
    base = int(view.data.ptr)
    assert base % 4096 == 0 and view.size >= layout.logical_bytes, "a whole, aligned slot"
    s = _thread_stream() if stream is None else _cupy_stream(stream.cuda_stream)
    for proj in ("gate", "up", "down"):
        rows, cols = projection_shape(layout, proj)
        packed = base + off[f"{proj}.packed"]
        if prefix == "t158":
            band = 16 * 15 * (cols // 64)
            kernel(source, entry, band)((rows // 16,), (256,),
                                         (packed, base + off[f"{proj}.scale"], np.int32(cols)),
                                         shared_mem=band, stream=s)
        else:
            groups = rows * (cols // 64)
            kernel(source, entry)((-(-groups // 256),), (256,), (packed, np.int64(groups)),
                                   stream=s)
    if stream is None:
        s.synchronize()


_local = threading.local()


def _thread_stream():
    """This thread's non-blocking cupy stream (the legacy default stream would serialize with
    every other stream of the process)."""
    import cupy

    if getattr(_local, "stream", None) is None:
        _local.stream = cupy.cuda.Stream(non_blocking=True)
    return _local.stream


# ---- The device interface ------------------------------------------------------------------

@dataclass
class Workspace:
    """Device buffers `moe_layer` reuses for up to `tokens` tokens: h [tokens K, I] and
    y [tokens K, R] in the model dtype (bf16 rounded where a bf16 model rounds, or fp32), and
    one counter per 128 rows of R (zero between launches: the last block of each row block
    resets its own, so graph replays need no memset)."""

    tokens: int
    h: torch.Tensor
    y: torch.Tensor
    counters: torch.Tensor


def workspace(tokens: int, K: int, shapes: Mapping, dtype: torch.dtype,
              device: torch.device | str) -> Workspace:
    I, R = tuple(shapes["gate"])  # noqa: E741 (the legend's name)
    dev = torch.device(device)
    return Workspace(tokens, torch.empty(tokens * K, I, dtype=dtype, device=dev),
                     torch.empty(tokens * K, R, dtype=dtype, device=dev),
                     torch.zeros(-(-R // BLOCK_ROWS), dtype=torch.int32, device=dev))


def route(ids: torch.Tensor, slot_of: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Group a layer's (token, expert) pairs by expert on the device, for T > DECODE_MAX_T:
    (pairs int32 [P], start int32 [P + 2], items). Pair p = t * K + k; pairs lists the picks whose
    expert has a slot, sorted by slot, then token; item j's pairs are pairs[start[j] :
    start[j + 1]], j < items = min(P, E) (items past the experts used are empty). Torch ops
    only: no host sync (works on CPU tensors too)."""
    T, K = ids.shape
    P, dev = T * K, ids.device
    flat = ids.reshape(-1)
    slot = torch.where(flat >= 0, slot_of[flat.clamp(min=0)].long(), -1)  # [P]
    valid = slot >= 0
    token = torch.arange(P, device=dev) // K
    key = torch.where(valid, slot * T + token, torch.iinfo(torch.int64).max)
    order = torch.argsort(key, stable=True)  # [P] pairs by (slot, token); invalid last
    s = slot[order]
    first = valid[order] & torch.cat([torch.ones(1, dtype=torch.bool, device=dev),
                                      s[1:] != s[:-1]])
    item = torch.cumsum(first, 0) - 1  # [P] item of each sorted pair
    start = valid.sum().to(torch.int32).expand(P + 2).clone()  # unused items: empty, at the end
    start.scatter_(0, torch.where(first, item, P + 1),
                   torch.arange(P, dtype=torch.int32, device=dev))
    return order.to(torch.int32), start, min(P, len(slot_of))


def moe_layer(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
              base: int, stride: int, layout, shapes: Mapping, ws: Workspace, out: torch.Tensor,
              *, acc: torch.Tensor | None = None, beta: float = SITU_BETA,
              beta_lin: float = SITU_LINEAR_BETA) -> torch.Tensor:
    """Routed experts of one layer from device slots: out[t] = acc[t] (or 0) + sum over k
    ascending of weights[t, k] * W_down SiTU-GLU(x_t) of expert ids[t, k], in fp32.

    x: [T, R] bf16 or fp32 (the model dtype; bf16 rounds where the reference's bf16 GEMMs round).
    ids: [T, K] int64 expert ids, -1 = an empty pick (skipped); distinct per token.
    weights: [T, K] fp32. slot_of: [E] int32, the slot of each expert, -1 = absent (its picks
    add nothing: the caller must have every chosen expert in a slot). base, stride: device address
    of slot 0 and the slot stride in bytes; slots hold records as `repack` left them.
    ws: a Workspace for >= T tokens of this layout, dtype and device. out: fp32 [T, R], written
    whole (may be acc itself). All on one device, contiguous. Returns out.
    Enqueued on torch's current stream without a host sync; with T <= DECODE_MAX_T two kernel
    launches and nothing else (capturable in a CUDA graph), above it `route` first.
    """
    T, R = x.shape
    K = ids.shape[1]
    source, prefix, off = _record_kernels(layout)
    I = tuple(shapes["gate"])[0]  # noqa: E741 (the legend's name)
    f32 = x.dtype == torch.float32
    if not (x.dtype in (torch.float32, torch.bfloat16) and ids.dtype == torch.int64
            and weights.dtype == torch.float32 and slot_of.dtype == torch.int32
            and out.dtype == torch.float32 and out.shape == (T, R) and ws.tokens >= T
            and ws.h.dtype == x.dtype and ids.shape == weights.shape == (T, K)
            and tuple(shapes["gate"]) == (I, R) and tuple(shapes["down"]) == (R, I)):
        raise ValueError(f"moe_layer: x {x.dtype}{list(x.shape)}, ids {ids.dtype}"
                         f"{list(ids.shape)}, weights {weights.dtype}{list(weights.shape)}, "
                         f"slot_of {slot_of.dtype}, out {out.dtype}{list(out.shape)}, workspace "
                         f"for {ws.tokens} tokens {ws.h.dtype}, shapes {dict(shapes)}")
    if T == 0 or K == 0:
        return out.copy_(acc) if acc is not None else out.zero_()
    if T <= DECODE_MAX_T:
        pairs = start = None
        items = T * K
    else:
        pairs, start, items = route(ids, slot_of)
    variant = "f32" if f32 else ("bf16x1" if T <= X1_MAX_T else "bf16x4")
    ntmax = 1 if variant != "bf16x4" else 4
    smem = (LUT_BYTES if prefix == "t158" else 0) + (3 if f32 else 1) * 8 * ntmax * XS_STRIDE_BYTES
    i32, i64, f32c = np.int32, np.int64, np.float32
    route_args = (pairs.data_ptr() if pairs is not None else 0,
                  start.data_ptr() if start is not None else 0)
    common = (i64(base), i64(stride), ids.data_ptr(), slot_of.data_ptr(), i32(T), i32(K))
    s = stream(x.device)
    kernel(source, f"{prefix}_gate_up_{variant}", smem)(
        (items, -(-I // BLOCK_ROWS)), (THREADS,),
        common + route_args + (x.data_ptr(), ws.h.data_ptr(), i32(I), i32(R),
                               i64(off["gate.packed"]), i64(off["gate.scale"]),
                               i64(off["up.packed"]), i64(off["up.scale"]), f32c(beta),
                               f32c(beta_lin)),
        shared_mem=smem, stream=s)
    kernel(source, f"{prefix}_down_{variant}", smem)(
        (items, -(-R // BLOCK_ROWS)), (THREADS,),
        common + route_args + (ws.h.data_ptr(), ws.y.data_ptr(), weights.data_ptr(),
                               acc.data_ptr() if acc is not None else 0, out.data_ptr(),
                               ws.counters.data_ptr(), i32(I), i32(R),
                               i64(off["down.packed"]), i64(off["down.scale"])),
        shared_mem=smem, stream=s)
    return out


# ---- The backend contract (reference.expert_mlp's signature) --------------------------------

def _slot_base(storage) -> tuple[int, int]:
    """(device address of slot 0, slot stride in bytes) of a cupy SlotTier-like `storage`."""
    v0 = storage.view(0)
    assert hasattr(v0, "data") and hasattr(v0.data, "ptr"), "storage must live on the GPU (cupy)"
    stride = int(storage.slot_bytes)
    base = int(v0.data.ptr)
    assert base % 4096 == 0 and stride % 4096 == 0, "slots must be 4 KiB-aligned"
    last = storage.num_slots - 1
    assert int(storage.view(last).data.ptr) == base + last * stride, \
        "storage slots must be one contiguous buffer, slot_bytes apart"
    return base, stride


_WORKSPACES: dict = {}


def _workspace(T: int, K: int, shapes: Mapping, dtype, device) -> Workspace:
    """A Workspace for at least T tokens, kept per (device, dtype, K, shapes) and grown as
    needed (the legacy entry point's buffers; moe_layer callers bring their own)."""
    key = (str(device), dtype, K, tuple(shapes["gate"]))
    ws = _WORKSPACES.get(key)
    if ws is None or ws.tokens < T:
        ws = _WORKSPACES[key] = workspace(max(T, 1), K, shapes, dtype, device)
    return ws


@cache
def _identity(n: int, device: str) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32, device=device)


def _slot_table(ids: torch.Tensor, slots, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, slot_of) for moe_layer from expert_mlp's `slots`: a {expert: slot} mapping (one
    small copy to the device, and one host sync to refuse an id without a slot, as the reference
    does), or a [T, K] slot tensor aligned with ids (the slots stand in for the ids: no sync)."""
    if isinstance(slots, Mapping):
        table = torch.full((max(slots, default=-1) + 1,), -1, dtype=torch.int32)
        for e, s in slots.items():
            table[int(e)] = int(s)
        table = table.to(ids.device)
        known = (ids < len(table)) & (table[ids.clamp(0, max(len(table) - 1, 0))] >= 0) \
            if len(table) else torch.zeros_like(ids, dtype=torch.bool)
        missing = (ids >= 0) & ~known
        if bool(missing.any()):
            raise KeyError(f"no slot given for experts {sorted(set(ids[missing].tolist()))}")
        return ids, table
    s = torch.as_tensor(slots).to(ids.device)
    if s.shape != ids.shape:
        raise ValueError(f"slots {list(s.shape)} must match ids {list(ids.shape)}")
    return torch.where(ids >= 0, s.long(), -1), _identity(num_slots, str(ids.device))


def expert_mlp(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slots, storage,
               layout, shapes, *, beta: float = SITU_BETA, beta_lin: float = SITU_LINEAR_BETA,
               acc: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `reference.expert_mlp`, on the GPU (`moe_layer` underneath). x, ids,
    weights: CUDA tensors; storage: a device SlotTier (`view(slot)` cupy, `slot_bytes`) whose
    records went through `repack`. fp32 sums; products are rounded to bf16 where a bf16
    model rounds, so results match the reference to fp32-sum reordering, not bit for bit.

    acc: optional fp32 [T, R] on x's device. When given, each token's sum starts from acc (not
    0), the routed products are added in ascending k, the result is written into acc and acc is
    returned (fp32, un-cast). When None, returns a fresh [T, R] tensor in x.dtype.
    Enqueued on torch's current stream; a {expert: slot} mapping costs one host sync (the check
    for experts without a slot), a [T, K] slot tensor none."""
    require()
    _record_kernels(layout)  # NotImplementedError before any work
    T, R = x.shape
    if not (x.is_cuda and x.dtype in (torch.float32, torch.bfloat16) and ids.dtype == torch.int64
            and weights.dtype == torch.float32 and ids.dim() == 2
            and ids.shape == weights.shape and ids.shape[0] == T):
        raise ValueError(f"x {x.dtype}{list(x.shape)} on {x.device}, ids {ids.dtype}"
                         f"{list(ids.shape)}, weights {weights.dtype}{list(weights.shape)}: "
                         "want CUDA [T, R] bf16/fp32, [T, K] int64, [T, K] fp32")
    check_acc(acc, x)
    assert acc is None or acc.is_contiguous(), "acc must be contiguous (written in place)"
    dev = x.device
    ids_k, slot_of = _slot_table(ids.to(dev), slots, int(storage.num_slots))
    base, stride = _slot_base(storage)
    ws = _workspace(T, ids.shape[1], shapes, x.dtype, dev)
    out = acc if acc is not None else torch.empty(T, R, dtype=torch.float32, device=dev)
    moe_layer(x.contiguous(), ids_k.contiguous(), weights.to(dev).contiguous(), slot_of, base,
              stride, layout, shapes, ws, out, acc=acc, beta=beta, beta_lin=beta_lin)
    return out if acc is not None else out.to(x.dtype)
