"""CUDA routed-expert kernels: the grouped GEMM's host-side grouping (CPU), tools/gpu_check.py's
no-GPU exit (CPU) and, opt-in on a GPU (`-m cuda`, auto-skipped without cupy or a device),
cuda.expert_mlp vs reference.expert_mlp for every codec, decode vs grouped path, the acc keyword.

GPU geometry: R = 2112 (33 groups of 64, 66 of 32) so gate/up stage two or three 32-group chunks
with a partial last one; I = 192 (a single partial chunk for down). E = 8 experts, K = 4, so at
T = 40 each expert has about 20 pairs: full tiles of 4 and partial ones.
Tolerances (relative to the reference's RMS / max): fp32 RMS 1e-5, max 1e-4; bf16 RMS 1e-2, max
5e-2 (an fp32 reorder can flip a bf16 rounding of a gate/up/h/y element: 2^-8 each).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import expert_banks
import pytest
import torch

from mtplx_runtime.kernels import cuda, reference
from mtplx_runtime.kernels.cuda import group_pairs

ROOT = Path(__file__).resolve().parent.parent
R, I, E, K = 2112, 192, 8, 4  # latent, expert width, experts, top-k
SHAPES = {"gate": (I, R), "up": (I, R), "down": (R, I)}
CODECS = [("t158", None), ("mxfp4", None), ("ct-int", 3), ("ct-int", 4)]
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 5e-2)}  # (RMS, max) relative


# ---- CPU: host-side grouping -------------------------------------------------------------

def check_grouping(slot_t: torch.Tensor, tile: int) -> None:
    pairs, tile_slot, tile_start, tile_count = group_pairs(slot_t, tile)
    flat = slot_t.reshape(-1).long()
    assert all(t.dtype == torch.int32 for t in (pairs, tile_slot, tile_start, tile_count))
    picked = (flat >= 0).nonzero().flatten().tolist()  # slot -1: an empty pick, no tile
    assert sorted(pairs.tolist()) == picked  # a permutation of the picked pair ids
    assert torch.all(tile_count >= 1) and torch.all(tile_count <= tile)
    # tiles are back to back and cover pairs exactly once, in order
    assert tile_start.tolist() == (torch.cumsum(tile_count, 0) - tile_count).tolist()
    assert int(tile_count.sum()) == len(picked)
    for s, a, n in zip(tile_slot.tolist(), tile_start.tolist(), tile_count.tolist()):
        assert torch.all(flat[pairs[a:a + n].long()] == s)  # every pair of a tile uses its slot
    # per slot: ceil(count / tile) tiles, consecutive, pair ids ascending (stable sort)
    for s in torch.unique(flat[flat >= 0]).tolist():
        mine = (tile_slot == s).nonzero().flatten()
        count = int((flat == s).sum())
        assert len(mine) == -(-count // tile)
        assert mine.tolist() == list(range(int(mine[0]), int(mine[0]) + len(mine)))
        run = pairs[int(tile_start[mine[0]]):int(tile_start[mine[0]]) + count].tolist()
        assert run == sorted(run) == (flat == s).nonzero().flatten().tolist()


def test_group_pairs_worked_example():
    slot_t = torch.tensor([[7, 2], [2, 5], [7, 2], [2, 7], [2, 5]], dtype=torch.int32)  # [T, K]
    pairs, tile_slot, tile_start, tile_count = group_pairs(slot_t, tile=4)
    # slot 2: pairs 1 2 5 6 8 (two tiles: 4 + 1), slot 5: 3 9, slot 7: 0 4 7
    assert pairs.tolist() == [1, 2, 5, 6, 8, 3, 9, 0, 4, 7]
    assert tile_slot.tolist() == [2, 2, 5, 7]
    assert tile_start.tolist() == [0, 4, 5, 7]
    assert tile_count.tolist() == [4, 1, 2, 3]


def test_group_pairs_skips_empty_picks():
    slot_t = torch.tensor([[-1, 2], [2, -1], [-1, -1], [5, 2]], dtype=torch.int32)  # [T, K]
    pairs, tile_slot, tile_start, tile_count = group_pairs(slot_t, tile=2)
    assert pairs.tolist() == [1, 2, 7, 6]
    assert tile_slot.tolist() == [2, 2, 5] and tile_count.tolist() == [2, 1, 1]
    check_grouping(slot_t, 2)
    check_grouping(torch.full((3, 2), -1, dtype=torch.int32), 4)


@pytest.mark.parametrize("T,k,slots,tile", [(1, 16, 896, 4), (40, 4, 8, 4), (64, 16, 64, 4),
                                            (33, 3, 5, 2), (7, 2, 3, 1)])
def test_group_pairs_invariants(T, k, slots, tile):
    g = torch.Generator().manual_seed(T * 1000 + k)
    slot_t = torch.stack([torch.randperm(slots, generator=g)[:k].sort().values
                          for _ in range(T)]).to(torch.int32)
    check_grouping(slot_t, tile)


def test_gpu_check_without_gpu_exits_2_cleanly():
    if cuda.unavailable_reason() is None:
        pytest.skip("a GPU is present: run tools/gpu_check.py itself")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stdout.startswith("gpu_check: no GPU: ") and "Traceback" not in p.stderr, p.stdout


# ---- GPU: cuda vs reference ------------------------------------------------------------

def make_bank(mode, bits, seed=0):
    return expert_banks.make_bank(mode, bits, R, I, E, seed, scale=0.1)


def device_tier(layout, store):
    import cupy

    from mtplx_runtime.offload.slots import SlotTier

    slot_bytes = -(-layout.logical_bytes // 4096) * 4096
    tier = SlotTier("dev", layout.logical_bytes, E * slot_bytes, device="cuda")
    for s in range(E):
        tier.view(s)[...] = cupy.asarray(store[s])
    return tier


def routing(T, seed=1):
    """x [T, R] (fp32), ids [T, K] ascending distinct, weights [T, K] fp32."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K].sort().values for _ in range(T)])
    return torch.randn(T, R, generator=g), ids, torch.rand(T, K, generator=g)


def assert_near(got, want, dtype):
    got, want = got.detach().cpu().float(), want.detach().cpu().float()
    rms, mx = TOL[dtype]
    rel = ((got - want).norm() / want.norm()).item()
    worst = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < rms and worst < mx, f"relative RMS {rel:.2e} (< {rms}), max {worst:.2e} (< {mx})"


@pytest.fixture(scope="module")
def banks():
    if cuda.unavailable_reason() is not None:
        pytest.skip(cuda.unavailable_reason())
    return {(m, b): (lambda lay, st: (lay, st, device_tier(lay, st)))(*make_bank(m, b))
            for m, b in CODECS}


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode,bits", CODECS, ids=["t158", "mxfp4", "ctint3", "ctint4"])
def test_cuda_matches_reference(banks, mode, bits, dtype, T):
    layout, store, tier = banks[(mode, bits)]
    x, ids, w = routing(T)
    x = x.to(dtype)
    want = reference.expert_mlp(x, ids, w, {e: E - 1 - e for e in range(E)}, store, layout,
                                SHAPES)
    for slots in ((E - 1 - ids).cuda(), {e: E - 1 - e for e in range(E)}):
        got = cuda.expert_mlp(x.cuda(), ids.cuda(), w.cuda(), slots, tier, layout, SHAPES)
        assert got.dtype == dtype and got.shape == (T, R) and got.is_cuda
        assert_near(got, want, dtype)
    for path in (cuda.decode_mlp, cuda.grouped_mlp):  # both paths at every T
        got = path(x.cuda(), ids.cuda(), w.cuda(), (E - 1 - ids).cuda(), tier, layout, SHAPES)
        assert_near(got, want, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode,bits", CODECS, ids=["t158", "mxfp4", "ctint3", "ctint4"])
def test_decode_and_grouped_paths_agree(banks, mode, bits, dtype):
    """Both paths run the same FMAs in the same order per lane (lane L: groups L, L+32, ...) and
    the same combine, so they should agree to the last bit. fp32: 1e-6 leaves room for a
    compiler contracting an expression differently in one of them; bf16: such a difference can
    flip a bf16 rounding, so the reference tolerance."""
    layout, _, tier = banks[(mode, bits)]
    x, ids, w = routing(40, seed=2)
    args = (x.to(dtype).cuda(), ids.cuda(), w.cuda(), (E - 1 - ids).cuda(), tier, layout, SHAPES)
    zero = torch.zeros(40, R, device="cuda")
    a = cuda.decode_mlp(*args, acc=zero.clone())
    b = cuda.grouped_mlp(*args, acc=zero.clone())
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * a.abs().max().item())
    else:
        assert_near(b, a, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_acc_keyword(banks, dtype, T):
    layout, store, tier = banks[("mxfp4", None)]
    x, ids, w = routing(T, seed=3)
    args = (x.to(dtype).cuda(), ids.cuda(), w.cuda(), (E - 1 - ids).cuda(), tier, layout, SHAPES)
    routed = cuda.expert_mlp(*args, acc=torch.zeros(T, R, device="cuda"))  # fp32 sum from 0
    assert routed.dtype == torch.float32
    want = reference.expert_mlp(x.to(dtype), ids, w, (E - 1 - ids), store, layout, SHAPES)
    assert_near(routed, want, dtype)
    acc0 = torch.randn(T, R, generator=torch.Generator().manual_seed(4)) * 10
    acc = acc0.cuda()
    got = cuda.expert_mlp(*args, acc=acc)
    assert got is acc and got.dtype == torch.float32  # written in place, returned un-cast
    # Same contract as the reference: the sum starts from acc0, then adds k ascending.
    want = reference.expert_mlp(x.to(dtype), ids, w, (E - 1 - ids), store, layout, SHAPES,
                                acc=acc0.clone())
    assert_near(got - acc0.cuda(), want - acc0, dtype)  # the routed part, at its own scale
    if dtype == torch.float32:  # bf16: a flipped y rounding is within assert_near, not this
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5,
                                   atol=1e-5 * want.abs().max().item())


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 40])
def test_windows_of_experts_with_empty_picks(banks, T):
    """The streaming provider's windows: picks outside a window are -1 (skipped); two windows
    summed through acc equal one call (decode and grouped paths alike)."""
    layout, store, tier = banks[("t158", None)]
    x, ids, w = routing(T, seed=5)
    slots = {e: E - 1 - e for e in range(E)}
    full = cuda.expert_mlp(x.cuda(), ids.cuda(), w.cuda(), slots, tier, layout, SHAPES,
                           acc=torch.zeros(T, R, device="cuda"))
    for run in (cuda.decode_mlp, cuda.grouped_mlp):
        acc = torch.zeros(T, R, device="cuda")
        for lo, hi in ((0, E // 2), (E // 2, E)):
            part = torch.where((ids >= lo) & (ids < hi), ids, -1)
            run(x.cuda(), part.cuda(), w.cuda(), slots, tier, layout, SHAPES, acc=acc)
        torch.testing.assert_close(acc, full, rtol=1e-6, atol=1e-6 * full.abs().max().item())
