"""CUDA routed-expert kernels: thin wrappers over native/*.cu, compiled lazily by cupy (NVRTC).

Importing this module never touches cupy; every entry point checks shapes, dtypes, devices and
alignment before a launch, and raises one clear RuntimeError when cupy or a GPU is missing.

    x [T, R] -> {codec}_gate_up: h [T, K, I] -> {codec}_down_combine: out [T, R] fp32

Shape legend: T tokens, R latent (3584), I expert width (3072), K top-k (16). Decode GEMV only:
a prefill chunk runs as T independent GEMVs (grouped GEMM: TODO, native/README.md).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import torch

from ..model.layers import SITU_BETA, SITU_LINEAR_BETA
from .reference import expert_slots

NATIVE = Path(__file__).resolve().parents[2] / "native"
WARPS = 8  # MTPLX_WARPS in native/common.cuh: one output row per warp
# bank mode (and bits) -> (source file, kernel prefix)
KERNELS = {("t158", None): ("t158_gemv.cu", "t158"), ("mxfp4", None): ("mxfp4_gemv.cu", "mxfp4"),
           ("ct-int", 3): ("ctint_gemv.cu", "ctint3"), ("ct-int", 4): ("ctint_gemv.cu", "ctint4")}
COMPONENTS = {"t158": ("packed", "scales"), "mxfp4": ("weight_packed", "weight_scale"),
              "ct-int": ("weight_packed", "weight_scale")}


def unavailable_reason() -> str | None:
    """None when cupy imports and sees a GPU; otherwise why not. Never raises."""
    try:
        import cupy
    except Exception as e:  # missing or broken install
        return f"cupy is not installed or failed to import ({type(e).__name__}: {e})"
    try:
        if not cupy.is_available():
            return "cupy found no CUDA device (no GPU or no driver)"
    except Exception as e:
        return f"cupy could not query CUDA ({type(e).__name__}: {e})"
    return None


def available() -> bool:
    return unavailable_reason() is None


def require() -> None:
    why = unavailable_reason()
    if why:
        raise RuntimeError(f"CUDA kernels unavailable: {why}; use MTPLX_KERNELS=cpu or reference")


@cache
def _module(source: str):
    import cupy

    code = (NATIVE / source).read_text()
    return cupy.RawModule(code=code, options=("--std=c++17", f"-I{NATIVE}"))


def kernel_key(layout) -> tuple[str, int | None]:
    key = (layout.mode, layout.bits if layout.mode == "ct-int" else None)
    if key not in KERNELS:
        raise NotImplementedError(f"no CUDA kernel for bank mode {layout.mode!r} bits "
                                  f"{layout.bits}; use the cpu or reference backend")
    return key


def segment_offsets(layout) -> dict[str, int]:
    """{"gate.packed", "gate.scale", ...}: byte offsets inside the record, each 16-aligned."""
    packed, scale = COMPONENTS[layout.mode]
    out = {}
    for s in layout.segments:
        if s.part in (packed, scale):
            off = s.offset
            assert off % 16 == 0, f"{s.component} at {off} is not 16-byte aligned"
            out[f"{s.proj}.{'packed' if s.part == packed else 'scale'}"] = off
    return out


def _slot_base(storage, max_slot: int) -> tuple[int, int]:
    """(device pointer of slot 0, slot stride in bytes) of a cupy SlotTier-like `storage`."""
    v0 = storage.view(0)
    assert hasattr(v0, "data") and hasattr(v0.data, "ptr"), "storage must live on the GPU (cupy)"
    stride = int(storage.slot_bytes)
    base = int(v0.data.ptr)
    assert base % 4096 == 0 and stride % 4096 == 0, "slots must be 4 KiB-aligned"
    assert int(storage.view(max_slot).data.ptr) == base + max_slot * stride, \
        "storage slots must be one contiguous buffer, slot_bytes apart"
    return base, stride


def expert_mlp(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slots, storage,
               layout, shapes, *, beta: float = SITU_BETA,
               beta_lin: float = SITU_LINEAR_BETA) -> torch.Tensor:
    """Same contract as `reference.expert_mlp`, on the GPU. x, ids, weights: CUDA tensors;
    storage: a device SlotTier (`view(slot)` cupy, `slot_bytes`). fp32 accumulation; products
    are rounded to bf16 where a bf16 model rounds, so results match the reference to fp32-sum
    reordering, not bit for bit. Enqueued on torch's current stream; does not block."""
    require()
    import cupy

    key = kernel_key(layout)
    T, R = x.shape
    I = tuple(shapes["gate"])[0]  # noqa: E741 (the legend's name)
    assert tuple(shapes["gate"]) == (I, R) and tuple(shapes["down"]) == (R, I), shapes
    assert R % 64 == 0 and I % 64 == 0, f"R={R}, I={I} must be multiples of 64"
    assert x.is_cuda and x.dtype in (torch.float32, torch.bfloat16), (x.device, x.dtype)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32, (ids.dtype, weights.dtype)
    assert ids.dim() == 2 and ids.shape == weights.shape and ids.shape[0] == T
    K = ids.shape[1]
    if torch.is_tensor(slots) and slots.shape == ids.shape:
        slot_t = slots.to(device=x.device, dtype=torch.int32).contiguous()  # [T, K]
    else:
        by_id = expert_slots(ids, slots)
        ids_h = ids.cpu().numpy()
        slot_t = torch.from_numpy(np.vectorize(by_id.__getitem__, otypes=[np.int32])(ids_h)
                                  ).to(x.device)  # [T, K]
    base, stride = _slot_base(storage, int(slot_t.max().item()) if slot_t.numel() else 0)
    off = segment_offsets(layout)
    xf = x.float().contiguous()  # [T, R] exact: bf16 -> fp32
    w = weights.to(device=x.device).contiguous()  # [T, K]
    h = torch.empty((T, K, I), dtype=torch.float32, device=x.device)  # [T, K, I]
    out = torch.empty((T, R), dtype=torch.float32, device=x.device)  # [T, R]
    source, prefix = KERNELS[key]
    mod = _module(source)
    rnd = np.int32(x.dtype == torch.bfloat16)
    i32, i64, f32 = np.int32, np.int64, np.float32
    with cupy.cuda.ExternalStream(torch.cuda.current_stream(x.device).cuda_stream):
        mod.get_function(f"{prefix}_gate_up")(
            (-(-I // WARPS), K, T), (32 * WARPS,),
            (i64(base), i64(stride), slot_t.data_ptr(), xf.data_ptr(), h.data_ptr(),
             i32(K), i32(I), i32(R), i64(off["gate.packed"]), i64(off["gate.scale"]),
             i64(off["up.packed"]), i64(off["up.scale"]), f32(beta), f32(beta_lin), rnd),
            shared_mem=4 * R)
        mod.get_function(f"{prefix}_down_combine")(
            (-(-R // WARPS), T), (32 * WARPS,),
            (i64(base), i64(stride), slot_t.data_ptr(), h.data_ptr(), w.data_ptr(),
             out.data_ptr(), i32(K), i32(I), i32(R), i64(off["down.packed"]),
             i64(off["down.scale"]), rnd),
            shared_mem=4 * I)
    return out.to(x.dtype)
