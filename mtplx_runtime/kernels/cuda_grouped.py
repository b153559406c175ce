"""Grouped GEMM for prefill chunks: the host half of native/grouped.cuh.

The T*K (token, k) pairs are sorted by slot so that each expert's pairs are contiguous, and
each expert's run is cut into tiles of at most TILE pairs. A block of `{codec}_gate_up_grouped`
/ `{codec}_down_grouped` handles one (row block, tile): it decodes each weight of its rows once
and applies it to every pair of the tile, instead of once per pair as the decode GEMV does.

    x [T, R] --gate_up_grouped--> h [T*K, I] --down_grouped--> y [T*K, R]
      --mtplx_combine (acc or 0, then + weights[t, k] * y[t*K + k] for k ascending)--> out [T, R]

Pair id p = t * K + k (row-major [T, K]). Shape legend as in cuda.py.
"""

from __future__ import annotations

import numpy as np
import torch

from .cuda import COMBINE, WARPS, Launch

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


def launch(L: Launch, beta: float, beta_lin: float) -> None:
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
