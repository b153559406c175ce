"""CUDA routed-expert kernels: thin wrappers over native/*.cu, compiled lazily by cupy (NVRTC).

Importing this module never touches cupy; every entry point checks shapes, dtypes, devices and
alignment before a launch, and raises one clear RuntimeError when cupy or a GPU is missing.

    decode (T < GROUPED_MIN_T):   x [T, R] -> {codec}_gate_up: h [T, K, I]
                                  -> {codec}_down_combine: out [T, R] fp32
    grouped (T >= GROUPED_MIN_T): below (pairs sorted by slot, each weight decoded
                                  once per tile of pairs; native/grouped.cuh)

Shape legend: T tokens, R latent (3584), I expert width (3072), K top-k (16).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

from ..extras import install_hint
from ..formats.record import first_misaligned
from .reference import SITU_BETA, SITU_LINEAR_BETA, check_acc, expert_slots

NATIVE = Path(__file__).resolve().parent / "native"
DEVICE = "cuda"  # where inputs, slots and results live (StreamingExpertProvider reads it)
WARPS = 8  # MTPLX_WARPS in native/common.cuh: one output row per warp
# Smallest T that takes the grouped path. Below it the decode GEMV should win: the grouped path
# pays a sort and one host sync (the tile count) and saves work only when tokens share experts,
# which at K3 (896 experts, top-16) is rare for a handful of tokens. Untuned: tools/gpu_check.py
# times both paths at T = 8 and 64 so the number can be moved with data.
GROUPED_MIN_T = 8
# bank mode (and bits) -> (source file, kernel prefix, columns per scale group = the codec's GROUP)
KERNELS = {("t158", None): ("t158_gemv.cu", "t158", 64),
           ("mxfp4", None): ("mxfp4_gemv.cu", "mxfp4", 32),
           ("ct-int", 3): ("ctint_gemv.cu", "ctint3", 64),
           ("ct-int", 4): ("ctint_gemv.cu", "ctint4", 64)}
# entry points per codec prefix (native/grouped.cuh MTPLX_KERNELS), plus one per module
SUFFIXES = ("gate_up", "down_combine", "gate_up_grouped", "down_grouped")
COMBINE = "mtplx_combine"
COMPONENTS = {"t158": ("packed", "scales"), "mxfp4": ("weight_packed", "weight_scale"),
              "ct-int": ("weight_packed", "weight_scale")}


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
def _module(source: str):
    import cupy

    code = (NATIVE / source).read_text()
    return cupy.RawModule(code=code, options=("--std=c++17", f"-I{NATIVE}"))


def unsupported(layout) -> str | None:
    """Why this backend cannot run records of `layout` (None: it can). Checked at load."""
    if (layout.mode, layout.bits if layout.mode == "ct-int" else None) not in KERNELS:
        return (f"no CUDA kernel for bank mode {layout.mode!r} bits {layout.bits}; use the cpu "
                "or reference backend")
    s = first_misaligned(layout, 16)
    if s is not None:  # the kernels load components with 16-byte vector loads
        return (f"the CUDA kernels need every record component 16-byte aligned; {s.component} "
                f"starts at record offset {s.offset} (an unpadded bank); use the cpu or "
                "reference backend, or rebuild the bank with `mtplx build-manifest`")
    return None


def kernel_key(layout) -> tuple[str, int | None]:
    why = unsupported(layout)
    if why:
        raise NotImplementedError(why)
    return layout.mode, layout.bits if layout.mode == "ct-int" else None


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


@dataclass
class Launch:
    """Checked, device-resident arguments shared by the decode and grouped paths."""

    mod: object  # cupy RawModule of the codec's source
    prefix: str  # kernel name prefix
    group: int  # columns per scale group (the shared-memory padding)
    T: int
    K: int
    I: int  # noqa: E741 (the legend's name)
    R: int
    slot_t: torch.Tensor  # [T, K] int32
    base: int  # device address of slot 0
    stride: int  # slot_bytes
    off: dict  # segment_offsets(layout)
    x: torch.Tensor  # [T, R] fp32
    w: torch.Tensor  # [T, K] fp32
    out: torch.Tensor  # [T, R] fp32: acc itself, or a fresh buffer
    acc0: int  # device address of the initial sums (acc), 0 for none
    rnd: np.int32  # 1: round to bf16 where a bf16 model rounds

    def smem(self, cols: int) -> int:
        """Dynamic shared bytes of one padded fp32 vector of `cols` (common.cuh padded())."""
        return 4 * (cols + cols // self.group)


def _prepare(x, ids, weights, slots, storage, layout, shapes, acc) -> Launch:
    key = kernel_key(layout)
    T, R = x.shape
    I = tuple(shapes["gate"])[0]  # noqa: E741 (the legend's name)
    assert tuple(shapes["gate"]) == (I, R) and tuple(shapes["down"]) == (R, I), shapes
    assert R % 64 == 0 and I % 64 == 0, f"R={R}, I={I} must be multiples of 64"
    assert x.is_cuda and x.dtype in (torch.float32, torch.bfloat16), (x.device, x.dtype)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32, (ids.dtype, weights.dtype)
    assert ids.dim() == 2 and ids.shape == weights.shape and ids.shape[0] == T
    check_acc(acc, x)
    assert acc is None or acc.is_contiguous(), "acc must be contiguous (written in place)"
    K = ids.shape[1]
    by_id = expert_slots(ids, slots)  # checks slots; empty picks (id < 0) have none
    missing = sorted({e for e in ids.unique().tolist() if e >= 0} - set(by_id))
    if missing:
        raise KeyError(f"no slot given for experts {missing}")
    # [T, K] slot per pick, -1 for an empty pick: the kernels skip those.
    slot_t = torch.tensor([[by_id[e] if e >= 0 else -1 for e in row] for row in ids.tolist()],
                          dtype=torch.int32).reshape(ids.shape).to(x.device)
    base, stride = _slot_base(storage, int(slot_t.max().item()) if slot_t.numel() else 0)
    source, prefix, group = KERNELS[key]
    if acc is not None:
        out = acc
    else:  # every element is written by the kernels, unless there is nothing to launch
        out = (torch.empty if T and K else torch.zeros)((T, R), dtype=torch.float32,
                                                         device=x.device)
    return Launch(_module(source), prefix, group, T, K, I, R, slot_t, base, stride,
                  segment_offsets(layout), x.float().contiguous(),  # bf16 -> fp32 is exact
                  weights.to(device=x.device).contiguous(), out,
                  acc.data_ptr() if acc is not None else 0, np.int32(x.dtype == torch.bfloat16))


def _decode(L: Launch, beta: float, beta_lin: float) -> None:
    """Two launches: gate_up per (row block, k, t), then down_combine per (row block, t)."""
    i32, i64, f32 = np.int32, np.int64, np.float32
    h = torch.empty((L.T, L.K, L.I), dtype=torch.float32, device=L.x.device)  # [T, K, I]
    L.mod.get_function(f"{L.prefix}_gate_up")(
        (-(-L.I // WARPS), L.K, L.T), (32 * WARPS,),
        (i64(L.base), i64(L.stride), L.slot_t.data_ptr(), L.x.data_ptr(), h.data_ptr(),
         i32(L.K), i32(L.I), i32(L.R), i64(L.off["gate.packed"]), i64(L.off["gate.scale"]),
         i64(L.off["up.packed"]), i64(L.off["up.scale"]), f32(beta), f32(beta_lin), L.rnd),
        shared_mem=L.smem(L.R))
    L.mod.get_function(f"{L.prefix}_down_combine")(
        (-(-L.R // WARPS), L.T), (32 * WARPS,),
        (i64(L.base), i64(L.stride), L.slot_t.data_ptr(), h.data_ptr(), L.w.data_ptr(),
         i64(L.acc0), L.out.data_ptr(), i32(L.K), i32(L.I), i32(L.R),
         i64(L.off["down.packed"]), i64(L.off["down.scale"]), L.rnd),
        shared_mem=L.smem(L.I))


def _run(grouped: bool | None, x, ids, weights, slots, storage, layout, shapes, beta, beta_lin,
         acc):
    require()
    import cupy

    L = _prepare(x, ids, weights, slots, storage, layout, shapes, acc)
    if L.T and L.K:  # else there is nothing to add: out is acc, or zeros
        if grouped is None:
            grouped = L.T >= GROUPED_MIN_T
        with cupy.cuda.ExternalStream(torch.cuda.current_stream(x.device).cuda_stream):
            if grouped:
                launch_grouped(L, beta, beta_lin)
            else:
                _decode(L, beta, beta_lin)
    return L.out if acc is not None else L.out.to(x.dtype)


def expert_mlp(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slots, storage,
               layout, shapes, *, beta: float = SITU_BETA, beta_lin: float = SITU_LINEAR_BETA,
               acc: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `reference.expert_mlp`, on the GPU. x, ids, weights: CUDA tensors;
    storage: a device SlotTier (`view(slot)` cupy, `slot_bytes`). fp32 accumulation; products
    are rounded to bf16 where a bf16 model rounds, so results match the reference to fp32-sum
    reordering, not bit for bit. T < GROUPED_MIN_T runs the decode GEMV, larger T the grouped
    GEMM (`launch_grouped`).

    acc: optional fp32 [T, R] on x's device. When given, each token's sum starts from acc (not
    0), the routed products are added in ascending k, the result is written into acc and acc is
    returned (fp32, un-cast). When None, returns a fresh [T, R] tensor in x.dtype.
    Enqueued on torch's current stream; blocks only for the slot lookup and, on the grouped
    path, the tile count."""
    return _run(None, x, ids, weights, slots, storage, layout, shapes, beta, beta_lin, acc)


def decode_mlp(x, ids, weights, slots, storage, layout, shapes, *, beta: float = SITU_BETA,
               beta_lin: float = SITU_LINEAR_BETA, acc: torch.Tensor | None = None):
    """`expert_mlp` forced onto the decode GEMV for any T (tests, gpu_check timings)."""
    return _run(False, x, ids, weights, slots, storage, layout, shapes, beta, beta_lin, acc)


def grouped_mlp(x, ids, weights, slots, storage, layout, shapes, *, beta: float = SITU_BETA,
                beta_lin: float = SITU_LINEAR_BETA, acc: torch.Tensor | None = None):
    """`expert_mlp` forced onto the grouped GEMM for any T (tests, gpu_check timings)."""
    return _run(True, x, ids, weights, slots, storage, layout, shapes, beta, beta_lin, acc)


# ---- Grouped GEMM for prefill chunks: the host half of native/grouped.cuh ----
# The T*K (token, k) pairs are sorted by slot so that each expert's pairs are contiguous, and
# each expert's run is cut into tiles of at most TILE pairs. A block of `{codec}_gate_up_grouped`
# / `{codec}_down_grouped` handles one (row block, tile): it decodes each weight of its rows once
# and applies it to every pair of the tile, instead of once per pair as the decode GEMV does.
#
#     x [T, R] --gate_up_grouped--> h [T*K, I] --down_grouped--> y [T*K, R]
#       --mtplx_combine (acc or 0, then + weights[t, k] * y[t*K + k] for k ascending)--> out [T, R]
#
# Pair id p = t * K + k (row-major [T, K]).

TILE = 4  # MTPLX_TILE in native/grouped.cuh: pairs per tile (one float4 per staged column)
MAX_TILES = 65535  # tiles ride on grid.y


def group_pairs(slot_t: torch.Tensor, tile: int = TILE
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, K] slot indices -> (pairs, tile_slot, tile_start, tile_count), all int32 on
    slot_t's device (pure torch: runs on CPU tensors too).

    pairs [P]: the pair ids of non-empty picks (slot >= 0; -1 marks an empty pick, which gets
    no tile) sorted by slot, ascending pair id within a slot (stable sort).
    Tile i covers pairs[tile_start[i] : tile_start[i] + tile_count[i]] (1..tile pairs), all of
    slot tile_slot[i]; tiles are ordered by slot, and a slot's tiles are consecutive.
    Blocks once on the device (the tile count sizes the grid).
    """
    flat = slot_t.reshape(-1).to(torch.int64)  # [T*K], index = pair id
    dev = flat.device
    pairs = torch.sort(flat, stable=True).indices  # [T*K] pair ids grouped by slot
    pairs = pairs[flat[pairs] >= 0]  # [P] empty picks (slot -1) sort first: drop them
    uniq, counts = torch.unique_consecutive(flat[pairs], return_counts=True)  # [U] each
    ntiles = (counts + tile - 1) // tile  # [U] tiles per slot
    first_pair = torch.cumsum(counts, 0) - counts  # [U] where each slot's run starts in pairs
    first_tile = torch.cumsum(ntiles, 0) - ntiles  # [U] index of each slot's first tile
    n = int(ntiles.sum())  # the one host sync
    owner = torch.repeat_interleave(torch.arange(len(uniq), device=dev), ntiles,
                                    output_size=n)  # [n] slot run of each tile
    j = torch.arange(n, device=dev) - first_tile[owner]  # [n] tile's rank inside its run
    tile_start = first_pair[owner] + j * tile
    tile_count = torch.clamp(counts[owner] - j * tile, max=tile)
    i32 = torch.int32
    return pairs.to(i32), uniq[owner].to(i32), tile_start.to(i32), tile_count.to(i32)


def launch_grouped(L: Launch, beta: float, beta_lin: float) -> None:
    """Enqueue the three grouped launches for `L` (T, K >= 1) on the current cupy stream;
    writes L.out."""
    i32, i64, f32 = np.int32, np.int64, np.float32
    pairs, tile_slot, tile_start, tile_count = group_pairs(L.slot_t)
    n = tile_count.numel()
    assert n <= MAX_TILES, f"{n} tiles: split the chunk (T*K <= {MAX_TILES} always fits)"
    dev = L.x.device
    h = torch.empty((L.T * L.K, L.I), dtype=torch.float32, device=dev)  # [T*K, I]
    y = torch.empty((L.T * L.K, L.R), dtype=torch.float32, device=dev)  # [T*K, R]
    smem = 16 * 32 * (L.group + 1)  # 32 padded groups of float4 (grouped.cuh)
    tiles = (i64(L.base), i64(L.stride), tile_slot.data_ptr(), tile_start.data_ptr(),
             tile_count.data_ptr(), pairs.data_ptr())
    L.mod.get_function(f"{L.prefix}_gate_up_grouped")(
        (-(-L.I // WARPS), n), (32 * WARPS,),
        tiles + (L.x.data_ptr(), h.data_ptr(), i32(L.K), i32(L.I), i32(L.R),
                 i64(L.off["gate.packed"]), i64(L.off["gate.scale"]), i64(L.off["up.packed"]),
                 i64(L.off["up.scale"]), f32(beta), f32(beta_lin), L.rnd),
        shared_mem=smem)
    L.mod.get_function(f"{L.prefix}_down_grouped")(
        (-(-L.R // WARPS), n), (32 * WARPS,),
        tiles + (h.data_ptr(), y.data_ptr(), i32(L.I), i32(L.R), i64(L.off["down.packed"]),
                 i64(L.off["down.scale"]), L.rnd),
        shared_mem=smem)
    L.mod.get_function(COMBINE)(
        (-(-L.T * L.R // 256),), (256,),
        (y.data_ptr(), L.w.data_ptr(), L.slot_t.data_ptr(), i64(L.acc0), L.out.data_ptr(),
         i32(L.T), i32(L.K), i32(L.R)))
